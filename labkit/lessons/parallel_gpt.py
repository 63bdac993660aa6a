"""Train labkit.models.gpt's GPT one of four ways over the devices of an SPMD process, and measure it.

    r = train(Strategy("fsdp"), GPTConfig(...), batches, dump_dir="/tmp/hlo")
    r.losses, r.step_s, r.param_bytes, r.opt_bytes, r.collectives

Strategies: "single" (nothing sharded: the one-device program, replicated on every device of the mesh), "data" (1-D mesh, batch split, weights
replicated), "tensor" (2-D data x model mesh, Megatron heads/MLP split on "model", batch on "data"),
"fsdp" (torch_xla's SpmdFullyShardedDataParallel: every weight split over all devices, batch too).
Every run starts from the same initial weights and sees the same batches, so their losses agree up
to floating-point reassociation (sums split over devices are added in another order).

AdamW's state is created before the first step (zeros with the weight's sharding), so the step
compiles once and the per-device optimizer bytes are known before training. Needs an SPMD runtime
(labkit.setup(spmd=True)) and, for the collective counts, XLA_FLAGS=--xla_dump_to=DIR
--xla_dump_hlo_as_text set before torch_xla started.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from labkit import _xla
from labkit.models.gpt import GPT, GPTConfig
from labkit.spmd import sharding as S
from labkit.spmd.mesh import make_mesh

STRATEGIES = ("single", "data", "tensor", "fsdp")


@dataclass
class Strategy:
    name: str
    model_axis: int = 2  # devices per tensor-parallel group ("tensor" only)

    def __post_init__(self):
        if self.name not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {self.name!r}")


@dataclass
class Result:
    strategy: str
    mesh_shape: dict
    losses: list[float]
    step_s: float  # median seconds per step after the first (compiling) one
    param_bytes: int  # per device
    opt_bytes: int  # per device (AdamW: two moments per weight)
    collectives: dict
    layout: list = field(default_factory=list)
    hlo_path: str = ""
    batch_spec: str = ""  # the XLA sharding of the batch ("" on one device)
    ops: list = field(default_factory=list)  # every collective of the step graph (sharding.collective_ops)
    model: object = field(default=None, repr=False)  # the trained module (unwrapped) and its optimizer
    optimizer: object = field(default=None, repr=False)


def build_mesh(strategy: Strategy):
    if strategy.name in ("single", "data"):
        return make_mesh(None, ("data",))
    if strategy.name == "tensor":
        return make_mesh((-1, strategy.model_axis), ("data", "model"))
    return make_mesh(None, ("fsdp",))


def _init_adamw_state(opt):
    """Create AdamW's moments now, each with its weight's sharding (torch would create them at the
    first step: a second compile, and replicated moments until the partitioner decides)."""
    import torch_xla

    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state[p]
            st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            st["exp_avg"] = torch.zeros_like(p)
            st["exp_avg_sq"] = torch.zeros_like(p)
            spec = S.sharding_of(p)
            if spec and "replicated" not in spec:
                for k in ("exp_avg", "exp_avg_sq"):
                    _xla.copy_sharding(st[k], p)
    torch_xla.sync()


def build(strategy: Strategy, cfg: GPTConfig, device, lr: float, seed: int = 0):
    """(model, optimizer, mesh, batch axis or None) for a strategy, weights from `seed`."""
    import torch_xla.distributed.spmd as xs

    torch.manual_seed(seed)
    model = GPT(cfg)
    if strategy.name == "tensor":
        S.split_qkv(model)  # same weights, q/k/v as separate matrices (whole heads per device)
    model = model.to(device)
    mesh = build_mesh(strategy)
    axis = None
    if strategy.name == "data":
        axis = "data"
    elif strategy.name == "tensor":
        S.apply_specs(model, mesh, S.gpt_tensor_parallel_specs(model))
        axis = "data"
    elif strategy.name == "fsdp":
        from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel

        # GPT returns (logits, loss): shard the logits' batch dim, as FSDPv2 asks of its output
        model = SpmdFullyShardedDataParallel(
            model, mesh=mesh, shard_output=lambda out, m: xs.mark_sharding(out[0], m, ("fsdp", None, None))
        )
        axis = "fsdp"
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0, capturable=True)
    _init_adamw_state(opt)
    return model, opt, mesh, axis


def train(strategy: Strategy, cfg: GPTConfig, batches, lr: float = 1e-2, dump_dir: str | None = None, seed: int = 0):
    """Train on `batches` (a list of (x, y) CPU tensors, the global batch) and measure."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    device = torch_xla.device()
    model, opt, mesh, axis = build(strategy, cfg, device, lr, seed)
    params = list(model.parameters())
    before = S.dumped(dump_dir) if dump_dir else set()
    losses, times, batch_spec = [], [], ""
    for x, y in batches:
        t0 = time.perf_counter()
        x, y = x.to(device), y.to(device)
        if axis is not None:
            S.shard_batch((x, y), mesh, axis)
            batch_spec = batch_spec or S.sharding_of(x)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch_xla.sync()
        losses.append(loss.detach())  # read after the loop: no host sync per step beyond the graph itself
        xm.wait_device_ops()  # honest step times: the graph has finished, not just been queued
        times.append(time.perf_counter() - t0)
    losses = [float(v) for v in torch.stack([v.cpu() for v in losses])]
    coll, path, ops = {}, "", []
    if dump_dir:
        path, text = S.newest_step_graph(dump_dir, before)
        coll = {k: v for k, v in S.count_collectives(text).items() if v["count"]}
        ops = S.collective_ops(text)
    steady = sorted(times[1:]) or times
    inner = getattr(model, "module", model)
    return Result(
        strategy=strategy.name,
        # "single" shards nothing: under SPMD its program is replicated, every device of the mesh runs all of it
        mesh_shape=dict(zip(mesh.axis_names, mesh.mesh_shape))
        if strategy.name != "single"
        else {"replicated on": len(mesh.device_ids)},
        losses=losses,
        step_s=steady[len(steady) // 2],
        param_bytes=S.device_bytes(params),
        opt_bytes=S.device_bytes(S.optimizer_tensors(opt)),
        collectives=coll,
        layout=S.layout_table(inner),
        hlo_path=path,
        batch_spec=batch_spec,
        ops=ops,
        model=inner,
        optimizer=opt,
    )
