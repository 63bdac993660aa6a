"""Shared fixtures: XLA:CPU environment, a real loopback GCS server, tiny data."""

from __future__ import annotations

import os

# Before torch_xla is imported anywhere in the test process.
os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("LABKIT_CONSOLE", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

# labkit.scratch() folders of the notebooks and tests run here (and in their kernels): one folder, removed at exit
if "LABKIT_SCRATCH" not in os.environ:
    os.environ["LABKIT_SCRATCH"] = tempfile.mkdtemp(prefix="labkit-test-scratch-")
    atexit.register(shutil.rmtree, os.environ["LABKIT_SCRATCH"], True)
    # torch.compile's cache (~2 GB after a run of the suite) goes there too, not to /tmp/torchinductor_<user>
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.environ["LABKIT_SCRATCH"], "inductor"))

import uuid

import pytest

_PASSED = pytest.StashKey[bool]()  # the session's verdict, for pytest_unconfigure


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    """A fake-gcs-server on 127.0.0.1 for the whole session; STORAGE_EMULATOR_HOST points at it."""
    from labkit.cloud.emulator import LocalGCSServer

    server = LocalGCSServer(root=tmp_path_factory.mktemp("gcs"))
    server.start()
    yield server
    server.close()


@pytest.fixture
def gcs_bucket(gcs_server):
    """A fresh, empty bucket name on the session server."""
    from labkit.cloud import gcs

    name = f"test-{uuid.uuid4().hex[:12]}"
    gcs.client().create_bucket(name)
    return name


def pytest_configure(config):
    """Where the time went, for every item of the run (notebooks/ too, which this folder's hooks would not see):
    tests/timing.py's hooks as a plugin of the whole session."""
    from tests import timing

    if not config.pluginmanager.has_plugin("labkit-timing"):
        config.pluginmanager.register(timing.Plugin(), "labkit-timing")


@pytest.hookimpl(trylast=True)  # after -m / -k deselection: only the selected tests start a job
def pytest_collection_modifyitems(config, items):
    """Tests whose module defines background_job(item) start their child process now (tests/background.py)
    and run last, by which time most of their work is done; so do the cells of the notebooks in
    tests/apart.py's APART, which a child pytest runs."""
    from tests import apart, background, timing

    apart_jobs = apart.plan(config, items)  # the longest notebooks' cells: run in a child pytest (tests/apart.py)
    jobs, later, first = [], [], []
    for item in items:
        make = getattr(getattr(item, "module", None), "background_job", None)
        job = apart_jobs.get(item.nodeid) or (make(item) if make is not None else None)
        if job is None:
            first.append(item)
        else:
            later.append(item)
            if job.id not in {j.id for j in jobs}:
                jobs.append(job)
            timing.waits_for_background(item.nodeid)
    if config.option.collectonly:
        return
    items[:] = first + later
    background.submit(jobs)


def pytest_sessionfinish(session, exitstatus):
    from tests import background

    background.stop_all()
    session.config.stash[_PASSED] = exitstatus == 0


def pytest_unconfigure(config):
    """After the closing table (it reads the jobs' results): a session that passed leaves no job folder behind."""
    from tests import background

    if config.stash.get(_PASSED, False):
        background.remove_dir()
