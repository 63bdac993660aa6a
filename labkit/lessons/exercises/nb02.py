"""Checkers for notebook 02 (a GPT language model). Each one runs the learner's code on inputs that change with
every call, with shapes where the quantities a wrong formula would confuse (context T, width d, vocabulary V,
depth L) all differ, and compares with what a real model has or does."""

from __future__ import annotations

import itertools
import random

from labkit.lessons.exercises import Wrong, call, close, integer, mistake, number, refusing, require, todo, xla_metric

__all__ = ["check_bucket", "check_gpt_params", "check_step_time"]


def _no_gpt_building():
    """While the learner's prediction runs, building a GPT raises: counting a real model's parameters is the
    measurement, not the prediction."""
    from labkit.models import gpt

    why = "predict from the shapes: building the model and counting its parameters is the measurement"
    parts = [gpt.GPT, gpt.Block, gpt.CausalSelfAttention, gpt.MLP, gpt.GPT.num_params, gpt.GPT.flops_per_token]
    return refusing(parts, why)  # every constructor: a Block or an MLP counted instead of the GPT is refused too


def _built(cfg: dict):
    """labkit's GPT of this shape, on the meta device: shapes without memory, so a model far too large for this
    machine (the last case of each check) is counted for real, in no time."""
    import torch

    from labkit.models import GPT, GPTConfig

    with torch.device("meta"):
        return GPT(GPTConfig(**cfg))


_calls = itertools.count(1)


def check_bucket(bucket, block_size: int = 256, rt=None) -> str:  # rt optional: without one, the rule only
    """02.bucket: bucket(n) -> the padded length for a prompt of n bytes, so that XLA compiles few graphs:
    at least n, at most block_size, a multiple of 32, and never more than 31 bytes of padding. On XLA (`rt`), prompts
    of random lengths padded by `bucket` run through an embedding lookup and a sum, and torch_xla's compile count must
    equal the number of buckets they fall in."""
    todo(bucket)
    shapes = set()
    for n in range(1, block_size + 1):
        b = integer(call(bucket, n), f"bucket({n})")
        require(b >= n, f"bucket({n}) = {b}: shorter than the prompt, bytes would be cut")
        require(b <= block_size, f"bucket({n}) = {b}: longer than the model's window ({block_size})")
        if b % 32 and b != block_size:  # the window itself is the last bucket when it is no multiple of 32
            raise Wrong(f"bucket({n}) = {b}: not a multiple of 32, so almost every length is its own graph")
        require(b - n < 32, f"bucket({n}) = {b}: {b - n} bytes of padding, more work than needed")
        shapes.add(b)
    note = f"{block_size} prompt lengths -> {len(shapes)} graphs instead of {block_size}"
    if rt is not None and rt.reads_metrics:  # torch_xla counts the graphs
        return note + "; " + _measure_buckets(bucket, block_size, rt)
    # eager CUDA/CPU compiles nothing per shape: there is no graph count to read, only the rule was checked
    return note + " (no XLA here: the graphs were not counted)"


def _measure_buckets(bucket, block_size: int, rt) -> str:
    import torch

    def compiles():
        return xla_metric("CompileTime")[0]

    k = next(_calls)
    rng = random.Random(k)
    lengths = [rng.randint(1, block_size) for _ in range(12)]
    emb = torch.randn(256, 24 + k, device=rt.device)  # a width of its own: no graph of an earlier call reused
    padded = [integer(call(bucket, n), f"bucket({n})") for n in lengths]  # asked once: the same answer is measured
    rt.sync()
    c0 = compiles()
    for b in padded:
        ids = torch.zeros(1, b, dtype=torch.long)
        out = emb[ids.to(rt.device)].sum()  # alive at the sync: computed
        rt.sync()
    del out
    graphs, want = compiles() - c0, len(set(padded))
    require(graphs == want, f"{len(lengths)} prompts in {want} buckets compiled {graphs} graphs on XLA")
    return f"measured: {len(lengths)} random prompts, {graphs} graphs compiled"


