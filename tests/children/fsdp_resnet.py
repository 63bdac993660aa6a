"""Run under torchrun (2 gloo processes) by tests/test_fsdp_resnet.py: the Trainer under fsdp2 on torchvision's
ResNet-18 (BatchNorm), the runs a GPU node takes next. Process 0 writes OUT (JSON) with one entry per run:

- "bf16": fsdp2 with a bf16 precision trains 3 steps (BatchNorm in float32 units), then evaluates over shares that
  do not divide (process 0 three batches, process 1 two); the BatchNorm buffers of both processes after it.
  Its collectives per optimizer step on the plan's mesh, counted ("comm": {op: [count, bytes]}).
- "bf16_k2": the same 3 steps, each of 2 micro-batches accumulated gathered: its collectives per optimizer step.
- "fp32": the same in float32; then process 0 evaluates a plain copy of the trained model (the whole state gathered)
  over all five batches: the metrics one process gives over the whole set.
- "rng": each process seeded differently; saved with DCP; a new Trainer resumed from it: each process's torch RNG
  state as saved, and the checkpoint's rng_by_process.
- "nan": process 1's second batch is NaN: what each process raised, and at which step.
- "layout": fsdp2 and replicate (DDP) in channels_last and in contiguous NCHW, 3 steps in float32 each: the losses,
  whether each step's batch and the first conv's weight were channels_last (DDP keeps the weights' format; FSDP2's
  gathered weights are contiguous, the batch carries the format).
- "folder": labkit.train.run_folder with process 1's clock 1.5 s behind process 0's: the folder each one got.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/children/fsdp_resnet.py OUT CKPT_DIR
"""

import json
import sys
import traceback

import torch
import torch.distributed as dist
import torchvision

import labkit
from labkit.checkpoint import CheckpointManager
from labkit.precision import Precision

BATCH, SIDE, CLASSES = 4, 16, 10


def batches(n, seed, nan_at=None):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        x = torch.randn(BATCH, 3, SIDE, SIDE, generator=g)
        if i == nan_at:
            x[:] = float("nan")
        out.append((x, torch.randint(0, CLASSES, (BATCH,), generator=g)))
    return out


class Listed(list):
    batch_size = BATCH

    def set_epoch(self, epoch):
        pass


def trainer(
    rt, precision, steps, train=None, val=None, ckpt=None, resume=False, accum_steps=1, cls=labkit.Trainer, **kw
):
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=CLASSES)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    kw.setdefault("parallel", "fsdp2")
    if kw["parallel"] == "fsdp2":
        kw.setdefault("fsdp_accumulate", "gathered")
    cfg = labkit.TrainConfig(
        epochs=1,
        max_steps=steps,
        log_every=1,
        eval_every=0,
        resume=resume,
        checkpoint_every=0,
        accum_steps=accum_steps,
        **kw,
    )
    train = Listed(train if train is not None else batches(steps * accum_steps, 10 + rt.ordinal))
    return cls(model, opt, rt, cfg, train, Listed(val or []), checkpoint=ckpt, precision=precision)


class Watched(labkit.Trainer):
    """Notes, at each step, whether the batch and the first convolution's weight are channels_last."""

    seen: list

    def train_step(self, batch):
        cl = torch.channels_last
        w = self.module.conv1.weight
        w = w.full_tensor() if hasattr(w, "full_tensor") else w  # FSDP2 between steps: the shard
        self.seen = getattr(self, "seen", []) + [
            [batch[0].is_contiguous(memory_format=cl), w.is_contiguous(memory_format=cl)]
        ]
        return super().train_step(batch)


def run_layout(rt):
    out = {}
    for parallel in ("fsdp2", "replicate"):
        for fmt in ("channels_last", "contiguous"):
            t = trainer(rt, None, 3, cls=Watched, parallel=parallel, memory_format=fmt)
            t.fit()
            out[f"{parallel} {fmt}"] = {"losses": [r["loss"] for r in t.history], "seen": t.seen}
    return out


def val_shares(rt):
    every = batches(5, 99)  # five batches: 3 for process 0, 2 for process 1
    return every, (every[:3] if rt.ordinal == 0 else every[3:])


def counted_fit(t) -> dict:
    """fit(), its collectives on the plan's mesh counted: {op: [count, bytes] per optimizer step}."""
    from labkit.parallel import collective_counter, comm_by_dim

    with collective_counter() as mode:
        t.fit()
    mine = comm_by_dim(mode, t.plan.mesh).get("fsdp", {})
    return {op: [c / t.step, b / t.step] for op, (c, b) in mine.items()}


