"""The live dashboard and what it reads: loss and throughput curves, MFU, and XLA's health (compiles,
recompiles with their cause, CPU fallbacks, host syncs per line of your code), in plain words.

    dash = labkit.Dashboard(flops_per_step=...)   # collector.py; drawn by sinks.py + view.py
    labkit.Trainer(..., callbacks=[dash]).fit()
    labkit.explain(dash)                          # explain.py, with the diagnosis rules of rules.py

controls.py: the buttons (profile, stop after this epoch, save now); health.py: the health panel's numbers per
interval and the recompile detective, read from XLA's counters on XLA and from torch.compile's record elsewhere
(dynamo.py: recompiles with the failed guard and line, graph breaks with reason and line; cuda_syncs.py: host syncs
per line on CUDA); syncs.py: the host-sync finder; flops.py: peak FLOP/s per chip and MFU; feed_of and
INPUT_BOUND: the feed meter (the share of step time spent waiting for data, labkit.steplog).
"""

from labkit.dashboard import flops
from labkit.dashboard.collector import Dashboard
from labkit.dashboard.controls import Controls, fit_with_buttons
from labkit.dashboard.cuda_syncs import HostSyncCounter
from labkit.dashboard.dynamo import CompileRecord
from labkit.dashboard.explain import explain, feed_of, parse_report
from labkit.dashboard.health import HealthMonitor, compile_count
from labkit.dashboard.rules import INPUT_BOUND, NOT_FALLBACKS
from labkit.dashboard.sinks import ConsoleSink, NotebookSink, environment, force_console
from labkit.dashboard.syncs import SyncFinder

__all__ = [
    "INPUT_BOUND",
    "NOT_FALLBACKS",
    "CompileRecord",
    "HostSyncCounter",
    "ConsoleSink",
    "Controls",
    "Dashboard",
    "HealthMonitor",
    "NotebookSink",
    "SyncFinder",
    "compile_count",
    "environment",
    "explain",
    "feed_of",
    "flops",
    "fit_with_buttons",
    "force_console",
    "parse_report",
]
