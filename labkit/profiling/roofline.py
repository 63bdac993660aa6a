"""Predict before you measure: this device's matmul FLOP/s and memory bandwidth, and the roofline that turns
a step's FLOPs and bytes into a time.

    from labkit.profiling import roofline
    here = roofline.measure(rt)                       # Machine("xla:0 (measured)", flops=1.8e11, bandwidth=1.1e10)
    roofline.predict(flops=6 * batch * weights, bytes_moved=..., machine=here)   # {"s": ..., "bound": "compute"}
    roofline.predict(flops=..., bytes_moved=..., machine=roofline.V5E)          # the same arithmetic for a v5e chip

A kernel that does F FLOPs and moves B bytes takes at least max(F / peak FLOP/s, B / bandwidth). Its arithmetic
intensity F / B against the machine's ridge point (peak / bandwidth) says which term wins: compute-bound above the
ridge, memory-bound below. Real steps add overheads the roofline does not see (launching work, Python,
collectives), so a prediction is a lower bound; how far above it a measured step lands is the lesson.
"""

from __future__ import annotations

import dataclasses
import time


@dataclasses.dataclass(frozen=True)
class Machine:
    name: str
    flops: float  # FLOP/s of a large float matmul (measured) or the chip's dense peak (paper)
    bandwidth: float  # bytes/s between memory and the compute units
    memory: float | None = None  # bytes of device memory, where known

    @property
    def ridge(self) -> float:
        """FLOPs per byte where compute time equals memory time."""
        return self.flops / self.bandwidth


# Google Cloud's TPU v5e page: 197 TFLOP/s bf16 dense, 819 GB/s HBM, 16 GB HBM per chip. Not verified here (no TPU).
V5E = Machine("TPU v5e (paper figures, not verified here)", 197e12, 819e9, 16e9)


# A step whose matmuls take less than this at the device's rate is set by launching its kernels and by Python, not
# by the matmul rate: on an H200 the CI-sized GPT of notebook 02 (0.02 ms of matmuls) stepped in 5.4 ms. Below it
# only the roofline's floor is a claim; above it a measured step lands within a stated factor of the prediction.
LAUNCH_FLOOR_S = 1e-3


def upper_bound(predicted_s: float, factor: float) -> float:
    """The highest measured / predicted ratio to accept: `factor`, or none (inf) for a launch-bound step."""
    return factor if predicted_s >= LAUNCH_FLOOR_S else float("inf")


def _timed(rt, fn, repeats: int) -> float:
    """Seconds per call of fn(), after one untimed call (the compile, on XLA); the device is synced and waited
    for at both ends, so the time is the device's work, not the time to queue it."""
    out = fn()  # held until after the sync: on XLA a tensor nobody holds is not computed at all
    rt.sync()
    rt.wait()  # the backend's own wait: XLA and CUDA run asynchronously, the CPU has finished already
    t0 = time.perf_counter()
    for _ in range(repeats):
        out = fn()
        rt.sync()
    rt.wait()
    del out
    return (time.perf_counter() - t0) / repeats


def measure(rt, n: int = 1024, mb: int = 64, repeats: int = 8) -> Machine:
    """Time an n x n float32 matmul (2 n^3 FLOPs) and a copy-and-scale of `mb` MB (reads it once, writes it once)
    on rt.device. About a second on a 2-core CPU; the figures move with the machine's load, so compare a
    prediction with a measurement taken in the same run."""
    import torch

    a = torch.randn(n, n, device=rt.device)
    b = torch.randn(n, n, device=rt.device)
    v = torch.randn(mb * 2**20 // 4, device=rt.device)
    t_mm = _timed(rt, lambda: a @ b, repeats)
    t_bw = _timed(rt, lambda: v * 1.5, repeats)
    return Machine(f"{rt.device} (measured)", 2 * n**3 / t_mm, 2 * v.numel() * 4 / t_bw)


def predict(flops: float, bytes_moved: float, machine: Machine) -> dict:
    """The roofline's time for a kernel (or a step) of `flops` FLOPs that moves `bytes_moved` bytes."""
    t_compute, t_memory = flops / machine.flops, bytes_moved / machine.bandwidth
    intensity = flops / bytes_moved if bytes_moved else float("inf")
    return {
        "s": max(t_compute, t_memory),
        "compute_s": t_compute,
        "memory_s": t_memory,
        "intensity": intensity,
        "bound": "compute" if intensity >= machine.ridge else "memory",
    }
