"""torch.export with a dynamic batch, saved and loaded; CPU evaluation that skips padded labels."""

import torch

from labkit.models.resnet import resnet50_cifar
from labkit.serve import export


def test_resnet50_exports_with_a_dynamic_batch_and_reloads(tmp_path):
    torch.manual_seed(0)
    m = resnet50_cifar(10, cifar_stem=False, zero_init_residual=False).eval()
    ep = export.export(m, torch.randn(4, 3, 32, 32))
    path = export.save_exported(ep, tmp_path / "resnet50.pt2")
    loaded = export.load_exported(path).module()
    with torch.no_grad():
        for b in (1, 3, 32):  # none of these is the batch it was exported with
            x = torch.randn(b, 3, 32, 32)
            torch.testing.assert_close(loaded(x), m(x), atol=1e-4, rtol=1e-4)


def test_evaluate_counts_only_labelled_samples():
    w = torch.eye(3)
    batches = [
        (torch.tensor([[5.0, 0, 0], [0, 5.0, 0]]), torch.tensor([0, 2])),
        (torch.tensor([[0, 0, 5.0], [5.0, 0, 0]]), torch.tensor([2, -100])),
    ]  # padded tail
    r = export.evaluate(lambda x: x @ w, batches)
    assert r["count"] == 3 and abs(r["val_acc"] - 2 / 3) < 1e-9
    expect = torch.nn.functional.cross_entropy(
        torch.tensor([[5.0, 0, 0], [0, 5.0, 0], [0, 0, 5.0]]), torch.tensor([0, 2, 2])
    )
    assert abs(r["val_loss"] - expect.item()) < 1e-5


def test_build_model_names_unknown_architectures():
    import pytest

    with pytest.raises(ValueError, match="unknown architecture 'vgg'"):
        export.build_model({"name": "vgg"})
    assert (
        sum(
            p.numel()
            for p in export.build_model(
                {"name": "gpt", "n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 8}
            ).parameters()
        )
        > 0
    )
