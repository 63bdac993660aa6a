"""Notebook 01's checkers: a right answer passes; answers that are wrong, faked or crash say "not yet"."""

import pytest
import torch

import labkit
from labkit.lessons.exercises import NotDone, Wrong, nb01


@pytest.fixture(scope="module")
def rt():
    return labkit.setup("xla-cpu")


@pytest.fixture(scope="module")
def cpu():
    return labkit.Runtime("cpu", torch.device("cpu"))


class AlwaysEqual:
    """A faked answer: equal to anything, and an int when asked."""

    def __eq__(self, other):
        return True

    def __int__(self):
        return 0

    __hash__ = object.__hash__


def right_bytes(b, c, h, w):
    return b * c * h * w * 4 + 8 * b


def test_feed_bytes_is_measured_by_torch_xla(rt):
    assert "every byte accounted for by torch_xla's OutboundData" in nb01.check_feed_bytes(right_bytes, rt)
    with pytest.raises(Wrong, match="images only; the labels travel too"):
        nb01.check_feed_bytes(lambda b, c, h, w: b * c * h * w * 4, rt)
    with pytest.raises(Wrong, match="not as uint8 pixels"):
        nb01.check_feed_bytes(lambda b, c, h, w: b * c * h * w + 8 * b, rt)
    with pytest.raises(Wrong, match=r"you say 245,888 bytes, torch_xla's OutboundData counted"):
        nb01.check_feed_bytes(lambda b, c, h, w: 245_888, rt)  # the last shape's answer (16x3x32x40), hard-coded
    with pytest.raises(Wrong, match="OutboundData counted"):
        nb01.check_feed_bytes(lambda b, c, h, w: b * c * h * w * 4 + 4 * b, rt)  # int32 labels
    with pytest.raises(Wrong, match="must be a number"):
        nb01.check_feed_bytes(lambda b, c, h, w: str(right_bytes(b, c, h, w)), rt)
    with pytest.raises(Wrong, match="must be a number .*got AlwaysEqual"):
        nb01.check_feed_bytes(lambda b, c, h, w: AlwaysEqual(), rt)
    with pytest.raises(Wrong, match=r"your code raised ZeroDivisionError"):
        nb01.check_feed_bytes(lambda b, c, h, w: b // 0, rt)
    with pytest.raises(NotDone):
        nb01.check_feed_bytes(lambda b, c, h, w: ..., rt)


def test_feed_bytes_measured_inside_the_prediction_is_refused(rt):
    from labkit.loader import DeviceLoader

    def measured(b, c, h, w):  # copy a batch the way the check does, and count
        x, y = torch.zeros(b, c, h, w), torch.zeros(b, dtype=torch.long)
        return sum(t.numel() * t.element_size() for t in next(iter(DeviceLoader([(x, y)], rt))))

    with pytest.raises(Wrong, match="runs nothing on the device.*host->device copies"):
        nb01.check_feed_bytes(measured, rt)

    def small_only(b, c, h, w):  # right wherever a batch fits in memory, a guess beyond
        return right_bytes(b, c, h, w) if b * c * h * w < 10**8 else 10**10

    with pytest.raises(Wrong, match="the measured batches' rule counted"):
        nb01.check_feed_bytes(small_only, rt)
    with pytest.raises(Wrong, match="labels are int64"):
        nb01.check_feed_bytes(lambda b, c, h, w: b * c * h * w * 4 + 4 * b, rt)


def test_feed_bytes_off_xla_uses_the_tensors_sizes(cpu):
    assert "the tensors' sizes" in nb01.check_feed_bytes(right_bytes, cpu)
    with pytest.raises(Wrong, match="the tensors' sizes counted"):
        nb01.check_feed_bytes(lambda b, c, h, w: b * c * h * w * 4 + 4 * b, cpu)


def rule(sizes):
    return 1 + len(set(sizes[1:]))  # step 0 has no momentum buffer yet: a graph of its own


def test_graphs_are_counted_by_torch_xla(rt, cpu):
    assert "graphs counted by torch_xla" in nb01.check_graphs(rule, rt)
    with pytest.raises(Wrong, match="one graph per distinct size"):
        nb01.check_graphs(lambda sizes: len(set(sizes)), rt)
    with pytest.raises(Wrong, match="XLA built"):  # the rule's path: no training needed to turn these away
        nb01.check_graphs(lambda sizes: len(set(sizes)) + 1, cpu)
    with pytest.raises(Wrong, match="you say 9 graphs, XLA built"):
        nb01.check_graphs(lambda sizes: 9, cpu)  # a hard-coded count (these runs build 3 to 5 graphs, in 4 to 7 steps)


def test_graphs_a_hard_coded_count_fails_every_call(rt, cpu):
    for runtime, counts in ((cpu, (2, 3, 4, 5)), (cpu, (2, 3, 4, 5)), (cpu, (2, 3, 4, 5)), (rt, (3,))):
        for n in counts:
            with pytest.raises(Wrong, match=f"you say {n} graphs|one graph per (distinct size|step) gives {n}"):
                nb01.check_graphs(lambda sizes, n=n: n, runtime)


def test_graphs_counted_inside_the_prediction_is_refused(rt):
    def measured(sizes):
        return nb01._train_and_count(rt, sizes)  # train and count, as the check does

    with pytest.raises(Wrong, match="runs nothing on the device.*graph\\(s\\) compiled"):
        nb01.check_graphs(measured, rt)


def test_graphs_refuses_fakes_before_training(rt, cpu):
    for runtime in (rt, cpu):
        with pytest.raises(Wrong, match="must be a number .*got AlwaysEqual"):
            nb01.check_graphs(lambda sizes: AlwaysEqual(), runtime)
        with pytest.raises(Wrong, match=r"your code raised IndexError: .*\(at test_exercises_nb01.py:\d+\)"):
            nb01.check_graphs(lambda sizes: sizes[99], runtime)
        with pytest.raises(NotDone):
            nb01.check_graphs(None, runtime)
        with pytest.raises(Wrong, match="a count is a whole number"):
            nb01.check_graphs(lambda sizes: rule(sizes) + 0.5, runtime)


def test_graphs_one_per_step_fails_every_call(cpu):
    for _ in range(6):  # both runs repeat a size after the first step: a count of steps is always too many
        with pytest.raises(Wrong, match="one graph per step gives"):
            nb01.check_graphs(lambda sizes: len(sizes), cpu)


def test_graphs_off_xla_says_nothing_was_measured(cpu):
    assert "not measured" in nb01.check_graphs(rule, cpu)
    with pytest.raises(Wrong, match="one graph per distinct size"):
        nb01.check_graphs(lambda sizes: len(set(sizes)), cpu)


def test_pad_labels():
    def right(y, batch):
        return torch.cat([y, torch.full((batch - len(y),), -100, dtype=y.dtype)])

    assert "nothing to the loss" in nb01.check_pad_labels(right)
    with pytest.raises(Wrong, match="padding must be -100"):
        nb01.check_pad_labels(lambda y, b: torch.cat([y, torch.zeros(b - len(y), dtype=y.dtype)]))
    with pytest.raises(Wrong, match="return a tensor, got AlwaysEqual"):
        nb01.check_pad_labels(lambda y, b: AlwaysEqual())
    with pytest.raises(Wrong, match="return a tensor, got LyingTensor"):

        class LyingTensor(torch.Tensor):  # a tensor whose comparisons all say yes
            def __eq__(self, other):
                return torch.ones(self.shape, dtype=torch.bool)

        nb01.check_pad_labels(
            lambda y, b: torch.cat([y, torch.zeros(b - len(y), dtype=y.dtype)]).as_subclass(LyingTensor)
        )
    with pytest.raises(Wrong, match=r"your code raised RuntimeError: .*\(at test_exercises_nb01.py:\d+\)"):
        nb01.check_pad_labels(lambda y, b: torch.cat([y, torch.full((b,), -100)]).view(5, 7))
    with pytest.raises(NotDone):
        nb01.check_pad_labels(lambda y, b: None)


def test_resume_position():
    assert "exactly once" in nb01.check_resume_position(lambda step, per: divmod(step, per))
    with pytest.raises(Wrong, match="the next batch to train is"):
        nb01.check_resume_position(lambda step, per: divmod(step + 1, per))
    with pytest.raises(Wrong, match="return the pair"):
        nb01.check_resume_position(lambda step, per: step)
    with pytest.raises(NotDone):
        nb01.check_resume_position(lambda step, per: None)  # the placeholder body: unpacking it crashed before
    with pytest.raises(Wrong, match="must be a number"):
        nb01.check_resume_position(lambda step, per: (AlwaysEqual(), AlwaysEqual()))

    class Pair(tuple):  # a tuple that claims any length
        def __len__(self):
            return 2

    with pytest.raises(Wrong, match="return the pair"):
        nb01.check_resume_position(lambda step, per: Pair((step // per, step % per, 0)))
    with pytest.raises(Wrong, match="your code raised ZeroDivisionError"):
        nb01.check_resume_position(lambda step, per: divmod(per, step))


def right_tradeoff(batch, s_min, b_noise):
    steps = s_min * (1 + b_noise / batch)
    return steps, batch * steps


def test_batch_tradeoff_is_the_papers_hyperbola():
    from labkit.optim import batch_tradeoff

    s_min, b_noise = 1000.0, 512.0
    assert batch_tradeoff(512, s_min, b_noise) == (2000.0, 2 * s_min * b_noise)  # at B_noise: twice both minima
    for batch in (1, 8, 512, 4096, 10**6):
        steps, examples = batch_tradeoff(batch, s_min, b_noise)
        assert steps > s_min and examples > s_min * b_noise and examples == pytest.approx(batch * steps)
        assert (steps / s_min - 1) * (examples / (s_min * b_noise) - 1) == pytest.approx(1.0)  # eq. 2.11
    with pytest.raises(ValueError, match="batch_tradeoff: batch=0"):
        batch_tradeoff(0, s_min, b_noise)
    with pytest.raises(ValueError, match="b_noise"):
        batch_tradeoff(8, s_min, -1.0)


def test_critical_batch_right_and_wrong():
    assert "from a 16th of B_noise to 32 times it" in nb01.check_critical_batch(right_tradeoff)
    wrong = [
        (lambda b, s, n: (s * n / b, s * n), "linear scaling forever"),  # no floor at S_min
        (lambda b, s, n: (s * (1 + b / n), s * n * (1 + n / b)), "swapped"),
        (lambda b, s, n: (s * (1 + n / b), s * (1 + b / n)), r"E_min is S_min x B_noise"),
        (lambda b, s, n: (s * (1 + n / b), s * n * b / n), "examples = batch x steps"),  # the examples with no floor
        (lambda b, s, n: (s * (1 + n / b) * 1.05, b * s * (1 + n / b)), "within 1% passes"),
        (lambda b, s, n: (2 * s, 2 * s * n), "the model says"),  # the knee's answer, for every batch
    ]
    for answer, says in wrong:
        for _ in range(3):  # inputs drawn anew each call: refused every time
            with pytest.raises(Wrong, match=says):
                nb01.check_critical_batch(answer)
    with pytest.raises(Wrong, match="return the pair"):
        nb01.check_critical_batch(lambda b, s, n: s * (1 + n / b))
    with pytest.raises(Wrong, match="must be a number"):
        nb01.check_critical_batch(lambda b, s, n: (AlwaysEqual(), AlwaysEqual()))
    with pytest.raises(NotDone):
        nb01.check_critical_batch(lambda b, s, n: ...)
    with pytest.raises(Wrong, match="your code raised ZeroDivisionError"):
        nb01.check_critical_batch(lambda b, s, n: (s / 0, 1))


def test_critical_batch_refuses_the_library_answer(monkeypatch, capsys):
    import labkit.optim
    from labkit.lessons.exercises import check
    from labkit.optim import batch_tradeoff as saved  # a reference saved before the check: refused all the same

    with pytest.raises(Wrong, match="batch_tradeoff is the answer"):
        nb01.check_critical_batch(lambda b, s, n: saved(b, s, n))
    with pytest.raises(Wrong, match="batch_tradeoff is the answer"):
        nb01.check_critical_batch(lambda b, s, n: labkit.optim.batch_tradeoff(b, s, n))
    assert saved(4, 10.0, 4.0) == (20.0, 80.0)  # and it works again afterwards
    monkeypatch.setenv("LABKIT_SOLUTIONS", "0")
    assert not check("01.critical_batch", lambda: nb01.check_critical_batch(saved))
    assert "✗ 01.critical_batch: not yet: work it out" in capsys.readouterr().out
