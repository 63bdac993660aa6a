"""One optimizer step, right for every backend.

    loss.backward()
    labkit.optimizer_step(optimizer, rt, clip_norm=1.0)

- XLA with several replicas (one process per device): `xm.optimizer_step` all-reduces the
  gradients, then steps.
- XLA SPMD or one device, CUDA (DDP already reduced the gradients in backward), CPU: a plain
  `optimizer.step()`.
- Optional gradient clipping by global norm, computed on the device with no `.item()`: the
  scale factor is a tensor, so nothing waits for the device (on XLA an `.item()` here would
  force an execution and a device->host transfer every step).
"""
from __future__ import annotations

import torch


def _grads(optimizer):
    return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


def clip_grad_norm(optimizer, max_norm: float, eps: float = 1e-6) -> torch.Tensor:
    """Scale all gradients so their global L2 norm is at most max_norm. Returns the norm
    before clipping, as a device tensor (read it in a step closure if you want to show it)."""
    grads = _grads(optimizer)
    if not grads:
        return torch.zeros(())
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.detach(), 2) for g in grads]), 2)
    scale = torch.clamp(max_norm / (norm + eps), max=1.0)  # a tensor: no host sync
    for g in grads:
        g.detach().mul_(scale.to(g.dtype))
    return norm


def reduce_gradients(optimizer, rt) -> None:
    """All-reduce (mean) gradients across XLA replicas; no-op otherwise."""
    if rt.is_xla and rt.world_size > 1 and not rt.spmd:
        import torch_xla.core.xla_model as xm

        xm.reduce_gradients(optimizer)


def optimizer_step(optimizer, rt, *, clip_norm: float | None = None, scaler=None):
    """Reduce gradients across replicas where needed, clip if asked, step.

    Returns the pre-clip gradient norm tensor when clip_norm is set, else None."""
    multi_xla = rt.is_xla and rt.world_size > 1 and not rt.spmd
    norm = None
    if clip_norm is None:
        if multi_xla:
            import torch_xla.core.xla_model as xm

            xm.optimizer_step(optimizer)  # all-reduce + step in one call
        elif scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        return None
    # clipping must see the reduced gradients, so reduce first, then clip, then step
    reduce_gradients(optimizer, rt)
    if scaler is not None:
        scaler.unscale_(optimizer)
    norm = clip_grad_norm(optimizer, clip_norm)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    return norm
