"""The checker of notebook 07's exercise 4 (07.fix_plan): the learner's sharding plan is validated by name and
shape, compared with the rule on paper for other widths and device counts, and run on virtual XLA:CPU devices
(labkit.lessons.capstone_mesh, in a child process) against a replicated run. Re-exported by
labkit.lessons.exercises.nb07 with the notebook's other checkers."""

from __future__ import annotations

import itertools
import random

import torch

from labkit.lessons import capstone
from labkit.lessons.exercises import Wrong, call, refusing, require, todo

__all__ = ["check_fixed_plan"]

_calls = itertools.count(1)


def _validated(plan, model, devices: int) -> dict:
    """The learner's plan as {name: tuple spec}, every fault named before anything runs."""
    from labkit.lessons.capstone_mesh import AXIS

    require(isinstance(plan, dict), f"return a dict (parameter name -> spec), not a {type(plan).__name__}")
    params = dict(model.named_parameters())
    unknown = sorted(str(k) for k in plan if k not in params)
    if unknown:
        raise Wrong(f"the model has no parameter {unknown[0]!r} (its names: {', '.join(params)})")
    out = {}
    for name, spec in plan.items():
        p = params[name]
        require(
            isinstance(spec, (tuple, list)) and len(spec) == p.dim(),
            f"{name}: a spec is a tuple with one entry per dimension ({p.dim()} here), got {spec!r}",
        )
        for d, a in enumerate(spec):
            require(a is None or a == AXIS, f"{name}: dimension {d} names {a!r}; the mesh has one axis, {AXIS!r}")
            require(
                a is None or p.shape[d] % devices == 0,
                f"{name}: dimension {d} has {p.shape[d]} rows, which do not split over {devices} devices",
            )
        out[name] = tuple(spec)
    return out


def _rule(shape, devices: int):
    """The spec the exercise asks for a weight matrix, computed here: split over the axis along a dimension that
    divides by `devices`, the larger when both do, the first on a tie. None when no dimension divides."""
    from labkit.lessons.capstone_mesh import AXIS

    fits = [d for d in (0, 1) if shape[d] % devices == 0]
    if not fits:
        return None
    d = max(fits, key=lambda d: (shape[d], -d))
    return (AXIS, None) if d == 0 else (None, AXIS)


def _same_rule(plan: dict, model, devices: int) -> None:
    """Every weight matrix's spec in `plan` (validated) is the rule's."""
    for name, p in model.named_parameters():
        if p.dim() != 2:
            continue
        want = _rule(tuple(p.shape), devices)
        got = plan.get(name, (None, None))
        if got == want:
            continue
        whole = got == (None, None)
        require(
            not whole,
            f"{name} {tuple(p.shape)} over {devices} devices: left whole, every device holds all of it; split it",
        )
        raise Wrong(
            f"{name} {tuple(p.shape)} over {devices} devices: you give {got}, the rule gives {want} (a dimension that "
            "divides, the larger when both do, the first on a tie)"
        )


def check_fixed_plan(fixed_plan, devices: int = 4) -> str:
    """07.fix_plan: fixed_plan(model, devices) -> {parameter name: spec over the "fsdp" axis}. Judged by what the
    plan does on `devices` virtual XLA:CPU devices (labkit.lessons.capstone_mesh, in a child process): every
    weight matrix split over all devices (each holds 1/devices of it) from the start and after the steps, and the
    losses of the sharded run equal to those of a replicated one; then, on paper, for two more (width, device
    count) pairs: every weight matrix's spec is the rule's (computed here: a dimension that divides, the larger when
    both do, the first on a tie). Widths fall on both sides of the 64 inputs and device counts where the larger
    dimension does not divide, so the right spec changes from call to call. Biases may stay whole."""
    from labkit.lessons import capstone_mesh

    todo(fixed_plan)
    k = next(_calls)
    rng = random.Random(k)
    width = rng.choice([48, 56, 96, 160])  # the first layer (width, 64) split along dim 1 below 64, dim 0 above
    why = "write the rule yourself: reference_plan is the answer"

    def asked(width: int, n: int) -> tuple[dict, torch.nn.Module]:
        model = capstone.make_model(None, width=width, seed=k)  # on the host: the plan reads names and shapes
        with refusing([capstone_mesh.reference_plan], why):
            return _validated(call(fixed_plan, model, n), model, n), model

    plan, model = asked(width, devices)
    _same_rule(plan, model, devices)
    # on paper: a width on the other side of 64, and 5 devices where only the first layer's rows divide
    other = rng.choice([36, 44, 52, 60]) if width > 64 else rng.choice([100, 132, 196])
    for w, n in ((other, devices), (rng.choice([40, 60]), 5)):
        p, m = asked(w, n)
        _same_rule(p, m, n)
    got = capstone_mesh.run(plan, width=width, devices=devices, steps=2, seed=k)
    for name, shape, _shard, spec, nbytes in got["rows"]:
        if len(shape) == 2:
            whole = shape[0] * shape[1] * 4
            require(
                nbytes * devices == whole,
                f"{name} {tuple(shape)}: each device holds {nbytes:,d} of its {whole:,d} bytes ({spec}): "
                f"split it over the {devices} devices",
            )
            was, was_bytes = got["start"][name]
            require(
                was_bytes * devices == whole,
                f"{name} {tuple(shape)}: {was} before the first step, {was_bytes:,d} bytes on every device (XLA split "
                "it only after the first update): a model sized for the split would not fit at the start; name it",
            )
    for i, (a, b) in enumerate(zip(got["losses"], got["replicated_losses"])):
        require(abs(a - b) <= 1e-4 * max(1.0, abs(b)), f"step {i}: loss {a:.5f} sharded, {b:.5f} replicated")
    even = got["bytes_total"] / devices
    return (
        f"width {width}: each of {devices} devices holds {got['bytes_per_device']:,d} bytes "
        f"({got['bytes_per_device'] / even:.2f}x an even split), the same losses as replicated; widths {other} and "
        "one over 5 devices follow the rule"
    )
