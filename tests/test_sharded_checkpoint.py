"""ShardedCheckpointManager (DCP + a commit marker) against a real folder and a real loopback GCS
server: in-place restore, retention, async errors, a save killed with SIGKILL before its marker,
corrupt files, and (heavy, child processes) an FSDP GPT saved over 8 devices restored onto 4 and 1."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch.utils._pytree import tree_leaves, tree_map

from labkit.checkpoint.sharded import MARKER, ShardedCheckpointManager, folder_name, is_sharded
from labkit.cloud import gcs

RUN = Path(__file__).parent / "children" / "sharded_ckpt_run.py"
REPO = Path(__file__).resolve().parent.parent


def _model_and_opt(seed):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(torch.randn(5, 8)).sum().backward()
    opt.step()  # AdamW's moments and step exist
    return m, opt


def _state(seed):
    m, opt = _model_and_opt(seed)
    return {"model": m.state_dict(), "optim": opt.state_dict(), "epoch": seed}


def _equal(a, b):
    la, lb = tree_leaves(a), tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert torch.equal(x, y) if torch.is_tensor(y) else x == y


def test_local_roundtrip_in_place_retention(tmp_path):
    ck = ShardedCheckpointManager(tmp_path, keep=2)
    saved = {}
    for step in (1, 2, 3):
        st = _state(step)
        assert ck.save(step, st, {"loss": 1.0 / step, "tag": "x", "skip": [1]})
        saved[step] = tree_map(lambda t: t.clone() if torch.is_tensor(t) else t, st)
    ck.close()
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step-")) == ["step-00000002", "step-00000003"]
    assert ck.latest()["step"] == 3 and ck.latest()["metrics"] == {"loss": 1 / 3, "tag": "x"}
    target = _state(99)
    weight, moment = target["model"]["0.weight"], target["optim"]["state"][0]["exp_avg"]
    again = ShardedCheckpointManager(tmp_path)
    assert again.restore(into=target) is target  # the restore protocol: filled in place, returned
    assert again.restored["step"] == 3 and target["epoch"] == 3
    _equal(target, saved[3])
    # filled in place: a module's and an optimizer's own tensors (int-keyed state) are restored
    assert target["model"]["0.weight"] is weight and target["optim"]["state"][0]["exp_avg"] is moment
    ShardedCheckpointManager(tmp_path).restore(target, step=2)  # `into` positionally: the same
    _equal(target, saved[2])
    _equal(ShardedCheckpointManager(tmp_path).restore(step=3), saved[3])  # no template: new CPU tensors


def test_empty_missing_and_bad_keep(tmp_path):
    assert ShardedCheckpointManager(tmp_path / "none").restore(_state(0)) is None
    with pytest.raises(FileNotFoundError, match="step-00000005 does not exist"):
        ShardedCheckpointManager(tmp_path / "none").restore(_state(0), step=5)
    with pytest.raises(ValueError, match="keep=0"):
        ShardedCheckpointManager(tmp_path, keep=0)


def test_uncommitted_and_corrupt_fall_back(tmp_path):
    ck = ShardedCheckpointManager(tmp_path, keep=5, async_save=False)
    for s in (1, 2, 3):
        ck.save(s, _state(s))
    ck.close()
    (tmp_path / folder_name(3) / MARKER).unlink()  # step 3: as if the writer died before committing
    data = tmp_path / folder_name(2) / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # step 2: one flipped byte in a committed shard file
    data.write_bytes(bytes(raw))
    target = _state(0)
    again = ShardedCheckpointManager(tmp_path)
    with pytest.warns(UserWarning) as w:
        again.restore(into=target)
    text = " ".join(str(x.message) for x in w)
    assert "step-00000003: no COMMITTED marker" in text and "step-00000002/__0_0.distcp" in text
    assert again.restored["step"] == 1 and target["epoch"] == 1
    assert ShardedCheckpointManager(tmp_path).latest()["step"] == 2  # latest() names committed steps only
    with pytest.raises(FileNotFoundError, match="no COMMITTED marker"):
        ShardedCheckpointManager(tmp_path).restore(target, step=3)
    with pytest.raises(OSError, match="crc32c does not match"):
        ShardedCheckpointManager(tmp_path).restore(target, step=2)


def test_second_writer_refused_and_async_error_surfaces(tmp_path):
    a = ShardedCheckpointManager(tmp_path)
    a.save(1, _state(1))
    with pytest.raises(RuntimeError, match="another checkpoint writer"):
        ShardedCheckpointManager(tmp_path).save(1, _state(1))
    a.close()
    bad = ShardedCheckpointManager(tmp_path / "bad")
    bad.save(1, {"f": lambda: 0})  # staged fine; the background write fails: a lambda cannot be pickled
    with pytest.raises(RuntimeError, match="earlier sharded checkpoint save"):
        bad.wait()
    assert bad.latest() is None  # nothing committed


def test_cpu_state_is_not_sharded():
    assert not is_sharded(_state(0))


def test_gcs_roundtrip_and_uncommitted(gcs_bucket):
    root = f"gs://{gcs_bucket}/run"
    ck = ShardedCheckpointManager(root, keep=2, retry_deadline_s=10)
    saved = {}
    for s in (1, 2, 3):
        st = _state(s)
        ck.save(s, st)
        saved[s] = tree_map(lambda t: t.clone() if torch.is_tensor(t) else t, st)
    ck.close()
    names = sorted(b.name for b in gcs.client().list_blobs(gcs_bucket))
    assert names == [f"run/step-0000000{s}/{n}" for s in (2, 3) for n in (".metadata", MARKER, "__0_0.distcp")]
    target = _state(0)
    again = ShardedCheckpointManager(root)
    assert again.restore(into=target) is target and again.restored["step"] == 3
    _equal(target, saved[3])
    gcs.blob(f"{root}/step-00000003/__0_0.distcp").delete()  # committed, then a file deleted from the bucket
    with pytest.warns(UserWarning, match=r"step-00000003/__0_0.distcp does not exist .*falling back"):
        assert again.restore(into=target) is target and again.restored["step"] == 2
    _equal(target, saved[2])
    with pytest.raises(FileNotFoundError, match=r"step-00000003/__0_0.distcp does not exist"):
        again.restore(into=target, step=3)  # asked for by step: no fallback, the object named
    gcs.blob(f"{root}/step-00000003/{MARKER}").delete()
    with pytest.warns(UserWarning, match="step-00000003: no COMMITTED marker"):
        assert again.restore(into=target) is target and again.restored["step"] == 2
    _equal(target, saved[2])


_KILLED_SAVE = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {repo!r})
    from tests.test_sharded_checkpoint import _state
    from labkit.checkpoint.sharded import ShardedCheckpointManager
    from tests.children.ckpt_hooks import install_from_env
    ck = ShardedCheckpointManager(sys.argv[1], retry_deadline_s=10)
    install_from_env(ck)
    ck.save(1, _state(1)); ck.wait()
    ck.save(2, _state(2)); ck.wait()   # CKPT_TEST_HOLD holds this one open (tests/children/ckpt_hooks.py): the test kills us
    """
)


