"""Optimizer and model states across plans: by parameter position (torch's optimizer.state_dict(), a one-file
checkpoint) or by parameter name (torch.distributed.checkpoint's get_optimizer_state_dict, a DCP checkpoint of an
FSDP2 run), turned into whichever the plan loads; and whether a state holds whole tensors or DTensor shards.

    state = optimizer_by_name(state, module, optimizer)   # a one-file checkpoint's optimizer state, for FSDP2
"""

from __future__ import annotations


def _param_names(module, optimizer) -> list:
    """The optimizer's parameters in its own order (param_groups, as optimizer.state_dict() numbers them), each by
    the module's name for it."""
    names = {id(p): n for n, p in module.named_parameters()}
    return [names.get(id(p), str(i)) for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])]


def _renumber(state: dict, key) -> dict:
    groups = [dict(g, params=[key(p) for p in g["params"]]) for g in state.get("param_groups", [])]
    return {**state, "state": {key(k): v for k, v in state.get("state", {}).items()}, "param_groups": groups}


def optimizer_by_name(state: dict, module, optimizer) -> dict:
    """An optimizer state keyed by parameter position (torch's optimizer.state_dict(), a one-file checkpoint) turned
    into the form keyed by parameter name that torch.distributed.checkpoint's set_optimizer_state_dict reads; a
    state already keyed by name is returned as it is."""
    params = [p for g in state.get("param_groups", []) for p in g["params"]]
    if not params or not all(isinstance(p, int) for p in params):
        return state
    names = _param_names(module, optimizer)
    return _renumber(state, lambda i: names[i])


def optimizer_by_id(state: dict, module, optimizer) -> dict:
    """The other way: a state keyed by parameter name (a DCP checkpoint of an FSDP2 run) into the positions
    optimizer.load_state_dict reads; a state already keyed by position is returned as it is."""
    params = [p for g in state.get("param_groups", []) for p in g["params"]]
    if not params or not all(isinstance(p, str) for p in params):
        return state
    where = {n: i for i, n in enumerate(_param_names(module, optimizer))}
    unknown = sorted(set(params) - set(where))
    if unknown:
        raise ValueError(f"the checkpoint's optimizer state names parameters this model lacks: {unknown[:3]}")
    return _renumber(state, lambda n: where[n])


def _plain(state: dict) -> bool:
    """Whether a model or optimizer state holds whole tensors only (a one-file checkpoint), no DTensor shard."""
    from torch.distributed.tensor import DTensor

    stack = [state]
    while stack:
        v = stack.pop()
        if isinstance(v, DTensor):
            return False
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return True
