"""A live training dashboard: a figure redrawn in place in a notebook, one line per interval elsewhere.

    dash = Dashboard(title="resnet18", flops_per_step=3.6e9 * 3 * 128)
    Trainer(model, opt, rt, cfg, train_loader, eval_loader, callbacks=[dash]).fit()
    dash.save_png("run.png"); dash.to_csv("run.csv")

What it shows: progress (step/total, epoch, ETA); train/val loss and accuracy; Rate (moving average
of examples/s) and GlobalRate (since the epoch started), global and per replica; tokens/s and MFU
when told the work per step; the feed meter (share of each step spent waiting for the next batch,
"input-bound" above labkit.dashboard.rules.INPUT_BOUND); XLA health: compiles and compile time per interval, graphs compiled,
each recompilation after warm-up with what changed, aten:: ops that fall back to the CPU, device->host
transfers, device memory; and plain-language warnings.

It never syncs the device itself: the numbers arrive in the Trainer's records, which are read in a
step closure every cfg.log_every steps (one batched transfer); the XLA counters are host-side.
Only the master process (ordinal 0) draws. The environment is detected once: a notebook kernel gets
the figure (a display handle updated in place, so executed notebooks keep the last image); scripts,
CI, LABKIT_CONSOLE=1 or force_console() get the console twin.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import time

from labkit.dashboard.health import HealthMonitor
from labkit.dashboard.rules import feed_finding
from labkit.dashboard.sinks import ConsoleSink, NotebookSink, environment, force_console  # noqa: F401
from labkit.dashboard.syncs import SyncFinder
from labkit.dashboard.view import render


class Dashboard:
    """Trainer callback; see the module docstring.

    total_steps: for progress and ETA (default: the trainer's). flops_per_step / tokens_per_step:
    work of ONE replica's step (MFU = its FLOP/s over peak_flops, one chip's peak; by default
    labkit.dashboard.flops.peak_flops: a table for TPUs/GPUs, a measured matmul rate on a CPU; the figure's
    source is kept in .peak_source); tokens/s is shown for all replicas. find_syncs: on XLA, run a
    labkit.dashboard.syncs.SyncFinder during fit() so that recompilations name the line that compiled and
    device->host reads are counted per line of your code (host-side, ~2 us per read). every: minimum seconds
    between draws (default: the sink's own: 0 for the console line, 1 s for the notebook header and 15 s for
    its figure); the last draw always happens. sink: anything with draw(frame, dashboard)
    (default: chosen by environment()). tensorboard_dir: also write the numbers there. controls: buttons
    under the notebook view to profile, stop after the epoch or save now; the console twin prints the
    same as method calls and signals (labkit.dashboard.controls, which says when a click takes effect)."""

    def __init__(
        self,
        total_steps=None,
        title="training",
        flops_per_step=None,
        tokens_per_step=None,
        peak_flops=None,
        every=None,
        sink=None,
        tensorboard_dir=None,
        smoothing=0.6,
        find_syncs=True,
        controls=True,
        chance=None,
    ):
        self.total_steps, self._total_given, self.title = total_steps, total_steps, title
        self.flops_per_step, self.tokens_per_step, self.peak_flops = flops_per_step, tokens_per_step, peak_flops
        self.peak_source = "given" if peak_flops else None  # where peak_flops came from (labkit.dashboard.flops)
        self.every, self.sink, self.tensorboard_dir, self.smoothing = every, sink, tensorboard_dir, smoothing
        self.history: list[dict] = []  # one row per log interval (what was drawn)
        self.evals: list[dict] = []
        self.health: HealthMonitor | None = None
        self.finder = SyncFinder() if find_syncs else None
        self._last_health: dict = {"xla": False, "warnings": []}
        self._shown_warnings: set[str] = set()  # warnings a sink has already drawn
        self.frames = 0
        self._active, self._rate, self._sps = True, None, None
        self._last_draw, self._pending, self._tb, self._final_drawn = 0.0, False, None, False
        self.world_size, self.rt = 1, None
        self.controls = controls
        self.chance = chance  # accuracy of guessing (1 / classes): drawn as a line on the accuracy panel

    # -- Trainer callbacks -----------------------------------------------------------------
    def on_train_begin(self, trainer) -> None:
        self.rt = rt = trainer.rt
        self._active, self._final_drawn = rt.is_master, False  # a new fit: its own end is still to come
        self.world_size = rt.world_size
        if self._total_given is None:  # not given: follow the trainer (fit() may be called again)
            self.total_steps = trainer.total_steps()
        if self.finder is not None and self._active and rt.reads_metrics:
            self.finder.start()  # stopped in on_fit_end
        if self.health is None:
            from labkit.dashboard import cuda_syncs

            self.health = HealthMonitor(
                rt,
                warmup_steps=getattr(trainer.cfg, "warmup_steps", 2),
                finder=self.finder if rt.reads_metrics else None,
                host_syncs=cuda_syncs.HostSyncCounter() if self.finder is not None and cuda_syncs.applies(rt) else None,
            )
        else:
            self.health.open()
            self.health.resync()
        if self.health.host_syncs is not None and self._active:
            self.health.host_syncs.start()  # stopped in on_fit_end
        if self.sink is None and self._active:
            self.sink = ConsoleSink() if environment() == "console" else NotebookSink()
        if self.peak_flops is None and self.flops_per_step:
            from labkit.dashboard import flops  # the chip's table figure, or a measured one on a CPU (~1 s, once)

            self.peak_flops, self.peak_source = flops.peak_flops(rt)
        if self.tensorboard_dir and self._active and self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(self.tensorboard_dir)
        self._prev = {"step": trainer.step, "elapsed_s": 0.0}
        if self._active and hasattr(self.sink, "begin"):
            self.sink.begin(trainer, self)

    def on_step_end(self, trainer, batch) -> None:
        if self._active and self.health is not None:
            self.health.on_step(trainer.step, batch)

    def on_log(self, trainer, record: dict) -> None:
        if not self._active:
            return
        if self.health is None:  # used without on_train_begin (e.g. a hand-written loop)
            self.on_train_begin(trainer)
        steps = record["step"] - self._prev["step"]
        dt = record["elapsed_s"] - self._prev["elapsed_s"]
        self._prev = record
        s = self.smoothing
        sps = steps / dt if dt > 0 else float("nan")
        self._rate = (
            record["examples_per_s"] if self._rate is None else s * self._rate + (1 - s) * record["examples_per_s"]
        )
        if math.isfinite(sps):
            self._sps = sps if self._sps is None else s * self._sps + (1 - s) * sps
        row = {k: record[k] for k in ("step", "epoch", "loss", "lr", "elapsed_s", "examples_per_s", "global_rate")}
        row.update({k: v for k, v in record.items() if k not in row and isinstance(v, (int, float))})
        row["rate"] = self._rate
        row["rate_per_replica"] = self._rate / self.world_size
        row["global_rate_per_replica"] = record["global_rate"] / self.world_size
        row["steps_per_s"] = sps
        if self.tokens_per_step:
            row["tokens_per_s"] = self.tokens_per_step * self.world_size * sps
        if self.flops_per_step:
            row["tflops_per_replica"] = self.flops_per_step * sps / 1e12
            row["mfu"] = self.flops_per_step * sps / self.peak_flops if self.peak_flops else None
        h = self.health.interval(steps)
        # XLA's counters as xla_*, torch.compile's record as dynamo_* (once something was compiled)
        pre = "xla_" if h.get("xla") else "dynamo_" if h.get("graphs_total") else None
        if pre:
            row.update(
                {pre + k: h[k] for k in ("compiles", "compile_s", "graphs_total", "transfers") if h.get(k) is not None}
            )
        if h.get("memory"):
            row["memory_used"] = h["memory"]["used"]
        # the feed meter (labkit.steplog): live, so it goes away again once the loader keeps up
        feed = feed_finding(
            record.get("data_wait_frac"),
            record.get("data_wait_s"),
            record.get("step_s"),
            record.get("data_workers"),
            record.get("examples_per_s"),
            in_memory=bool(record.get("data_in_memory")),
        )
        h = dict(h, warnings=list(h["warnings"]) + [f.short for f in feed])
        self._last_health = h
        self.history.append(row)
        if self._tb is not None:
            for k, v in row.items():
                if k not in ("step", "epoch") and isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(f"train/{k}", v, row["step"])
        self._maybe_draw(force=self.total_steps is not None and record["step"] >= self.total_steps)

    def on_eval(self, trainer, metrics: dict) -> None:
        if self.health is not None:
            self.health.resync()  # evaluation graphs compile once: not recompilations
        if not self._active:
            return
        self.evals.append(dict(metrics))
        if self._tb is not None:
            for k, v in metrics.items():
                if k not in ("step", "epoch") and isinstance(v, (int, float)):
                    self._tb.add_scalar(f"eval/{k}", v, metrics["step"])
        if self.history:
            if hasattr(self.sink, "draw_eval"):
                self.sink.draw_eval(metrics, self)
            else:
                self._maybe_draw()

    def on_train_end(self, trainer) -> None:
        # the view must end on the last numbers (an evaluation may have come after the last draw) and say that
        # the run ended: a fit stopped early otherwise ended on an ETA
        if self._active and self.history and (self._pending or not self._final_drawn):
            self._draw(final=True)
        if self._tb is not None:
            self._tb.flush()
        if self._active and hasattr(self.sink, "end"):
            self.sink.end(trainer, self)

    def on_fit_end(self, trainer) -> None:
        """fit() returned or raised: take back every hook on_train_begin put on torch or Python (the sync finder,
        the CUDA sync-debug mode and warnings.showwarning, the listener on torch's structured trace)."""
        if self.finder is not None:
            self.finder.stop()
        if self.health is not None:
            if self.health.host_syncs is not None:
                self.health.host_syncs.stop()
            self.health.close()

    # -- drawing -----------------------------------------------------------------------------
    def _maybe_draw(self, force=False) -> None:
        every = self.every if self.every is not None else getattr(self.sink, "min_interval_s", 0.0)
        now = time.perf_counter()
        if force or not self.frames or now - self._last_draw >= every:
            self._draw(final=force)
        else:
            self._pending = True

    def _draw(self, final=False) -> None:
        self._last_draw, self._pending = time.perf_counter(), False
        self._final_drawn = final
        self.frames += 1
        if self.sink is not None:
            f = self.frame()
            f["final"] = final
            self.sink.draw(f, self)
            self._shown_warnings = set(f["warnings"])  # drawn: no longer new

    def frame(self) -> dict:
        """Everything a sink draws, as plain Python values (reading it changes nothing)."""
        r = self.history[-1]
        h = self._last_health
        ev = self.evals[-1] if self.evals else {}
        eta = (self.total_steps - r["step"]) / self._sps if self.total_steps and self._sps and self._sps > 0 else None
        return {
            "title": self.title,
            "step": r["step"],
            "total": self.total_steps,
            "epoch": r["epoch"],
            "eta_s": eta,
            "final": self._final_drawn,  # the fit ended: views say finished / stopped instead of an ETA
            "elapsed_s": r["elapsed_s"],
            "loss": r["loss"],
            "val_loss": ev.get("val_loss"),
            "acc": r.get("acc"),
            "val_acc": ev.get("val_acc"),
            "lr": r["lr"],
            "rate": r["rate"],
            "global_rate": r["global_rate"],
            "rate_per_replica": r["rate_per_replica"],
            "global_rate_per_replica": r["global_rate_per_replica"],
            "world_size": self.world_size,
            "tokens_per_s": r.get("tokens_per_s"),
            "mfu": r.get("mfu"),
            "data_wait_frac": r.get("data_wait_frac"),  # the feed meter: share of step time waiting for data
            "data_wait_s": r.get("data_wait_s"),
            "step_s": r.get("step_s"),
            "health": h,
            "warnings": list(h["warnings"]),
            "new_warnings": [w for w in h["warnings"] if w not in self._shown_warnings],
            "recompiles": list(self.health.events) if self.health else [],
        }

    def view_data(self) -> dict:
        """What the figure draws: the history, the evaluations and the last frame (plain data)."""
        return {
            "title": self.title,
            "history": list(self.history),
            "evals": list(self.evals),
            "world_size": self.world_size,
            "chance": self.chance,
            "tokens_per_step": self.tokens_per_step,
            "frame": self.frame() if self.history else None,
        }

    def figure(self):
        """A matplotlib Figure of the current state (not attached to pyplot: nothing auto-displays)."""
        return render(self.view_data())

    def png_bytes(self, dpi=72) -> bytes:
        buf = io.BytesIO()
        self.figure().savefig(buf, format="png", dpi=dpi)
        return buf.getvalue()

    def save_png(self, path, dpi=100) -> str:
        self.figure().savefig(path, format="png", dpi=dpi)
        return str(path)

    # -- export -------------------------------------------------------------------------------
    def save_artifacts(self, name: str, folder: str | None = None) -> list[str]:
        """Keep the figure (dashboard-NAME.png) and the curves (history-NAME.csv) for a person to look at,
        in `folder`, else in $LABKIT_ARTIFACTS (set by headless runs); nothing when neither is set.
        Returns the paths written."""
        folder = folder or os.environ.get("LABKIT_ARTIFACTS")
        if not folder:
            return []
        os.makedirs(folder, exist_ok=True)
        png = self.save_png(os.path.join(folder, f"dashboard-{name}.png"))
        return [png, self.to_csv(os.path.join(folder, f"history-{name}.csv"))]

    def to_csv(self, path) -> str:
        keys = list(dict.fromkeys(k for row in self.history for k in row))
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(self.history)
        return str(path)

    def to_json(self, path=None) -> str:
        """The history, evaluations, recompilations and warnings as JSON (returned; written if path). A NaN or
        infinite value (a loss after a non-finite step) is written as null, and "nonfinite" counts them: JSON has
        no NaN, and a file with one is not JSON."""
        h, replaced = self._last_health, []

        def finite(v):
            if isinstance(v, float) and not math.isfinite(v):
                replaced.append(v)
                return None
            if isinstance(v, dict):
                return {k: finite(x) for k, x in v.items()}
            return [finite(x) for x in v] if isinstance(v, (list, tuple)) else v

        data = finite(
            {
                "title": self.title,
                "history": self.history,
                "eval": self.evals,
                "recompiles": self.health.events if self.health else [],
                "warnings": h.get("warnings", []),
            }
        )
        text = json.dumps({**data, "nonfinite": len(replaced)}, indent=1, default=str, allow_nan=False)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text
