"""The XLA diagnosis rules, in one place: the dashboard's warnings and labkit.explain() both use them.

    counts = counts_from(metric_data, counter_value, counter_names)   # one counter -> dict conversion
    for f in findings(counts, steps, events, syncs): print(f.short, "|", f.advice)

Each Finding has a stable key (the dashboard shows each key once and updates it), a short line
for the live panel, and the longer advice with the fix for explain(). The thresholds live here
and nowhere else.
"""

from __future__ import annotations

import math
from typing import NamedTuple

# ops that fall back because their output size depends on the data
DYNAMIC_OPS = {"nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive", "index.Tensor"}
READS_PER_STEP = 0.5  # device->host reads per step (beyond fallbacks and the loop's own) that earn a warning
MIN_READS = 3  # ... and never for fewer than this many in the window
MANY_COMPILES = 20  # compiles with no recompile events seen that still look wrong (explain only)
# share of step time spent waiting for the next batch above which a run is called input-bound: a quarter of
# the chip's time lost to the host; below it the loader keeps up and the meter stays quiet
INPUT_BOUND = 0.25
# ... and at least this many seconds per step: a shorter wait is the loader thread's hand-over (the GIL, a
# queue) in a step of a few ms (measured: 0.6 ms of a 2.3 ms MLP step on XLA:CPU), not a starving chip
MIN_WAIT_S = 0.005

SAME_SHAPES_REASON = (
    "graph changed with the same input shapes (a Python number baked into the graph, "
    "e.g. a float learning rate or step count, or data-dependent Python control flow)"
)


BRANCH_REASON = "graph changed after Python branched on a device value (data-dependent control flow)"
GUARD_REASON = "guard failed"  # torch.compile's recompiles: "guard failed in f (a.py:3): lr == 0.1"
# counted by torch_xla under aten:: but not a fallback: the op behind .item()/bool(t), i.e. a read
NOT_FALLBACKS = ("aten::_local_scalar_dense",)


class Finding(NamedTuple):
    key: str
    short: str
    advice: str


def counts_from(metric_data, counter_value, counter_names) -> dict:
    """The counters labkit reads, as one dict, from any source that answers torch_xla.debug.metrics'
    three questions (the live module, or a parsed metrics_report() text)."""

    def metric(name):
        d = metric_data(name)
        return (d[0], d[1]) if d else (0, 0.0)

    compiles, compile_ns = metric("CompileTime")
    execs, exec_ns = metric("ExecuteTime")
    xfers, xfer_ns = metric("TransferFromDeviceTime")
    fallbacks = {n: counter_value(n) or 0 for n in counter_names() if n.startswith("aten::") and n not in NOT_FALLBACKS}
    return {
        "compiles": compiles,
        "compile_s": compile_ns / 1e9,
        "executions": execs,
        "execute_s": exec_ns / 1e9,
        "transfers": xfers,
        "transfer_s": xfer_ns / 1e9,
        "fallbacks": fallbacks,
        "cached_compiles": counter_value("CachedCompile") or 0,
    }


def _fix_for(reason: str) -> str:
    if reason.startswith(GUARD_REASON):  # torch.compile: Dynamo named the guard that failed
        guard = reason.split(": ", 1)[-1]
        if "size mismatch" in guard or "stride mismatch" in guard or "dtype mismatch" in guard:
            return (
                "keep shapes fixed (pad to a fixed batch size or drop_last=True; bucket variable lengths), or mark "
                "the dimension dynamic (torch._dynamo.mark_dynamic) when it must vary"
            )
        if "___check_obj_id" in guard or "got deallocated" in guard:  # ID_MATCH: Dynamo compiled for one object
            return (
                "an id guard: the code was compiled for one particular object (a module, an optimizer, a function or "
                "a closure) and now sees a different one, e.g. a new optimizer or model built for a second run, or a "
                "function defined again; build such objects once and reuse them, or call torch._dynamo.reset() "
                "before starting over on purpose"
            )
        if "requires_grad mismatch" in guard:
            return (
                "an input requires grad now and did not before (or the reverse), e.g. an activation where data was: "
                "one graph per case is expected; detach the input if its gradient is not needed"
            )
        if "___check_type_id" in guard:  # TYPE_MATCH
            return "a value's type changed between calls (an int where a float was, another class): keep it one type"
        if "==" in guard or "is " in guard:
            return (
                "a Python value the graph was specialised on changed: pass it as a tensor (e.g. torch.tensor(lr) "
                "on the device) or keep it constant"
            )
        return "the guard says what changed between calls: keep it the same from step to step"
    if reason not in (SAME_SHAPES_REASON, BRANCH_REASON):  # an input's shape or dtype changed
        return (
            "pad to a fixed batch size or use drop_last=True (a short last batch compiles a new graph); "
            "for variable lengths pad to a few bucket sizes; keep dtypes fixed"
        )
    return (
        "keep changing Python numbers out of the graph (pass them as device tensors) and avoid branching "
        "on tensor values (torch.where instead of `if t:`)"
    )


