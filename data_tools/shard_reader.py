"""One shard, read and checked: the samples of a tar stream, its sha256 and sample count checked against
the manifest, and every failure named (a corrupt shard may be skipped; a network error never is).

    from data_tools.shard_reader import read_shard
    for sample in read_shard(url, entry, generation=gen, verify="stream", timeout=60, skip_corrupt=False):
        ...

data_tools.stream.ShardStream deals shards to workers and calls this for each one.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import io
import json
import os
import warnings

from webdataset.tariterators import group_by_keys

from .manifest import GROUP_PREFIX, HashingReader, ShardError, check_digest
from .tario import MAX_MEMBER, CompressedTar, TarFormatError, TarGroupError, iter_tar
from .text import cache_dir
from .urls import DEFAULT_TIMEOUT, ObjectChanged, is_not_found, open_url, redact, scheme_of


def open_shard(url: str, entry, verify, timeout):
    """The shard's byte stream, checked as `verify` asks ("stream": sha256 as the bytes pass, True: read
    whole and check first, False: unchecked); returns (stream, hasher or None)."""
    stream = open_url(url, timeout)
    if not entry or not verify:
        return stream, None
    if verify == "stream":
        stream = HashingReader(stream)
        return stream, stream
    with stream:
        data = stream.read()
    check_digest(len(data), hashlib.sha256(data).hexdigest(), url, entry)
    return io.BytesIO(data), None


def read_shard(url: str, entry, *, generation, verify, timeout, skip_corrupt: bool, count_skip=lambda n: None):
    """Samples of one shard. Only a broken tar or wrong count is corruption (skippable: count_skip(n) is
    told how many samples were lost); a missing object or a network failure always raises."""
    shown = redact(url)  # the URL as messages show it: no password, no token
    limit = entry["bytes"] if entry else MAX_MEMBER  # no member is larger than its shard
    group = GROUP_PREFIX + generation if (entry and generation) else None
    n, key = 0, None
    try:
        stream, hasher = open_shard(url, entry, verify, timeout)
        with stream:
            members = ({"fname": name, "data": data, "__url__": url} for name, data in iter_tar(stream, group, limit))
            seen = set()  # a key met again later (members appended with `tar -r`) would train one sample twice
            for sample in group_by_keys(members):
                if sample["__key__"] in seen:
                    msg = (
                        f"shard {shown}: key {sample['__key__']!r} appears again after {n} sample(s) (appended later?)"
                    )
                    if not skip_corrupt:
                        raise ShardError(msg)
                    count_skip()
                    continue
                seen.add(sample["__key__"])
                n, key = n + 1, sample["__key__"]
                yield sample
            if hasher is not None:
                hasher.finish(url, entry)
    except CompressedTar as e:  # never skipped: every sample of it would be lost
        raise ShardError(f"shard {shown}: {e}") from None
    except TarGroupError as e:
        raise ShardError(
            f"shard {shown} is not from the write that manifest.json describes (generation "
            f"{generation}; {e}): the folder is being rewritten or a rewrite was "
            "interrupted - write it again"
        ) from None
    except ShardError as e:  # sha256 or size differs: the shard's samples were already yielded
        if not skip_corrupt:
            raise
        warnings.warn(str(e), stacklevel=2)
        return
    except (TarFormatError, EOFError) as e:
        msg = f"shard {shown}: corrupt or truncated tar after {n} sample(s) (last key {key!r}): {e}"
        if not skip_corrupt:
            raise ShardError(msg) from e
        count_skip(max(1, (entry["samples"] - n) if entry else 1))
        return
    except ValueError as e:  # webdataset's group_by_keys: two members of one sample with one name
        if "duplicate file name" not in str(e):
            raise
        msg = f"shard {shown}: duplicate member after {n} sample(s) (last key {key!r}): {e}"
        if not skip_corrupt:
            raise ShardError(msg) from None
        count_skip()
        return
    except OSError as e:  # the network or the disk failed: never a corrupt sample, never skipped
        if is_not_found(e):
            raise FileNotFoundError(f"shard not found: {shown}") from None
        # the same type where it takes a message (s3fs's FileExpired does not: `type(e)(msg)` would lose what it
        # said), else OSError; the original stays attached as the cause
        kind = type(e) if type(e).__module__ in ("builtins", ObjectChanged.__module__) else OSError
        raise kind(f"shard {shown}: read failed after {n} sample(s): {type(e).__name__}: {redact(e)}") from e
    except Exception as e:
        if is_not_found(e):  # google-cloud-storage's NotFound is no OSError
            raise FileNotFoundError(f"shard not found: {shown}") from None
        raise
    if entry and n != entry["samples"]:
        msg = f"shard {shown}: {n} samples, manifest says {entry['samples']} (truncated or replaced)"
        if not skip_corrupt:
            raise ShardError(msg)
        count_skip(max(0, entry["samples"] - n))


COUNTS_FILE = "shard-counts.json"


def _count_key(url: str) -> str:
    if scheme_of(url) == "file":  # a local file rewritten in place gets a new key
        path = url.removeprefix("file://")
        st = os.stat(path)
        return f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}"
    return redact(url)  # never a password or a signature in a file: the redacted URL names the same object


def count_samples(urls: list[str], timeout: float = DEFAULT_TIMEOUT) -> list[int]:
    """Samples per shard, for shards without a manifest: each shard is read once (every byte, nothing
    decoded; 8 at a time) and its count kept in LABKIT_CACHE/shard-counts.json for the next run (keyed by the
    redacted URL: no credential is stored; the file is created private, mode 0600)."""
    path = cache_dir() / COUNTS_FILE
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    cache = {k: v for k, v in cache.items() if redact(k) == k}  # an older file's keys with credentials: dropped
    keys = [_count_key(u) for u in urls]
    todo = [i for i, k in enumerate(keys) if not isinstance(cache.get(k), int)]

    def count(i):
        opts = dict(generation=None, verify=False, timeout=timeout, skip_corrupt=False)
        return sum(1 for _ in read_shard(urls[i], None, **opts))

    if todo:
        with concurrent.futures.ThreadPoolExecutor(min(8, len(todo))) as pool:
            for i, n in zip(todo, pool.map(count, todo)):
                if n == 0:
                    raise ShardError(f"shard {redact(urls[i])} holds no samples")
                cache[keys[i]] = n
        try:  # a cache that cannot be written costs a recount next time, nothing else
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.fchmod(fd, 0o600)  # an older file of that name keeps its mode through O_CREAT
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(cache))
            os.replace(tmp, path)
        except OSError:
            pass
    return [cache[k] for k in keys]
