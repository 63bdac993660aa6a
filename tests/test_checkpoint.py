"""CheckpointManager against a real folder and a real loopback GCS server: atomic pointer,
retention, best metric, verified uploads, faults (server down, corrupt object, missing bucket,
two writers, shape mismatch), XLA state saved with one batched transfer."""

import json
import os

import pytest
import torch

from labkit.checkpoint import CheckpointManager, check_compatible, to_cpu
from labkit.runtime import Runtime
from labkit.seeding import rng_state, set_rng_state

CPU = Runtime("cpu", torch.device("cpu"))  # rng_state asks the backend for its device generator


def _state(step, n=4):
    return {
        "model": {"w": torch.full((n, n), float(step)), "b": torch.arange(n, dtype=torch.float32)},
        "step": step,
        "rng": rng_state(CPU),
    }


def test_local_roundtrip_retention_and_best(tmp_path):
    m = CheckpointManager(tmp_path, keep=2, best_metric="val_acc", mode="max", save_every=2)
    accs = {1: 0.1, 2: 0.2, 3: 0.9, 4: 0.3, 5: 0.2, 6: 0.4, 7: 0.5, 8: 0.1}
    saved = [s for s, a in accs.items() if m.save(s, _state(s), metrics={"val_acc": a})]
    m.wait()
    # periodic (even steps) plus every improvement (1, 2, 3)
    assert saved == [1, 2, 3, 4, 6, 8]
    names = sorted(n for n in os.listdir(tmp_path) if n.endswith(".pt"))
    assert names == ["ckpt-00000003.pt", "ckpt-00000006.pt", "ckpt-00000008.pt"]  # last 2 + best
    ptr = json.loads((tmp_path / "latest").read_text())
    assert ptr["step"] == 8 and ptr["best"]["step"] == 3 and ptr["metrics"]["val_acc"] == 0.1
    st = m.restore()
    assert st["step"] == 8 and torch.equal(st["model"]["w"], torch.full((4, 4), 8.0))
    assert m.restore(step=3)["model"]["w"][0, 0] == 3.0
    # a new manager picks the best up from the pointer: 0.5 is no improvement over 0.9
    m2 = CheckpointManager(tmp_path, keep=2, save_every=100)
    assert not m2.save(9, _state(9), metrics={"val_acc": 0.5})


def test_restore_empty_and_missing_step(tmp_path):
    m = CheckpointManager(tmp_path / "none")
    assert m.restore() is None
    with pytest.raises(FileNotFoundError, match="ckpt-00000005.pt"):
        m.restore(step=5)


def test_rng_state_roundtrip_is_weights_only_safe(tmp_path):
    import random

    import numpy as np

    s = rng_state(CPU)
    torch.save(s, tmp_path / "r.pt")
    a = (random.random(), np.random.rand(), torch.rand(1))
    set_rng_state(torch.load(tmp_path / "r.pt", weights_only=True), CPU)
    b = (random.random(), np.random.rand(), torch.rand(1))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


def test_corrupt_newest_falls_back_with_warning(tmp_path):
    m = CheckpointManager(tmp_path, keep=3, async_save=False)
    for s in (1, 2, 3):
        m.save(s, _state(s))
    p = tmp_path / "ckpt-00000003.pt"
    p.write_bytes(p.read_bytes()[:100])  # truncated
    with pytest.warns(UserWarning, match="ckpt-00000003.pt"):
        st = m.restore()
    assert st["step"] == 2


def test_shape_mismatch_names_key():
    a = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    b = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    check_compatible(a.state_dict(), a)
    with pytest.raises(ValueError, match=r"'1\.weight'"):
        check_compatible(a.state_dict(), b)


def test_trainer_load_state_dict_rejects_other_shape(tmp_path):
    import labkit

    rt = labkit.setup("cpu")
    mk = lambda k: torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, k))
    t1 = labkit.Trainer(mk(2), torch.optim.SGD(mk(2).parameters(), lr=0.1), rt, labkit.TrainConfig())
    m = CheckpointManager(tmp_path, async_save=False)
    m.save(1, t1.state_dict())
    model = mk(3)
    t2 = labkit.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), rt, labkit.TrainConfig())
    with pytest.raises(ValueError, match=r"1\.weight"):
        t2.load_state_dict(m.restore())


