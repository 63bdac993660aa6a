"""Running sums kept on the device, read without extra syncs.

    acc = DeviceAccumulator(rt)
    acc.add(loss=loss.detach(), correct=correct)     # every step: stays on the device
    if time_to_log:
        rt.add_step_closure(show, args=(acc.take(),))  # values read after the step ran

`take()` hands back the sums and restarts them, without changing the graph: every step
computes `sum = where(keep, sum, 0) + x` where `keep` is one of two device tensors made
once. Resetting with a fresh `torch.zeros` would instead make the step after each read a
different graph, i.e. one more compilation on XLA.
"""
from __future__ import annotations

import torch


class DeviceAccumulator:
    def __init__(self, rt):
        self.rt = rt
        self._one = torch.ones((), dtype=torch.bool, device=rt.device)
        self._zero = torch.zeros((), dtype=torch.bool, device=rt.device)
        self._keep = self._zero  # first add starts the sums
        self._sums: dict[str, torch.Tensor] = {}
        self.steps = 0  # host-side count of add() calls since the last take()

    def add(self, **values: torch.Tensor) -> None:
        keep = self._keep
        for name, v in values.items():
            v = v.detach().float()
            prev = self._sums.get(name)
            # where() rather than prev * keep: a NaN must not survive a restart
            self._sums[name] = v if prev is None else torch.where(keep, prev, torch.zeros_like(prev)) + v
        self._keep = self._one
        self.steps += 1

    def take(self) -> dict:
        """The current sums (device tensors) and how many steps they cover; restarts the sums."""
        out = dict(self._sums)
        out["_steps"] = self.steps
        self._keep = self._zero
        self.steps = 0
        return out


def read(values: dict) -> dict:
    """Device tensors -> Python floats, in ONE device->host transfer for all of them.

    Call it inside a step closure: the values are then already computed, so on XLA it costs
    that transfer and no graph execution. (Outside a closure it would first execute the
    pending graph: a host sync.)"""
    keys = [k for k, v in values.items() if isinstance(v, torch.Tensor)]
    tensors = [values[k] for k in keys]
    out = dict(values)
    if not tensors:
        return out
    if tensors[0].device.type == "xla":
        import torch_xla.core.xla_model as xm

        cpu = xm._maybe_convert_to_cpu(tensors)  # batched transfer (one TransferFromDevice)
    else:
        cpu = [t.detach().cpu() for t in tensors]  # CUDA: sync once, then cheap copies
    for k, t in zip(keys, cpu):
        out[k] = t.item() if t.numel() == 1 else t.tolist()
    return out
