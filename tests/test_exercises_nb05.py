"""Notebook 05's checkers: the artefact is judged (an ExportedProgram with a symbolic batch, byte counts against
real tensors), so an eager model, a static export, a copied number or a float32 count fail."""

import pytest
import torch

from labkit.lessons.exercises import NotDone, Wrong, nb05


@pytest.fixture(scope="module")
def model_and_x():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10)
    )
    return model.eval(), torch.randn(32, 3, 8, 8)


def test_dynamic_export(model_and_x):
    model, x = model_and_x
    batch = torch.export.Dim("batch", max=1024)
    dynamic = torch.export.export(model, (x[:4],), dynamic_shapes=({0: batch},))
    assert "dynamic batch" in nb05.check_dynamic_export(dynamic, model, x)
    with pytest.raises(Wrong, match="not a Sequential: an eager model answers any batch"):
        nb05.check_dynamic_export(model, model, x)
    with pytest.raises(Wrong, match="batch dimension is a fixed number"):
        nb05.check_dynamic_export(torch.export.export(model, (x[:4],)), model, x)
    other = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 10)).eval()
    with pytest.raises(Wrong, match="outputs differ"):
        nb05.check_dynamic_export(torch.export.export(other, (x[:4],), dynamic_shapes=({0: batch},)), model, x)
    with pytest.raises(NotDone):
        nb05.check_dynamic_export(..., model, x)


def test_int8_size(model_and_x):
    model, _ = model_and_x
    rule = sum(p.numel() * (1 if p.dim() > 1 else 4) for p in model.parameters())
    fp32 = 4 * sum(p.numel() for p in model.parameters())

    def right(m):
        return sum(p.numel() * (1 if p.dim() > 1 else 4) for p in m.parameters())

    assert "within" in nb05.check_int8_size(right, model, int(rule * 1.1), fp32)
    with pytest.raises(Wrong, match="float32 size"):
        nb05.check_int8_size(lambda m: 4 * sum(p.numel() for p in m.parameters()), model, rule, fp32)
    with pytest.raises(Wrong, match="a model of your own shape"):
        nb05.check_int8_size(lambda m: rule, model, rule, fp32)  # this model's number, copied in


def test_kv_cache_bytes():
    def right(L, H, T, d, B):
        return 2 * L * B * T * d * 4

    assert "four shapes" in nb05.check_kv_cache_bytes(right)
    with pytest.raises(Wrong, match="keys AND values"):
        nb05.check_kv_cache_bytes(lambda L, H, T, d, B: L * B * T * d * 4)
    with pytest.raises(Wrong, match="count it once"):
        nb05.check_kv_cache_bytes(lambda L, H, T, d, B: 2 * L * B * T * d * 4 * H)
    with pytest.raises(Wrong, match="you say"):
        nb05.check_kv_cache_bytes(lambda L, H, T, d, B: 2 * L * B * d * d * 4)  # the window confused with the width
    with pytest.raises(Wrong, match="allocating the cache is the measurement"):
        from labkit.models import GPT, GPTConfig

        nb05.check_kv_cache_bytes(
            lambda L, H, T, d, B: GPT(GPTConfig(block_size=T, n_layer=L, n_head=H, n_embd=d)).empty_cache(B).nbytes
        )
    with pytest.raises(Wrong, match="must be a number"):
        nb05.check_kv_cache_bytes(lambda L, H, T, d, B: torch.tensor(2 * L * B * T * d * 4))
    with pytest.raises(Wrong, match="one cache per sequence of the batch"):
        nb05.check_kv_cache_bytes(lambda L, H, T, d, B: 2 * L * T * d * 4)


