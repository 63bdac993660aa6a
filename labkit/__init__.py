"""labkit: learn PyTorch training on TPUs (PyTorch/XLA), GPUs and CPUs from a notebook.

import labkit
rt = labkit.setup()              # TPU, CUDA, XLA:CPU or CPU, detected once
labkit.doctor()                  # versions, devices, warnings
trainer = labkit.Trainer(model, opt, rt, labkit.TrainConfig.from_env(), train_loader)
trainer.fit()

The names below are the public API; everything else is reached through a wing: labkit.checkpoint,
labkit.cloud, labkit.dashboard, labkit.lessons, labkit.models, labkit.profiling, labkit.serve, labkit.spmd
(each imported on first use, so `import labkit` stays light).
"""

import importlib

from labkit import compile_cache, precision
from labkit.checkpoint import CheckpointManager
from labkit.config import TrainConfig, fast_mode, from_env
from labkit.dashboard import Dashboard, explain, force_console
from labkit.device import BACKENDS, BackendError, Runtime, setup
from labkit.doctor import doctor
from labkit.envsetup import VERSION as __version__  # the one home of the version (kept equal to pyproject by tests)
from labkit.lm import LMTrainer
from labkit.loader import DeviceLoader
from labkit.loop import Trainer
from labkit.models.sizes import chance_accuracy, count_params
from labkit.optim import optimizer_step, warmup_cosine
from labkit.precision import Precision
from labkit.seeding import manual_seed

WINGS = ("checkpoint", "cloud", "dashboard", "lessons", "models", "profiling", "serve", "spmd")


def __getattr__(name):  # labkit.spmd, labkit.serve, ...: imported when first used (PEP 562)
    if name in WINGS:
        return importlib.import_module(f"labkit.{name}")
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")


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
    "setup",
    "warmup_cosine",
    *WINGS,
]
