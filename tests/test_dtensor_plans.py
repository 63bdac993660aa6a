"""Notebook 03's plans with DTensor (FSDP2, parallelize_module): the arithmetic without processes, then one
torchrun of 4 gloo processes beside GSPMD on 4 virtual XLA:CPU devices (labkit.lessons.dtensor_mesh)."""

import math

import pytest
import torch

from labkit.models.gpt import GPT, GPTConfig
from labkit.spmd import dtensor_plans as D
from labkit.spmd.predict import gpt_param_shapes, predict_fsdp
from labkit.spmd.sharding import split_qkv

FAST = GPTConfig(n_layer=1, n_head=4, n_embd=32, block_size=16)


def test_fsdp2_pads_dim0_and_fsdpv2_splits_the_largest_dim():
    assert D.fsdp2_shard_shape((10, 3), 4) == (3, 3)  # 12 rows stored for 10
    assert D.fsdp2_local_rows(10, 4) == [3, 3, 3, 1] and D.fsdp2_local_rows(2, 4) == [1, 1, 0, 0]
    assert D.fsdp2_shard_shape((32, 128), 4) == (8, 128) and D.largest_dim_shard_shape((32, 128), 4) == (32, 32)
    assert D.largest_dim_shard_shape((32, 32), 4) == (8, 32)  # a tie: the first dim
    assert D.fsdp2_shard_shape((), 4) == () and D.split_dims((16, 32), (16, 8)) == (1,)


def test_predicted_bytes_per_device():
    full = sum(math.prod(s) for s in gpt_param_shapes(FAST)) * 4
    assert D.predict_bytes("data", FAST, 4) == full
    # every dim 0 of the fast GPT divides by 4: FSDP2 and FSDPv2 differ in layout, not in bytes
    assert D.predict_bytes("fsdp", FAST, 4) == full // 4 == predict_fsdp(FAST, 4)["param_bytes"]
    # uneven (wpe 18 x 36): FSDP2 stores ceil(18/4)=5 rows of 36, FSDPv2 ceil(36/4)=9 columns of 18
    odd = GPTConfig(n_layer=1, n_head=4, n_embd=36, block_size=18)
    assert D.predict_bytes("fsdp", odd, 4) - predict_fsdp(odd, 4)["param_bytes"] == (5 * 36 - 18 * 9) * 4
    # tensor, model axis 2: q, k, v, fc (weights and biases) and both projections' weights halved, the rest whole
    C = 32
    split = (3 * (C * C + C) + 4 * C * C + 4 * C + C * C + 4 * C * C) * 4
    assert D.predict_bytes("tensor", FAST, 4, model_axis=2) == full - split // 2


def test_units_and_predicted_collectives():
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16)
    units = D.gpt_units(cfg)
    assert [s for u in units for s in u] != [] and sorted(s for u in units for s in u) == sorted(gpt_param_shapes(cfg))
    assert len(units) == 3 and all(len(u) == 16 for u in D.gpt_units(cfg, split=True)[1:])
    full = sum(math.prod(s) for s in gpt_param_shapes(cfg)) * 4
    root = sum(math.prod(s) for s in units[0]) * 4
    fsdp = D.predict_collectives("fsdp", cfg, 4)
    assert fsdp == {
        "all-gather": {"count": 5, "bytes": 2 * full - root},  # the root is not gathered again for backward
        "reduce-scatter": {"count": 3, "bytes": full},
    }
    last = sum(math.prod(s) for s in units[-1]) * 4  # the Trainer's policy: the last block stays gathered
    kept = D.predict_collectives("fsdp", cfg, 4, last_kept=True)
    assert (
        kept["all-gather"] == {"count": 4, "bytes": 2 * full - root - last}
        and kept["reduce-scatter"] == fsdp["reduce-scatter"]
    )
    assert D.predict_collectives("data", cfg, 4)["all-reduce"] == {"count": 3, "bytes": full}
    assert D.predict_collectives("tensor", cfg, 4)["all-reduce"]["count"] == 2 + 16 * 2 + 2 + 4 * 2
    assert D.textbook_collectives("data", cfg, 4)["all-reduce"] == {"count": len(gpt_param_shapes(cfg)), "bytes": full}
    with pytest.raises(ValueError):
        D.predict_collectives("pipeline", cfg, 4)


