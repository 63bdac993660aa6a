"""The unit tests whose outcome depends on the Python version, on Python 3.13 (Colab's Python), beside the 3.11 run.

.venvs/py3.13/ holds requirements.txt, the 3.11 lock, installed with Python 3.13 from wheels only
(scripts/image_venv.py; it shares the uv cache with the image venvs). Every pin of the lock has a cp313
wheel, so no version moves: the torch, torch_xla and every library are the 3.11 run's, and only Python differs.
So the 3.13 run takes the modules listed in PY_SENSITIVE, each with the part of Python it leans on; the rest
(arithmetic, network clients, torch's own numerics) gives the same answer on any Python and is the 3.11 run's.
Where Python matters and a module is too slow to run twice, a notebook in a 3.13 image covers it: torch.compile's
bytecode tracing (test_compiled_step.py) and torch.export (test_export.py) run on Python 3.13 in the Colab GPU
image (notebooks 08 and 05, tests/test_images.py). It runs in the background (tests/children/image_job.py py3.13,
started when collection ends: tests/background.py) while the rest of the suite runs.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from tests import background
from tests.children.image_job import ROOT

pytestmark = pytest.mark.images

# module -> the part of Python it leans on (the 3.13 run takes these; heavy tests stay with the 3.11 run)
PY_SENSITIVE = {
    "test_codepaths.py": "traceback frames and path resolution (whose code raised)",
    "test_exercises.py": "traceback frames, SIGALRM timers, exceptions from the learner's code",
    "test_exercises_nb01.py": "the checkers' frame walk on notebook 01's answers",
    "test_config.py": "dataclasses and typing (unions, Optional) in the environment overlay",
    "test_envsetup.py": "importlib.metadata, subprocess and pip: the set-up cell runs on Colab's Python",
    "test_stream.py": "tarfile, multiprocessing DataLoader workers (3.13 warns about fork in threads)",
    "test_tar_names.py": "tarfile's pax headers and name decoding",
    "test_writer.py": "tarfile writing, os.replace",
    "test_hostile_data.py": "tarfile, json, urllib.parse on hostile bytes",
    "test_hostile_round4.py": "stdlib decoders and http reads on hostile bytes",
    "test_loader.py": "DataLoader worker processes and threads",
    "test_checkpoint_safety.py": "pickle: what torch.load(weights_only=True) lets through",
    "test_checkpoint_restore.py": "pickle, tempfile and os errors during restores",
    "test_syncs.py": "sys._getframe and line numbers of the learner's frames",
    "test_compile_instruments.py": "Dynamo's bytecode tracing and logging handlers",
    "test_redaction.py": "re and urllib.parse",
    "test_urls.py": "socket timeouts and http.client",
    "test_http_deadline.py": "http.client reads",
    "test_device.py": "torch_xla's start-up on this Python",
    "test_loop.py": "the Trainer itself (signals, threads, closures)",
    "test_train_script.py": "argparse's messages (3.12 and 3.13 changed them)",
    "test_doctor.py": "importlib.metadata and platform",
}


def _job() -> background.Job:
    out = Path(background.job_dir()) / "py3.13.json"
    modules = [f"tests/{m}" for m in sorted(PY_SENSITIVE)]
    argv = [sys.executable, str(ROOT / "tests" / "children" / "image_job.py"), "py3.13", *modules, str(out)]
    return background.Job(id="py3.13", argv=argv, cwd=str(ROOT), expected_s=113)


def test_every_python_sensitive_module_exists():
    """A renamed module would silently leave the 3.13 run."""
    missing = [m for m in PY_SENSITIVE if not (ROOT / "tests" / m).is_file()]
    assert not missing, f"PY_SENSITIVE names modules that do not exist: {missing}"


def background_job(item) -> background.Job | None:
    return _job() if item.name == "test_unit_suite_passes_on_python_313" else None


@pytest.mark.timeout(3600)
def test_unit_suite_passes_on_python_313(capsys):
    job = background.wait("py3.13", _job())
    result_file = Path(job.argv[-1])
    assert job.returncode == 0 and result_file.exists(), f"the 3.13 job failed:\n{background.output(job)[-6000:]}"
    r = json.loads(result_file.read_text())
    assert r["version"].startswith("3.13."), r["version"]
    with capsys.disabled():
        print(
            f"\n[py3.13] venv {r['built']['action']} in {float(r['built']['seconds']):.1f} s; "
            f"suite in {r['seconds']:.0f} s: {r['summary']}"
        )
    assert r["returncode"] == 0, f"the suite failed on Python {r['version']}:\n{r['stdout']}\n{r['stderr']}"
    assert re.search(r"\d+ passed", r["summary"]) and "failed" not in r["summary"], r["summary"]
