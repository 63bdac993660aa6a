"""Profile a few steps of a live fit(): capture (torch_xla's or torch's profiler) and analysis (each step
split into data wait, compile, device, host and idle; top ops; a timeline).

    trainer.request_profile(steps=5)                  # capture: labkit.profiling.capture
    a = labkit.profiling.analyze("profiles/step...")  # analysis: labkit.profiling.analysis
    print(labkit.profiling.viewers.how_to_open(a.folder))  # TensorBoard/XProf, Perfetto
"""

from labkit.profiling import viewers
from labkit.profiling.analysis import CATEGORIES, COLORS, Analysis, analyze, trace_files
from labkit.profiling.capture import SIGNAL, StepProfiler, default_dir, trigger_path

__all__ = [
    "CATEGORIES",
    "COLORS",
    "SIGNAL",
    "Analysis",
    "StepProfiler",
    "analyze",
    "default_dir",
    "trace_files",
    "trigger_path",
    "viewers",
]
