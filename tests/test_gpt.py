"""The byte-level GPT, its generation on XLA, FLOP counts, MFU, and the text batches."""

import math

import pytest
import torch

import labkit
from data_tools import text
from labkit.dashboard import flops
from labkit.dashboard.health import compile_count
from labkit.models import gpt
from labkit.models.gpt import GPT, GPTConfig, bits_per_byte


@pytest.fixture(autouse=True, scope="module")
def xla_first():
    """Start the XLA device before any backward pass: autograd sizes its per-device queues at its
    first backward, and an XLA backward after that fails inside the engine."""
    labkit.setup("xla-cpu")


TINY = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)


def tiny(seed=0, spread=0.0, cfg=TINY):
    torch.manual_seed(seed)
    m = GPT(cfg)
    if spread:  # well-separated logits: greedy picks cannot flip on float rounding
        torch.nn.init.normal_(m.wte.weight, std=spread)
    return m.eval()


def naive_greedy(model, idx, n):
    """The textbook loop: crop to the window, run, take the last position's argmax, append."""
    for _ in range(n):
        logits, _ = model(idx[:, -model.cfg.block_size :])
        idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return idx[:, -n:]


def test_shapes_and_initial_loss_near_uniform():
    m = tiny()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 256, (4, 16), generator=g), torch.randint(0, 256, (4, 16), generator=g)
    logits, loss = m(x, y)
    assert logits.shape == (4, 16, 256) and loss.dim() == 0
    assert abs(loss.item() - math.log(256)) < 0.1, loss.item()  # small init: ~uniform predictions
    assert m(x[:, :5])[0].shape == (4, 5, 256) and m(x)[1] is None
    with pytest.raises(ValueError, match="block_size=16"):
        m(torch.zeros(1, 17, dtype=torch.long))
    assert bits_per_byte(math.log(256)) == pytest.approx(8.0)


def test_causal_future_tokens_do_not_change_earlier_logits():
    m = tiny()
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    x2 = x.clone()
    x2[:, 9] = (x2[:, 9] + 1) % 256
    a, b = m(x)[0], m(x2)[0]
    torch.testing.assert_close(a[:, :9], b[:, :9])
    assert (a[:, 9:] - b[:, 9:]).abs().amax(-1).min() > 0  # every later position sees the change


def test_weight_tying_and_parameter_count():
    cfg = TINY
    m = tiny()
    d, L, V, T = cfg.n_embd, cfg.n_layer, cfg.vocab_size, cfg.block_size
    assert [n for n, p in m.named_parameters() if p.shape == (V, d)] == ["wte.weight"]  # one matrix
    h = torch.randn(3, d)
    torch.testing.assert_close(m.lm_head(h), h @ m.wte.weight.T)
    # by hand: per block 2 LayerNorms (2d each), qkv (3d*d + 3d), proj (d*d + d), fc (4d*d + 4d), proj (4d*d + d)
    per_block = 4 * d + 3 * d * d + 3 * d + d * d + d + 4 * d * d + 4 * d + 4 * d * d + d
    total = V * d + T * d + L * per_block + 2 * d
    assert m.num_params(non_embedding=False) == total == sum(p.numel() for p in m.parameters())
    assert m.num_params() == total - T * d
    # the output gradient reaches the embedding (it is the same tensor)
    x = torch.randint(0, 256, (2, 8))
    m.train()
    m(x, x)[1].backward()
    untouched = torch.ones(V, dtype=torch.bool)
    untouched[x.unique()] = False  # rows not used as inputs get gradient only through the head
    assert m.wte.weight.grad[untouched].abs().sum() > 0


def test_flops_per_token_matches_hand_count():
    cfg = TINY
    m = tiny()
    d, L, V, T = cfg.n_embd, cfg.n_layer, cfg.vocab_size, cfg.block_size
    # matmuls per token, forward: qkv 3d^2, proj d^2, mlp 8d^2 multiply-adds per layer, head d*V;
    # attention scores QK^T and weights x V: T*d multiply-adds each per layer. 2 FLOPs per
    # multiply-add, and backward costs twice the forward.
    fwd = 2 * (L * 12 * d * d + d * V) + 2 * L * 2 * T * d
    hand = 3 * fwd
    got = m.flops_per_token()
    assert got == 6 * m.num_params() + 12 * L * T * d
    assert abs(got - hand) / hand < 0.03, (got, hand)  # the rest: biases and LayerNorms, counted in 6N
    assert m.flops_per_token(seq_len=8) < got


