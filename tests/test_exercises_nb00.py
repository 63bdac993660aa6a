"""Notebook 00's exercise checkers on XLA:CPU: each accepts a right answer and turns away the wrong ones it was
written for (padding on the device, labels that count, boolean indexing, a read per step), with a message that
says what is wrong; and every solution cell of every notebook is collapsed and runs only with LABKIT_SOLUTIONS."""

import math
import re

import nbformat
import pytest
import torch
import torch.nn.functional as F

import labkit
from labkit.lessons import exercises
from labkit.lessons.exercises import NotDone, Wrong, nb00
from tests.test_notebooks import ROOT


@pytest.fixture(scope="module")
def dev():
    return labkit.setup("xla-cpu").device


def _pad(x, y, value=-100):
    extra = 8 * math.ceil(len(x) / 8) - len(x)
    return F.pad(x, (0, 0, 0, extra)), F.pad(y, (0, extra), value=value)


def test_pad_batch(dev):
    assert "3 buckets [8, 16, 24]" in nb00.check_pad_batch(_pad)
    with pytest.raises(Wrong, match="return the pair"):
        nb00.check_pad_batch(lambda x, y: _pad(x, y)[0])
    with pytest.raises(Wrong, match="your code raised RuntimeError"):
        nb00.check_pad_batch(lambda x, y: (torch.cat([x, torch.zeros(1)]), y))  # a mistake inside the learner's code
    with pytest.raises(NotDone):
        nb00.check_pad_batch(lambda x, y: ...)
    with pytest.raises(Wrong, match="padding rows must not count"):
        nb00.check_pad_batch(lambda x, y: _pad(x, y, value=0))
    with pytest.raises(Wrong, match="next multiple of 8"):
        nb00.check_pad_batch(lambda x, y: (F.pad(x, (0, 0, 0, 16 - len(x) % 16)), F.pad(y, (0, 16 - len(y) % 16))))
    with pytest.raises(Wrong, match=r"compiled \d+ graphs; each bucket should compile once"):
        nb00.check_pad_batch(lambda x, y: _pad(x.to(dev), y.to(dev)))  # padded on the device: a graph per size


def test_pad_batch_compares_gradients_too(dev):
    def nan_rows(x, y):  # NaN padding rows, labelled -100: the forward loss is right, the gradients are NaN
        extra = 8 * math.ceil(len(x) / 8) - len(x)
        return torch.cat([x, torch.full((extra, x.shape[1]), float("nan"))]), F.pad(y, (0, extra), value=-100)

    with pytest.raises(Wrong, match="the loss is right but the gradients are not those of the batch itself"):
        nb00.check_pad_batch(nan_rows)


def test_masked_mean(dev):
    def right(pred, y):
        keep = y >= 0
        return torch.where(keep, pred, 0.0).sum() / keep.sum()

    assert "one graph, no fallback" in nb00.check_masked_mean(right)
    with pytest.raises(Wrong, match="aten::nonzero"):
        nb00.check_masked_mean(lambda pred, y: pred[y >= 0].mean())
    with pytest.raises(Wrong, match="the mean over y >= 0"):
        nb00.check_masked_mean(lambda pred, y: pred.mean())
    with pytest.raises(NotDone):
        nb00.check_masked_mean(lambda pred, y: None)
    with pytest.raises(Wrong, match="your code raised"):
        nb00.check_masked_mean(lambda pred, y: pred.sum() / y.nope())


def test_quiet_epoch(dev):
    import torch_xla

    def right(model, opt, batches):
        d = next(model.parameters()).device
        total = torch.zeros((), device=d)
        for x, y in batches:
            opt.zero_grad()
            loss = F.cross_entropy(model(x.to(d)), y.to(d))
            loss.backward()
            opt.step()
            total += loss.detach()
            torch_xla.sync()
        return total.item() / len(batches)

    def loud(model, opt, batches):
        d = next(model.parameters()).device
        losses = []
        for x, y in batches:
            opt.zero_grad()
            loss = F.cross_entropy(model(x.to(d)), y.to(d))
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))  # the read per step the exercise is about
            torch_xla.sync()
        return sum(losses) / len(losses)

    assert "1 read" in nb00.check_quiet_epoch(right)
    with pytest.raises(Wrong, match=r"6 device->host reads in 6 steps \(6× test_exercises_nb00.py:\d+ losses.append"):
        nb00.check_quiet_epoch(loud)
    with pytest.raises(Wrong, match="not a tensor"):
        nb00.check_quiet_epoch(lambda m, o, b: torch.zeros(()))


