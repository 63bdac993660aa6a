"""Checkpoints: save every N steps in the background, restore the newest that verifies, resume exactly.

    ckpt = labkit.CheckpointManager("gs://bucket/run1", keep=3)   # or a local folder
    labkit.Trainer(..., checkpoint=ckpt).fit()                    # saves; cfg.resume=True restores

manager.py: CheckpointManager, the one manager: when to save, the lock, retention over both formats, the best,
the refuse-older-step rule, the restore fallback; formats.py: what a format is, and the one-file format
(one torch.save per step, committed by the `latest` pointer); dcp.py: the sharded format (torch.distributed.checkpoint
folders committed by a COMMITTED marker), which the manager picks when the state is split over devices;
sharded.py: why that format is built so, and ShardedCheckpointManager (the manager with format="sharded");
shards.py: what that format writes (is_sharded, the CPU copy of this host's shards, DCP's planners);
writer.py: the one background writer both formats use (one save at a time, errors surface, test hook);
state.py: what a checkpoint holds and how it is checked (to_cpu, verify, check_compatible);
together.py, together_dcp.py, together_manager.py: what torchrun's processes do together for a checkpoint (their
own gloo group, the agreements, the sharded save on every process, one restore decision); staging.py: the CpuMirror
a background save of the shards is copied into, and the NaN check before it.
safe_load.py: reading runs no code (DCP metadata through a restricted unpickler, plain values weights_only)
and writes only into its temp folder; runs.py: a run that did not restore may not save below the folder's newest step.
Where the bytes go (a local folder, a gs:// or s3:// prefix) is labkit.cloud.store: one interface for all.
Both restore the same way: restore(into=state) fills live tensors where it can and returns
the state; restore() returns CPU tensors; None when there is nothing.
"""

from labkit.checkpoint.manager import CheckpointManager, object_name
from labkit.checkpoint.sharded import MARKER, ShardedCheckpointManager, folder_name, is_sharded
from labkit.checkpoint.state import check_compatible, to_cpu, verify

__all__ = [
    "MARKER",
    "CheckpointManager",
    "ShardedCheckpointManager",
    "check_compatible",
    "folder_name",
    "is_sharded",
    "object_name",
    "to_cpu",
    "verify",
]
