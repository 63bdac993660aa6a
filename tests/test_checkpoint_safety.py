"""Restoring a checkpoint runs no code and writes nowhere but its temp folder; a new run in an old run's
folder is stopped before it mixes its checkpoints with the old ones. Real files, a real loopback GCS
server, and planted payloads whose only effect is to create a folder (its existence proves code ran)."""

import json
import os
import pickle
import tempfile

import pytest
import torch

from labkit.checkpoint import MARKER, CheckpointManager, ShardedCheckpointManager, folder_name
from labkit.cloud import gcs
from labkit.runtime import Runtime
from labkit.seeding import rng_state

CPU = Runtime("cpu", torch.device("cpu"))  # rng_state asks the backend for its device generator


class _Payload:
    """Unpickling it calls os.mkdir(proof): the folder appears only if a loader ran the pickle's code."""

    def __init__(self, proof):
        self.proof = str(proof)

    def __reduce__(self):
        return (os.mkdir, (self.proof,))


def _state(step):
    torch.manual_seed(step)
    m = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    for p in m.parameters():  # gradients set by hand: no backward here (the autograd engine, once started on
        p.grad = torch.randn_like(p)  # the CPU before torch_xla is imported, has no queue for XLA devices)
    opt.step()
    return {"model": m.state_dict(), "optim": opt.state_dict(), "step": step, "rng": rng_state(CPU)}


def _same(a, b):
    assert torch.equal(a["model"]["weight"], b["model"]["weight"]) and a["step"] == b["step"]


def _recommit(folder):
    """Rewrite a local step folder's COMMITTED so every file's crc32c matches what is there now."""
    rec = json.loads((folder / MARKER).read_text())
    rec["files"] = {
        n: {"crc32c": gcs.crc32c_b64(str(folder / n)), "size": (folder / n).stat().st_size}
        for n in sorted(os.listdir(folder))
        if n != MARKER
    }
    (folder / MARKER).write_text(json.dumps(rec))


def _repoint(path):
    """Record a one-file checkpoint's current crc32c in its folder's `latest` pointer."""
    latest = path.parent / "latest"
    ptr = json.loads(latest.read_text())
    ptr["crc32c"] = ptr["objects"][path.name] = gcs.crc32c_b64(str(path))
    latest.write_text(json.dumps(ptr))


# -- 1. no code runs on restore ----------------------------------------------------------------------
def test_planted_sharded_metadata_runs_no_code_and_falls_back(tmp_path):
    root, proof = tmp_path / "run", tmp_path / "code-ran"
    ck = CheckpointManager(root, format="sharded", best_metric=None, async_save=False, rt=None)
    for s in (1, 2):
        ck.save(s, _state(s))
    ck.close()
    (root / folder_name(2) / ".metadata").write_bytes(pickle.dumps(_Payload(proof)))
    _recommit(root / folder_name(2))  # the crc32c check passes: only the unpickler stands in the way
    with pytest.warns(UserWarning, match=r"step-00000002/\.metadata refers to posix\.mkdir.*falling back"):
        got = CheckpointManager(root, rt=None).restore()
    assert not proof.exists()
    _same(got, _state(1))
    with pytest.raises(OSError, match=r"refers to posix\.mkdir"):  # an explicit step: refused, not skipped
        ShardedCheckpointManager(root).restore(_state(0), step=2)
    assert not proof.exists()


def test_planted_bytes_entry_runs_no_code(tmp_path):
    """DCP's own planner reads plain values with torch.load(weights_only=False); the reader refuses them first."""
    import torch.distributed.checkpoint as dcp

    root, proof = tmp_path / "run", tmp_path / "code-ran"
    ck = ShardedCheckpointManager(root, async_save=False)
    ck.save(1, {"w": torch.ones(2), "epoch": 1})
    ck.close()
    folder = root / folder_name(2)
    state = {"w": torch.zeros(2), "epoch": _Payload(proof)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(folder), planner=dcp.DefaultSavePlanner(), no_dist=True)
    (folder / MARKER).write_text(json.dumps({"step": 2, "files": {}, "planner": "default", "metrics": {}}))
    _recommit(folder)
    target = {"w": torch.zeros(2), "epoch": 0}
    with pytest.warns(UserWarning, match=r"step-00000002: the entry 'epoch' is not plain data .*posix\.mkdir"):
        m = ShardedCheckpointManager(root)
        assert m.restore(target) is target
        rec = m.restored
    assert not proof.exists()
    assert rec["step"] == 1 and target["epoch"] == 1 and torch.equal(target["w"], torch.ones(2))


