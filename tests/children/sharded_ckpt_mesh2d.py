"""Run in a subprocess (8 virtual devices, SPMD) for tests/test_sharded_checkpoint.py: tensors laid out
on a 2x4 ("data", "model") mesh (tiles replicated over "data", a shape that does not divide evenly, a
2-D split) saved and restored onto other layouts of a 1-D mesh. Prints RESULT and exits 1 on a mismatch."""

import atexit
import os
import shutil
import sys
import tempfile

os.environ["PJRT_DEVICE"] = "CPU"
os.environ["CPU_NUM_DEVICES"] = "8"

import torch  # noqa: E402

import labkit  # noqa: E402
from labkit.checkpoint.sharded import ShardedCheckpointManager, is_sharded  # noqa: E402
from labkit.spmd.mesh import make_mesh  # noqa: E402

labkit.setup("xla-cpu", spmd=True)
import torch_xla  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402

dev = torch_xla.device()
g = torch.Generator().manual_seed(0)
ref = {"a": torch.randn(8, 6, generator=g), "b": torch.randn(10, 3, generator=g), "c": torch.randn(6, 12, generator=g)}
saved = {k: v.to(dev) for k, v in ref.items()}
m2 = make_mesh((2, 4), ("data", "model"))
xs.mark_sharding(saved["a"], m2, ("model", None))  # each tile on 2 devices
xs.mark_sharding(saved["b"], m2, ("model", None))  # 10 rows over 4: padded tiles
xs.mark_sharding(saved["c"], m2, ("data", "model"))
root = tempfile.mkdtemp(prefix="mesh2d-")
atexit.register(shutil.rmtree, root, True)
ck = ShardedCheckpointManager(root)
ck.save(1, saved)
ck.close()

m1 = make_mesh(None, ("fsdp",))
target = {k: torch.zeros_like(v).to(dev) for k, v in ref.items()}
xs.mark_sharding(target["a"], m1, (None, None))  # replicated
xs.mark_sharding(target["b"], m1, ("fsdp", None))
xs.mark_sharding(target["c"], m1, (None, "fsdp"))
torch_xla.sync()
ShardedCheckpointManager(root).restore(target)
same = {k: torch.equal(target[k].cpu(), ref[k]) for k in ref}
print("RESULT", same, is_sharded(saved), flush=True)
sys.exit(0 if all(same.values()) and is_sharded(saved) else 1)
