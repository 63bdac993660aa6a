"""Host CPU cost of saving a sharded state: CheckpointManager's sharded format (DCP, async; what format="auto"
picks for it) vs its one-file format (format="file").

    CPU_NUM_DEVICES=8 python bench/bench_sharded_checkpoint.py [--repeats 3]

The state: ResNet-50 weights + SGD momentum (~204 MB in float32) on XLA:CPU under SPMD, every
tensor whose first dimension divides by the device count split on it over a 1-D mesh (the rest
replicated), as FSDP lays it out. For each manager: process CPU-seconds (time.process_time, every
thread: staging, serialising, crc32c, writing) per GB of state, from save() until the save is
committed; the seconds save() blocks the caller; and the wall seconds until committed. Medians of
--repeats saves to a local folder (the page cache: what is measured is the host's work, not a disk).
The one-file format gathers each sharded tensor whole (one batched transfer) and torch.saves one
object; the sharded save moves only the shards (each piece once) and lets DCP write them.
"""

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")

import torch  # noqa: E402
import torchvision  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

import labkit  # noqa: E402
from labkit.checkpoint import CheckpointManager  # noqa: E402
from labkit.checkpoint.sharded import is_sharded  # noqa: E402


def sharded_state(n):
    import torch_xla
    import torch_xla.distributed.spmd as xs

    from labkit.spmd.mesh import make_mesh

    device = torch_xla.device()
    model = torchvision.models.resnet50(num_classes=1000).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    mesh = make_mesh(None, ("fsdp",))
    for p in model.parameters():
        opt.state[p]["momentum_buffer"] = torch.randn_like(p) * 1e-3
        if p.dim() and p.shape[0] % n == 0:
            spec = ("fsdp",) + (None,) * (p.dim() - 1)
            xs.mark_sharding(p, mesh, spec)
            xs.mark_sharding(opt.state[p]["momentum_buffer"], mesh, spec)
    torch_xla.sync()
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def measure(make, state, repeats):
    out = []
    for i in range(repeats):
        root = tempfile.mkdtemp(prefix="bench-sckpt-")
        m = make(root)
        c0, w0 = time.process_time(), time.perf_counter()
        m.save(i + 1, state)
        blocked = time.perf_counter() - w0
        m.wait()
        out.append((time.process_time() - c0, blocked, time.perf_counter() - w0))
        m.close()
    return [statistics.median(x) for x in zip(*out)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    n = int(os.environ["CPU_NUM_DEVICES"])
    labkit.setup("xla-cpu", spmd=n > 1)
    state = sharded_state(n)
    gb = sum(t.numel() * t.element_size() for t in tree_leaves(state) if torch.is_tensor(t)) / 1e9
    print(f"state: ResNet-50 + SGD momentum, {gb * 1e3:.0f} MB, sharded over {n} devices: {is_sharded(state)}")
    rows = {
        "CheckpointManager format=file (gather + torch.save, async)": lambda r: CheckpointManager(
            r, keep=1, best_metric=None, format="file"
        ),
        "CheckpointManager format=auto (sharded: DCP, async)": lambda r: CheckpointManager(r, keep=1, best_metric=None),
    }
    res = {}
    for name, make in rows.items():
        measure(make, state, 1)  # warm: first transfers, imports
        cpu, blocked, wall = measure(make, state, a.repeats)
        res[name] = cpu / gb
        print(f"{name:48s} {cpu / gb:6.2f} CPU-s/GB   save() blocks {blocked:5.2f} s   committed after {wall:5.2f} s")
    a_, b_ = res.values()
    print(f"ratio sharded / one file CPU-s per GB: {b_ / a_:.2f}")


if __name__ == "__main__":
    main()
