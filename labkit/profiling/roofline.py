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

The launches themselves: dispatch_s() times the host's cost of one eager op, count_kernels(step) counts the ops a
step dispatches, and launch_bound_s(kernels, launch_s, kernel_s, graph) says whether the host or the device sets an
eager step's time and what replaying it as one CUDA graph would leave.
"""

from __future__ import annotations

import dataclasses
import time

from labkit.config import check_number


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


# -- launch overhead: the host's share of an eager step ---------------------------------------------------------------

# Ops that launch no kernel on a GPU: the profiler's markers, and `.item()` (a device->host copy and a wait, not work)
_NOT_KERNELS = ("profiler.", "aten._local_scalar_dense")


def dispatch_s(n: int = 2000, repeats: int = 5) -> float:
    """Host seconds per eager op: the median over `repeats` of n in-place adds on a 16-element CPU tensor, after a
    warm-up. The add's arithmetic is a few nanoseconds; the rest is Python, torch's dispatcher and autograd's checks,
    the work the host does before any kernel, on any device. About 20 ms in all."""
    import statistics

    import torch

    check_number("dispatch_s: n", n, low=1, integer=True)
    check_number("dispatch_s: repeats", repeats, low=1, integer=True)
    x = torch.zeros(16)
    for _ in range(n // 10):
        x.add_(1.0)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            x.add_(1.0)
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times)


def count_kernels(fn) -> dict[str, int]:
    """{aten op: calls} of the ops fn() dispatches (its backward too, where it calls one) that would each launch a
    kernel on a GPU: a TorchDispatchMode sees every op after autograd, and views (`t`, `view`, `detach`: metadata,
    no kernel), profiler markers and `.item()` are left out. Ops, not kernels exactly: Inductor fuses many into one,
    a cuBLAS call may launch two."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    seen: collections.Counter = collections.Counter()

    class _Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket)
            if not func.is_view and not name.startswith(_NOT_KERNELS):
                seen[name] += 1
            return func(*args, **(kwargs or {}))

    with _Count():  # a context manager: the mode is popped even when fn raises
        fn()
    return dict(seen)


def launch_bound_s(kernels: int, launch_s: float, kernel_s: float, graph: bool = False) -> float:
    """Seconds for one step timed alone, from its first launch to its last kernel's end: `kernels` kernels, each taking
    the host `launch_s` to launch and the device `kernel_s` to run, on a device that runs them in order, each once it
    is launched and the one before it has ended. Eager, the host launches them one by one, queued ahead while the
    device works, so the slower stream sets the time: kernels x max(launch_s, kernel_s) plus the faster one's last
    (or first) item, host-bound when a kernel runs shorter than its launch, device-bound otherwise. Replayed as a CUDA
    graph, the host launches the whole graph once: launch_s + kernels x kernel_s. A model of the overlap, not a
    measurement (it leaves out Python between launches, syncs, and the replay's own cost on the device)."""
    check_number("launch_bound_s: kernels", kernels, low=1, integer=True)
    check_number("launch_bound_s: launch_s", launch_s)
    check_number("launch_bound_s: kernel_s", kernel_s)
    if graph:
        return launch_s + kernels * kernel_s
    return kernels * max(launch_s, kernel_s) + min(launch_s, kernel_s)
