"""The unit suite on Python 3.13 (Colab's Python), beside the 3.11 run of the main venv.

.venvs/py3.13/ holds requirements.txt, the 3.11 lock, installed with Python 3.13 from wheels only
(scripts/image_venv.py; it shares the uv cache with the image venvs). Every pin of the lock has a cp313
wheel, so no version moves. The run leaves out the image runs (`images`, this file included) and the
`heavy` tests, which the 3.11 run covers. It runs in the background (tests/children/image_job.py py3.13, started
when collection ends: tests/background.py) while the rest of the suite runs.
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


def _job() -> background.Job:
    out = Path(background.job_dir()) / "py3.13.json"
    argv = [sys.executable, str(ROOT / "tests" / "children" / "image_job.py"), "py3.13", str(out)]
    return background.Job(id="py3.13", argv=argv, cwd=str(ROOT), expected_s=240)


def background_job(item) -> background.Job:
    return _job()


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
