"""Two numbers every lesson quotes: how big a model is, and the accuracy a classifier must clearly beat.

labkit.count_params(model), labkit.chance_accuracy(10)
"""

from __future__ import annotations


def count_params(model) -> int:
    """Number of scalars in the model's parameters (shared parameters counted once)."""
    return sum(p.numel() for p in model.parameters())


def chance_accuracy(num_classes: int) -> float:
    """Accuracy of guessing uniformly: what a trained classifier must clearly beat."""
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    return 1.0 / num_classes
