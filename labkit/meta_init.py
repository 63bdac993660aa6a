"""A model too big for one device: built on the meta device, sharded, then each shard filled with the values a
one-process build would have given it.

    model = labkit.meta_init.build(lambda: GPT(cfg), seed=0)     # no weight memory yet: every tensor on "meta"
    opt = adamw(model, 3e-4)                                      # the optimizer may be built on it (no state yet)
    trainer = labkit.Trainer(model, opt, rt, TrainConfig(parallel="fsdp2"), ...)   # shards, then fills the shards

Why: built the ordinary way, every process first holds the whole model (on the CPU, then moved whole to its device)
and only then shards it: a model whose float32 weights do not fit one device cannot be built, and 8 processes hold
8 whole CPU copies. torchtitan builds on the meta device, shards, then `to_empty` + `init_weights()` on the shards;
its values then differ from a one-process build of the same seed. labkit keeps them equal, so a run under fsdp2
and a replicate or one-process run of the same seed train alike (tests/test_fsdp_trainer.py compares their losses):

1. `build` constructs the model under torch.manual_seed(seed) on the meta device and records, for every parameter
   and buffer, the in-place ops its constructor ran on it (uniform_, normal_, zero_, fill_, ...) and, for each
   random one, the CPU generator's state just before it. To advance the generator exactly as a CPU build does, each
   random op also runs once on a scratch CPU tensor of that shape (one tensor at a time, freed at once).
2. `materialize(model, device)`, after sharding, gives every tensor real memory (`to_empty`) and replays its ops on
   a whole CPU tensor, one tensor at a time, keeping only this process's shard (DTensor's own split of it, any
   mesh). Peak memory per process: its shards plus the largest single tensor, not the whole model.

The cost: the initialisation runs 1 + (processes) times over (once to record, once per process to replay), a few
seconds for a billion weights. What cannot be replayed this way (an op that reads another tensor, such as a copy_
from a pretrained weight, or an op on a view) is refused by name: build that model on the CPU and load its weights.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_RANDOM = {"uniform_", "normal_", "bernoulli_", "random_", "exponential_", "geometric_", "log_normal_", "cauchy_"}
_FILL = {"zero_", "fill_", "uniform_", "normal_", "bernoulli_", "random_", "exponential_", "geometric_"}
_FILL |= {"log_normal_", "cauchy_", "clamp_", "mul_", "div_", "add_", "sub_", "erfinv_", "clamp_min_", "clamp_max_"}


def _key(t) -> int:
    return t.untyped_storage()._cdata  # a Parameter wraps its tensor's storage: the same key for both


class _Recorder(TorchDispatchMode):
    """Every in-place op on a meta tensor, kept per storage: (op, its other arguments, generator state or None)."""

    def __init__(self):
        super().__init__()
        self.ops: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        target = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if target is None or not target.is_meta or not name.endswith("_") or name.startswith("set_"):
            return func(*args, **kwargs)
        rest = args[1:]
        if name not in _FILL or any(isinstance(a, torch.Tensor) and a.is_meta for a in rest):
            self.ops.setdefault(_key(target), []).append(("refuse", name, None, None))
            return func(*args, **kwargs)
        state = None
        if name in _RANDOM:  # the CPU generator advanced as a CPU build advances it
            state = torch.get_rng_state()
            scratch = torch.empty(target.shape, dtype=target.dtype, device="cpu")
            func(scratch, *rest, **kwargs)
            del scratch
        view = target.numel() != target.untyped_storage().nbytes() // max(target.element_size(), 1)
        self.ops.setdefault(_key(target), []).append(("view" if view else "op", func, (rest, kwargs), state))
        return func(*args, **kwargs)


def build(make, seed: int = 0):
    """`make()` run on the meta device under torch.manual_seed(seed), its initialisation recorded for materialize.
    The CPU generator ends where a CPU build would leave it."""
    torch.manual_seed(seed)
    rec = _Recorder()
    with torch.device("meta"), rec:
        model = make()
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    model._labkit_init = {name: rec.ops.get(_key(t), []) for name, t in named}
    return model


def is_meta(model) -> bool:
    return any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


def _replay(name: str, shape, dtype, ops) -> torch.Tensor:
    for kind, fn, _, _ in ops:
        if kind in ("refuse", "view"):
            what = fn if kind == "refuse" else fn.__name__
            raise ValueError(
                f"meta-device build: {name} was initialised with {what} on a view or from another tensor, which "
                "labkit.meta_init cannot replay shard by shard: build this model on the CPU instead (and load its "
                "weights), or initialise it with in-place ops on whole tensors"
            )
    full = torch.empty(shape, dtype=dtype, device="cpu")
    keep = torch.get_rng_state()
    try:
        for _, fn, (rest, kwargs), state in ops:
            if state is not None:
                torch.set_rng_state(state)
            fn(full, *rest, **kwargs)
    finally:
        torch.set_rng_state(keep)  # the replay leaves the generator as the build left it
    return full


@torch.no_grad()
def materialize(model, device) -> None:
    """Real memory for every tensor of a meta-built model (after sharding: only this process's shards), filled with
    the values the one-process build would have given them. Parameters and buffers without a recorded
    initialisation stay uninitialised: refused by name."""
    ops = getattr(model, "_labkit_init", None)
    if ops is None:
        raise ValueError("this model is on the meta device but was not built by labkit.meta_init.build")
    model.to_empty(device=device)
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    done: set = set()
    for name, t in named:
        if name not in ops or not ops[name]:
            raise ValueError(f"meta-device build: nothing initialised {name} in the model's constructor")
        if id(t) in done:  # a tied weight: filled once
            continue
        done.add(id(t))
        full = _replay(name, t.shape, t.dtype, ops[name])
        if hasattr(t, "device_mesh"):  # a DTensor: this process's part of the whole, as DTensor splits it
            from torch.distributed.tensor import distribute_tensor

            local = distribute_tensor(full.to(t.device), t.device_mesh, t.placements, src_data_rank=None).to_local()
            t.to_local().copy_(local)
        else:
            t.copy_(full)
        del full
    del model._labkit_init
