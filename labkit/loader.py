"""Feed a host DataLoader to the device, overlapping the copy with compute.

    train = labkit.DeviceLoader(torch.utils.data.DataLoader(ds, batch_size=128), rt)
    for x, y in train: ...            # x, y are already on rt.device

- XLA: the runtime chooses how (`feed="auto"`, said once): on a TPU and on XLA:CPU, torch_xla's
  `pl.ParallelLoader`, a background thread that copies batches to the device and keeps a few ready
  (`device_prefetch`). `feed="main"` copies each batch in the training loop's own thread instead, as Lightning
  Fabric does on one XLA device: one graph fewer at warm-up, but on XLA:CPU the copy then waits for the running step
  and stalls the tracing of the next (measured in bench/bench_peers.py). Under SPMD the batch is sharded along dim 0
  over the mesh's "data" axis either way.
- CUDA: pinned host memory, `non_blocking` copies on a side stream, one batch ahead; 4-D image batches turned
  channels_last on that stream when the run's memory format is (`.layout`, which the Trainer sets from its runtime's
  decision: labkit.runtime.layout).
- CPU: pass-through (images in `.layout` too).

Static shapes matter on XLA: a smaller last batch is a new graph, i.e. a recompilation (tens
of seconds for ResNet-50). So a short LAST batch is dropped by default (`drop_partial=True`) and
counted in `.dropped`; any other change of size (a sampler with varying batch sizes) is an error
naming the batch and both sizes, never a silent drop of most of the epoch.

Errors are never swallowed: torch_xla's loader thread catches nothing and closes its queue in a
`finally`, so an exception raised by the host loader (a truncated shard, a bad sample) would
only print a thread traceback and end the epoch early. The host side here catches it in that
thread, and the consumer re-raises the same exception object (original traceback included)
after the batches already queued, on every backend.
"""

from __future__ import annotations

import threading

import torch

from labkit.runtime.layout import CONTIGUOUS, map_tensors


def _leading_dim(batch):
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    if isinstance(batch, dict):
        for v in batch.values():
            return _leading_dim(v)
    if isinstance(batch, (list, tuple)) and batch:
        return _leading_dim(batch[0])
    return None


def _samples(loader) -> int:
    """Samples the loader's epoch holds on this process: its sampler's length, so a DistributedSampler's share (the
    whole dataset over world_size, padded), not the whole dataset's; the dataset's where there is no sampler with a
    length. TypeError where neither is known (an iterable dataset)."""
    try:
        return len(loader.sampler)
    except (AttributeError, TypeError):  # no sampler (a DataLoader-like), or an iterable dataset's endless one
        return len(getattr(loader, "dataset", None))  # None: TypeError, as an unknown length


FEEDS = ("auto", "thread", "main")  # who copies batches to an XLA device: the runtime's choice, a thread, the loop


class _HostSide:
    """What the backend iterates (DeviceLoader.host_batches), with the host loader's length."""

    def __init__(self, owner: DeviceLoader):
        self.owner = owner

    def __iter__(self):
        return self.owner.host_batches()

    def __len__(self):
        return len(self.owner.loader)


