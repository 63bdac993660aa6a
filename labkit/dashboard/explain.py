"""`labkit.explain()`: torch_xla's metrics report in plain words, with what to do about each finding.

    import labkit
    ...train...
    info = labkit.explain(dash)      # prints a short summary, returns it as a dict
    labkit.explain(open("report.txt").read())   # or a saved met.metrics_report() text
    rec = CompileRecord(); ...compile...; labkit.explain(rec)   # off XLA: only what ran since rec started

Given the Dashboard, it counts the run that Dashboard watched (its fits, from their start to their end): graphs
that other cells compiled in the same process, an exercise check or a demo, are not the run's and earn no advice.
Without one it reads the whole process and says so. Compiling longer than running is said as a note, not advice.
It reads the same host-side counters as the dashboard (no device sync): compile vs execute time,
compiles and recompilations (with the causes and lines the dashboard saw, when given one), aten:: ops that
fell back to the CPU, and device->host transfers. On CUDA/CPU it reads torch.compile's record instead
(labkit.dashboard.dynamo): frames compiled and the time it took, each recompile with the guard that failed and its
line, graph breaks in your code with their reason and line, and torch's own boundaries named apart. Given
the Dashboard, it also says whether the run was input-bound (the feed meter of labkit.steplog, over the
whole run but its first log interval, which holds the compiles and the loader's start).
"""

from __future__ import annotations

import re

from labkit.dashboard import health as xla_health
from labkit.dashboard.rules import (
    GUARD_REASON,
    _fix_for,
    break_findings,
    counts_from,
    feed_finding,
    findings,
    recompile_findings,
)

_TIME = re.compile(r"(\d+(?:\.\d+)?)(ns|us|ms|s|m|h|d)")
_UNIT = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """Seconds in a metrics-report duration such as "01m16s524ms188.877us".

    The report rounds every unit but the last to the nearest instead of truncating (CompileTime
    with 132,737,647 ns prints as "133ms737.647us"), so a unit followed by more than half a unit
    of smaller ones was rounded up: take the one back."""
    parts = [(float(v), _UNIT[u]) for v, u in _TIME.findall(text)]
    total = 0.0
    for i, (v, unit) in enumerate(parts):
        rest = sum(w * u for w, u in parts[i + 1 :])
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
    # parse_report keeps seconds; counts_from expects torch_xla's nanoseconds
    return counts_from(lambda n: (m[n][0], m[n][1] * 1e9) if n in m else None, c.get, lambda: list(c))


def _events_of(source) -> tuple[list[dict], dict]:
    """Recompile events and per-line reads from a Dashboard or a HealthMonitor (or nothing)."""
    health = getattr(source, "health", source)
    if health is None:
        return [], {}
    finder = getattr(health, "finder", None)
    return list(getattr(health, "events", [])), (dict(finder.total) if finder is not None else {})