def test_kv_cache_refuses_every_path_to_the_cache():
    from labkit.models import GPTConfig
    from labkit.models.gpt import GPT, Block  # saved by name before the check runs

    empty_cache = GPT.empty_cache

    def on_meta(L, H, T, d, B):  # no memory used: still allocating the cache
        with torch.device("meta"):
            m = GPT(GPTConfig(block_size=T, n_layer=L, n_head=H, n_embd=d))
        return empty_cache(m, B, device="meta").nbytes

    def from_a_block(L, H, T, d, B):
        Block(GPTConfig(block_size=T, n_layer=L, n_head=H, n_embd=d))
        return 2 * L * B * T * d * 4

    def by_hand(L, H, T, d, B):  # the function called on a stand-in object, never a GPT
        cfg = GPTConfig(block_size=T, n_layer=L, n_head=H, n_embd=d)
        return empty_cache(type("M", (), {"cfg": cfg})(), B, device="meta").nbytes

    for answer in (on_meta, from_a_block, by_hand):
        with pytest.raises(Wrong, match="allocating the cache is the measurement"):
            nb05.check_kv_cache_bytes(answer)

    def small_only(L, H, T, d, B):  # right wherever a cache fits in memory, a guess beyond
        return 2 * L * B * T * d * 4 if T < 1000 else 10**12

    with pytest.raises(Wrong, match="T=(8192|32768)"):
        nb05.check_kv_cache_bytes(small_only)


def test_int8_size_without_an_int8_file_checks_the_rule(model_and_x):
    model, _ = model_and_x
    assert "no int8 file" in nb05.check_int8_size(
        lambda m: sum(p.numel() * (1 if p.dim() > 1 else 4) for p in m.parameters()), model, None, None
    )
    with pytest.raises(Wrong):
        nb05.check_int8_size(lambda m: 1000, model, None, None)


def one_transfer(state):
    """The right answer: one device tensor gathered on the device, copied once, split on the host."""
    flat = torch.cat([t.reshape(-1) for t in state.values()]).cpu()
    parts = flat.split([t.numel() for t in state.values()])
    return {name: p.view(t.shape) for (name, t), p in zip(state.items(), parts)}


def test_to_host_counts_torch_xlas_transfers():
    import labkit

    rt = labkit.setup("xla-cpu")
    assert "in 1 transfer" in nb05.check_to_host(one_transfer, rt)
    with pytest.raises(Wrong, match=r"device->host transfers for \d+ tensors"):  # a .to('cpu') per tensor
        nb05.check_to_host(lambda s: {k: v.to("cpu") for k, v in s.items()}, rt)
    with pytest.raises(Wrong, match="is on xla:0"):  # nothing copied
        nb05.check_to_host(lambda s: dict(s), rt)
    with pytest.raises(Wrong, match="values differ"):  # made on the host, never read from the device
        nb05.check_to_host(lambda s: {k: torch.zeros(v.shape) for k, v in s.items()}, rt)
    with pytest.raises(Wrong, match="labkit's to_cpu/to_host"):
        nb05.check_to_host(lambda s: labkit.checkpoint.state.to_cpu(s, rt), rt)
    # torch_xla's own batched copy, through its Python wrapper and through the C function under it
    import torch_xla
    import torch_xla.core.xla_model as xm

    get_cpu = torch_xla._XLAC._xla_get_cpu_tensors  # a reference saved before the check: still refused
    for own in (
        lambda s: dict(zip(s, xm._maybe_convert_to_cpu(list(s.values())))),
        lambda s: dict(zip(s, get_cpu(list(s.values())))),
    ):
        with pytest.raises(Wrong, match="torch_xla's batched copy"):
            nb05.check_to_host(own, rt)
    with pytest.raises(Wrong, match="your code raised TypeError"):  # an int64 or odd state mixed in by mistake
        nb05.check_to_host(lambda s: {k: v.cpu() + "x" for k, v in s.items()}, rt)
    with pytest.raises(NotDone):
        nb05.check_to_host(lambda s: ..., rt)


def test_to_host_off_xla_checks_values_and_says_nothing_was_counted():
    from labkit.runtime import Runtime

    rt = Runtime("cpu", torch.device("cpu"))
    assert "the transfers were not counted" in nb05.check_to_host(one_transfer, rt)
    with pytest.raises(Wrong, match="values differ"):
        nb05.check_to_host(lambda s: {k: torch.ones(v.shape) for k, v in s.items()}, rt)
    with pytest.raises(Wrong, match="return a dict"):
        nb05.check_to_host(lambda s: list(s.values()), rt)
