"""Environment doctor: what is installed, where we run, and what is likely to bite.

    report = labkit.doctor()        # prints a short report, returns it as a dict

Warnings it knows (each says what to do):
- torch and torch_xla of different minor versions (torch_xla X.Y needs torch X.Y.*);
- the host has TPU chips but the backend is not 'tpu' (PJRT fell back, libtpu missing, a variable
  forces the CPU, or another process holds the chips), each with its fix;
- deprecated or removed variables still set (XLA_USE_BF16, XRT_*...);
- torchrun over several hosts: gloo (the CPU side groups: the step vote, the lockstep, checkpoints) cannot reach the
  rendezvous host from the address it picks, with GLOO_SOCKET_IFNAME named as the fix.
"""

from __future__ import annotations

import os
import platform

from labkit import device as _device
from labkit import envsetup
from labkit.torchrun import gloo_address, gloo_reach_warnings  # noqa: F401  (gloo's check: torchrun's)

# variable -> what to do instead
DEPRECATED_ENV = {
    "XLA_USE_BF16": "deprecated since torch_xla 2.4: use torch.autocast('xla', dtype=torch.bfloat16) "
    "(labkit: precision=labkit.precision.choose(rt, 'bf16')) or cast the model with .to(torch.bfloat16)",
    "XLA_DOWNCAST_BF16": "deprecated: use autocast or explicit bfloat16 dtypes",
    "XLA_USE_FP16": "deprecated: use autocast or explicit dtypes",
    "XRT_TPU_CONFIG": "XRT was removed in torch_xla 2.1: use PJRT (PJRT_DEVICE=TPU)",
    "XRT_DEVICE_MAP": "XRT was removed in torch_xla 2.1: use PJRT",
    "XRT_WORKERS": "XRT was removed in torch_xla 2.1: use PJRT",
    "GPU_NUM_DEVICES": "torch_xla 2.9 has no CUDA backend: use torch's own 'cuda' device (LABKIT_BACKEND=cuda)",
}


version_of = envsetup.version_of
tpu_error_advice = envsetup.tpu_error_advice  # stdlib only: setup() needs it before the doctor


def check_versions(torch_version: str | None, xla_version: str | None) -> list[str]:
    """Warnings for a torch / torch_xla pair that do not belong together (pure function)."""
    problem = envsetup.pair_problem(torch_version, xla_version)
    return [problem] if problem else []


def where() -> str:
    """The platform id envsetup uses: colab-tpu, colab-gpu, kaggle-tpu, kaggle-gpu, tpu-vm or jupyter."""
    return envsetup.detect_platform()


def tpu_warnings(tpu: envsetup.Tpu, backend: str | None, versions: dict, root: str | None = None) -> list[str]:
    """Why a host with TPU chips does not run on them, with the fix (pure but for reading /proc)."""
    if not tpu or backend == "tpu":
        return []
    fixes = []
    if not versions.get("torch_xla"):
        fixes.append(
            f"install PyTorch/XLA: pip install torch=={envsetup.TORCH} torch_xla=={envsetup.TORCH_XLA} "
            f"libtpu=={envsetup.LIBTPU_FOR[envsetup.minor(envsetup.TORCH_XLA)]}"
        )
    elif not versions.get("libtpu"):
        lib = envsetup.LIBTPU_FOR.get(envsetup.minor(versions["torch_xla"]), "")
        fixes.append(f"install libtpu: pip install libtpu{'==' + lib if lib else ''}")
    for var, bad in (("LABKIT_BACKEND", lambda v: v.lower() != "tpu"), ("PJRT_DEVICE", lambda v: v.upper() != "TPU")):
        if os.environ.get(var) and bad(os.environ[var]):
            fixes.append(f"unset {var} (it is {os.environ[var]!r})")
    holders = envsetup.tpu_holders(root)
    if holders:
        who = ", ".join(f"{pid} ({cmd})" for pid, cmd in holders)
        fixes.append(f"stop the process(es) holding the chips: {who} (kill {' '.join(str(p) for p, _ in holders)})")
    fixes = fixes or ["check that no other process holds the TPU"]
    return [
        f"this host has {tpu.chips} TPU chip(s) ({'; '.join(tpu.evidence)}) but the backend is "
        f"{backend or 'unknown'!r}, so nothing runs on them. Fix: "
        + "; ".join(fixes)
        + ", then restart the runtime and run labkit.setup() again"
    ]


