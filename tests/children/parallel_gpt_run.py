"""Run in a subprocess (SPMD and the HLO dump must be set before torch_xla starts): a 1-layer GPT trained
four ways on 8 virtual CPU devices; prints one line per check for tests/test_parallel_gpt.py."""

import atexit
import os
import shutil
import sys
import tempfile

os.environ["PJRT_DEVICE"] = "CPU"
os.environ["CPU_NUM_DEVICES"] = "8"
DUMP = tempfile.mkdtemp(prefix="hlo-")
atexit.register(shutil.rmtree, DUMP, True)  # ~60 MB of HLO text a run
os.environ["XLA_FLAGS"] = f"--xla_dump_to={DUMP} --xla_dump_hlo_as_text"

import torch  # noqa: E402

import labkit  # noqa: E402
from labkit.lessons import parallel_gpt as PG  # noqa: E402
from labkit.models.gpt import GPTConfig  # noqa: E402
from labkit.spmd import sharding as S  # noqa: E402

rt = labkit.setup("xla-cpu", spmd=True)
cfg = GPTConfig(block_size=16, n_layer=1, n_head=4, n_embd=32)
g = torch.Generator().manual_seed(0)
text = torch.randint(0, 8, (4, 16, 17), generator=g)  # 8 symbols: the loss can fall below ln 256 in 4 steps
batches = [(t[:, :-1], t[:, 1:]) for t in text]
res = {s: PG.train(PG.Strategy(s), cfg, batches, lr=3e-2, dump_dir=DUMP) for s in PG.STRATEGIES}
single, data, tensor, fsdp = res["single"], res["data"], res["tensor"], res["fsdp"]
ok = True


def check(name, cond, detail):
    global ok
    ok &= bool(cond)
    print("CHECK", name, "OK" if cond else "FAIL", detail, flush=True)


check("loss falls", single.losses[-1] < single.losses[0] - 0.2, single.losses)
for s in ("data", "tensor", "fsdp"):
    diff = max(abs(a - b) for a, b in zip(res[s].losses, single.losses))
    check(f"{s} losses match single", diff < 1e-4, diff)
# XLA may add collectives to the first-principles prediction (explained in notebook 03), never fewer
for name, run, pred in (
    ("dp", data, S.predict_data_parallel(cfg, 16)),
    ("tp", tensor, S.predict_tensor_parallel(cfg, 16, 4, 2)),
):
    extra = S.extra_collectives(pred, run.collectives)
    check(f"{name} collectives >= prediction", all(d["bytes"] >= 0 for d in extra.values()), extra)
check("fsdp params per device", fsdp.param_bytes == single.param_bytes // 8, (fsdp.param_bytes, single.param_bytes))
check("fsdp adam per device", fsdp.opt_bytes == 2 * fsdp.param_bytes, fsdp.opt_bytes)
check("dp replicated", data.param_bytes == single.param_bytes and not single.collectives, data.param_bytes)
sys.exit(0 if ok else 1)
