"""Restores that never quietly do the wrong thing: a checkpoint that cannot be read (the network, a full
temp disk) is not a damaged one, so the restore stops and says why instead of falling back to an older
step or to none (a resumed run would start over); Ctrl-C during a restore is an interrupt. Real folders and
the loopback GCS server."""

import errno
import os
import tempfile

import pytest
import torch

from labkit.checkpoint import CheckpointManager, ShardedCheckpointManager
from labkit.checkpoint import dcp as sharded_module


@pytest.fixture(autouse=True, scope="module")
def xla_first():
    """Start the XLA device before any backward pass (the NaN test trains on the CPU): autograd sizes its
    per-device queues at its first backward, and an XLA backward after that (a later module) would fail."""
    import labkit

    labkit.setup("xla-cpu")


def _state(v):
    return {"model": {"w": torch.full((4, 4), float(v))}, "step": int(v)}


def _saved(root, fmt, steps=(1, 2)):
    m = CheckpointManager(root, keep=3, rt=None, best_metric=None, async_save=False, format=fmt)
    for s in steps:
        m.save(s, _state(s))
    m.close()


def test_a_transient_network_error_in_a_one_file_restore_is_retried_not_fallen_back(gcs_bucket, monkeypatch):
    root = f"gs://{gcs_bucket}/run"
    _saved(root, "file")
    m = CheckpointManager(root, rt=None, best_metric=None)
    real, calls = m.store.get, []

    def drops_once(name):
        calls.append(name)
        if len(calls) == 1:
            raise ConnectionError("connection reset by peer")
        return real(name)

    monkeypatch.setattr(m.store, "get", drops_once)
    got = m.restore()
    assert got["step"] == 2 and m.restored["step"] == 2  # read again, not step 1 with a warning

    def always_down(name):
        raise ConnectionError("connection refused")

    monkeypatch.setattr(m.store, "get", always_down)
    with pytest.raises(OSError, match=r"ckpt-00000002\.pt failed 3 times .*not known to be damaged"):
        m.restore()


def test_a_full_temp_disk_in_a_gcs_sharded_restore_says_so(gcs_bucket, monkeypatch):
    """The downloaded files land on a disk that is full: an OSError(ENOSPC) naming where and what is free,
    not two 'damaged' warnings and None (which a resumed run reads as 'start at step 0')."""
    root = f"gs://{gcs_bucket}/run"
    _saved(root, "sharded")
    real = tempfile.mkdtemp

    def full_folder(*a, **k):  # every file written in it goes to a device that is always full
        d = real(*a, **k)
        for n in (".metadata", "__0_0.distcp"):
            os.symlink("/dev/full", os.path.join(d, n))
        return d

    monkeypatch.setattr(sharded_module.tempfile, "mkdtemp", full_folder)
    with pytest.raises(OSError, match=r"no space left on .* \(\d+ MB free\) while downloading .*step-00000002") as e:
        CheckpointManager(root, rt=None, best_metric=None).restore(into=_state(0))
    assert e.value.errno == errno.ENOSPC


def test_ctrl_c_during_a_sharded_restore_is_a_keyboard_interrupt(tmp_path, monkeypatch):
    from labkit.checkpoint import safe_load

    _saved(tmp_path, "sharded")

    def interrupted(self, plan, planner):
        raise KeyboardInterrupt

    monkeypatch.setattr(safe_load.SafeReader, "read_data", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ShardedCheckpointManager(tmp_path).restore(into=_state(0))


# -- what a save records and refuses ----------------------------------------------------------------------
def test_best_records_its_metric_and_mode_and_says_when_they_change(tmp_path):
    """A val_loss (min) run in a folder whose best was a val_acc (max) one used to compare 0.3 (a loss)
    against 0.9 (an accuracy) and keep the wrong step as best."""
    acc = CheckpointManager(tmp_path, keep=1, best_metric="val_acc", mode="max", save_every=100, rt=None)
    acc.save(1, _state(1), metrics={"val_acc": 0.9}, force=True)
    acc.close()
    with pytest.warns(UserWarning, match=r"chosen by 'val_acc' \(mode 'max'\).*ranks by 'val_loss' \(mode 'min'\)"):
        loss = CheckpointManager(tmp_path, keep=1, best_metric="val_loss", mode="min", save_every=100, rt=None)
    loss.restore()
    assert loss.save(2, _state(2), metrics={"val_loss": 0.3})  # the first val_loss: the best, so it saves
    loss.close()
    best = CheckpointManager(tmp_path, keep=1, best_metric="val_loss", mode="min", rt=None).best
    assert best["step"] == 2 and best["metric"] == "val_loss" and best["mode"] == "min"


@pytest.mark.parametrize("fmt", ["file", "sharded"])
def test_a_state_with_nan_weights_is_never_saved(tmp_path, fmt):
    import labkit
    from tests.helpers import blobs, mlp

    rt = labkit.setup("cpu")
    data = blobs(n=96)
    data.tensors[0][48:64] = float("inf")  # batch 4 (16 rows): its loss, then the weights, go non-finite
    model = mlp()
    ck = CheckpointManager(tmp_path, async_save=False, rt=rt, best_metric=None, format=fmt)
    tr = labkit.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        rt,
        labkit.TrainConfig(epochs=1, log_every=100, eval_every=0, checkpoint_every=2),  # losses read at the end
        torch.utils.data.DataLoader(data, batch_size=16),
        checkpoint=ck,
    )
    with pytest.raises(FloatingPointError, match=r"not saving step 4 .*NaN or inf"):
        tr.fit()
    assert CheckpointManager(tmp_path, rt=None).latest()["step"] == 2  # the last good state stays latest
