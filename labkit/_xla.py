"""The private torch_xla calls labkit makes, in one place: what each does and where it was checked.

    from labkit import _xla
    host = _xla.to_cpu([loss_a, loss_b])          # one device->host transfer for the whole list

torch_xla's public API lacks a few things labkit needs; the underscore functions below fill the gaps.
They may change in any release, so nothing else in labkit touches torch_xla's private names: when an
upgrade breaks one, this file is the one to fix (and the table says what to re-check).

| function here                 | private call                                         | checked on       | what it does
|-------------------------------|------------------------------------------------------|------------------|--------------------------------
| to_cpu(tensors)               | torch_xla.core.xla_model._maybe_convert_to_cpu       | torch_xla 2.8,2.9| copies a list of XLA tensors to the host in ONE TransferFromDevice (a `.cpu()` per tensor is one each)
| computation_cache_started()   | torch_xla._XLAC._xla_computation_cache_is_initialized| torch_xla 2.8,2.9| True once XLA ran a computation: too late to turn on the persistent compile cache
| sharding_spec(t)              | torch_xla._XLAC._get_xla_sharding_spec               | torch_xla 2.8,2.9| a tensor's sharding as HLO text ("{devices=[4,1]0,1,2,3}", "" when unsharded)
| copy_sharding(dst, like)      | torch_xla._XLAC._xla_mark_sharding + _get_xla_op_sharding | torch_xla 2.8,2.9| gives `dst` the very OpSharding of `like` (xs.mark_sharding needs a mesh and a partition spec)
| trace_span(name)              | torch_xla._XLAC.profiler.TraceMe                     | torch_xla 2.8,2.9| a named span in the XLA profiler's host trace (xp.Trace adds Python overhead per call)
| pending_graph_text(tensors)   | torch_xla._XLAC._get_xla_tensors_text                | torch_xla 2.8,2.9| the IR of tensors not executed yet (tests use it to prove a graph is still pending)
| split_over_devices(t)         | torch_xla.experimental.distributed_checkpoint._helpers._is_sharded_tensor | torch_xla 2.9 | True for a tensor split over devices (not replicated): the sharded checkpoint format's test
| cpu_shards(tensors)           | ..._helpers._cpu_shards_from_tensors                 | torch_xla 2.9    | this host's pieces of split tensors, with their offsets (what torch_xla's own async save stages)
| cpu_tensors(tensors)          | torch_xla._XLAC._xla_get_cpu_tensors                 | torch_xla 2.9    | unsplit XLA tensors copied to new CPU tensors in one transfer
| quiet_jax_notice()            | (a logging filter on torch_xla._internal.jax_workarounds' notice) | torch_xla 2.8 | drops "You are trying to use a feature that requires jax/pallas", logged at every traced op where jax is absent
"""

from __future__ import annotations


def to_cpu(tensors: list) -> list:
    import torch_xla.core.xla_model as xm

    return xm._maybe_convert_to_cpu(list(tensors))


def computation_cache_started() -> bool:
    import torch_xla

    return bool(torch_xla._XLAC._xla_computation_cache_is_initialized())


def sharding_spec(t) -> str:
    import torch_xla

    return torch_xla._XLAC._get_xla_sharding_spec(t)


def copy_sharding(dst, like) -> None:
    import torch_xla

    torch_xla._XLAC._xla_mark_sharding(dst, torch_xla._XLAC._get_xla_op_sharding(like))


def trace_span(name: str):
    """A context manager: the span shows in the captured trace under `name`."""
    import torch_xla

    return torch_xla._XLAC.profiler.TraceMe(name)


def pending_graph_text(tensors: list) -> str:
    import torch_xla

    return torch_xla._XLAC._get_xla_tensors_text(list(tensors))


def split_over_devices(t) -> bool:
    import torch_xla.distributed.spmd as xs
    from torch_xla.experimental.distributed_checkpoint._helpers import _is_sharded_tensor

    return _is_sharded_tensor(xs.wrap_if_sharded(t))


def cpu_shards(tensors: list) -> list:
    from torch_xla.experimental.distributed_checkpoint._helpers import _cpu_shards_from_tensors

    return _cpu_shards_from_tensors(list(tensors))


def cpu_tensors(tensors: list) -> list:
    import torch_xla

    return torch_xla._XLAC._xla_get_cpu_tensors(list(tensors))


class _JaxNotice:
    """torch_xla 2.8's maybe_get_jax() logs this warning on the root logger at every call, and its graph
    builder calls it per traced op when jax is not installed: hundreds of identical lines per notebook
    (Kaggle's image), none of which concerns labkit, which uses no jax/pallas feature."""

    def filter(self, record) -> bool:
        return "requires jax/pallas" not in str(record.msg)


def quiet_jax_notice() -> None:
    import logging

    root = logging.getLogger()
    if not any(isinstance(f, _JaxNotice) for f in root.filters):
        root.addFilter(_JaxNotice())
