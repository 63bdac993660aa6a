"""XLA health while training: compiles, recompilations and why, CPU fallbacks, transfers, memory.

    mon = HealthMonitor(rt, warmup_steps=2)
    mon.on_step(step, batch)        # every step, after rt.sync(): host-side shapes + a counter read
    info = mon.interval(steps=20)   # every log interval: what happened since the last call

Everything here reads torch_xla.debug.metrics, a registry of counters kept on the host by
torch_xla's C++ runtime: reading it never executes a graph and never copies from the device
(checked in tests/test_xla_health.py). The batch shapes come from tensor metadata, which lazy
tensors hold on the host too. Costs: ~1 us per step (one counter read, one tuple of shapes),
~50 us per interval (listing the counters). On CUDA/CPU the XLA parts read as None.

A compile after warm-up is a recompilation. Its usual cause is an input shape that differs from
the warm-up shapes (a short last batch, variable sequence lengths); when the shapes match, the
graph itself changed (a Python number baked into the graph, data-dependent Python control flow).
Each recompilation event names the inputs that changed (old -> new shape and dtype) and, when a
labkit.dashboard.syncs.SyncFinder is active (the Dashboard runs one on XLA), the user's line that made XLA
compile: a read in the step (`if t:`, `.item()`) or the sync that ended it. The rules that turn
these numbers into warnings live in labkit.dashboard.rules (shared with labkit.dashboard.explain).

Off XLA the same monitor reads torch.compile's own record instead (labkit.dashboard.dynamo.CompileRecord; the runtime's
`reads_metrics` chooses): frames compiled and their compile time per interval, each recompile after warm-up with the
guard that failed and its line, graph breaks in the code's own lines (torch's own boundaries listed apart, never
warned about), and on CUDA the host syncs per line (labkit.dashboard.cuda_syncs, given as `host_syncs`). The interval
dict then has engine="torch.compile", breaks=[...], torch_breaks=[...]; on XLA engine="xla".
"""

from __future__ import annotations

import sys
import time
from collections import Counter

from labkit.dashboard.rules import (
    BRANCH_REASON,
    GUARD_REASON,
    SAME_SHAPES_REASON,
    break_findings,
    counts_from,
    findings,
    reads_finding,
    recompile_findings,
)
from labkit.dashboard.shapes import describe_change, input_changes, shape_signature  # noqa: F401  (also here)

_BRANCH_READS = ("__bool__", "__int__", "__index__", "__float__", "item")  # reads whose value steers Python


def _met():
    """torch_xla.debug.metrics if torch_xla is already imported, else None (never imports it:
    importing torch_xla on a CUDA machine would start a PJRT client for nothing)."""
    if "torch_xla" not in sys.modules:
        return None
    import torch_xla.debug.metrics as met

    return met


def snapshot(rt) -> dict | None:
    """Totals so far in this process, or None when the backend keeps no torch_xla metrics. Host-only.
    rt None (no labkit runtime, e.g. labkit.explain() on a bare torch_xla session): whatever torch_xla counted."""
    if rt is not None and not rt.reads_metrics:
        return None
    met = _met()
    if met is None:
        return None
    out = counts_from(met.metric_data, met.counter_value, met.counter_names)
    out["t"] = time.perf_counter()
    return out


def counts_between(now: dict, prev: dict) -> dict:
    """What happened between two snapshots: each count and time of `now` less `prev` (fallbacks per op, only
    the ops that moved)."""
    out = {k: now[k] - prev.get(k, 0) for k in now if k not in ("fallbacks", "t")}
    out["fallbacks"] = {
        k: v - prev["fallbacks"].get(k, 0) for k, v in now["fallbacks"].items() if v - prev["fallbacks"].get(k, 0) > 0
    }
    return out


def counts_plus(a: dict, b: dict) -> dict:
    """Two stretches of counts (counts_between) as one."""
    out = {k: a.get(k, 0) + b[k] for k in b if k != "fallbacks"}
    ops = set(a.get("fallbacks", {})) | set(b["fallbacks"])
    out["fallbacks"] = {k: a.get("fallbacks", {}).get(k, 0) + b["fallbacks"].get(k, 0) for k in ops}
    return out


def compile_count() -> int:
    """Graphs compiled so far (UncachedCompile): one counter read, for per-step use."""
    met = _met()
    return (met.counter_value("UncachedCompile") or 0) if met is not None else 0


def device_memory(rt) -> dict | None:
    """{'used': bytes, 'limit': bytes or None, 'peak': bytes or None}, or None where unknown: the backend's
    (labkit.runtime: memory()). TPU: xm.get_memory_info; CUDA: torch's allocator; XLA:CPU and CPU: nothing."""
    return rt.memory()


