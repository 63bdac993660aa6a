"""Checkers for notebook 01 (ResNet-50 on streamed shards). Each one runs the learner's code on inputs that change
with every call and judges what it does. Two are predicted, then measured on the device: 01.feed_bytes against
torch_xla's count of bytes sent to the device, 01.graphs against its count of new graphs. One is arithmetic only:
01.critical_batch, the steps and examples a batch size costs in McCandlish et al.'s model (labkit.optim).

    from labkit.lessons.exercises import check, nb01
    check("01.feed_bytes", lambda: nb01.check_feed_bytes(step_bytes, rt))
    check("01.graphs", lambda: nb01.check_graphs(graphs_compiled, rt))
    check("01.critical_batch", lambda: nb01.check_critical_batch(steps_and_examples))

On XLA:CPU the two device checks cost at most 6 small compiles (about half a second each on two loaded cores).
"""

from __future__ import annotations

import itertools
import random

import torch

from labkit.lessons.exercises import (
    Wrong,
    call,
    integer,
    mistake,
    number,
    predicting,
    refusing,
    require,
    todo,
    xla_metric,
)

__all__ = [
    "check_critical_batch",
    "check_feed_bytes",
    "check_graphs",
    "check_pad_labels",
    "check_resume_position",
    "require",
]

_calls = itertools.count(1)
# every model the graphs check trains has a width of its own: XLA keeps the graphs of an earlier attempt in memory,
# and a model it has seen before would compile fewer graphs than the rule says
_widths = itertools.count(24)


def _xla_count(name: str) -> int:
    """A torch_xla counter, or the number of samples of a metric (0 when it has none yet)."""
    import torch_xla.debug.metrics as met

    if name in met.counter_names():
        return int(met.counter_value(name))
    return xla_metric(name)[0]


def _outbound_bytes() -> int:
    """Bytes torch_xla has copied host -> device in this process (the sum of its OutboundData metric)."""
    return int(xla_metric("OutboundData")[1])


def check_feed_bytes(step_bytes, rt) -> str:
    """01.feed_bytes: step_bytes(batch, channels, height, width) -> bytes one training step copies from the host to
    the device: a float32 image batch (N, C, H, W) and its int64 labels. Predicted, then measured: on XLA by
    torch_xla's OutboundData metric while labkit.DeviceLoader (the training loop's way in, sharded under SPMD)
    copies a real batch of that shape; elsewhere by the sizes of the tensors it put on the device. Then two batches
    of tens of gigabytes, which no machine here can hold, against the rule the measured ones follow. On XLA the
    prediction must make the device do nothing (torch_xla's counts): copying a batch and counting is the check's
    part."""
    from labkit.loader import DeviceLoader

    todo(step_bytes)
    rng = random.Random(next(_calls))
    # batches are multiples of 8, so that under SPMD every chip of a host (4 or 8) gets an equal share
    shapes = [(8 * rng.randint(1, 8), rng.choice([1, 3]), rng.choice([28, 32, 48, 64]), 0) for _ in range(4)]
    shapes = [(b, c, h, rng.choice([h, h + 8])) for b, c, h, _ in shapes] + [(16, 3, 32, 40)]
    huge = [(8 * rng.randint(300, 900), 3, rng.choice([384, 512]), rng.choice([512, 640])) for _ in range(2)]
    how = "the tensors' sizes"
    for b, c, h, w in shapes + huge:
        with predicting(rt, "a prediction of the bytes"):
            got = integer(call(step_bytes, b, c, h, w), f"step_bytes({b}, {c}, {h}, {w})")
        if (b, c, h, w) in huge:  # tens of GB: the rule the measured batches above followed
            want, how_here = b * c * h * w * 4 + 8 * b, "the measured batches' rule"
        else:
            x, y = torch.randn(b, c, h, w), torch.randint(0, 10, (b,))
            rt.sync()
            before = _outbound_bytes() if rt.reads_metrics else 0
            (on_device,) = list(DeviceLoader([(x, y)], rt))  # consumed to the end: its thread stops
            rt.sync()
            if rt.reads_metrics:
                want, how = _outbound_bytes() - before, "torch_xla's OutboundData"
            else:
                want = sum(t.numel() * t.element_size() for t in on_device)
            how_here = how
        pixels = b * c * h * w
        hint = mistake(
            got,
            want,
            {
                "that is the images only; the labels travel too (int64: 8 bytes each)": pixels * 4,
                "images arrive as float32 (4 bytes per value) after normalising, not as uint8 pixels": pixels + 8 * b,
                "labels are int64 (8 bytes each), not int32": pixels * 4 + 4 * b,
            },
        )
        require(
            got == want,
            f"batch {b}x{c}x{h}x{w}: you say {got:,} bytes, {how_here} counted {want:,}"
            + (f": {hint}" if hint else ""),
        )
    watched = "" if rt.reads_metrics else " (no XLA here: the prediction's own device work was not watched)"
    return f"{len(shapes)} batch shapes, every byte accounted for by {how}; two of tens of GB by their rule{watched}"


