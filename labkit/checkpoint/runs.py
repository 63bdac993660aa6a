"""One run's checkpoints per folder: a new run does not mix its steps with an old run's.

    root = check_root(root)                          # ValueError for "" (not FileNotFoundError: '')
    refuse_older_step(root, step=100, newest=1200)   # RuntimeError naming the folder, the step and both fixes

Why: a run that did not restore and saves step 100 into a folder whose newest checkpoint is step 1200
(an old run's) mixes the two: its checkpoints are pruned against the old run's (the old newest ones
are kept, the new ones deleted), the old "best" stays best, and if its newest file is damaged, restore
falls back to the old run's state. So the first save of a manager that did not restore checks the
folder once (one listing) and refuses a step below the newest found, in either format.

Refuse, not a fresh sub-folder: a run that quietly saved to `root/run-2/` would not be found by a
later resume of `root`, which is where the user looks. A save of the same step as the newest passes
here; the write then replaces it only if it is not committed (a killed writer's leftover): a step another
run committed is never overwritten (manager.py, sharded.py).
"""

from __future__ import annotations


def check_root(root) -> str:
    """`root` as a string, or ValueError when it is empty (os.makedirs('') says only FileNotFoundError: '')."""
    text = str(root) if root is not None else ""
    if not text.strip():
        raise ValueError(f"root={root!r}: expected a folder or gs://bucket/prefix to keep the checkpoints in")
    return text


def refuse_older_step(root: str, step: int, newest: int | None) -> None:
    """Raise RuntimeError when a run that did not restore would save `step` below the folder's `newest`."""
    if newest is not None and int(step) < newest:
        raise RuntimeError(
            f"{root} already holds checkpoints up to step {newest}, and this run (which did not restore) would "
            f"save step {step} below it: its checkpoints would be pruned against the old run's and the old best "
            "would stay best. Either resume (TrainConfig(resume=True), or call restore() before saving), or give "
            "this run a fresh folder"
        )
