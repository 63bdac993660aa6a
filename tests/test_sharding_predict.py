"""The paper predictions of labkit.spmd.sharding for tensor parallelism and FSDP against figures read from
real optimized HLO (torch_xla 2.9, XLA:CPU, 8 virtual devices), tile parsing, collective listing, the
layout picture, and the practice-devices switch (in a fresh process: it must run before torch_xla)."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from labkit.models.gpt import GPT, GPTConfig
from labkit.spmd import sharding

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "L, C, T, measured",
    [  # read from the optimized HLO: 2 x 4 data x model mesh, global batch 16 (parallel_gpt.train, "tensor")
        (1, 32, 16, {"all-reduce": {"count": 30, "bytes": 142796}, "all-gather": {"count": 10, "bytes": 229376}}),
        (1, 48, 8, {"all-reduce": {"count": 30, "bytes": 194220}, "all-gather": {"count": 10, "bytes": 172032}}),
        (2, 48, 8, {"all-reduce": {"count": 52, "bytes": 288204}, "all-gather": {"count": 18, "bytes": 294912}}),
    ],
)
def test_tensor_parallel_prediction_from_first_principles_and_what_xla_added(L, C, T, measured):
    cfg = GPTConfig(block_size=T, n_layer=L, n_head=4, n_embd=C)
    pred = sharding.predict_tensor_parallel(cfg, 16, data=4, model=2)
    act = (16 // 4) * T * C * 4  # one data slice's activations
    n_params = len(list(GPT(cfg).parameters())) + 4 * L  # q, k, v as three weights and three biases (split_qkv)
    assert pred["all-reduce"]["count"] == n_params + 4 * L  # gradients over "data" + Megatron's 4 per block
    # gradient bytes one device holds: the split matrices (q, k, v, attention proj, MLP fc and proj) and the
    # column-split biases (q, k, v, fc) at 1/2
    full = sum(math.prod(s) for s in sharding.gpt_param_shapes(cfg)) * 4
    split = L * (3 * C * C + 3 * C + C * C + 8 * C * C + 4 * C) * 4
    assert pred["all-reduce"]["bytes"] == full - split // 2 + 4 * L * act
    extra = sharding.extra_collectives(pred, measured)
    # explained: the tied table's two gradients, three loss scalars, q/k/v's input gradients reduced one by
    # one (2 more than Megatron's single all-reduce), LayerNorm's two all-gathers of the whole batch's
    # activations (2L + 1 LayerNorms), and four all-gathers per block of one data slice's heads around attention
    table = cfg.vocab_size * C * 4
    assert extra["all-reduce"] == {"count": 1 + 3 + 2 * L, "bytes": table + 3 * 4 + 2 * L * act}
    assert extra["all-gather"] == {"count": 2 * (2 * L + 1) + 4 * L, "bytes": 2 * (2 * L + 1) * 4 * act + 4 * L * act}


def test_tensor_parallel_prediction_scales_with_the_mesh():
    cfg = GPTConfig(block_size=16, n_layer=1, n_head=4, n_embd=32)
    two = sharding.predict_tensor_parallel(cfg, 16, data=4, model=2)
    four = sharding.predict_tensor_parallel(cfg, 16, data=2, model=4)
    # a wider model axis: smaller weight shards to reduce, but each data slice's activations are larger
    assert four["all-reduce"]["count"] == two["all-reduce"]["count"]
    act_two, act_four = 4 * 16 * 32 * 4, 8 * 16 * 32 * 4
    assert four["all-reduce"]["bytes"] - 4 * act_four < two["all-reduce"]["bytes"] - 4 * act_two


def test_tensor_parallel_prediction_names_what_does_not_divide():
    cfg = GPTConfig(block_size=16, n_layer=1, n_head=4, n_embd=36)
    with pytest.raises(ValueError, match="n_embd=36"):
        sharding.predict_tensor_parallel(cfg, 16, data=1, model=8)
    with pytest.raises(ValueError, match="global_batch=10"):
        sharding.predict_tensor_parallel(GPTConfig(n_embd=32, n_head=4), 10, data=4, model=2)
    with pytest.raises(ValueError, match="n_head=6"):
        sharding.predict_tensor_parallel(GPTConfig(n_embd=48, n_head=6), 16, data=2, model=4)
    with pytest.raises(ValueError, match="bias=True"):
        sharding.predict_tensor_parallel(GPTConfig(n_embd=32, n_head=4, bias=False), 16, data=4, model=2)


def test_gpt_param_shapes_are_the_models():
    cfg = GPTConfig(block_size=16, n_layer=2, n_head=4, n_embd=32)
    assert sharding.gpt_param_shapes(cfg) == [tuple(p.shape) for p in GPT(cfg).parameters()]


@pytest.mark.parametrize(
    "L, C, T, per_device",  # measured per-device parameter bytes of SpmdFullyShardedDataParallel, 8 devices
    [(1, 32, 32, 10992), (1, 32, 16, 10736), (2, 48, 8, 34656)],
)
def test_fsdp_prediction_matches_measured_bytes(L, C, T, per_device):
    cfg = GPTConfig(block_size=T, n_layer=L, n_head=4, n_embd=C)
    got = sharding.predict_fsdp(cfg, 8)
    assert got["param_bytes"] == per_device and got["opt_bytes"] == 2 * per_device
    full = sum(p.numel() * 4 for p in GPT(cfg).parameters())
    assert got["textbook"]["all-gather"]["bytes"] == 2 * full
    assert got["textbook"]["reduce-scatter"] == {"count": len(list(GPT(cfg).parameters())), "bytes": full}


def test_fsdp_prediction_pads_like_the_sharding():
    cfg = GPTConfig(block_size=10, n_layer=1, n_head=2, n_embd=6)  # 6 / 8, 18 / 8, 24 / 8 ... do not all divide

    def spec(shape):  # FSDPv2 splits the largest dim (the first on a tie) over the 8 devices
        tiles = [1] * len(shape)
        tiles[shape.index(max(shape))] = 8
        return "{devices=[" + ",".join(map(str, tiles)) + "]0,1,2,3,4,5,6,7}"

    want = sum(torch.Size(sharding.shard_shape(s, spec(s))).numel() * 4 for s in sharding.gpt_param_shapes(cfg))
    assert sharding.predict_fsdp(cfg, 8)["param_bytes"] == want


def test_tile_devices_reads_explicit_and_iota_forms():
    t = sharding.tile_devices
    assert t(2, "{devices=[2,1,4]0,2,4,6,1,3,5,7 last_tile_dim_replicate}") == {
        (0, 0): [0, 2, 4, 6],
        (1, 0): [1, 3, 5, 7],
    }
    assert t(2, "{devices=[4,1,2]0,1,2,3,4,5,6,7 last_tile_dim_replicate}")[(3, 0)] == [6, 7]
    assert t(2, "{devices=[2,4]<=[4,2]T(1,0)}") == {
        (0, 0): [0],
        (0, 1): [2],
        (0, 2): [4],
        (0, 3): [6],
        (1, 0): [1],
        (1, 1): [3],
        (1, 2): [5],
        (1, 3): [7],
    }
    assert t(1, "{devices=[8]<=[8]}")[(5,)] == [5]
    assert t(2, "{replicated}") == t(2, "") == {(0, 0): []}


def test_collective_ops_lists_each_one_with_its_group():
    hlo = """
  %all-reduce = f32[32,48]{1,0} all-reduce(%dot.5), channel_id=5, replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
  %all-gather.1 = f32[4,4,16,8]{3,2,0,1} all-gather(%t), channel_id=2, replica_groups=[4,2]<=[8], dimensions={1}
  %all-reduce.8 = f32[] all-reduce(%reduce.9), channel_id=19, replica_groups={{0,2,4,6},{1,3,5,7}}, to_apply=%add
