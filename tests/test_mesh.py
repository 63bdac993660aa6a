"""labkit.spmd.mesh and labkit.spmd.sharding pieces that need no SPMD process: the spmd switch, the batch plan,
shard shapes from XLA sharding strings, and collective counting on real optimized-HLO lines."""

import pytest

from labkit import device
from labkit.models.gpt import GPT, GPTConfig
from labkit.spmd import mesh, sharding


@pytest.mark.parametrize(
    "value, want",
    [
        ("auto", "auto"),
        ("AUTO", "auto"),
        (True, True),
        (False, False),
        ("on", True),
        ("off", False),
        ("1", True),
        ("no", False),
    ],
)
def test_parse_spmd(value, want):
    assert device.parse_spmd(value) == want


def test_parse_spmd_names_the_setting():
    with pytest.raises(ValueError, match="spmd must be one of auto, on, off"):
        device.parse_spmd("sometimes")


def test_spmd_on_a_backend_without_xla_is_refused():
    with pytest.raises(ValueError, match="needs an XLA backend"):
        device.wants_spmd(True, "cuda")
    assert device.wants_spmd("auto", "cpu") is False


def test_batch_plan_arithmetic():
    p = mesh.BatchPlan(per_chip=8, chips=4, hosts=2, spmd=True)
    assert (p.host_batch, p.global_batch, p.total_chips) == (32, 64, 8)
    assert "8 per chip x 8 chip(s) = 64 per step" in p.describe()
    q = mesh.BatchPlan(per_chip=8, chips=1, hosts=2, spmd=False)  # torchrun: one device per process
    assert (q.host_batch, q.global_batch, q.total_chips) == (8, 16, 2)
    assert mesh.throughput(800.0, p) == {"total": 800.0, "per_chip": 100.0}


def test_shard_shape_from_xla_sharding_strings():
    assert sharding.shard_shape((64, 256), "{replicated}") == (64, 256)
    assert sharding.shard_shape((64, 256), "") == (64, 256)
    assert sharding.shard_shape((64, 256), "{devices=[8,1]0,1,2,3,4,5,6,7}") == (8, 256)
    assert sharding.shard_shape((64, 256), "{devices=[1,2,4]0,1,2,3,4,5,6,7 last_tile_dim_replicate}") == (64, 128)
    assert sharding.shard_shape((10,), "{devices=[4]0,1,2,3}") == (3,)  # uneven: the largest shard, padded


HLO = """
  %all-reduce.3 = f32[64,256]{1,0} all-reduce(%dot.30), channel_id=14, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%Add
  %all-reduce.1 = f32[] all-reduce(%reduce.12), channel_id=12, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%Add
  %all-reduce.9 = (f32[192]{0}, f32[64]{0}) all-reduce(%a, %b), channel_id=21, replica_groups={{0,1,2,3}}, to_apply=%Add
  %all-gather = f32[1,512,64]{2,0,1} all-gather(%bitcast.6), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={1}
  %reduce-scatter = f32[8,64]{1,0} reduce-scatter(%x), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %ags = (f32[8,64]{1,0}, f32[64,64]{1,0}) all-gather-start(%y), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}
  %agd = f32[64,64]{1,0} all-gather-done(%ags)
  %fusion = f32[64,256]{1,0} fusion(%all-reduce.3), kind=kLoop
"""


def test_count_collectives_reads_ops_and_bytes():
    got = sharding.count_collectives(HLO)
    assert got["all-reduce"] == {"count": 3, "bytes": 64 * 256 * 4 + 4 + (192 + 64) * 4}
    # an all-gather's payload is its gathered result; a reduce-scatter's is its input (8 devices x result)
    assert got["all-gather"] == {"count": 2, "bytes": 512 * 64 * 4 + 64 * 64 * 4}
    assert got["reduce-scatter"] == {"count": 1, "bytes": 8 * 8 * 64 * 4}


def test_tensor_parallel_specs_cover_whole_heads():
    model = sharding.split_qkv(GPT(GPTConfig(block_size=8, n_layer=2, n_head=4, n_embd=32)))
    specs = sharding.gpt_tensor_parallel_specs(model)
    assert specs["blocks.1.attn.q.weight"] == ("model", None) and specs["blocks.0.mlp.proj.weight"] == (None, "model")
    assert not any(k.startswith(("wte", "wpe", "ln_f")) for k in specs)
    with pytest.raises(TypeError, match="split_qkv"):
        sharding.gpt_tensor_parallel_specs(GPT(GPTConfig(block_size=8, n_layer=1, n_head=2, n_embd=16)))


def test_split_qkv_computes_the_same_function():
    import torch

    torch.manual_seed(0)
    cfg = GPTConfig(block_size=8, n_layer=2, n_head=4, n_embd=32)
    a = GPT(cfg)
    b = sharding.split_qkv(GPT(cfg))
    b.load_state_dict(a.state_dict(), strict=False)  # q/k/v are new names: copy them from the packed matrix
    for blk_a, blk_b in zip(a.blocks, b.blocks):
        blk_b.attn = sharding.SplitQKVAttention(blk_a.attn)
    x = torch.randint(0, 256, (2, 8))
    assert torch.allclose(a(x)[0], b(x)[0], atol=1e-6)


def test_data_parallel_prediction_is_the_parameter_bytes_and_explains_what_xla_added():
    # first principles: one all-reduce per gradient, of the parameter's bytes
    from labkit.models.gpt import GPTConfig as Cfg

    cfg = Cfg(block_size=32, n_layer=2, n_head=4, n_embd=64)
    params = list(GPT(cfg).parameters())
    pred = sharding.predict_data_parallel(cfg, 16)
    assert pred == {"all-reduce": {"count": len(params), "bytes": sum(p.numel() * 4 for p in params)}}
    # read from the optimized HLO of this GPT, batch 16 x 32, 8 virtual devices (torch_xla 2.9, XLA:CPU)
    measured = {"all-reduce": {"count": 32, "bytes": 539660}, "all-gather": {"count": 10, "bytes": 1310720}}
    extra = sharding.extra_collectives(pred, measured)
    # the extra, explained: the tied token table's two gradients (lookup, output layer) reduced separately,
    # three scalars of the mean loss, and two all-gathers of the (B, T, C) activations per LayerNorm (2L + 1)
    table = cfg.vocab_size * cfg.n_embd * 4
    assert extra["all-reduce"] == {"count": 1 + 3, "bytes": table + 3 * 4}
    assert extra["all-gather"] == {"count": 2 * 5, "bytes": 2 * 5 * 16 * 32 * 64 * 4}
