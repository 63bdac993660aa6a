"""manifest.json: what a shard folder holds (shards, counts, sha256, classes, mean/std, generation).

    from data_tools.manifest import load_manifest, verify_manifest
    m = load_manifest("gs://bucket/cifar/train/manifest.json")   # + m["urls"]: one URL per shard
    verify_manifest(m)                                          # sha256 of every shard, names the bad one

Every write of a folder has a `generation` id, stored in the manifest and in every tar header of its
shards (the group-name field, `labkit-<generation>`): a reader compares the two and refuses shards
that a later, unfinished write put under an older manifest.
"""

from __future__ import annotations

import hashlib
import json
import os

from .urls import DEFAULT_TIMEOUT, Wrapper, is_not_found, read_bytes, redact, scheme_of, sibling

MANIFEST = "manifest.json"
FORMAT = "labkit-shards/1"
GROUP_PREFIX = "labkit-"  # tar group name of a member: GROUP_PREFIX + generation (ustar gname: 32 bytes)


class ShardError(ValueError):
    """Bad shard data; the message names the shard URL (and the key when known)."""


def _folder_hint(url: str) -> str | None:
    if scheme_of(url) == "file" and os.path.isdir(url):
        return f"{redact(url)} is a folder; pass {os.path.join(url, MANIFEST)}"
    if url.endswith("/"):
        return f"{redact(url)} looks like a folder; pass {redact(url)}{MANIFEST}"
    return None


def check_shard_name(manifest_url: str, name) -> str:
    """A shard name is a plain file name in the manifest's own folder: no separator, no `.`/`..`, no
    scheme (`x://`), drive (`C:`) or absolute path. Else ShardError naming the manifest and the name:
    `../../other/train-000000.tar` would read another dataset, `/etc/passwd` any file."""
    bad = (
        not isinstance(name, str)
        or name in ("", ".", "..")
        or "/" in name
        or "\\" in name
        or ":" in name  # x://..., C:..., and NTFS streams (name:stream)
        or os.path.isabs(name)
        or "\0" in name
    )
    if bad:
        raise ShardError(
            f"manifest {redact(manifest_url)}: shard name {name!r} is not a plain file name in the manifest's "
            "folder (no /, \\, '..', '.', scheme, drive letter or absolute path): refusing to read it"
        )
    return name


MAX_MANIFEST_BYTES = 64 << 20  # a manifest of a million shards is ~150 MB of JSON; more is not a manifest


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _check_fields(url: str, i: int, s: dict) -> None:
    """Each field of a shard entry has the type and range a reader relies on, else a ValueError naming it."""
    bad = None
    if not _is_count(s["samples"]) or s["samples"] == 0:
        bad = f"samples={s['samples']!r} (a positive integer)"
    elif not _is_count(s["bytes"]):
        bad = f"bytes={s['bytes']!r} (a non-negative integer)"
    elif not (
        isinstance(s["sha256"], str) and len(s["sha256"]) == 64 and all(c in "0123456789abcdef" for c in s["sha256"])
    ):
        bad = f"sha256={s['sha256']!r:.80} (64 lowercase hex digits)"
    if bad:
        raise ValueError(f"manifest {redact(url)}: shard entry {i} ({s['name']!r}) has {bad}")


def _check_stats(url: str, m: dict) -> None:
    """The image fields a reader relies on, each refused naming the manifest and the field (a hand-edited one
    otherwise fails later with an unrelated error: a reshape, a decode): channels a positive integer; mean/std one
    finite number, or one per channel (std > 0: a std of 0 divides every pixel by zero); image_size [height, width]
    of positive integers."""
    import math

    where = f"manifest {redact(url)}"
    channels = m.get("channels", 3)
    if not (_is_count(channels) and channels > 0):
        raise ValueError(f"{where}: channels={channels!r:.80} must be a positive integer")
    for key in ("mean", "std"):
        if key not in m:
            continue
        v = m[key]
        ok = isinstance(v, list) and v and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)
        if not ok or not all(math.isfinite(x) for x in v) or (key == "std" and min(v) <= 0):
            raise ValueError(
                f"{where}: {key}={v!r:.80} must be a list of finite numbers per channel"
                + (", each > 0" if key == "std" else "")
            )
        if len(v) not in (1, channels):
            raise ValueError(
                f"{where}: {key}={v!r:.80} has {len(v)} values for images of {channels} channels: give one per "
                "channel (or one for all)"
            )
    if "image_size" in m:
        size = m["image_size"]
        if not (isinstance(size, list) and len(size) == 2 and all(_is_count(x) and x > 0 for x in size)):
            raise ValueError(f"{where}: image_size={size!r:.80} must be [height, width], two positive integers")
    if "num_classes" in m and not (_is_count(m["num_classes"]) and m["num_classes"] > 0):
        raise ValueError(f"{where}: num_classes={m['num_classes']!r} must be a positive integer")