def test_quiet_epoch_refuses_remembered_and_lying_numbers(dev):
    """The epoch's weights and batches change with every call: the loss of an earlier check does not pass again,
    and an object whose comparisons always say yes is not a number."""
    import torch_xla

    def right(model, opt, batches):
        d = next(model.parameters()).device
        total = torch.zeros((), device=d)
        for x, y in batches:
            opt.zero_grad()
            loss = F.cross_entropy(model(x.to(d)), y.to(d))
            loss.backward()
            opt.step()
            total += loss.detach()
            torch_xla.sync()
        return total.item() / len(batches)

    seen = []

    def remember(model, opt, batches):
        seen.append(right(model, opt, batches))
        return seen[0]  # trains for real, returns the first check's loss

    nb00.check_quiet_epoch(remember)
    with pytest.raises(Wrong, match="but the epoch's mean loss is"):
        nb00.check_quiet_epoch(remember)

    class Yes(float):
        def __eq__(self, other):
            return True

        def __sub__(self, other):
            return 0.0

        __hash__ = float.__hash__

    with pytest.raises(Wrong, match="but the epoch's mean loss is"):
        nb00.check_quiet_epoch(lambda m, o, b: right(m, o, b) and Yes(123.0))
    with pytest.raises(Wrong, match="must be a number"):
        nb00.check_quiet_epoch(lambda m, o, b: str(right(m, o, b)))


def test_check_prints_and_raises_only_with_solutions(monkeypatch, capsys):
    def wrong():
        raise Wrong("not like this")

    monkeypatch.setenv("LABKIT_SOLUTIONS", "0")
    assert exercises.check("t.x", wrong) is False and exercises.results["t.x"] is False
    assert "✗ t.x: not yet: not like this" in capsys.readouterr().out
    monkeypatch.setenv("LABKIT_SOLUTIONS", "1")
    with pytest.raises(Wrong):
        exercises.check("t.x", wrong)


def test_solution_cells_are_collapsed_and_guarded():
    """Every cell tagged 'solution' is hidden in Jupyter (source_hidden) and Colab (a form), and defines its answer
    only under solutions_on(): Run all leaves the learner's own cell in force."""
    found = 0
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            if "solution" not in cell.metadata.get("tags", []):
                continue
            found += 1
            assert cell.metadata.get("jupyter", {}).get("source_hidden") is True, f"{path.name}: {cell.id} not hidden"
            assert cell.metadata.get("colab", {}).get("cellView") == "form", f"{path.name}: {cell.id} not a form"
            code = [ln for ln in cell.source.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
            assert re.fullmatch(r"if \w+\.solutions_on\(\):", code[0]), (
                f"{path.name}: {cell.id} runs without LABKIT_SOLUTIONS"
            )
    assert found >= 3


def test_work_on_the_host_or_a_hidden_read_is_caught(dev):
    """The classes of faked answers: the mean computed on the host, a read per step spelled .to("cpu").item(), and
    an epoch trained on a CPU copy of the model (right losses, the real model untouched)."""
    import copy

    import torch_xla

    def on_the_host(pred, y):
        return pred.cpu()[y.cpu() >= 0].mean()

    with pytest.raises(Wrong, match="the result is on cpu"):
        nb00.check_masked_mean(on_the_host)

    def host_then_back(pred, y):
        return on_the_host(pred, y).to(pred.device)

    with pytest.raises(Wrong, match="device->host transfer"):
        nb00.check_masked_mean(host_then_back)

    def spelled_to_cpu(model, opt, batches):
        d = next(model.parameters()).device
        total = 0.0
        for x, y in batches:
            opt.zero_grad()
            loss = F.cross_entropy(model(x.to(d)), y.to(d))
            loss.backward()
            opt.step()
            total += loss.detach().to("cpu").item()  # a read per step, spelled another way
            torch_xla.sync()
        return total / len(batches)

    with pytest.raises(Wrong, match=r"6 device->host reads in 6 steps"):
        nb00.check_quiet_epoch(spelled_to_cpu)

    def on_a_cpu_copy(model, opt, batches):
        cpu = copy.deepcopy(model).cpu()
        copt = torch.optim.SGD(cpu.parameters(), lr=0.1)
        total = 0.0
        for x, y in batches:
            copt.zero_grad()
            loss = F.cross_entropy(cpu(x), y)
            loss.backward()
            copt.step()
            total += loss.item()
        return total / len(batches)

    with pytest.raises(Wrong, match="device->host reads in 6 steps .*deepcopy|not those of an epoch of training"):
        nb00.check_quiet_epoch(on_a_cpu_copy)
