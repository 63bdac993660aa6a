"""Run under torchrun by tests/test_dcp_agreement.py: FSDP2 on a tiny GPT (labkit.lessons.fsdp_trainer's data and
model), with a CheckpointManager each run configures.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/children/dcp_agreement.py JOB.json

JOB.json: {"out": PATH, "runs": [...]}, each run a dict, in order:
- {"name", "flip": PATH}: process 0 flips one byte in the middle of PATH (a committed shard), then all go on.
- {"name", "steps", "stop_at", "checkpoint_every", "ckpt", "resume", "async", "keep", "per_rank_root", "delay",
  "progress", "step_sleep"}: one fit(). per_rank_root: process r saves under CKPT-r (what a local folder on each host
  is). delay: seconds the save waits in its writer thread before the commit (a slow store). Reported: "global_losses",
  "first_step", "restored" (every process's restored step), "warnings" (process 0's checkpoint warnings), "stalls"
  (process 0's seconds in each save() on the training thread), "waits" (process 0's seconds in each wait for the
  previous save: part of a stall, then the close), "ends", "times" (process 0's time.time() when fit() returned and
  when the save had finished), or "error".
"""

import json
import os
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist

import labkit
from labkit.checkpoint import CheckpointManager
from labkit.interrupts import Preempted
from labkit.lessons.fsdp_trainer import GlobalLoss, Progress, Rows, gpt_config
from labkit.models.gpt import GPT, adamw


def flip(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def run(rt, spec):
    g = torch.Generator().manual_seed(1)
    text = torch.randint(0, 8, (spec["steps"], 16, 17), generator=g)
    torch.manual_seed(0)
    model = GPT(gpt_config(spec.get("n_embd", 32)))
    opt = adamw(model, 1e-2, rt=rt)
    cfg = labkit.TrainConfig(
        epochs=1,
        max_steps=spec.get("stop_at", spec["steps"]),
        log_every=1,
        eval_every=0,
        clip_norm=1.0,
        parallel="fsdp2",
        checkpoint_every=spec.get("checkpoint_every", 0),
        resume=spec.get("resume", False),
    )
    root = spec["ckpt"] + (f"-{rt.ordinal}" if spec.get("per_rank_root") else "")
    ckpt = CheckpointManager(root, keep=spec.get("keep", 3), rt=rt, async_save=spec.get("async", True))
    if spec.get("delay"):
        ckpt.writer.on_stage = lambda step, path: time.sleep(spec["delay"])  # in the writer thread, before the commit
    stalls, save = [], ckpt.save

    def timed_save(*a, **k):  # the training thread's time in each save
        t0 = time.perf_counter()
        try:
            return save(*a, **k)
        finally:
            stalls.append(round(time.perf_counter() - t0, 4))

    ckpt.save = timed_save
    waits, wait = [], ckpt.writer.wait

    def timed_wait():  # the part of a stall spent waiting for the previous save (at most one in flight)
        t0 = time.perf_counter()
        try:
            return wait()
        finally:
            waits.append(round(time.perf_counter() - t0, 4))

    ckpt.writer.wait = timed_wait
    progress = [Progress(spec["progress"], rt.ordinal, spec.get("step_sleep", 0.0))] if spec.get("progress") else []
    trainer = GlobalLoss(
        model, opt, rt, cfg, Rows(text, rt.ordinal, rt.world_size), checkpoint=ckpt, callbacks=progress
    )
    trainer.global_losses = []
    preempted = False
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            trainer.fit()
        except Preempted:
            preempted = True
        stopped = time.time()
        ckpt.close()
        closed = time.time()
    restored = [None] * rt.world_size
    dist.all_gather_object(restored, (ckpt.restored or {}).get("step"))
    ends = [None] * rt.world_size
    dist.all_gather_object(ends, [trainer.step, preempted])
    return {
        "global_losses": trainer.global_losses,
        "first_step": trainer.history[0]["step"] if trainer.history else None,
        "restored": restored,
        "warnings": [str(w.message) for w in said if "step-" in str(w.message)],
        "stalls": stalls,
        "waits": waits,
        "ends": ends,
        "times": {"stopped": stopped, "closed": closed},  # process 0's: fit() returned, the pending save finished
    }


def main():
    with open(sys.argv[1]) as f:
        job = json.load(f)
    rt = labkit.setup("cpu")  # under torchrun: one gloo process per rank
    report = {}
    for spec in job["runs"]:
        if "flip" in spec:
            if rt.is_master:
                flip(spec["flip"])
            dist.barrier()
            continue
        try:
            report[spec["name"]] = run(rt, spec)
        except Exception as e:
            report[spec["name"]] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
        dist.barrier()
        if rt.is_master:  # after each run: a test that stops the launch still finds what finished
            with open(job["out"], "w") as f:
                json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
