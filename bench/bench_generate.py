"""Sampling from a GPT on XLA:CPU: the textbook growing-sequence loop vs GPT.generate's fixed window.

    PJRT_DEVICE=CPU python bench/bench_generate.py [--tokens 24] [--block 64]

Both decode greedily from the same model and prompt, so they must produce the same bytes (checked).
Prints, from one run, for each way: graphs compiled, wall time for a first call and for a second
call with the same arguments, and the ratios. The textbook loop feeds a sequence one token longer
at every step: a new input shape, hence a new XLA graph and compile per token (until the window
is full); its second call is fast only because the compile cache kept every one of those graphs.
Without a sync per token ("no sync") the lazy graph instead grows by a whole forward pass per
token and compiles once, at the end, as one graph that gets slower to compile the longer the
sample (and is recompiled for every other length). generate() compiles a fixed handful (setup,
a filling step, a sliding step) whatever the length. Last, on the plain CPU: the fixed window vs GPT.generate_cached's
key/value cache (eager), tokens/s and their ratio.
"""

import argparse
import os
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch
import torch_xla

import data_tools.text
import labkit
from labkit.dashboard.health import compile_count
from labkit.models.gpt import GPT, GPTConfig


def textbook(model, idx, n, block, sync=True):
    for _ in range(n):
        logits, _ = model(idx[:, max(0, idx.shape[1] - block) :])  # XLA rejects an out-of-range -block slice
        idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        if sync:
            torch_xla.sync()
    return idx[:, -n:].cpu()


def timed(fn):
    c, t = compile_count(), time.perf_counter()
    out = fn()
    return out, compile_count() - c, time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--block", type=int, default=64)
    args = ap.parse_args()
    rt = labkit.setup("xla-cpu")
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=args.block, n_layer=2, n_head=4, n_embd=64)).to(rt.device).eval()
    prompt = data_tools.text.encode("The ")[None].to(rt.device)
    rows = {}
    with torch.no_grad():
        for name, fn in (
            ("textbook loop", lambda: textbook(model, prompt, args.tokens, args.block)),
            ("no sync", lambda: textbook(model, prompt, args.tokens, args.block, sync=False)),
            ("GPT.generate", lambda: model.generate(prompt, args.tokens, temperature=0)),
        ):
            out1, c1, t1 = timed(fn)
            out2, c2, t2 = timed(fn)
            rows[name] = (out1, c1, t1, c2, t2)
            print(
                f"{name:14s} first call {t1:6.2f} s, {c1:3d} compiles | second call {t2:6.2f} s, {c2} compiles",
                flush=True,
            )
    (a, ca, ta, _, ta2), (b, cb, tb, _, tb2) = rows["textbook loop"], rows["GPT.generate"]
    u, cu, tu, _, _ = rows["no sync"]
    assert torch.equal(a, b) and torch.equal(u, b), "the loops decoded different bytes"
    print(
        f"{args.tokens} tokens, block {args.block}: first call textbook/generate {ta / tb:.1f}x "
        f"({ca} vs {cb} compiles), no-sync/generate {tu / tb:.1f}x; second call textbook/generate {ta2 / tb2:.2f}x"
    )
    cpu_kv_cache(args)


def cpu_kv_cache(args):
    """On the plain CPU (eager): generate's fixed window vs generate_cached's key/value cache, same bytes."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=args.block, n_layer=2, n_head=4, n_embd=64)).eval()
    prompt = data_tools.text.encode("The ")[None]
    n = args.block - prompt.shape[1]  # fill the window: the cache's best case
    rates, outs = {}, {}
    for name, fn in (
        ("window", lambda: model.generate(prompt, n, temperature=0)),
        ("kv cache", lambda: model.generate_cached(prompt, n, temperature=0)),
    ):
        fn()
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            outs[name] = fn()
            best = min(best, time.perf_counter() - t)
        rates[name] = n / best
        print(f"CPU eager, {name:8s}: {rates[name]:8.1f} tokens/s", flush=True)
    assert torch.equal(outs["window"], outs["kv cache"]), "the cache changed the greedy bytes"
    print(f"CPU eager, {n} tokens, block {args.block}: kv cache / window {rates['kv cache'] / rates['window']:.2f}x")


if __name__ == "__main__":
    main()
