"""One runtime for TPU, GPU, XLA:CPU and CPU: detect once, then the same calls everywhere.

    import labkit
    rt = labkit.setup()                 # or setup("xla-cpu"), or LABKIT_BACKEND=cpu
    x = rt.to_device(batch); ...; rt.sync()

Detection order: TPU through torch_xla (PJRT, needs torch_xla + libtpu or PJRT_DEVICE=TPU), TPU through TorchTPU
(torch-tpu's `tpu` device, when torch.accelerator sees its chips; where both could drive the chips, torch_xla, said in
one line, and LABKIT_BACKEND=torch-tpu picks TorchTPU), CUDA (torch's own backend: torch_xla 2.9 has no CUDA
backend), XLA:CPU (torch_xla importable), plain CPU. torch-tpu installed without chips: one line says so, then the
CPU (labkit.envsetup.no_chip_settings keeps libtpu from waiting on the metadata server there).
`setup()` is idempotent: a notebook may run the cell twice and gets the same Runtime.
On TPU it also turns on torch_xla's persistent compile cache (labkit.compile_cache; `compile_cache=`).
"""

from __future__ import annotations

import importlib.util
import os

import torch

from labkit import _xla, envsetup, torchrun
from labkit import compile_cache as _cc
from labkit.config import parse_bool
from labkit.runtime import BackendError, Runtime  # noqa: F401  (labkit.device.Runtime, as before)
from labkit.runtime import torch_tpu as _torch_tpu
from labkit.torchrun import torchrun_world

BACKENDS = ("tpu", "torch-tpu", "cuda", "xla-cpu", "cpu")
_runtimes: dict[str, Runtime] = {}
_xla_kind: str | None = None  # the PJRT device this process committed to (cannot change later)


# -- the SPMD switch: one process drives every chip of the host (labkit.spmd builds the meshes) --
SPMD_CHOICES = ("auto", "on", "off")


def parse_spmd(value) -> str | bool:
    """Returns "auto", True or False, from a bool or a string (auto, on/off, true/false, yes/no, 1/0).

    Raises ValueError naming the setting for anything else."""
    if isinstance(value, bool) or value is None:
        return bool(value)
    low = str(value).strip().lower()
    if low == "auto":
        return "auto"
    try:
        return parse_bool(low, "spmd")
    except ValueError:
        raise ValueError(f"spmd must be one of {', '.join(SPMD_CHOICES)} (or True/False), got {value!r}") from None


def addressable_devices() -> int:
    """XLA devices this process can drive (chips of the host; CPU_NUM_DEVICES on XLA:CPU).

    Reading it starts the PJRT client but does not lock the SPMD choice: `xr.use_spmd()` may
    still follow as long as no XLA tensor exists (measured with torch_xla 2.9)."""
    import torch_xla.runtime as xr

    return int(xr.addressable_runtime_device_count())


def wants_spmd(spmd, kind: str) -> bool:
    """Resolve setup()'s `spmd` for a backend: "auto" means on with more than one local XLA device."""
    choice = parse_spmd(spmd)
    xla = kind in ("tpu", "xla-cpu")
    if choice == "auto":
        return xla and addressable_devices() > 1
    if choice and not xla:
        raise ValueError(f"spmd=True needs an XLA backend (tpu or xla-cpu), not {kind!r}")
    return bool(choice)


def _has_torch_xla() -> bool:
    return importlib.util.find_spec("torch_xla") is not None


def tpu_evidence() -> str | None:
    """Why we think TPU chips are attached, or None. Reads files only: no runtime initialisation.
    (PJRT_DEVICE=TPU is a request, not evidence: resolve_backend() checks it against this.)"""
    tpu = envsetup.detect_tpu()
    return f"{tpu.chips} chip(s): {'; '.join(tpu.evidence)}" if tpu else None


def detect() -> dict:
    """What this machine offers, without committing to anything."""
    return {
        "torch_xla": _has_torch_xla(),
        "tpu": tpu_evidence(),
        "libtpu": envsetup.version_of("libtpu") is not None,
        "torch_tpu": envsetup.version_of("torch-tpu"),
        "torch_tpu_chips": _torch_tpu.chips(),
        "cuda": torch.cuda.is_available(),
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }


