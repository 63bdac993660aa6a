"""torch.compile's own record: frames compiled, recompiles with the guard that failed, graph breaks with their
reason and line, time spent compiling. The compiled engine's twin of torch_xla's metrics (labkit.dashboard.health
reads one or the other, chosen by the runtime's `reads_metrics`).

    rec = CompileRecord()                        # start before compiling: the lines come from compile-time events
    f = torch.compile(f, dynamic=False); f(x, 0.1); f(x, 0.2)
    rec.snapshot()    # {'compiles': 2, 'recompiles': 1, 'breaks': 0, 'torch_breaks': 0, 'compile_s': 0.3, ...}
    rec.recompiles()  # [{'guard': 'lr == 0.1', 'frame': 'f (train.py:12)', 'site': 'train.py:14 y = x * lr', ...}]
    rec.breaks()      # [{'reason': 'Failed to trace builtin operator', 'site': 'train.py:15 print(y)', ...}]
    print(rec.report())

Where it comes from: Dynamo's structured trace (the events tlparse reads, logger "torch.__trace"), received by one
logging handler, attached while a record is open (a Dashboard's fit(), `with CompileRecord() as rec:`, or
`listen()` until `unlisten()`) and detached from torch's logger when the last one closes, whether fit() returned or
raised:
`compilation_metrics` (each frame compiled: its function, the failed guard `recompile_reason`, the seconds it
took), `dynamo_graph_break_reason` (the reason and the user code traceback of each break) and `dynamo_start`
(where the learner's code called the frame: the live Python stack at that moment). torch._logging.set_logs and
TORCH_TRACE leave the handler in place. Compiles that happened before it was installed are taken from
torch._dynamo.utils.get_compilation_metrics() (the last 64 frames: functions, guards, times, no lines).

Costs: nothing per step (events come only while Dynamo compiles); while compiling, torch formats the payloads of
every structured event once a handler listens (measured here: 0.62 s of a 23 s compile, 2.7 %, an MLP with
Inductor, as reported by torch's own structured_logging_overhead_s). Reading a record is a list walk on the host:
it never touches a device.

A graph break is torch's own, not the learner's, where torch breaks on purpose: labkit.runtime.boundaries holds
the one table of them (keyed on torch's graph-break registry ids, e.g. GB0025 for Optimizer.step's `_use_grad`),
and a break counts as torch's only when its id is there and the code the entry names is torch's by resolved file
or module identity. Those are counted apart (`torch_breaks`) and named, never warned about. A break that is not
one of them is the code's: the learner's ("yours") or labkit's, by the innermost line outside torch; where no such
line is known, its owner is "unknown" and every report says it cannot tell. These are torch 2.9's and 2.11's
structures (checked here on 2.9.0 and 2.11.0: labkit.dashboard.dynamo_parse reads both wordings); where a later torch
renames them the record says so in `status` and counts what it still sees.
"""

from __future__ import annotations

import logging
import os
import threading

import torch

from labkit.codepaths import is_labkit_file, under
from labkit.dashboard.dynamo_parse import _site, clean_guard, guard_line, guard_source, parse_break  # noqa: F401 (re-exported)
from labkit.dashboard.syncs import Site, user_site
from labkit.runtime.boundaries import boundary_for

MAX_EVENTS = 20_000  # a run that compiles forever stops growing the record here (Dynamo's own limit is 8 per frame)


def torch_boundary(brk: dict) -> str | None:
    """What torch's own boundary this break is (labkit.runtime.boundaries), or None when it is not proven torch's."""
    found = boundary_for(brk)
    if found is None:
        return None
    b, what = found
    return f"{what} ({b.gb_id}): {b.why}"


class _Listener(logging.Handler):
    """The one handler on torch's structured trace: turns compile-time events into plain dicts (process-wide)."""

    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.events: list[dict] = []
        self.calls: dict = {}  # (frame_id, frame_compile_id) -> Site of the learner's call (from dynamo_start)
        self.dropped = 0
        self.status = "listening to torch.compile's structured trace"

    def _add(self, ev: dict) -> None:
        # logging.Handler.handle holds the handler's own lock around emit: one event at a time
        if len(self.events) >= MAX_EVENTS:
            self.dropped += 1
            return
        self.events.append(ev)

    def emit(self, record: logging.LogRecord) -> None:  # called by torch while it compiles, on its thread
        try:
            md = getattr(record, "metadata", None)
            if not isinstance(md, dict):
                return
            key = (md.get("frame_id"), md.get("frame_compile_id"))
            if "dynamo_start" in md:
                self.calls[key] = user_site(1)
            elif "artifact" in md and md["artifact"].get("name") == "dynamo_graph_break_reason":
                brk = parse_break(getattr(record, "payload", "") or "")
                if brk is not None:
                    self._add(_break_event(brk, self.calls.get(key)))
            elif "compilation_metrics" in md or "bwd_compilation_metrics" in md:
                m = md.get("compilation_metrics") or md.get("bwd_compilation_metrics") or {}
                self._add(_compile_event(m, self.calls.pop(key, None), backward="bwd_compilation_metrics" in md))
        except Exception as e:  # an instrument must never stop a compile: say so once, keep going
            self.status = f"torch.compile's trace changed shape ({type(e).__name__}: {e}); counts may be partial"


