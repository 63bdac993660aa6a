"""torch's CUDA backend (labkit.runtime's table: the CudaRuntime column)."""

from __future__ import annotations

import torch

from labkit import precision as _precision
from labkit.runtime.base import Runtime


class CudaRuntime(Runtime):
    """torch's own CUDA: eager, asynchronous kernels; under torchrun one process per GPU over nccl."""

    backs = (("cuda", False),)
    # TrainConfig.compile="auto" compiles the step for runs longer than the compile's payback on CUDA
    # (labkit.runtime.step.PAYBACK_STEPS["cuda"], from bench/bench_compile.py --device cuda)

    def wait(self) -> None:
        torch.cuda.synchronize(self.device)

    def ddp_device_ids(self):
        return [self.device.index]

    def iterate(self, loader, host):
        return loader.cuda_batches(host)  # pinned memory, copied on a side stream (labkit.loader)

    def seed_device(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def device_rng_state(self) -> dict:
        """This process's own GPU's generator only: get_rng_state_all() would open a CUDA context on every visible
        GPU (hundreds of MB each) from each of torchrun's processes, and under DCP every process would load one
        process's copy of them."""
        return {"cuda_device": torch.cuda.get_rng_state(self.device)} if torch.cuda.is_initialized() else {}

    def set_device_rng_state(self, state: dict) -> None:
        if "cuda_device" in state:
            torch.cuda.set_rng_state(state["cuda_device"], self.device)
        elif "cuda" in state:  # an older checkpoint: every visible GPU's
            torch.cuda.set_rng_state_all(state["cuda"])

    def precision_for(self, mode: str, want) -> _precision.Precision:
        return _precision.for_cuda(mode, want, self.device)

    def profiler_activities(self) -> list:
        import torch.profiler as tp

        return [tp.ProfilerActivity.CPU, tp.ProfilerActivity.CUDA]

    def device_names(self) -> list[str]:
        return [f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())]

    def memory(self) -> dict | None:
        """torch's allocator counters: host-side, no synchronisation."""
        idx = self.device.index or 0
        return {
            "used": torch.cuda.memory_allocated(idx),
            "peak": torch.cuda.max_memory_allocated(idx),
            "limit": torch.cuda.get_device_properties(idx).total_memory,
        }

    def chip_name(self) -> str | None:
        return torch.cuda.get_device_name(self.device)