def torch_tpu_note(found: dict, kind: str) -> str | None:
    """One line on TorchTPU where it is installed and labkit does not use it (no chips; torch_xla chosen), else
    None."""
    if not found["torch_tpu"] or kind == "torch-tpu":
        return None
    if not found["torch_tpu_chips"]:
        claim = f" ({found['tpu']}, but torch_tpu's own scan of the PCI bus found none)" if found["tpu"] else ""
        return (
            f"[labkit] found TorchTPU (torch_tpu {found['torch_tpu']}, torch {torch.__version__}) and no TPU chips"
            f"{claim}: running on {kind}"
        )
    return (
        f"[labkit] TorchTPU (torch_tpu {found['torch_tpu']}) sees {found['torch_tpu_chips']} chip(s); running on "
        f"{kind} as asked or detected (LABKIT_BACKEND=torch-tpu picks TorchTPU)"
    )


def _describe(found: dict) -> str:
    parts = []
    parts.append(f"TPU ({found['tpu']})" if found["tpu"] else "no TPU")
    parts.append(f"{found['cuda_devices']} CUDA device(s)" if found["cuda"] else "no CUDA GPU")
    parts.append("torch_xla installed" if found["torch_xla"] else "torch_xla not installed")
    return ", ".join(parts)


def resolve_backend(backend: str | None = None) -> str:
    """Pick the backend: the argument, else LABKIT_BACKEND, else the best one found."""
    name = backend or os.environ.get("LABKIT_BACKEND") or None
    found = detect()
    pjrt = os.environ.get("PJRT_DEVICE", "").upper()
    if pjrt == "TPU" and not found["tpu"]:
        raise BackendError(
            f"PJRT_DEVICE=TPU is set but this machine has {_describe(found)}: unset PJRT_DEVICE "
            "(labkit picks the backend) or set PJRT_DEVICE=CPU for XLA on the CPU"
        )
    if name is None:
        if torchrun_world() > 1 and not found["tpu"] and not found["cuda"]:
            return "cpu"  # torchrun on a CPU host: one process per rank over gloo (XLA:CPU has no multi-process path)
        if pjrt == "CPU" and found["torch_xla"]:
            return "xla-cpu"  # an explicit request for XLA:CPU, even on a TPU host
        if found["torch_xla"] and found["tpu"]:
            return "tpu"
        if found["torch_tpu_chips"]:
            return "torch-tpu"
        if found["cuda"]:
            return "cuda"
        return "xla-cpu" if found["torch_xla"] else "cpu"
    name = name.strip().lower().replace("_", "-")
    name = {"xla": "xla-cpu" if not found["tpu"] else "tpu", "gpu": "cuda", "xlacpu": "xla-cpu"}.get(name, name)
    source = "backend argument" if backend else "LABKIT_BACKEND"
    if name not in BACKENDS:
        raise BackendError(f"unknown backend {name!r} (from {source}); valid names: {', '.join(BACKENDS)}")
    if name == "tpu" and found["tpu"] and found["torch_xla"] and not found["libtpu"]:
        raise BackendError(
            f"backend 'tpu' ({source}): this machine has TPU {found['tpu']} and torch_xla, but "
            f"libtpu is not installed, so PJRT would fall back to the CPU. Fix: "
            f"pip install libtpu=={envsetup.LIBTPU_FOR.get(envsetup.minor(envsetup.version_of('torch_xla')), envsetup.LIBTPU_FOR['2.9'])} "
            "then restart the runtime"
        )
    if name == "tpu" and not (found["torch_xla"] and found["tpu"]):
        raise BackendError(
            f"backend 'tpu' was asked for ({source}) but this machine has {_describe(found)}. "
            "On Colab pick Runtime > Change runtime type > TPU; or use one of: "
            + ", ".join(b for b in BACKENDS if b != "tpu")
        )
    if name == "torch-tpu" and not found["torch_tpu_chips"]:
        have = f"torch_tpu {found['torch_tpu']} but no chip it can see" if found["torch_tpu"] else "no torch_tpu"
        raise BackendError(
            f"backend 'torch-tpu' was asked for ({source}) but this machine has {have} ({_describe(found)}). "
            "TorchTPU needs a TPU VM (pip install torch_tpu); or use one of: "
            + ", ".join(b for b in BACKENDS if b != "torch-tpu")
        )
    if name == "cuda" and not found["cuda"]:
        raise BackendError(f"backend 'cuda' was asked for ({source}) but this machine has {_describe(found)}")
    if name == "xla-cpu" and not found["torch_xla"]:
        raise BackendError(
            f"backend 'xla-cpu' was asked for ({source}) but torch_xla is not installed: "
            f"pip install torch=={envsetup.TORCH} torch_xla=={envsetup.TORCH_XLA}"
        )
    return name