def recompile_findings(events: list[dict]) -> list[Finding]:
    by_reason: dict[str, list[dict]] = {}
    for ev in events:
        by_reason.setdefault(ev["reason"], []).append(ev)
    out = []
    for reason, evs in by_reason.items():
        n = len(evs)
        times = "once" if n == 1 else f"{n} times"
        where = next((e["site"] for e in evs if e.get("site")), None)
        at = f" (compiled at {where})" if where else ""
        steps = [e["step"] for e in evs]
        out.append(
            Finding(
                "recompile:" + reason,
                f"recompiled {times} after warm-up: {reason}{at}",
                f"Recompiled {n} time(s) after warm-up (steps {', '.join(map(str, steps[:6]))}"
                f"{'...' if n > 6 else ''}): {reason}{at}. Fix: {_fix_for(reason)}.",
            )
        )
    return out


def break_findings(breaks: list[dict]) -> list[Finding]:
    """torch.compile's graph breaks in the code's own lines (labkit.dashboard.dynamo; torch's own boundaries are
    not passed here): each splits the compiled function in two, with Python running between the graphs."""
    out = []
    for b in breaks:
        why = f" {b['explanation'].rstrip('.')}." if b.get("explanation") else ""
        owner = b.get("owner", "yours")
        if owner == "yours":
            fix = (
                "Fix: move it out of the compiled function, or use a tensor op (torch.where instead of `if t:`; "
                "no print(), .item() or .tolist() inside)."
            )
        elif owner == "labkit":
            fix = "It is in labkit's own code, not yours: nothing for you to change (a labkit bug to report)."
        else:  # inside torch with no caller's line: not proven whose
            fix = "labkit cannot tell whose code this is (no line outside torch is known): nothing is blamed."
        out.append(
            Finding(
                f"break:{b['file']}:{b['line']}",
                f"graph break at {b['site']}: {b['reason']}" + ("" if owner == "yours" else f" ({owner})"),
                f"Graph break at {b['site']}: {b['reason']}.{why} The compiled function splits into two graphs "
                f"here and Python runs in between. {fix}",
            )
        )
    return out


def fallback_findings(fallbacks: dict, steps: int | None, totals: dict | None = None) -> list[Finding]:
    """steps=None: the whole run (explain); else a window of that many steps (the dashboard)."""
    out = []
    for op, n in sorted(fallbacks.items(), key=lambda kv: -kv[1]):
        base = op.split("::", 1)[1] if "::" in op else op
        why = (
            (
                "its output size depends on the data; use a fixed-size form (a mask multiply or torch.where "
                "instead of boolean indexing / nonzero / unique)"
            )
            if base in DYNAMIC_OPS
            else ("no XLA lowering for it here; move it out of the training step or find an equivalent op")
        )
        advice = (
            f"{op} ran on the CPU {n} time(s): each time the tensors travel to the host and back and "
            f"the graph is cut. {why[0].upper() + why[1:]}."
        )
        if steps is not None and n >= steps:
            short = (
                f"{op} falls back to CPU every step ({n} times in the last {steps} steps): "
                "each fallback copies tensors to the host and back and cuts the graph"
            )
        else:
            short = f"{op} fell back to CPU {(totals or {}).get(op, n)} times so far"
        out.append(Finding("fallback:" + op, short, advice))
    return out


def reads_finding(reads: int, steps: int, transfer_s: float | None = None, syncs: dict | None = None) -> list[Finding]:
    """reads: device->host transfers made by the code (fallbacks and labkit's own reads taken out)."""
    steps = max(steps, 1)
    if reads < max(MIN_READS, READS_PER_STEP * steps):
        return []
    lines = ""
    if syncs:
        top = sorted(((n, s) for s, n in syncs.items() if s is not None), key=lambda t: -t[0])[:3]
        lines = "; ".join(f"{s} x{n}" for n, s in top)
    where = f" at {lines}" if lines else " (a .item(), float(t), print(t), `if t:` or .cpu() in the step)"
    took = f" ({transfer_s:.2f} s)" if transfer_s else ""
    return [
        Finding(
            "transfers",
            f"{reads} device->host reads in the last {steps} steps{where}: "
            "each waits for the device; read in a step closure every N steps",
            f"{reads} device->host reads for {steps} steps{took}{where}: each one waits for the device "
            "to finish. Move the read into a step closure (rt.add_step_closure) and read every N steps; "
            "replace `if t:` by torch.where.",
        )
    ]


