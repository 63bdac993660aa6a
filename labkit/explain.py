"""`labkit.explain()`: torch_xla's metrics report in plain words, with what to do about each finding.

    import labkit
    ...train...
    info = labkit.explain()          # prints a short summary, returns it as a dict
    labkit.explain(open("report.txt").read())   # or a saved met.metrics_report() text

It reads the same host-side counters as the dashboard (no device sync): compile vs execute time,
compiles and recompilations (with the causes the dashboard saw, when one ran), aten:: ops that
fell back to the CPU, and device->host transfers. On CUDA/CPU it says it is not running on XLA.
"""
from __future__ import annotations

import re

from . import xla_health

_TIME = re.compile(r"(\d+(?:\.\d+)?)(ns|us|ms|s|m|h|d)")
_UNIT = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}

# ops that fall back because their output size depends on the data, and the fixed-size form
_DYNAMIC = {"nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive", "index.Tensor"}


def parse_duration(text: str) -> float:
    """Seconds in a metrics-report duration such as "01m16s524ms188.877us".

    The report rounds every unit but the last to the nearest instead of truncating (CompileTime
    with 132,737,647 ns prints as "133ms737.647us"), so a unit followed by more than half a unit
    of smaller ones was rounded up: take the one back."""
    parts = [(float(v), _UNIT[u]) for v, u in _TIME.findall(text)]
    total = 0.0
    for i, (v, unit) in enumerate(parts):
        rest = sum(w * u for w, u in parts[i + 1:])
        total += (v - 1 if i + 1 < len(parts) and v >= 1 and rest > 0.5 * unit else v) * unit
    return total


def parse_report(text: str) -> dict:
    """Counters and metrics out of met.metrics_report() text: {'counters': {...}, 'metrics': {name: (n, seconds)}}."""
    counters, metrics, name, kind = {}, {}, None, None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith(("Counter:", "Metric:")):
            kind, name = line.split(":", 1)
            name = name.strip()
        elif name and kind == "Counter" and line.startswith("Value:"):
            counters[name] = int(float(line.split(":", 1)[1]))
        elif name and kind == "Metric" and line.startswith("TotalSamples:"):
            metrics[name] = (int(float(line.split(":", 1)[1])), 0.0)
        elif name and kind == "Metric" and line.startswith("Accumulator:"):
            acc = line.split(":", 1)[1].strip()
            secs = parse_duration(acc)
            metrics[name] = (metrics.get(name, (0, 0.0))[0], secs)
    return {"counters": counters, "metrics": metrics}


def _from_report(text: str) -> dict:
    p = parse_report(text)
    m, c = p["metrics"], p["counters"]

    def get(name):
        return m.get(name, (0, 0.0))

    return {"compiles": get("CompileTime")[0], "compile_s": get("CompileTime")[1],
            "executions": get("ExecuteTime")[0], "execute_s": get("ExecuteTime")[1],
            "transfers": get("TransferFromDeviceTime")[0], "transfer_s": get("TransferFromDeviceTime")[1],
            "cached_compiles": c.get("CachedCompile", 0),
            "fallbacks": {k: v for k, v in c.items() if k.startswith("aten::")}}


def _advice(d: dict, events: list[dict]) -> list[str]:
    out = []
    if d["compile_s"] > d["execute_s"] and d["compiles"]:
        out.append(f"Compiling took longer than running ({d['compile_s']:.1f} s vs {d['execute_s']:.1f} s). "
                   "Normal for a short run; in a long one it means the graphs keep changing (see below).")
    by_reason: dict[str, list[int]] = {}
    for ev in events:
        by_reason.setdefault(ev["reason"], []).append(ev["step"])
    for reason, steps in by_reason.items():
        fix = ("pad to a fixed batch size or use drop_last=True (the short last batch compiles a new graph); "
               "for variable lengths pad to a few bucket sizes") if "shape" in reason or "dim" in reason else (
               "keep changing Python numbers out of the graph (pass them as device tensors) and avoid branching "
               "on tensor values; PT_XLA_DEBUG_LEVEL=2 prints why each graph compiled")
        out.append(f"Recompiled {len(steps)} time(s) after warm-up (steps {', '.join(map(str, steps[:6]))}"
                   f"{'...' if len(steps) > 6 else ''}): {reason}. Fix: {fix}.")
    if not events and d["compiles"] > 20 and d["compiles"] > 0.1 * max(d["executions"], 1):
        out.append(f"{d['compiles']} graphs compiled for {d['executions']} executions: shapes or Python values "
                   "change between steps. Pad to a fixed batch, use drop_last=True, keep Python numbers out of the graph.")
    for op, n in sorted(d["fallbacks"].items(), key=lambda kv: -kv[1]):
        base = op.split("::", 1)[1]
        why = ("its output size depends on the data; use a fixed-size form (a mask multiply or torch.where "
               "instead of boolean indexing / nonzero / unique)") if base in _DYNAMIC else (
               "no XLA lowering for it here; move it out of the training step or find an equivalent op")
        out.append(f"{op} ran on the CPU {n} time(s): each time the tensors travel to the host and back and "
                   f"the graph is cut. {why[0].upper() + why[1:]}.")
    own = d["transfers"] - sum(d["fallbacks"].values())  # each fallback brings its own transfer
    if own > 10 and own > 0.5 * max(d["executions"], 1):
        out.append(f"{own} device->host transfers (besides the fallbacks) for {d['executions']} executions "
                   f"({d['transfer_s']:.2f} s): something reads tensors every step (.item(), float(t), print, .cpu()). "
                   "Move the read into a step closure (rt.add_step_closure) and read every N steps.")
    if not out:
        out.append("Nothing to fix: no recompilations after warm-up, no CPU fallbacks, few transfers.")
    return out


def explain(report: str | None = None, verbose: bool = True) -> dict:
    """Summarise the XLA metrics of this process (or of `report`, a metrics_report() text)."""
    if report is not None:
        d = _from_report(report)
        events = []
    else:
        from .device import current_runtime

        rt = current_runtime()
        snap = xla_health.snapshot(rt)
        if snap is None:
            where = rt.kind if rt is not None else "no labkit runtime set up"
            d = {"xla": False, "advice": [f"not running on XLA ({where}): nothing to explain; "
                                          "on CUDA use torch.profiler, on CPU time the step directly"]}
            d["text"] = "XLA: " + d["advice"][0]
            if verbose:
                print(d["text"])
            return d
        d = {k: v for k, v in snap.items() if k != "t"}
        mon = xla_health.last_monitor
        events = list(mon.events) if mon is not None else []
    d["xla"] = True
    d["recompiles"] = len(events)
    d["recompile_events"] = events
    d["advice"] = _advice(d, events)
    head = (f"XLA: {d['compiles']} graphs compiled in {d['compile_s']:.2f} s, {d['executions']} executions in "
            f"{d['execute_s']:.2f} s, {d['recompiles']} recompiles after warm-up, "
            f"{sum(d['fallbacks'].values())} CPU fallbacks ({len(d['fallbacks'])} ops), {d['transfers']} device->host transfers")
    d["text"] = head + "\n" + "\n".join(f"- {a}" for a in d["advice"])
    if verbose:
        print(d["text"])
    return d
