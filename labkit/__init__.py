"""labkit: learn PyTorch training on TPUs (PyTorch/XLA), GPUs and CPUs from a notebook."""
__version__ = "0.1.0"
