"""Vision model builders: the CIFAR stem and notebook 01's optimizers."""

import pytest
import torch

from labkit.models.resnet import image_optimizer, resnet50_cifar


def test_cifar_stem_keeps_32_pixels_and_the_imagenet_stem_shrinks_them():
    cifar, imagenet = resnet50_cifar(10), resnet50_cifar(10, cifar_stem=False)
    assert cifar.conv1.stride == (1, 1) and isinstance(cifar.maxpool, torch.nn.Identity)
    assert imagenet.conv1.stride == (2, 2)
    with torch.no_grad():
        assert cifar.eval()(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


def test_image_optimizer_recipes_and_errors():
    m = torch.nn.Linear(4, 2)
    sgd = image_optimizer(m, "sgd", 0.1)
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["nesterov"] and sgd.defaults["momentum"] == 0.9
    adamw = image_optimizer(m, "adamw", 1e-3, xla=True)
    assert isinstance(adamw, torch.optim.AdamW) and adamw.defaults["capturable"]
    assert not image_optimizer(m, "adamw", 1e-3).defaults["capturable"]
    with pytest.raises(ValueError, match="'lamb'.*parameter 'optimizer'"):
        image_optimizer(m, "lamb", 1e-3)
