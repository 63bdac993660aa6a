"""Profile a few steps of a running fit(), then split each step's time the way Holistic Trace Analysis does.

    trainer.request_profile(steps=5)          # from a callback, a notebook cell, a dashboard button
    ...                                       # the next 5 steps are captured; then, in the run's folder:
    a = trainer.profiles[-1]                  # an Analysis: a.table(), a.top_ops(), a.timeline()
    a = labkit.profiling.analyze("profiles/step000120-20261123-201500")   # the same, read back from disk

From a script, without touching its code: `kill -USR1 <pid>` (SIGUSR1, installed during fit() only in the
main thread and only when nothing else handles it) or `touch profiles/PROFILE` (the trigger file:
$LABKIT_PROFILE_TRIGGER, else <out_dir>/PROFILE; it may hold a step count; polled with one os.stat at most
once a second, and removed when seen). The folder is $LABKIT_PROFILE_DIR, else ./profiles.

What a capture costs: nothing until one is requested (one attribute test per step and the once-a-second
stat; no device sync). During the N captured steps, each step ends with a wait for the device
(xm.wait_device_ops on XLA, torch.cuda.synchronize on a GPU) so that a step's work stays inside its step:
captured steps run a little slower than free-running ones, whose host and device overlap. Measured by
bench/bench_profile.py on 2 loaded cores: 1.4-1.8 us per step idle; a captured XLA:CPU MLP step 1.22x a free one.
The capture's end (stop, analysis, timeline PNG) takes ~0.2-1 s of the step that ends it.

What is captured, per backend:
- XLA (TPU, XLA:CPU): torch_xla.debug.profiler's in-process session (`xp.start_trace`/`xp.stop_trace`; the
  older `xp.start_server` + `xp.trace_detached` needs a server and a client thread and is not needed in
  the process itself). It writes `plugins/profile/<run>/<host>.xplane.pb`, which TensorBoard's profile
  plugin and XProf open (`tensorboard --logdir <capture folder>`), and beside it `<host>.trace.json.gz`,
  the same events as a Chrome trace, which is what labkit reads (no XPlane parser is installed here).
  torch_xla-specific.
- CPU and CUDA: torch.profiler, exported as a Chrome/Perfetto JSON trace (open it at ui.perfetto.dev).

The split of each step (`Analysis.steps`) is exclusive, each instant going to the first category that
covers it: data wait (labkit's own timer around next(loader), the wait for the prefetch queue), compile
(XLA's `XLAGraphExecutor::Compile` events), device (XLA: the HLO ops of the trace, on XLA:CPU the PjRt
client's `ThunkExecutor::Execute`; CUDA: kernels and copies; CPU: aten ops, since there the host is the
device), host (the loop's own Python: on XLA building the lazy graph and cutting it; also the callbacks
after the step) and idle (the rest: waiting for nothing the trace shows). A step runs from asking for its
batch to the end of its callbacks. The categories are HTA's; HTA itself reads only torch.profiler's GPU
traces, so this is a small re-implementation that also reads XLA's Chrome trace.

Checked here on XLA:CPU and CPU only. On a TPU the same torch_xla events mark compiles; device time is
read from the `hlo_op` events or, failing those, from the `/device:TPU:N` lines of the trace, which was
not verified on a chip. torch.profiler is not run beside torch_xla's session: on XLA its aten events would
only show the lazy tracing, which the host category already measures.
"""

from __future__ import annotations

import bisect
import glob
import gzip
import json
import os
import re
import signal
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

CATEGORIES = ("data_wait", "compile", "device", "host", "idle")  # the split's priority order
COLORS = {"compile": "#d62728", "device": "#2ca02c", "data_wait": "#1f77b4", "host": "#ff7f0e", "idle": "#c7c7c7"}
SIGNAL = "SIGUSR1"
STEP_SPAN = "labkit_step"  # the span labkit puts around each captured step in the trace (aligns clocks)
_MATMUL = r"addmm|\bmm\b|aten::mm|bmm|matmul|linear|\bdot|gemm"


def default_dir() -> Path:
    return Path(os.environ.get("LABKIT_PROFILE_DIR") or "profiles")


