"""One writer per checkpoint root, really: a gs:// writer proves it still holds the lock before every commit
point (an object replaced, a marker, the pointer, a prune), a taken-over writer commits nothing, releases only
its own lock, ages are read on the server's clock, and a step another run committed is never replaced. A
local `.writer.lock` planted as a link is refused. Against the loopback fake-gcs-server."""

import json
import os
import time
import warnings

import pytest
import torch

from labkit.checkpoint import CheckpointManager

LOCK = ".writer.lock"


def _state(v, step=0):
    return {"model": {"w": torch.full((4, 4), float(v))}, "step": step}


def _opts(fmt="file"):
    return dict(keep=1, rt=None, best_metric=None, retry_deadline_s=10, async_save=False, format=fmt)


def _resumed(root, fmt="file"):
    """A second run on the same prefix that resumed (and so may take the lock over)."""
    m = CheckpointManager(root, **_opts(fmt))
    m.restore()
    return m


def _take_over(root, fmt="file"):
    m = _resumed(root, fmt)
    with pytest.warns(UserWarning, match="taking over the writer lock"):
        m.store.acquire_writer(takeover=True)
    return m


def _w(m, step=None):
    got = m.restore(step=step)
    return float(got["model"]["w"][0, 0])


def _fresh(root):
    return CheckpointManager(root, rt=None, best_metric=None)


# -- the takeover at each point of a save ------------------------------------------------------------------
POINTS = ["before the upload", "after the upload", "after the pointer"]


@pytest.mark.parametrize("point", POINTS)
def test_a_writer_whose_lock_is_taken_mid_save_commits_nothing_more(gcs_bucket, point):
    root = f"gs://{gcs_bucket}/run"
    old = CheckpointManager(root, **_opts())
    old.save(1, _state(1, 1))
    new = {}

    def take_over(*a):
        if "m" not in new:
            new["m"] = _take_over(root)

    if point == "before the upload":
        old.writer.on_stage = take_over
    else:  # wrap the store call after which the other run takes over
        name = "put_if_absent" if point == "after the upload" else "put_if_version"  # the pointer's write
        real = getattr(old.store, name)

        def then_take_over(*a, **k):
            real(*a, **k)
            take_over()

        setattr(old.store, name, then_take_over)
    with pytest.raises(RuntimeError, match="taken over by another writer"):
        old.save(2, _state(2, 2))
    with pytest.raises(RuntimeError, match="another checkpoint writer"):
        old.save(3, _state(3, 3))  # and every later save: the lock is the other run's
    committed = 2 if point == "after the pointer" else 1
    assert _w(_fresh(root)) == committed  # nothing of the old writer became visible after the takeover
    new["m"].save(10, _state(10, 10))  # the run that took over saves as usual
    new["m"].close()
    assert _w(_fresh(root)) == 10 and _fresh(root).latest()["step"] == 10


def test_a_sharded_save_in_flight_does_not_write_its_marker_after_a_takeover(gcs_bucket):
    from labkit.checkpoint import MARKER, folder_name
    from labkit.cloud import gcs

    root = f"gs://{gcs_bucket}/run"
    old = CheckpointManager(root, **_opts("sharded"))
    old.save(1, _state(1, 1))
    new = {}
    old.writer.on_stage = lambda *a: new.setdefault("m", _take_over(root, "sharded"))  # files in, marker next
    with pytest.raises(RuntimeError, match="taken over by another writer"):
        old.save(2, _state(2, 2))
    assert not gcs.exists(f"{root}/{folder_name(2)}/{MARKER}")
    assert _w(_fresh(root)) == 1
    new["m"].save(3, _state(3, 3))
    assert _w(_fresh(root)) == 3


