"""Checkers for notebook 05 (export and int8). Each one runs the learner's code on models and inputs that change
with every call and judges the artefact it makes: a byte count against real tensors and files, an exported program
by its dynamic dimension and its answers, a copy off the device by where its tensors live and by torch_xla's own
count of device->host transfers."""

from __future__ import annotations

import itertools
import random

import torch

from labkit.lessons.exercises import Wrong, call, close, integer, mistake, number, refusing, require, todo, xla_metric

__all__ = ["check_dynamic_export", "check_int8_size", "check_kv_cache_bytes", "check_to_host"]

_calls = itertools.count(1)


def _rule(model) -> int:
    """What PT2E's x86 quantizer stores: conv and linear weights as int8 (1 byte), everything else float32."""
    return sum(p.numel() * (1 if p.dim() > 1 else 4) for p in model.parameters())


def _other_models(k: int):
    rng = random.Random(k)
    c, w = rng.choice([8, 16, 24]), rng.choice([32, 64, 96])
    yield torch.nn.Sequential(
        torch.nn.Conv2d(3, c, 3),
        torch.nn.BatchNorm2d(c),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(c * 30 * 30, 10),
    )
    yield torch.nn.Sequential(
        torch.nn.Linear(w, 2 * w), torch.nn.GELU(), torch.nn.LayerNorm(2 * w), torch.nn.Linear(2 * w, 7)
    )


def check_int8_size(predict_int8_bytes, model, measured_int8_bytes: int | None, measured_fp32_bytes: int | None) -> str:
    """05.int8_size: predict_int8_bytes(model) -> bytes of the int8 program's weights, from the model alone. Checked
    on two other models against the quantizer's rule, then on `model` against the file section 4 measured (25 %:
    the file also holds scales, zero points and the program)."""
    todo(predict_int8_bytes)
    for other in _other_models(next(_calls)):
        got = number(call(predict_int8_bytes, other), f"predict_int8_bytes of a {len(other)}-layer model")
        want = _rule(other)
        if abs(got - 4 * sum(p.numel() for p in other.parameters())) < 1e-6:
            raise Wrong("that is the float32 size: the quantized weights take 1 byte per element, not 4")
        close(got, want, 0.02, "a model of your own shape", hint="conv/linear weights at 1 byte, the rest at 4")
    if measured_int8_bytes is None:  # no int8 file here (the PT2E flow is missing): the rule alone was checked
        return "the quantizer's rule on two models (no int8 file to compare with here)"
    got = number(call(predict_int8_bytes, model), "predict_int8_bytes(model)")
    if abs(got - measured_fp32_bytes) < 0.1 * measured_fp32_bytes:
        raise Wrong("that is the float32 size: the quantized weights take 1 byte per element, not 4")
    err = close(got, measured_int8_bytes, 0.25, "this model's int8 file")
    return f"within {err:.0%} of the {measured_int8_bytes / 1e6:.1f} MB file"


def _batch_is_dynamic(program) -> bool:
    """The first input's dimension 0 is a symbol (torch.export's Dim), not a number fixed at export."""
    for node in program.graph_module.graph.nodes:
        if node.op == "placeholder" and node.name in program.graph_signature.user_inputs:
            val = node.meta.get("val")
            return val is not None and isinstance(val.shape[0], torch.SymInt)
    return False