def _kill_during_save(root, tmp_path, step, script, timeout=300):
    """Run `script` with the save of `step` held open after its files are stored; SIGKILL it there."""
    marker = tmp_path / "pending"
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO),
        CKPT_TEST_HOLD=f"{step}:600",
        CKPT_TEST_MARKER=str(marker),
    )
    p = subprocess.Popen(script, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + timeout
    while not marker.exists() and p.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    if not marker.exists():
        p.kill()
        raise AssertionError(f"the held save never started: {p.communicate()[0][-3000:]}")
    p.kill()  # SIGKILL: no handler, no finally
    p.wait()
    assert p.returncode == -9


@pytest.mark.parametrize("where", ["local", "gcs"])
def test_kill_9_before_the_marker_restores_previous_step(tmp_path, request, where):
    root = f"gs://{request.getfixturevalue('gcs_bucket')}/run" if where == "gcs" else str(tmp_path / "run")
    script = [sys.executable, "-c", _KILLED_SAVE.format(repo=str(REPO)), root]
    _kill_during_save(root, tmp_path, 2, script)
    ck = ShardedCheckpointManager(root)
    listing = ck.formats["sharded"].listing()
    assert MARKER not in listing[2] and "__0_0.distcp" in listing[2]  # the files are there, the commit is not
    assert ck.latest()["step"] == 1
    target = _state(0)
    with pytest.warns(UserWarning, match="step-00000002: no COMMITTED marker"):
        assert ck.restore(into=target) is target and ck.restored["step"] == 1
    _equal(target, _state(1))


@pytest.mark.heavy
def test_fsdp_over_8_killed_then_restored_onto_4_and_1_devices(tmp_path):
    """An FSDP GPT (every weight and AdamW moment split over 8 devices) saves step 1, is killed with
    SIGKILL inside the save of step 2; a 4-device FSDP model and a one-device model (no SPMD) each
    restore step 1, bit-identical, and train a step from it."""
    root, ref = tmp_path / "run", tmp_path / "ref.pt"
    _kill_during_save(root, tmp_path, 2, [sys.executable, str(RUN), "save", "8", str(root), str(ref)])
    assert not (root / folder_name(2) / MARKER).exists() and (root / folder_name(2) / ".metadata").exists()
    for n in (4, 1):
        env = dict(os.environ, PYTHONPATH=str(REPO), EXPECT_STEP="1")
        p = subprocess.run(
            [sys.executable, str(RUN), "restore", str(n), str(root), str(ref)],
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
        )
        checks = [ln for ln in p.stdout.splitlines() if ln.startswith("CHECK")]
        assert p.returncode == 0 and len(checks) == 6, f"{n} devices:\n" + p.stdout + p.stderr[-3000:]


def test_2d_mesh_with_replicated_tiles_restores_onto_1d_layouts():
    """Tiles replicated over one mesh axis are written once (with their copies the checkpoint does not
    load), padded tiles lose their padding, and a 2x4 layout restores onto three 1-D ones."""
    p = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "children" / "sharded_ckpt_mesh2d.py")],
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0 and "RESULT" in p.stdout, p.stdout + p.stderr[-3000:]


