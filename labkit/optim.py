"""One optimizer step, right for every backend.

    loss.backward()
    labkit.optimizer_step(optimizer, rt, clip_norm=1.0)

- XLA with several replicas (one process per device): `xm.optimizer_step` all-reduces the
  gradients, then steps.
- XLA SPMD or one device, CUDA (DDP already reduced the gradients in backward), CPU: a plain
  `optimizer.step()`.
- Then the step as the run's labkit.precision.Precision takes it (fp32 when none is given): under fp16
  the GradScaler unscales, the gradients are clipped, the step is taken or skipped, the scale updated.
- Optional gradient clipping by global norm: torch.nn.utils.clip_grad_norm_, which computes the
  norm and the scale factor as tensors on the device with no `.item()`, so nothing waits for the
  device (on XLA an `.item()` here would force an execution and a device->host transfer every step;
  tests/test_loop.py proves none happens).
"""

from __future__ import annotations

import math

import torch

from labkit.config import check_number
from labkit.precision import Precision

FP32 = Precision("fp32", "cpu", "no precision given: a plain optimizer.step()")  # no autocast, no scaler


def check_lr(optimizer) -> None:
    """Every param group's lr a finite number >= 0 (ValueError naming the group)."""
    for i, g in enumerate(optimizer.param_groups):
        lr = g.get("lr")
        if isinstance(lr, (int, float)):
            check_number(f"optimizer param group {i}'s lr", lr)


def move_model(model, optimizer, device):
    """Move the model to the device; if that replaced the Parameter objects (CPU -> XLA does),
    point the optimizer at the new ones so an optimizer built before the move still trains."""
    before = list(model.parameters())
    model = model.to(device)
    after = list(model.parameters())
    remap = {id(a): b for a, b in zip(before, after) if a is not b}
    if remap and optimizer is not None:
        for group in optimizer.param_groups:
            group["params"] = [remap.get(id(p), p) for p in group["params"]]
        moved = {}
        for p, st in optimizer.state.items():
            moved[remap.get(id(p), p)] = {
                k: v.to(device) if torch.is_tensor(v) and v.dim() else v for k, v in st.items()
            }
        optimizer.state.clear()
        optimizer.state.update(moved)
    return model


def reduce_gradients(optimizer, rt) -> None:
    """All-reduce (mean) gradients across replicas where the backend needs it done by hand (labkit.runtime)."""
    rt.reduce_gradients(optimizer)


def optimizer_step(optimizer, rt, *, clip_norm: float | None = None, precision=None):
    """Reduce gradients across replicas where needed, clip if asked, step.

    Returns the pre-clip gradient norm tensor when clip_norm is set, else None.
    The reduction is the backend's (labkit.runtime): xm.reduce_gradients with several XLA replicas (what
    xm.optimizer_step does before its step), nothing under SPMD (the compiler inserted it) or DDP (done in
    backward). The rest is the precision's (labkit.precision.Precision.step: unscale, clip, step, update)."""
    rt.reduce_gradients(optimizer)  # before clipping: the clip must see the reduced gradients
    return (precision or FP32).step(optimizer, clip_norm)


def scaled_lr(lr: float, base_batch: int, global_batch: int, rule: str = "linear") -> float:
    """The learning rate for `global_batch` samples per optimizer step, given one (`lr`) set for `base_batch`.

    linear (Goyal et al. 2017, "Accurate, Large Minibatch SGD"): lr x global/base. k times the batch averages k times the
    samples into one step, so one step should move as far as k steps did; it holds for SGD up to a few thousand
    images, with a warm-up (the first steps' large moves at a large lr diverge). sqrt: lr x sqrt(global/base), the lr
    only. For SGD that form is older (Krizhevsky 2014, "One weird trick"; Hoffer et al. 2017). For Adam, Malladi et al.
    2022 derive a square-root rule that also scales the betas (1 - beta times k) and eps (divided by sqrt(k)); this
    function does not touch them. Both are starting points to tune from, not laws: past the statistical critical batch
    size (McCandlish et al. 2018; batch_tradeoff below) neither keeps the loss per sample."""
    check_number("scaled_lr: lr", lr)
    check_number("scaled_lr: base_batch", base_batch, low=1, integer=True)
    check_number("scaled_lr: global_batch", global_batch, low=1, integer=True)
    ratio = global_batch / base_batch
    if rule == "linear":
        return lr * ratio
    if rule == "sqrt":
        return lr * math.sqrt(ratio)
    raise ValueError(f"scaled_lr: rule {rule!r} is not 'linear' or 'sqrt'")


def batch_tradeoff(batch: int, s_min: float, b_noise: float) -> tuple[float, float]:
    """(steps, examples) a run at a constant `batch` needs to reach a given loss, in McCandlish et al. 2018's model
    ("An Empirical Model of Large-Batch Training", arXiv 1812.06162): S = S_min (1 + B_noise / B) and
    E = B S = E_min (1 + B / B_noise), with E_min = S_min B_noise. Their eq. 2.11, (S/S_min - 1)(E/E_min - 1) = 1, and
    eq. 2.12, B_crit = E_min / S_min, which they find close to the gradient noise scale B_noise. Below B_noise a k-times
    batch needs nearly k times fewer steps for nearly the same examples (linear scaling pays); above it the steps
    stop falling (never below S_min) while the examples grow with B. At B = B_noise: 2 S_min steps, 2 E_min examples.
    B_noise is a property of the task and of the loss reached (it grows as the loss falls): measure it, do not guess."""
    check_number("batch_tradeoff: batch", batch, low=1)
    check_number("batch_tradeoff: s_min", s_min, above=True)
    check_number("batch_tradeoff: b_noise", b_noise, above=True)
    steps = s_min * (1 + b_noise / batch)
    return steps, batch * steps


class WarmupCosine:
    """lr multiplier: linear warm-up to 1 over `warmup` steps, then a cosine down to `floor` at
    `total`, flat after it (a resumed run may train past `total`). A class, not a lambda, so
    LambdaLR's state_dict records (warmup, total, floor) as plain numbers (weights_only-safe)."""

    def __init__(self, warmup: int, total: int, floor: float = 0.0):
        check_number("warmup_cosine: warmup", warmup, integer=True)
        check_number("warmup_cosine: total", total, integer=True)
        check_number("warmup_cosine: floor", floor, high=1.0)
        self.warmup, self.total, self.floor = int(warmup), int(total), float(floor)

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        t = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.floor + (1.0 - self.floor) * 0.5 * (1.0 + math.cos(math.pi * t))


def warmup_cosine(optimizer, warmup: int, total: int, floor: float = 0.0) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over WarmupCosine: call scheduler.step() once per optimizer step (the Trainer
    does). The learning rate stays a Python number: no graph input changes on XLA.

        scheduler = warmup_cosine(optimizer, warmup=total // 10, total=total, floor=0.02)
    """
    return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(warmup, total, floor))
