"""The FSDP2 Trainer step ÷ a hand-written fully_shard loop doing the same work, on torchrun's processes (gloo on the
CPU, nccl on GPUs); then what labkit adds per step under torchrun: the StepVote and a checkpoint save's stall.

    .venv/bin/python bench/bench_fsdp.py [--processes 2] [--trials 9] [--steps 20] [--accum 1] [--bf16]
                                         [--accum-mode gathered|sharded]

Starts `python -m torch.distributed.run --standalone --nproc-per-node N` of itself (default 2: the 2-core CPU this
was written on; a default run took 101 s there at load average 14). In every process, two loops on the same GPT
(--layers 2, --width 128, T=64, --rows 8 per process), the same initial weights, batches and AdamW, clip_norm 1.0,
compile off (torch.compile is bench_compile.py's). Batches are built on the CPU for both and moved inside each step:
- labkit: LMTrainer(..., TrainConfig(parallel="fsdp2", accum_steps=k)), fed through its DeviceLoader; --bf16 gives
  it Precision("bf16", device type, ...) directly (labkit.precision.choose refuses bf16 on the CPU);
- by hand: fully_shard per block, then the root (MixedPrecisionPolicy(bf16 params, fp32 reduce) under --bf16);
  per optimizer step k micro-batches, each .to(device, non_blocking=True), forward under the same autocast, backward
  of loss / k, with FullyShard.gradient_sync's calls (no gradient sync and no reshard on all but the last);
  clip_grad_norm_, opt.step(), zero_grad; the loss read every 20 steps and at each trial's end (labkit's log does).
Each loop warms up (2 steps), then `--trials` rounds alternate which loop goes first; a trial is `--steps` optimizer
steps timed on process 0 between barriers (after a device sync). Printed: ms/step per trial, the median of the
per-round ratios labkit ÷ by hand with their min-max (goal ≤ 1.02: the kit costs at most 2 % over the loop it
wraps; the min-max is the machine's noise, the median what to compare), and the collectives of one optimizer step
of each loop (labkit.parallel.collective_counter; they must be equal, the vote's being left out by design).

Then, after the trials (so they do not disturb them): the vote, StepVote(rt).cast() --votes times between barriers on
every process (one all_reduce of two int32, every optimizer step in labkit's loop, already inside its ms/step above),
in µs per step and as a share of labkit's median step; and the save: CheckpointManager(tmp, rt=rt, keep=1).save(step,
trainer.state_dict(), force=True), 3 times, the seconds the training thread is held in save() (the slowest process;
under FSDP2 every process writes its shards before save() returns) and as steps' worth of labkit's median step.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def child(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import labkit
    from labkit.checkpoint import CheckpointManager
    from labkit.interrupts import StepVote
    from labkit.lm import LMTrainer
    from labkit.models.gpt import GPT, GPTConfig, adamw
    from labkit.parallel import collective_counter
    from labkit.precision import Precision
    from labkit.spmd.dtensor_plans import comm_counts

    rt = labkit.setup()
    k, dev = args.accum, rt.device
    cfg = GPTConfig(block_size=64, n_layer=args.layers, n_head=4, n_embd=args.width, dropout=0.0)
    g = torch.Generator().manual_seed(rt.ordinal)  # each process its own rows, as a sampler gives them
    n_batches = 2 * (2 + args.count + args.trials * args.steps) * k  # both loops: warm-up, count, trials
    text = torch.randint(0, 256, (n_batches, args.rows, cfg.block_size + 1), generator=g)
    batches = [(t[:, :-1].clone(), t[:, 1:].clone()) for t in text]  # on the CPU: each loop moves its own
    prec = Precision("bf16", dev.type, "bench: bf16 asked") if args.bf16 else None
    autocast = prec.autocast if prec is not None else contextlib.nullcontext

    def sync():  # the device's queue drained, then every process here
        if dev.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()

    torch.manual_seed(0)
    model = GPT(cfg)
    tc = labkit.TrainConfig(epochs=1, log_every=20, eval_every=0, clip_norm=1.0, parallel="fsdp2", accum_steps=k)
    tc = dataclasses.replace(tc, compile="off", fsdp_accumulate=args.accum_mode)  # checked again
    trainer = LMTrainer(model, adamw(model, 1e-3, rt=rt), rt, tc, batches[:k], precision=prec)

    def labkit_run(chunk):  # one fit() per chunk: an epoch of len(chunk) // k steps, the step counter going on
        trainer.train_loader = trainer._wrap(chunk)
        trainer.epoch = trainer.batch_in_epoch = 0
        trainer._step_offset = trainer.step
        trainer.fit()

    torch.manual_seed(0)
    hand = GPT(cfg).to(dev)
    mesh = init_device_mesh(dev.type, (rt.world_size,))
    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if prec else {}
    last = len(hand.blocks) - 1
    for i, block in enumerate(hand.blocks):  # labkit's policy (torchtitan's): the last block stays gathered
        fully_shard(block, mesh=mesh, reshard_after_forward=i < last, **kw)
    root = fully_shard(hand, mesh=mesh, **kw)
    opt = adamw(hand, 1e-3, rt=rt)
    losses = []

    def gradient_sync(enabled):  # labkit.parallel.FullyShard.gradient_sync, call for call
        if args.accum_mode == "sharded":  # every micro-batch reduce-scatters: torch's defaults
            return
        root.set_requires_gradient_sync(enabled)
        root.set_reshard_after_backward(enabled)
        for i, block in enumerate(hand.blocks):
            block.set_reshard_after_forward(enabled and i < last, recurse=False)

    def hand_run(chunk):
        for i in range(0, len(chunk) - k + 1, k):
            micro = []
            for j, (x, y) in enumerate(chunk[i : i + k]):
                gradient_sync(j == k - 1)
                x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
                with autocast():
                    _, loss = hand(x, y)
                (loss / k if k > 1 else loss).backward()
                micro.append(loss.detach())
            torch.nn.utils.clip_grad_norm_([p for p in hand.parameters() if p.grad is not None], 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(micro[0] if k == 1 else torch.stack(micro).mean())
            if len(losses) == 20 or i + k >= len(chunk):  # labkit's log: every 20 steps and at the fit's end
                torch.stack(losses).sum().item()
                losses.clear()

    loops = {"labkit": labkit_run, "by hand": hand_run}
    at = 0

    def take(steps):
        nonlocal at
        at += steps * k
        return batches[at - steps * k : at]

    for run in loops.values():
        run(take(1))  # warm-up: FSDP2's lazy init, AdamW's state, the loader's first pass
    for run in loops.values():
        run(take(1))
    counts = {}
    for name, run in loops.items():  # the collectives of --count optimizer steps, counted once
        with collective_counter() as mode:
            run(take(args.count))
        counts[name] = {op: v["count"] / args.count for op, v in sorted(comm_counts(mode).items())}
    times: dict[str, list] = {name: [] for name in loops}
    for trial in range(args.trials):
        for name in list(loops) if trial % 2 == 0 else list(reversed(loops)):
            chunk = take(args.steps)
            sync()
            t0 = time.perf_counter()
            loops[name](chunk)
            sync()
            times[name].append((time.perf_counter() - t0) / args.steps)
    step_s = statistics.median(times["labkit"])

    vote = StepVote(rt)  # its own instance: the Trainer's keeps its state
    vote.cast()
    sync()
    t0 = time.perf_counter()
    for _ in range(args.votes):
        vote.cast()
    sync()
    vote_s = (time.perf_counter() - t0) / args.votes

    ckpt = CheckpointManager(args.ckpt_root, rt=rt, keep=1)
    stalls = []
    for i in range(3):
        sync()
        t0 = time.perf_counter()
        ckpt.save(trainer.step + i, trainer.state_dict(), force=True)
        held = time.perf_counter() - t0
        ckpt.wait()
        each = [None] * rt.world_size
        dist.all_gather_object(each, held)
        stalls.append(max(each))
    ckpt.close()

    if rt.is_master:
        what = f"{rt.world_size} processes ({rt.kind}), GPT {args.layers}x{args.width}, T=64, {args.rows} rows"
        what += (
            f", accum {k} ({args.accum_mode}), {'bf16' if prec else 'fp32'}, {args.trials} trials of {args.steps} steps"
        )
        print(what)
        for name, ts in times.items():
            print(f"{name:>8}: " + ", ".join(f"{t * 1e3:.1f}" for t in ts) + " ms/step")
        ratios = [a / b for a, b in zip(times["labkit"], times["by hand"])]
        ratio = statistics.median(ratios)
        print(f"RATIO labkit/by-hand {ratio:.3f} (median of rounds; rounds {min(ratios):.3f}-{max(ratios):.3f})")
        for name, c in counts.items():
            print(f"collectives per optimizer step, {name:>7}: " + ", ".join(f"{op} {v:g}" for op, v in c.items()))
        print("collectives: equal" if counts["labkit"] == counts["by hand"] else "collectives: NOT EQUAL")
        print(f"VOTE {vote_s * 1e6:.0f} µs/step ({args.votes} casts), {vote_s / step_s:.2%} of labkit's step")
        print(
            "SAVE stall "
            + ", ".join(f"{s:.2f}" for s in stalls)
            + f" s (slowest process, 3 saves): {statistics.median(stalls) / step_s:.1f} steps' worth (median)"
        )
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--trials", type=int, default=9, help="rounds of both loops, alternating which goes first")
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps per trial")
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    ap.add_argument("--bf16", action="store_true", help="bf16 gathers and autocast, fp32 reduction")
    ap.add_argument(
        "--accum-mode", choices=("gathered", "sharded"), default="gathered", help="TrainConfig.fsdp_accumulate"
    )
    ap.add_argument("--count", type=int, default=2, help="optimizer steps counted for collectives")
    ap.add_argument("--votes", type=int, default=200)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--rows", type=int, default=8, help="rows per process per micro-batch")
    ap.add_argument("--ckpt-root", help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    tmp = tempfile.mkdtemp(prefix="bench-fsdp-")  # the save's folder, shared by the processes, removed after
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.processes}"]
    cmd += [os.path.abspath(__file__), "--child", "--ckpt-root", tmp] + sys.argv[1:]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        sys.exit(proc.wait())
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
