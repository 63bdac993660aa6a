"""A live training dashboard: a figure redrawn in place in a notebook, one line per interval elsewhere.

    dash = Dashboard(title="resnet18", flops_per_step=3.6e9 * 3 * 128)
    Trainer(model, opt, rt, cfg, train_loader, eval_loader, callbacks=[dash]).fit()
    dash.save_png("run.png"); dash.to_csv("run.csv")

What it shows: progress (step/total, epoch, ETA); train/val loss and accuracy; Rate (moving average
of examples/s) and GlobalRate (since the epoch started), global and per replica; tokens/s and MFU
when told the work per step; XLA health: compiles and compile time per interval, graphs compiled,
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
import sys
import textwrap
import time

from .xla_health import HealthMonitor

_forced: str | None = None
_detected: str | None = None

def force_console(on: bool = True) -> None:
    """Use the console twin even inside a notebook (or undo with on=False)."""
    global _forced
    _forced = "console" if on else None


def environment() -> str:
    """'console', 'colab' or 'notebook' (detected once per process; see force_console)."""
    global _detected
    if _forced:
        return _forced
    if os.environ.get("LABKIT_CONSOLE", "").strip().lower() in ("1", "true", "yes", "on"):
        return "console"
    if _detected is None:
        _detected = "console"
        if "IPython" in sys.modules:
            from IPython import get_ipython

            ip = get_ipython()
            if ip is not None and getattr(ip, "kernel", None) is not None:
                _detected = "colab" if "google.colab" in sys.modules else "notebook"
    return _detected


def _fmt_n(x, unit="") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    for div, suf in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suf}{unit}"
    return f"{x:.3g}{unit}"


def _fmt_t(s) -> str:
    if s is None or not math.isfinite(s):
        return "-"
    s = int(s)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def summary_line(f: dict) -> str:
    """The compact one-line form of a frame (the console twin prints it)."""
    tot = f"/{f['total']}" if f.get("total") else ""
    parts = [f"[{f['title']}] step {f['step']}{tot} ep {f['epoch']}", f"loss {f['loss']:.4f}"]
    if f.get("val_loss") is not None:
        parts[-1] += f" val {f['val_loss']:.4f}"
    if f.get("acc") is not None or f.get("val_acc") is not None:
        parts.append("acc " + " val ".join(f"{v:.3f}" if v is not None else "-" for v in (f.get("acc"), f.get("val_acc"))))
    rate = f"rate {_fmt_n(f['rate'])}/s global {_fmt_n(f['global_rate'])}/s"
    if f["world_size"] > 1:
        rate += f" ({_fmt_n(f['rate_per_replica'])}/s per replica)"
    parts.append(rate)
    if f.get("tokens_per_s") is not None:
        parts.append(f"{_fmt_n(f['tokens_per_s'])} tok/s")
    if f.get("mfu") is not None:
        parts.append(f"MFU {100 * f['mfu']:.1f}%")
    h = f["health"]
    if h.get("xla"):
        parts.append(f"compiles {h['compiles']} ({h['compile_s']:.1f}s) graphs {h['graphs_total']} xfers {h['transfers']}")
    if h.get("memory"):
        m = h["memory"]
        parts.append(f"mem {_fmt_n(m['used'], 'B')}" + (f"/{_fmt_n(m['limit'], 'B')}" if m.get("limit") else ""))
    parts.append(f"ETA {_fmt_t(f.get('eta_s'))}")
    return " | ".join(parts)


class ConsoleSink:
    """Prints one line per interval and each warning when it first appears or changes."""

    min_interval_s = 0.0

    def __init__(self, stream=None):
        self.stream = stream

    def draw(self, frame: dict, dash: "Dashboard") -> None:
        out = self.stream or sys.stdout
        print(summary_line(frame), file=out, flush=True)
        for w in frame["new_warnings"]:
            print(f"  ! {w}", file=out, flush=True)


    def draw_eval(self, metrics: dict, dash: "Dashboard") -> None:
        vals = "  ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k not in ("step", "epoch") and isinstance(v, float))
        print(f"[{dash.title}] eval at step {metrics['step']} (epoch {metrics['epoch']}): {vals}", file=self.stream or sys.stdout, flush=True)


class NotebookSink:
    """HTML header + PNG figure, each through one display handle updated in place (no stacking,
    no flicker; nbclient/nbval keep the last image in the saved output).

    The header (progress, numbers, warnings) costs well under a millisecond and is updated at most
    every `min_interval_s`. Rendering the figure costs ~0.15-0.25 s of host time (matplotlib Agg on
    one core at 72 dpi), which the training loop waits for: it is redrawn at most every `figure_every_s`
    (15 s: ~1 % of the time) and at the end; Dashboard(every=...) sets both."""

    min_interval_s = 1.0

    def __init__(self, figure_every_s: float = 15.0):
        self.figure_every_s = figure_every_s
        self._html = self._img = None
        self._img_t = 0.0

    def draw(self, frame: dict, dash: "Dashboard") -> None:
        from IPython.display import HTML, Image, display

        html = HTML(_html(frame))
        every = dash.every if dash.every is not None else self.figure_every_s
        now = time.perf_counter()
        img = None
        if self._img is None or frame["final"] or now - self._img_t >= every:
            img, self._img_t = Image(data=dash.png_bytes()), now
        if self._img is None:
            self._html = display(html, display_id=True)
            self._img = display(img, display_id=True)
        else:
            self._html.update(html)
            if img is not None:
                self._img.update(img)


def _html(f: dict) -> str:
    import html as h

    pct = 100 * f["step"] / f["total"] if f.get("total") else 0
    warn = "".join(f"<li style='color:#b45309'>{h.escape(w)}</li>" for w in f["warnings"])
    bar = f"<progress value='{pct:.1f}' max='100' style='width:40%'></progress> " if f.get("total") else ""
    return (f"<div style='font-family:monospace'><b>{h.escape(f['title'])}</b> {bar}"
            f"{h.escape(summary_line(f))}" + (f"<ul>{warn}</ul>" if warn else "") + "</div>")


class Dashboard:
    """Trainer callback; see the module docstring.

    total_steps: for progress and ETA (default: the trainer's). flops_per_step / tokens_per_step:
    work of ONE replica's step (MFU = its FLOP/s over peak_flops, one chip's peak; by default
    labkit.flops.peak_flops: a table for TPUs/GPUs, a measured matmul rate on a CPU; the figure's
    source is kept in .peak_source); tokens/s is shown for all replicas. every: minimum seconds
    between draws (default: the sink's own: 0 for the console line, 1 s for the notebook header and 15 s for
    its figure); the last draw always happens. sink: anything with draw(frame, dashboard)
    (default: chosen by environment()). tensorboard_dir: also write the numbers there."""

    def __init__(self, total_steps=None, title="training", flops_per_step=None, tokens_per_step=None,
                 peak_flops=None, every=None, sink=None, tensorboard_dir=None, smoothing=0.6):
        self.total_steps, self._total_given, self.title = total_steps, total_steps, title
        self.flops_per_step, self.tokens_per_step, self.peak_flops = flops_per_step, tokens_per_step, peak_flops
        self.peak_source = "given" if peak_flops else None  # where peak_flops came from (labkit.flops)
        self.every, self.sink, self.tensorboard_dir, self.smoothing = every, sink, tensorboard_dir, smoothing
        self.history: list[dict] = []   # one row per log interval (what was drawn)
        self.evals: list[dict] = []
        self.health: HealthMonitor | None = None
        self.frames = 0
        self._active, self._rate, self._sps = True, None, None
        self._last_draw, self._pending, self._tb, self._final_drawn = 0.0, False, None, False
        self.world_size, self.rt = 1, None

    # -- Trainer callbacks -----------------------------------------------------------------
    def on_train_begin(self, trainer) -> None:
        self.rt = rt = trainer.rt
        self._active = rt.is_master
        self.world_size = rt.world_size
        if self._total_given is None:  # not given: follow the trainer (fit() may be called again)
            self.total_steps = trainer.total_steps()
        if self.health is None:
            self.health = HealthMonitor(rt, warmup_steps=getattr(trainer.cfg, "warmup_steps", 2))
        else:
            self.health.resync()
        if self.sink is None and self._active:
            self.sink = ConsoleSink() if environment() == "console" else NotebookSink()
        if self.peak_flops is None and self.flops_per_step:
            from . import flops  # the chip's table figure, or a measured one on a CPU (~1 s, once)

            self.peak_flops, self.peak_source = flops.peak_flops(rt)
        if self.tensorboard_dir and self._active and self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(self.tensorboard_dir)
        self._prev = {"step": trainer.step, "elapsed_s": 0.0}

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
        self._rate = record["examples_per_s"] if self._rate is None else s * self._rate + (1 - s) * record["examples_per_s"]
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
        row.update({f"xla_{k}": h[k] for k in ("compiles", "compile_s", "graphs_total", "transfers") if h.get(k) is not None})
        if h.get("memory"):
            row["memory_used"] = h["memory"]["used"]
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
        # the figure must end on the last numbers (an evaluation may have come after the last draw)
        if self._active and self.history and (self._pending or (
                not self._final_drawn and isinstance(self.sink, NotebookSink))):
            self._draw(final=True)
        if self._tb is not None:
            self._tb.flush()

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

    def frame_preview(self) -> dict:
        """frame() without marking warnings as shown."""
        shown = getattr(self, "_shown_warnings", {})
        f = self.frame()
        self._shown_warnings = shown
        return f

    def frame(self) -> dict:
        """Everything a sink draws, as plain Python values."""
        r = self.history[-1]
        h = getattr(self, "_last_health", {"xla": False, "warnings": []})
        shown = getattr(self, "_shown_warnings", {})
        new = [w for w in h["warnings"] if w not in shown]
        self._shown_warnings = {w: 1 for w in h["warnings"]}
        ev = self.evals[-1] if self.evals else {}
        eta = (self.total_steps - r["step"]) / self._sps if self.total_steps and self._sps and self._sps > 0 else None
        return {"title": self.title, "step": r["step"], "total": self.total_steps, "epoch": r["epoch"],
                "eta_s": eta, "elapsed_s": r["elapsed_s"], "loss": r["loss"], "val_loss": ev.get("val_loss"),
                "acc": r.get("acc"), "val_acc": ev.get("val_acc"), "lr": r["lr"], "rate": r["rate"],
                "global_rate": r["global_rate"], "rate_per_replica": r["rate_per_replica"],
                "global_rate_per_replica": r["global_rate_per_replica"], "world_size": self.world_size,
                "tokens_per_s": r.get("tokens_per_s"), "mfu": r.get("mfu"), "health": h,
                "warnings": list(h["warnings"]), "new_warnings": new,
                "recompiles": list(self.health.events) if self.health else []}

    def figure(self):
        """A matplotlib Figure of the current state (not attached to pyplot: nothing auto-displays)."""
        return render(self)

    def png_bytes(self, dpi=72) -> bytes:
        buf = io.BytesIO()
        self.figure().savefig(buf, format="png", dpi=dpi)
        return buf.getvalue()

    def save_png(self, path, dpi=100) -> str:
        self.figure().savefig(path, format="png", dpi=dpi)
        return str(path)

    # -- export -------------------------------------------------------------------------------
    def to_csv(self, path) -> str:
        keys = list(dict.fromkeys(k for row in self.history for k in row))
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(self.history)
        return str(path)

    def to_json(self, path=None) -> str:
        """The history, evaluations, recompilations and warnings as JSON (returned; written if path)."""
        h = getattr(self, "_last_health", {})
        text = json.dumps({"title": self.title, "history": self.history, "eval": self.evals,
                           "recompiles": self.health.events if self.health else [],
                           "warnings": h.get("warnings", [])}, indent=1, default=str)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text


def render(dash: Dashboard):
    """Loss, accuracy, throughput, XLA compiles/transfers, and a text panel (progress, health)."""
    from matplotlib.figure import Figure

    rows, evals = dash.history, dash.evals
    fig = Figure(figsize=(13, 6.5))
    fig.subplots_adjust(left=0.05, right=0.98, top=0.9, bottom=0.08, hspace=0.35, wspace=0.2)
    gs = fig.add_gridspec(2, 3)
    steps = [r["step"] for r in rows]
    ax = fig.add_subplot(gs[0, 0])
    ax.plot(steps, [r["loss"] for r in rows], "o-", ms=3, label="train")
    if any("val_loss" in e for e in evals):
        ax.plot([e["step"] for e in evals if "val_loss" in e], [e["val_loss"] for e in evals if "val_loss" in e],
                "s--", ms=4, color="C1", label="val")
    ax.set(title="loss", xlabel="step")
    ax.legend(fontsize=8)
    ax = fig.add_subplot(gs[0, 1])
    if any("acc" in r for r in rows):
        ax.plot([r["step"] for r in rows if "acc" in r], [r["acc"] for r in rows if "acc" in r], "o-", ms=3, color="C0", label="train")
    if any("val_acc" in e for e in evals):
        ax.plot([e["step"] for e in evals if "val_acc" in e], [e["val_acc"] for e in evals if "val_acc" in e],
                "s--", ms=4, color="C1", label="val")
    if ax.lines:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no accuracy yet", ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set(title="accuracy", xlabel="step")
    ax = fig.add_subplot(gs[0, 2])
    ax.plot(steps, [r["rate"] for r in rows], "o-", ms=3, label="Rate (moving avg)")
    ax.plot(steps, [r["global_rate"] for r in rows], "--", label="GlobalRate (epoch)")
    if dash.world_size > 1:
        ax.plot(steps, [r["rate_per_replica"] for r in rows], ":", label="Rate per replica")
    ax.set(title="examples/s", xlabel="step")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax = fig.add_subplot(gs[1, 0])
    if any("xla_compiles" in r for r in rows):
        ax.bar(steps, [r.get("xla_compiles", 0) for r in rows], width=max(1, (steps[-1] - steps[0]) / max(len(steps), 1) * 0.4)
               if len(steps) > 1 else 1, label="compiles", color="tab:red")
        ax.plot(steps, [r.get("xla_transfers", 0) for r in rows], "k.-", label="device->host transfers")
        for ev in dash.health.events if dash.health else []:
            ax.axvline(ev["step"], color="tab:orange", lw=0.8, ls=":")
        ax.legend(fontsize=8)
        ax.set(title="XLA per interval (dotted: recompiles)", xlabel="step")
    else:
        ax.text(0.5, 0.5, "not running on XLA", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set(title="XLA", xticks=[], yticks=[])
    ax = fig.add_subplot(gs[1, 1:])
    ax.axis("off")
    f = dash.frame_preview()
    lines = [f"{f['title']}   step {f['step']}" + (f"/{f['total']} ({100 * f['step'] / f['total']:.0f}%)" if f["total"] else "")
             + f"   epoch {f['epoch']}   elapsed {_fmt_t(f['elapsed_s'])}   ETA {_fmt_t(f['eta_s'])}",
             f"loss {f['loss']:.4f}" + (f"   val {f['val_loss']:.4f}" if f["val_loss"] is not None else "")
             + (f"   acc {f['acc']:.3f}" if f["acc"] is not None else "")
             + (f"   val acc {f['val_acc']:.3f}" if f["val_acc"] is not None else "") + f"   lr {f['lr']:.3g}",
             f"Rate {_fmt_n(f['rate'])}/s   GlobalRate {_fmt_n(f['global_rate'])}/s   per replica "
             f"{_fmt_n(f['rate_per_replica'])}/s, {_fmt_n(f['global_rate_per_replica'])}/s (x{f['world_size']})"]
    if f["tokens_per_s"] is not None or f["mfu"] is not None:
        lines.append(f"tokens/s {_fmt_n(f['tokens_per_s'])}   MFU " + (f"{100 * f['mfu']:.1f}%" if f["mfu"] is not None else "- (peak unknown)"))
    h = f["health"]
    if h.get("xla"):
        lines.append(f"XLA: {h['compiles']} compiles ({h['compile_s']:.2f} s) last interval, {h['graphs_total']} graphs "
                     f"in all, {h['recompiles']} recompiles after warm-up, {h['transfers']} transfers")
        if h["fallbacks"]:
            lines.append("CPU fallbacks: " + ", ".join(f"{k} x{v}" for k, v in h["fallbacks"].items()))
    if h.get("memory"):
        m = h["memory"]
        lines.append(f"device memory {_fmt_n(m['used'], 'B')}" + (f" of {_fmt_n(m['limit'], 'B')}" if m.get("limit") else ""))
    y = 0.97
    for ln in lines:
        ax.text(0.0, y, ln, family="monospace", fontsize=9, va="top", transform=ax.transAxes)
        y -= 0.1
    for w in f["warnings"][:5]:
        ax.text(0.0, y, "! " + textwrap.shorten(w, 130), fontsize=9, va="top", color="#b45309", transform=ax.transAxes)
        y -= 0.1
    fig.suptitle(dash.title)
    return fig
