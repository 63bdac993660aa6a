"""Dynamo's texts read: a graph break's payload (`dynamo_graph_break_reason`) and a failed guard, as
labkit.dashboard.dynamo's record keeps them. torch 2.9's wording (checked on 2.9.0); a text in neither known form
gives None, and the record says its counts may be partial.

    parse_break(payload)   # {'file', 'line', 'reason', 'explanation', 'gb_id', 'context', 'user_frames'}
    clean_guard("0/0: lr == 0.1  # y = x * lr  # a.py:3 in f")   # 'lr == 0.1  # y = x * lr  # a.py:3 in f'
"""

from __future__ import annotations

import os
import re

from labkit.dashboard.syncs import Site
from labkit.runtime.boundaries import gb_id

_BREAK_AT = re.compile(r"Graph break in user code at (.+):(\d+)\s*\nGraph Break Reason: (.*)")
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


def guard_source(guard: str, file: str | None) -> Site | None:
    """The learner's line a failed guard came from, when Dynamo wrote it after the guard ("... # code  # a.py:3 in f";
    value guards carry it, tensor shape guards do not). `file`: the recompiled frame's file, to restore the path
    Dynamo shortened."""
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


def parse_break(payload: str) -> dict | None:
    """A graph break out of Dynamo's `dynamo_graph_break_reason` text: {'file', 'line', 'reason', 'explanation',
    'gb_id' (torch's registry id, or None), 'context' (torch's "Developer debug context"),
    'user_frames': [(file, line, func, code)]} (None when the text has neither known form)."""
    m = _BREAK_AT.search(payload)
    if m is not None:
        file, line, reason = m.group(1), int(m.group(2)), m.group(3).strip()
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
