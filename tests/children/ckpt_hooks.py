"""The checkpoint test hook, installed from outside the library by the child scripts of the kill tests.

    from ckpt_hooks import install_from_env   # (tests/ is the child script's own folder)
    install_from_env(manager)                  # CheckpointManager or ShardedCheckpointManager

Reads, in the child process:
  CKPT_TEST_KILL=STEP          SIGKILL this process inside the save of STEP (bytes written, not visible yet)
  CKPT_TEST_HOLD=STEP:SECONDS  hold the save of STEP open there for SECONDS
  CKPT_TEST_MARKER=PATH        with HOLD: write PATH when the hold starts (the parent then acts)
The manager's writer calls `on_stage(step, path)` once the step's bytes are written and before its commit point
(the `latest` pointer, or the COMMITTED marker); it is None unless a test sets it.
"""

import os
import signal
import time


def install_from_env(manager) -> None:
    kill = os.environ.get("CKPT_TEST_KILL")
    hold_step, _, hold_s = os.environ.get("CKPT_TEST_HOLD", "").partition(":")
    marker = os.environ.get("CKPT_TEST_MARKER")
    if not kill and not hold_step:
        return

    def on_stage(step, path):
        if str(step) == kill:
            os.kill(os.getpid(), signal.SIGKILL)
        if str(step) == hold_step:
            if marker:
                with open(marker, "w") as f:
                    f.write(path)
            time.sleep(float(hold_s or 5))

    manager.writer.on_stage = on_stage  # labkit.checkpoint.writer.BackgroundWriter.on_stage