# -- two runs resumed from one step ------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["file", "sharded"])
@pytest.mark.parametrize("first", ["a", "b"])
def test_two_resumed_runs_racing_never_replace_a_committed_step(gcs_bucket, fmt, first):
    """Both resume step 1 and save step 2, in either order: the first one's step 2 stays (the second is
    refused), and the run that lost the lock commits nothing after."""
    root = f"gs://{gcs_bucket}/run"
    seed = CheckpointManager(root, **_opts(fmt))
    seed.save(1, _state(1, 1))
    seed.close()
    runs = {"a": _resumed(root, fmt), "b": _resumed(root, fmt)}
    winner, loser = runs[first], runs["b" if first == "a" else "a"]
    winner.save(2, _state(20, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the takeover's warning
        with pytest.raises(RuntimeError, match="another run committed"):
            loser.save(2, _state(99, 2))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert _w(_fresh(root)) == 20
    assert not [w for w in seen if "falling back" in str(w.message)]  # step 2 intact: no fallback
    with pytest.raises(RuntimeError, match="taken over by another writer"):
        winner.save(3, _state(30, 3))  # the loser took the lock over before it was refused
    assert _w(_fresh(root)) == 20


# -- releasing, clocks, odd locks ----------------------------------------------------------------------------
def test_close_leaves_a_lock_another_run_took_over(gcs_bucket):
    from labkit.cloud import gcs

    root = f"gs://{gcs_bucket}/run"
    old = CheckpointManager(root, **_opts())
    old.save(1, _state(1, 1))
    new = _take_over(root)
    with pytest.warns(UserWarning, match="taken over by another writer.*left in place"):
        old.close()
    assert json.loads(gcs.blob(f"{root}/{LOCK}").download_as_bytes())["id"] == new.store._lock["id"]
    third = CheckpointManager(root, **_opts())  # did not resume: refused, the lock is the new run's
    with pytest.raises(RuntimeError, match="another checkpoint writer"):
        third.save(5, _state(5, 5))
    new.close()
    assert not gcs.exists(f"{root}/{LOCK}")  # its own lock: released


def test_a_fast_host_clock_does_not_take_a_fresh_lock_over(gcs_bucket, monkeypatch):
    """The lease is measured on the server's clock: a host 16 minutes ahead sees a lock renewed now as new."""
    root = f"gs://{gcs_bucket}/run"
    holder = CheckpointManager(root, **_opts())
    holder.save(1, _state(1, 1))
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 16 * 60)
    other = CheckpointManager(root, **_opts())
    with pytest.raises(RuntimeError, match="another checkpoint writer"):
        other.save(2, _state(2, 2))
    monkeypatch.undo()
    holder.save(2, _state(2, 2))  # still the holder
    assert _w(_fresh(root)) == 2


def test_a_lock_deleted_by_hand_stops_the_writer_that_held_it(gcs_bucket):
    from labkit.cloud import gcs

    root = f"gs://{gcs_bucket}/run"
    a = CheckpointManager(root, **_opts())
    a.save(1, _state(1, 1))
    gcs.blob(f"{root}/{LOCK}").delete()
    b = CheckpointManager(root, **_opts())
    b.restore()
    b.save(2, _state(2, 2))  # the lock was free: b takes it, create-only
    with pytest.raises(RuntimeError, match="taken over by another writer.*deleted by hand"):
        a.save(3, _state(3, 3))
    assert _w(_fresh(root)) == 2


@pytest.mark.parametrize("body", [b"[]", b"5", b"not json"])
def test_a_lock_that_is_not_a_json_object_is_named(gcs_bucket, body):
    from labkit.cloud import gcs

    root = f"gs://{gcs_bucket}/run"
    gcs.blob(f"{root}/{LOCK}").upload_from_string(body)
    with pytest.raises(RuntimeError, match=r"\.writer\.lock is not a labkit writer lock.*gcloud storage rm"):
        CheckpointManager(root, **_opts()).save(1, _state(1, 1))


def test_a_local_lock_planted_as_a_link_is_not_written_through(tmp_path):
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    root = tmp_path / "run"
    root.mkdir()
    os.symlink(victim, root / LOCK)
    with pytest.raises(RuntimeError, match=r"\.writer\.lock is a symbolic link.*refusing to write through it"):
        CheckpointManager(root, **_opts()).save(1, _state(1, 1))
    assert victim.read_text() == "keep me"
    os.remove(root / LOCK)
    os.link(victim, root / LOCK)  # a hard link: the same file under two names
    with pytest.raises(RuntimeError, match="not a plain lock file"):
        CheckpointManager(root, **_opts()).save(1, _state(1, 1))
    assert victim.read_text() == "keep me"


def test_a_forked_child_does_not_keep_the_local_writer_lock(tmp_path):
    """A DataLoader worker forked while a manager holds the folder's flock (persistent_workers=True) gets a copy of
    its descriptor. After close(), a new manager on the folder in the same process must take the lock, the child
    still alive. The child says it started (its fork hooks have run by then, as a worker's have long before a
    notebook closes its manager); the test waits for that, so no scheduling decides the verdict."""
    root = str(tmp_path / "ck")
    first = CheckpointManager(root, **_opts())
    first.save(1, _state(1, 1))
    (wait_r, wait_w), (ready_r, ready_w) = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: says it runs, then waits until the parent has tried, as a persistent worker would
        try:
            os.write(ready_w, b"r")
            os.read(wait_r, 1)
        finally:
            os._exit(0)
    os.close(wait_r)
    os.close(ready_w)
    try:
        assert os.read(ready_r, 1) == b"r"
        first.close()
        second = CheckpointManager(root, **_opts())
        second.save(2, _state(2, 2))  # takes the writer lock: refused while the child held a copy
        second.close()
    finally:
        os.write(wait_w, b"x")
        os.close(wait_w)
        os.close(ready_r)
        os.waitpid(pid, 0)