def _break_event(brk: dict, call: Site | None) -> dict:
    """A break as the record keeps it: where (the innermost frame of the learner's code), why, and whose."""
    why = torch_boundary(brk)
    torch_dir = os.path.dirname(torch.__file__)
    # the innermost frame outside torch: a break inside torch's code is reported at the line that called into it
    outside = [f for f in brk["user_frames"] if not under(f[0], torch_dir)]
    if why is None and not under(brk["file"], torch_dir):
        outside = outside or [(brk["file"], brk["line"])]
    file, line = (outside[-1][0], outside[-1][1]) if outside and why is None else (brk["file"], brk["line"])
    if why:
        owner = "torch"
    elif not outside:  # inside torch, and no line outside it is known: whose it is is not proven
        owner = "unknown"
    else:
        owner = "labkit" if is_labkit_file(file) else "yours"
    return {
        "kind": "break",
        "gb_id": brk.get("gb_id"),
        "reason": brk["reason"],
        "explanation": brk["explanation"],
        "file": file,
        "line": line,
        "site": str(_site(file, line)),
        "owner": owner,
        "torch_boundary": why,
        "call": str(call) if call else None,
    }


def _compile_event(m: dict, call: Site | None, backward: bool = False) -> dict:
    secs = m.get("entire_frame_compile_time_s")
    if secs is None and m.get("duration_us") is not None:
        secs = m["duration_us"] / 1e6
    file, first = m.get("co_filename"), m.get("co_firstlineno")
    guard = clean_guard(m.get("recompile_reason"))
    src = guard_source(guard, file) if guard else None
    frame = f"{m.get('co_name')} ({os.path.basename(file)}:{first})" if file else None
    return {
        "kind": "backward" if backward else "compile",
        "compile_id": m.get("compile_id"),
        "frame": frame,
        "file": file,
        "first_line": first,
        "seconds": float(secs or 0.0),
        "guard": guard_line(guard) if guard else None,
        "guard_text": guard,
        "guard_site": str(src) if src else None,
        "call": str(call) if call else None,
        "failed": m.get("fail_type"),
        "fail_reason": (m.get("fail_reason") or "").splitlines()[0] if m.get("fail_reason") else None,
        "installed": bool(m.get("has_guarded_code")),
    }


_listener: _Listener | None = None  # the one listener; its events outlive its attachments (explain() reads them)
_users = 0  # open records (and listen() calls) that want it attached
_install_lock = threading.Lock()


def listen() -> _Listener | None:
    """Attach the process's one listener to torch's structured trace and return it; None where torch has no
    structured trace. Counted: each listen() is undone by one unlisten(), and the handler leaves torch's logger
    when the last is (torch formats its payloads only while a handler listens)."""
    global _listener, _users
    with _install_lock:
        try:
            from torch._logging._internal import trace_log  # torch's structured trace logger ("torch.__trace")
        except ImportError:
            return None
        if _listener is None:
            _listener = _Listener()
            _listener.events.extend(_backfill())
        if _users == 0:
            trace_log.setLevel(logging.DEBUG)  # torch keeps it at DEBUG itself; set again in case a test reset it
            trace_log.addHandler(_listener)
        _users += 1
        return _listener


def unlisten() -> None:
    """Undo one listen(); the last one detaches the handler from torch's logger."""
    global _users
    with _install_lock:
        if _listener is None or _users == 0:
            return
        _users -= 1
        if _users == 0:
            from torch._logging._internal import trace_log

            trace_log.removeHandler(_listener)


def _backfill() -> list[dict]:
    """Frames compiled before the listener existed, from Dynamo's own ring of the last 64 (no lines, no breaks)."""
    try:
        from torch._dynamo.utils import get_compilation_metrics
    except ImportError:
        return []
    import dataclasses

    out = []
    for c in get_compilation_metrics():
        m = dataclasses.asdict(c)
        out.append(_compile_event(m, None, backward=m.get("is_forward") is False))
    return out