def test_mfu_and_peak_lookup(monkeypatch):
    assert flops.mfu(2e12, 0.5, 8e12) == pytest.approx(0.5)
    assert flops.mfu(2e12, 0.5, None) is None
    assert flops.lookup("TPU v5 lite") == ("TPU v5e", 197e12)
    assert flops.lookup("v5p-8")[1] == 459e12 and flops.lookup("v6e-8")[1] == 918e12
    assert flops.lookup("TPU v4")[1] == 275e12 and flops.lookup("NVIDIA H100 80GB HBM3")[1] == 989e12
    assert flops.lookup("NVIDIA L40S") is None and flops.lookup("cpu") is None
    rt = labkit.setup("cpu")
    peak, source = flops.peak_flops(rt)
    assert peak > 1e8 and "measured" in source
    monkeypatch.setenv("LABKIT_PEAK_FLOPS", "1.5e14")
    assert flops.peak_flops(rt) == (1.5e14, "LABKIT_PEAK_FLOPS")


def test_greedy_generate_matches_naive_loop_on_cpu():
    m = tiny(spread=1.0)
    prompt = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(3))
    ref = naive_greedy(m, prompt, 30)  # 5 + 30 > block_size 16: the window fills, then slides
    assert torch.equal(m.generate(prompt, 30, temperature=0), ref)
    assert torch.equal(m.generate(prompt, 30, top_k=1), ref)
    long = torch.randint(0, 256, (1, 40))  # longer than the window: only the last 16 count
    assert torch.equal(m.generate(long, 5, temperature=0), naive_greedy(m, long, 5))


def test_cached_step_gives_the_full_forward_logits():
    m = tiny(1)
    idx = torch.randint(0, 256, (3, 12))
    full, _ = m(idx)
    cache = m.empty_cache(3)
    first = m.forward_cached(idx[:, :7], torch.zeros(1, dtype=torch.long), cache)  # prefill 7 tokens
    torch.testing.assert_close(first, full[:, 6], atol=1e-5, rtol=1e-5)
    for t in range(7, 12):  # then one at a time
        step = m.forward_cached(idx[:, t : t + 1], torch.tensor([t]), cache)
        torch.testing.assert_close(step, full[:, t], atol=1e-5, rtol=1e-5)


def test_generate_cached_equals_the_fixed_window_while_it_fits():
    m = tiny(2, spread=1.0)
    p = torch.randint(0, 256, (2, 4))
    n = TINY.block_size - 4  # prompt + new tokens fill the window exactly
    assert torch.equal(m.generate_cached(p, n, temperature=0), m.generate(p, n, temperature=0))
    assert torch.equal(m.generate_cached(p, n, temperature=0), naive_greedy(m, p, n))
    long = m.generate_cached(p, 3 * TINY.block_size, temperature=0.9, top_k=5)  # refills the cache twice
    assert long.shape == (2, 3 * TINY.block_size) and long.dtype == torch.long
    with pytest.raises(ValueError, match="temperature"):
        m.generate_cached(p, 2, temperature=-1)


def test_exported_cached_step_has_a_dynamic_batch_and_matches_eager():
    from labkit.serve.export import export_decoder

    m = tiny(3, spread=1.0)
    ep = export_decoder(m)
    step = ep.module()
    for b in (1, 3):
        p = torch.randint(0, 256, (b, 5))
        assert torch.equal(m.generate_cached(p, 9, temperature=0, step=step), m.generate_cached(p, 9, temperature=0))


def test_top_k_samples_only_among_the_k_best():
    m = tiny(spread=0.2)  # peaked enough for a clear top 3, flat enough to sample among them
    torch.manual_seed(4)
    prompt = torch.randint(0, 256, (3, 4))
    out = m.generate(prompt, 20, temperature=1.5, top_k=3)
    seq = torch.cat([prompt, out], 1)
    for t in range(20):
        ctx = seq[:, : 4 + t][:, -16:]
        top3 = m(ctx)[0][:, -1].topk(3).indices
        assert (top3 == out[:, t : t + 1]).any(1).all(), t
    assert m.training is False and len(set(out.flatten().tolist())) > 3  # it samples, not argmax


