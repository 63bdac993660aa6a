"""torch's CUDA backend (labkit.runtime's table: the CudaRuntime column)."""

from __future__ import annotations

import torch

from labkit import precision as _precision
from labkit.runtime.base import Runtime
from labkit.runtime.layout import Layout


def cudnn_benchmark(fixed_shapes: bool) -> tuple[bool, str]:
    """Whether to turn cuDNN's autotuner on (torch.backends.cudnn.benchmark), and why. It times every algorithm for
    each new convolution shape once, then reuses the fastest: it pays when shapes repeat (a DeviceLoader that drops
    the short last batch makes every step the same shape) and costs a search per shape when they do not."""
    if fixed_shapes:
        return (
            True,
            "every training batch has one shape (the short last one is dropped): each convolution is tuned once",
        )
    return False, "batch shapes vary (drop_partial=False): a new search for every new shape would cost more"


class CudaRuntime(Runtime):
    """torch's own CUDA: eager, asynchronous kernels; under torchrun one process per GPU over nccl."""

    backs = (("cuda", False),)
    fused_optimizers = True  # AdamW(fused=True): one multi-tensor kernel for the update instead of a few per tensor
    layout = Layout(
        True,
        "CUDA: tensor cores read NHWC, and cuDNN transposes an NCHW convolution in and out of it (ResNet-50, 224 px, "
        "batch 128, bf16, a hand loop on an H200, 2026-11-28: 54.6 ms a step in NCHW, 29.5 ms in channels_last)",
    )
    # TrainConfig.compile="auto" compiles the step for runs longer than the compile's payback on CUDA
    # (labkit.runtime.step.PAYBACK_STEPS["cuda"], from bench/bench_compile.py --device cuda)

    def wait(self) -> None:
        torch.cuda.synchronize(self.device)

    def autotune(self, fixed_shapes: bool) -> None:
        on, why = cudnn_benchmark(fixed_shapes)
        torch.backends.cudnn.benchmark = on
        if not self._said_tune:
            self._said_tune = True
            self.master_print(f"[labkit] cuDNN autotuner {'on' if on else 'off'}: {why}")

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