def test_gcs_roundtrip_corrupt_and_two_writers(gcs_bucket):
    from labkit.cloud import gcs

    root = f"gs://{gcs_bucket}/run"
    m = CheckpointManager(root, keep=2)
    for s in (1, 2, 3):
        m.save(s, _state(s))
    m.wait()
    names = sorted(b.name for b in gcs.client().list_blobs(gcs_bucket))
    # the lock object (taken before the first byte) stays while m is open
    assert names == ["run/.writer.lock", "run/ckpt-00000002.pt", "run/ckpt-00000003.pt", "run/latest"]
    assert m.restore()["step"] == 3
    # a second writer is refused, with a clear error naming the first
    other = CheckpointManager(root, keep=2, async_save=False)
    m.save(4, _state(4))
    m.wait()
    with pytest.raises(RuntimeError, match=rf"another checkpoint writer \(host .* pid {os.getpid()}, "):
        other.save(5, _state(5))
    assert m.latest()["step"] == 4
    # corrupt the newest object: restore warns and falls back to step 3
    gcs.blob(f"{root}/ckpt-00000004.pt").upload_from_string(b"garbage")
    with pytest.warns(UserWarning, match="ckpt-00000004.pt"):
        assert m.restore()["step"] == 3


def test_missing_bucket_is_a_clear_error(gcs_server):
    with pytest.raises(FileNotFoundError, match="no-such-bucket-xyz"):
        CheckpointManager("gs://no-such-bucket-xyz/run")


def test_server_down_during_upload_then_recovers(tmp_path, monkeypatch):
    from labkit.cloud import gcs
    from labkit.cloud.emulator import LocalGCSServer

    # stop()+start() leaves this server's address in the environment: monkeypatch puts the
    # session server's back afterwards
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", os.environ.get("STORAGE_EMULATOR_HOST", ""))
    with LocalGCSServer(root=tmp_path / "srv") as server:
        gcs.client().create_bucket("faults")
        m = CheckpointManager("gs://faults/run", keep=2, retry_deadline_s=2)
        m.save(1, _state(1))
        m.wait()
        server.stop()
        m.save(2, _state(2, n=64))  # async: training goes on, the error comes at wait()
        with pytest.raises(RuntimeError, match=r"checkpoint save .*upload of gs://faults/run/ckpt-00000002\.pt failed"):
            m.wait()
        server.start()
        assert m.latest()["step"] == 1  # the pointer still names the last good checkpoint
        m.save(3, _state(3))
        m.wait()
        assert m.latest()["step"] == 3 and m.restore()["step"] == 3


def test_async_error_surfaces_on_next_save(tmp_path, monkeypatch):
    m = CheckpointManager(tmp_path / "ro", keep=2)

    def disk_full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(m.store, "put_if_absent", disk_full)  # the upload fails in the background thread
    m.save(1, _state(1))
    m.writer.finished.wait()  # the failure happens in the background; let it happen before restoring put
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="earlier checkpoint save"):
        m.save(2, _state(2))
    assert m.latest() is None  # the failed save never moved the pointer


def test_xla_state_moves_in_one_transfer_and_loads_on_cpu(tmp_path):
    import torch_xla
    import torch_xla.debug.metrics as met

    dev = torch_xla.device()
    model = torch.nn.Linear(16, 4).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 16, device=dev)).sum().backward()
    opt.step()
    torch_xla.sync()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    met.clear_all()
    cpu = to_cpu(state)
    assert (met.metric_data("CompileTime") or (0,))[0] == 0  # no compile to save
    assert met.metric_data("TransferFromDeviceTime")[0] == 1  # one batched transfer
    m = CheckpointManager(tmp_path, async_save=False)
    m.save(1, state)
    back = m.restore()
    assert back["model"]["weight"].device.type == "cpu"
    assert torch.equal(back["model"]["weight"], cpu["model"]["weight"])