def _new_graphs() -> int:
    """Graphs this process has met for the first time: an in-memory cache miss (UncachedCompile: compiled now) or a
    load from the persistent cache on disk (PersistentCacheHit, which torch_xla counts as a CachedCompile: on a TPU
    labkit keeps that cache on, so a restarted runtime loads the graphs of its last run instead of compiling)."""
    return _xla_count("UncachedCompile") + _xla_count("PersistentCacheHit")


def _train_and_count(rt, sizes: list[int]) -> int:
    """Train a small fresh MLP with SGD + momentum, one step per batch size, one sync per step; return the graphs
    it needed that this process had not met before (a fresh width each time: every one of its graphs is new)."""
    width = next(_widths)
    model = torch.nn.Sequential(torch.nn.Linear(12, width), torch.nn.ReLU(), torch.nn.Linear(width, 5)).to(rt.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    rt.sync()
    before = _new_graphs()
    for b in sizes:
        x, y = rt.to_device((torch.randn(b, 12), torch.randint(0, 5, (b,))))
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        rt.sync()
    return _new_graphs() - before


def _graph_runs(rng: random.Random) -> list[list[int]]:
    """Two lists of batch sizes whose graph counts differ from each other (a hard-coded count passes at most one),
    from a count of distinct sizes (one where the first size comes back later, one where it never does) and from a
    count of steps (both repeat a size after the first step, so "one graph per step" overcounts both)."""
    while True:
        pool = rng.sample([4, 6, 8, 10, 12, 14, 16, 20], 7)
        few, many = pool[:2], pool[2:7]
        back = [few[0], few[1], few[0]] + [rng.choice(few) for _ in range(rng.randint(1, 2))]
        never = [pool[2]] + rng.sample(many[1:], rng.randint(2, 4))
        never += [rng.choice(never[1:]) for _ in range(rng.randint(1, 2))]
        rule = [1 + len(set(r[1:])) for r in (back, never)]
        if rule[0] != rule[1]:
            return [back, never] if rng.random() < 0.5 else [never, back]


def check_graphs(graphs_compiled, rt) -> str:
    """01.graphs: graphs_compiled(batch_sizes) -> how many graphs XLA builds while a fresh model trains one step
    per entry of batch_sizes (SGD with momentum, a sync after each step). Predicted, then measured on XLA by
    torch_xla's counters (UncachedCompile + PersistentCacheHit) while a small MLP trains, for two lists whose counts
    differ. On XLA the prediction must make the device do nothing (torch_xla's counts of graphs compiled and run,
    copies): training and counting is the check's part. Off XLA nothing is compiled per shape, so there is nothing
    to measure: the answer is compared with the rule XLA follows (1 + the distinct sizes after the first step)."""
    todo(graphs_compiled)
    rng = random.Random(next(_calls))
    runs = _graph_runs(rng)
    for sizes in runs:
        with predicting(rt, "a prediction of the graphs"):
            got = integer(call(graphs_compiled, list(sizes)), f"graphs_compiled({sizes})")
        want = _train_and_count(rt, sizes) if rt.reads_metrics else 1 + len(set(sizes[1:]))
        if got == len(set(sizes)) != want:
            raise Wrong(
                f"batch sizes {sizes}: one graph per distinct size gives {got}, XLA built {want}: "
                "is the first step's graph the same as the second's? (where is the momentum buffer at step 0?)"
            )
        if got == len(sizes) != want:
            raise Wrong(
                f"batch sizes {sizes}: one graph per step gives {got}, XLA built {want}: a size seen before "
                "(with the same optimizer state) reuses its compiled graph"
            )
        require(got == want, f"batch sizes {sizes}: you say {got} graphs, XLA built {want}")
    if rt.reads_metrics:
        return f"{len(runs)} runs, graphs counted by torch_xla"
    # the kind shown, not tested: the message names the backend that compiles nothing
    return f"no XLA on {rt.kind}: eager kernels compile nothing per shape; compared with XLA's rule, not measured"


def check_pad_labels(pad_labels) -> str:
    """01.pad_eval: pad_labels(y, batch) -> y padded to `batch` entries with -100 (cross_entropy's ignore index)."""
    todo(pad_labels)
    rng = random.Random(next(_calls))
    for n, batch in [(rng.randint(1, 7), 8), (8, 8), (rng.randint(1, 31), 32)]:
        y = torch.randint(0, 10, (n,), generator=torch.Generator().manual_seed(n))
        got = call(pad_labels, y.clone(), batch)
        # exactly a Tensor: a subclass could answer the comparisons below with anything it likes
        require(type(got) is torch.Tensor, f"return a tensor, got {type(got).__name__}")
        require(tuple(got.shape) == (batch,), f"{n} labels padded to batch {batch}: shape {tuple(got.shape)}")
        require(got.dtype == y.dtype, f"labels must stay {y.dtype}, got {got.dtype}")
        got = got.cpu()
        require(bool(torch.equal(got[:n], y)), "the real labels must stay first, unchanged")
        require(bool((got[n:] == -100).all()), "padding must be -100, which cross_entropy ignores")
        logits = torch.randn(batch, 10, generator=torch.Generator().manual_seed(batch))
        loss = torch.nn.functional.cross_entropy(logits, got, reduction="sum")
        want = torch.nn.functional.cross_entropy(logits[:n], y, reduction="sum")
        require(abs(loss.item() - want.item()) < 1e-4, "the padded rows changed the loss")
    return "padded rows add nothing to the loss"


def check_resume_position(resume_position) -> str:
    """01.resume: resume_position(step, batches_per_epoch) -> (epoch, batch index) where training continues,
    after `step` optimizer steps were done (and checkpointed). Resuming there skips and repeats nothing."""
    todo(resume_position)
    rng = random.Random(next(_calls))
    for per in (rng.randint(3, 9), rng.randint(20, 40)):
        seen = []
        for step in range(0, 3 * per + 1):
            out = call(resume_position, step, per)
            # a plain tuple or list only: a subclass could make len() and indexing say anything
            require(
                type(out) in (tuple, list) and len(out) == 2,
                f"resume_position({step}, {per}) = {out!r}: return the pair (epoch, batch index)",
            )
            epoch = integer(out[0], f"the epoch of resume_position({step}, {per})")
            idx = integer(out[1], f"the batch index of resume_position({step}, {per})")
            require(0 <= idx < per, f"step {step}: batch index {idx} is outside 0..{per - 1}")
            seen.append(epoch * per + idx)
        if seen != list(range(3 * per + 1)):
            bad = next(s for s, v in enumerate(seen) if v != s)
            raise Wrong(
                f"with {per} batches per epoch, after {bad} steps you resume at batch #{seen[bad]} "
                f"(counting from 0 over all epochs): the next batch to train is #{bad}"
            )
    return "every batch trained exactly once"


def _near(got: float, want: float, rel: float = 0.01) -> bool:
    return abs(got - want) <= rel * abs(want)


def _batch_cases(rng: random.Random) -> list[tuple[int, float, float]]:
    """(batch, S_min, B_noise): one noise scale and S_min per call, batches from a 16th of it to 32 times it (linear
    scaling's region, the knee, far past it) and one drawn between."""
    b_noise = float(rng.randint(5, 200) * 100)
    s_min = float(rng.randint(10, 200) * 100)
    mults = [1 / 16, 1, 4, 32, rng.choice([1 / 4, 1 / 2, 2, 8])]
    cases = [(max(1, round(b_noise * m)), s_min, b_noise) for m in mults]
    rng.shuffle(cases)
    return cases


def check_critical_batch(steps_and_examples) -> str:
    """01.critical_batch: steps_and_examples(batch, s_min, b_noise) -> (steps, examples) a run at that constant
    batch needs to reach a given loss, in McCandlish et al. 2018's model (labkit.optim.batch_tradeoff). Judged within
    1% on batches below, at and far above the noise scale, drawn anew on every call; batch_tradeoff is refused while
    the answer runs. Pure arithmetic: nothing runs on a device."""
    from labkit.optim import batch_tradeoff

    todo(steps_and_examples)
    rng = random.Random(next(_calls))
    cases = _batch_cases(rng)
    for batch, s_min, b_noise in cases:
        with refusing([batch_tradeoff], "work it out from the model: labkit.optim.batch_tradeoff is the answer"):
            out = call(steps_and_examples, batch, s_min, b_noise)
        what = f"steps_and_examples({batch}, {s_min:g}, {b_noise:g})"
        require(type(out) in (tuple, list) and len(out) == 2, f"{what} = {out!r}: return the pair (steps, examples)")
        steps, examples = number(out[0], f"the steps of {what}"), number(out[1], f"the examples of {what}")
        want_s, want_e = batch_tradeoff(batch, s_min, b_noise)
        if _near(steps, want_s) and _near(examples, want_e):
            continue
        e_min, ratio = s_min * b_noise, b_noise / batch
        where = f"batch {batch} with S_min {s_min:g} and B_noise {b_noise:g}"
        if _near(steps, s_min * (1 + 1 / ratio)) and _near(examples, e_min * (1 + ratio)):
            raise Wrong(f"{where}: steps and examples swapped: a larger batch needs fewer steps and more examples")
        if _near(steps, s_min * ratio):
            raise Wrong(
                f"{where}: you say {steps:,.4g} steps, linear scaling forever (S_min x B_noise / B); no batch gets "
                f"a run below S_min = {s_min:g} steps: S = S_min (1 + B_noise / B) = {want_s:,.4g}"
            )
        require(
            _near(steps, want_s),
            f"{where}: you say {steps:,.4g} steps, the model says {want_s:,.4g} (within 1% passes)",
        )
        if _near(examples, s_min * (1 + 1 / ratio)):
            raise Wrong(f"{where}: E_min is S_min x B_noise = {e_min:g} examples, not S_min")
        raise Wrong(
            f"{where}: you say {examples:,.4g} examples; every step takes a batch, so examples = batch x steps "
            f"= {want_e:,.4g}"
        )
    return f"{len(cases)} batches from a 16th of B_noise to 32 times it"
