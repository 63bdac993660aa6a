"""Run under torchrun (gloo): labkit's LMTrainer on a tiny GPT under TrainConfig.parallel, for tests/test_fsdp_trainer.py.

    python -m torch.distributed.run --standalone --nproc-per-node 4 tests/children/fsdp_trainer.py JOB.json

JOB.json: {"out": path, "runs": [{"name", "parallel", "accum_steps", "merge", "steps", "stop_at", "ckpt",
"checkpoint_every", "resume", "count", "compile", "n_embd"}, ...]}. Every run trains the same data: `steps` optimizer
steps of a global batch of GLOBAL rows, split over the processes (each rank its rows of every micro-batch). merge=True
feeds each rank its k micro-batches as one batch (accum_steps=1): the k-times larger batch, row for row the same.
Process 0 writes {name: {"losses": [per-step loss of process 0], "comm": {op: count per optimizer step}, ...}}.
"""

import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

import labkit
from labkit.checkpoint import CheckpointManager
from labkit.lm import LMTrainer
from labkit.models.gpt import GPT, GPTConfig, adamw
from labkit.spmd import dtensor_plans as D

GLOBAL, BLOCK, MICRO = 16, 16, 4  # rows per micro-batch over all processes, tokens per row, micro-batches kept


class Rows:
    """Each rank's rows of a fixed list of global micro-batches; `merge` consecutive ones joined into one batch."""

    def __init__(self, text, rank, world, merge=1):
        self.text, self.rank, self.world, self.merge = text, rank, world, merge
        self.batch_size = GLOBAL // world * merge
        self.dataset = list(range(len(text) * GLOBAL))  # the position checks count samples against it

    def __len__(self):
        return len(self.text) // self.merge

    def set_epoch(self, epoch):
        pass

    def __iter__(self):
        each = GLOBAL // self.world
        for i in range(len(self)):
            rows = [
                t[self.rank * each : (self.rank + 1) * each] for t in self.text[i * self.merge : (i + 1) * self.merge]
            ]
            t = torch.cat(rows)
            yield t[:, :-1].contiguous(), t[:, 1:].contiguous()


class GlobalLoss(LMTrainer):
    """Records each micro-batch's loss averaged over the processes (one all-reduce, outside the counted runs): a
    process's own loss depends on which rows it holds, which changes with the number of processes."""

    global_losses: list

    def train_step(self, batch):
        loss = super().train_step(batch)
        if self.global_losses is not None:
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            self.global_losses.append(mean.item() / self.rt.world_size)
        return loss


def run(rt, spec, steps_total):
    k = spec.get("accum_steps", 1)
    merge = k if spec.get("merge") else 1
    g = torch.Generator().manual_seed(1)
    text = torch.randint(0, 8, (steps_total * MICRO, GLOBAL, BLOCK + 1), generator=g)  # 8 symbols: the loss falls
    text = text[: spec["steps"] * k]  # k micro-batches per optimizer step, merged or not
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=BLOCK, n_layer=2, n_head=2, n_embd=spec.get("n_embd", 32), dropout=0.0))
    opt = adamw(model, 1e-2, rt=rt)
    cfg = labkit.TrainConfig(
        epochs=1,
        max_steps=spec.get("stop_at", spec["steps"]),
        log_every=1,
        eval_every=0,
        clip_norm=1.0,
        accum_steps=1 if merge > 1 else k,
        parallel=spec["parallel"],
        checkpoint_every=spec.get("checkpoint_every", 0),
        resume=spec.get("resume", False),
        compile=spec.get("compile", "off"),
        compile_backend=spec.get("compile_backend", "inductor"),
    )
    ckpt = CheckpointManager(spec["ckpt"], keep=2, rt=rt, async_save=False) if spec.get("ckpt") else None
    loader = Rows(text, rt.ordinal, rt.world_size, merge)
    trainer = GlobalLoss(model, opt, rt, cfg, loader, checkpoint=ckpt)
    mode = D.collective_counter() if spec.get("count") else None
    trainer.global_losses = None if mode is not None else []
    t0 = time.perf_counter()
    if mode is not None:
        with mode:
            trainer.fit()
    else:
        trainer.fit()
    seconds = time.perf_counter() - t0
    if ckpt is not None:
        ckpt.close()
    params = {n: p for n, p in trainer.module.named_parameters()}
    mine = sum(D.local(p).numel() * p.element_size() for p in params.values())
    state = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    opt_mine = sum(D.local(v).numel() * v.element_size() for v in state)
    done = trainer.step - (trainer.history[0]["step"] - 1 if trainer.history else 0)
    out = {
        "plan": trainer.plan.describe(),
        "losses": [r["loss"] for r in trainer.history],  # process 0's
        "global_losses": trainer.global_losses,  # per micro-batch, the mean over the processes
        "first_step": trainer.history[0]["step"] if trainer.history else None,
        "seconds": round(seconds, 2),
        "param_bytes": mine,
        "opt_bytes": opt_mine,
        "full_param_bytes": sum(p.numel() * p.element_size() for p in params.values()),
        "placements": sorted({D.placement(p) for p in params.values()}),
        "keys": sorted(trainer.module.state_dict())[:3],
    }
    if mode is not None:
        out["comm"] = {op: v["count"] / done for op, v in D.comm_counts(mode).items()}
    return out


def main():
    with open(sys.argv[1]) as f:
        job = json.load(f)
    rt = labkit.setup("cpu")  # under torchrun: one gloo process per rank
    steps_total = max(r["steps"] for r in job["runs"])
    report = {}
    for spec in job["runs"]:
        try:
            report[spec["name"]] = run(rt, spec, steps_total)
        except Exception as e:  # a refusal a test expects: its message, on every rank alike
            report[spec["name"]] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        dist.barrier()
    if rt.is_master:
        with open(job["out"], "w") as f:
            json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