@pytest.mark.heavy  # three child runs: ~70 s on a busy 2-core machine
def test_trainer_killed_and_resumed_from_sharded_checkpoints_is_exact(tmp_path):
    """Trainer(checkpoint=CheckpointManager(format="sharded")): SIGKILL after step 8, resume from the newest
    commit, end bit-identical to an uninterrupted run (weights, momentum, scheduler, RNG, data order)."""
    script = Path(__file__).parent / "children" / "ckpt_train_script.py"
    env = dict(os.environ, PYTHONPATH=str(REPO))

    def run(root, out, *extra):
        args = [sys.executable, str(script), str(root), str(out), "--steps", "12", "--every", "3", "--sharded"]
        return subprocess.run([*args, *extra], env=env, capture_output=True, text=True, timeout=300)

    assert run(tmp_path / "ref", tmp_path / "ref.pt").returncode == 0
    assert run(tmp_path / "run", tmp_path / "x.pt", "--kill-at", "8").returncode == -9
    last = ShardedCheckpointManager(tmp_path / "run").latest()["step"]
    assert last in (3, 6)  # 6 unless its background save had not committed when the kill came
    p = run(tmp_path / "run", tmp_path / "resumed.pt", "--resume")
    assert p.returncode == 0 and f"resumed at step {last}" in p.stdout, p.stderr[-3000:]
    ref, got = (
        torch.load(tmp_path / "ref.pt", weights_only=True),
        torch.load(tmp_path / "resumed.pt", weights_only=True),
    )
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)


