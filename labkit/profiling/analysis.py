"""Read a captured trace back and split each step's time (after Holistic Trace Analysis), and rank its ops.

    a = labkit.profiling.analyze("profiles/step000120-20261123-201500")
    a.table(); a.top_ops(); a.timeline()

The split of each step (`Analysis.steps`) is exclusive, each instant going to the first category that
covers it: data wait (labkit's own timer around next(loader), the wait for the prefetch queue), compile
(XLA's `XLAGraphExecutor::Compile` events), device (XLA: the HLO ops of the trace, on XLA:CPU the PjRt
client's `ThunkExecutor::Execute`; CUDA: kernels and copies; CPU: aten ops, since there the host is the
device), host (the loop's own Python: on XLA building the lazy graph and cutting it; also the callbacks
after the step) and idle (the rest: waiting for nothing the trace shows). A step runs from asking for its
batch to the end of its callbacks. Holistic Trace Analysis (HTA) splits GPU time into idle, compute and
non-compute (and its idle into host-wait and kernel-wait); device, idle and host here follow it, while data
wait and compile are labkit's own. HTA reads only torch.profiler's GPU traces, so this is a small split of its
own that also reads XLA's Chrome trace.

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
import re
from dataclasses import dataclass, field
from pathlib import Path

CATEGORIES = ("data_wait", "compile", "device", "host", "idle")  # the split's priority order
COLORS = {"compile": "#d62728", "device": "#2ca02c", "data_wait": "#1f77b4", "host": "#ff7f0e", "idle": "#c7c7c7"}
STEP_SPAN = "labkit_step"  # the span labkit puts around each captured step in the trace (aligns clocks)
_MATMUL = r"addmm|\bmm\b|aten::mm|bmm|matmul|linear|\bdot|gemm"


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


def _self_events(events) -> list[dict]:
    """Each nested complete event with its self time (its duration less its children's, per thread), as
    {"name", "ts", "dur_us"}: what an op cost by itself, not counting the ops it called."""
    out: list = []
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
    out.append({"name": e["name"], "ts": e["ts"], "dur_us": max(e.get("dur", 0) - child, 0.0)})


def op_name(name: str) -> str:
    """The kind of an XLA instruction: its name without XLA's number (`fusion.3` -> `fusion`). Only for a
    summary by kind: each numbered name is an instruction of its own (see rank_ops)."""
    return re.sub(r"\.\d+$", "", name)


def rank_ops(events, numbered: bool = False) -> list[tuple]:
    """(name, seconds, count) per instruction, slowest first: the sum of each execution's `dur_us`.

    On XLA each name is one instruction of the compiled graph: `fusion.3` and `fusion.7` are two fusions, each
    calling its own fused computation (different ops, shapes and costs), so they are ranked apart; summing
    them into `fusion` would put "fusion" first on almost any TPU profile and say nothing. numbered=True
    gives that summary by kind anyway (`op_name`). A name is unique within one compiled module; a capture
    that ran two graphs may hold the same name twice (each module numbers its own), and those are summed."""
    agg: dict = {}
    for e in events:
        name = op_name(e["name"]) if numbered else e["name"]
        s, n = agg.get(name, (0.0, 0))
        agg[name] = (s + e["dur_us"] / 1e6, n + 1)
    return sorted(((k, s, n) for k, (s, n) in agg.items()), key=lambda o: -o[1])


@dataclass
class Analysis:
    """What one capture found. Times are seconds; intervals are (start, end) from the first step's start."""

    folder: Path
    backend: str
    steps: list[dict]  # per step: step, total_s and one *_s per category
    intervals: dict  # category -> [(start, end)], not exclusive (the timeline's rows)
    step_edges: list[float]
    ops: list[tuple] = field(default_factory=list)  # (instruction, seconds, count), slowest first
    host_ops: list[tuple] = field(default_factory=list)  # host-side events by self time
    # every execution `ops` adds up, {"name", "ts" (us, the trace's clock), "dur_us"} (+ "module" on XLA: the
    # compiled graph it belongs to): device ops on XLA and CUDA (their duration), aten ops with their self
    # time on the CPU (there the host is the device)
    op_events: list[dict] = field(default_factory=list, repr=False)

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

    def timeline(self, steps: int | None = None):
        """A matplotlib Figure: one row per category over the first `steps` captured steps (default: all of
        them; not attached to pyplot). Each step is labelled with its number and length, and a step that
        spent most of its time compiling says so: one compile can be ten times a steady step."""
        from matplotlib.figure import Figure

        shown = len(self.steps) if steps is None else min(steps, len(self.steps))
        end = self.step_edges[min(shown, len(self.step_edges) - 1)] if self.step_edges else 0.0
        fig = Figure(figsize=(10, 3.0))
        fig.subplots_adjust(left=0.1, right=0.98, bottom=0.18, top=0.84)  # tight_layout costs ~0.5 s here
        ax = fig.add_subplot()
        for row, cat in enumerate(reversed(CATEGORIES)):
            bars = [(1e3 * a, 1e3 * (b - a)) for a, b in _clip(self.intervals.get(cat, []), 0.0, end)]
            ax.broken_barh(bars, (row - 0.4, 0.8), color=COLORS[cat])
        for x in self.step_edges[: shown + 1]:
            ax.axvline(1e3 * x, color="k", lw=0.6, ls=":")
        for s, a, b in zip(self.steps[:shown], self.step_edges, self.step_edges[1:]):
            label = f"step {s['step']}: {1e3 * (b - a):.0f} ms"
            if s.get("compile_s", 0) > 0.5 * max(b - a, 1e-9):
                label += f"\n({1e3 * s['compile_s']:.0f} ms compiling)"
            ax.text(1e3 * (a + b) / 2, len(CATEGORIES) - 0.4, label, ha="center", va="bottom", fontsize=7)
        ax.set_yticks(range(len(CATEGORIES)), [c.replace("_", " ") for c in reversed(CATEGORIES)])
        ax.set_ylim(-0.6, len(CATEGORIES) + 0.4)
        ax.set_xlim(0, 1e3 * end if end > 0 else 1)
        ax.set_xlabel("ms since the first captured step began (dotted: step boundaries)")
        of = f"{shown} of {len(self.steps)}" if shown < len(self.steps) else f"all {shown}"
        ax.set_title(f"{self.backend}: {of} profiled steps", pad=4)
        return fig

    def save_png(self, path, steps: int | None = None, dpi: int = 80) -> str:
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
    dev_events = [{"name": e["name"], "ts": e["ts"], "dur_us": float(e.get("dur", 0)), **_module(e)} for e in dev_ev]
    # ops that start while the loop waits for data are the loader's (collate on CPU), not the step's
    waits = intervals["data_wait"]
    starts = [a for a, _ in waits]

    def in_wait(e):
        i = bisect.bisect_right(starts, iv(e)[0]) - 1
        return i >= 0 and iv(e)[0] < waits[i][1]

    host_events = [e for e in _self_events([e for e in host_ev if not in_wait(e)]) if e["name"] != STEP_SPAN]
    if backend == "cpu":  # the host is the device: its ops are the device ops
        dev_events, host_events = host_events, []
    ops, host_ops = rank_ops(dev_events), rank_ops(host_events)
    return Analysis(folder, backend, rows, intervals, edges, ops, host_ops, dev_events)


def _module(e) -> dict:
    m = e.get("args", {}).get("hlo_module")
    return {"module": m} if m else {}


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