def trigger_path(out_dir=None) -> Path:
    """Where `touch` starts a capture: $LABKIT_PROFILE_TRIGGER, else <out_dir>/PROFILE."""
    env = os.environ.get("LABKIT_PROFILE_TRIGGER")
    return Path(env) if env else Path(out_dir or default_dir()) / "PROFILE"


def _check_steps(steps) -> int:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"profile steps={steps!r}: expected a whole number >= 1")
    return steps


class StepProfiler:
    """The Trainer's part: it owns one, calls it at step boundaries and never otherwise."""

    poll_every_s = 1.0

    def __init__(self, rt, out_dir=None):
        self.rt, self.out_dir = rt, out_dir
        self.capturing = False  # the one attribute the loop tests each step
        self._request = None  # (steps, out_dir) waiting for the next step boundary
        self._last_poll = -1e9
        self._old_handler = None
        self.results: list[Analysis] = []

    # -- requests ----------------------------------------------------------------------------------
    def request(self, steps: int = 5, out_dir=None) -> None:
        self._request = (_check_steps(steps), out_dir)  # a plain assignment: safe from a signal handler

    def install_signal(self) -> None:
        """SIGUSR1 requests a capture, during fit() only, main thread only, never over someone's handler."""
        sig = getattr(signal, SIGNAL, None)
        if sig is None or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(sig) not in (signal.SIG_DFL, None):
            return
        try:
            self._old_handler = signal.signal(sig, lambda signum, frame: self.request())
        except (ValueError, OSError):
            self._old_handler = None

    def remove_signal(self) -> None:
        if self._old_handler is not None:
            signal.signal(getattr(signal, SIGNAL), self._old_handler)
            self._old_handler = None

    def _poll_trigger(self) -> None:
        path = trigger_path(self.out_dir)
        try:
            os.stat(path)
        except OSError:
            return
        try:
            text = path.read_text().strip()
            path.unlink()
        except OSError:
            return
        try:
            self.request(int(text) if text else 5)
        except ValueError:
            warnings.warn(f"profile trigger {path} holds {text!r}: expected a step count or nothing", stacklevel=3)

    # -- called by the Trainer -----------------------------------------------------------------------
    def step_boundary(self, trainer) -> None:
        """After each step (callbacks and saves done) and at fit() start: close a captured step,
        poll the trigger file, start a requested capture."""
        now = time.perf_counter()
        if self.capturing and "t4" in self._t:
            self._t["t5"] = now
            self._open.__exit__(None, None, None)
            self.timers.append(self._t)
            self._t = {}
            self.remaining -= 1
            if self.remaining <= 0:
                self._guarded(self.finish, "finished")
        if now - self._last_poll >= self.poll_every_s:
            self._last_poll = now
            self._poll_trigger()
        if self._request is not None and not self.capturing and self.rt.is_master:
            if trainer._stop or trainer.step >= trainer.total_steps():
                return  # no step follows in this fit(): the request waits for the next one
            steps, out_dir = self._request
            self._request = None
            self._guarded(lambda: self._start(trainer.step, steps, out_dir), "started")

    def _guarded(self, fn, what: str) -> None:
        """A profile that cannot start or finish (another profiler session is running, a full disk)
        warns and is dropped: it never stops the training run."""
        try:
            fn()
        except Exception as e:
            self.capturing, self._t = False, {}
            warnings.warn(f"profile capture could not be {what}: {type(e).__name__}: {e}", stacklevel=3)

    def _start(self, step: int, steps: int, out_dir) -> None:
        root = Path(out_dir or self.out_dir or default_dir())
        self.folder = root / f"step{step:06d}-{time.strftime('%Y%m%d-%H%M%S')}"
        n = 1
        while self.folder.exists():
            n += 1
            self.folder = root / f"step{step:06d}-{time.strftime('%Y%m%d-%H%M%S')}-{n}"
        self.remaining, self.timers, self._t = steps, [], {}
        self.kind = self.rt.kind
        if self.rt.is_xla:
            import torch_xla
            import torch_xla.debug.profiler as xp

            xp.start_trace(str(self.folder))
            self._span = lambda: torch_xla._XLAC.profiler.TraceMe(STEP_SPAN)
        else:
            import torch
            import torch.profiler as tp

            if torch.autograd.profiler._is_profiler_enabled:  # a second session crashes the process at exit
                raise RuntimeError("another torch.profiler session is running; stop it first")
            acts = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if self.kind == "cuda" else [])
            self._torch_prof = tp.profile(activities=acts)
            self._torch_prof.start()
            self._span = lambda: tp.record_function(STEP_SPAN)
        self.folder.mkdir(parents=True)  # after the session started: a refused start leaves no folder
        self.capturing = True

    def before_batch(self) -> None:
        if self._t:  # the last epoch's loader ran out after before_batch: close that span first
            self._open.__exit__(None, None, None)
        self._open = self._span()
        self._open.__enter__()
        self._t = {"t0": time.perf_counter()}

    def after_batch(self) -> None:
        self._t["t1"] = time.perf_counter()

    def before_sync(self) -> None:
        self._t["t2"] = time.perf_counter()

    def after_sync(self, step: int) -> None:
        """The step's graph is launched: wait for the device (captured steps only)."""
        t = self._t
        t["t3"] = time.perf_counter()
        if self.rt.is_xla:
            import torch_xla.core.xla_model as xm

            xm.wait_device_ops()
        elif self.kind == "cuda":
            import torch

            torch.cuda.synchronize()
        t["t4"] = time.perf_counter()
        t["step"] = step

    def finish(self) -> Analysis | None:
        """Stop the capture (also when fit() ends early), write the files, analyse them."""
        if not self.capturing:
            return None
        self.capturing = False
        if self._t:  # a step begun but not finished (loader ran out, an error): drop it
            self._open.__exit__(None, None, None)
            self._t = {}
        if self.rt.is_xla:
            import torch_xla.debug.profiler as xp

            xp.stop_trace()
        else:
            self._torch_prof.stop()
            self._torch_prof.export_chrome_trace(str(self.folder / "trace.json"))
            self._torch_prof = None
        if not self.timers:
            warnings.warn(
                f"fit() ended before a profiled step finished: nothing to analyse in {self.folder}", stacklevel=3
            )
            return None
        (self.folder / "steps.json").write_text(json.dumps({"backend": self.kind, "steps": self.timers}, indent=1))
        a = analyze(self.folder)
        a.save_png(self.folder / "timeline.png")
        (self.folder / "summary.json").write_text(json.dumps(a.summary(), indent=1))
        self.results.append(a)
        return a


