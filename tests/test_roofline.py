"""The roofline: measured rates on this device, and the arithmetic that turns FLOPs and bytes into a time."""

import pytest

import labkit
from labkit.profiling import roofline


def test_predict_says_which_term_bounds_the_time():
    m = roofline.Machine("m", flops=1e12, bandwidth=1e11)  # ridge at 10 FLOPs per byte
    assert m.ridge == 10
    mm = roofline.predict(flops=2e9, bytes_moved=1e7, machine=m)  # intensity 200: compute-bound
    assert mm["bound"] == "compute" and mm["s"] == pytest.approx(2e-3) and mm["memory_s"] == pytest.approx(1e-4)
    add = roofline.predict(flops=1e6, bytes_moved=1.2e7, machine=m)  # intensity 1/12: memory-bound
    assert add["bound"] == "memory" and add["s"] == pytest.approx(1.2e-4)
    assert roofline.V5E.ridge == pytest.approx(197e12 / 819e9) and "not verified" in roofline.V5E.name


def test_a_launch_bound_step_keeps_only_the_floor():
    assert roofline.upper_bound(5e-3, 30) == 30  # 5 ms of matmuls: the stated factor holds
    assert roofline.upper_bound(roofline.LAUNCH_FLOOR_S, 10) == 10
    assert roofline.upper_bound(2e-5, 30) == float("inf")  # 0.02 ms: kernel launches and Python set the time


@pytest.mark.parametrize("backend", ["xla-cpu", "cpu"])
def test_measure_on_this_device(backend):
    rt = labkit.setup(backend)
    here = roofline.measure(rt, n=256, mb=8, repeats=3)
    # sane for any CPU of the last decade: more than 1 GFLOP/s and 0.5 GB/s, less than 100 TFLOP/s and 1 TB/s
    assert 1e9 < here.flops < 1e14 and 5e8 < here.bandwidth < 1e12, here
    assert str(rt.device) in here.name
