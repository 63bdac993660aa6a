"""After training: serving checkpoints, torch.export, x86 INT8 (PT2E + Inductor), generation with a cache.

labkit.serve.save_for_serving(trainer.module, "resnet50_cifar")
model = labkit.serve.load_model("resnet50_cifar")
"""

from labkit.serve import export, quantize
from labkit.serve.export import export_decoder, load_model, load_serving, save_for_serving

__all__ = ["export", "export_decoder", "load_model", "load_serving", "quantize", "save_for_serving"]