def test_planted_single_file_payload_with_a_valid_crc_runs_no_code(tmp_path):
    proof = tmp_path / "code-ran"
    ck = CheckpointManager(tmp_path / "run", keep=5, best_metric=None, async_save=False, rt=None)
    for s in (1, 2):
        ck.save(s, _state(s))
    ck.close()
    bad = tmp_path / "run" / "ckpt-00000002.pt"
    torch.save({"step": 2, "x": _Payload(proof)}, bad)  # an intact torch zip
    _repoint(bad)  # and the crc the pointer records: only the loader stands in the way
    with pytest.warns(UserWarning, match="ckpt-00000002.pt is unreadable") as w:
        got = CheckpointManager(tmp_path / "run", rt=None).restore()
    assert not proof.exists() and "posix.mkdir" in str(w[0].message)
    _same(got, _state(1))


# -- 2. a bucket writes nowhere but the temp folder ----------------------------------------------------
def test_commit_record_names_outside_the_temp_folder_are_refused(gcs_bucket, tmp_path, monkeypatch):
    root = f"gs://{gcs_bucket}/run"
    ck = ShardedCheckpointManager(root, keep=5, async_save=False, retry_deadline_s=10)
    for s in (1, 2, 3, 4):
        ck.save(s, _state(s))
    ck.close()
    outside = tmp_path / "evil-abs"
    for s, name in ((4, "../../evil"), (3, str(outside)), (2, "sub/evil")):
        gcs.blob(f"{root}/{folder_name(s)}/{name}").upload_from_string(b"bucket content")
        marker = gcs.blob(f"{root}/{folder_name(s)}/{MARKER}")
        rec = json.loads(marker.download_as_bytes())
        rec["files"] = {name: {"crc32c": gcs.crc32c_b64(b"bucket content"), "size": 14}, **rec["files"]}
        marker.upload_from_string(json.dumps(rec))
    tmp = tmp_path / "a" / "b"  # restore's temp folders go here: "../../evil" would land in tmp_path/a
    tmp.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    target = _state(0)
    with pytest.warns(UserWarning) as w:
        m = ShardedCheckpointManager(root, retry_deadline_s=10)
        assert m.restore(target) is target
        rec = m.restored
    assert not (tmp_path / "a" / "evil").exists() and not outside.exists()  # nothing written outside
    text = "\n".join(str(x.message) for x in w)
    assert f"{folder_name(4)}: its commit record names the file '../../evil'" in text
    assert f"{folder_name(3)}: its commit record names the file {str(outside)!r}" in text
    assert f"{folder_name(2)}: its commit record names the file 'sub/evil'" in text
    assert rec["step"] == 1 and target["step"] == 1
    assert [n for n in os.listdir(tmp) if n.startswith("labkit-dcp-read-")] == []  # none left behind


def test_failed_gcs_fetch_leaves_no_temp_folder(gcs_bucket, tmp_path, monkeypatch):
    root = f"gs://{gcs_bucket}/run"
    ck = ShardedCheckpointManager(root, keep=5, async_save=False, retry_deadline_s=10)
    for s in (1, 2):
        ck.save(s, _state(s))
    ck.close()
    gcs.blob(f"{root}/{folder_name(2)}/.metadata").upload_from_string(b"not what was committed")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    target = _state(0)
    with pytest.warns(UserWarning, match=r"step-00000002/\.metadata is missing or its crc32c does not match"):
        assert ShardedCheckpointManager(root, retry_deadline_s=10).restore(target)["step"] == 1
    with pytest.raises(OSError, match="crc32c does not match"):
        ShardedCheckpointManager(root, retry_deadline_s=10).restore(target, step=2)
    assert [n for n in os.listdir(tmp_path) if n.startswith("labkit-dcp-read-")] == []


