"""The Runtime: where tensors live and how replicas talk, as labkit.setup() found it (labkit.device builds it;
labkit.torchrun builds it for torchrun's processes). BackendError is what setup() raises with a fix in words.

    rt = labkit.setup(); rt.device, rt.world_size, rt.sync(), rt.to_device(batch)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from labkit.seeding import manual_seed as _seed  # the one home for seeding and RNG capture


class BackendError(RuntimeError):
    """A backend was asked for that this machine or process cannot give."""


@dataclass
class Runtime:
    """Where tensors live and how replicas talk. Build it with `labkit.setup()`."""

    kind: str
    device: torch.device
    world_size: int = 1
    ordinal: int = 0
    local_ordinal: int = 0
    local_device_count: int = 1
    spmd: bool = False
    info: dict = field(default_factory=dict)
    compile_cache: str | None = None  # the persistent compile cache folder in use (None: off; see info)

    @property
    def is_xla(self) -> bool:
        return self.kind in ("tpu", "xla-cpu")

    @property
    def is_master(self) -> bool:
        return self.ordinal == 0

    # -- the few calls a training loop needs -------------------------------------------------
    def sync(self) -> None:
        """Cut the lazy graph and launch it (XLA). Elsewhere a no-op: eager ops already ran."""
        if self.is_xla:
            import torch_xla

            torch_xla.sync()

    def to_device(self, obj, non_blocking: bool = False):
        if isinstance(obj, torch.Tensor):
            return obj.to(self.device, non_blocking=non_blocking)
        if isinstance(obj, dict):
            return {k: self.to_device(v, non_blocking) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            out = [self.to_device(v, non_blocking) for v in obj]
            return type(obj)(out) if not hasattr(obj, "_fields") else type(obj)(*out)
        return obj

    def master_print(self, *args, **kwargs) -> None:
        if self.is_master:
            print(*args, **kwargs, flush=True)

    def rendezvous(self, tag: str) -> None:
        if self.world_size <= 1:
            return
        if self.is_xla:
            import torch_xla.core.xla_model as xm

            xm.rendezvous(tag)
        elif torch.distributed.is_initialized():
            torch.distributed.barrier()

    def add_step_closure(self, fn, args=()) -> None:
        """Run fn(*args) after the current step's graph has executed (XLA), or now (eager).

        On XLA reading a tensor inside the closure costs one device->host transfer but no extra
        graph execution, because the values are already computed when the closure runs."""
        if self.is_xla:
            import torch_xla.core.xla_model as xm

            xm.add_step_closure(fn, args=args)
        else:
            fn(*args)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Sum or mean over replicas (identity with one replica). Returns a new tensor on XLA."""
        if op not in ("sum", "mean"):
            raise ValueError(f"all_reduce op must be 'sum' or 'mean', got {op!r}")
        if self.world_size <= 1 or self.spmd:
            return tensor
        if self.is_xla:
            import torch_xla.core.xla_model as xm

            out = xm.all_reduce(xm.REDUCE_SUM, tensor)
        else:
            out = tensor.clone()
            torch.distributed.all_reduce(out)
        return out / self.world_size if op == "mean" else out

    def manual_seed(self, seed: int) -> None:
        _seed(seed, self)

    def __repr__(self) -> str:
        extra = ", spmd" if self.spmd else ""
        extra += f", compile_cache={self.compile_cache!r}" if self.compile_cache else ""
        return (
            f"Runtime(kind={self.kind!r}, device={str(self.device)!r}, world_size={self.world_size}, "
            f"ordinal={self.ordinal}, local_devices={self.local_device_count}{extra})"
        )
