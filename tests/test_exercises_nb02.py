"""Notebook 02's checkers: right answers pass; formulas that confuse T, d and V, faked counts and copies of the
library's own count fail with a reason."""

import math

import pytest

from labkit.lessons.exercises import NotDone, Wrong, nb02


def params(V, T, L, d):
    return V * d + T * d + L * (12 * d * d + 13 * d) + 2 * d


def step_s(V, T, L, d, batch, flops_per_s):
    return (6 * (params(V, T, L, d) - T * d) + 12 * L * T * d) * batch * T / flops_per_s


def test_bucket():
    note = nb02.check_bucket(lambda n: min(256, 32 * math.ceil(n / 32)))
    assert "graphs instead of 256" in note and "no XLA here: the graphs were not counted" in note
    with pytest.raises(Wrong, match="not a multiple of 32"):
        nb02.check_bucket(lambda n: n)
    with pytest.raises(Wrong, match="must be a number"):
        nb02.check_bucket(lambda n: str(32 * math.ceil(n / 32)))


def test_bucket_on_xla_counts_the_graphs():
    import labkit

    rt = labkit.setup("xla-cpu")
    note = nb02.check_bucket(lambda n: min(64, 32 * math.ceil(n / 32)), 64, rt)
    assert "measured: 12 random prompts" in note and "graphs compiled" in note
    with pytest.raises(Wrong, match="your code raised ZeroDivisionError"):
        nb02.check_bucket(lambda n: min(64, 32 * math.ceil(n / 32)) + 0 // (n - 50), 64, rt)  # fails at n = 50


def test_gpt_params():
    assert "every parameter counted" in nb02.check_gpt_params(params)
    with pytest.raises(Wrong, match="weight tying"):
        nb02.check_gpt_params(lambda V, T, L, d: params(V, T, L, d) + V * d)
    with pytest.raises(Wrong, match="position table"):
        nb02.check_gpt_params(lambda V, T, L, d: params(V, T, L, d) - T * d)
    with pytest.raises(Wrong, match="you say"):
        nb02.check_gpt_params(lambda V, T, L, d: params(V, d, L, T))  # T and d swapped: they differ in every case
    with pytest.raises(Wrong, match="building the model and counting its parameters is the measurement"):
        from labkit.models import GPT, GPTConfig

        nb02.check_gpt_params(
            lambda V, T, L, d: sum(
                p.numel()
                for p in GPT(GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=4, n_embd=d)).parameters()
            )
        )
    with pytest.raises(Wrong, match="you say 120,576"):
        nb02.check_gpt_params(lambda V, T, L, d: 120_576)  # the notebook's own model, hard-coded


def test_step_time():
    assert "four shapes" in nb02.check_step_time(step_s)
    with pytest.raises(Wrong, match="forward pass only"):
        nb02.check_step_time(lambda *a: step_s(*a) / 3)
    with pytest.raises(Wrong, match="FLOPs per step: divide"):
        nb02.check_step_time(lambda *a: step_s(*a) * a[-1])
    with pytest.raises(Wrong, match="off"):  # attention counted with d where T belongs
        nb02.check_step_time(lambda V, T, L, d, b, f: (6 * (params(V, T, L, d) - T * d) + 12 * L * d * d) * b * T / f)
    with pytest.raises(NotDone):
        nb02.check_step_time(...)


def _cfg(V, T, L, d):
    from labkit.models import GPTConfig

    return GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=4, n_embd=d)


def test_every_path_to_a_built_model_is_refused():
    import torch

    from labkit.models import gpt
    from labkit.models.gpt import GPT  # an import by name: a reference saved before the check runs

    saved_block = gpt.Block

    def on_meta(V, T, L, d):  # the model built without memory: still the measurement
        with torch.device("meta"):
            return sum(p.numel() for p in GPT(_cfg(V, T, L, d)).parameters())

    def from_blocks(V, T, L, d):  # a submodule counted instead of the GPT
        block = sum(p.numel() for p in saved_block(_cfg(V, T, L, d)).parameters())
        return V * d + T * d + L * block + 2 * d

    def num_params(V, T, L, d):
        return GPT.num_params(torch.nn.Module()) + T * d

    for answer in (on_meta, from_blocks, num_params):
        with pytest.raises(Wrong, match="building the model and counting its parameters is the measurement"):
            nb02.check_gpt_params(answer)
    with pytest.raises(Wrong, match="building the model"):
        nb02.check_step_time(lambda V, T, L, d, b, f: GPT(_cfg(V, T, L, d)).flops_per_token() * b * T / f)
    assert sum(p.numel() for p in GPT(_cfg(97, 40, 1, 32)).parameters()) == params(97, 40, 1, 32)  # restored


def test_a_model_too_large_to_build_is_part_of_the_check():
    # right on every small shape, wrong past a billion parameters (a table of the four small answers, say)
    def small_only(V, T, L, d):
        return params(V, T, L, d) if d < 100 else 1_500_000_000

    with pytest.raises(Wrong, match="V=50257"):
        nb02.check_gpt_params(small_only)
