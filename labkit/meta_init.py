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

The cost: the initialisation runs 1 + (processes) times over (once to record, once per process to replay).
Measured on ResNet-50 (23.5 M weights), one CPU core: CPU build 0.8 s, record 1.4-1.8 s, whole replay 0.6-0.8 s.

Refused by name:
- while building, a random op whose inputs the recorder cannot reproduce, or one given its own torch.Generator:
  the CPU generator could not advance as in a CPU build;
- in materialize, before any memory is given: a tensor built from values the recorder never saw (`torch.tensor`
  of a literal, a tensor made before build()), a tensor nothing initialised (`torch.empty` never written), a
  tensor written together with others by one op, and a tensor written in place after build() outside the
  recorder (its version counter moved).

An initialisation after build() either runs under the recorder, `record(model, fn)`, with the same parity, or is
given as `build(..., init_fn=fn)`. fn(model) then runs on the materialized shards, after the replay (torchtitan's
`init_weights` path), and must write every tensor the constructor left uninitialised. init_fn has no one-process
parity: under fsdp2 each process draws its shard's random numbers itself, so the values differ from a CPU build
followed by fn (tests/test_meta_init.py shows it on 3 shards).
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

aten = torch.ops.aten
# constructors that leave memory as they found it: a tensor made by one of these and never written is uninitialised
_EMPTY = {aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty, aten.new_empty_strided}
# ops that read a tensor's shape, dtype and layout only, never its values
_SHAPE_ONLY = _EMPTY | {aten.zeros_like, aten.ones_like, aten.full_like, aten.rand_like, aten.randn_like}
_SHAPE_ONLY |= {aten.randint_like, aten.new_zeros, aten.new_ones, aten.new_full}
# in-place ops that overwrite every element they write without reading it (an out= argument is write-only too)
_OVERWRITE = {aten.zero_, aten.fill_, aten.copy_, aten.uniform_, aten.normal_, aten.random_, aten.bernoulli_}
_OVERWRITE |= {aten.exponential_, aten.geometric_, aten.log_normal_, aten.cauchy_}
_UNSEEN = "was made where labkit.meta_init could not see it (torch.tensor of a literal, or before build())"


class Unreplayable(ValueError):
    """A value the meta build cannot reproduce: the message names the op and, once known, the tensor."""


class _Op:
    __slots__ = ("func", "args", "kwargs", "index", "state", "why")

    def __init__(self, func=None, args=(), kwargs=None, index=None, state=None, why=None):
        self.func, self.args, self.kwargs, self.index, self.state, self.why = func, args, kwargs, index, state, why


class _Rec:
    """One storage's history, from the op that made it. Held through a weak reference to the storage: an address
    freed and handed to a later tensor starts a new history."""

    def __init__(self, storage, first: _Op):
        self.ref = StorageWeakRef(storage)
        self.ops = [first]


class _Ref:
    """A meta tensor read or written by a recorded op: its storage's history up to that op, and its view of it."""

    __slots__ = ("rec", "n", "size", "stride", "offset", "dtype")

    def __init__(self, t, rec: _Rec):
        self.rec, self.n, self.dtype = rec, len(rec.ops), t.dtype
        self.size, self.stride, self.offset = tuple(t.shape), t.stride(), t.storage_offset()


class _Like:
    """A meta tensor read for its shape, dtype and layout only (new_empty, zeros_like, ...)."""

    __slots__ = ("size", "stride", "dtype")

    def __init__(self, t):
        self.size, self.stride, self.dtype = tuple(t.shape), t.stride(), t.dtype


def _metas(tree) -> list:
    return [a for a in tree_flatten(tree)[0] if isinstance(a, torch.Tensor) and a.is_meta]


def _name(func) -> str:
    return str(func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else func)


