"""From a training run to a model that serves on any CPU: a serving checkpoint, torch.export, evaluation.

    path = save_for_serving(trainer, metrics, example_x, arch={"name": "resnet50_cifar", ...})  # end of training
    ckpt = load_serving(path)                 # CPU tensors; torch_xla is never imported
    model = build_model(ckpt["arch"]); model.load_state_dict(ckpt["model"])
    ep = export(model, example_x)             # torch.export, batch dimension dynamic
    save_exported(ep, "m.pt2"); ep2 = load_exported("m.pt2")

A checkpoint written on a TPU holds CPU tensors (labkit.checkpoint.to_cpu copies them off the device in
one transfer) in float32: bf16 autocast computes in bfloat16 but keeps float32 weights, so nothing in
the file needs XLA. What can differ on the CPU is the arithmetic: a bf16-autocast forward on the TPU and
a float32 forward on the CPU agree only to bf16 precision (~3 significant digits), and a prediction on
the edge between two classes can flip. The serving checkpoint therefore carries the logits the training
device computed for one batch, so the CPU side can check its own against them with a stated tolerance.
Serving checkpoints go to $LABKIT_ARTIFACTS or ./checkpoints (`artifacts_dir`): one place both
the training notebooks and notebook 05 look.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
import torch.nn.functional as F

FORMAT = "labkit-serving-1"


def artifacts_dir() -> Path:
    """Where serving checkpoints live: $LABKIT_ARTIFACTS if set, else ./checkpoints."""
    return Path(os.environ.get("LABKIT_ARTIFACTS") or "checkpoints")


def build_model(arch: dict) -> torch.nn.Module:
    """The architecture a serving checkpoint names: {"name": "resnet50_cifar" | "gpt", ...its arguments}."""
    args = dict(arch)
    name = args.pop("name", None)
    if name == "resnet50_cifar":
        from labkit.models.resnet import resnet50_cifar

        return resnet50_cifar(**args)
    if name == "gpt":
        from labkit.models.gpt import GPT, GPTConfig

        return GPT(GPTConfig(**args))
    raise ValueError(f"unknown architecture {name!r} in serving checkpoint (expected 'resnet50_cifar' or 'gpt')")


@torch.no_grad()
def device_logits(model, x: torch.Tensor, precision=None) -> torch.Tensor:
    """model(x) on the model's own device, under the run's autocast (a labkit.precision.Precision;
    None: none), as float32 CPU logits."""
    dev = next(model.parameters()).device
    was = model.training
    model.eval()
    try:
        with precision.autocast() if precision is not None else contextlib.nullcontext():
            out = model(x.to(dev))
        out = out[0] if isinstance(out, tuple) else out
        return out.float().cpu()  # one device->host transfer
    finally:
        model.train(was)


def save_for_serving(
    trainer,
    metrics: dict,
    example: torch.Tensor,
    arch: dict,
    meta: dict | None = None,
    path: str | os.PathLike | None = None,
) -> Path:
    """Write the trainer's model (CPU float32 tensors), its architecture, the final evaluation metrics,
    `meta` (plain data: class names, normalisation, where the validation data live) and a reference:
    the training device's logits for `example` under the run's autocast. Atomic (write + rename)."""
    from labkit.checkpoint.state import to_cpu

    module = getattr(trainer, "module", trainer)
    rt, precision = getattr(trainer, "rt", None), getattr(trainer, "precision", None)
    bf16 = getattr(precision, "name", "fp32") == "bf16"  # the reference's tolerance depends on it
    path = Path(path or artifacts_dir() / f"{arch.get('name', 'model')}.pt")
    state = {
        "format": FORMAT,
        "arch": dict(arch),
        "model": to_cpu(module.state_dict(), rt),
        "metrics": {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))},
        "meta": to_cpu(dict(meta or {})),
        "reference": {
            "x": example.detach().cpu(),
            "logits": device_logits(module, example, precision),
            "device": str(getattr(rt, "device", "cpu")),
            "bf16": bf16,
        },
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".part")
    torch.save(state, tmp)
    tmp.replace(path)
    return path


def load_serving(path: str | os.PathLike) -> dict:
    """Read a serving checkpoint on the CPU (weights_only: no code from the file runs)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no serving checkpoint at {path} (written by labkit.serve.export.save_for_serving)")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path} is not a labkit serving checkpoint (format {FORMAT!r})")
    return state