def check_dynamic_export(program, model, x: torch.Tensor) -> str:
    """05.dynamic_batch: `program` must be a torch.export.ExportedProgram whose batch dimension is dynamic, answering
    like `model` on batch sizes picked at random (never the one it was traced with, most likely)."""
    todo(program)
    require(
        isinstance(program, torch.export.ExportedProgram),
        f"give the exported program (torch.export.export(...)), not a {type(program).__name__}: an eager model "
        "answers any batch, but it is not what a server loads",
    )
    require(
        _batch_is_dynamic(program), "the batch dimension is a fixed number: export with dynamic_shapes={...: {0: Dim}}"
    )
    rng = random.Random(next(_calls))
    sizes = sorted({1, rng.randint(2, 9), rng.randint(10, x.shape[0])})
    run = program.module()
    with torch.no_grad():
        for b in sizes:
            try:
                got = run(x[:b])
            except Exception as e:
                raise Wrong(f"batch {b} fails ({type(e).__name__}): the program does not accept that size") from None
            want = model(x[:b])
            require(
                tuple(got.shape) == tuple(want.shape), f"batch {b}: shape {tuple(got.shape)}, want {tuple(want.shape)}"
            )
            require(
                bool(torch.allclose(got, want, atol=1e-4, rtol=1e-4)), f"batch {b}: outputs differ from the model's"
            )
    return f"an ExportedProgram with a dynamic batch, right on batches {sizes}"


def check_kv_cache_bytes(kv_cache_bytes) -> str:
    """05.kv_cache: kv_cache_bytes(n_layer, n_head, block_size, n_embd, batch) -> bytes of a float32 key/value
    cache for a whole window, predicted, then compared with the cache labkit's GPT really allocates (empty_cache)
    for four shapes where the window and the width differ, and for one model far too large for this machine (its
    cache made on the meta device, after the answer). Every GPT part's constructor and the cache functions refuse
    while the learner's code runs: allocating the cache is the measurement."""
    from labkit.models import GPTConfig, gpt

    todo(kv_cache_bytes)
    rng = random.Random(next(_calls))
    shapes = []
    for _ in range(4):
        L, H = rng.randint(1, 4), rng.choice([2, 4])
        shapes.append(
            (L, H, rng.choice([24, 40, 72]), H * rng.choice([8, 16]), rng.choice([3, 5, 6, 7]))
        )  # not 2 or 4: dropping the batch would look like dropping K/V or the 4 bytes
    shapes.append((rng.randint(60, 96), 64, rng.choice([8192, 32768]), 64 * 128, rng.randint(9, 40)))  # terabytes
    parts = [gpt.GPT, gpt.Block, gpt.CausalSelfAttention, gpt.MLP, gpt.GPT.empty_cache, gpt.GPT.forward_cached]
    for L, H, T, d, B in shapes:
        with refusing(parts, "predict from the shapes: allocating the cache is the measurement"):
            got = integer(call(kv_cache_bytes, L, H, T, d, B), f"kv_cache_bytes({L}, {H}, {T}, {d}, {B})")
        with torch.device("meta"):  # shapes without memory: the cache of the largest model too
            cache = gpt.GPT(GPTConfig(block_size=T, n_layer=L, n_head=H, n_embd=d, vocab_size=64)).empty_cache(B)
        want = cache.numel() * cache.element_size()
        hint = mistake(
            got,
            want,
            {
                "keys AND values: two tensors per layer": want // 2,
                "the heads split the width: n_head x head_dim = n_embd, count it once": want * H,
                "one cache per sequence of the batch": want // B,
                "float32: 4 bytes per value": want // 4,
            },
        )
        require(
            got == want,
            hint or f"L={L}, heads={H}, T={T}, d={d}, batch {B}: you say {got:,}, the cache is {want:,} bytes",
        )
    return f"four shapes and one of {want / 1e12:.1f} TB: 2 x layers x batch x window x width x 4 bytes"


def _from_device() -> tuple[int, int]:
    """torch_xla's device->host copies in this process: (transfers, bytes), the sample count of its
    TransferFromDeviceTime metric and the total of its InboundData metric (bytes that came in to the host)."""
    return xla_metric("TransferFromDeviceTime")[0], int(xla_metric("InboundData")[1])


