"""INT8 post-training static quantization for x86 CPUs (PyTorch 2 export flow + Inductor), and how to measure it.

    from labkit.serve import quantize
    qmodel = quantize.quantize_x86(model, example_batch, calib_batches)   # int8 weights and activations
    fast = quantize.compile_cpu(qmodel, example_batch)                   # Inductor: fused int8 oneDNN kernels
    quantize.throughput(fast, torch.randn(32, 3, 32, 32))                # images/s
    quantize.cpu_flags()                                                 # what the CPU offers for int8

The flow: torch.export captures the model as an ATen graph (batch dimension dynamic);
X86InductorQuantizer annotates convs/linears/adds with observers; prepare_pt2e inserts them; a few
hundred calibration images record activation ranges; convert_pt2e folds the weights to int8 and leaves
quantize/dequantize pairs in the graph; torch.compile (Inductor) then pattern-matches those pairs into
int8 convolutions and matmuls from oneDNN. Without the compile step the quantized graph runs the
dequantize->fp32 op->quantize chain literally and is slower than fp32.

Where the API lives: torch 2.8/2.9 still ship it as torch.ao.quantization (quantize_pt2e,
quantizer.x86_inductor_quantizer) but 2.9 warns that torch.ao.quantization will be removed in 2.10; it
moved to torchao (torchao.quantization.pt2e). `pt2e_api` takes torchao's copy when torchao is installed
and torch's otherwise, so the same code runs on the pinned torch 2.9 with or without torchao.

What to expect: int8 pays off on CPUs with VNNI (AVX512-VNNI, AVX-VNNI: 4 int8 multiply-adds per lane in
one instruction) or AMX (Sapphire Rapids and later: int8 tile matmuls); on AVX2-only CPUs oneDNN needs two
instructions per int8 dot product and the gain comes mostly from moving 4x fewer bytes. How much each case buys
is for the notebook to measure (ResNet-50, batch 32, int8 / fp32 compiled: 2.1x on an AVX2-only EPYC, 3.1x and
5.9x on AVX-512-VNNI hosts, all loaded 2-core machines). `cpu_flags` reads /proc/cpuinfo so a notebook can say
which case it ran in.
"""

from __future__ import annotations

import os
import tempfile
import time
import warnings

import torch

INT8_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")


def cpu_flags(path: str = "/proc/cpuinfo") -> dict:
    """{flag: bool} for the x86 features that decide int8 speed, plus 'model' (the CPU's name)."""
    try:
        text = open(path).read()
    except OSError:
        return {"model": "unknown (no /proc/cpuinfo)", **{f: False for f in INT8_FLAGS}}
    flags, model = set(), "unknown"
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags" and not flags:
            flags = set(value.split())
        elif key.strip() == "model name" and model == "unknown":
            model = value.strip()
    return {"model": model, **{f: f in flags for f in INT8_FLAGS}}


def int8_outlook(flags: dict) -> str:
    """One sentence: what int8 can be expected to buy on a CPU with these flags."""
    if flags.get("amx_int8"):
        return "AMX int8 tiles: the fastest int8 path on a CPU (how much faster than fp32: measured below)"
    if flags.get("avx512_vnni") or flags.get("avx_vnni"):
        return (
            "VNNI: one instruction per 4 int8 multiply-adds, so int8 gains faster arithmetic on top of 4x fewer "
            "bytes (vendors quote 2-4x over fp32 on conv-heavy models; not verified here: measured below)"
        )
    if flags.get("avx2"):
        return (
            "AVX2 without VNNI: an int8 multiply-accumulate takes three instructions (vpmaddubsw, vpmaddwd, "
            "vpaddd) where VNNI's vpdpbusd does it in one, so int8 wins here mostly by moving 4x fewer bytes "
            "(how much: measured below); a VNNI or AMX CPU adds the faster arithmetic on top"
        )
    return "no AVX2: oneDNN falls back to reference int8 kernels; expect int8 to be slow"


