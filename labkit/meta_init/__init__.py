"""A model too big for one device: built on the meta device, sharded, then each shard filled with the values a
one-process build would have given it, or refused by name.

    model = labkit.meta_init.build(lambda: GPT(cfg), seed=0)     # no weight memory yet: every tensor on "meta"
    opt = adamw(model, 3e-4)                                      # the optimizer may be built on it (no state yet)
    trainer = labkit.Trainer(model, opt, rt, TrainConfig(parallel="fsdp2"), ...)   # shards, then fills the shards

Why: built the ordinary way, every process first holds the whole model (on the CPU, then moved whole to its device)
and only then shards it: a model whose float32 weights do not fit one device cannot be built, and 8 processes hold
8 whole CPU copies. torchtitan builds on the meta device, shards, then `to_empty` + `init_weights()` on the shards;
its values then differ from a one-process build of the same seed. labkit keeps them equal, so a run under fsdp2
and a replicate or one-process run of the same seed train alike (tests/test_fsdp_trainer.py compares their losses):

1. `build` constructs the model under torch.manual_seed(seed) on the meta device and records every op that makes
   or writes a meta tensor. Which tensors an op writes comes from its schema (`Tensor(a!)`: in-place ops and
   `out=` ones such as `torch.eye(..., out=w)`, which nn.init.eye_ runs), not from its name. Each storage keeps
   its own history, from the op that made it: a freed storage's history dies with it. An op that overwrites a
   whole storage without reading it (zero_, fill_, an out= write) starts that storage's history anew.
2. A random op (torch's `nondeterministic_seeded` tag: randn, randint, randperm, uniform_, dropout, ...) keeps the
   CPU generator's state, and also runs once on the CPU, on CPU copies of its inputs. So the generator advances
   exactly as in a CPU build, even for a random tensor that only helps build another one. Those copies cost one
   tensor at a time, freed at once.
3. `materialize(model, device)`, after sharding, gives every tensor real memory (`to_empty`) and replays its
   history on the CPU, one tensor at a time. Each process cuts its own shard on the CPU (DTensor's split, any
   mesh) and copies only that shard to its device. Peak memory per process: its shards plus one whole tensor.

The cost: recording runs every op on the meta device (no values) and every random op once more on the CPU (so the
generator advances as a CPU build's); each process then replays what its tensors need, once. Measured on ResNet-50
(23.5 M weights), one CPU thread, a 2-core host at load 5-6: CPU build 0.6-0.8 s, record 1.0 s, whole replay 0.4 s.

Refused by name:
- while building, a random op whose inputs the recorder cannot reproduce, or one given its own torch.Generator:
  the CPU generator could not advance as in a CPU build;
- in materialize, before any memory is given: a tensor built from values the recorder never saw (`torch.tensor`
  of a literal, a tensor made before build()), a tensor nothing initialised (`torch.empty` never written), a
  tensor written together with others by one op, a tensor written in place after build() outside the recorder
  (its version counter moved), a Parameter replaced after build() (`module.weight = nn.Parameter(...)`) and a
  storage replaced (`w.data = t`). A weight tied after build() to another built one (`head.weight = emb.weight`)
  is not refused: it takes that one's values, as after a CPU build.

Not seen, so not refused: a write through `.data` (`w.data.normal_()`, `nn.init.ones_(w.data)`, Hugging Face's
`_init_weights` idiom). `.data` is a tensor with a version counter of its own, so nothing records that it was
written, and materialize puts the constructor's values back. Run such an initialisation as `record(model, fn)`.

An initialisation after build() either runs under the recorder, `record(model, fn)`, with the same parity, or is
given as `build(..., init_fn=fn)`. fn(model) then runs on the materialized shards, after the replay (torchtitan's
`init_weights` path), and must write every tensor the constructor left uninitialised. init_fn has no one-process
parity: under fsdp2 each process draws its shard's random numbers itself, so the values differ from a CPU build
followed by fn (tests/test_meta_init.py shows it on 3 shards).
"""

from __future__ import annotations

import torch

from labkit.meta_init.recorder import Unreplayable, _arg, _Recorder, _Ref, _why

__all__ = ["Unreplayable", "build", "check", "is_meta", "materialize", "record"]


class _Init:
    """What build() recorded: the recorder, and per parameter or buffer its history, view, version and refusal."""

    def __init__(self, recorder: _Recorder, init_fn):
        self.recorder, self.init_fn, self.entries = recorder, init_fn, {}

    def snapshot(self, model) -> None:
        seen: dict = {}
        self.entries = {}
        for name, t in _named(model):
            rec = self.recorder.rec_of(t)
            self.entries[name] = (t, _Ref(t, rec), t._version, _why(rec, len(rec.ops), seen))
        # each recorded tensor's storage, to tell a `w.data = t` after build() (the same Parameter, new storage)
        self.storages = {id(t): t.untyped_storage()._cdata for t, *_ in self.entries.values()}


def _named(model) -> list:
    return list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))


def build(make, seed: int = 0, init_fn=None):
    """`make()` run on the meta device under torch.manual_seed(seed), its initialisation recorded for materialize.
    The CPU generator ends where a CPU build would leave it. init_fn(model), if given, runs on the materialized
    (sharded) model after the replay: torchtitan's init_weights path, without one-process parity."""
    torch.manual_seed(seed)
    rec = _Recorder()
    with torch.device("meta"), rec:
        model = make()
    model._labkit_init = _Init(rec, init_fn)
    model._labkit_init.snapshot(model)
    return model


