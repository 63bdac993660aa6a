"""Per-step values kept on the device, read without extra syncs.

    acc = DeviceAccumulator(rt)
    acc.add(loss=loss.detach())                         # every step: stays on the device
    if time_to_log:
        rt.add_step_closure(show, args=(acc.take(),))   # read after the step ran
    ...
    def show(sums): print(read(sums))                   # {'loss': sum over the interval, '_steps': n}

Why a list of per-step tensors rather than a running sum on the device: a running sum makes
every step's graph take the previous step's output as an input (a dependency between steps)
and measured ~3-6 % slower per step on XLA:CPU (bench/bench_loop.py); keeping each step's
loss alive only adds an output to the graph it already computes. At read time all of them
come back in ONE batched device->host transfer and are summed on the host.
"""

from __future__ import annotations

import torch


class DeviceAccumulator:
    def __init__(self, rt):
        self.rt = rt
        self._vals: dict[str, list[torch.Tensor]] = {}
        self.steps = 0  # add() calls since the last take()

    def add(self, **values: torch.Tensor) -> None:
        for name, v in values.items():
            self._vals.setdefault(name, []).append(v.detach())
        self.steps += 1

    def take(self) -> dict:
        """{name: [per-step device tensors]} plus '_steps'; starts a new interval."""
        out: dict = dict(self._vals)
        out["_steps"] = self.steps
        self._vals = {}
        self.steps = 0
        return out


def to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copy device tensors to the CPU in one go (one TransferFromDevice on XLA).

    Elsewhere one-element tensors (an interval's losses) are stacked on their device and copied once per
    device and dtype: on CUDA each copy is a wait for the device (torch.profiler on an H200, log every 20
    steps: 22 stream syncs per 20 steps with the losses read one by one, 4 once stacked). Larger tensors are
    copied one by one: stacking them would double their memory on the device for a moment."""
    if not tensors:
        return []
    if tensors[0].device.type == "xla":
        from labkit import _xla

        return _xla.to_cpu(tensors)  # batched: one transfer for all
    out, stacked = _copied(tensors, lambda t: t)
    for where, host in stacked:
        for i, v in zip(where, host):
            out[i] = v.reshape(tensors[i].shape)
    return out


def _copied(tensors: list[torch.Tensor], whole):
    """The CPU copies of the larger tensors, as whole(copy), at their positions (None elsewhere); and the one-element
    tensors of each device and dtype stacked and copied once: [(their positions, the stacked CPU tensor)]."""
    out: list = [None] * len(tensors)
    scalars: dict = {}  # (device, dtype) -> positions of one-element tensors
    for i, t in enumerate(tensors):
        if t.numel() == 1:
            scalars.setdefault((t.device, t.dtype), []).append(i)
        else:
            out[i] = whole(t.detach().cpu())
    stacked = [
        (where, torch.stack([tensors[i].detach().reshape(()) for i in where]).cpu()) for where in scalars.values()
    ]
    return out, stacked


def _numbers(tensors: list[torch.Tensor]) -> list:
    """Each tensor as a Python number (one element) or a list, copied as to_host copies them. Off XLA the one-element
    tensors of a device and dtype come back as one stacked tensor read with one .tolist(): the same numbers as one
    .item() each, without a host tensor and an .item() per step (the Trainer reads log_every losses at a time)."""
    if not tensors or tensors[0].device.type == "xla":
        return [t.item() if t.numel() == 1 else t.tolist() for t in to_host(tensors)]
    out, stacked = _copied(tensors, lambda t: t.tolist())
    for where, host in stacked:
        for i, v in zip(where, host.tolist()):
            out[i] = v
    return out


def read(values: dict) -> dict:
    """Device tensors (or lists of them) -> Python numbers; lists are summed. One transfer.

    Call it inside a step closure: the values are then already computed, so on XLA it costs
    that transfer and no graph execution. (Outside a closure it would first execute the
    pending graph: a host sync.)"""
    flat, where = [], []
    for k, v in values.items():
        items = v if isinstance(v, list) else [v]
        for t in items:
            if isinstance(t, torch.Tensor):
                flat.append(t)
                where.append(k)
    out = {k: v for k, v in values.items() if not isinstance(v, (list, torch.Tensor))}
    for k, val in zip(where, _numbers(flat)):
        if isinstance(values[k], list):
            out[k] = out.get(k, 0.0) + val
        else:
            out[k] = val
    for k, v in values.items():  # empty lists read as 0
        if isinstance(v, list) and k not in out:
            out[k] = 0.0
    return out


def mean_of(losses: list):
    """The mean of k micro-batch losses (tensors, or dicts of them), on the device: one added op in the optimizer
    step's graph, the same every step. With equal micro-batches it is the loss of the k-times larger batch."""
    if isinstance(losses[0], dict):
        return {name: torch.stack([d[name].detach() for d in losses]).mean() for name in losses[0]}
    return torch.stack([t.detach() for t in losses]).mean()