def pt2e_api():
    """(prepare_pt2e, convert_pt2e, X86InductorQuantizer, default_config_fn, where) from torchao or torch.ao.

    torch < 2.10 ships the PT2E flow as torch.ao.quantization; from 2.10 it lives only in torchao
    (torchao.quantization.pt2e, torchao >= 0.11). Colab's GPU image pairs torch 2.11 with torchao 0.10, which
    has neither: then this raises ImportError saying what to install (see pt2e_missing())."""
    try:
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
        from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
            X86InductorQuantizer,
            get_default_x86_inductor_quantization_config,
        )

        return prepare_pt2e, convert_pt2e, X86InductorQuantizer, get_default_x86_inductor_quantization_config, "torchao"
    except Exception:  # ImportError, or a torchao built for another torch failing in its own __init__
        pass
    try:
        with warnings.catch_warnings():
            # "torch.ao.quantization ... removed in 2.10": see the docstring
            warnings.simplefilter("ignore", DeprecationWarning)
            from torch.ao.quantization.quantize_pt2e import convert_pt2e, prepare_pt2e
            from torch.ao.quantization.quantizer.x86_inductor_quantizer import (
                X86InductorQuantizer,
                get_default_x86_inductor_quantization_config,
            )
    except ImportError:
        raise ImportError(_missing_message()) from None
    return prepare_pt2e, convert_pt2e, X86InductorQuantizer, get_default_x86_inductor_quantization_config, "torch.ao"


def _missing_message() -> str:
    import importlib.metadata as md

    try:
        tao = f"torchao {md.version('torchao')}, which has no torchao.quantization.pt2e"
    except md.PackageNotFoundError:
        tao = "no torchao"
    return (
        f"x86 INT8 needs the PT2E quantization flow: torch {torch.__version__} no longer ships it "
        f"(torch.ao.quantization.quantize_pt2e was removed in 2.10) and this environment has {tao}. "
        "`pip install -U 'torchao>=0.11'` brings it (on a Colab image this replaces the image's torchao: "
        "restart the runtime after it)"
    )


def pt2e_missing() -> str | None:
    """None when the PT2E INT8 flow can run here, else the reason and the command that fixes it."""
    try:
        pt2e_api()
    except ImportError as e:
        return str(e)
    return None


def batch_dim(max_batch: int = 1024):
    return torch.export.Dim("batch", min=1, max=max_batch)


@torch.no_grad()
def quantize_x86(model: torch.nn.Module, example: torch.Tensor, calibration, max_batch: int = 1024):
    """Post-training static int8 quantization of an image model for x86 (per-channel int8 weights,
    per-tensor uint8 activations). calibration: an iterable of input batches (CPU tensors), a few
    hundred images in all. Returns the converted GraphModule, in eval mode, batch dimension dynamic."""
    prepare_pt2e, convert_pt2e, Quantizer, default_config, _ = pt2e_api()
    model = model.eval()
    # strict=True: torch 2.9's default (non-strict) export no longer records node.meta["source_fn_stack"],
    # which X86InductorQuantizer uses to find convs and linears; without it nothing is annotated and the
    # "quantized" model silently stays float32 (measured). The check after convert_pt2e guards that.
    ep = torch.export.export(model, (example,), dynamic_shapes=({0: batch_dim(max_batch)},), strict=True)
    quantizer = Quantizer().set_global(default_config())
    with warnings.catch_warnings():
        # pt2e's own internals still call torch.export.export_for_training / erase nodes twice: noise, not our code
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        prepared = prepare_pt2e(ep.module(), quantizer)
        n = 0
        for x in calibration:
            prepared(x)
            n += x.shape[0]
        if n == 0:
            raise ValueError("calibration gave no batches: int8 activation ranges need a few hundred real inputs")
        converted = convert_pt2e(prepared)
    if int8_weights(converted) == 0:
        raise RuntimeError(
            "quantize_x86: no int8 weight came out of convert_pt2e; the quantizer matched no conv/linear"
        )
    torch.ao.quantization.move_exported_model_to_eval(converted)  # batch norm / dropout in eval form
    return drop_unused_weights(converted)


