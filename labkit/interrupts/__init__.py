"""Interrupts during fit() and what torchrun's processes agree on: SIGTERM and Ctrl-C turned into an orderly stop
(labkit.interrupts.signals), and the votes that make one process's stop, save, problem or setting every process's
(labkit.interrupts.vote).

    with sigterm_raises(vote): trainer steps ...   # SIGTERM -> Preempted (one process) or vote.got (torchrun)
"""

from labkit.interrupts.signals import Preempted, finish_pending_save, sigterm_deferred, sigterm_raises
from labkit.interrupts.vote import Asked, Requests, SettingsDiffer, SigtermVote, StepVote, same_everywhere

__all__ = [
    "Asked",
    "Preempted",
    "Requests",
    "SettingsDiffer",
    "SigtermVote",
    "StepVote",
    "finish_pending_save",
    "same_everywhere",
    "sigterm_deferred",
    "sigterm_raises",
]
