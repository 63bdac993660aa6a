"""A resume that cannot continue exactly is refused by name: another dataset under a mid-epoch position,
or a shuffling DataLoader whose resumed epoch would be a new permutation. SIGTERM during
fit_with_buttons finishes the pending checkpoint as fit() does. Plain CPU, real folders, real processes."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import labkit
from labkit import CheckpointManager, TrainConfig, Trainer
from tests.helpers import blobs, mlp


@pytest.fixture(autouse=True, scope="module")
def xla_first():
    """Start the XLA device before any backward pass (see tests/test_resume_changes.py)."""
    labkit.setup("xla-cpu")


class Rows:
    def __init__(self):
        self.rows = 0

    def on_step_end(self, trainer, batch):
        self.rows += batch[0].shape[0]


def _trainer(root, n=320, shuffle=False, **cfg):
    rt = labkit.setup("cpu")
    model = mlp()
    seen = Rows()
    tr = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        rt,
        TrainConfig(**{"epochs": 1, "log_every": 1, "eval_every": 0, **cfg}),
        torch.utils.data.DataLoader(blobs(n=n), batch_size=16, shuffle=shuffle),
        callbacks=[seen],
        checkpoint=CheckpointManager(root, async_save=False, rt=rt),
    )
    return tr, seen


def test_a_mid_epoch_resume_on_another_dataset_is_refused_by_name(tmp_path):
    """Before: 96 samples into an epoch of 320, resumed on 80 samples, trained 0 rows without a word."""
    first, _ = _trainer(tmp_path, max_steps=6, checkpoint_every=6)
    first.fit()
    second, seen = _trainer(tmp_path, n=80, resume=True)
    before = {k: v.clone() for k, v in second.model.state_dict().items()}
    with pytest.raises(ValueError, match=r"stopped 96 samples into epoch 0 of another dataset \(samples 320 -> 80\)"):
        second.fit()
    assert seen.rows == 0
    # refused before anything loads: the model keeps its own weights (a new run then starts from them, not the checkpoint's)
    assert all(torch.equal(v, before[k]) for k, v in second.model.state_dict().items())
    same, seen = _trainer(tmp_path, resume=True)  # the same data: the epoch goes on
    same.fit()
    assert seen.rows == 320 - 96


def test_another_dataset_at_an_epoch_end_is_said(tmp_path):
    first, _ = _trainer(tmp_path, n=64, checkpoint_every=0)  # saved at the epoch's end
    first.fit()
    second, _ = _trainer(tmp_path, n=80, resume=True, epochs=2)
    with pytest.warns(UserWarning, match=r"the dataset changed since the checkpoint \(samples 64 -> 80\)"):
        second.fit()


def test_a_mid_epoch_resume_with_a_shuffling_loader_is_refused_by_name(tmp_path):
    """Before: the resumed epoch skipped its first 5 batches of a NEW permutation: 80 samples twice, 80 never."""
    first, _ = _trainer(tmp_path, shuffle=True, max_steps=5, checkpoint_every=5)
    first.fit()
    second, seen = _trainer(tmp_path, shuffle=True, resume=True)
    before = {k: v.clone() for k, v in second.model.state_dict().items()}
    with pytest.raises(ValueError, match=r"stopped 80 samples into epoch 0.*RandomSampler draws a new order"):
        second.fit()
    assert seen.rows == 0
    assert all(torch.equal(v, before[k]) for k, v in second.model.state_dict().items()), "nothing was loaded"


CHILD = textwrap.dedent(
    """
    import asyncio, sys, time
    sys.path.insert(0, sys.argv[3])  # this checkout's labkit and tests.helpers
    import torch
    import labkit
    from labkit.checkpoint import CheckpointManager
    from labkit.dashboard.controls import fit_with_buttons
    from tests.helpers import blobs, mlp

    root, marker = sys.argv[1], sys.argv[2]
    rt = labkit.setup("cpu")
    model = mlp()
    ck = CheckpointManager(root, keep=3, rt=rt, best_metric=None)

    def hold(step, path):  # the save of step 6 stays in flight for a while
        if step == 6:
            open(marker, "w").close()
            time.sleep(3)

    ck.writer.on_stage = hold
    cfg = labkit.TrainConfig(epochs=100, max_steps=400, checkpoint_every=3, log_every=0, eval_every=0)
    loader = torch.utils.data.DataLoader(blobs(n=64), batch_size=16)
    tr = labkit.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), rt, cfg, loader, checkpoint=ck)
    asyncio.run(fit_with_buttons(tr))
    print("returned normally")
    """
)


def test_sigterm_during_fit_with_buttons_keeps_the_pending_checkpoint(tmp_path):
    root, marker = tmp_path / "run", tmp_path / "pending"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.Popen(
        [sys.executable, str(script), str(root), str(marker), repo],
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 180
    while not marker.exists() and p.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert marker.exists(), "the held save never started"
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=120)
    assert p.returncode not in (0, -signal.SIGTERM), out[-2000:]  # not killed on the spot, not a normal return
    assert "KeyboardInterrupt: SIGTERM" in out and "returned normally" not in out, out[-2000:]
    assert CheckpointManager(root, rt=None).restore()["step"] >= 6  # the save in flight was finished
