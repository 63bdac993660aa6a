"""Byte-level text corpora and fixed-shape (B, T) batches for language models.

    data = load_corpus("offline")                 # bytes; no download
    train, val = split(data)                      # 90% / 10%
    batches = TextBatches(train, batch_size=16, block_size=64, steps=100, seed=0)
    for x, y in batches: ...                      # int64 (16, 64) each; y is x shifted by one byte

Corpora:
- "offline": the Python Language Reference as shipped inside every CPython (the standard
  library's `pydoc_data.topics`, the text `help("if")` prints): ~460 KB of real English prose
  about Python, with code samples, on any machine, no network. Sections in sorted key order, so
  the bytes are the same for a given Python version.
- "shakespeare": Karpathy's tiny-shakespeare (~1.1 MB), downloaded once to a cache folder
  (LABKIT_CACHE or ~/.cache/labkit) only when asked for; a clear error when offline.
- a path: any file, read as bytes.

Bytes are the tokens (vocabulary 256): no tokenizer to download or train, at the price of
sequences ~4x longer than with a BPE tokenizer for the same text.

Batches are random windows drawn with a seeded torch.Generator, so a run is reproducible, and
always the same shape, so XLA compiles the training step once (a short last batch would be a
new shape, i.e. a recompilation).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .urls import http_opener, http_request, redact

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"


def offline_text() -> bytes:
    """The Python Language Reference topics bundled with CPython (pydoc_data), UTF-8."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


def cache_dir() -> Path:
    return Path(os.environ.get("LABKIT_CACHE") or Path.home() / ".cache" / "labkit")


def download(url: str, name: str, timeout: float = 20.0) -> Path:
    """Fetch url into the cache once (atomic rename); later calls read the cached file."""
    path = cache_dir() / name
    if path.exists() and path.stat().st_size > 0:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".part")
    try:
        # http_request: user info goes in an Authorization header, not to DNS
        with http_opener().open(http_request(url), timeout=timeout) as r, open(tmp, "wb") as f:
            f.write(r.read())
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ConnectionError(
            f"could not download {redact(url)} to {path}: {redact(e)}. Offline? Use load_corpus('offline')"
        ) from e
    tmp.replace(path)
    return path


def load_corpus(name: str = "offline") -> bytes:
    """'offline', 'shakespeare' or a file path -> the corpus as bytes."""
    if name == "offline":
        return offline_text()
    if name == "shakespeare":
        return download(SHAKESPEARE_URL, "tinyshakespeare.txt").read_bytes()
    path = Path(name).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"corpus {name!r} is neither 'offline', 'shakespeare' nor an existing file")
    return path.read_bytes()


def corpus_source(name: str) -> str:
    """Plain words for where the text comes from (for notebooks and logs)."""
    if name == "offline":
        return "the Python Language Reference bundled with CPython (pydoc_data.topics)"
    if name == "shakespeare":
        return f"tiny-shakespeare ({SHAKESPEARE_URL})"
    return f"the file {name}"


def split(data: bytes, val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val) uint8 tensors: the first 90% and the last 10% (contiguous, so no window
    straddles both)."""
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    n = int(len(t) * (1 - val_fraction))
    return t[:n], t[n:]


def decode(tokens) -> str:
    """Token ids (list or tensor) -> text; bytes that are not valid UTF-8 become U+FFFD."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.tolist()
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


def encode(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


class TextBatches:
    """`steps` batches of random windows per pass: x = data[i:i+T], y = data[i+1:i+T+1].

    Each pass draws from torch.Generator(seed, epoch, rank): the same seed gives the same
    batches; set_epoch (the Trainer calls it) gives a new draw per epoch unless fixed=True (use
    that for evaluation: the same windows every time, so val losses compare). rank/world_size
    give each replica its own windows. name: shown in errors.

    shared_order=True: every replica draws the whole step's batch (batch_size x world_size windows)
    from one generator that ignores rank and world size, and keeps rows rank*B..(rank+1)*B. The data a
    step sees then depends only on the global batch, not on how it is split: 2 ranks x 8 windows train
    on exactly the windows of 1 process x 16 (how tests check DDP and SPMD against one process). With
    one replica it yields the same batches as shared_order=False."""

    def __init__(
        self,
        data,
        batch_size: int,
        block_size: int,
        steps: int,
        seed: int = 0,
        fixed: bool = False,
        rank: int = 0,
        world_size: int = 1,
        name: str = "corpus",
        shared_order: bool = False,
    ):
        if not isinstance(data, torch.Tensor):
            data = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if len(data) < block_size + 2:
            raise ValueError(
                f"{name} has {len(data)} bytes: too short for block_size={block_size} "
                f"(needs at least {block_size + 2}); use a longer text or a smaller block_size"
            )
        self.data, self.batch_size, self.block_size, self.steps = data, batch_size, block_size, steps
        self.seed, self.fixed, self.rank, self.world_size, self.epoch = seed, fixed, rank, world_size, 0
        self.shared_order = shared_order
        self._offsets = torch.arange(block_size + 1)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        rank, world = (0, 1) if self.shared_order else (self.rank, self.world_size)
        g = torch.Generator().manual_seed(hash((self.seed, 0 if self.fixed else self.epoch, rank, world)) % 2**63)
        hi = len(self.data) - self.block_size - 1  # last valid start (exclusive upper bound + 1)
        draw = self.batch_size * (self.world_size if self.shared_order else 1)
        mine = (
            slice(self.rank * self.batch_size, (self.rank + 1) * self.batch_size) if self.shared_order else slice(None)
        )
        for _ in range(self.steps):
            starts = torch.randint(0, hi + 1, (draw,), generator=g)[mine]
            win = self.data[starts[:, None] + self._offsets].long()  # (B, T+1), one gather
            yield win[:, :-1].contiguous(), win[:, 1:].contiguous()

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.block_size