class _Recorder(TorchDispatchMode):
    """Every op that makes or writes a meta tensor, kept in the history of the storage it makes or writes."""

    def __init__(self):
        super().__init__()
        self.recs: dict = {}  # storage address -> the history of the live storage there

    def rec_of(self, t) -> _Rec:
        s = t.untyped_storage()
        rec = self.recs.get(s._cdata)
        if rec is None or rec.ref.expired():
            rec = self.recs[s._cdata] = _Rec(s, _Op(why=_UNSEEN))
        return rec

    def _convert(self, func, tree):
        like = func.overloadpacket in _SHAPE_ONLY

        def one(a):
            if isinstance(a, torch.Tensor):
                if not a.is_meta:
                    return a.detach().clone()  # a CPU value (a copy_ source, an index): kept as it is now
                return _Like(a) if like else _Ref(a, self.rec_of(a))
            if isinstance(a, torch.device) and a.type == "meta":
                return torch.device("cpu")
            if isinstance(a, torch.Generator):
                raise Unreplayable(f"meta-device build: {_name(func)} was given its own torch.Generator, which "
                                   "labkit.meta_init cannot advance as a CPU build would: use the global generator")  # fmt: skip
            return a

        return tree_map(one, tree)

    @staticmethod
    def _overwrites(func, args, kwargs, w) -> bool:
        """Whether the op writes every byte of w's storage without reading it: an out= argument, or w in place by
        an op that reads nothing of it (BatchNorm's torch.tensor(0) never seen, then zero_())."""
        s = w.untyped_storage()
        whole = w.is_contiguous() and w.storage_offset() == 0 and w.numel() * w.element_size() == s.nbytes()
        others = [t for t in _metas((args, kwargs)) if t is not w]
        if not whole or any(t.untyped_storage()._cdata == s._cdata for t in others):
            return False
        out = any(a.kwarg_only and a.alias_info.is_write and kwargs.get(a.name) is w
                  for a in func._schema.arguments if a.alias_info is not None)  # fmt: skip
        return out or (len(args) > 0 and args[0] is w and func.overloadpacket in _OVERWRITE)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ins = _metas((args, kwargs))
        devices = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.device)]
        if not ins and not any(d.type == "meta" for d in devices):
            return func(*args, **kwargs)  # nothing on meta: runs (and draws) as in a CPU build
        random = torch.Tag.nondeterministic_seeded in func.tags
        state = torch.get_rng_state() if random else None
        written = [t for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write
                   for t in _metas(args[i] if i < len(args) else kwargs.get(a.name))]  # fmt: skip
        if len(written) == 1 and self._overwrites(func, args, kwargs, written[0]):  # a new history: the old one is moot
            w, s = written[0], written[0].untyped_storage()
            self.recs[s._cdata] = _Rec(s, _Op(aten.empty_strided.default, (w.shape, w.stride()), {"dtype": w.dtype}))
        cargs, ckwargs = self._convert(func, (args, kwargs))
        out = func(*args, **kwargs)
        op = _Op(func, cargs, ckwargs, None, state)
        if len(written) > 1:
            for t in written:
                self.rec_of(t).ops.append(_Op(why=f"{_name(func)} wrote it together with other tensors"))
        elif written:
            self.rec_of(written[0]).ops.append(op)
        outs = [out] if isinstance(out, torch.Tensor) else list(out) if isinstance(out, (tuple, list)) else []
        read = {t.untyped_storage()._cdata for t in ins}
        returns = func._schema.returns
        for i, o in enumerate(outs):
            ret = returns[i] if len(returns) > 1 else returns[0] if returns else None  # one Tensor[] return: each
            fresh = ret is not None and ret.alias_info is None
            if isinstance(o, torch.Tensor) and o.is_meta and fresh and o.untyped_storage()._cdata not in read:
                s = o.untyped_storage()
                index = None if isinstance(out, torch.Tensor) else i
                self.recs[s._cdata] = _Rec(s, _Op(func, cargs, ckwargs, index, state))
        if random:  # the CPU generator advanced as a CPU build advances it: the op run once on CPU copies
            try:
                a, k = tree_map(lambda x: _arg(x, None, None, {}), (cargs, ckwargs))
            except Unreplayable as e:
                raise Unreplayable(
                    f"meta-device build: {_name(func)} draws random numbers from a tensor that {e}, so the CPU "
                    "generator cannot advance as in a CPU build: build this model on the CPU"
                ) from None
            torch.set_rng_state(state)
            func(*a, **k)
        return out