def setup_torch_tpu() -> Runtime:
    """TorchTPU's `tpu` device; under torchrun one process per chip, joined over the "tpu" process group.

    Names and order read from torch-tpu 0.2.0's sources (labkit.runtime.torch_tpu), not run here: no chip."""
    import torch.distributed as dist

    world = torchrun.torchrun_world()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if world > 1:
        unset = [k for k in _torch_tpu.LAUNCH_ENV if not os.environ.get(k)]
        if unset:
            raise BackendError(
                f"TorchTPU under torchrun needs {', '.join(unset)} decided before torchrun starts the processes (every "
                'rank must see the same values): run `set -a; eval "$(python -m torch.tpu.distributed)"; set +a` '
                "in the shell that then starts torchrun"
            )
    torch.accelerator.set_device_index(local)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(_torch_tpu.PROCESS_GROUP, timeout=torchrun.timeout())
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = torch.device("tpu", local)
    info = {"name": torch.tpu.get_device_name(local), "dist": _torch_tpu.PROCESS_GROUP if world > 1 else None}
    return Runtime("torch-tpu", device, world, rank, local, torch.accelerator.device_count(), False, info)


def _autograd_knows_xla(device) -> None:
    """PyTorch's autograd engine makes its per-device queues once, at the process's first backward, for the
    devices it can count then. A backward run before the XLA devices started (before torch_xla was imported,
    or imported but before its first device) leaves them out, and every XLA backward after it fails with
    "INTERNAL ASSERT FAILED ... device_ready_queues_ ... please report a bug to PyTorch" (measured, torch 2.9
    and torch_xla 2.9 on XLA:CPU). One backward of a one-element tensor here (traced, never run: nothing
    compiles or executes) turns that into a clear error at setup."""
    x = torch.zeros(1, device=device, requires_grad=True)
    try:
        (x * 2).sum().backward()
    except RuntimeError as e:
        if "device_ready_queues_" not in str(e):
            raise
        raise BackendError(
            "a backward pass ran in this process before the XLA devices started, so PyTorch's autograd engine "
            "has no queue for them and every backward on them would fail: restart the runtime (Colab: "
            "Runtime > Restart session) and call labkit.setup() before any training, even a CPU one"
        ) from e


