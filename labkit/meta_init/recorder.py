"""How labkit.meta_init records a meta-device build: a dispatch mode that keeps, per storage, the ops that made
and wrote it, and rebuilds any storage's contents on the CPU from them (labkit/meta_init/__init__.py says why)."""

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
