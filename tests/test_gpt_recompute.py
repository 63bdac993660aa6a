"""GPTConfig.recompute: activation recomputation gives the same losses and gradients, and keeps only each block's
input for the backward pass (measured with saved_tensors_hooks, as notebook 02 does)."""

import functools

import pytest
import torch

import labkit
from labkit.accumulate import to_host
from labkit.models.gpt import GPT, GPTConfig

SHAPE = {"block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32}


@pytest.fixture(autouse=True, scope="module")
def _xla_first():
    labkit.setup("xla-cpu")  # XLA's devices start before any backward in this process (labkit.device says why)


def _loss_and_grads(cfg, x, device="cpu", recompute_fn=None):
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    if recompute_fn is not None:
        model.recompute_fn = recompute_fn
    torch.manual_seed(1)  # the dropout masks
    _, loss = model(x.to(device), x.to(device))
    loss.backward()
    names = [n for n, _ in model.named_parameters()]
    # one graph, one transfer (a .cpu() per lazy tensor would compile a graph for each)
    host = to_host([loss.detach()] + [p.grad for p in model.parameters()])
    return host[0], dict(zip(names, host[1:]))


def _saved_bytes(model, x):
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, x)
    return sum(kept.values())


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_recompute_gives_the_same_loss_and_gradients(dropout):
    x = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(2))
    loss, grads = _loss_and_grads(GPTConfig(**SHAPE, dropout=dropout), x)
    loss_r, grads_r = _loss_and_grads(GPTConfig(**SHAPE, dropout=dropout, recompute=True), x)
    torch.testing.assert_close(loss_r, loss, rtol=0, atol=0)  # the same forward: the same bits
    for name, g in grads.items():  # the recomputed forward replays the dropout masks (torch saves the RNG state)
        torch.testing.assert_close(grads_r[name], g, rtol=1e-6, atol=1e-7, msg=name)


def test_recompute_keeps_only_each_blocks_input():
    L, d, V, B, T = 3, 32, 256, 4, 16
    x = torch.randint(0, V, (B, T))
    cfg = GPTConfig(block_size=T, n_layer=L, n_head=2, n_embd=d)
    torch.manual_seed(0)
    full, kept = _saved_bytes(GPT(cfg), x), _saved_bytes(GPT(GPTConfig(**{**cfg.__dict__, "recompute": True})), x)
    assert abs(full - 4 * B * T * (16 * L * d + 2 * d + V)) <= 0.03 * full  # notebook 02's rule
    assert abs(kept - 4 * B * T * (L * d + 2 * d + V)) <= 0.03 * kept  # with recompute: d per block
    # not in evaluation, nor without gradients: nothing to recompute for
    model = GPT(GPTConfig(**{**cfg.__dict__, "recompute": True})).eval()
    assert _saved_bytes(model, x) == full


def test_recompute_on_xla_with_torch_xlas_checkpoint():
    """On XLA the model takes torch_xla's checkpoint (the one with an optimization barrier): same gradients."""
    from torch_xla.utils.checkpoint import checkpoint

    rt = labkit.setup("xla-cpu")
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    cfg = GPTConfig(**{**SHAPE, "n_layer": 1})
    loss, grads = _loss_and_grads(cfg, x)
    xla_fn = functools.partial(checkpoint, use_reentrant=True)
    loss_x, grads_x = _loss_and_grads(GPTConfig(**{**cfg.__dict__, "recompute": True}), x, rt.device, xla_fn)
    torch.testing.assert_close(loss_x, loss, rtol=1e-5, atol=1e-5)
    for name, g in grads.items():
        torch.testing.assert_close(grads_x[name], g, rtol=1e-4, atol=1e-5, msg=name)