class DeviceLoader:
    """Same iteration protocol on every backend: yields batches already on `rt.device`.

    Attributes for the curious: `fetched` (host batches pulled so far, including the ones
    waiting in the prefetch queue), `yielded` (batches handed to the training loop),
    `dropped` (1 when a short last batch was skipped)."""

    def __init__(
        self,
        loader,
        rt,
        *,
        drop_partial: bool = True,
        device_prefetch: int = 4,
        loader_prefetch: int = 8,
        host_to_device_threads: int = 1,
        input_sharding=None,
        feed: str = "auto",
    ):
        if feed not in FEEDS:
            raise ValueError(f"feed must be one of {', '.join(map(repr, FEEDS))}, got {feed!r}")
        self.loader, self.rt, self.drop_partial, self.feed = loader, rt, drop_partial, feed
        self.device_prefetch, self.loader_prefetch = device_prefetch, loader_prefetch
        self.host_to_device_threads = host_to_device_threads
        self.input_sharding = input_sharding
        self.layout = CONTIGUOUS  # the memory format of 4-D image batches (the Trainer sets its runtime's choice)
        self.fetched = self.yielded = self.dropped = 0
        self.skip_batches = 0  # the next iteration skips this many host batches (then resets)
        self._said_short = False  # a dropped short batch of unknown size up front is said once (host_batches)
        self._leftovers = None  # (accum_steps, world_size) while what an epoch leaves out waits for a batch's rows
        self._lock = threading.Lock()
        self._error: BaseException | None = None  # raised by the host loader, re-raised by __iter__

    def __len__(self) -> int:
        """Batches this process's loader yields in an epoch, the short last one dropped (drop_partial)."""
        n = len(self.loader)
        bs = getattr(self.loader, "batch_size", None)
        if self.drop_partial and bs and not getattr(self.loader, "drop_last", True):
            try:
                n = _samples(self.loader) // bs  # the partial batch will be dropped
            except TypeError:
                pass
        return n

    def partial_rows(self) -> int | None:
        """Rows of the short last batch each epoch drops (drop_partial): 0 when the data divides into batches or the
        host loader drops it itself (drop_last), None when its length or batch size is not known up front."""
        bs = getattr(self.loader, "batch_size", None)
        if not self.drop_partial or getattr(self.loader, "drop_last", False):
            return 0
        try:
            return _samples(self.loader) % bs if bs else None
        except TypeError:  # an iterable dataset: its length is not known before it ends
            return None

    def say_leftovers(self, accum_steps: int, world_size: int = 1) -> None:
        """Print once what each epoch leaves out (epoch_leftovers): now, or where a batch's samples are not known up
        front (a list of batches), when the first batch comes (host_batches)."""
        said = epoch_leftovers(self, accum_steps, world_size)
        if said:
            self.rt.master_print(said)
        self._leftovers = (accum_steps, world_size) if said == "" else None

    def set_epoch(self, epoch: int) -> None:
        for obj in (self.loader, getattr(self.loader, "dataset", None)):
            if hasattr(obj, "set_epoch"):
                obj.set_epoch(epoch)
                return

    def __iter__(self):
        self.fetched = self.yielded = self.dropped = 0
        self._error = None
        host = _HostSide(self)
        for batch in self.rt.iterate(self, host):  # the backend's way onto the device (labkit.runtime)
            self.yielded += 1
            yield batch
        err, self._error = self._error, None
        if err is not None:
            raise err  # the same object: its traceback still points into the host loader

    def host_batches(self):
        """The host loader's batches, partial ones dropped, counted; runs in torch_xla's loader thread on XLA,
        so an exception is kept for __iter__ to re-raise after the batches already queued."""
        size = short = None  # rows of the first batch; (index, rows) of a short batch held back
        skip, self.skip_batches = self.skip_batches, 0
        try:
            for i, batch in enumerate(self.loader):
                if i < skip:  # resuming mid-epoch: skipped on the host, never copied to the device
                    continue
                n = _leading_dim(batch)
                size = n if size is None else size
                if self._leftovers is not None and size:  # the first batch tells its rows: say what is left out
                    args, self._leftovers = self._leftovers, None
                    self.rt.master_print(epoch_leftovers(self, *args, rows=size))
                if self.drop_partial and (short is not None or (n is not None and n > size)):
                    j, rows = short if short is not None else (i, n)
                    raise ValueError(
                        f"batch {j} has {rows} rows, batch {skip} had {size}: on XLA every batch but a short "
                        "last one must have the same size (each new size is a new graph); fix the sampler, or "
                        "pass drop_partial=False to accept the recompilations"
                    )
                if self.drop_partial and n is not None and n < size:
                    short = (i, n)  # dropped if it is the last batch, an error if another follows
                    continue
                with self._lock:
                    self.fetched += 1
                yield batch
            if short is not None:
                self.dropped += 1
                if not self._said_short and self.partial_rows() is None:  # the Trainer could not say it up front
                    self._said_short = True
                    self.rt.master_print(
                        f"[labkit] the epoch's short last batch ({short[1]} samples) is left out: every step keeps "
                        "one shape (no recompile)"
                    )
        except GeneratorExit:  # the consumer stopped early (break, max_steps): not an error
            raise
        except BaseException as e:  # in torch_xla's loader thread: hand it to the consumer
            self._error = e

    def data_parallel_sharding(self):
        """The batch split along "data" over a 1-D mesh of every device (SPMD's default)."""
        from labkit.spmd.mesh import make_mesh

        return BatchSharding(make_mesh())

    def xla_batches(self, host, sharding=None):
        """XLA: pl.ParallelLoader uploads batches on a thread, a few ahead of the step (and shards them)."""
        import torch_xla.distributed.parallel_loader as pl

        kwargs = dict(
            loader_prefetch_size=self.loader_prefetch,
            device_prefetch_size=self.device_prefetch,
            host_to_device_transfer_threads=self.host_to_device_threads,
        )
        if sharding is not None:
            kwargs["input_sharding"] = sharding
        loader = pl.ParallelLoader(host, [self.rt.device], **kwargs)
        try:
            yield from loader.per_device_loader(self.rt.device)
        finally:
            loader.close()

    def xla_batches_here(self, host, sharding=None):
        """XLA: each batch copied in this thread when the step asks for it (one host->device transfer per batch, the
        same call pl.ParallelLoader's thread makes), no thread beside the loop's."""
        import torch_xla.core.xla_model as xm

        for batch in host:
            yield xm.send_cpu_data_to_device([batch], self.rt.device, sharding)[0]

    def cuda_batches(self, host):
        """CUDA: pinned host memory, copied on a side stream while the step runs; images turned to the run's memory
        format there too (a permute on the GPU: the host's cores stay on decoding)."""
        stream = torch.cuda.Stream(device=self.rt.device)

        def copy(batch):
            with torch.cuda.stream(stream):
                pinned = map_tensors(batch, lambda t: t.pin_memory() if not t.is_pinned() else t)
                return self.layout.batch(self.rt.to_device(pinned, non_blocking=True))

        it = iter(host)
        nxt = None
        for batch in it:
            nxt = copy(batch)
            break
        while nxt is not None:
            # the consumer's stream must wait for the copy; record_stream stops the allocator
            # from reusing the memory while the side stream still owns it
            torch.cuda.current_stream(self.rt.device).wait_stream(stream)
            map_tensors(nxt, lambda t: t.record_stream(torch.cuda.current_stream(self.rt.device)) or t)
            cur, nxt = nxt, None
            for batch in it:
                nxt = copy(batch)  # one batch ahead, overlapping the consumer's compute
                break
            yield cur