def test_a_resumed_xla_run_compiles_no_new_step(tmp_path):
    """torch_xla shares one device buffer between host scalars of equal value: AdamW's per-parameter `step` and
    BatchNorm's num_batches_tracked, loaded one by one, made the first step after a resume a new graph."""
    import dataclasses

    import labkit
    from labkit.models.resnet import image_optimizer
    from tests.helpers import xla_counts

    rt = labkit.setup("xla-cpu")
    data = torch.utils.data.TensorDataset(torch.randn(128, 3, 8, 8), torch.randint(0, 10, (128,)))

    def trainer(seed, cfg, ckpt):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1),
            torch.nn.BatchNorm2d(8),
            torch.nn.ReLU(),
            torch.nn.Conv2d(8, 8, 3, padding=1),
            torch.nn.BatchNorm2d(8),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(8, 10),
        )
        opt = image_optimizer(model, "adamw", 1e-3, xla=rt.capturable_optimizers)  # capturable: `step` on the device
        loader = torch.utils.data.DataLoader(data, batch_size=32, drop_last=True)
        return labkit.Trainer(model, opt, rt, cfg, loader, checkpoint=CheckpointManager(ckpt, keep=1, rt=rt))

    cfg = labkit.TrainConfig(epochs=1, log_every=2, checkpoint_every=4)
    first = trainer(0, cfg, tmp_path)
    first.fit()
    before, _ = xla_counts()
    resumed = trainer(1, dataclasses.replace(cfg, resume=True, epochs=2, max_steps=first.step + 3), tmp_path)
    resumed.fit()
    assert resumed.step == first.step + 3
    steps = [st["step"] for st in resumed.optimizer.state.values()]
    assert len(steps) == 10 and all(s.device.type == "xla" for s in steps)
    assert xla_counts()[0] == before, "the first steps after the resume compiled graphs the first run had compiled"


def test_numpy_values_are_stored_as_plain_numbers_and_other_objects_are_refused(tmp_path):
    import numpy as np

    # LambdaLR with an np.cos schedule keeps numpy floats in its state; weights_only loading refuses those
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + np.cos(np.pi * s / 10)))
    opt.step()
    sched.step()
    assert any(isinstance(v, np.generic) for v in sched.state_dict()["_last_lr"])
    mgr = CheckpointManager(tmp_path / "ck", best_metric=None, async_save=False)
    mgr.save(1, {"scheduler": sched.state_dict(), "arr": np.arange(3)})
    back = mgr.restore()
    assert back["scheduler"]["_last_lr"] == pytest.approx([float(v) for v in sched.state_dict()["_last_lr"]])
    assert type(back["scheduler"]["_last_lr"][0]) is float
    assert torch.equal(back["arr"], torch.arange(3))
    with pytest.raises(TypeError, match=r"state\['extra'\]\['fn'\] is a builtins.function"):
        mgr.save(2, {"extra": {"fn": lambda: 0}})
    assert mgr.restore()["scheduler"]["last_epoch"] == 1  # the refused save left the good one in place


def test_two_local_writers_the_second_is_refused_naming_the_first(tmp_path):
    import subprocess
    import sys

    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, torch; from labkit.checkpoint import CheckpointManager; "
            f"m = CheckpointManager({str(tmp_path)!r}, async_save=False, rt=None); "
            "m.save(1, {'w': torch.ones(2)}); print('saved', flush=True); sys.stdin.readline()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, LABKIT_BACKEND="cpu"),
    )
    try:
        assert child.stdout.readline().strip() == "saved"
        mine = CheckpointManager(tmp_path, keep=1, async_save=False)
        with pytest.raises(RuntimeError, match=rf"another checkpoint writer \(host .* pid {child.pid}\)"):
            mine.save(2, _state(2))
        assert sorted(n for n in os.listdir(tmp_path) if n.endswith(".pt")) == ["ckpt-00000001.pt"]  # nothing pruned
    finally:
        child.communicate("\n", timeout=60)
    mine.save(3, _state(3))  # the first writer is gone: the lock is free
    assert mine.restore()["step"] == 3


