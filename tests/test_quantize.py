"""x86 int8 post-training quantization (PyTorch 2 export flow + Inductor) and the CPU flag reader."""

import pytest
import torch
import torch.nn as nn

from labkit.serve import quantize


def small_convnet():
    torch.manual_seed(0)
    # ~80k weights: enough that the file's fixed overhead (~50 KB) does not hide the 4x smaller int8 weights
    return nn.Sequential(
        nn.Conv2d(3, 64, 3, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.Conv2d(64, 128, 3, stride=2),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(128, 10),
    ).eval()


def test_int8_model_is_really_int8_close_to_fp32_smaller_and_compiles():
    m = small_convnet()
    calib = [torch.randn(16, 3, 16, 16) for _ in range(4)]
    q = quantize.quantize_x86(m, calib[0][:2], calib)
    assert quantize.int8_weights(q) == 3  # both convs and the linear hold int8 weights
    x = torch.randn(8, 3, 16, 16)
    with torch.no_grad():
        ref, out = m(x), q(x)
    assert out.shape == (8, 10)
    assert (out - ref).abs().max() < 0.1 * ref.abs().max()  # int8 rounding, not a different model
    assert quantize.size_on_disk(q, x[:2]) < 0.6 * quantize.size_on_disk(quantize.batch_export(m, x[:2]))
    fast = quantize.compile_cpu(q, x)  # Inductor's int8 kernels
    torch.testing.assert_close(fast(x), out, atol=0.1 * ref.abs().max().item(), rtol=0)
    assert fast(x[:1]).shape == (1, 10)  # another batch size: another graph, same results
    assert quantize.throughput(fast, x, seconds=0.05) > 0


def test_calibration_without_batches_is_refused():
    m = small_convnet()
    with pytest.raises(ValueError, match="calibration gave no batches"):
        quantize.quantize_x86(m, torch.randn(2, 3, 16, 16), [])


def test_cpu_flags_and_what_they_promise(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nmodel name\t: Some Xeon\nflags\t\t: fpu sse avx2 avx512f avx512_vnni\n\n"
        "processor\t: 1\nmodel name\t: Some Xeon\nflags\t\t: fpu sse avx2 avx512f avx512_vnni\n"
    )
    f = quantize.cpu_flags(str(info))
    assert f["model"] == "Some Xeon" and f["avx2"] and f["avx512_vnni"] and not f["amx_int8"] and not f["avx_vnni"]
    assert "VNNI" in quantize.int8_outlook(f)
    assert "without VNNI" in quantize.int8_outlook({"avx2": True})
    assert "AMX" in quantize.int8_outlook({"amx_int8": True, "avx2": True})
    assert quantize.cpu_flags(str(tmp_path / "none"))["model"].startswith("unknown")
    real = quantize.cpu_flags()
    assert set(quantize.INT8_FLAGS) <= set(real)


def test_without_pt2e_the_error_says_what_to_install(monkeypatch):
    """torch >= 2.10 without a torchao that has pt2e (Colab's GPU image: torch 2.11, torchao 0.10)."""
    import sys

    from labkit.serve import quantize

    assert quantize.pt2e_missing() is None  # the lock's torch 2.9 still ships torch.ao's flow
    for name in ("torchao", "torch.ao.quantization.quantize_pt2e"):
        monkeypatch.setitem(sys.modules, name, None)  # `import` of either now raises ImportError
    reason = quantize.pt2e_missing()
    assert reason is not None and "torchao>=0.11" in reason and "no torchao" in reason
    with pytest.raises(ImportError, match="PT2E"):
        quantize.pt2e_api()


def test_throughput_spread_reads_the_same_calls_three_ways():
    """(median, slowest, fastest) examples per second, ordered on any machine; throughput() is its median."""
    calls = []
    x = torch.zeros(4, 2)
    med, slow, fast = quantize.throughput_spread(lambda t: calls.append(t), x, seconds=0.0, warmup=1, min_iters=5)
    assert len(calls) == 1 + 5 and 0 < slow <= med <= fast
    assert quantize.throughput(lambda t: t, x, seconds=0.0, min_iters=3) > 0