class BatchSharding:
    """SPMD input sharding for batches of mixed rank (images 4-D, labels 1-D): dim 0 split
    over the mesh's "data" axis, other dims replicated. torch_xla's ShardingSpec fits one
    rank only (it silently replicates tensors of another rank), so build one per rank."""

    minibatch = False

    def __init__(self, mesh, axis: str = "data"):
        self.mesh, self.axis, self._specs = mesh, axis, {}

    def xla_spec(self, t: torch.Tensor):
        import torch_xla.distributed.spmd as xs

        if t.dim() == 0:
            return None
        spec = self._specs.get(t.dim())
        if spec is None:
            spec = self._specs[t.dim()] = xs.ShardingSpec(self.mesh, (self.axis,) + (None,) * (t.dim() - 1))
        return spec.xla_spec(t)


def as_device_loader(loader, rt):
    """`loader` as a DeviceLoader on rt (None stays None, a DeviceLoader stays itself)."""
    return loader if loader is None or isinstance(loader, DeviceLoader) else DeviceLoader(loader, rt)


def batch_rows(loader) -> int | None:
    """Samples in one of the loader's batches, known before the first one: its batch_size, or its dataset's (a
    shard stream batches itself: its DataLoader's batch_size is None); None when neither says."""
    host = getattr(loader, "loader", loader)
    bs = getattr(host, "batch_size", None) or getattr(getattr(host, "dataset", None), "batch_size", None)
    return bs if isinstance(bs, int) and not isinstance(bs, bool) and bs > 0 else None


def epoch_leftovers(loader, accum_steps: int, world_size: int = 1, rows: int | None = None) -> str | None:
    """What each epoch leaves out of the training data, and why, as one line (None when nothing is): the short last
    batch (every step keeps one shape, so nothing recompiles) and the batches after the last whole accumulation
    (every optimizer step averages the same number of samples), with the samples each costs. `rows`: samples in a
    batch, where the loader does not say (batch_rows: a list of batches); "" when that number is needed and not
    known yet (DeviceLoader.say_leftovers says it at the first batch). Where the data's length is not known up front, the
    DeviceLoader says so the first time it drops a short batch."""
    if not isinstance(loader, DeviceLoader):
        return None
    bs, short, left = rows or batch_rows(loader), loader.partial_rows(), len(loader) % accum_steps
    if left and bs is None:
        return ""
    parts = []
    if short:
        parts.append(f"{short} in the short last batch (every step keeps one shape: no recompile)")
    if left:
        parts.append(
            f"{left * bs} in the last {left} batch(es), fewer than accum_steps={accum_steps} (every "
            "optimizer step averages the same number of samples)"
        )
    if not parts:
        return None
    lost = (short or 0) + left * (bs or 0)
    each = f" on each of the {world_size} processes ({lost * world_size} in all)" if world_size > 1 else ""
    return f"[labkit] each epoch leaves out, of the training data{each}: " + "; ".join(parts)
