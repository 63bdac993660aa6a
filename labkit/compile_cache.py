"""torch_xla's persistent compile cache: compiled XLA programs kept on disk, so a second process
(a restarted Colab runtime, the next run of a script) loads them instead of compiling again.

    rt = labkit.setup()                        # TPU: on by default, in ~/.cache/labkit/xla-cache
    rt = labkit.setup(compile_cache="/data/xla-cache")   # a folder of your own (or True / False / "auto")
    rt.compile_cache                           # the folder in use, or None; rt.info["compile_cache"] says why
    first_step_in_child("/tmp/c", "mlp")       # one training step in a fresh process: time, compiles, counters

LABKIT_COMPILE_CACHE sets the same thing from the environment (1/0/yes/no/auto or a folder); an
argument to setup() wins over it. It wraps `torch_xla.runtime.initialize_cache(path, readonly)`, which
torch_xla 2.9 accepts only before the first computation of the process: creating the device is fine,
running a graph is not (the computation cache is built then, and reads XLA_PERSISTENT_CACHE_PATH once).

Where it helps (measured with torch_xla 2.9): on a TPU the PJRT client serialises executables, so the
second process's first step loads them (metric counter PersistentCacheHit). On XLA:CPU the first process
writes the files (PersistentCacheMiss), but the CPU client cannot deserialise them ("Deserializing
serialized executable not supported"): the second process counts PersistentCacheDeserializeFailure and
compiles again. That is why "auto" means on for TPU only; on XLA:CPU it is opt-in and only shows the
mechanism (files written, entries found by graph hash). CUDA and plain CPU do not run through XLA here:
the setting is ignored there (rt.info says so). A gs:// path is not supported: the cache is a local folder.

With several processes per host (xmp.spawn / torch_xla.launch) only local ordinal 0 writes; the others
read the cache (readonly), so two processes never write the same file at once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from .config import FALSE, TRUE, parse_bool

ENV = "LABKIT_COMPILE_CACHE"
DEFAULT_DIR = os.path.join("~", ".cache", "labkit", "xla-cache")


def resolve(value, kind: str) -> tuple[str | None, str]:
    """The folder to use for backend `kind` (or None: off) and why, from setup()'s `compile_cache`
    argument; None there reads LABKIT_COMPILE_CACHE, then "auto" (on for TPU only).

    Accepts True/False, yes/no strings (labkit.config.parse_bool's words), "auto", or a folder
    (a path with a separator, or starting with ~ or .). Anything else is a ValueError naming the setting."""
    source = "compile_cache"
    if value is None:
        value = os.environ.get(ENV)
        source = ENV
        if value is None:
            value = "auto"
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    path = None
    if isinstance(value, str):
        low = value.strip().lower()
        if low == "auto":
            if kind != "tpu":
                return None, f"off ({source}=auto: on for TPU only; {kind} does not load cached programs)"
            value = True
        elif low in TRUE or low in FALSE:
            value = parse_bool(low, source)
        elif low.startswith("gs://") or "://" in low:
            raise ValueError(f"{source}={value!r}: the compile cache must be a local folder (torch_xla reads files)")
        elif os.sep in value or "/" in value or value.startswith(("~", ".")):
            path = value
        else:
            raise ValueError(
                f"{source}={value!r} is neither yes/no, 'auto' nor a folder "
                f"(use one of {', '.join(TRUE)} / {', '.join(FALSE[:-1])}, auto, or a path such as {DEFAULT_DIR})"
            )
    elif not isinstance(value, bool):
        raise ValueError(f"{source}={value!r}: expected True, False, 'auto' or a folder path")
    if value is False:
        return None, f"off ({source})"
    if kind not in ("tpu", "xla-cpu"):
        return None, f"off: {kind} does not run through XLA, the XLA compile cache does not apply"
    folder = os.path.abspath(os.path.expanduser(path or DEFAULT_DIR))
    return folder, f"on ({source})"


def enable(folder: str, readonly: bool = False) -> tuple[str | None, str]:
    """Point torch_xla at `folder` (created if missing). Must run before the process's first XLA
    computation; afterwards it is too late unless the cache already uses this folder. Returns the folder
    in use (or None) and a note."""
    import torch_xla
    import torch_xla.runtime as xr

    current = os.environ.get("XLA_PERSISTENT_CACHE_PATH")
    if torch_xla._XLAC._xla_computation_cache_is_initialized():
        if current and os.path.abspath(current) == folder:
            return folder, "on"
        return None, (
            "off: XLA already ran a computation in this process before setup() could turn the compile cache "
            "on (call labkit.setup() first, or restart the runtime)"
            + (f"; the cache in use is {current}" if current else "")
        )
    os.makedirs(folder, exist_ok=True)
    xr.initialize_cache(folder, readonly=readonly)
    return folder, "on" + (" (read-only: another local process writes it)" if readonly else "")


def counters() -> dict:
    """torch_xla's persistent-cache counters of this process (PersistentCacheHit, ...Miss, ...Load,
    ...DeserializeFailure), zeros included: host-side, no device sync."""
    import torch_xla.debug.metrics as met

    names = ("PersistentCacheHit", "PersistentCacheMiss", "PersistentCacheLoad", "PersistentCacheDeserializeFailure")
    return {n: met.counter_value(n) or 0 for n in names}


def entries(folder: str | None) -> list[str]:
    """The cached programs in `folder` (one file per graph hash), sorted; [] if none or no folder."""
    if not folder or not os.path.isdir(folder):
        return []
    return sorted(f for f in os.listdir(folder) if os.path.isfile(os.path.join(folder, f)))


# -- one training step in a fresh process (tests, bench/bench_compile_cache.py, notebook 04) -------------
MODELS = ("mlp", "gpt", "resnet50")


def _model(name: str):
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    if name == "mlp":
        model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))
        return model, torch.randn(16, 64), torch.randint(0, 10, (16,))
    if name == "gpt":
        from .gpt import GPT, GPTConfig

        model = GPT(GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=128))
        ids = torch.randint(0, 256, (8, 65))
        return model, ids[:, :-1], ids[:, 1:]
    from .models import resnet50_cifar

    return resnet50_cifar(10), torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))


def _one_step(folder: str | None, model: str, backend: str | None) -> dict:
    import torch
    import torch.nn.functional as F
    import torch_xla.debug.metrics as met

    from .device import setup

    rt = setup(backend, compile_cache=folder or False)
    net, x, y = _model(model)
    net = net.to(rt.device)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    x, y = rt.to_device((x, y))
    rt.sync()  # the weights and the batch are on the device: the timing below is the step only
    before = met.metric_data("CompileTime") or (0, 0.0, ())
    t = time.perf_counter()
    loss = net(x, y)[1] if model == "gpt" else F.cross_entropy(net(x), y)
    loss.backward()
    opt.step()
    rt.sync()
    value = float(loss.detach().cpu())  # waits for the step to finish
    after = met.metric_data("CompileTime") or (0, 0.0, ())
    return {
        "first_step_s": time.perf_counter() - t,
        "compiles": after[0] - before[0],
        "compile_s": (after[1] - before[1]) / 1e9,
        "loss": value,
        "cache": rt.compile_cache,
        "note": rt.info.get("compile_cache"),
        "counters": counters(),
        "entries": entries(rt.compile_cache),
    }


def first_step_in_child(
    folder: str | None, model: str = "mlp", backend: str | None = None, timeout: float = 600
) -> dict:
    """Run one SGD step of `model` (mlp / gpt / resnet50) in a fresh Python process whose compile cache is
    `folder` (None: off) and return what it measured: first_step_s, compiles, compile_s (XLA's
    CompileTime), counters (the PersistentCache* counters), entries (files in the cache afterwards).
    A fresh process is the point: the in-memory graph cache of this one would answer instead."""
    if model not in MODELS:
        raise ValueError(f"model={model!r}: expected one of {', '.join(MODELS)}")
    code = "import sys; from labkit.compile_cache import _main; _main(sys.argv[1:])"
    cmd = [sys.executable, "-c", code, model, folder or "off"] + ([backend] if backend else [])
    env = dict(os.environ)
    env.pop(ENV, None)  # the folder argument decides, not this process's environment
    if backend == "xla-cpu":  # e.g. from a TPU notebook, whose kernel holds the chips: the child uses the CPU
        env["PJRT_DEVICE"] = "CPU"
    # the child imports the labkit this process runs (a checkout may shadow an installed copy)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def _main(argv: list[str]) -> None:  # the child: MODEL FOLDER|off [BACKEND]; prints one JSON line
    name, folder, backend = argv[0], argv[1], (argv[2:] or [None])[0]
    print(json.dumps(_one_step(None if folder == "off" else folder, name, backend)), flush=True)