class CompileRecord:
    """What torch.compile did in this process since this record started (see the module docstring).

    Per step, take() returns the events since the previous take (a recompile then belongs to that step); per
    interval, snapshot() totals that subtract. Neither touches a device."""

    def __init__(self, since_process_start: bool = False):
        self.listener, self.is_open = listen(), True
        events = self.listener.events if self.listener else []
        self.start = 0 if since_process_start else len(events)
        self._taken = self.start

    def open(self) -> CompileRecord:
        """Listen again after close() (a second fit() of one Dashboard); idempotent. Compiles while closed are
        not seen."""
        if not self.is_open:
            self.listener, self.is_open = listen(), True
        return self

    def close(self) -> None:
        """Stop listening (idempotent): what was recorded stays readable."""
        if self.is_open:
            self.is_open = False
            unlisten()

    def __enter__(self) -> CompileRecord:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def status(self) -> str:
        if self.listener is None:
            return "this torch has no structured trace: torch.compile's record is unavailable"
        return self.listener.status

    def events(self) -> list[dict]:
        return self.listener.events[self.start :] if self.listener else []

    def take(self) -> list[dict]:
        """Events since the previous take() (or the start)."""
        if self.listener is None:
            return []
        evs = self.listener.events
        out, self._taken = evs[self._taken :], len(evs)
        return out

    def compiles(self) -> list[dict]:
        return [e for e in self.events() if e["kind"] == "compile"]

    def recompiles(self) -> list[dict]:
        """Frames compiled again because a guard failed: each with 'guard', 'frame', 'guard_site', 'call'."""
        return [e for e in self.compiles() if e["guard"]]

    def breaks(self, owner: str | None = "yours") -> list[dict]:
        """Graph breaks, one per (line, reason) with a 'count' of the compiles that met it. owner: 'yours' (the
        code's), 'torch' (labkit.runtime.boundaries), 'labkit' (labkit's own code), 'unknown' (not proven whose)
        or None (all)."""
        seen: dict = {}
        for e in self.events():
            if e["kind"] == "break" and (owner is None or e["owner"] == owner):
                k = (e["file"], e["line"], e["reason"])
                if k in seen:
                    seen[k]["count"] += 1
                else:
                    seen[k] = dict(e, count=1)
        return list(seen.values())

    def snapshot(self) -> dict:
        """Totals since the start: compiles (frames), recompiles, breaks (yours, distinct), labkit_breaks,
        torch_breaks, unknown_breaks (whose is not proven; each distinct), compile_s (forward and backward compiles),
        failed (frames Dynamo gave up on)."""
        evs = self.events()
        comp = [e for e in evs if e["kind"] in ("compile", "backward")]
        return {
            "compiles": sum(e["kind"] == "compile" and e["installed"] for e in comp),
            "recompiles": sum(bool(e.get("guard")) for e in comp),
            "breaks": len(self.breaks("yours")),
            "labkit_breaks": len(self.breaks("labkit")),
            "torch_breaks": len(self.breaks("torch")),
            "unknown_breaks": len(self.breaks("unknown")),
            "compile_s": sum(e["seconds"] for e in comp),
            "failed": sum(bool(e["failed"]) for e in comp),
        }

    def report(self) -> str:
        s = self.snapshot()
        lines = [
            f"torch.compile: {s['compiles']} frames compiled in {s['compile_s']:.2f} s, {s['recompiles']} recompiles, "
            f"{s['breaks']} graph breaks in your code, {s['torch_breaks']} of torch's own"
            + (f", {s['labkit_breaks']} in labkit's" if s["labkit_breaks"] else "")
            + (f", {s['unknown_breaks']} whose labkit cannot tell" if s["unknown_breaks"] else "")
        ]
        lines += [f"recompile: {recompile_text(e)}" for e in self.recompiles()]
        lines += [f"graph break: {break_text(b)}" for b in self.breaks("yours")]
        lines += [f"graph break in labkit's code: {break_text(b)}" for b in self.breaks("labkit")]
        lines += [f"graph break, whose not known (inside torch, no caller's line): {break_text(b)}"
                  for b in self.breaks("unknown")]  # fmt: skip
        lines += [f"torch's own: {b['site']}: {b['torch_boundary']}" for b in self.breaks("torch")]
        return "\n".join(lines)


def recompile_text(e: dict) -> str:
    """One recompile in words: "f (train.py:12) recompiled: guard failed: lr == 0.1 (at train.py:14 y = x * lr)"."""
    where = e.get("guard_site") or e.get("call")
    return f"{e['frame']} recompiled: guard failed: {e['guard']}" + (f" (at {where})" if where else "")


def break_text(b: dict) -> str:
    """One graph break in words: "train.py:15 print(y): Failed to trace builtin operator (Dynamo does not ...)"."""
    why = f" ({b['explanation']})" if b.get("explanation") else ""
    return f"{b['site']}: {b['reason']}{why}"
