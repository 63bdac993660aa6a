"""labkit: learn PyTorch training on TPUs (PyTorch/XLA), GPUs and CPUs from a notebook.

import labkit
rt = labkit.setup()              # TPU, CUDA, XLA:CPU or CPU, detected once
labkit.doctor()                  # versions, devices, warnings
trainer = labkit.Trainer(model, opt, rt, labkit.TrainConfig.from_env(), train_loader)
trainer.fit()

The names below are the public API; everything else is reached through a wing: labkit.checkpoint,
labkit.cloud, labkit.dashboard, labkit.lessons, labkit.models, labkit.profiling, labkit.serve, labkit.spmd
(each imported on first use).

`import labkit` itself imports no torch and a handful of labkit modules: every name below is looked up on
first use (PEP 562), so `import labkit` costs milliseconds, and `labkit.setup()` pulls in the training path.
"""

import importlib

from labkit.envsetup import VERSION as __version__  # the one home of the version (kept equal to pyproject by tests)
from labkit.envsetup import no_chip_settings as _no_chip_settings

# Where torch-tpu is installed and no TPU chip is, libtpu would wait on the cloud metadata server before a CPU backward:
# the setting that stops it must be in the environment before torch starts (labkit.envsetup.NO_CHIP_ENV).
_no_chip_settings()

# public name -> the module that defines it (imported the first time the name is used)
_HOMES = {
    "BACKENDS": "labkit.device",
    "BackendError": "labkit.device",
    "Runtime": "labkit.device",
    "setup": "labkit.device",
    "CheckpointManager": "labkit.checkpoint",
    "TrainConfig": "labkit.config",
    "fast_mode": "labkit.config",
    "from_env": "labkit.config",
    "Dashboard": "labkit.dashboard",
    "explain": "labkit.dashboard",
    "force_console": "labkit.dashboard",
    "doctor": "labkit.doctor",
    "LMTrainer": "labkit.lm",
    "DeviceLoader": "labkit.loader",
    "Trainer": "labkit.loop",
    "chance_accuracy": "labkit.models.sizes",
    "count_params": "labkit.models.sizes",
    "optimizer_step": "labkit.optim",
    "warmup_cosine": "labkit.optim",
    "Precision": "labkit.precision",
    "manual_seed": "labkit.seeding",
    "scratch": "labkit.scratch_dirs",
}
MODULES = ("compile_cache", "precision")  # modules reached as labkit.compile_cache, labkit.precision
WINGS = ("checkpoint", "cloud", "dashboard", "lessons", "models", "profiling", "serve", "spmd")


def __getattr__(name):
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
    elif name in WINGS or name in MODULES:
        value = importlib.import_module(f"labkit.{name}")
    else:
        raise AttributeError(f"module 'labkit' has no attribute {name!r}")
    globals()[name] = value  # once looked up, a plain attribute
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "BACKENDS",
    "__version__",
    "BackendError",
    "CheckpointManager",
    "Dashboard",
    "DeviceLoader",
    "LMTrainer",
    "Precision",
    "Runtime",
    "TrainConfig",
    "Trainer",
    "chance_accuracy",
    "compile_cache",
    "count_params",
    "doctor",
    "explain",
    "fast_mode",
    "force_console",
    "from_env",
    "manual_seed",
    "optimizer_step",
    "precision",
    "scratch",
    "setup",
    "warmup_cosine",
    *WINGS,
]
