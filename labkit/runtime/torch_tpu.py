"""TorchTPU's backend: torch-tpu's `tpu` device, one process per chip (labkit.runtime's table, the TorchTpuRuntime
column; docs/backends.md, the TorchTPU column).

    rt = labkit.setup()          # on a TPU VM with torch-tpu and its chips: TorchTpuRuntime ("torch-tpu")
    LABKIT_BACKEND=torch-tpu     # asks for it by name (where torch_xla could drive the chips too)

TorchTPU (`torch-tpu` 0.2.0 on PyPI: torch >= 2.11, <= 2.15, libtpu >= 0.0.50) is a PrivateUse1 device named `tpu`
that torch loads through its `torch.backends` entry point. It runs eagerly, op by op, as CUDA does; the Trainer
compiles its step with `torch.compile(backend="tpu", dynamic=False)`, which its guide asks for. Several chips:
one process per chip (torchrun), joined over the "tpu" process group; DDP, FSDP2 (DTensor) and DCP are torch's own.

Where each name comes from (torch-tpu 0.2.0's wheel, read; nothing here ran on a chip):
- `torch.accelerator.*` rather than `torch.tpu.*` for synchronize, device_count and is_available: torch_tpu marks
  its own as internal from torch 2.11 on (`torch_tpu/_internal/device/_device_module.py`, `prefer=` in each
  decorator); `torch.tpu.is_available()` raises there.
- `torch.tpu.manual_seed_all`, `get_rng_state`, `set_rng_state`, `get_device_name`, `get_device_properties`:
  `torch_tpu/_internal/public_api.py` exports them (experimental).
- the "tpu" compile backend: `torch_tpu/_internal/compile/__init__.py` registers it; torch_tpu's `torch.compile`
  wrapper (`torch_tpu/_loader.py`) refuses Inductor on TPU tensors, so labkit never passes "inductor" here.
- the "tpu" and "tpu_dist" process-group backends: registered by `torch_tpu/_loader.py` (`_init_device_impl`) when
  the autoload finds chips (a PCI scan, `torch_tpu/_internal/utils/hardware.py`); without chips nothing registers.
- a multi-process job needs TORCH_TPU_SLICEBUILDER_ADDRESSES and TORCH_TPU_TOPOLOGY decided in the parent, before
  torchrun starts: `torch_tpu/_internal/distributed/distributed.py` (`python -m torch.tpu.distributed` prints them).

CALLS is every such name labkit calls, with the parameters it passes: tests/children/torch_tpu_contract.py checks
each against the real package in the simulated TorchTPU image. The values they return need a chip: not checked here.
"""

from __future__ import annotations

import torch

from labkit import precision as _precision
from labkit.runtime.base import Runtime

# name -> the parameters labkit passes (positional names first, then keywords), checked against the package
CALLS = {
    "torch.accelerator.is_available": (),
    "torch.accelerator.device_count": (),
    "torch.accelerator.current_accelerator": (),
    "torch.accelerator.set_device_index": ("device",),
    "torch.accelerator.synchronize": ("device",),
    "torch.accelerator.memory_allocated": ("device",),
    "torch.accelerator.max_memory_allocated": ("device",),
    "torch.tpu.manual_seed_all": ("seed",),
    "torch.tpu.get_rng_state": ("device",),
    "torch.tpu.set_rng_state": ("new_state", "device"),
    "torch.tpu.get_device_name": ("device",),
    "torch.tpu.get_device_properties": ("device",),
    "torch.tpu.get_amp_supported_dtype": (),
}
COMPILE_BACKEND = "tpu"  # torch.compile's backend for TPU tensors (Inductor is refused on them)
PROCESS_GROUP = "tpu"  # torch.distributed's backend name for the chips' collectives
LAUNCH_ENV = ("TORCH_TPU_SLICEBUILDER_ADDRESSES", "TORCH_TPU_TOPOLOGY")  # set before torchrun, in the parent


