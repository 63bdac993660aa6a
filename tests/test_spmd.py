"""SPMD data parallelism over 4 virtual CPU devices (in a subprocess: SPMD must be switched on
before the first XLA tensor exists, and this test process already has some)."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_spmd_data_parallel_trains_with_sharded_inputs():
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4", TF_CPP_MIN_LOG_LEVEL="3")
    p = subprocess.run([sys.executable, "-m", "tests.spmd_train"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr[-3000:]
    assert p.returncode == 0, out
    assert "SHARDING {devices=[4,1]0,1,2,3}" in p.stdout, out
