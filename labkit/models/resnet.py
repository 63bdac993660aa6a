"""Vision models sized for 32x32 inputs.

    model = labkit.models.resnet.resnet50_cifar(num_classes=10)
    opt = labkit.models.resnet.image_optimizer(model, "sgd", lr=0.1, xla=rt.capturable_optimizers)

torchvision's ResNet-50 was built for 224x224 ImageNet images: a 7x7 stride-2 stem conv and a
stride-2 max-pool shrink the input 4x before the first block. On 32x32 CIFAR images that leaves
8x8 feature maps entering the network and 1x1 at the end, and accuracy suffers. The usual CIFAR
adjustment keeps the same blocks but uses a 3x3 stride-1 stem conv and drops the max-pool, so
the four stages see 32, 16, 8 and 4 pixels. The cost: ~16x more FLOPs than the ImageNet stem on
the same 32x32 input (2.6 GFLOPs forward per image instead of 0.17, measured with
`resnet_flops_per_image`). On a 2-core CPU that is several seconds per step, so the notebook's
CI-sized run keeps torchvision's stem (`cifar_stem=False`) and says so.
"""

from __future__ import annotations

import torch.nn as nn
import torchvision


def resnet50_cifar(num_classes: int = 10, cifar_stem: bool = True, zero_init_residual: bool = True) -> nn.Module:
    """zero_init_residual: the last BatchNorm of each residual branch starts at zero, so every block
    starts as the identity (Goyal et al. 2017). Without it, training from scratch with small batches
    often blows up in the first steps (measured on digits, batch 32: loss 2.6 -> 34 at lr 0.05)."""
    model = torchvision.models.resnet50(weights=None, num_classes=num_classes, zero_init_residual=zero_init_residual)
    if cifar_stem:
        model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    return model


def image_optimizer(model: nn.Module, name: str, lr: float, xla: bool = False, fused: bool = False):
    """The two optimizers notebook 01 offers for an image classifier.

    sgd: Nesterov momentum 0.9, weight decay 5e-4 (the classic CIFAR recipe). adamw: weight decay 0.05,
    capturable on XLA, so the bias corrections are computed on the device and the graph does not change
    (recompile) when one of them rounds to exactly 1.0 after ~16,600 steps (see labkit.models.gpt.adamw); fused (one
    kernel for the update) where the runtime says it pays (rt.fused_optimizers: CUDA)."""
    import torch

    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    if name == "adamw":
        fused_kw = {"fused": True} if fused else {}
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05, capturable=xla, **fused_kw)
    raise ValueError(f"optimizer must be 'sgd' or 'adamw', got {name!r} (parameter 'optimizer')")


def resnet_flops_per_image(model: nn.Module, size: int = 32) -> float:
    """Forward FLOPs (2 x multiply-adds) of conv and linear layers for one size x size image,
    counted with forward hooks on a CPU copy's shapes (no device work)."""
    import torch

    total = 0.0

    def conv_hook(m, inp, out):
        nonlocal total
        k = m.kernel_size[0] * m.kernel_size[1] * (m.in_channels // m.groups)
        total += 2.0 * k * out.numel()

    def lin_hook(m, inp, out):
        nonlocal total
        total += 2.0 * m.in_features * out.numel()

    hooks = [m.register_forward_hook(conv_hook) for m in model.modules() if isinstance(m, nn.Conv2d)]
    hooks += [m.register_forward_hook(lin_hook) for m in model.modules() if isinstance(m, nn.Linear)]
    dev = next(model.parameters()).device
    try:
        if dev.type != "cpu":
            import copy

            cpu_model = copy.deepcopy(model).cpu()
            for h in hooks:
                h.remove()
            return resnet_flops_per_image(cpu_model, size)
        was = model.training
        model.eval()
        with torch.no_grad():
            model(torch.zeros(1, 3, size, size))
        model.train(was)
    finally:
        for h in hooks:
            h.remove()
    return total