# -- reading traces ---------------------------------------------------------------------------------------
def _load_trace(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def trace_files(folder) -> list[Path]:
    """The trace files of one capture folder (XLA: .xplane.pb for TensorBoard and .trace.json.gz; else trace.json)."""
    folder = Path(folder)
    pats = ("plugins/profile/*/*.xplane.pb", "plugins/profile/*/*.trace.json.gz", "trace.json")
    return sorted(Path(p) for pat in pats for p in glob.glob(str(folder / pat)))


def _union(iv):
    out = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        elif b > a:
            out.append([a, b])
    return out


def _measure(iv) -> float:
    return sum(b - a for a, b in _union(iv))


def _clip(iv, lo, hi):
    return [(max(a, lo), min(b, hi)) for a, b in iv if b > lo and a < hi]


def _self_times(events) -> dict:
    """Per-name (self seconds, count) of nested complete events, per thread."""
    out: dict = {}
    by_tid: dict = {}
    for e in events:
        by_tid.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    for evs in by_tid.values():
        evs.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        stack = []  # [end, event, child time]
        for e in evs:
            end = e["ts"] + e.get("dur", 0)
            while stack and stack[-1][0] <= e["ts"]:
                _close(stack.pop(), out)
            if stack:
                stack[-1][2] += min(end, stack[-1][0]) - e["ts"]
            stack.append([end, e, 0.0])
        while stack:
            _close(stack.pop(), out)
    return out


def _close(item, out) -> None:
    end, e, child = item
    s, n = out.get(e["name"], (0.0, 0))
    out[e["name"]] = (s + max(e.get("dur", 0) - child, 0.0) / 1e6, n + 1)


@dataclass
class Analysis:
    """What one capture found. Times are seconds; intervals are (start, end) from the first step's start."""

    folder: Path
    backend: str
    steps: list[dict]  # per step: step, total_s and one *_s per category
    intervals: dict  # category -> [(start, end)], not exclusive (the timeline's rows)
    step_edges: list[float]
    ops: list[tuple] = field(default_factory=list)  # (name, seconds, count), device ops first
    host_ops: list[tuple] = field(default_factory=list)  # host-side events by self time

    def top_ops(self, n: int = 10, host: bool = False) -> list[tuple]:
        return (self.host_ops if host else self.ops)[:n]

    def has_op(self, pattern: str = _MATMUL) -> bool:
        """Whether an op name (device or host) matches the regex (default: a matmul)."""
        rx = re.compile(pattern, re.I)
        return any(rx.search(name) for name, *_ in self.ops + self.host_ops)

    def mean(self) -> dict:
        n = max(len(self.steps), 1)
        return {k: sum(s[k] for s in self.steps) / n for k in ("total_s", *(c + "_s" for c in CATEGORIES))}

    def table(self, n_ops: int = 8) -> str:
        head = f"{'step':>6} {'total ms':>9}" + "".join(f" {c:>10}" for c in CATEGORIES)
        lines = [f"profile of {len(self.steps)} steps ({self.backend}) in {self.folder}", head]
        for s in [*self.steps, {"step": "mean", **self.mean()}]:
            row = f"{s['step']:>6} {1e3 * s['total_s']:9.2f}"
            row += "".join(f" {100 * s[c + '_s'] / max(s['total_s'], 1e-12):9.1f}%" for c in CATEGORIES)
            lines.append(row)
        for title, ops in (("device ops", self.ops), ("host ops (self time)", self.host_ops)):
            if ops:
                lines.append(f"top {title}:")
                lines += [f"  {1e3 * t:9.3f} ms  x{c:<4} {name}" for name, t, c in ops[:n_ops]]
        return "\n".join(lines)

    def summary(self) -> dict:
        return {
            "backend": self.backend,
            "folder": str(self.folder),
            "trace_files": [str(p) for p in trace_files(self.folder)],
            "steps": self.steps,
            "mean": self.mean(),
            "top_ops": [list(o) for o in self.ops[:20]],
            "top_host_ops": [list(o) for o in self.host_ops[:20]],
        }

    def timeline(self, steps: int = 3):
        """A matplotlib Figure: one row per category over the first `steps` steps (not attached to pyplot)."""
        from matplotlib.figure import Figure

        end = self.step_edges[min(steps, len(self.step_edges) - 1)] if self.step_edges else 0.0
        fig = Figure(figsize=(10, 2.8))
        fig.subplots_adjust(left=0.1, right=0.98, bottom=0.18, top=0.9)  # tight_layout costs ~0.5 s here
        ax = fig.add_subplot()
        for row, cat in enumerate(reversed(CATEGORIES)):
            bars = [(1e3 * a, 1e3 * (b - a)) for a, b in _clip(self.intervals.get(cat, []), 0.0, end)]
            ax.broken_barh(bars, (row - 0.4, 0.8), color=COLORS[cat])
        for x in self.step_edges[: steps + 1]:
            ax.axvline(1e3 * x, color="k", lw=0.6, ls=":")
        ax.set_yticks(range(len(CATEGORIES)), [c.replace("_", " ") for c in reversed(CATEGORIES)])
        ax.set_xlim(0, 1e3 * end if end > 0 else 1)
        ax.set_xlabel("ms since the first captured step began (dotted: step boundaries)")
        ax.set_title(f"{self.backend}: {min(steps, len(self.steps))} profiled steps")
        return fig

    def save_png(self, path, steps: int = 3, dpi: int = 80) -> str:
        self.timeline(steps).savefig(path, format="png", dpi=dpi)
        return str(path)


def analyze(folder) -> Analysis:
    """Read a capture folder (labkit's steps.json + the trace) and split each step's time."""
    folder = Path(folder)
    meta_path = folder / "steps.json"
    if not meta_path.exists():
        raise FileNotFoundError(f"{meta_path}: not a labkit profile folder (no steps.json)")
    meta = json.loads(meta_path.read_text())
    backend, timers = meta["backend"], meta["steps"]
    xla = backend in ("tpu", "xla-cpu")
    files = [p for p in trace_files(folder) if p.suffix in (".gz", ".json")]
    if not files:
        raise FileNotFoundError(f"{folder}: no trace file (expected plugins/profile/*/*.trace.json.gz or trace.json)")
    raw = _load_trace(files[-1])
    events = [e for e in raw if e.get("ph") == "X" and "ts" in e]
    # TPU traces put device lines under processes named /device:TPU:N (XLA:CPU has none)
    dev_pids = {
        e.get("pid")
        for e in raw
        if e.get("name") == "process_name" and "/device:" in str(e.get("args", {}).get("name"))
    }
    spans = sorted(e["ts"] for e in events if e["name"] == STEP_SPAN)
    if len(spans) < len(timers) or not timers:
        raise ValueError(f"{files[-1]}: {len(spans)} '{STEP_SPAN}' spans for {len(timers)} timed steps")
    # the trace's clock (us) -> labkit's perf_counter clock (s), from the steps' starts
    offs = sorted(ts / 1e6 - t["t0"] for ts, t in zip(spans, timers))
    off, origin = offs[len(offs) // 2], timers[0]["t0"]

    def iv(e):
        a = e["ts"] / 1e6 - off - origin
        return (a, a + e.get("dur", 0) / 1e6)

    if xla:
        compile_ev = [e for e in events if e["name"] == "XLAGraphExecutor::Compile"]
        dev_ev = [e for e in events if "hlo_op" in e.get("args", {}) and not e["name"].startswith("end: ")]
        dev_ev = dev_ev or [e for e in events if e.get("pid") in dev_pids]
        busy = [e for e in events if e["name"] == "ThunkExecutor::Execute"] or dev_ev
        host_ev = [e for e in events if e.get("tid") == _python_tid(events, spans)]
    else:
        compile_ev = []
        dev_ev = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
        host_ev = [e for e in events if e.get("cat") == "cpu_op"]
        busy = dev_ev if backend == "cuda" else host_ev
    T = [{k: (v - origin if k.startswith("t") else v) for k, v in t.items()} for t in timers]
    intervals = {
        "compile": _union(map(iv, compile_ev)),
        "device": _union(map(iv, busy)),
        "data_wait": _union((t["t0"], t["t1"]) for t in T),
        "host": _union(iv for t in T for iv in ((t["t1"], t["t3"]), (t["t4"], t["t5"]))),
    }
    rows, edges = [], [T[0]["t0"]]
    for t in T:
        lo, hi = t["t0"], t["t5"]
        edges.append(hi)
        row, acc, prev = {"step": t["step"], "total_s": hi - lo}, [], 0.0
        for cat in CATEGORIES[:-1]:
            acc += _clip(intervals[cat], lo, hi)
            m = _measure(acc)
            row[cat + "_s"], prev = m - prev, m
        row["idle_s"] = max(hi - lo - prev, 0.0)
        rows.append(row)
    busy_all = _union(iv for cat in CATEGORIES[:-1] for iv in intervals[cat])
    intervals["idle"] = _gaps(busy_all, [(t["t0"], t["t5"]) for t in T])
    agg: dict = {}
    for e in dev_ev:
        name = re.sub(r"\.\d+$", "", e["name"]) if xla else e["name"]
        s, n = agg.get(name, (0.0, 0))
        agg[name] = (s + e.get("dur", 0) / 1e6, n + 1)
    # ops that start while the loop waits for data are the loader's (collate on CPU), not the step's
    waits = intervals["data_wait"]
    starts = [a for a, _ in waits]

    def in_wait(e):
        i = bisect.bisect_right(starts, iv(e)[0]) - 1
        return i >= 0 and iv(e)[0] < waits[i][1]

    host = _self_times([e for e in host_ev if not in_wait(e)])
    ops = sorted(((k, s, n) for k, (s, n) in agg.items()), key=lambda o: -o[1])
    host_ops = sorted(((k, s, n) for k, (s, n) in host.items() if k != STEP_SPAN), key=lambda o: -o[1])
    if backend == "cpu":  # the host is the device: its ops are the device ops
        ops, host_ops = host_ops, []
    return Analysis(folder, backend, rows, intervals, edges, ops, host_ops)


def _python_tid(events, spans):
    first = spans[0]
    return next(e.get("tid") for e in events if e["name"] == STEP_SPAN and e["ts"] == first)


def _gaps(busy, windows):
    out = []
    for lo, hi in windows:
        cur = lo
        i = bisect.bisect_left([b for _, b in busy], lo)
        for a, b in busy[i:]:
            if a >= hi:
                break
            if a > cur:
                out.append((cur, a))
            cur = max(cur, b)
        if cur < hi:
            out.append((cur, hi))
    return out