def torch_tpu_warnings(versions: dict, chips: int | None = None) -> list[str]:
    """TorchTPU (`torch-tpu`, torch_xla's successor) installed: what labkit does with it here. `chips`: the TPU chips
    TorchTPU drives in this process (labkit.runtime.torch_tpu.chips); None where torch is not imported yet."""
    if not versions.get("torch_tpu"):
        return []
    if chips:
        use = (
            f"labkit trains on its {chips} chip(s) as backend 'torch-tpu' (labkit.runtime.torch_tpu: the step "
            "compiled with backend='tpu', torchrun over the 'tpu' process group, DCP checkpoints)"
        )
        if versions.get("torch_xla"):
            use += "; torch_xla is installed too and is chosen first: LABKIT_BACKEND=torch-tpu picks TorchTPU"
    else:
        use = (
            "TorchTPU sees no chip here, so labkit runs on the CPU (or CUDA) and keeps libtpu off the cloud metadata "
            "server (TPU_SKIP_MDS_QUERY=1)"
        )
    return [
        f"torch_tpu {versions['torch_tpu']} is installed: {use}. The set-up cell keeps torch, torch_tpu and libtpu; "
        "notebooks 00, 03, 04 and 07 teach torch_xla and end at their set-up cell without it (notebook 10 maps "
        "their lessons to TorchTPU). torch_tpu loads with every `import torch` (TORCH_DEVICE_BACKEND_AUTOLOAD=0 keeps "
        "it out) and needs torch >= 2.11, so it cannot share an environment with torch_xla 2.9"
        + (f"; this one has torch_xla {versions['torch_xla']} too" if versions.get("torch_xla") else "")
    ]


def _torch_tpu_chips() -> int:
    from labkit.runtime import torch_tpu

    return torch_tpu.chips()


def doctor(rt=None, *, quiet: bool = False) -> dict:  # rt optional: the doctor also runs before setup()
    """Collect versions, platform, devices and warnings; print them unless quiet.
    rt: the Runtime labkit.setup() returned (None: before setup(), the backend it would pick)."""
    versions = {
        "python": platform.python_version(),
        "torch": version_of("torch"),
        "torch_xla": version_of("torch_xla"),
        "torchvision": version_of("torchvision"),
        "libtpu": version_of("libtpu") or version_of("libtpu-nightly"),
        "torch_tpu": version_of("torch-tpu") or version_of("torch_tpu"),
        "labkit": envsetup.VERSION,
    }
    found = _device.detect()
    warnings = check_versions(versions["torch"], versions["torch_xla"])
    for var, fix in DEPRECATED_ENV.items():
        if var in os.environ:
            warnings.append(f"{var}={os.environ[var]} is set: {fix}")
    place = where()
    pjrt = os.environ.get("PJRT_DEVICE")
    backend = rt.kind if rt else None  # data, not a branch: the report names the backend, tpu_warnings reads it
    if rt is None:
        try:
            backend = _device.resolve_backend()
        except _device.BackendError as e:
            warnings.append(str(e))
    warnings += tpu_warnings(envsetup.detect_tpu(), backend, versions)
    warnings += torch_tpu_warnings(versions, _torch_tpu_chips())
    warnings += gloo_reach_warnings()
    if envsetup.labkit_status()[0] != "ours":
        warnings.append(
            "the importable 'labkit' is not this project's (PyPI's unrelated 'labkit'?): "
            f"pip uninstall -y labkit && {envsetup.shell_words('pip', 'install', f'{envsetup.DIST_NAME} @ {envsetup.PUBLISHED}')}"
        )
    report = {
        "versions": versions,
        "platform": place,
        "machine": platform.machine(),
        "pjrt_device": pjrt,
        "backend": backend,
        "runtime": repr(rt) if rt else None,
        "devices": rt.device_names() if rt else [],
        "found": found,
        "warnings": warnings,
    }
    if not quiet:
        print(format_report(report))
    return report


def format_report(r: dict) -> str:
    v = r["versions"]
    lines = [
        "labkit doctor",
        "  versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val),
        f"  platform: {r['platform']} ({r['machine']}), PJRT_DEVICE={r['pjrt_device'] or 'unset'}",
        f"  backend:  {r['backend']}  {r['runtime'] or '(labkit.setup() not called yet)'}",
        f"  devices:  {', '.join(r['devices']) or '-'}",
    ]
    lines += [f"  WARNING: {w}" for w in r["warnings"]] or ["  no warnings"]
    return "\n".join(lines)
