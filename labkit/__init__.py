"""labkit: learn PyTorch training on TPUs (PyTorch/XLA), GPUs and CPUs from a notebook.

import labkit
rt = labkit.setup()              # TPU, CUDA, XLA:CPU or CPU, detected once
labkit.doctor()                  # versions, devices, warnings
trainer = labkit.Trainer(model, opt, rt, labkit.TrainConfig.from_env(), train_loader)
trainer.fit()
"""

from . import flops, gpt, mesh, precision, text  # light: ~3 ms together (torch is already imported above)
from .config import TrainConfig, fast_mode, from_env
from .dashboard import Dashboard, force_console
from .device import BACKENDS, BackendError, Runtime, current_runtime, setup
from .doctor import doctor
from .envsetup import VERSION as __version__  # the one home of the version (kept equal to pyproject by tests)
from .explain import explain
from .loader import ParallelLoader, device_loader
from .loop import Trainer
from .optim import clip_grad_norm, optimizer_step

__all__ = [
    "BACKENDS",
    "__version__",
    "BackendError",
    "Dashboard",
    "ParallelLoader",
    "Runtime",
    "TrainConfig",
    "Trainer",
    "clip_grad_norm",
    "current_runtime",
    "device_loader",
    "doctor",
    "explain",
    "fast_mode",
    "flops",
    "force_console",
    "from_env",
    "gpt",
    "mesh",
    "optimizer_step",
    "precision",
    "setup",
    "text",
]