def findings(
    counts: dict, steps: int | None, events: list[dict], syncs: dict | None = None, loop_reads: int = 0
) -> list[Finding]:
    """Every rule over one set of counts. steps=None: the whole run (use executions as steps)."""
    out = recompile_findings(events)
    if steps is None and counts["compile_s"] > counts["execute_s"] and counts["compiles"]:
        out.insert(
            0,
            Finding(
                "compile_time",
                "compiling took longer than running",
                f"Compiling took longer than running ({counts['compile_s']:.1f} s vs "
                f"{counts['execute_s']:.1f} s). Normal for a short run; in a long one it means the "
                "graphs keep changing (see below).",
            ),
        )
    if (
        steps is None
        and not events
        and counts["compiles"] > MANY_COMPILES
        and counts["compiles"] > 0.1 * max(counts["executions"], 1)
    ):
        out.append(
            Finding(
                "many_compiles",
                f"{counts['compiles']} graphs compiled",
                f"{counts['compiles']} graphs compiled for {counts['executions']} executions: shapes or "
                "Python values change between steps. Pad to a fixed batch, use drop_last=True, keep "
                "Python numbers out of the graph.",
            )
        )
    out += fallback_findings(counts["fallbacks"], steps)
    window = steps if steps is not None else counts["executions"]
    reads = counts["transfers"] - loop_reads - sum(counts["fallbacks"].values())
    out += reads_finding(reads, window, counts.get("transfer_s") if steps is None else None, syncs)
    return out


def cores_needed(wait_s: float, step_s: float, workers: int) -> float:
    """Host cores that would feed the chip at the step's own pace, from the feed meter's figures. Input-bound, the
    loader's processes (num_workers, or the loop's own process for 0) decode flat out and deliver one batch per
    step_s; the chip alone would take one per step_s - wait_s. So each core gives batch / step_s / workers images/s,
    the chip asks batch / (step_s - wait_s), and their quotient is workers x step_s / (step_s - wait_s)."""
    busy = step_s - wait_s
    return max(workers, 1) * step_s / busy if busy > 0 else math.inf


def feed_finding(
    wait_frac, wait_s=None, step_s=None, workers=None, images_per_s=None, in_memory=False
) -> list[Finding]:
    """The feed meter's verdict (labkit.steplog): input-bound when the loop waited for data for at least
    INPUT_BOUND of its time and MIN_WAIT_S per step; nothing otherwise (or when the share is unknown). Knowing the
    loader's `workers` (0: the loop's own process), it says how many host cores one chip needs at this step's pace
    (cores_needed), and with the run's `images_per_s` what each core gives now. `in_memory`: the batches were made
    before the run (a list), so nothing decodes: the wait is the copy to the device or a host too busy to make it,
    and workers, smaller or pre-resized images cannot shorten it; the advice says that instead."""
    if wait_frac is None or wait_frac < INPUT_BOUND or (wait_s is not None and wait_s < MIN_WAIT_S):
        return []
    per = f" ({wait_s:.3g} s of {step_s:.3g} s per step)" if wait_s is not None and step_s else ""
    if in_memory:
        short = (
            f"waiting for data: {100 * wait_frac:.0f} % of step time{per}, with the batches already in memory: "
            "the copy to the device, or a busy host"
        )
        advice = (
            f"{short}. Nothing decodes here, so more workers or smaller images cannot help. The wait is the batch's "
            "copy to the device, or the loader's thread waiting for a host core that other work holds: check the "
            "machine's load, and that the device copy runs ahead (DeviceLoader)."
        )
        return [Finding("waiting_in_memory", short, advice)]
    cores = ""
    if workers is not None and wait_s is not None and step_s:
        need = cores_needed(wait_s, step_s, workers)
        procs = f"{workers} worker{'s' if workers != 1 else ''}" if workers else "the loop's own process"
        each = f", {images_per_s / max(workers, 1):,.0f} images/s each" if images_per_s else ""
        cores = f" One chip needs about {math.ceil(need - 1e-9)} host cores decoding at this rate ({procs} now{each})."
    short = (
        f"input-bound: {100 * wait_frac:.0f} % of step time waiting for data{per}: "
        "add workers, pre-resize the shards, or smaller images"
    )
    advice = (
        f"{short}. The chip idles while the host decodes: raise make_loader's num_workers "
        "(one per free host core: num_workers='auto'), store images near the size you train at, or lower image_size; "
        f"bench/bench_feed.py measures images/s per core.{cores}"
    )
    return [Finding("input_bound", short, advice)]
