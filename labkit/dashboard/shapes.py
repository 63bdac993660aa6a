"""What a batch's shapes are, and what changed between two batches: the recompile detective's words for a new
graph ("batch shape changed (32→17)"). Plain data in, plain words out; labkit.dashboard.health calls it.

    describe_change(shape_signature(old_batch), shape_signature(new_batch))
"""

from __future__ import annotations

import torch


def shape_signature(batch) -> tuple:
    """The shapes (and dtypes) of the tensors in a batch, as a hashable tuple. Host metadata only."""
    if isinstance(batch, torch.Tensor):
        return ((None, tuple(batch.shape), str(batch.dtype).replace("torch.", "")),)
    if isinstance(batch, dict):
        items = sorted(batch.items(), key=lambda kv: str(kv[0]))
    elif isinstance(batch, (list, tuple)):
        items = list(enumerate(batch))
    else:
        return ()
    return tuple(
        (k, tuple(v.shape), str(v.dtype).replace("torch.", "")) for k, v in items if isinstance(v, torch.Tensor)
    )


def _fmt_shape(s) -> str:
    return "[" + ",".join(str(d) for d in s) + "]"


def _input_name(k) -> str:
    return "input" if k is None else f"input {k!r}" if isinstance(k, str) else f"input {k}"


def input_changes(old: tuple, new: tuple) -> list[dict]:
    """[{'input': name, 'old': (shape, dtype), 'new': (shape, dtype)}] for each input that differs."""
    if [k for k, *_ in old] != [k for k, *_ in new]:
        return [{"input": "batch", "old": f"{len(old)} tensors", "new": f"{len(new)} tensors"}]
    return [
        {"input": _input_name(k), "old": f"{_fmt_shape(s0)} {d0}", "new": f"{_fmt_shape(s1)} {d1}"}
        for (k, s0, d0), (_, s1, d1) in zip(old, new)
        if s0 != s1 or d0 != d1
    ]


def describe_change(old: tuple, new: tuple) -> str:
    """Plain words for how `new` differs from `old` (two shape signatures)."""
    if len(old) != len(new) or [k for k, *_ in old] != [k for k, *_ in new]:
        return f"batch structure changed ({len(old)}→{len(new)} tensors)"
    parts = []
    for (k, s0, d0), (_, s1, d1) in zip(old, new):
        name = _input_name(k)
        if s0 != s1:
            if len(s0) == len(s1) and s0[1:] == s1[1:]:
                parts.append(f"batch shape changed ({s0[0]}→{s1[0]})")
            elif len(s0) == len(s1) and s0[0] == s1[0] and sum(a != b for a, b in zip(s0, s1)) == 1:
                i = next(i for i, (a, b) in enumerate(zip(s0, s1)) if a != b)
                parts.append(f"{name} dim {i} changed ({s0[i]}→{s1[i]})")
            else:
                parts.append(f"{name} shape changed ({_fmt_shape(s0)}→{_fmt_shape(s1)})")
        elif d0 != d1:
            parts.append(f"{name} dtype changed ({d0}→{d1})")
    parts = list(dict.fromkeys(parts))  # x and y both lose rows: say it once
    return "; ".join(parts) if parts else "same input shapes"