# -- 3. a new run in an old run's folder ----------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["file", "sharded"])
def test_new_run_below_the_folders_newest_step_is_refused(tmp_path, fmt):
    old = CheckpointManager(tmp_path, keep=2, best_metric="acc", format=fmt, async_save=False, rt=None)
    for s, acc in ((1, 0.9), (2, 0.1), (3, 0.2)):
        old.save(s, _state(s), {"acc": acc})
    old.close()
    new = CheckpointManager(tmp_path, keep=2, best_metric="acc", format=fmt, async_save=False, rt=None)
    with pytest.raises(
        RuntimeError, match=f"{tmp_path} already holds checkpoints up to step 3.*step 1 .*resume.*fresh"
    ):
        new.save(1, _state(1), {"acc": 0.5}, force=True)
    _same(CheckpointManager(tmp_path, rt=None).restore(), _state(3))  # the old run's checkpoints are untouched
    other = "sharded" if fmt == "file" else "file"  # the newest step counts whichever format holds it
    with pytest.raises(RuntimeError, match="up to step 3"):
        CheckpointManager(tmp_path, format=other, rt=None).save(2, _state(2), force=True)
    resumed = CheckpointManager(tmp_path, keep=2, best_metric="acc", format=fmt, async_save=False, rt=None)
    resumed.restore(step=2)
    assert resumed.save(2, _state(2), {"acc": 0.3}, force=True)  # it restored: it continues the folder's run
    resumed.close()
    later = CheckpointManager(tmp_path, format=fmt, async_save=False, rt=None)
    assert later.save(4, _state(4), force=True)  # above the newest: a run that goes on is not stopped
    later.close()


def test_sharded_manager_alone_refuses_an_older_step(tmp_path):
    ck = ShardedCheckpointManager(tmp_path, async_save=False)
    for s in (1, 2):
        ck.save(s, _state(s))
    ck.close()
    with pytest.raises(RuntimeError, match="up to step 2.*step 1 below"):
        ShardedCheckpointManager(tmp_path, async_save=False).save(1, _state(1))


# -- 4. clear errors ------------------------------------------------------------------------------------
def test_empty_root_is_named():
    with pytest.raises(ValueError, match="root=''"):
        CheckpointManager("", rt=None)
    with pytest.raises(ValueError, match="root=''"):
        ShardedCheckpointManager("")


def test_dcp_failure_is_a_runtime_error_naming_the_step(tmp_path):
    ck = ShardedCheckpointManager(tmp_path, async_save=False)
    ck.save(1, {"w": torch.ones(2, 3)})
    ck.close()
    with pytest.raises(RuntimeError, match=r"loading .*step-00000001 failed: ValueError: Size mismatch .* for w") as e:
        ShardedCheckpointManager(tmp_path).restore({"w": torch.zeros(4, 3)})
    from torch.distributed.checkpoint.api import CheckpointException

    assert isinstance(e.value.__cause__, CheckpointException)  # chained: the whole report is still there


def test_a_checkpoint_from_a_newer_labkit_says_so(tmp_path):
    """A newer labkit may save what this one cannot load (here a fractions.Fraction, which weights_only
    refuses); the error names both versions instead of only the refused global."""
    import fractions

    from labkit.versions import __version__

    ck = CheckpointManager(tmp_path, best_metric=None, async_save=False, rt=None)
    ck.save(1, _state(1))
    ck.close()
    state = {**_state(1), "versions": {"labkit": "99.0.0", "torch": "9.0"}, "extra": fractions.Fraction(1, 3)}
    torch.save(state, tmp_path / "ckpt-00000001.pt")
    _repoint(tmp_path / "ckpt-00000001.pt")
    with pytest.raises(
        RuntimeError,
        match=f"saved by labkit 99.0.0, newer than this labkit {__version__}.*refers to fractions.Fraction",
    ):
        CheckpointManager(tmp_path, rt=None).restore(step=1)
    state["versions"]["labkit"] = __version__  # the same version: the loader's own error, unchanged
    torch.save(state, tmp_path / "ckpt-00000001.pt")
    _repoint(tmp_path / "ckpt-00000001.pt")
    with pytest.raises(pickle.UnpicklingError, match="Fraction"):
        CheckpointManager(tmp_path, rt=None).restore(step=1)


