"""What exists only to serve the notebooks: the recipes notebooks 01/02 and `python -m labkit.train` share,
the capture-mode measurements of notebook 04, its compile-cache experiment, and notebook 03's GPT trained
four ways over a mesh (GSPMD, and DTensor beside it), and notebook 08's Trainer under FSDP2 on torchrun processes
(fsdp_trainer). Library code never imports this wing.

    data = labkit.lessons.recipes.image_shards(...)
"""

from labkit.lessons import capture_modes, dtensor_mesh, exercises, fsdp_trainer, parallel_gpt, recipes
from labkit.lessons.compile_cache_demo import first_step_in_child

__all__ = [
    "capture_modes",
    "dtensor_mesh",
    "exercises",
    "first_step_in_child",
    "fsdp_trainer",
    "parallel_gpt",
    "recipes",
]