def feed_of(source) -> dict | None:
    """The feed meter over a Dashboard's history: {"data_wait_frac", "data_wait_s", "step_s"} (per step),
    None without one. Each interval counts by its steps; the first is left out when there are more."""
    rows = list(getattr(source, "history", None) or [])
    pairs = [(a, b) for a, b in zip([None] + rows, rows) if "data_wait_frac" in b]
    if len(pairs) > 1:
        pairs = pairs[1:]
    if not pairs:
        return None
    steps = [max(b["step"] - (a["step"] if a else 0), 1) for a, b in pairs]
    wait = sum(b["data_wait_s"] * n for (_, b), n in zip(pairs, steps))
    wall = sum(b["step_s"] * n for (_, b), n in zip(pairs, steps))
    frac = wait / wall if wall > 0 else 0.0
    rates = [b["examples_per_s"] for _, b in pairs if isinstance(b.get("examples_per_s"), (int, float))]
    return {
        "data_wait_frac": frac,
        "data_wait_s": wait / sum(steps),
        "step_s": wall / sum(steps),
        "workers": pairs[-1][1].get("data_workers"),  # the host loader's num_workers (None: not a DataLoader)
        "images_per_s": sum(rates) / len(rates) if rates else None,
        "in_memory": bool(pairs[-1][1].get("data_in_memory")),  # a list of batches: no loader to speed up
    }


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def recompile_lines(recs: list[dict]) -> list[str]:
    """One line per recompile site: recompiles of one frame whose guards differ only in their numbers (a float
    that changes every step, an object id) are one cause, said once with how many times and each guard's text."""
    from labkit.dashboard.dynamo import recompile_text

    groups: dict = {}
    for e in recs:
        key = (e["frame"], e.get("guard_site") or e.get("call"), _NUMBER.sub("#", e["guard"]))
        groups.setdefault(key, []).append(e)
    out = []
    for evs in groups.values():
        first, n = evs[0], len(evs)
        guards = ", then ".join(dict.fromkeys(e["guard"] for e in evs))
        times = "" if n == 1 else f" ({n} times)"
        text = recompile_text(dict(first, guard=guards))
        out.append(f"Recompile{times}: {text}. Fix: {_fix_for(GUARD_REASON + ': ' + first['guard'])}.")
    return out


def _explain_compiled(source, rt, events, fed, feed, verbose) -> dict:
    """Off XLA: torch.compile's record, the Dashboard's (from its first step) or the whole process's."""
    from labkit.dashboard.dynamo import CompileRecord

    health = getattr(source, "health", source)
    record = health if isinstance(health, CompileRecord) else getattr(health, "record", None)
    if isinstance(health, CompileRecord):
        health = None  # a bare record: what it saw since it started, no warm-up to leave out
    if record is None:  # read the process's record and let go of torch's logger at once
        with CompileRecord(since_process_start=True) as record:
            pass
    s = record.snapshot()
    where = rt.kind if rt is not None else "no labkit runtime set up"  # shown, not tested: the backend's name
    recs = record.recompiles()
    breaks = record.breaks("yours") + record.breaks("labkit")
    own, unknown = record.breaks("torch"), record.breaks("unknown")
    d = dict(s, xla=False, engine="torch.compile", feed=feed, status=record.status)
    d["recompile_events"] = events or [dict(e, reason=f"{GUARD_REASON} in {e['frame']}: {e['guard']}") for e in recs]
    d["breaks"], d["torch_breaks"], d["unknown_breaks"] = breaks, own, unknown
    if not (s["compiles"] or breaks or own or unknown):
        d["advice"] = [
            f"not running on XLA ({where}) and nothing was compiled with torch.compile here: nothing to explain; "
            "on CUDA use torch.profiler, on CPU time the step directly"
        ] + [f.advice for f in fed]
        d["text"] = "\n- ".join(d["advice"])
        if verbose:
            print(d["text"])
        return d
    found = recompile_findings(events) if events else []
    advice = [f.advice for f in fed + found + break_findings(breaks + unknown)]
    if not events:  # no Dashboard: every recompile the record saw, each once, with its guard, line and fix
        advice += recompile_lines(recs)
    notes = [f"torch's own boundary (not yours, nothing to fix) at {b['site']}: {b['torch_boundary']}." for b in own]
    if s["failed"]:
        advice.append(f"Dynamo gave up on {s['failed']} frame(s): they run eagerly ({record.status}).")
    d["advice"] = advice or ["Nothing to fix: no recompiles, no graph breaks in your code."]
    d["notes"] = notes
    d["text"] = (
        f"not running on XLA ({where}): torch.compile compiled {s['compiles']} frames in {s['compile_s']:.2f} s, "
        f"{len(d['recompile_events'])} recompiles{' after warm-up' if events or health is not None else ''}, "
        f"graph breaks: yours: {len(record.breaks('yours'))}, labkit's: {len(record.breaks('labkit'))}, "
        f"torch's own: {len(own)}"
        + (f", not known whose: {len(unknown)}" if unknown else "")
        + "\n"
        + "\n".join(f"- {a}" for a in d["advice"] + notes)
    )
    if verbose:
        print(d["text"])
    return d