def chips() -> int:
    """TPU chips TorchTPU drives in this process: torch.accelerator's count when its accelerator is the `tpu` device,
    else 0 (torch_tpu absent, or its autoload found no chip and left the device unregistered)."""
    acc = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    if acc is None or acc.type != "tpu" or not torch.accelerator.is_available():
        return 0
    return int(torch.accelerator.device_count())


def for_torch_tpu(mode: str, want) -> _precision.Precision:
    """bf16 autocast on the `tpu` device (its device module lists the dtypes autocast may use:
    torch.tpu.get_amp_supported_dtype), fp32 on request; fp16 refused as on torch_xla's TPU."""
    if mode == "fp32":
        return _precision.Precision("fp32", "tpu", f"asked for ({want!r})")
    if mode == "fp16":
        raise ValueError("fp16 on a TPU: the MXU computes in bf16; use 'bf16' (or 'auto')")
    return _precision.Precision("bf16", "tpu", "TPU (TorchTPU): the MXU computes in bf16")


class TorchTpuRuntime(Runtime):
    """TorchTPU's `tpu` device: eager ops as Python calls them, the step compiled with backend="tpu"; under torchrun
    one process per chip over the "tpu" process group (DDP or FSDP2, labkit.parallel)."""

    backs = (("torch-tpu", False),)
    _said_backend = False

    def wait(self) -> None:
        torch.accelerator.synchronize(self.device)

    def step_capture(self, setting: str = "auto", backend: str = "inductor", steps: int | None = None):
        """torch.compile with backend="tpu": the config's default "inductor" is TorchTPU's "tpu" here (torch_tpu
        refuses Inductor on TPU tensors), said once. "auto" compiles by PAYBACK_STEPS["torch-tpu"]."""
        if backend == "inductor":
            backend = COMPILE_BACKEND
            if not self._said_backend and setting != "off":
                self._said_backend = True
                self.master_print(
                    "[labkit] torch.compile backend 'tpu', TorchTPU's: torch_tpu refuses Inductor on TPU tensors "
                    "(TrainConfig.compile_backend names another)"
                )
        return super().step_capture(setting, backend, steps)

    def iterate(self, loader, host):
        """Each host batch copied to the chip as it comes. Pinned memory and copies ahead of the step are CUDA's
        (labkit.loader's cuda_batches); whether TorchTPU overlaps them is not known here: not used."""
        batches = host if not loader.layout.channels_last else (loader.layout.batch(b) for b in host)
        return (self.to_device(b) for b in batches)

    def seed_device(self, seed: int) -> None:
        torch.tpu.manual_seed_all(seed)

    def device_rng_state(self) -> dict:
        return {"tpu_device": torch.tpu.get_rng_state(self.device)}

    def set_device_rng_state(self, state: dict) -> None:
        if "tpu_device" in state:
            torch.tpu.set_rng_state(state["tpu_device"], self.device)

    def precision_for(self, mode: str, want) -> _precision.Precision:
        return for_torch_tpu(mode, want)

    def profiler_activities(self) -> list:
        """The host's ops and, through the Kineto backend torch_tpu registers, PrivateUse1 (the chip's) activity;
        what the trace holds on a chip is not verified here."""
        import torch.profiler as tp

        return [tp.ProfilerActivity.CPU, tp.ProfilerActivity.PrivateUse1]

    def device_names(self) -> list[str]:
        return [f"tpu:{i} {torch.tpu.get_device_name(i)}" for i in range(torch.accelerator.device_count())]

    def memory(self) -> dict | None:
        """The chip's HBM (torch.tpu.get_device_properties: static) and torch.accelerator's allocator counters where
        TorchTPU fills them; None where it does not (not verified: no chip here)."""
        try:
            return {
                "used": torch.accelerator.memory_allocated(self.device),
                "peak": torch.accelerator.max_memory_allocated(self.device),
                "limit": torch.tpu.get_device_properties(self.device).total_memory,
            }
        except (AttributeError, RuntimeError, NotImplementedError):
            return None

    def chip_name(self) -> str | None:
        return torch.tpu.get_device_name(self.device)
