"""What labkit's step profiler costs: nothing requested (every step), and inside a capture window.

    PJRT_DEVICE=CPU .venv/bin/python bench/bench_profile.py [--steps 60] [--calls 200000]   # ~1 min on 2 cores

1. Idle: the loop's per-step work when no capture is requested (the `capturing` tests and
   StepProfiler.step_boundary, whose trigger-file poll is one os.stat at most once a second), timed
   over many calls, printed in microseconds per step and as a share of the measured plain step.
2. Capture: one fit() on XLA:CPU of an MLP (batch 128, 512->1024->10); the median step time of the
   captured steps (each ends with xm.wait_device_ops, the trace is recording) divided by the median of
   the free-running steps (each step's time from labkit's own log records: examples / examples_per_s).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch
import torch.nn as nn

import labkit
from labkit.profiling import StepProfiler


class Trainerish:
    step = 0


def idle_cost(calls: int) -> float:
    prof = StepProfiler(labkit.setup("cpu"))
    tr = Trainerish()
    t = time.perf_counter()
    for _ in range(calls):
        if prof.capturing:  # the loop's four tests
            pass
        if prof.capturing:
            pass
        if prof.capturing:
            pass
        if prof.capturing:
            pass
        prof.step_boundary(tr)
    return (time.perf_counter() - t) / calls


def capture_ratio(steps: int) -> tuple[float, float]:
    rt = labkit.setup()
    torch.manual_seed(0)
    n = 128 * steps
    data = torch.utils.data.TensorDataset(torch.randn(n, 512), torch.randint(0, 10, (n,)))
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 10))

    class Ask:
        def on_step_end(self, trainer, batch):
            if trainer.step == steps // 2:
                trainer.request_profile(10, out_dir=tempfile.mkdtemp(prefix="bench-profile-"))

    tr = labkit.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        rt,
        labkit.TrainConfig(max_steps=steps, log_every=1),
        torch.utils.data.DataLoader(data, batch_size=128),
        callbacks=[Ask()],
    )
    tr.fit()
    (a,) = tr.profiles
    captured = {s["step"] for s in a.steps}
    free = [r["examples"] / r["examples_per_s"] for r in tr.history[5:] if r["step"] not in captured]
    # medians: the steps that start and finish the capture (the analysis, the PNG) are outliers
    return statistics.median(s["total_s"] for s in a.steps), statistics.median(free)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--calls", type=int, default=200_000)
    args = ap.parse_args()
    idle = idle_cost(args.calls)
    cap, free = capture_ratio(args.steps)
    print(f"idle profiler: {1e6 * idle:.2f} us per step ({100 * idle / free:.3f}% of a {1e3 * free:.1f} ms step)")
    print(f"captured step {1e3 * cap:.1f} ms / free step {1e3 * free:.1f} ms = {cap / free:.2f}")


if __name__ == "__main__":
    main()
