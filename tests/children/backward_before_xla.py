"""A backward on the CPU, then labkit.setup("xla-cpu"), in a fresh process (tests/test_device.py): setup
refuses with a clear error instead of leaving every XLA backward to fail inside PyTorch."""

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402

x = torch.ones(2, requires_grad=True)
(x * 2).sum().backward()  # the autograd engine makes its device queues now, without XLA's

import labkit  # noqa: E402
from labkit.runtime import BackendError  # noqa: E402

try:
    labkit.setup("xla-cpu")
except BackendError as e:
    print(f"REFUSED: {e}")
else:
    print("ACCEPTED")
