"""LMTrainer on XLA:CPU, and a model trained there (bf16 autocast) served from its checkpoint on a plain CPU."""

import math
import os
import subprocess
import sys

import pytest
import torch

import labkit
from data_tools import text
from labkit.dashboard.health import compile_count
from labkit.lm import LMTrainer
from labkit.models import gpt
from labkit.models.gpt import GPT, GPTConfig
from labkit.serve.export import load_serving, save_for_serving


@pytest.fixture(autouse=True, scope="module")
def xla_first():
    """Start the XLA device before any backward pass (autograd sizes its device queues at the first one)."""
    labkit.setup("xla-cpu")


@pytest.mark.heavy
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])  # bf16 autocast: the TPU default
def test_trainer_lowers_loss_on_xla_without_recompiles(bf16):
    rt = labkit.setup("xla-cpu")
    rt.manual_seed(0)
    train, val = text.split(text.load_corpus("offline"))
    cfg = GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=32)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = gpt.adamw(model, 1e-2, rt=rt)  # built before the Trainer moves the model: it remaps the params
    compiles = []

    class Count:
        def on_step_end(self, trainer, batch):
            compiles.append(compile_count())

    tc = labkit.TrainConfig(max_steps=40, log_every=10)
    tr = LMTrainer(
        model,
        opt,
        rt,
        tc,
        text.TextBatches(train, 8, 32, 40),
        text.TextBatches(val, 8, 32, 2, fixed=True),
        callbacks=[Count()],
        precision=labkit.precision.choose(rt, "bf16" if bf16 else "fp32"),
    )
    hist = tr.fit()
    losses = [h["loss"] for h in hist]
    assert losses[-1] < losses[0] - 0.3 and losses[-1] < math.log(256) - 1.5, losses
    assert len(set(compiles[3:])) == 1, compiles  # flat after warm-up
    ev = tr.eval_history[-1]
    assert ev["val_loss"] < math.log(256) - 1.5 and 0 < ev["val_acc"] < 1


def test_checkpoint_trained_on_xla_with_bf16_serves_on_a_cpu_without_xla(tmp_path):
    rt = labkit.setup("xla-cpu")
    rt.manual_seed(0)
    train, val = text.split(text.load_corpus("offline"))
    cfg = GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=32)
    torch.manual_seed(0)
    model = GPT(cfg)
    tr = LMTrainer(
        model,
        gpt.adamw(model, 1e-2, rt=rt),
        rt,
        labkit.TrainConfig(max_steps=20, log_every=10),
        text.TextBatches(train, 8, 32, 20),
        text.TextBatches(val, 8, 32, 2, fixed=True),
        precision=labkit.precision.choose(rt, "bf16"),
    )
    tr.fit()
    final = tr.evaluate()
    x, _ = next(iter(text.TextBatches(val, 4, 32, 1, fixed=True)))
    path = save_for_serving(tr, final, x, arch={"name": "gpt", **vars(cfg)}, path=tmp_path / "gpt.pt")
    state = load_serving(path)
    assert state["reference"]["bf16"] and state["reference"]["device"].startswith("xla")
    assert state["metrics"]["val_loss"] == pytest.approx(final["val_loss"])
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in state["model"].values())
    # a fresh interpreter with no PJRT_DEVICE: loading and running must not need torch_xla
    code = (
        "import sys, torch; from labkit.serve.export import load_model; "
        f"m, s = load_model({str(path)!r}); ref = s['reference']; "
        "out = m(ref['x'])[0].float(); d = (out - ref['logits']).abs().max().item(); "
        "agree = (out.argmax(-1) == ref['logits'].argmax(-1)).float().mean().item(); "
        "print(d, agree, 'torch_xla' in sys.modules)"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "LABKIT_BACKEND")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    diff, agree, xla_loaded = r.stdout.split()
    # bf16 autocast on the training device vs float32 on the CPU: bf16 has 8 significant bits, so
    # logits of a few units agree to ~0.1; next-byte predictions agree almost everywhere
    assert float(diff) < 0.25 and float(agree) > 0.95, r.stdout
    assert xla_loaded == "False", "loading a serving checkpoint imported torch_xla"
    with pytest.raises(FileNotFoundError, match="no serving checkpoint"):
        load_serving(tmp_path / "missing.pt")
    torch.save({"model": {}}, tmp_path / "plain.pt")
    with pytest.raises(ValueError, match="not a labkit serving checkpoint"):
        load_serving(tmp_path / "plain.pt")