def int8_weights(gm) -> int:
    """Number of int8 weight tensors held by a converted GraphModule (0 means nothing was quantized)."""
    return sum(
        1
        for n in gm.graph.nodes
        if n.op == "get_attr" and getattr(getattr(gm, n.target, None), "dtype", None) == torch.int8
    )


@torch.no_grad()
def compile_cpu(model, example: torch.Tensor):
    """torch.compile (Inductor) for CPU inference, compiled now by one call on `example`.

    One graph per batch size (dynamic=False): a batch-dynamic graph does not save the second compile here,
    because Inductor's conv lowering guards on batch >= 16 and recompiles for batch 1 anyway, and
    dynamic=True makes every dimension symbolic and "duck-sizes" equal ones (batch 32 on 32x32 images gets
    one symbol for all three, and batch 1 then fails; both measured with torch 2.9). Freezing folds the
    (int8 or fp32) weights into constants so Inductor can pre-pack them for oneDNN. It is set through
    inductor's config around every call (a later batch size compiles inside the call): passed as
    torch.compile(options={"freezing": True}) instead, the int8 graph fails with "UnsupportedOperatorException:
    onednn.qconv_prepack" (torch 2.9, measured)."""
    import torch._inductor.config as inductor_config

    compiled = torch.compile(model, dynamic=False)

    def run(x):
        with inductor_config.patch(freezing=True):
            return compiled(x)

    run(example)
    return run


@torch.no_grad()
def throughput(fn, x: torch.Tensor, seconds: float = 2.0, warmup: int = 2, min_iters: int = 3) -> float:
    """Examples per second of fn(x): warm-up calls (compiles happen there), then calls for at least
    `seconds` and `min_iters` iterations; the median per-call time, so one slow call on a busy machine
    does not decide the figure."""
    return throughput_spread(fn, x, seconds, warmup, min_iters)[0]


def throughput_spread(
    fn, x: torch.Tensor, seconds: float = 2.0, warmup: int = 2, min_iters: int = 3
) -> tuple[float, float, float]:
    """throughput()'s calls, read three ways: (median, slowest, fastest) examples per second. The same calls, so
    the spread costs no extra time; two figures whose ranges overlap are not ordered by this measurement."""
    for _ in range(warmup):
        fn(x)
    times: list[float] = []
    t_end = time.perf_counter() + seconds
    while len(times) < min_iters or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t0)
    times.sort()
    n = x.shape[0]
    return n / times[len(times) // 2], n / times[-1], n / times[0]


def batch_export(model, example: torch.Tensor) -> torch.export.ExportedProgram:
    """torch.export with a dynamic batch; a converted int8 GraphModule is exported as it is (its train/eval
    switch is disabled by pt2e), anything else in eval mode."""
    if not isinstance(model, torch.fx.GraphModule):
        model = model.eval()
    return torch.export.export(model, (example,), dynamic_shapes=({0: batch_dim()},))


def drop_unused_weights(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Delete parameters and buffers no graph node reads. convert_pt2e leaves the float32 originals on the
    module next to the int8 copies the graph uses; an export would save both (measured: ResNet-50's int8
    program came out 26 % larger than the float32 one)."""
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for name in [k for k, _ in gm.named_parameters()] + [k for k, _ in gm.named_buffers()]:
        if name not in used:
            owner, _, leaf = name.rpartition(".")
            mod = gm.get_submodule(owner) if owner else gm
            if hasattr(mod, leaf):
                delattr(mod, leaf)
    return gm


def size_on_disk(obj, example: torch.Tensor | None = None) -> int:
    """Bytes of a saved model: a state_dict for an nn.Module (torch.save), or an exported program
    (torch.export.save) for a quantized GraphModule (its int8 weights live in the graph's constants)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "model.pt2")
        if isinstance(obj, torch.export.ExportedProgram):
            torch.export.save(obj, path)
        elif isinstance(obj, torch.nn.Module) and example is None:
            torch.save(obj.state_dict(), path)
        else:
            torch.export.save(batch_export(obj, example), path)
        return os.path.getsize(path)