class HealthMonitor:
    """Watches compiles per step and XLA counters per interval; produces warnings in plain words.

    finder: a labkit.dashboard.syncs.SyncFinder that is active during training (the Dashboard starts one):
    then each recompilation also names the user line that triggered it, and the transfer warning
    names the lines that read from the device."""

    def __init__(self, rt, warmup_steps: int = 2, finder=None, host_syncs=None):
        self.rt = rt
        self.enabled = bool(rt is not None and rt.reads_metrics)
        # off XLA: torch.compile's record (process-wide; this monitor reads what happens from now on)
        self.record = None
        if rt is not None and not rt.reads_metrics:
            from labkit.dashboard.dynamo import CompileRecord

            self.record = CompileRecord()
        self.host_syncs = host_syncs  # labkit.dashboard.cuda_syncs.HostSyncCounter on CUDA, else None
        self._last_compiled = self.record.snapshot() if self.record is not None else None
        self.warmup_steps = warmup_steps
        self.finder = finder
        self.warm_shapes: Counter = Counter()  # signature -> steps seen during warm-up
        self.steps_seen = 0
        self.events: list[dict] = []  # recompilations after warm-up
        self.syncs: dict = {}  # Site -> device->host reads in the last interval
        self._last_compiles = compile_count() if self.enabled else 0
        self._last = snapshot(rt)
        # the watched run's own counts: what happened while a fit() was open, from this monitor's start, and
        # nothing that other cells compiled or ran in the same process before, between or after its fits
        self.run: dict | None = None
        self._watching = self._last is not None
        self._new_events: list[dict] = []
        self.warnings: dict[str, str] = {}  # key -> current message (insertion ordered)
        self._memory_ok = True

    # per step ----------------------------------------------------------------------------
    def on_step(self, step: int, batch) -> None:
        """Call after the step's rt.sync(): XLA compiles synchronously inside sync, so a change
        of the counter since the previous call belongs to this step."""
        if self.record is not None:
            self._on_compiled_step(step, batch)
            return
        if not self.enabled:
            return
        sig = shape_signature(batch)
        c = compile_count()
        new = c - self._last_compiles
        self._last_compiles = c
        self.steps_seen += 1
        sites, reads = self.finder.take_compiles() if self.finder is not None else ([], [])
        if self.steps_seen <= self.warmup_steps:  # counted from here, not from step 0: resumes warm up too
            self.warm_shapes[sig] += 1
            return
        if new > 0:
            ref = self.warm_shapes.most_common(1)[0][0] if self.warm_shapes else sig
            known = sig in self.warm_shapes
            reason = describe_change(ref, sig) if not known else SAME_SHAPES_REASON
            # the line that made XLA compile: a read in the user's step (`if t:`, .item()) when there
            # is one, else the sync that ended the step
            hit = next((s for s in sites if s["via"] not in ("sync", "mark_step")), sites[0] if sites else None)
            branch = next((r for r in reads if r[1] in _BRANCH_READS and r[0] is not None), None)
            if known and branch is not None:
                # same inputs, a new graph, and the step branched on a device value: that branch
                # chose the new graph (the compile itself happens later, at the sync)
                reason = BRANCH_REASON
                hit = {"site": branch[0], "via": branch[1]}
            ev = {
                "step": step,
                "compiles": new,
                "reason": reason,
                "shapes": [list(s) for _, s, _ in sig],
                "changes": [] if known else input_changes(ref, sig),
                "site": str(hit["site"]) if hit and hit["site"] else None,
                "via": hit["via"] if hit else None,
            }
            self.events.append(ev)
            self._new_events.append(ev)

    def _on_compiled_step(self, step: int, batch) -> None:
        """torch.compile compiles inside the call, so the record's new events belong to this step."""
        sig = shape_signature(batch)
        new = self.record.take()
        self.steps_seen += 1
        if self.steps_seen <= self.warmup_steps:
            self.warm_shapes[sig] += 1
            return
        for e in new:
            if e["kind"] != "compile" or not e["guard"]:
                continue
            known = sig in self.warm_shapes
            ref = self.warm_shapes.most_common(1)[0][0] if self.warm_shapes else sig
            ev = {
                "step": step,
                "compiles": 1,
                "reason": f"{GUARD_REASON} in {e['frame']}: {e['guard']}",
                "guard": e["guard"],
                "frame": e["frame"],
                "shapes": [list(s) for _, s, _ in sig],
                "changes": [] if known else input_changes(ref, sig),
                "site": e["guard_site"] or e["call"],
                "via": "recompile",
            }
            self.events.append(ev)
            self._new_events.append(ev)

    def open(self) -> None:
        """Listen to torch.compile again (a second fit()); the first is open from the start. On XLA: count again
        from here, so what ran between the two fits is not the run's."""
        if self.record is not None:
            self.record.open()
        if self.enabled and not self._watching:
            self._last = snapshot(self.rt)
            self._last_compiles = compile_count()
            self._watching = self._last is not None

    def close(self) -> None:
        """Detach from torch's structured trace (fit() returned or raised); the record stays readable. On XLA:
        the run's counts take in what happened since the last interval (the last evaluation) and stop there."""
        if self.record is not None:
            self.record.close()
        if self.enabled and self._watching:
            now = snapshot(self.rt)
            if now is not None and self._last is not None:
                self._add_to_run(counts_between(now, self._last))
                self._last = now
            self._watching = False

    def _add_to_run(self, delta: dict) -> None:
        self.run = delta if self.run is None else counts_plus(self.run, delta)

    def run_counts(self) -> dict | None:
        """XLA's counts for the run this monitor watched (its fits, from on_train_begin to on_fit_end), in
        snapshot()'s keys; None off XLA. Host-only, like snapshot()."""
        if not self.enabled or self._last is None:
            return None
        run = self.run
        if self._watching:  # a fit still open: add what happened since the last interval
            now = snapshot(self.rt)
            if now is not None:
                d = counts_between(now, self._last)
                run = d if run is None else counts_plus(run, d)
        if run is None:
            zero = {k: 0 for k in snapshot(self.rt) or {} if k not in ("fallbacks", "t")}
            run = dict(zero, fallbacks={})
        return run

    def resync(self) -> None:
        """Forget compiles since the last step (e.g. evaluation graphs): they are not recompilations."""
        if self.record is not None:
            self.record.take()
        if self.enabled:
            self._last_compiles = compile_count()
            if self.finder is not None:
                self.finder.take_compiles()

    # per interval ------------------------------------------------------------------------
    def interval(self, steps: int) -> dict:
        """Counters since the previous call, totals, memory and the current warnings."""
        out = {
            "xla": self.enabled,
            "engine": "xla" if self.enabled else None,
            "compiles": None,
            "compile_s": None,
            "graphs_total": None,
            "transfers": None,
            "fallbacks": {},
            "recompiles": len(self.events),
            "new_recompiles": self._new_events,
            "memory": self._memory(),
            "syncs": [],
        }
        self._new_events = []
        if self.record is not None:
            return self._compiled_interval(out, steps)
        now = snapshot(self.rt)
        if now is not None and self._last is not None:
            d = counts_between(now, self._last)
            self._add_to_run(d)
            out.update(
                compiles=d["compiles"],
                compile_s=d["compile_s"],
                graphs_total=self.run["compiles"],  # the run's, not the process's: other cells compile too
                transfers=d["transfers"],
                execute_s=d["execute_s"],
            )
            out["fallbacks"] = d["fallbacks"]
            self._last = now
            self.syncs = self.finder.take() if self.finder is not None else {}
            out["syncs"] = [
                (str(s) if s is not None else "(no user frame)", n)
                for s, n in sorted(self.syncs.items(), key=lambda kv: -kv[1])
            ]
            self._update_warnings(out, steps)
        out["warnings"] = list(self.warnings.values())
        return out

    def _compiled_interval(self, out: dict, steps: int) -> dict:
        """The interval off XLA: torch.compile's record and, on CUDA, the host syncs per line."""
        now, prev = self.record.snapshot(), self._last_compiled
        self._last_compiled = now
        breaks = self.record.breaks("yours") + self.record.breaks("labkit") + self.record.breaks("unknown")
        out.update(
            xla=False,
            engine="torch.compile",
            compiles=now["compiles"] - prev["compiles"],
            compile_s=now["compile_s"] - prev["compile_s"],
            graphs_total=now["compiles"],
            breaks=[{k: b[k] for k in ("site", "reason", "explanation", "owner", "count")} for b in breaks],
            torch_breaks=[{"site": b["site"], "why": b["torch_boundary"]} for b in self.record.breaks("torch")],
            record_status=self.record.status,
        )
        found = recompile_findings(self.events) + break_findings(breaks)
        if self.host_syncs is not None:
            self.syncs = self.host_syncs.take()
            mine = {s: n for s, n in self.syncs.items() if s is not None}  # None: labkit's own batched read
            out["transfers"] = sum(self.syncs.values())
            out["syncs"] = [(str(s), n) for s, n in sorted(mine.items(), key=lambda kv: -kv[1])]
            found += reads_finding(sum(mine.values()), max(steps, 1), None, mine)
        for f in found:
            self.warnings[f.key] = f.short
        out["warnings"] = list(self.warnings.values())
        return out

    def _memory(self):
        if not self._memory_ok:
            return None
        mem = device_memory(self.rt)
        self._memory_ok = mem is not None  # unsupported once (XLA:CPU): do not ask again
        return mem

    def _update_warnings(self, out: dict, steps: int) -> None:
        counts = {
            "compiles": out["compiles"],
            "compile_s": out["compile_s"],
            "execute_s": out["execute_s"],
            "executions": steps,
            "transfers": out["transfers"],
            "fallbacks": out["fallbacks"],
        }
        totals = (self.run or {}).get("fallbacks", {})  # the run's, like graphs_total
        # the loop's own metric read is one transfer per interval
        for f in findings(counts, max(steps, 1), self.events, self.syncs, loop_reads=1):
            if f.key.startswith("fallback:") and "every step" not in f.short:
                if "every step" in self.warnings.get(f.key, ""):
                    continue  # it was every step before: keep saying so
                f = f._replace(short=f"{f.key[9:]} fell back to CPU {totals.get(f.key[9:], 0)} times so far")
            self.warnings[f.key] = f.short
