"""torch's own graph breaks in a compiled training step: one table, keyed on what torch names each break.

    from labkit.runtime.boundaries import TORCH_BOUNDARIES, boundary_for
    boundary_for(brk)   # the Boundary a parsed break is (labkit.dashboard.dynamo.parse_break), or None

torch 2.9 gives every graph break a type (`gb_type`, the first line of its "Graph Break Reason") and a registry
id for that type (torch/_dynamo/graph_break_registry.json: "GB0025" is "Call to `torch._dynamo.graph_break()`";
each message ends with a link to .../gb/gb0025.html). A break is torch's own only when both hold:
- its id is in TORCH_BOUNDARIES, and
- the code the entry names is torch's, by identity: the break happened in that torch module's own file (its
  resolved path, labkit.codepaths.under), or the function Dynamo skipped is one of that module's (its file in
  torch's folder, its qualname an attribute of the module), or the method Dynamo could not trace is an
  optimizer's `step`.
Anything else is the code's (the learner's or labkit's, by the line that called into torch), or, where no line
outside torch is known, whose it is is not known and the record says so. The step's docstring
(labkit.runtime.step), the dashboard, labkit.explain() and the recompile detective all read this one table.
Checked on torch 2.9.0 and 2.11.0 (the same ids and types in both registries); tests/test_hostile_round5.py checks
each id and type against torch's own registry.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
from dataclasses import dataclass

from labkit.codepaths import under


@dataclass(frozen=True)
class Boundary:
    gb_id: str  # the registry id, e.g. "GB0025"
    gb_type: str  # the registry's Gb_type for it: the break's reason line
    where: str  # "site": the break is in `modules`' file; "skipped": Dynamo skipped a function of `modules`;
    # "optimizer step": Dynamo could not trace an optimizer's `step`; "anywhere": the type alone (torch's hint: "fundamental")
    modules: tuple[str, ...]
    what: str  # what it is, in a word
    why: str  # why torch breaks there, and what it costs


# GB0007 (a call) and GB0008 (an inline) are one boundary under two ids: the same functions, the same cost
_SKIPPED = (
    "skipped",
    ("torch.optim.optimizer", "torch.amp.grad_scaler"),
    "a function Dynamo skips",
    "Dynamo skips it on purpose (zero_grad, the GradScaler's unscale_/step/update): it runs eagerly between "
    "graphs; under fp16 the GradScaler's inf check reads a value on the host, as in eager",
)

TORCH_BOUNDARIES = (
    Boundary(
        "GB0025",
        "Call to `torch._dynamo.graph_break()`",
        "site",
        ("torch.optim.optimizer",),
        "Optimizer.step's _use_grad",
        "Optimizer.step breaks around itself on purpose (_use_grad in torch/optim/optimizer.py calls "
        "torch._dynamo.graph_break()): the update compiles as its own graph",
    ),
    Boundary(
        "GB0156",
        "Unsupported method call",
        "optimizer step",
        (),
        "a scheduler-wrapped step",
        "an LR scheduler wraps optimizer.step in a function Dynamo does not trace into: the call runs the update "
        "as its own graph",
    ),
    Boundary(
        "GB0208",
        "torch.* op returned non-Tensor",
        "site",
        ("torch.utils._foreach_utils",),
        "clip_grad_norm_'s grouping",
        "clip_grad_norm_ groups the gradients by device and dtype in a call that returns a dict: the norm and "
        "the scaling compile as graphs around it",
    ),
    Boundary("GB0007", "Attempted to call function marked as skipped", *_SKIPPED),
    Boundary("GB0008", "Attempted to inline function marked as skipped", *_SKIPPED),
    Boundary(
        "GB0123",
        "Unsupported Tensor.backward() call",
        "anywhere",
        (),
        "loss.backward() in a compiled function",
        "loss.backward() inside a compiled function is not traced by Dynamo (compiled autograd is off): "
        "compiling the model lets AOTAutograd compile its backward instead",
    ),
)
BY_ID = {b.gb_id: b for b in TORCH_BOUNDARIES}

_LINK = re.compile(r"/gb/gb(\d+)\.html")
_SKIPPED_FILE = re.compile(r"filename: `([^`]+)`")  # GB0008's context
_SKIPPED_MODULE = re.compile(r"module: ([\w.]+), qualname: ")  # GB0007's context
_QUALNAME = re.compile(r"qualname: ([\w.<>]+)")
_METHOD = re.compile(r"call_method (\w+)\(.*?\) (\w+) ")  # GB0156's context: call_method {self} {name} ...


@functools.lru_cache(maxsize=1)
def registry() -> dict:
    """torch's graph-break registry, {Gb_type: id} (empty where this torch ships none)."""
    import torch

    path = os.path.join(os.path.dirname(torch.__file__), "_dynamo", "graph_break_registry.json")
    try:
        with open(path) as f:
            return {entry["Gb_type"]: gb_id for gb_id, entries in json.load(f).items() for entry in entries}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def gb_id(reason: str, payload: str = "") -> str | None:
    """A break's registry id: from the link torch appends to the message, else from its type's registry entry."""
    m = _LINK.search(payload)
    if m is not None:
        return f"GB{m.group(1)}"
    return registry().get(reason.splitlines()[0].strip() if reason else "")


@functools.cache
def _module_file(name: str) -> str | None:
    """A module's own file, found without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None else None


def _is_module_file(path: str, modules) -> bool:
    files = [f for f in map(_module_file, modules) if f]
    return any(under(path, f) for f in files)  # under() of a file is the file itself, resolved


def _defined_in(qualname: str, modules) -> bool:
    """Whether `qualname` ("Optimizer.zero_grad") names an attribute of one of `modules` (only those imported:
    a function that ran is in an imported module)."""
    import sys

    for m in modules:
        obj = sys.modules.get(m)
        for part in qualname.split("."):
            obj = getattr(obj, part, None)
        if obj is not None and callable(obj):
            return True
    return False


def boundary_for(brk: dict) -> tuple[Boundary, str] | None:
    """(the Boundary, what exactly: "Optimizer.zero_grad", ...) a parsed break is, or None where it is not proven
    to be torch's own. brk: parse_break's dict ('gb_id', 'file', 'context' are read)."""
    b = BY_ID.get(brk.get("gb_id") or "")
    if b is None:
        return None
    ctx = brk.get("context", "")
    if b.where == "anywhere":
        return b, b.what
    if b.where == "site":
        return (b, b.what) if _is_module_file(brk.get("file", ""), b.modules) else None
    if b.where == "skipped":
        name, mod, path = _QUALNAME.search(ctx), _SKIPPED_MODULE.search(ctx), _SKIPPED_FILE.search(ctx)
        if name is None:
            return None
        import torch

        # the function Dynamo skipped: its module (GB0007) or its file (GB0008: the function's own, or the wrapper
        # torch/_compile.py puts around zero_grad) is torch's, and its qualname is a function of a listed module
        in_torch = (mod is not None and mod.group(1).split(".")[0] == "torch") or (
            path is not None and under(path.group(1), os.path.dirname(torch.__file__))
        )
        return (b, name.group(1)) if in_torch and _defined_in(name.group(1), b.modules) else None
    if b.where == "optimizer step":
        m = _METHOD.search(ctx + " ")
        return (b, b.what) if m is not None and m.group(1) == "OptimizerVariable" and m.group(2) == "step" else None
    return None


def docs_table() -> str:
    """The table as lines, for a docstring or a notebook: "GB0025 Call to ...: why"."""
    return "\n".join(f"{b.gb_id} {b.gb_type} ({b.what}): {b.why}" for b in TORCH_BOUNDARIES)