def _configs(k: int):
    """GPT shapes where V, T, d and L all differ (no formula that mixes them up can pass by luck): four small ones,
    then one of billions of parameters (GPT-2 XL and beyond), far too large to build on this machine."""
    rng = random.Random(k)
    out = []
    for _ in range(4):
        d = rng.choice([32, 48, 64, 96])
        out.append(
            dict(
                vocab_size=rng.choice([256, 300, 97]),
                block_size=rng.choice([40, 72, 136]),
                n_layer=rng.randint(1, 4),
                n_head=4,
                n_embd=d,
            )
        )
    d = 64 * rng.randint(25, 40)
    out.append(
        dict(vocab_size=50257, block_size=rng.choice([1024, 2048]), n_layer=rng.randint(36, 60), n_head=16, n_embd=d)
    )
    return out


def check_gpt_params(gpt_params) -> str:
    """02.params: gpt_params(V, T, L, d) -> the parameters of labkit's GPT (biases on, the output layer tied to the
    token table), predicted from the shapes, then counted on real models of four shapes and on one of billions of
    parameters (built on the meta device, after the answer). Every GPT part's constructor refuses while the
    learner's code runs."""
    todo(gpt_params)
    for c in _configs(next(_calls)):
        V, T, L, d = c["vocab_size"], c["block_size"], c["n_layer"], c["n_embd"]
        with _no_gpt_building():
            got = integer(call(gpt_params, V, T, L, d), f"gpt_params({V}, {T}, {L}, {d})")
        want = sum(p.numel() for p in _built(c).parameters())
        hint = mistake(
            got,
            want,
            {
                "the output layer shares the token table (weight tying): count V x d once": want + V * d,
                "the position table (T x d) is a parameter too": want - T * d,
                "12 L d^2 is the matrices of the blocks only: add the embeddings, biases and LayerNorms": L
                * 12
                * d
                * d,
            },
        )
        require(got == want, hint or f"V={V}, T={T}, L={L}, d={d}: you say {got:,}, the model has {want:,}")
    return f"four shapes and one of {want / 1e9:.1f} B parameters, every parameter counted"


def check_step_time(predict_step_s, machine_flops: float | None = None) -> str:
    """02.step_time: predict_step_s(V, T, L, d, batch, flops_per_s) -> seconds of one training step of `batch`
    windows of T bytes at `flops_per_s`, counting 6 FLOPs per parameter per token (without the position table,
    a lookup) and 12 L T d per token for attention's two products. Checked on four shapes within 2 % of labkit's
    count (GPT.flops_per_token), and on a model of billions of parameters (built on the meta device after the
    answer); every GPT part's constructor and labkit's own count refuse while the learner's code runs. Why not torch's FlopCounterMode as the reference: on the CPU it counts the matmuls
    exactly (6 per matrix weight per token) but not scaled_dot_product_attention (measured with torch 2.9: 81-84 % of
    6N + 12LTd on three shapes, the attention term missing)."""
    todo(predict_step_s)
    k = next(_calls)
    rate = machine_flops or 1e11
    for i, c in enumerate(_configs(k)):
        V, T, L, d = c["vocab_size"], c["block_size"], c["n_layer"], c["n_embd"]
        batch, flops_per_s = 4 + 4 * i, rate * (1 + i)
        want = _built(c).flops_per_token() * batch * T / flops_per_s
        with _no_gpt_building():
            got = number(call(predict_step_s, V, T, L, d, batch, flops_per_s), f"predict_step_s for {c}")
        if abs(got - want / 3) <= 0.02 * want / 3:
            raise Wrong("that is the forward pass only: backward costs about twice the forward")
        if (
            abs(got * flops_per_s - want * flops_per_s) > 0.02 * want * flops_per_s
            and abs(got - want * flops_per_s) <= 0.02 * want * flops_per_s
        ):
            raise Wrong("that is FLOPs per step: divide by the FLOP/s for seconds")
        close(
            got,
            want,
            0.02,
            f"V={V}, T={T}, L={L}, d={d}, batch {batch}",
            hint="FLOPs per token x tokens per step / FLOP/s",
        )
    return "four shapes and one too large to build here, at four rates"
