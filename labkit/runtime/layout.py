"""Memory format: how a 4-D image tensor lies in memory, and the runtime's decision about it.

    layout = rt.choose_layout(model, cfg.memory_format)   # Layout(channels_last=True, why="..."), said once
    model = layout.apply(model, optimizer)                 # conv weights (and AdamW's moments) in that format
    x = layout.batch(x)                                    # a 4-D floating batch in that format

A batch of images is N x C x H x W. "contiguous" (NCHW) stores each channel's whole H x W plane in turn;
"channels_last" (NHWC) stores the C values of one pixel side by side. The shape and the values are the same: only
the strides differ, so a checkpoint never sees it (load_state_dict copies values into whatever layout the model has).

Where it pays:
- CUDA: a GPU's tensor cores read NHWC; cuDNN runs an NCHW convolution by transposing in and out of it. ResNet-50,
  224 px, batch 128, bf16, a hand-written loop on an NVIDIA H200 (2026-11-28): 54.6 ms a step in NCHW, 29.5 ms in
  channels_last. So CUDA trains a model with 2-D convolutions in channels_last, and the device loader hands its
  4-D batches over in it.
- XLA (TPU, XLA:CPU): off. The compiler chooses each tensor's layout itself; the strides of an eager tensor mean
  nothing there.
- The plain CPU: it depends on the CPU and the shapes (oneDNN's blocked formats), so the CPU runtime does not guess.
  "auto" stays contiguous and says so; TrainConfig.memory_format="probe" measures this CPU (probe(): a few
  forward + backward passes of a small conv stack in each format, about a second) and takes channels_last only
  when it is clearly faster (PROBE_MARGIN). A test injects the measurement (decide_from_probe), never a timing.

Under torchrun the decision holds for both plans. DDP keeps the parameters' format (its gradient buckets follow the
parameters' strides). FSDP2 refuses a non-contiguous parameter (torch 2.9's fully_shard), so its weights stay
contiguous (the plan's weights_in_layout); the batch is still channels_last, and cuDNN then runs the convolution
in channels_last (it follows either operand), converting the weight, a small tensor, once per call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from labkit.config import MEMORY_FORMATS as SETTINGS  # TrainConfig.memory_format's values

PROBE_MARGIN = 1.10  # channels_last must be this much faster than NCHW on the probe to be chosen on the CPU


def has_conv2d(model) -> bool:
    """Whether the model has a 2-D convolution (the layer that channels_last speeds up)."""
    return any(isinstance(m, torch.nn.modules.conv._ConvNd) and m.weight.dim() == 4 for m in model.modules())


@dataclass(frozen=True)
class Layout:
    """The run's memory format for 4-D tensors, and why."""

    channels_last: bool
    why: str

    @property
    def memory_format(self) -> torch.memory_format:
        return torch.channels_last if self.channels_last else torch.contiguous_format

    def describe(self) -> str:
        return f"[labkit] memory format: {'channels_last' if self.channels_last else 'contiguous (NCHW)'}: {self.why}"

    def apply(self, model, optimizer=None):
        """The model with its 4-D weights in this format (a no-op for contiguous); tensors of the optimizer's state
        shaped like their parameter follow it (a fused AdamW reads the moments element by element beside the
        weight). A model on the meta device keeps the format through its materialisation (to_empty keeps strides)."""
        if not self.channels_last:
            return model
        model = model.to(memory_format=torch.channels_last)
        if optimizer is not None:
            match_state(optimizer)
        return model

    def batch(self, obj):
        """4-D floating tensors of a batch (images) in this format; labels and other tensors as they are."""
        if not self.channels_last:
            return obj
        return map_tensors(obj, _to_channels_last)


CONTIGUOUS = Layout(False, "the default")  # a DeviceLoader built without a Trainer


def _to_channels_last(t: torch.Tensor) -> torch.Tensor:
    if t.dim() == 4 and t.is_floating_point():
        return t.contiguous(memory_format=torch.channels_last)
    return t


def map_tensors(obj, fn):
    """fn applied to every tensor of a batch: tensors, dicts, lists, tuples and named tuples, nested."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        out = [map_tensors(v, fn) for v in obj]
        return type(obj)(*out) if hasattr(obj, "_fields") else type(obj)(out)
    return obj


def match_state(optimizer) -> None:
    """Every tensor of the optimizer's state with its parameter's shape laid out as the parameter is (a state loaded
    from a checkpoint arrives contiguous). Values unchanged."""
    for p, state in optimizer.state.items():
        for k, v in state.items():
            if torch.is_tensor(v) and v.shape == p.shape and v.dim() == 4 and v.stride() != p.stride():
                state[k] = torch.empty_like(p, dtype=v.dtype).copy_(v)


def decide(model, setting: str, default: Layout, probe=None) -> Layout:
    """The run's Layout: `setting` (TrainConfig.memory_format) where it is explicit, else the backend's `default`;
    a model without 2-D convolutions stays contiguous whatever is asked. "probe" calls `probe()` for a
    (nchw_seconds, channels_last_seconds) pair (tests pass one in; the CPU runtime passes measure)."""
    if setting not in SETTINGS:
        raise ValueError(f"TrainConfig.memory_format={setting!r}: expected one of {', '.join(SETTINGS)}")
    if not has_conv2d(model):
        return Layout(False, "the model has no 2-D convolution")
    if setting == "channels_last":
        return Layout(True, "asked for (TrainConfig.memory_format)")
    if setting == "contiguous":
        return Layout(False, "asked for (TrainConfig.memory_format)")
    if setting == "probe":
        return decide_from_probe(*(probe or measure)())
    return default


def decide_from_probe(nchw_s: float, channels_last_s: float) -> Layout:
    """The CPU's choice from one measurement: channels_last when NCHW takes PROBE_MARGIN times as long or more."""
    ratio = nchw_s / channels_last_s
    on = ratio >= PROBE_MARGIN
    return Layout(
        on,
        f"measured on this CPU: a conv step {nchw_s * 1e3:.1f} ms in NCHW, {channels_last_s * 1e3:.1f} ms in "
        f"channels_last ({ratio:.2f}x; chosen at >= {PROBE_MARGIN:.2f}x)",
    )


def measure(reps: int = 3, batch: int = 8, size: int = 32) -> tuple[float, float]:
    """(NCHW seconds, channels_last seconds): the best of `reps` forward + backward passes of a small conv stack
    (3 -> 32 -> 64 -> 64 channels, 3x3, BatchNorm, ReLU) on this CPU, each format once warmed. About a second."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    layers = []
    for cin, cout in ((3, 32), (32, 64), (64, 64)):
        layers += [torch.nn.Conv2d(cin, cout, 3, padding=1, bias=False), torch.nn.BatchNorm2d(cout), torch.nn.ReLU()]
    net = torch.nn.Sequential(*layers)
    x0 = torch.randn(batch, 3, size, size, generator=g)
    out = []
    for fmt in (torch.contiguous_format, torch.channels_last):
        net, x = net.to(memory_format=fmt), x0.contiguous(memory_format=fmt)
        best = float("inf")
        for _ in range(reps + 1):  # the first is the warm-up
            t = time.perf_counter()
            net(x).sum().backward()
            best = min(best, time.perf_counter() - t)
        out.append(best)
    return out[0], out[1]