def test_a_sharded_checkpoint_from_a_newer_labkit_says_so(tmp_path):
    """The sharded format's commit record names the labkit that wrote it; when a newer one wrote what this
    one cannot read (here a planner it does not know), the error names both versions."""
    import json

    from labkit.versions import __version__

    ck = ShardedCheckpointManager(tmp_path, async_save=False)
    ck.save(1, {"w": torch.ones(2, 3)})
    ck.close()
    marker = tmp_path / "step-00000001" / "COMMITTED"
    rec = json.loads(marker.read_text())
    assert rec["labkit"] == __version__
    marker.write_text(json.dumps({**rec, "labkit": "99.0.0", "planner": "tiles-v2"}))
    with pytest.raises(RuntimeError, match=f"saved by labkit 99.0.0, newer than this labkit {__version__}.*tiles-v2"):
        ShardedCheckpointManager(tmp_path).restore({"w": torch.zeros(2, 3)})
    marker.write_text(json.dumps({**rec, "planner": "tiles-v2"}))  # this labkit's own record: its own error
    with pytest.raises(ValueError, match="unknown planner 'tiles-v2'"):
        ShardedCheckpointManager(tmp_path).restore({"w": torch.zeros(2, 3)})


_SPMD_NEW_RUN = """
import os, sys
os.environ["PJRT_DEVICE"] = "CPU"
os.environ["CPU_NUM_DEVICES"] = "4"
import torch, labkit
from labkit.checkpoint import CheckpointManager, is_sharded
from labkit.spmd.mesh import make_mesh
labkit.setup("xla-cpu", spmd=True)
import torch_xla, torch_xla.distributed.spmd as xs
w = torch.randn(8, 4).to(torch_xla.device())
xs.mark_sharding(w, make_mesh(None, ("fsdp",)), ("fsdp", None))
state = {"w": w, "step": 0}
assert is_sharded(state)
old = CheckpointManager(sys.argv[1], best_metric=None, async_save=False)  # format "auto": sharded
for s in (1, 2, 3):
    old.save(s, state)
old.close()
try:
    CheckpointManager(sys.argv[1], best_metric=None, async_save=False).save(1, state)
except RuntimeError as e:
    print("REFUSED", e, flush=True)
"""


def test_new_run_below_the_newest_step_is_refused_with_state_split_over_devices(tmp_path):
    """The same with a state split over 4 XLA:CPU devices (SPMD, a child process): "auto" picks the sharded format."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    p = subprocess.run(
        [sys.executable, "-c", _SPMD_NEW_RUN, str(tmp_path)],
        env=dict(os.environ, PYTHONPATH=str(repo)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step-")) == [folder_name(s) for s in (1, 2, 3)]
    assert f"REFUSED {tmp_path} already holds checkpoints up to step 3" in p.stdout, p.stdout + p.stderr[-3000:]


def test_planted_metadata_reading_a_file_outside_the_step_is_refused(tmp_path):
    """A `.metadata` whose pieces name an absolute (or `../`) relative_path would load tensors from a file
    the commit record never covered; the restore refuses the step by name and falls back."""
    import dataclasses
    import shutil

    from labkit.checkpoint import safe_load

    root = tmp_path / "run"
    ck = CheckpointManager(root, format="sharded", best_metric=None, async_save=False, rt=None)
    for s in (1, 2):
        ck.save(s, _state(s))
    ck.close()
    step2 = root / folder_name(2)
    data = next(n for n in os.listdir(step2) if n.endswith(".distcp"))
    outside = tmp_path / "elsewhere.distcp"
    shutil.copy(root / folder_name(1) / data, outside)  # step 1's tensors, planted outside the folder
    for target in (str(outside), f"../{folder_name(1)}/{data}"):
        md = safe_load.read_metadata(step2 / ".metadata")
        md.storage_data = {k: dataclasses.replace(v, relative_path=target) for k, v in md.storage_data.items()}
        (step2 / ".metadata").write_bytes(pickle.dumps(md))
        _recommit(step2)
        m = CheckpointManager(root, rt=None)
        with pytest.warns(UserWarning, match=rf"reads a tensor from '{target}'.*not a plain file name.*falling back"):
            got = m.restore()
        assert m.restored["step"] == 1  # the step that holds these tensors, and says so
        _same(got, _state(1))
