"""The compile-cache experiment of notebook 04: one training step in a fresh process, cold or warm.

    from labkit.lessons.compile_cache_demo import first_step_in_child
    first_step_in_child("/tmp/c", "mlp")   # time, compiles, PersistentCache* counters, files in the cache

The cache itself (the setting, turning it on) is labkit.compile_cache; this module only measures it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from labkit.compile_cache import ENV, counters, entries

MODELS = ("mlp", "gpt", "resnet50")


def _model(name: str):
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    if name == "mlp":
        model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))
        return model, torch.randn(16, 64), torch.randint(0, 10, (16,))
    if name == "gpt":
        from labkit.models.gpt import GPT, GPTConfig

        model = GPT(GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=128))
        ids = torch.randint(0, 256, (8, 65))
        return model, ids[:, :-1], ids[:, 1:]
    from labkit.models.resnet import resnet50_cifar

    return resnet50_cifar(10), torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))


def _one_step(folder: str | None, model: str, backend: str | None) -> dict:
    import torch
    import torch.nn.functional as F
    import torch_xla.debug.metrics as met

    from labkit.device import setup

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
    code = "import sys; from labkit.lessons.compile_cache_demo import _main; _main(sys.argv[1:])"
    cmd = [sys.executable, "-c", code, model, folder or "off"] + ([backend] if backend else [])
    env = dict(os.environ)
    env.pop(ENV, None)  # the folder argument decides, not this process's environment
    if backend == "xla-cpu":  # e.g. from a TPU notebook, whose kernel holds the chips: the child uses the CPU
        env["PJRT_DEVICE"] = "CPU"
    # the child imports the labkit this process runs (a checkout may shadow an installed copy)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def _main(argv: list[str]) -> None:  # the child: MODEL FOLDER|off [BACKEND]; prints one JSON line
    name, folder, backend = argv[0], argv[1], (argv[2:] or [None])[0]
    print(json.dumps(_one_step(None if folder == "off" else folder, name, backend)), flush=True)
