"""The GPT trained as one device, data parallel, tensor parallel and FSDPv2 over 8 virtual CPU devices (subprocess:
SPMD and XLA's HLO dump must be set before torch_xla starts): same losses, predicted collectives,
per-device bytes."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import child_env

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.heavy
def test_strategies_agree_and_cost_what_the_paper_says():
    p = subprocess.run(
        [sys.executable, "-m", "tests.children.parallel_gpt_run"],
        cwd=ROOT,
        env=child_env(ROOT, TF_CPP_MIN_LOG_LEVEL="3"),
        capture_output=True,
        text=True,
        timeout=900,
    )
    checks = [ln for ln in p.stdout.splitlines() if ln.startswith("CHECK")]
    assert p.returncode == 0 and len(checks) == 9 and all(" OK " in c for c in checks), (
        "\n".join(checks) + p.stderr[-3000:]
    )