def _flip_middle(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside the tensor data of these 64x64 states
    path.write_bytes(bytes(data))


def test_fallback_and_explicit_step_are_verified(tmp_path):
    m = CheckpointManager(tmp_path, keep=3, async_save=False)
    for s in (1, 2, 3):
        m.save(s, _state(s, n=64))
    (tmp_path / "ckpt-00000003.pt").write_bytes(b"")  # the pointer's object: unreadable
    _flip_middle(tmp_path / "ckpt-00000002.pt")  # the fallback: one flipped bit
    with pytest.warns(UserWarning, match="ckpt-00000002.pt"):
        st = m.restore()
    assert st["step"] == 1 and torch.equal(st["model"]["w"], torch.full((64, 64), 1.0))
    with pytest.raises(OSError, match="ckpt-00000002.pt"):
        m.restore(step=2)
    # with no pointer at all the zip members' own CRCs still catch it
    (tmp_path / "latest").unlink()
    with pytest.raises(OSError, match="ckpt-00000002.pt"):
        CheckpointManager(tmp_path).restore(step=2)


@pytest.mark.parametrize("content", [b"", b"{garbage", b"[1, 2]", b'{"name": 3}'])
def test_garbage_latest_warns_and_falls_back(tmp_path, content):
    m = CheckpointManager(tmp_path, keep=3, async_save=False)
    for s in (1, 2):
        m.save(s, _state(s))
    m.close()
    (tmp_path / "latest").write_bytes(content)
    with pytest.warns(UserWarning, match="latest is unreadable"):
        m2 = CheckpointManager(tmp_path, keep=3, async_save=False)
    with pytest.warns(UserWarning, match="latest is unreadable"):
        assert m2.restore()["step"] == 2
    m2.save(3, _state(3))  # and the next save writes a good pointer again
    assert m2.latest()["step"] == 3


def test_keep_below_one_is_refused(tmp_path):
    for keep in (0, -1):
        with pytest.raises(ValueError, match="keep"):
            CheckpointManager(tmp_path, keep=keep)


# -- data loss: another process, a second writer, a full disk -------------------------------------------
_HELD_SAVE = """
import sys, torch
from labkit.checkpoint import CheckpointManager
m = CheckpointManager(sys.argv[1], async_save=False, rt=None, best_metric=None)
def hold(step, path):  # the test hook: the bytes are staged, the parent opens the folder meanwhile
    print("staged", flush=True)
    sys.stdin.readline()
m.writer.on_stage = hold
m.save(1, {"w": torch.ones(2)})
m.close()
print("saved", flush=True)
"""


def test_opening_a_folder_does_not_break_another_process_save(tmp_path):
    """A second process opening the folder (CheckpointManager(root).latest()) used to sweep the first
    one's staged temp file, and the first one's save then failed."""
    import subprocess
    import sys

    child = subprocess.Popen(
        [sys.executable, "-c", _HELD_SAVE, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, LABKIT_BACKEND="cpu"),
    )
    try:
        assert child.stdout.readline().strip() == "staged"
        staged = [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
        assert len(staged) == 1  # the child's checkpoint, written, not yet visible
        assert CheckpointManager(tmp_path, rt=None).latest() is None
        assert [n for n in os.listdir(tmp_path) if n.endswith(".tmp")] == staged  # its writer is alive: kept
        out, err = child.communicate("\n", timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 0 and "saved" in out, err[-3000:]
    assert CheckpointManager(tmp_path, rt=None).latest()["step"] == 1


@pytest.mark.parametrize("fmt", ["file", "sharded"])
def test_a_second_writer_on_one_gcs_prefix_changes_nothing(gcs_bucket, fmt):
    """Two managers on one gs:// prefix: the second is refused before its first byte, so the first one's
    step 20 stays the first one's (checkpoint objects used to be overwritten before the refusal)."""
    from labkit.cloud import gcs

    def state(v):
        return {"model": {"w": torch.full((4, 4), float(v))}, "step": 20}

    def snapshot():
        return {b.name: (b.generation, b.crc32c) for b in gcs.client().list_blobs(gcs_bucket)}

    root = f"gs://{gcs_bucket}/run"
    opts = dict(keep=2, rt=None, best_metric=None, format=fmt, retry_deadline_s=10)
    first = CheckpointManager(root, **opts)
    first.save(20, state(1.0))
    first.wait()
    before = snapshot()
    second = CheckpointManager(root, async_save=False, **opts)
    with pytest.raises(RuntimeError, match=rf"another checkpoint writer \(host .* pid {os.getpid()}, "):
        second.save(20, state(2.0))
    assert snapshot() == before  # not one object written, replaced or deleted
    assert torch.equal(CheckpointManager(root, rt=None).restore()["model"]["w"], state(1.0)["model"]["w"])
    first.close()  # gives the lock back: now the second may write
    assert ".writer.lock" not in {n.rpartition("/")[2] for n in snapshot()}
    second.save(21, state(3.0))
    second.close()
    # a fresh lock of a run on another machine is refused, naming it and the ways out
    gcs.blob(f"{root}/.writer.lock").upload_from_string(json.dumps({"host": "elsewhere", "pid": 1, "id": "x"}))
    with pytest.raises(RuntimeError, match=r"host elsewhere pid 1, lock renewed 0 min ago.*resume this run"):
        CheckpointManager(root, async_save=False, **opts).save(22, state(4.0))


def test_a_resumed_run_takes_the_gcs_lock_over_and_the_old_writer_stops(gcs_bucket, monkeypatch):
    """A preempted VM comes back with a new host name: its lock cannot be checked by pid. Resuming says the
    old run is over (takeover, with a warning); so does a lock not renewed for LEASE_S. The writer whose
    lock was taken fails at its next save instead of overwriting the new writer's checkpoints."""
    from labkit.cloud import gcs, gcs_store

    root = f"gs://{gcs_bucket}/run"
    opts = dict(keep=3, rt=None, best_metric=None, retry_deadline_s=10, async_save=False)
    old = CheckpointManager(root, **opts)
    old.save(1, _state(1))
    gcs.blob(f"{root}/.writer.lock").upload_from_string(json.dumps({"host": "gone-vm", "pid": 7, "id": "old"}))
    new = CheckpointManager(root, **opts)
    with pytest.raises(RuntimeError, match="another checkpoint writer"):
        new.save(2, _state(2))  # it did not resume: refused
    new = CheckpointManager(root, **opts)
    assert new.restore()["step"] == 1
    with pytest.warns(UserWarning, match=r"taking over the writer lock of host gone-vm pid 7 \(this run resumed it\)"):
        new.save(2, _state(2))
    assert json.loads(gcs.blob(f"{root}/.writer.lock").download_as_bytes())["id"] == new.store._lock["id"]
    # the old writer renews before its next save and finds the lock gone to the new one
    old.store._renewed -= 120
    with pytest.raises(RuntimeError, match="taken over by another writer"):
        old.save(3, _state(3))
    assert CheckpointManager(root, rt=None).restore()["step"] == 2
    # a lock nobody renewed for the lease is taken over by any writer
    new.store._lock = None  # this process forgets it (as a killed one would)
    monkeypatch.setattr(gcs_store, "LEASE_S", 0)
    with pytest.warns(UserWarning, match="not renewed"):
        CheckpointManager(root, **opts).save(4, _state(4))


def test_full_disk_says_so_and_the_next_save_works(tmp_path, monkeypatch):
    """torch.save on a full disk says only "[enforce fail at inline_container.cc:664] . unexpected pos":
    the manager now names the folder and what is free (OSError ENOSPC) and leaves nothing behind."""
    import errno
    import re

    m = CheckpointManager(tmp_path, rt=None, best_metric=None, async_save=False)
    m.save(1, _state(1))
    real_save = torch.save

    def onto_a_full_disk(obj, f):  # the staging write, sent to a device that is always full
        with open("/dev/full", "wb") as full:
            real_save(obj, full)

    monkeypatch.setattr(torch, "save", onto_a_full_disk)
    with pytest.raises(OSError, match=rf"no space left on {re.escape(str(tmp_path))} \(\d+ MB free\)") as e:
        m.save(2, _state(2))
    assert e.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == [".writer.lock", "ckpt-00000001.pt", "latest"]  # no partial file
    m.save(2, _state(2))
    assert m.restore()["step"] == 2


def test_a_failed_prune_after_a_one_file_commit_is_a_warning_not_the_next_saves_error(tmp_path):
    """Under torchrun only process 0 writes a one-file checkpoint: a prune failure raised at its next save() would
    stop it alone while the others train on. The step is committed, so it warns and the next save prunes."""
    m = CheckpointManager(tmp_path, keep=1, best_metric=None)
    m.save(1, _state(1))
    m.wait()
    fmt = m.formats["file"]
    remove = fmt.remove

    def failing(*a, **k):
        fmt.remove = remove
        raise OSError(13, "Permission denied (simulated)")

    fmt.remove = failing
    with pytest.warns(UserWarning, match=r"ckpt-00000002.pt is committed, but removing .* Permission denied"):
        m.save(2, _state(2))
        m.wait()
    m.save(3, _state(3))  # no error; it prunes what the failed prune left
    m.close()
    assert sorted(n for n in os.listdir(tmp_path) if n.endswith(".pt")) == ["ckpt-00000003.pt"]
