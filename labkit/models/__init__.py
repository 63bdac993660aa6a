"""The two models of the course, torch only: ResNet-50 with a CIFAR stem, and a readable GPT with a
key/value cache (nanoGPT's shape).

    model = labkit.models.resnet50_cifar(10)
    gpt = labkit.models.GPT(labkit.models.GPTConfig(n_layer=4))
"""

from labkit.models.gpt import GPT, GPTConfig, adamw, bits_per_byte
from labkit.models.resnet import image_optimizer, resnet50_cifar, resnet_flops_per_image
from labkit.models.sizes import chance_accuracy, count_params

__all__ = [
    "GPT",
    "GPTConfig",
    "adamw",
    "bits_per_byte",
    "chance_accuracy",
    "count_params",
    "image_optimizer",
    "resnet50_cifar",
    "resnet_flops_per_image",
]
