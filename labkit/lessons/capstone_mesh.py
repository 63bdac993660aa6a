"""Notebook 07's sharded run: the capstone's MLP trained under a sharding plan on a mesh of several devices,
and what each device then holds.

    from labkit.lessons import capstone_mesh
    report = capstone_mesh.run({"0.weight": ("fsdp", None)}, width=512)   # a plan: parameter -> spec
    print(capstone_mesh.describe(report))      # per parameter: shape, per-device shape, sharding, bytes per device

A plan is FSDP-style: each named parameter is split over the mesh's one axis, "fsdp", along the dimension
its spec names, or kept whole on every device (replicated) where its spec is all None; the batch is split over
the same axis. A parameter the plan does not name is left to XLA's sharding propagation: measured here (torch_xla
2.9), the capstone's unnamed hidden weight came out of its first in-place SGD update split like its gradient, so
an omission is not what replicates a weight; a spec that says so is.

The run needs several XLA devices in one SPMD process, and the process that runs a notebook has already started
torch_xla on its own device (one chip on Colab's v5e-1), which a process cannot change. So the plan runs in a fresh Python process on `devices` virtual XLA:CPU devices (PJRT_DEVICE=CPU,
CPU_NUM_DEVICES): the partitioning and the bytes each device holds are XLA's real ones, the timings are not a
TPU's. The same process also trains a fully replicated copy of the model on the same batches, so the report
says whether the plan changed the losses (it must not: a layout is not maths).

Read with labkit.spmd.sharding (layout_table, device_bytes): the tools of notebook 03.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

AXIS = "fsdp"
RESULT = "capstone-mesh-result "  # the child's last line: this prefix, then the report as JSON


def available() -> str | None:
    """Why the sharded run cannot run here (torch_xla is not installed: the Colab GPU image), or None."""
    if importlib.util.find_spec("torch_xla") is None:
        return "torch_xla is not installed here: the sharded run needs XLA devices (a TPU runtime, or XLA:CPU)"
    return None


def run(
    plan: dict,
    width: int = 512,
    devices: int = 4,
    steps: int = 3,
    batch: int = 32,
    seed: int = 0,
    timeout_s: float = 600,
) -> dict:
    """Train the capstone MLP (64 -> width -> width -> 10) for `steps` SGD steps under `plan` on `devices`
    virtual XLA:CPU devices in a child process. Returns {"devices", "rows": [[name, shape, per-device shape,
    sharding, bytes per device]] after the steps, "start": {name: [sharding, bytes per device]} before them,
    "bytes_per_device", "bytes_total", "losses", "replicated_losses"}.
    Raises RuntimeError with the child's own message when it fails."""
    why = available()
    if why:
        raise RuntimeError(why)
    job = {
        "plan": {str(k): [None if a is None else str(a) for a in v] for k, v in plan.items()},
        "width": int(width),
        "steps": int(steps),
        "batch": int(batch),
        "seed": int(seed),
    }
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # labkit's parent folder
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(int(devices)), LABKIT_BACKEND="xla-cpu")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # XLA's per-compile Shardy notice (see labkit.spmd.practice_devices)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "labkit.lessons.capstone_mesh"],
        input=json.dumps(job),
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith(RESULT)]
    if done.returncode or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-8:]
        raise RuntimeError(f"the sharded run failed (exit {done.returncode}):\n" + "\n".join(tail))
    return json.loads(lines[-1][len(RESULT) :])


def reference_plan(model, devices: int) -> dict:
    """The fix: every weight matrix split over the axis along a dimension that divides by `devices`, the larger
    one, the first on a tie; biases left whole. FSDPv2 also picks the largest dimension, but needs no divisibility
    (GSPMD pads an uneven split): the condition that it divides is this exercise's, not FSDPv2's."""
    plan = {}
    for name, p in model.named_parameters():
        fits = [d for d in (0, 1) if p.dim() == 2 and p.shape[d] % devices == 0]
        if fits:
            d = max(fits, key=lambda d: (p.shape[d], -d))
            plan[name] = (AXIS, None) if d == 0 else (None, AXIS)
    return plan


def same_losses(report: dict, rel: float = 1e-4) -> bool:
    """The plan's losses equal the replicated run's, step by step, within `rel` (a layout is not maths)."""
    pairs = zip(report["losses"], report["replicated_losses"])
    return all(abs(a - b) <= rel * max(1.0, abs(b)) for a, b in pairs)


def describe(report: dict) -> str:
    """The per-parameter table and the total against an even split, in words."""
    n, total, each = report["devices"], report["bytes_total"], report["bytes_per_device"]
    out = [f"{'parameter':10s} {'shape':>12s} {'per device':>12s} {'bytes/device':>13s}  sharding"]
    for name, shape, shard, spec, nbytes in report["rows"]:
        out.append(f"{name:10s} {str(tuple(shape)):>12s} {str(tuple(shard)):>12s} {nbytes:>13,d}  {spec}")
    out.append(
        f"each of the {n} devices holds {each:,d} bytes of parameters; an even split is {total // n:,d} "
        f"({each / (total / n):.2f}x)"
    )
    for name, _shape, _shard, spec, _nbytes in report["rows"]:
        was, was_bytes = report["start"][name]
        if was != spec:
            out.append(f"{name}: {was} ({was_bytes:,d} bytes per device) before the first step, {spec} after it")
    return "\n".join(out)


def _child(job: dict) -> dict:
    """In the child process (PJRT_DEVICE=CPU, CPU_NUM_DEVICES=n): train under the plan and replicated."""
    import torch

    import labkit
    from labkit.lessons import capstone
    from labkit.spmd import make_mesh, sharding

    rt = labkit.setup("xla-cpu", spmd=True)
    mesh = make_mesh(None, (AXIS,))
    n = int(mesh.size())
    x, y = capstone.digits(seed=job["seed"])
    b, steps = job["batch"], job["steps"]
    report = {"devices": n}
    for label, plan in (("losses", job["plan"]), ("replicated_losses", {})):
        model = capstone.make_model(rt, job["width"], seed=job["seed"])
        sharding.apply_specs(model, mesh, {k: tuple(v) for k, v in plan.items()})
        params = dict(model.named_parameters())
        start = {name: [spec, sharding.device_bytes([params[name]])] for name, *_, spec in sharding.layout_table(model)}
        losses = []
        for i in range(steps):
            xb, yb = rt.to_device((x[i * b : (i + 1) * b], y[i * b : (i + 1) * b]))
            sharding.shard_batch((xb, yb), mesh, AXIS)
            loss, _correct, _labelled = capstone.reference_step(model, xb, yb, 0.05)
            rt.sync()
            losses.append(loss)
        report[label] = [float(v) for v in torch.stack(losses).cpu()]
        if label == "losses":  # `params` are the same tensors, updated in place
            report["start"] = start  # {name: [sharding, bytes per device]} before the first step
            report["rows"] = [
                [name, list(shape), list(shard), spec, sharding.device_bytes([params[name]])]
                for name, shape, shard, spec in sharding.layout_table(model)
            ]
            report["bytes_per_device"] = sharding.device_bytes(params.values())
            report["bytes_total"] = sum(p.numel() * p.element_size() for p in params.values())
    return report


if __name__ == "__main__":
    print(RESULT + json.dumps(_child(json.load(sys.stdin))), flush=True)