def load_model(path: str | os.PathLike) -> tuple[torch.nn.Module, dict]:
    """(eval-mode CPU model with the checkpoint's weights, the checkpoint dict)."""
    state = load_serving(path)
    model = build_model(state["arch"])
    model.load_state_dict(state["model"])
    return model.eval(), state


def export(model: torch.nn.Module, example: torch.Tensor, max_batch: int = 1024) -> torch.export.ExportedProgram:
    """torch.export of model(example) with the batch dimension dynamic (1..max_batch), in eval mode."""
    batch = torch.export.Dim("batch", min=1, max=max_batch)
    return torch.export.export(model.eval(), (example,), dynamic_shapes=({0: batch},))


def save_exported(ep: torch.export.ExportedProgram, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(ep, path)
    return path


def load_exported(path: str | os.PathLike) -> torch.export.ExportedProgram:
    return torch.export.load(Path(path))


@torch.no_grad()
def evaluate(fn, batches) -> dict:
    """Accuracy and mean cross-entropy of fn(x) -> logits over (x, y) CPU batches; labels < 0 are
    padding (data_tools pads the last evaluation batch with -100) and count for nothing, as in
    labkit.Trainer.evaluate."""
    correct = count = 0
    loss = 0.0
    for x, y in batches:
        out = fn(x)
        out = (out[0] if isinstance(out, tuple) else out).float()
        keep = y >= 0
        correct += int((out.argmax(-1)[keep] == y[keep]).sum())
        count += int(keep.sum())
        loss += float(F.cross_entropy(out, y, ignore_index=-100, reduction="sum"))
    if count == 0:
        raise ValueError("evaluate got no labelled samples")
    return {"val_acc": correct / count, "val_loss": loss / count, "count": count}


class CachedStep(torch.nn.Module):
    """GPT.forward_cached as a module: (idx (B, t), pos (1,), cache) -> logits (B, vocab), cache updated in place."""

    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt

    def forward(self, idx, pos, cache):
        return self.gpt.forward_cached(idx, pos, cache)


def export_decoder(gpt, max_batch: int = 64) -> torch.export.ExportedProgram:
    """torch.export of a GPT's key/value-cached step, batch and token count dynamic (one program serves
    the prefill of a prompt and every one-token step after it). The cache is an input the program
    updates in place; `ep.module()` is what GPT.generate_cached(step=...) takes."""
    gpt = gpt.eval()
    B = torch.export.Dim("batch", min=1, max=max_batch)
    T = torch.export.Dim("tokens", min=1, max=gpt.cfg.block_size)
    idx = torch.zeros(2, 3, dtype=torch.long)
    return torch.export.export(
        CachedStep(gpt),
        (idx, torch.zeros(1, dtype=torch.long), gpt.empty_cache(2)),
        dynamic_shapes=({0: B, 1: T}, None, {2: B}),
    )


def stand_in_resnet(workdir: str | os.PathLike, steps: int = 60, seed: int = 0) -> Path:
    """Train a small stand-in for notebook 01's model on the CPU and write its serving checkpoint under
    workdir (with digits shards for train and val): ResNet-50 with the ImageNet stem, `steps` AdamW steps of
    32 digits. For when no real checkpoint exists; its accuracy is far below a real run's."""
    from data_tools import make_loader, write_dataset
    from labkit.models.resnet import resnet50_cifar

    workdir = Path(workdir)
    for split in ("train", "val"):
        write_dataset("digits", split, str(workdir / split), samples_per_shard=400)
    one = {"rank": 0, "world_size": 1}  # this process alone trains the stand-in: it reads every shard
    train = make_loader(str(workdir / "train" / "manifest.json"), 32, train=True, seed=seed, **one)
    val = make_loader(str(workdir / "val" / "manifest.json"), 32, train=False, mean=train.mean, std=train.std, **one)
    torch.manual_seed(seed)
    model = resnet50_cifar(10, cifar_stem=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    step = 0
    while step < steps:
        for x, y in train:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step == steps:
                break
    model.eval()
    return save_for_serving(
        model,
        evaluate(model, val),
        next(iter(val))[0],
        path=workdir / "resnet50_cifar.pt",
        arch={"name": "resnet50_cifar", "num_classes": 10, "cifar_stem": False},
        meta={
            "source": "digits",
            "val": str(workdir / "val" / "manifest.json"),
            "classes": [str(i) for i in range(10)],
            "mean": train.mean,
            "std": train.std,
        },
    )
