"""Resuming with another batch size, chip count or optimizer: every sample of the epoch is trained once,
or the resume is refused by name (plain CPU: the position arithmetic is the same on every backend)."""

import warnings

import pytest
import torch

import labkit
from labkit import CheckpointManager, TrainConfig, Trainer
from tests.helpers import blobs, mlp


@pytest.fixture(autouse=True, scope="module")
def xla_first():
    """Start the XLA device before any backward pass: autograd sizes its per-device queues at its
    first backward, and an XLA backward after that (a later test module) fails inside the engine."""
    labkit.setup("xla-cpu")


N = 320  # samples per epoch: 20 batches of 16, 10 of 32, 5 of 64


class Rows:
    """Counts the rows each step trained on."""

    def __init__(self):
        self.rows = 0

    def on_step_end(self, trainer, batch):
        self.rows += batch[0].shape[0]


def _trainer(root, batch, *, opt="sgd", lr=0.1, **cfg):
    rt = labkit.setup("cpu")
    model = mlp()
    if opt == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    seen = Rows()
    tr = Trainer(
        model,
        optimizer,
        rt,
        TrainConfig(epochs=1, log_every=1, eval_every=0, **cfg),
        torch.utils.data.DataLoader(blobs(n=N), batch_size=batch),
        callbacks=[seen],
        checkpoint=CheckpointManager(root, async_save=False, rt=rt),
    )
    return tr, seen


@pytest.mark.parametrize(
    "before, stop_at, after",
    [
        (16, 6, 32),  # a larger batch mid-epoch: before, 6 batches of 32 were skipped (96 samples never trained)
        (16, 12, 64),  # 1 -> 4 SPMD chips (the global batch x4): before, step 12 >= 5 steps, nothing trained
        (32, 3, 16),  # a smaller batch
    ],
)
def test_resume_with_another_global_batch_trains_every_sample_once(tmp_path, before, stop_at, after):
    first, seen1 = _trainer(tmp_path, before, max_steps=stop_at, checkpoint_every=stop_at)
    first.fit()
    assert seen1.rows == stop_at * before
    second, seen2 = _trainer(tmp_path, after, resume=True)
    second.fit()
    assert second.batch_in_epoch == 0 and second.epoch == 1  # the epoch finished
    assert seen1.rows + seen2.rows == N, (seen1.rows, seen2.rows)
    assert second.step == stop_at + (N - stop_at * before) // after  # the step counter goes on


def test_resume_off_a_batch_boundary_is_refused_by_name(tmp_path):
    first, _ = _trainer(tmp_path, 16, max_steps=5, checkpoint_every=5)
    first.fit()  # 80 samples: not a whole number of batches of 32
    second, seen = _trainer(tmp_path, 32, resume=True)
    with pytest.raises(ValueError, match=r"stopped 80 samples into epoch 0 \(5 batches of 16.*global batch is 32"):
        second.fit()
    assert seen.rows == 0


def test_resume_into_another_optimizer_class_is_refused_by_name(tmp_path):
    """Before: Adam's state loaded into SGD, then KeyError: 'momentum' inside SGD.step."""
    first, _ = _trainer(tmp_path, 16, opt="adam", lr=1e-3, max_steps=4, checkpoint_every=4)
    first.fit()
    second, _ = _trainer(tmp_path, 16, opt="sgd", resume=True)
    with pytest.raises(ValueError, match=r"trained with torch\.optim\.adam\.Adam.*optimizer is torch\.optim\.sgd\.SGD"):
        second.fit()


def test_a_new_learning_rate_losing_to_the_checkpoints_warns(tmp_path):
    first, _ = _trainer(tmp_path, 16, lr=0.1, max_steps=4, checkpoint_every=4)
    first.fit()
    second, _ = _trainer(tmp_path, 16, lr=0.01, resume=True)
    with pytest.warns(UserWarning, match=r"lr=0\.01 but the checkpoint's lr=0\.1"):
        second.fit()
    same, _ = _trainer(tmp_path / "same", 16, lr=0.1, max_steps=2, checkpoint_every=2)
    same.fit()
    again, _ = _trainer(tmp_path / "same", 16, lr=0.1, resume=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same lr: no warning
        again.fit()