def record(model, fn):
    """fn(model) run under the recorder of a meta-built model (an initialisation after build()): replayed by
    materialize with the values a CPU build followed by fn(model) would have."""
    init = _init_of(model)
    with torch.device("meta"), init.recorder:
        fn(model)
    init.snapshot(model)
    return model


def is_meta(model) -> bool:
    return any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


def _init_of(model) -> _Init:
    init = getattr(model, "_labkit_init", None)
    if not isinstance(init, _Init):
        raise ValueError("this model is on the meta device but was not built by labkit.meta_init.build")
    return init


def _refusal(name: str, why: str) -> ValueError:
    return Unreplayable(
        f"meta-device build: {name} {why}; labkit.meta_init cannot give it the values of a CPU build: build this "
        "model on the CPU (and load its weights), or pass the initialisation as build(..., init_fn=fn)"
    )


def _local_part(full: torch.Tensor, mesh, placements) -> torch.Tensor:
    """This process's part of a whole CPU tensor, as DTensor splits it (torch.chunk along each Shard, in mesh order)."""
    from torch.distributed.tensor import Replicate, Shard

    coord, part = mesh.get_coordinate(), full
    for i, p in enumerate(placements):
        if type(p) is Replicate:
            continue
        if type(p) is not Shard:
            raise ValueError(f"meta-device build: placement {p} is not a plain Shard or Replicate")
        chunks = torch.chunk(part, mesh.size(i), dim=p.dim)
        part = chunks[coord[i]] if coord[i] < len(chunks) else part.narrow(p.dim, 0, 0)
    return part


def check(model) -> dict:
    """Refuse by name, before any memory is given, what materialize could not fill as a CPU build would; returns
    {name: the name its tensor was recorded under} (a weight tied after build() is filled from the one it is tied
    to). materialize calls it; a plan that replaces the Parameters (fully_shard) calls it first, while the model's
    tensors are still the ones build() recorded."""
    init = _init_of(model)
    owner: dict = {}
    for name, (t0, *_) in init.entries.items():
        owner.setdefault(id(t0), name)
    sources = {}
    for name, t in _named(model):
        if name not in init.entries:
            raise ValueError(f"meta-device build: {name} was added to the model after build()")
        sharded = hasattr(t, "device_mesh")  # fully_shard's DTensor in the recorded one's slot (checked before it)
        src = name if sharded else owner.get(id(t))
        if src is None:
            raise ValueError(
                f"meta-device build: {name} was replaced after build() by a tensor no recorder saw (`module.<name> = "
                "nn.Parameter(...)`): make it inside the function given to build(), or write the one there with "
                "meta_init.record(model, fn)"
            )
        t0, _, version, why = init.entries[src]
        if not sharded and t0.untyped_storage()._cdata != init.storages[id(t0)]:
            raise ValueError(
                f"meta-device build: {name}'s storage was replaced after build() (`{name}.data = t`), where no "
                "recorder saw it: write its values in place under meta_init.record(model, fn) instead"
            )
        if t0._version != version:
            raise ValueError(
                f"meta-device build: {name} was written in place after build(), where no recorder saw it: run that "
                "initialisation as meta_init.record(model, fn), or pass it as build(..., init_fn=fn)"
            )
        if why is not None and init.init_fn is None:
            raise _refusal(name, why)
        sources[name] = src
    return sources


@torch.no_grad()
def materialize(model, device) -> None:
    """Real memory for every tensor of a meta-built model (after sharding: only this process's shards), filled with
    the values the one-process build would have given them, then init_fn if build() was given one. What cannot be
    replayed is refused by name before any memory is given (check).

    `to_empty` runs with torch.__future__.set_swap_module_params_on_conversion(True): each Parameter object keeps
    its identity and takes the new memory (torch.utils.swap_tensors). Without it, to_empty makes a new Parameter per
    module slot, so a tied weight (`head.weight = emb.weight`) became two matrices, and an optimizer built before
    held neither the head's nor, after the plan's re-pointing by name, more than one of them."""
    init = _init_of(model)
    sources = check(model)
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    keep, done, left = torch.get_rng_state(), set(), {}
    try:
        for name, t in _named(model):
            src = sources[name]
            _, ref, _, why = init.entries[src]
            if id(t) in done:  # a tied weight: filled once
                continue
            done.add(id(t))
            if why is not None:  # init_fn's to fill
                left[name] = (t, t._version, why)
                continue
            try:
                full = _arg(ref, None, None, {})
            except Unreplayable as e:
                raise _refusal(name, str(e)) from None
            if tuple(full.shape) != tuple(t.shape):
                raise ValueError(f"meta-device build: {name} is {tuple(t.shape)} now, {tuple(full.shape)} when built")
            if full.dtype != t.dtype:  # a model cast after build (.to(bfloat16)): rounded as a CPU build's cast rounds
                full = full.to(t.dtype)
            if hasattr(t, "device_mesh"):  # a DTensor: this process's part, cut on the CPU, only it moved
                dst, part = t.to_local(), _local_part(full, t.device_mesh, t.placements)
            else:
                dst, part = t, full
            if dst.shape != part.shape:
                raise ValueError(f"meta-device build: {name}'s shard is {tuple(dst.shape)}, not {tuple(part.shape)}")
            dst.copy_(part)
            del full, part
    finally:
        torch.set_rng_state(keep)  # the replay leaves the generator as the build left it
    if init.init_fn is not None:
        init.init_fn(model)
    for name, (t, version, why) in left.items():
        if t._version == version:
            raise _refusal(name, f"{why}, and init_fn did not write it either")
    del model._labkit_init
