"""Environment doctor: what is installed, where we run, and what is likely to bite.

    report = labkit.doctor()        # prints a short report, returns it as a dict

Warnings it knows (each says what to do):
- torch and torch_xla of different minor versions (torch_xla X.Y needs torch X.Y.*);
- a TPU was expected (Colab TPU runtime, TPU VM, PJRT_DEVICE=TPU) but PJRT runs on CPU;
- deprecated or removed variables still set (XLA_USE_BF16, XRT_*...).
"""
from __future__ import annotations

import importlib.metadata as md
import os
import platform
import sys

from . import device as _device

# variable -> what to do instead
DEPRECATED_ENV = {
    "XLA_USE_BF16": "deprecated since torch_xla 2.4: use torch.autocast('xla', dtype=torch.bfloat16) "
                    "(labkit: TrainConfig.bf16=True) or cast the model with .to(torch.bfloat16)",
    "XLA_DOWNCAST_BF16": "deprecated: use autocast or explicit bfloat16 dtypes",
    "XLA_USE_FP16": "deprecated: use autocast or explicit dtypes",
    "XRT_TPU_CONFIG": "XRT was removed in torch_xla 2.1: use PJRT (PJRT_DEVICE=TPU)",
    "XRT_DEVICE_MAP": "XRT was removed in torch_xla 2.1: use PJRT",
    "XRT_WORKERS": "XRT was removed in torch_xla 2.1: use PJRT",
    "GPU_NUM_DEVICES": "torch_xla 2.9 has no CUDA backend: use torch's own 'cuda' device (LABKIT_BACKEND=cuda)",
}


def version_of(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _minor(v: str) -> tuple[int, int] | None:
    try:
        parts = v.split("+")[0].split(".")
        return int(parts[0]), int(parts[1])
    except (ValueError, IndexError):
        return None


def check_versions(torch_version: str | None, xla_version: str | None) -> list[str]:
    """Warnings for a torch / torch_xla pair that do not belong together (pure function)."""
    if not torch_version or not xla_version:
        return []
    t, x = _minor(torch_version), _minor(xla_version)
    if t is None or x is None or t == x:
        return []
    want = f"{x[0]}.{x[1]}"
    return [f"torch {torch_version} does not match torch_xla {xla_version} (minor versions differ; "
            f"import may fail or ops may silently differ). Fix: pip install 'torch=={want}.*' "
            f"'torch_xla=={xla_version.split('+')[0]}' — or torch_xla matching torch "
            f"{t[0]}.{t[1]}: pip install 'torch_xla=={t[0]}.{t[1]}.*'"]


def where() -> str:
    if "google.colab" in sys.modules or os.environ.get("COLAB_RELEASE_TAG") or os.environ.get("COLAB_GPU"):
        return "colab"
    if os.environ.get("KAGGLE_KERNEL_RUN_TYPE"):
        return "kaggle"
    if os.environ.get("TPU_ACCELERATOR_TYPE") or os.path.exists("/dev/accel0") or os.path.exists("/dev/vfio/0"):
        return "tpu-vm"
    return "plain"


def _devices(rt) -> list[str]:
    if rt is None:
        return []
    if rt.is_xla:
        import torch_xla.core.xla_model as xm

        return [str(d) for d in xm.get_xla_supported_devices()] or [str(rt.device)]
    if rt.kind == "cuda":
        import torch

        return [f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())]
    return ["cpu"]


def doctor(rt=None, *, quiet: bool = False) -> dict:
    """Collect versions, platform, devices and warnings; print them unless quiet."""
    rt = rt or _device.current_runtime()
    versions = {"python": platform.python_version(), "torch": version_of("torch"),
                "torch_xla": version_of("torch_xla") or version_of("torch-xla"),
                "torchvision": version_of("torchvision"),
                "libtpu": version_of("libtpu") or version_of("libtpu-nightly"),
                "labkit": version_of("labkit")}
    found = _device.detect()
    warnings = check_versions(versions["torch"], versions["torch_xla"])
    for var, fix in DEPRECATED_ENV.items():
        if var in os.environ:
            warnings.append(f"{var}={os.environ[var]} is set: {fix}")
    place = where()
    pjrt = os.environ.get("PJRT_DEVICE")
    expected_tpu = found["tpu"] or (place == "colab" and os.environ.get("COLAB_TPU_ADDR"))
    if rt is not None and rt.is_xla and expected_tpu and rt.kind != "tpu":
        warnings.append(f"a TPU was expected ({found['tpu'] or place}) but XLA runs on {rt.info.get('pjrt_device', 'CPU')}: "
                        "PJRT fell back to the CPU. Check that libtpu is installed (pip install 'torch_xla[tpu]'), "
                        "that PJRT_DEVICE=TPU, and that no other process holds the TPU")
    if pjrt and pjrt.upper() == "TPU" and not found["torch_xla"]:
        warnings.append("PJRT_DEVICE=TPU but torch_xla is not installed")
    if versions["torch_xla"] and not versions["libtpu"] and place in ("colab", "tpu-vm") and found["tpu"]:
        warnings.append("torch_xla is installed without libtpu: pip install 'torch_xla[tpu]==2.9.0'")
    report = {"versions": versions, "platform": place, "machine": platform.machine(),
              "pjrt_device": pjrt, "backend": rt.kind if rt else _device.resolve_backend(),
              "runtime": repr(rt) if rt else None, "devices": _devices(rt),
              "found": found, "warnings": warnings}
    if not quiet:
        print(format_report(report))
    return report


def format_report(r: dict) -> str:
    v = r["versions"]
    lines = ["labkit doctor",
             "  versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val),
             f"  platform: {r['platform']} ({r['machine']}), PJRT_DEVICE={r['pjrt_device'] or 'unset'}",
             f"  backend:  {r['backend']}  {r['runtime'] or '(labkit.setup() not called yet)'}",
             f"  devices:  {', '.join(r['devices']) or '-'}"]
    lines += [f"  WARNING: {w}" for w in r["warnings"]] or ["  no warnings"]
    return "\n".join(lines)
