"""The unit suite on Python 3.13 (Colab's Python), beside the 3.11 run of the main venv.

.venvs/py3.13/ holds requirements.txt, the 3.11 lock, installed with Python 3.13 from wheels only
(scripts/image_venv.py; it shares the uv cache with the image venvs). Every pin of the lock has a cp313
wheel, so no version moves. The run leaves out the image runs (`images`, this file included) and the
`heavy` tests, which the 3.11 run covers.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("image_venv", ROOT / "scripts" / "image_venv.py")
image_venv = importlib.util.module_from_spec(_spec)
sys.modules["image_venv"] = image_venv  # dataclasses look their module up there
_spec.loader.exec_module(image_venv)

pytestmark = pytest.mark.images


@pytest.mark.timeout(3600)
def test_unit_suite_passes_on_python_313(capsys):
    built = image_venv.build_lock_venv("3.13", log=lambda msg: None)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTEST_ADDOPTS", "PYTEST_CURRENT_TEST")}
    env.update(PYTHONPATH=str(ROOT), PJRT_DEVICE="CPU", LABKIT_FAST="1", MPLBACKEND="Agg", LABKIT_CONSOLE="1")
    py = built["python"]
    version = subprocess.run([py, "-c", "import sys; print(sys.version.split()[0])"], capture_output=True, text=True)
    assert version.stdout.startswith("3.13."), version
    cmd = [
        py,
        "-m",
        "pytest",
        "tests",
        "-m",
        "not images and not heavy",
        "-q",
        "-p",
        "no:cacheprovider",
        "--timeout=900",
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    lines = proc.stdout.strip().splitlines()
    summary = next((ln for ln in reversed(lines) if re.search(r"\d+ (passed|failed|error)", ln)), "(no summary)")
    with capsys.disabled():
        print(
            f"\n[py3.13] venv {built['action']} in {built['seconds']:.1f} s; suite in {seconds:.0f} s: {summary.strip('= ')}"
        )
    assert proc.returncode == 0, (
        f"the suite failed on Python {version.stdout.strip()}:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    )
    assert re.search(r"\d+ passed", summary) and "failed" not in summary, summary