def test_planner_named_in_the_commit_record(tmp_path, monkeypatch):
    """Without torch_xla installed DCP's own planners write (and must read) the checkpoint; the commit
    record says which, and an unknown one is named."""
    import labkit.checkpoint.dcp as sc  # the sharded format

    monkeypatch.setattr(sc, "_planner_kind", lambda: "default")
    ck = ShardedCheckpointManager(tmp_path)
    ck.save(1, _state(1))
    ck.close()
    assert ck.latest()["planner"] == "default"
    target = _state(0)
    ShardedCheckpointManager(tmp_path).restore(target)
    _equal(target, _state(1))
    marker = tmp_path / folder_name(1) / MARKER
    marker.write_text(marker.read_text().replace('"default"', '"mystery"'))
    with pytest.raises(ValueError, match="unknown planner 'mystery'"):
        ShardedCheckpointManager(tmp_path).restore(target)


def test_restore_into_an_optimizer_without_state_yet(tmp_path):
    """A fresh AdamW has no moments until its first step: restore adds them from the checkpoint, and
    the optimizer's load_state_dict takes them."""
    ck = ShardedCheckpointManager(tmp_path)
    ck.save(1, _state(1))
    ck.close()
    torch.manual_seed(5)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    target = {"model": m.state_dict(), "optim": opt.state_dict(), "epoch": 0}
    assert target["optim"]["state"] == {}
    ShardedCheckpointManager(tmp_path).restore(target)
    _equal(target, _state(1))
    opt.load_state_dict(target["optim"])
    assert len(opt.state) == 4 and torch.equal(
        opt.state[m[0].weight]["exp_avg"], _state(1)["optim"]["state"][0]["exp_avg"]
    )


def test_checkpoint_manager_writes_and_reads_the_sharded_format(tmp_path):
    """CheckpointManager's format: "auto" keeps a CPU state in one file; "sharded" (what "auto" picks for a
    state split over devices) writes DCP folders, keeps its best step through pruning, remembers it in
    the commit record, and reads back as new CPU tensors or into a template in place; the newer of the
    two formats is restored."""
    from labkit.checkpoint import CheckpointManager, object_name

    auto = CheckpointManager(tmp_path / "auto", rt=None)
    auto.save(1, _state(1))
    auto.close()
    assert os.listdir(tmp_path / "auto").count(object_name(1)) == 1 and auto.format == "auto"

    ck = CheckpointManager(tmp_path, keep=2, best_metric="acc", format="sharded", rt=None)
    saved = {}
    for step, acc in ((1, 0.9), (2, 0.1), (3, 0.2), (4, 0.3)):
        st = _state(step)
        assert ck.save(step, st, {"acc": acc})
        saved[step] = tree_map(lambda t: t.clone() if torch.is_tensor(t) else t, st)
    ck.close()
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step-")) == [folder_name(s) for s in (1, 3, 4)]
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".pt")]
    again = CheckpointManager(tmp_path, best_metric="acc", rt=None)
    assert again.best == {"step": 1, "name": folder_name(1), "value": 0.9, "metric": "acc", "mode": "max"}
    assert again.latest()["step"] == 4 and again.latest()["metrics"] == {"acc": 0.3}
    got = again.restore()  # no template: full CPU tensors, like the one-file format
    _equal(got, saved[4])
    target = _state(0)
    weight = target["model"]["0.weight"]
    assert again.restore(into=target) is target and target["model"]["0.weight"] is weight
    _equal(target, saved[4])
    _equal(again.restore(step=1), saved[1])
    later = CheckpointManager(tmp_path, format="file", best_metric=None, rt=None)
    later.save(5, _state(5))
    later.close()
    assert CheckpointManager(tmp_path, rt=None).latest()["step"] == 5
    _equal(CheckpointManager(tmp_path, rt=None).restore(into=_state(0)), _state(5))
    with pytest.raises(ValueError, match="format='dcp'"):
        CheckpointManager(tmp_path, format="dcp", rt=None)