@pytest.mark.heavy
def test_generate_on_xla_compiles_a_fixed_number_of_graphs():
    rt = labkit.setup("xla-cpu")
    cpu_model = tiny(spread=1.0)
    prompt = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(5))
    expected = naive_greedy(cpu_model, prompt, 40)
    m = tiny(spread=1.0).to(rt.device)
    p = prompt.to(rt.device)
    c0 = compile_count()
    out = m.generate(p, 40, temperature=0)
    first = compile_count() - c0
    assert torch.equal(out, expected)
    # one graph per phase (window filling, window sliding) plus set-up: not one per token
    assert first <= 6, first
    c1 = compile_count()
    m.generate(p, 40, temperature=0.8, top_k=8)  # sampling adds its own step graphs, once
    c2 = compile_count()
    assert c2 - c1 <= 6, c2 - c1
    m.generate(p, 40, temperature=0.8, top_k=8)
    assert compile_count() == c2  # same shapes again: everything cached
    m.generate(p, 90, temperature=0.8, top_k=8)  # 50 more tokens: a new output buffer, no more
    assert compile_count() - c2 <= 3


def test_text_batches_shapes_reproducible_and_errors(tmp_path):
    data = text.load_corpus("offline")
    assert len(data) > 300_000 and b" the " in data
    train, val = text.split(data)
    assert len(train) + len(val) == len(data) and abs(len(val) / len(data) - 0.1) < 0.001
    b = text.TextBatches(train, 4, 8, steps=3, seed=7)
    got = list(b)
    assert len(b) == 3 == len(got)
    for x, y in got:
        assert x.shape == y.shape == (4, 8) and x.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
    again = list(text.TextBatches(train, 4, 8, steps=3, seed=7))
    assert all(torch.equal(a[0], c[0]) for a, c in zip(got, again))
    b.set_epoch(1)
    assert not torch.equal(next(iter(b))[0], got[0][0])  # a new draw per epoch
    ev = text.TextBatches(val, 4, 8, steps=2, fixed=True)
    first = next(iter(ev))[0]
    ev.set_epoch(5)
    assert torch.equal(next(iter(ev))[0], first)  # evaluation: same windows
    short = tmp_path / "short.txt"
    short.write_bytes(b"too short")
    with pytest.raises(ValueError, match="short.txt.*block_size=64"):
        text.TextBatches(text.load_corpus(str(short)), 2, 64, 1, name=str(short))
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        text.load_corpus(str(tmp_path / "nope.txt"))
    assert text.decode(text.encode("héllo")) == "héllo"


def test_download_caches_once_and_names_the_url(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "src.txt"
    src.write_text("to be or not to be")
    path = text.download(src.as_uri(), "x.txt")
    src.unlink()  # the second call must not fetch again
    assert text.download(src.as_uri(), "x.txt") == path and path.read_text() == "to be or not to be"
    with pytest.raises(ConnectionError, match="missing.txt"):
        text.download((tmp_path / "missing.txt").as_uri(), "y.txt")
    assert not (tmp_path / "cache" / "y.txt").exists()


@pytest.mark.parametrize("capturable", [False, True], ids=["plain", "labkit"])
def test_adamw_keeps_one_graph_past_the_bias_correction_rounding(capturable):
    """Plain AdamW on XLA recompiles once sqrt(1 - 0.95**step) rounds to 1.0 (step ~325):
    torch_xla bakes the constant 1 into the graph. gpt.adamw (capturable on XLA) does not."""
    rt = labkit.setup("xla-cpu")
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 4).to(rt.device)  # the optimizer's graph is what matters, not the model's
    if capturable:
        opt = gpt.adamw(m, 1e-3, rt=rt)
    else:  # what gpt.adamw gives without capturable: torch's AdamW, the same betas
        opt = torch.optim.AdamW(m.parameters(), 1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    x = torch.ones(2, 4).to(rt.device)
    counts = []
    for _ in range(340):
        m(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        rt.sync()
        counts.append(compile_count())
    extra = counts[-1] - counts[3]
    assert extra == (0 if capturable else 1), (extra, [i for i in range(1, 340) if counts[i] != counts[i - 1]])


def test_generate_cached_takes_a_step_that_has_no_truth_value():
    """torch 2.11's compiled module raises on len() (so on bool()): the step argument is tested against None."""
    from labkit.models import GPT, GPTConfig

    torch.manual_seed(0)
    gpt = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32)).eval()

    class NoTruth:
        def __init__(self, fn):
            self.fn = fn

        def __len__(self):
            raise TypeError("GraphModule does not support len()")

        def __call__(self, *a, **k):
            return self.fn(*a, **k)

    prompt = torch.tensor([[1, 2, 3]])
    want = gpt.generate_cached(prompt, 4, temperature=0)
    assert torch.equal(gpt.generate_cached(prompt, 4, temperature=0, step=NoTruth(gpt.forward_cached)), want)
