"""Dynamo's texts read: a graph break's payload (`dynamo_graph_break_reason`) and a failed guard, as
labkit.dashboard.dynamo's record keeps them. Read by the parts torch keeps from one version to the next: the
"Graph break in user code at FILE:LINE" header, the registry id of the link torch appends (".../gb/gb0059.html"),
the break's type (the registry's Gb_type for that id), the "User code traceback" frames. The prose around the type
changes: torch 2.9.0 writes "Graph Break Reason: Failed to trace builtin operator", torch 2.11.0 "Graph Break
Reason: Encountered graph break when attempting to trace CALL: a function call, e.g. f(x, y):", a blank line, then
"Failed to trace builtin operator" (both checked here). A text in neither known form gives None, and the record
says its counts may be partial.

    parse_break(payload)   # {'file', 'line', 'reason', 'explanation', 'gb_id', 'context', 'user_frames'}
    clean_guard("0/0: lr == 0.1  # y = x * lr  # a.py:3 in f")   # 'lr == 0.1  # y = x * lr  # a.py:3 in f'
"""

from __future__ import annotations

import os
import re

from labkit.dashboard.syncs import Site
from labkit.runtime.boundaries import gb_id, registry

_BREAK_AT = re.compile(r"Graph break in user code at (.+):(\d+)\s*\nGraph Break Reason: ")
# where the reason's own text ends: the first of torch's labelled parts after it
_REASON_END = re.compile(
    r"\n\s*(?:Explanation:|Hint:|Developer debug context:|For more details)|\nUser code traceback:"
)
_WONT_CONVERT = re.compile(r"WON'T CONVERT (\S+) (.+) line (\d+)")
_EXPLAIN = re.compile(r"^\s*Explanation: (.*)$", re.M)
_FRAME = re.compile(r'^\s*File "(.+)", line (\d+), in (.+)\n\s*(.*)$', re.M)
_COMPILE_ID = re.compile(r"^\[?\d+/\d+\]?:?\s*")
_CONTEXT = re.compile(r"Developer debug context: (.*?)(?:\n\s*\n|\n For more details|\nUser code traceback:|\Z)", re.S)


def _site(file: str, line: int) -> Site:
    import linecache

    return Site(file, line, linecache.getline(file, line).strip())


def clean_guard(reason: str | None) -> str | None:
    """Dynamo's failed-guard text without its compile id: "0/0: lr == 0.1  # y = x * lr  # a.py:3 in f"
    -> "lr == 0.1  # y = x * lr  # a.py:3 in f" (the comments, when there, are the guard's source line)."""
    if not reason:
        return None
    return _COMPILE_ID.sub("", reason.strip(), count=1)


def guard_line(guard: str) -> str:
    """The failed guard itself, on one line: without the source-line comments, a "User stack trace:" below it, or,
    torch 2.11, the object an id guard names printed over several lines after it ("___check_obj_id(self, 1403...),
    type=SGD (" + the optimizer's repr + ")"): that first line, less the repr's opening bracket."""
    first = guard.split("  #")[0].split("\n")[0].strip()
    return first[:-1].rstrip() if first.endswith("(") else first


def guard_source(guard: str, file: str | None) -> Site | None:
    """The learner's line a failed guard came from, when Dynamo wrote it after the guard ("... # code  # a.py:3 in f";
    value guards carry it, tensor shape guards do not). `file`: the recompiled frame's file, to restore the path
    Dynamo shortened. torch 2.11 adds a "User stack trace:" of File/line frames below: its innermost frame is the
    line, read whole (the comment-split form then fails: the frame's code repeats the line's own comments)."""
    guard, _, stack = guard.partition("\nUser stack trace:")
    frames = _FRAME.findall(stack)
    if frames:
        return _site(frames[-1][0], int(frames[-1][1]))
    parts = [p.strip() for p in re.split(r"\s{2,}#\s", guard)]
    if len(parts) < 3:
        return None
    m = re.match(r"(.*?):(\d+) in ", parts[-1])
    if m is None:
        return None
    path, line = m.group(1), int(m.group(2))
    if file and os.path.basename(file) == os.path.basename(path):  # Dynamo cut the path's start: put it back
        return _site(file, line)  # the line as the file has it (Dynamo's copy is cut at the code's own comments)
    return Site(path, line, parts[1])


def _reason(text: str, gb: str | None) -> str:
    """The break's type out of the text after "Graph Break Reason: ": the registry's Gb_type for its id where the
    text has it on a line of its own, else the first line of the text's last paragraph (torch 2.11 puts what it was
    tracing first, then a blank line, then the type; torch 2.9 the type alone)."""
    text = text[: m.start()] if (m := _REASON_END.search(text)) else text
    lines = [ln.strip() for ln in text.splitlines()]
    known = {t for t, i in registry().items() if i == gb} if gb else set()
    found = [ln for ln in lines if ln in known]
    if found:
        return found[-1]
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
    return paragraphs[-1].splitlines()[0].strip() if paragraphs else ""


def parse_break(payload: str) -> dict | None:
    """A graph break out of Dynamo's `dynamo_graph_break_reason` text: {'file', 'line', 'reason', 'explanation',
    'gb_id' (torch's registry id, or None), 'context' (torch's "Developer debug context"),
    'user_frames': [(file, line, func, code)]} (None when the text has neither known form)."""
    m = _BREAK_AT.search(payload)
    if m is not None:
        file, line = m.group(1), int(m.group(2))
        reason = _reason(payload[m.end() :], gb_id("", payload))
    else:
        m = _WONT_CONVERT.search(payload)
        if m is None:
            return None
        file, line, reason = m.group(2), int(m.group(3)), f"could not compile {m.group(1)}"
    ex = _EXPLAIN.search(payload)
    user = payload.split("User code traceback:", 1)[1].split("\n\n", 1)[0] if "User code traceback:" in payload else ""
    frames = [(f, int(n), fn.strip(), code.strip()) for f, n, fn, code in _FRAME.findall(user)]
    ctx = _CONTEXT.search(payload)
    return {
        "gb_id": gb_id(reason, payload),
        "context": " ".join(ctx.group(1).split()) if ctx else "",
        "file": file,
        "line": line,
        "reason": reason,
        "explanation": ex.group(1).strip() if ex else "",
        "user_frames": frames,
    }