def run_k2(rt):
    t = trainer(rt, Precision("bf16", "cpu", "test: bf16 under fsdp2"), 3, accum_steps=2)
    comm = counted_fit(t)
    return {"plan": t.plan.describe(), "comm": comm, "losses": [r["loss"] for r in t.history]}


def run_eval(rt, name):
    prec = Precision("bf16", "cpu", "test: bf16 under fsdp2") if name == "bf16" else None
    every, mine = val_shares(rt)
    t = trainer(rt, prec, 3, val=mine)
    comm = counted_fit(t)
    metrics = t.evaluate()
    buffers = torch.cat([t.module.bn1.running_mean, t.module.layer4[1].bn2.running_var])
    seen = [None] * rt.world_size
    dist.all_gather_object(seen, buffers.tolist())
    out = {
        "plan": t.plan.describe(),
        "losses": [r["loss"] for r in t.history],
        "val": metrics,
        "buffers_equal": all(s == seen[0] for s in seen),
        "bn_weight_dtype": str(t.module.bn1.weight.dtype),
        "comm": comm,
    }
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(t.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rt.is_master and name == "fp32":  # one process over the whole set, the same weights and statistics
        plain = torchvision.models.resnet18(num_classes=CLASSES)
        plain.load_state_dict(full)
        plain.eval()
        loss = correct = count = 0.0
        with torch.no_grad():
            for x, y in every:
                logits = plain(x)
                loss += float(torch.nn.functional.cross_entropy(logits, y, reduction="sum"))
                correct += float((logits.argmax(-1) == y).sum())
                count += len(y)
        out["one_process"] = {"val_loss": loss / count, "val_acc": correct / count}
    return out


def run_rng(rt, ckpt_dir):
    ck = CheckpointManager(ckpt_dir, keep=1, rt=rt, async_save=False)
    torch.manual_seed(1000 + rt.ordinal)  # each process its own stream (as dropout under torchrun draws)
    t = trainer(rt, None, 2, ckpt=ck)
    torch.manual_seed(1000 + rt.ordinal)
    t.fit()  # saves at the epoch end (step 2)
    ck.close()
    state = t.state_dict()
    at_save = state["rng_by_process"][f"process{rt.ordinal}"]["torch"]
    torch.manual_seed(7)  # anything: the resume must put back this process's own state
    ck2 = CheckpointManager(ckpt_dir, keep=1, rt=rt, async_save=False)
    t2 = trainer(rt, None, 2, ckpt=ck2, resume=True)
    t2.fit()  # restores step 2, trains nothing more
    ck2.close()
    after = torch.get_rng_state()
    mine = [None] * rt.world_size
    dist.all_gather_object(mine, [bool(torch.equal(after, at_save)), at_save[:64].tolist()])
    return {"restored_own": [m[0] for m in mine], "differ": mine[0][1] != mine[1][1], "step": t2.step}


def run_nan(rt):
    t = trainer(rt, None, 4, train=batches(4, 10 + rt.ordinal, nan_at=1 if rt.ordinal == 1 else None))
    try:
        t.fit()
        raised = None
    except FloatingPointError as e:
        raised = str(e)
    seen = [None] * rt.world_size
    dist.all_gather_object(seen, [raised, t.step])
    return {"raised": [s[0] for s in seen], "steps": [s[1] for s in seen]}


def run_folder(rt, root):
    import time

    from labkit.train import run_folder

    if rt.ordinal == 1:
        time.sleep(1.5)  # another second on this process's clock: its own strftime would name another folder
    name = run_folder(rt, root, None)
    seen = [None] * rt.world_size
    dist.all_gather_object(seen, name)
    return {"folders": seen}


def main():
    out, ckpt_dir = sys.argv[1], sys.argv[2]
    rt = labkit.setup("cpu")
    report = {}
    for name, fn in [
        ("bf16", lambda: run_eval(rt, "bf16")),
        ("bf16_k2", lambda: run_k2(rt)),
        ("fp32", lambda: run_eval(rt, "fp32")),
        ("rng", lambda: run_rng(rt, ckpt_dir)),
        ("nan", lambda: run_nan(rt)),
        ("folder", lambda: run_folder(rt, ckpt_dir + "-runs")),
        ("layout", lambda: run_layout(rt)),
    ]:
        try:
            report[name] = fn()
        except Exception as e:
            report[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
        rt.rendezvous(name)
    if rt.is_master:
        with open(out, "w") as f:
            json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