def load_manifest(url: str, timeout: float = DEFAULT_TIMEOUT) -> dict:
    """Read a manifest.json (path or URL); shard URLs are added as m["urls"]."""
    url = os.fspath(url)
    hint = _folder_hint(url)
    if hint:
        raise IsADirectoryError(hint)
    try:
        data = read_bytes(url, timeout, limit=MAX_MANIFEST_BYTES)
        m = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"manifest {redact(url)} is not valid JSON: {e}") from None
    except RecursionError:
        raise ValueError(f"manifest {redact(url)} nests JSON too deeply to be a manifest") from None
    except Exception as e:
        if is_not_found(e):
            raise FileNotFoundError(f"manifest not found: {redact(url)}") from None
        raise
    if not isinstance(m, dict) or m.get("format") != FORMAT or not isinstance(m.get("shards"), list):
        fmt = m.get("format") if isinstance(m, dict) else type(m).__name__
        raise ValueError(f"{redact(url)} is not a labkit shard manifest (format={fmt!r})")
    if not m["shards"]:
        raise ValueError(f'manifest {redact(url)} lists no shards ("shards": []): rewrite the dataset')
    seen = set()
    for i, s in enumerate(m["shards"]):
        if not isinstance(s, dict) or not {"name", "samples", "bytes", "sha256"} <= set(s):
            raise ValueError(
                f"manifest {redact(url)}: shard entry {i} needs name, samples, bytes and sha256, got {s!r:.200}"
            )
        check_shard_name(url, s["name"])
        if s["name"] in seen:
            raise ShardError(f"manifest {redact(url)} lists shard {s['name']!r} twice: it would be trained twice")
        seen.add(s["name"])
        _check_fields(url, i, s)
    _check_stats(url, m)
    m["urls"] = [sibling(url, s["name"]) for s in m["shards"]]
    m["manifest_url"] = url
    return m


def verify_manifest(manifest: dict | str) -> dict:
    """Read every shard and compare its sha256 and size with the manifest.

    Raises ValueError naming the first shard that differs. Returns the manifest."""
    m = load_manifest(manifest) if isinstance(manifest, (str, os.PathLike)) else manifest
    where = m.get("manifest_url", "(dict)")
    for url, s in zip(m["urls"], m["shards"]):
        check_shard_name(where, s["name"])  # a dict may have been edited after load_manifest
        if url != sibling(where, s["name"]) and "manifest_url" in m:
            raise ShardError(f"manifest {redact(where)}: shard URL {redact(url)} is not beside the manifest")
        data = read_bytes(url)
        check_digest(len(data), hashlib.sha256(data).hexdigest(), url, s)
    return m


def check_digest(size: int, digest: str, url: str, entry: dict) -> None:
    if size != entry["bytes"]:
        raise ShardError(f"shard {redact(url)}: {size} bytes, manifest says {entry['bytes']} (truncated or replaced)")
    if digest != entry["sha256"]:
        raise ShardError(
            f"shard {redact(url)}: sha256 {digest[:16]}... does not match manifest {entry['sha256'][:16]}..."
        )


class HashingReader(Wrapper):
    """Wraps a binary stream and hashes every byte read through it (sha256 as the bytes pass, so
    checking a streamed shard costs no second read; ~0.5 ms per MB)."""

    def __init__(self, f):
        self.raw, self.h, self.size = f, hashlib.sha256(), 0

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self.h.update(data)
        self.size += len(data)
        return data

    def finish(self, url: str, entry: dict) -> None:
        """Read what is left (the tar's zero padding) and compare size and sha256 with the manifest."""
        while self.read(min(1 << 20, max(1, entry["bytes"] - self.size + 1))):
            if self.size > entry["bytes"]:  # a server that pads forever stops here, not at the end of memory
                raise ShardError(f"shard {redact(url)}: more than the {entry['bytes']:,} bytes the manifest lists")
        check_digest(self.size, self.h.hexdigest(), url, entry)