def explain(source=None, verbose: bool = True, report: str | None = None, rt=None) -> dict:  # rt: or the source's
    """Summarise the XLA metrics of this process (or of `report`, a metrics_report() text).

    source: a CompileRecord (labkit.dashboard.dynamo): torch.compile's record since it started, nothing else.
    Or the Dashboard (or its HealthMonitor) that watched the run: then each recompilation
    comes with what changed and the line that compiled it, and the read warning names the lines
    that read from the device. (A metrics_report() text may also be passed first, as before.)
    rt: the Runtime labkit.setup() returned, when no Dashboard is passed."""
    if isinstance(source, str):
        source, report = None, source
    from labkit.dashboard.dynamo import CompileRecord

    if isinstance(source, CompileRecord):  # torch.compile's record from where it started, nothing else
        return _explain_compiled(source, rt, [], [], None, verbose)
    events, syncs = _events_of(source)
    feed = feed_of(source)
    keys = ("data_wait_frac", "data_wait_s", "step_s", "workers", "images_per_s")
    fed = feed_finding(*(feed[k] for k in keys), in_memory=feed.get("in_memory", False)) if feed else []
    if report is not None:
        d = _from_report(report)
    else:
        if rt is None:  # the run's own Runtime: the Dashboard's (or HealthMonitor's) when given one
            rt = getattr(getattr(source, "health", source), "rt", None)
        health = getattr(source, "health", source)
        run = health.run_counts() if isinstance(health, xla_health.HealthMonitor) else None
        snap = run if run is not None else xla_health.snapshot(rt)
        if snap is None and (rt is None or not rt.reads_metrics):
            return _explain_compiled(source, rt, events, fed, feed, verbose)
        if snap is None:
            where = rt.kind if rt is not None else "no labkit runtime set up"  # shown, not tested: the backend's name
            d = {
                "xla": False,
                "feed": feed,
                "advice": [
                    f"not running on XLA ({where}): nothing to explain; "
                    "on CUDA use torch.profiler, on CPU time the step directly"
                ]
                + [f.advice for f in fed],
            }
            d["text"] = "XLA: " + "\n- ".join(d["advice"])
            if verbose:
                print(d["text"])
            return d
        d = {k: v for k, v in snap.items() if k != "t"}
        d["scope"] = "run" if run is not None else "process"
    d["xla"] = True
    d["recompiles"] = len(events)
    d["recompile_events"] = events
    d["syncs"] = {str(k): v for k, v in syncs.items()}
    d["feed"] = feed
    # the loop's own reads: one per log interval and one per evaluation (a Dashboard keeps both)
    own_reads = len(getattr(source, "history", None) or []) + len(getattr(source, "evals", None) or [])
    found = fed + findings(d, None, events, syncs, loop_reads=own_reads)
    # compiling longer than running is a fact about a short run, not a fault: said as a note, never as advice
    d["notes"] = [f.advice for f in found if f.key == "compile_time"]
    d["advice"] = [f.advice for f in found if f.key != "compile_time"]
    whose = {"run": "the run the dashboard watched", "process": "this process"}.get(d.get("scope"), "the report")
    head = (
        f"XLA, {whose}: {d['compiles']} graphs compiled in {d['compile_s']:.2f} s, {d['executions']} executions in "
        f"{d['execute_s']:.2f} s, {d['recompiles']} recompiles after warm-up, "
        f"{sum(d['fallbacks'].values())} CPU fallbacks ({len(d['fallbacks'])} ops), {d['transfers']} device->host transfers"
    )
    verdict = (
        []
        if d["advice"]
        else [
            "Nothing to fix: no recompilations after warm-up, no CPU fallbacks, few transfers"
            + (", and the loader keeps up." if feed else ".")
        ]
    )
    d["text"] = head + "\n" + "\n".join(f"- {a}" for a in d["advice"] + verdict + d["notes"])
    if verbose:
        print(d["text"])
    return d