def _arg(x, rec, base, cache):
    """A recorded argument's CPU value: the tensor being rebuilt (a view of `base`), another storage's replay, an
    empty tensor of a shape-only read, or the argument itself."""
    if isinstance(x, _Ref):
        src = base if x.rec is rec else _value(x.rec, x.n, cache)
        if src.dtype != x.dtype:
            raise Unreplayable(f"was read as {x.dtype} from a storage of {src.dtype}")
        return src.as_strided(x.size, x.stride, x.offset)
    if isinstance(x, _Like):
        return torch.empty_strided(x.size, x.stride, dtype=x.dtype)
    return x


def _value(rec: _Rec, n: int, cache: dict) -> torch.Tensor:
    """The storage's contents after its first n ops, rebuilt on the CPU (a tensor whose storage is that storage)."""
    key = (id(rec), n)
    if key not in cache:
        base = None
        for op in rec.ops[:n]:
            if op.why is not None:
                raise Unreplayable(op.why)
            a, k = tree_map(lambda x, b=base: _arg(x, rec, b, cache), (op.args, op.kwargs))
            if op.state is not None:
                torch.set_rng_state(op.state)
            out = op.func(*a, **k)
            if base is None:
                base = out if op.index is None else out[op.index]
        cache[key] = base
    return cache[key]


def _why(rec: _Rec, n: int, seen: dict) -> str | None:
    """Why the storage's first n ops cannot be replayed (None: they can), found without running them."""
    key = (id(rec), n)
    if key not in seen:
        seen[key] = None
        for op in rec.ops[:n]:
            if op.why is not None:
                seen[key] = op.why
                break
            for x in tree_flatten((op.args, op.kwargs))[0]:
                if isinstance(x, _Ref) and x.rec is not rec and (why := _why(x.rec, x.n, seen)):
                    seen[key] = f"was computed by {_name(op.func)} from a tensor that {why}"
                    break
            if seen[key]:
                break
        else:
            if len(rec.ops[:n]) == 1 and rec.ops[0].func.overloadpacket in _EMPTY:
                seen[key] = "was made by an empty constructor and nothing initialised it"
    return seen[key]


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


@torch.no_grad()
def materialize(model, device) -> None:
    """Real memory for every tensor of a meta-built model (after sharding: only this process's shards), filled with
    the values the one-process build would have given them, then init_fn if build() was given one. What cannot be
    replayed is refused by name before any memory is given."""
    init = _init_of(model)
    named = _named(model)
    for name, _ in named:
        if name not in init.entries:
            raise ValueError(f"meta-device build: {name} was added to the model after build()")
        t0, _, version, why = init.entries[name]
        if t0._version != version:
            raise ValueError(
                f"meta-device build: {name} was written in place after build(), where no recorder saw it: run that "
                "initialisation as meta_init.record(model, fn), or pass it as build(..., init_fn=fn)"
            )
        if why is not None and init.init_fn is None:
            raise _refusal(name, why)
    model.to_empty(device=device)
    keep, done, left = torch.get_rng_state(), set(), {}
    try:
        for name, t in _named(model):
            _, ref, _, why = init.entries[name]
            if id(t) in done:  # a tied weight: filled once
                continue
            done.add(id(t))
            if why is not None:  # init_fn's to fill
                left[name] = (t, t._version)
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
    for name, (t, version) in left.items():
        if t._version == version:
            raise _refusal(name, f"{init.entries[name][3]}, and init_fn did not write it either")
    del model._labkit_init