def test_one_manager_keeps_and_falls_back_over_both_formats(tmp_path):
    """A run whose state becomes sharded part-way (one file, then DCP folders, then one file again): `keep`
    counts steps of both formats together, and a damaged newest one-file step falls back to the sharded
    step before it, not to an older one-file step (one retention rule, one fallback, whatever the format)."""
    from labkit.checkpoint import CheckpointManager, object_name

    ck = CheckpointManager(tmp_path, keep=2, best_metric=None, format="file", rt=None, async_save=False)
    ck.save(1, _state(1))
    ck.format = "sharded"  # e.g. the model moved to FSDP: "auto" would pick this for a split state
    ck.save(2, _state(2))
    ck.save(3, _state(3))
    ck.format = "file"
    ck.save(4, _state(4))
    ck.close()
    names = sorted(n for n in os.listdir(tmp_path) if n.startswith(("ckpt-", "step-")))
    assert names == [object_name(4), folder_name(3)], "the newest 2 steps of either format are kept"
    with open(tmp_path / object_name(4), "r+b") as f:  # flip a byte in the middle of the newest step
        f.seek(os.path.getsize(tmp_path / object_name(4)) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    again = CheckpointManager(tmp_path, best_metric=None, rt=None)
    target = _state(0)
    with pytest.warns(UserWarning, match=r"ckpt-00000004.pt is unreadable.*falling back"):
        assert again.restore(into=target) is target
    assert again.restored["step"] == 3 and again.restored["planner"]
    _equal(target, _state(3))


def test_sharded_format_refuses_several_processes(tmp_path):
    from labkit.checkpoint import CheckpointManager
    from labkit.device import Runtime

    rt = Runtime(kind="cpu", device=torch.device("cpu"), world_size=2)
    with pytest.raises(RuntimeError, match="2 processes.*format='file'"):
        CheckpointManager(tmp_path, format="sharded", rt=rt).save(1, _state(1))


def test_checkpoint_manager_finds_the_sharded_format_on_gcs(gcs_bucket):
    from labkit.checkpoint import CheckpointManager

    root = f"gs://{gcs_bucket}/run"
    ck = CheckpointManager(root, keep=1, best_metric=None, format="sharded", rt=None, retry_deadline_s=10)
    ck.save(7, _state(7))
    ck.close()
    again = CheckpointManager(root, rt=None, retry_deadline_s=10)
    assert again.latest()["step"] == 7
    target = _state(0)
    assert again.restore(into=target) is target
    _equal(target, _state(7))


def test_full_disk_leaves_no_partial_step_and_the_next_save_works(tmp_path, monkeypatch):
    """A sharded save on a full disk used to leave its partial step folder behind (holding the space the
    next save needs); now it is removed and the error names the folder and what is free."""
    import errno
    import re

    import torch.distributed.checkpoint as dcp

    ck = ShardedCheckpointManager(tmp_path, async_save=False)
    ck.save(1, _state(1))
    real_save = dcp.save

    def onto_a_full_disk(state, storage_writer, **kw):  # DCP's data file lands on a device that is always full
        os.makedirs(str(storage_writer.path), exist_ok=True)
        os.symlink("/dev/full", os.path.join(str(storage_writer.path), "__0_0.distcp"))
        return real_save(state, storage_writer=storage_writer, **kw)

    monkeypatch.setattr(dcp, "save", onto_a_full_disk)
    with pytest.raises(OSError, match=rf"no space left on {re.escape(str(tmp_path))} \(\d+ MB free\)") as e:
        ck.save(2, _state(2))
    assert e.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert sorted(n for n in os.listdir(tmp_path) if n != ".writer.lock") == [folder_name(1)]  # nothing partial
    ck.save(2, _state(2))
    target = _state(0)
    assert ck.restore(into=target) is target and ck.restored["step"] == 2
    _equal(target, _state(2))
