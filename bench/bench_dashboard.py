"""Step time of labkit's Trainer with the dashboard vs without, same model, same run.

    PJRT_DEVICE=CPU .venv/bin/python bench/bench_dashboard.py [--steps 600] [--trials 5]   # ~6 min on 2 cores

Three Trainers over one MLP (batch 256, 1024->1536->1536->10, ~6 GFLOP per step: ~30 ms per
step on a 2-core XLA:CPU), loss read every 20 steps in a step closure:
  plain    no callbacks
  console  Dashboard with the console twin (one line per interval, written to /dev/null)
  no-finder  the console Dashboard with find_syncs=False (no SyncFinder: the detective without lines)
  figure   Dashboard drawing like the notebook (header each >= 1 s, PNG figure each >= 15 s and at
           the end of every fit(): one trial = one fit, so trials are long to amortise that), with
           the notebook's buttons built and bound to the trainer (labkit.dashboard.controls)
Trials interleave (rotating order) after each loop's warm-up, so drifts of the machine hit all.
Prints per-trial times and the ratios dashboard / plain (goal <= 1.02).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch
import torch.nn as nn

import labkit
from labkit.dashboard import ConsoleSink, Dashboard, NotebookSink
from labkit.dashboard.controls import Controls
from labkit.dashboard.view import html_header


class FigureSink:
    """What NotebookSink does minus the IPython display calls: the HTML header every >= 1 s, the
    PNG figure every >= 15 s and at the end of each fit() (each trial here ends one)."""

    min_interval_s = NotebookSink.min_interval_s

    def __init__(self):
        self.renders, self._t = 0, 0.0
        self.figure_every_s = NotebookSink().figure_every_s
        self.controls = None

    def begin(self, trainer, dash):
        """NotebookSink.begin minus the display: the buttons are built once and bound at each fit()."""
        if self.controls is None:
            self.controls = Controls()
            self.controls.widget()
        self.controls.bind(trainer)

    def draw(self, frame, dash):
        html_header(frame)
        if not self.renders or frame["final"] or time.perf_counter() - self._t >= self.figure_every_s:
            dash.png_bytes()
            self.renders, self._t = self.renders + 1, time.perf_counter()


def make_data(n, bs, dim):
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(n, dim, generator=g), torch.randint(0, 10, (n,), generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=bs, drop_last=True)


def make_model(dim, hidden):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))


class Loop:
    def __init__(self, rt, data, dim, hidden, callbacks):
        model = make_model(dim, hidden)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        cfg = labkit.TrainConfig(epochs=10**6, log_every=20, eval_every=0)
        self.rt, self.callbacks = rt, callbacks
        self.tr = labkit.Trainer(model, opt, rt, cfg, data, callbacks=callbacks)

    def run(self, steps):
        self.tr.cfg.max_steps = self.tr.step + steps
        self.tr.batch_in_epoch = 0
        self.tr.fit()
        if self.rt.is_xla:
            import torch_xla.core.xla_model as xm

            xm.wait_device_ops()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--backend", default=None)
    a = ap.parse_args()
    rt = labkit.setup(a.backend)
    data = make_data(a.batch * (a.steps + 4), a.batch, a.dim)
    devnull = open(os.devnull, "w")
    dashes = {
        "console": Dashboard(title="bench", sink=ConsoleSink(devnull)),
        "no-finder": Dashboard(title="bench", sink=ConsoleSink(devnull), find_syncs=False),
        "figure": Dashboard(title="bench", sink=FigureSink()),
    }
    loops = {
        "plain": Loop(rt, data, a.dim, a.hidden, []),
        "console": Loop(rt, data, a.dim, a.hidden, [dashes["console"]]),
        "no-finder": Loop(rt, data, a.dim, a.hidden, [dashes["no-finder"]]),
        "figure": Loop(rt, data, a.dim, a.hidden, [dashes["figure"]]),
    }
    for name, loop in loops.items():
        t = time.perf_counter()
        loop.run(25)  # compiles (step 0, step 1 with optimizer state) and one log interval
        print(f"warm-up {name}: {time.perf_counter() - t:.1f} s", flush=True)
    names = list(loops)
    times = {k: [] for k in loops}
    for trial in range(a.trials):
        order = names[trial % len(names) :] + names[: trial % len(names)]
        for name in order:
            t = time.perf_counter()
            loops[name].run(a.steps)
            times[name].append((time.perf_counter() - t) / a.steps)
        print(f"trial {trial}: " + ", ".join(f"{k} {times[k][-1] * 1000:.1f} ms/step" for k in names), flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"{rt.kind} MLP {a.dim}-{a.hidden}-{a.hidden}-10 batch {a.batch}, {a.steps} steps x {a.trials} trials: "
        + ", ".join(f"{k} {v * 1000:.1f} ms/step" for k, v in med.items())
    )
    print(
        f"draws: figure sink {dashes['figure'].frames} ({dashes['figure'].sink.renders} PNG renders), "
        f"console {dashes['console'].frames} lines; buttons built: {dashes['figure'].sink.controls.box is not None}"
    )
    for k in ("console", "figure"):
        print(f"RATIO {k}-dashboard/plain step time = {med[k] / med['plain']:.3f} (goal <= 1.02)")
    # the recompile detective's line capture and the host-sync finder (labkit.dashboard.syncs) on vs off
    print(f"RATIO finder-on/finder-off step time = {med['console'] / med['no-finder']:.3f} (goal <= 1.02)")


if __name__ == "__main__":
    main()
