"""Peak FLOP/s of the chip we run on, and model FLOPs utilisation (MFU).

    peak, source = labkit.dashboard.flops.peak_flops(rt, "bf16")  # (1.97e14, "TPU v5e (TPU v5 lite): 197.0 TFLOP/s bf16 dense, ...")
    print(f"MFU {mfu(flops_per_step, step_time_s, peak):.1%}")

MFU = (FLOPs the model needs per step / step time) / the chip's peak FLOP/s. The model's FLOPs
are counted from its shapes (e.g. GPT.flops_per_token), not measured, so work the hardware does
on top (recomputation, padding, optimizer) does not raise MFU. Peaks are per chip, dense (no
2:4 sparsity), for the dtype the run computes in (a T4 does 65 TFLOP/s in fp16 but 8.1 in fp32:
measuring an fp32 run against the fp16 figure reports MFU 8x too low); a run with world_size chips compares one replica's
FLOP/s with one chip's peak.

On a CPU there is no vendor figure worth quoting, so `measure_cpu_peak()` times a float32
matmul for about a second (once per process) and uses that; the source string says "measured".
"""

from __future__ import annotations

import os
import re
import time

from labkit.config import check_number

# Peak dense FLOP/s per chip and dtype (no 2:4 sparsity: the "with sparsity" figures are twice these).
# TPUs: Google Cloud TPU system-architecture pages, "Peak compute per chip (bf16)": v2 45, v3 123, v4 275,
# v5e 197, v5p 459, v6e/Trillium 918 TFLOPs. A float32 matmul on a TPU runs at XLA's default precision,
# one bf16 pass on the MXU, so an fp32 run is measured against the same peak (torch_xla's "highest"
# matmul precision is several passes and several times slower; set LABKIT_PEAK_FLOPS then).
# NVIDIA data sheets, tensor-core dense: T4 fp16 65 / fp32 8.1 (Turing has no bf16 tensor cores);
# V100 SXM2 fp16 125 / fp32 15.7 (no bf16); A100 bf16=fp16 312 / fp32 19.5; L4 bf16=fp16 121 / fp32 30.3;
# H100 SXM bf16=fp16 989 / fp32 67; H100 PCIe 756 / 51; H200 989 / 67. The NVL cards (H100 NVL, H200 NVL: two
# or four boards bridged by NVLink, each with a lower power limit) are rated 835 / 60 per GPU, not SXM's 989;
# GH200's Hopper GPU is SXM-class, 989 / 67 (NVIDIA H100 and H200 data sheets, "H100 NVL" and "H200 NVL"
# columns, and the GH200 Grace Hopper Superchip data sheet; each "1,671 TFLOPS with sparsity" is 835 dense). GH200's
# dense 989 is the H100 SXM figure carried over, not read off GH200's own sheet: not verified here.
# fp32 is plain IEEE fp32: torch
# does not use TF32 for matmuls unless torch.backends.cuda.matmul.allow_tf32 is set (cuDNN convolutions
# do by default, so an fp32 ResNet on an A100 can exceed 100% of the fp32 figure).
_TPU = {"TPU v2": 45e12, "TPU v3": 123e12, "TPU v4": 275e12, "TPU v5e": 197e12, "TPU v5p": 459e12, "TPU v6e": 918e12}
PEAKS: dict[str, dict[str, float]] = {k: {"bf16": v, "fp32": v} for k, v in _TPU.items()}
PEAKS.update(
    {
        "T4": {"fp16": 65e12, "fp32": 8.1e12},
        "V100": {"fp16": 125e12, "fp32": 15.7e12},
        "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
        "L4": {"bf16": 121e12, "fp16": 121e12, "fp32": 30.3e12},
        "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12},
        "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
        "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
        "H100 NVL": {"bf16": 835e12, "fp16": 835e12, "fp32": 60e12},
        "H200 NVL": {"bf16": 835e12, "fp16": 835e12, "fp32": 60e12},
        "GH200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    }
)
PEAK_FLOPS: dict[str, float] = {k: v.get("bf16") or v["fp16"] for k, v in PEAKS.items()}  # 16-bit peaks
SOURCES = {  # a table key, or its first word -> where its figures come from (else "NVIDIA data sheet")
    "TPU": "Google Cloud TPU docs",
    "H100 NVL": "NVIDIA H100 data sheet, H100 NVL column",
    "H200 NVL": "NVIDIA H200 data sheet, H200 NVL column",
    "GH200": "NVIDIA GH200 Grace Hopper Superchip data sheet",
}

# Names as the chips report themselves -> PEAK_FLOPS keys, first match wins. XLA's device kind
# says "TPU v5 lite" for v5e, "TPU v5" for v5p, "TPU v6 lite" for v6e; TPU_ACCELERATOR_TYPE says
# "v5litepod-8", "v5p-8", "v6e-8"; CUDA says e.g. "NVIDIA H100 80GB HBM3", "NVIDIA L4".
_ALIASES = [
    (r"v6e|v6 ?lite|trillium", "TPU v6e"),
    (r"v5e|v5 ?lite", "TPU v5e"),
    (r"v5p|\bv5\b", "TPU v5p"),
    (r"\bv4", "TPU v4"),
    (r"\bv3", "TPU v3"),
    (r"\bv2", "TPU v2"),
    (r"\bA100", "A100"),
    (r"\bH100.*PCIe", "H100 PCIe"),
    (r"\bH100.*\bNVL", "H100 NVL"),
    (r"\bH200.*\bNVL", "H200 NVL"),
    (r"\bGH200", "GH200"),  # before H200: "NVIDIA GH200 480GB" (the word boundary already keeps H200 from it)
    (r"\bH100", "H100"),
    (r"\bH200", "H200"),
    (r"\bL4\b", "L4"),
    (r"\bT4\b", "T4"),
    (r"\bV100", "V100"),
]

_cpu_peak: float | None = None


def detect_chip(rt) -> str | None:
    """The chip's own name: 'TPU v5 lite', 'v5litepod-8', 'NVIDIA H100 80GB HBM3', 'cpu' (labkit.runtime: chip_name)."""
    return rt.chip_name()


def lookup(chip: str | None, dtype: str | None = None) -> tuple[str, float] | None:
    """(table key, peak) for a chip name as detect_chip reports it, or None. dtype None: the chip's
    16-bit peak (bf16, else fp16); 'bf16' | 'fp16' | 'fp32': that dtype's, None if the chip has none."""
    for pattern, key in _ALIASES:
        if chip and re.search(pattern, chip, flags=re.IGNORECASE):
            peak = PEAK_FLOPS[key] if dtype is None else PEAKS[key].get(dtype)
            return (key, peak) if peak else None
    return None


def measure_cpu_peak(seconds: float = 1.0, n: int = 1024) -> float:
    """FLOP/s of float32 n x n matmuls on this CPU (torch's own BLAS, all threads), timed for about
    `seconds` once per process and cached. A measured ceiling, not a vendor figure: MFU against it
    says how close a model gets to what this machine's matmul actually does."""
    global _cpu_peak
    if _cpu_peak is None:
        import torch

        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b  # warm-up: thread pool, caches
        reps, t0 = 0, time.perf_counter()
        while True:
            a @ b
            reps += 1
            dt = time.perf_counter() - t0
            if dt >= seconds:
                break
        _cpu_peak = 2 * n**3 * reps / dt
    return _cpu_peak


def peak_flops(rt, dtype: str | None = None) -> tuple[float | None, str]:
    """(peak FLOP/s of one chip for the dtype the run computes in, where the figure comes from).

    dtype: 'bf16' | 'fp16' | 'fp32', as labkit.precision.choose(rt, ...).name gives it; None: the dtype
    that labkit's automatic choice runs on this chip. LABKIT_PEAK_FLOPS overrides."""
    env = os.environ.get("LABKIT_PEAK_FLOPS")
    if env:
        try:
            value = float(env)
        except ValueError:
            raise ValueError(f"LABKIT_PEAK_FLOPS={env!r}: expected a number of FLOP/s, e.g. 1.97e14") from None
        return check_number("LABKIT_PEAK_FLOPS", value, above=True), "LABKIT_PEAK_FLOPS"
    chip = detect_chip(rt)
    if chip == "cpu":
        p = measure_cpu_peak()
        return p, f"CPU: {p / 1e9:.0f} GFLOP/s float32 matmul, measured here"
    if dtype is None:
        from labkit.precision import choose

        dtype = choose(rt).name
    found = lookup(chip, dtype)
    if found is None:
        known = lookup(chip)
        if known:
            return None, f"{known[0]} ({chip}) has no {dtype} peak in the table (no {dtype} matrix units)"
        return None, f"unknown chip {chip!r}: no peak (set LABKIT_PEAK_FLOPS to give one)"
    key, v = found
    source = SOURCES.get(key) or SOURCES.get(key.split()[0], "NVIDIA data sheet")
    return v, f"{key} ({chip}): {v / 1e12:.1f} TFLOP/s {dtype} dense, {source}"


def mfu(flops_per_step: float, step_time_s: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s over peak (None when the peak is unknown)."""
    if not peak or step_time_s <= 0:
        return None
    return flops_per_step / step_time_s / peak