def _setup_xla(kind: str, spmd, cache: str | None = None) -> Runtime:
    global _xla_kind
    want = "TPU" if kind == "tpu" else "CPU"
    if _xla_kind is not None and _xla_kind != kind:
        raise BackendError(
            f"this process already runs XLA as {_xla_kind!r}; PJRT cannot switch to {kind!r} "
            "in the same process: restart the kernel"
        )
    if _xla_kind is None:
        os.environ.setdefault("PJRT_DEVICE", want)
        if os.environ["PJRT_DEVICE"].upper() != want:
            raise BackendError(f"backend {kind!r} conflicts with PJRT_DEVICE={os.environ['PJRT_DEVICE']}")
    # checked from metadata BEFORE the import: a mismatched pair dies in the import with an undefined symbol
    problem = envsetup.pair_problem(envsetup.version_of("torch"), envsetup.version_of("torch_xla"))
    if problem:
        raise BackendError(problem)
    import torch_xla
    import torch_xla.runtime as xr

    if wants_spmd(spmd, kind) and not xr.is_spmd():  # "auto": more than one local device
        xr.use_spmd()  # must happen before any XLA tensor is created
    try:
        device = torch_xla.device()  # the PJRT client starts here (libtpu opens the chips)
        _xla.quiet_jax_notice()  # torch_xla 2.8's per-op 'requires jax/pallas' log line: see labkit._xla
    except RuntimeError as e:
        raise BackendError(envsetup.tpu_error_advice(str(e)) or f"PJRT could not start {want} devices: {e}") from e
    _autograd_knows_xla(device)
    _xla_kind = kind
    is_spmd = xr.is_spmd()
    if is_spmd:
        world, ordinal, local = xr.process_count(), xr.process_index(), 0
        local_count = xr.global_runtime_device_count()
    else:
        world, ordinal, local = xr.world_size(), xr.global_ordinal(), xr.local_ordinal()
        local_count = xr.addressable_device_count()
    actual = xr.device_type()
    if actual != want:
        raise BackendError(
            f"asked for {kind!r} but PJRT started {actual!r} devices (PJRT fell back); "
            "check libtpu and that no other process holds the TPU"
        )
    rt = Runtime(kind, device, world, ordinal, local, local_count, is_spmd, {"pjrt_device": actual})
    if cache:  # after the device (which compiles nothing), before the first computation
        _turn_on_cache(rt, cache)
    return rt


def _turn_on_cache(rt: Runtime, folder: str) -> None:
    # several processes on one host (xmp.spawn): only local ordinal 0 writes, the others read
    rt.compile_cache, note = _cc.enable(folder, readonly=rt.local_ordinal != 0 and not rt.spmd)
    rt.info["compile_cache"] = note
    if rt.compile_cache is None:
        import warnings

        warnings.warn(f"labkit.setup(): compile cache {folder}: {note}", stacklevel=3)


def setup(
    backend: str | None = None, *, spmd: bool | str = False, compile_cache=None, verbose: bool = False
) -> Runtime:
    """Detect (or take) the backend, initialise it once, and return the Runtime.

    backend: None (auto), "tpu", "cuda", "xla-cpu" or "cpu"; LABKIT_BACKEND overrides auto.
    spmd: XLA only; one process drives all local devices (torch_xla SPMD). "auto" (or "on"/"off"):
    on when this host has more than one XLA device, off elsewhere (see labkit.spmd.mesh).
    compile_cache: torch_xla's persistent compile cache. None reads LABKIT_COMPILE_CACHE, else "auto":
    on for TPU (in ~/.cache/labkit/xla-cache), off elsewhere; True/False/yes/no, or a folder. XLA:CPU
    writes the cache but cannot load it (see labkit.compile_cache). rt.compile_cache: the folder or None."""
    spmd = parse_spmd(spmd)
    kind = resolve_backend(backend)
    cache, cache_note = _cc.resolve(compile_cache, kind)
    if spmd == "auto" and kind not in ("tpu", "xla-cpu"):
        spmd = False
    rt = _runtimes.get(kind)
    if rt is None or (spmd is True and not rt.spmd):
        if kind in ("tpu", "xla-cpu"):
            rt = _setup_xla(kind, spmd, cache)
        elif kind == "cuda":
            rt = torchrun.setup_cuda()
        elif kind == "torch-tpu":
            rt = setup_torch_tpu()
        else:
            if spmd:
                raise BackendError("spmd=True needs an XLA backend (tpu or xla-cpu)")
            rt = torchrun.setup_cpu()
        _runtimes[kind] = rt
        note = torch_tpu_note(detect(), kind)
        if note:
            rt.master_print(note)
    elif cache and rt.compile_cache != cache:  # asked for again (or for another folder): possible until XLA ran
        _turn_on_cache(rt, cache)
    rt.info.setdefault("compile_cache", cache_note if cache is None else "on")
    if verbose:
        rt.master_print(f"[labkit] {rt}")
    return rt
