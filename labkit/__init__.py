"""labkit: learn PyTorch training on TPUs (PyTorch/XLA), GPUs and CPUs from a notebook.

    import labkit
    rt = labkit.setup()              # TPU, CUDA, XLA:CPU or CPU, detected once
    labkit.doctor()                  # versions, devices, warnings
    trainer = labkit.Trainer(model, opt, rt, labkit.TrainConfig.from_env(), train_loader)
    trainer.fit()
"""
__version__ = "0.1.0"

from .config import TrainConfig, fast_mode, from_env
from .dashboard import Dashboard, force_console
from .device import BACKENDS, BackendError, Runtime, current_runtime, setup
from .doctor import doctor
from .explain import explain
from .loader import ParallelLoader, device_loader
from .loop import Trainer
from .optim import clip_grad_norm, optimizer_step
from . import flops, gpt, mesh, text  # light: ~3 ms together (torch is already imported above; mesh needs numpy)

__all__ = ["BACKENDS", "BackendError", "Dashboard", "ParallelLoader", "Runtime", "TrainConfig", "Trainer",
           "clip_grad_norm", "current_runtime", "device_loader", "doctor", "explain", "fast_mode",
           "flops", "force_console", "from_env", "gpt", "mesh", "optimizer_step", "setup", "text"]
