"""How PyTorch turns code into a graph: run one model through each capture mode and measure it.

    rows = [measure("eager (CPU)", lambda: model(x)),
            measure("lazy XLA", lambda: lazy_step(model_xla, x_xla), graphs=xla_graphs)]
    print(table(rows))

measure() times the first call (tracing + compiling + running) and the median of the next few
(steady state), and counts the graphs the mode compiled during the first call with the counter
given (`xla_graphs` for torch_xla, `dynamo_graphs` for torch.compile). Every timing waits for the
result (a device->host read on XLA, torch.cuda.synchronize on CUDA) so that it measures the work,
not the dispatch. Used by notebooks/04_graphs_and_compilation.py.
"""

from __future__ import annotations

import statistics
import time


def xla_graphs() -> int:
    """Graphs torch_xla compiled so far in this process (host counter, no device access)."""
    import torch_xla.debug.metrics as met

    d = met.metric_data("CompileTime")
    return d[0] if d else 0


def dynamo_graphs() -> int:
    """Graphs torch.compile (dynamo) has captured so far, graph breaks included."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _wait(out) -> None:
    """Block until `out` is computed: the one read that a timing must include."""
    import torch

    t = out[0] if isinstance(out, (tuple, list)) else out
    if isinstance(t, torch.Tensor):
        if t.device.type == "xla":
            import torch_xla
            import torch_xla.core.xla_model as xm

            torch_xla.sync()  # runs what is pending (nothing when the mode already did) ...
            xm.wait_device_ops()  # ... and waits for it, without a read that would add a graph
        elif t.device.type == "cuda":
            torch.cuda.synchronize(t.device)


def measure(name: str, run, graphs=None, steady: int = 5, note: str = "") -> dict:
    """{'mode', 'graphs', 'first_s', 'steady_s', 'note'}: run() once (first call), then `steady` times.

    graphs: a function returning a running count of compiled graphs (None: '-'). The count covers
    the first call and the steady calls: a mode that compiles again in steady state shows it."""
    g0 = graphs() if graphs else None
    t = time.perf_counter()
    _wait(run())
    first = time.perf_counter() - t
    times = []
    for _ in range(steady):
        t = time.perf_counter()
        _wait(run())
        times.append(time.perf_counter() - t)
    return {
        "mode": name,
        "graphs": graphs() - g0 if graphs else None,
        "first_s": first,
        "steady_s": statistics.median(times),
        "note": note,
    }


def table(rows: list[dict]) -> str:
    """A fixed-width text table of measure() rows. A time that was not measured (NaN: a skipped mode) is '-'."""
    head = f"{'mode':34s} {'graphs':>6s} {'first call':>11s} {'steady':>10s}  note"
    lines = [head, "-" * len(head)]

    def ms(seconds: float, width: int, digits: int) -> str:
        return f"{'-':>{width}s}  " if seconds != seconds else f"{seconds * 1e3:{width}.{digits}f}ms"

    for r in rows:
        g = "-" if r["graphs"] is None else str(r["graphs"])
        lines.append(f"{r['mode']:34s} {g:>6s} {ms(r['first_s'], 9, 1)} {ms(r['steady_s'], 8, 2)}  {r['note']}")
    return "\n".join(lines)
