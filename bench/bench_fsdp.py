"""The FSDP2 Trainer step ÷ a hand-written fully_shard loop, on torchrun's processes (gloo on the CPU, nccl on GPUs).

    .venv/bin/python bench/bench_fsdp.py [--processes 4] [--steps 10] [--trials 3] [--layers 2] [--width 128]

Starts `python -m torch.distributed.run --standalone --nproc-per-node N` of itself. In every process, two loops on
the same GPT (2 layers, 128 wide, T=64, 8 rows per process by default), the same initial weights, batches and AdamW,
clip_norm 1.0:
- labkit: LMTrainer(..., TrainConfig(parallel="fsdp2")) (labkit.parallel: fully_shard per block, then the root);
- by hand: the same fully_shard calls, then forward, backward, clip_grad_norm_, opt.step(), zero_grad, the loss
  read every 20 steps (what labkit's log interval does).
Each loop runs 2 warm-up steps, then the trials alternate their order; a trial is `steps` optimizer steps timed on
process 0 between barriers. Prints per-trial times and the RATIO line (median labkit ÷ median by hand; goal ≤ 1.02).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def child(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import labkit
    from labkit.lm import LMTrainer
    from labkit.models.gpt import GPT, GPTConfig, adamw

    rt = labkit.setup()
    cfg = GPTConfig(block_size=64, n_layer=args.layers, n_head=4, n_embd=args.width, dropout=0.0)
    g = torch.Generator().manual_seed(0)
    n = args.steps * (2 * args.trials) + 4
    text = torch.randint(0, 256, (n, 8, cfg.block_size + 1), generator=g)
    batches = [(t[:, :-1].to(rt.device), t[:, 1:].to(rt.device)) for t in text]

    def labkit_loop():
        torch.manual_seed(0)
        model = GPT(cfg)
        tc = labkit.TrainConfig(epochs=1, log_every=20, eval_every=0, clip_norm=1.0, parallel="fsdp2")
        trainer = LMTrainer(model, adamw(model, 1e-3, rt=rt), rt, tc, [batches[0], batches[1]])

        def run(chunk):  # one fit() per chunk: an epoch of len(chunk) steps, the step counter going on
            trainer.train_loader = trainer._wrap(chunk)
            trainer.epoch = trainer.batch_in_epoch = 0
            trainer._step_offset = trainer.step
            trainer.fit()

        return run

    def hand_loop():
        torch.manual_seed(0)
        model = GPT(cfg).to(rt.device)
        mesh = init_device_mesh(rt.device.type, (rt.world_size,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = adamw(model, 1e-3, rt=rt)
        losses = []

        def run(chunk):
            for x, y in chunk:
                _, loss = model(x, y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.detach())
                if len(losses) == 20:
                    torch.stack(losses).sum().item()
                    losses.clear()

        return run

    loops = {"labkit": labkit_loop(), "by hand": hand_loop()}
    for run in loops.values():
        run(batches[:2])  # warm-up
    times: dict[str, list] = {name: [] for name in loops}
    at = 2
    for trial in range(args.trials):
        order = list(loops) if trial % 2 == 0 else list(reversed(loops))
        for name in order:
            chunk = batches[at : at + args.steps]
            at += args.steps
            dist.barrier()
            t0 = time.perf_counter()
            loops[name](chunk)
            dist.barrier()
            times[name].append((time.perf_counter() - t0) / args.steps)
    if rt.is_master:
        for name, ts in times.items():
            print(f"{name:>8}: " + ", ".join(f"{t * 1e3:.1f}" for t in ts) + " ms/step", flush=True)
        ratio = statistics.median(times["labkit"]) / statistics.median(times["by hand"])
        print(f"RATIO labkit/by-hand {ratio:.3f} ({rt.world_size} processes, {rt.kind})", flush=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.processes}"]
    cmd += [os.path.abspath(__file__), "--child"] + sys.argv[1:]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        sys.exit(proc.wait())
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()


if __name__ == "__main__":
    main()