def check_to_host(to_host, rt) -> str:
    """05.to_host: to_host(state) -> the same dict of tensors as CPU tensors, copied off the device in ONE
    transfer. The state is a small model's state_dict on `rt.device` (float32; widths and depth drawn anew on every
    call). Checked: a dict with the same names, every value a CPU tensor of the same shape and dtype, equal to the
    device's values; on XLA torch_xla's TransferFromDeviceTime count must rise by exactly 1 (a `.cpu()` per tensor
    is one transfer each); the bytes that came in (InboundData) are reported, not judged. labkit's own batched copies
    refuse while the learner's code runs. Off XLA there is no such count: the values and devices are still checked,
    and the note says the transfers were not counted."""
    from labkit import _xla, accumulate
    from labkit.checkpoint import state as checkpoint_state

    todo(to_host)
    k = next(_calls)
    rng = random.Random(k)
    widths = [rng.choice([8, 12, 20, 28, 36]) for _ in range(rng.randint(3, 5))]
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.LayerNorm(b)]
    torch.manual_seed(k)
    model = torch.nn.Sequential(*layers)
    with torch.no_grad():
        for p in model.parameters():  # LayerNorm starts at ones and zeros: random values, so a guess cannot match
            p.normal_()
    state = model.to(rt.device).state_dict()  # the tensors a training run holds on its device
    rt.sync()  # the upload and any pending work done: what is counted below is the learner's copy alone
    before = _from_device() if rt.reads_metrics else (0, 0)
    library = [_xla.to_cpu, _xla.cpu_tensors, accumulate.to_host, checkpoint_state.to_cpu]
    c_library = []
    if rt.reads_metrics:  # torch_xla's own batched copy: its Python wrapper and the C function under it
        import torch_xla
        import torch_xla.core.xla_model as xm

        library.append(xm._maybe_convert_to_cpu)
        c_library.append(torch_xla._XLAC._xla_get_cpu_tensors)
    why = (
        "write the copy yourself: labkit's to_cpu/to_host and torch_xla's batched copy are what this exercise rebuilds"
    )
    with refusing(library, why, builtins=c_library):
        out = call(to_host, state)
    after = _from_device() if rt.reads_metrics else (0, 0)
    require(isinstance(out, dict), f"return a dict of tensors (name -> tensor), not a {type(out).__name__}")
    require(all(type(n) is str for n in out), "the keys must be the state's names (strings)")
    missing, extra = sorted(set(state) - set(out)), sorted(set(out) - set(state))
    require(not missing and not extra, f"names missing: {missing[:3]}, names not in the state: {extra[:3]}")
    for name, t in state.items():
        v = out[name]
        require(type(v) in (torch.Tensor, torch.nn.Parameter), f"{name}: a {type(v).__name__}, not a tensor")
        require(v.device.type == "cpu", f"{name} is on {v.device}: the copy must live on the host (the CPU)")
        require(
            tuple(v.shape) == tuple(t.shape) and v.dtype == t.dtype,
            f"{name}: {tuple(v.shape)} {v.dtype}, the state has {tuple(t.shape)} {t.dtype}",
        )
    # the checker's own reference copy, after the counts were read
    tensors = list(state.values())
    want = dict(zip(state, accumulate.to_host(tensors)))  # the batched copy on XLA, .cpu() elsewhere
    for name in state:
        require(bool(torch.equal(out[name], want[name])), f"{name}: values differ from the device's")
    if not rt.reads_metrics:
        where = "the model was already on the host" if rt.device.type == "cpu" else f"on {rt.device.type}"
        return f"right names, shapes and values ({where}; no XLA device here: the transfers were not counted)"
    n, nbytes = after[0] - before[0], after[1] - before[1]
    require(
        n == 1,
        f"{n} device->host transfers for {len(state)} tensors: gather them into one device tensor and copy that once "
        "(a .cpu() or .to('cpu') per tensor is one transfer each)",
    )
    size = sum(t.numel() * t.element_size() for t in tensors)
    return f"{len(state)} tensors ({size:,} bytes) in 1 transfer of {nbytes:,} bytes (torch_xla's own counts)"