def test_collective_names_and_bytes():
    ops = torch.ops
    assert D.op_name(ops.c10d.allreduce_) == D.op_name(ops._c10d_functional.all_reduce) == "all-reduce"
    assert D.op_name(ops.c10d._allgather_base_) == D.op_name(ops.c10d_functional.all_gather_into_tensor)
    assert D.op_name(ops.c10d._allgather_base_) == "all-gather"
    assert D.op_name(ops.c10d._reduce_scatter_base_) == "reduce-scatter"
    a, b = torch.zeros(8), torch.zeros(2, 8)
    assert D.collective_bytes(([a, a],)) == 64  # c10d's allreduce_: a list, added up
    assert D.collective_bytes((b, a)) == 64 and D.collective_bytes((a,), b) == 64  # the largest buffer


def test_local_heads_attention_is_the_same_maths():
    torch.manual_seed(0)
    a, b = GPT(FAST), GPT(FAST)
    b.load_state_dict(a.state_dict())
    split_qkv(a), D.tensor_parallel_model(b)
    x = torch.randint(0, 256, (2, 16))
    assert type(b.blocks[0].attn) is D.LocalHeadsAttention
    torch.testing.assert_close(a(x, x)[1], b(x, x)[1])


def _report(losses=(2.0, 1.5), gbytes=100, glosses=(2.0, 1.5)):
    d = {"param_bytes": 100, "opt_bytes": 200, "losses": list(losses), "rows": [["w", [8, 4], [2, 4], "S(0)", [0], 32]]}
    g = {"param_bytes": gbytes, "opt_bytes": 200, "losses": list(glosses), "rows": [["w", [8, 4], [8, 1], "", [1]]]}
    return {"dtensor": {"fsdp": d}, "gspmd": {"fsdp": g}}


def test_compare_flags_bytes_losses_and_layouts():
    from labkit.lessons import dtensor_mesh as M

    (same,) = M.compare(_report())
    assert same["same_bytes"] and same["same_losses"] and same["layout_differs"] == [["w", [0], [1]]]
    (off,) = M.compare(_report(gbytes=104, glosses=(2.0, 1.6)))
    assert not off["same_bytes"] and not off["same_losses"] and abs(off["loss_diff"] - 0.1) < 1e-9


@pytest.fixture(scope="module")
def report():
    from labkit.lessons import dtensor_mesh as M

    return M.run()  # the fast GPT, 3 steps, every plan: one torchrun of 4 processes, one XLA child


@pytest.mark.heavy
def test_dtensor_beside_gspmd(report):
    from labkit.lessons import dtensor_mesh as M

    single = report["single_losses"]
    assert single[-1] < single[0] - 0.5, single
    rows = {r["plan"]: r for r in M.compare(report)}
    assert sorted(rows) == sorted(D.PLANS)
    for plan, d in report["dtensor"].items():
        r = rows[plan]
        assert r["same_bytes"] and d["param_bytes"] == D.predict_bytes(plan, FAST, 4), (plan, r, d["param_bytes"])
        assert d["opt_bytes"] == 2 * d["param_bytes"] and len(set(d["bytes_by_rank"])) == 1
        assert r["same_losses"], (plan, d["losses"], report["gspmd"][plan]["losses"])
        assert max(abs(a - b) for a, b in zip(d["losses"], single)) <= M.LOSS_TOL, (plan, d["losses"], single)
        assert d["collectives"] == d["predicted"], (plan, d["collectives"], d["predicted"])
    # where the engines lay a weight out differently: FSDP2 dim 0, FSDPv2 the largest dim
    wide = sorted(n for n, s, *_ in report["dtensor"]["fsdp"]["rows"] if len(s) == 2 and s[1] > s[0])
    assert wide == ["blocks.0.mlp.proj.weight", "wpe.weight"]
    assert sorted(n for n, dt, gs in rows["fsdp"]["layout_differs"] if dt == [0] and gs == [1]) == wide
    assert rows["data"]["layout_differs"] == rows["tensor"]["layout_differs"] == []
    assert report["dtensor"]["fsdp"]["padded_bytes"] == report["dtensor"]["fsdp"]["param_bytes"]
    pad = report["padding"]
    assert pad["rows_by_rank"] == D.fsdp2_local_rows(10, 4) and pad["padded_rows"] == 3
    assert "DTensor splits dims [0], GSPMD dims [1]" in M.describe(report)