"""
    ops = sharding.collective_ops(hlo)
    assert [(o["op"], o["result"], o["group"]) for o in ops] == [
        ("all-reduce", "f32[32,48]", 2),
        ("all-gather", "f32[4,4,16,8]", 2),
        ("all-reduce", "f32[]", 4),
    ]
    assert [o["bytes"] for o in ops] == [32 * 48 * 4, 4 * 4 * 16 * 8 * 4, 4]
    assert sharding.count_collectives(hlo)["all-reduce"] == {"count": 2, "bytes": 32 * 48 * 4 + 4}


def test_layout_picture_draws_every_tile():
    import matplotlib

    matplotlib.use("Agg")
    from labkit.spmd.view import draw_layouts

    fig = draw_layouts(
        [
            {"strategy": "data", "devices": 8, "tensors": [("fc", (128, 32), "{replicated}")]},
            {
                "strategy": "tensor",
                "devices": 8,
                "tensors": [
                    ("fc", (128, 32), "{devices=[2,1,4]0,2,4,6,1,3,5,7 last_tile_dim_replicate}"),
                    ("batch", (16, 16), "{devices=[4,1,2]0,1,2,3,4,5,6,7 last_tile_dim_replicate}"),
                ],
            },
        ]
    )
    axes = fig.axes
    assert len(axes) == 4 and not axes[1].axison  # the data row has one tensor: its second panel is blank
    assert len(axes[0].patches) == 1 and axes[0].texts[0].get_text() == "all 8"
    assert [t.get_text() for t in axes[2].texts] == ["dev 0,2,4,6", "dev 1,3,5,7"]
    assert len(axes[3].patches) == 4 and axes[3].texts[0].get_text() == "dev 0,1"


def test_practice_devices_sets_the_cpu_mesh_and_the_dump_before_torch_xla(tmp_path):
    code = (
        "import os, sys; from labkit.spmd import mesh; "
        f"print(mesh.practice_devices(8, {str(tmp_path)!r})); "
        "print(os.environ['PJRT_DEVICE'], os.environ['CPU_NUM_DEVICES'], os.environ['XLA_FLAGS']); "
        "import torch_xla; print(mesh.practice_devices(8, 'elsewhere'))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("CPU_NUM_DEVICES", "XLA_FLAGS", "TPU_ACCELERATOR_TYPE")}
    env.update(PYTHONPATH=str(ROOT), XLA_FLAGS="--xla_cpu_enable_fast_math=false")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    lines = p.stdout.splitlines()
    assert p.returncode == 0, p.stderr[-2000:]
    assert "8 virtual XLA:CPU devices" in lines[0] and str(tmp_path) in lines[0]
    assert lines[1] == f"CPU 8 --xla_cpu_enable_fast_math=false --xla_dump_to={tmp_path} --xla_dump_hlo_as_text"
    assert lines[2].startswith("torch_xla already imported")


@pytest.mark.parametrize(
    "need, chips, started_on_tpu, want",
    [
        (2, 0, False, "cpu"),  # a laptop, a GPU runtime: virtual XLA:CPU devices
        (2, 1, False, "cpu"),  # Colab's v5e-1: one chip is not a mesh
        (2, 1, True, "restart"),  # ... and torch_xla already imported for that chip: only a fresh kernel helps
        (2, 8, False, "tpu"),  # a v5e-8
        (2, 4, True, "tpu"),  # a v4-8 (4 chips), torch_xla already running: fine
        (8, 4, False, "cpu"),  # a lesson that needs 8 on 4 chips
    ],
)
def test_practice_choice(need, chips, started_on_tpu, want):
    from labkit.spmd import practice_choice

    assert practice_choice(need, chips, started_on_tpu) == want


def test_practice_devices_on_a_one_chip_tpu_host_uses_virtual_cpu_devices(tmp_path):
    """Colab's v5e-1 simulated (TPU_ACCELERATOR_TYPE with PJRT_DEVICE=CPU): labkit sees a TPU with one
    chip, which cannot hold a mesh, so the lesson must still get 8 virtual XLA:CPU devices and say why."""
    code = (
        "import os; from labkit.spmd import mesh; from labkit import envsetup; "
        "print(envsetup.detect_tpu().chips); "
        f"print(mesh.practice_devices(8, {str(tmp_path)!r})); "
        "print(os.environ['PJRT_DEVICE'], os.environ.get('CPU_NUM_DEVICES'), os.environ['TF_CPP_MIN_LOG_LEVEL']); "
        "import torch_xla.runtime as xr; print(xr.global_runtime_device_count())"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("CPU_NUM_DEVICES", "XLA_FLAGS", "TF_CPP_MIN_LOG_LEVEL")}
    env.update(PYTHONPATH=str(ROOT), TPU_ACCELERATOR_TYPE="v5litepod-1", PJRT_DEVICE="CPU")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.splitlines()
    assert lines[0] == "1", "the simulated host must look like a one-chip TPU"
    assert "1 chip(s), fewer than the 2" in lines[1] and "8 virtual XLA:CPU devices" in lines[1], lines[1]
    assert lines[2] == "CPU 8 2"
    assert lines[3] == "8"


def test_layout_picture_greys_only_what_every_device_holds():
    """Grey means replicated: a slice held by one device (device 7 was tab10's grey) gets a colour of its own."""
    import matplotlib

    matplotlib.use("Agg")
    from labkit.spmd.view import REPLICATED, draw_layouts

    spec = "{devices=[8,1]0,1,2,3,4,5,6,7}"
    fig = draw_layouts([{"strategy": "fsdp", "devices": 8, "tensors": [("fc", (128, 32), spec)]}])
    colours = [tuple(p.get_facecolor()[:3]) for p in fig.axes[0].patches]
    assert len(colours) == 8 and len(set(colours)) == 8
    assert all(abs(r - g) > 0.05 or abs(g - b) > 0.05 for r, g, b in colours), "a single device's slice drawn grey"
    assert REPLICATED not in colours
