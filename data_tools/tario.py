"""A fast reader for the uncompressed tar shards that data_tools writes (any ustar/pax/GNU tar).

    from data_tools.tario import iter_tar
    with open("train-000000.tar", "rb") as f:
        for name, data in iter_tar(f): ...        # ("train-0000000.png", b"\\x89PNG...")

Why not tarfile: per member it costs 3.7x what iter_tar costs in stream mode ("r|", the only
mode for a gs:// or http stream) and 2.9x with random access ("r:"): 49 and 38 us vs 13 us per
member, beside 192 us for a 32x32 PNG decode (bench/bench_tario.py, one 1,438-sample shard in
memory, best of 7, on a shared 2-core machine under load: the ratios hold, the absolute figures
are slower than on an idle one). Any cut of the archive raises TarFormatError (tarfile accepts a
file that stops cleanly between members).
"""

from __future__ import annotations


class TarFormatError(ValueError):
    """A tar header fails its checksum or the archive ends inside a member."""


class TarGroupError(ValueError):
    """A member's group name differs from the one the caller expects (see iter_tar's `group`)."""


class CompressedTar(ValueError):
    """The shard is a compressed tar (.tar.gz, .tar.bz2, .tar.xz, .tar.zst): not read; never taken for a corrupt one."""


COMPRESSED = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"\x28\xb5\x2f\xfd": "zstd"}


def _read_exact(f, n: int) -> bytes:
    data = f.read(n)
    while len(data) < n:  # streams (gs://, pipes) may return short reads
        more = f.read(n - len(data))
        if not more:
            break
        data += more
    return data


MAX_MEMBER = 1 << 30  # bytes: a member larger than this (or than its shard) is a broken size field


def _text(raw: bytes, what: str, offset: int) -> str:
    """A name field as text; one that is not UTF-8 is a corrupt member, named by its bytes and offset."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise TarFormatError(f"{what} {raw[:60]!r} at byte {offset} is not UTF-8") from None


def iter_tar(f, group: str | None = None, max_member: int = MAX_MEMBER):
    """(name, bytes) of each regular file in an uncompressed tar stream (ustar, pax, GNU long names).

    Reads the 512-byte headers directly (checksums verified; see the module docstring for the cost). With `group`, every regular member's
    group name (the ustar gname field) must equal it, else TarGroupError (one bytes compare per member).
    A header whose size field exceeds `max_member` (pass the shard's size when known) is a
    TarFormatError before anything is read: a corrupt field must not ask for petabytes of memory."""
    want = group.encode().ljust(32, b"\0")[:32] if group is not None else None
    long_name = pax_size = None
    offset = 0
    while True:
        h = _read_exact(f, 512)
        start = offset  # this member's header
        kind = next((k for magic, k in COMPRESSED.items() if offset == 0 and h.startswith(magic)), None)
        if kind:
            raise CompressedTar(f"a {kind}-compressed tar: not supported; decompress it (shards are read as plain tar)")
        if h == b"\0" * 512:
            return  # end-of-archive blocks (what follows is padding)
        if not h:  # tar writers always end with zero blocks: a clean cut between members is truncation
            raise TarFormatError(f"archive ends at byte {offset} without the end-of-archive blocks")
        if len(h) < 512:
            raise TarFormatError(f"archive ends inside a header at byte {offset}")
        try:
            stored = int(h[148:156].replace(b"\0", b" ").strip() or b"0", 8)
            size = (
                int.from_bytes(h[125:136], "big")
                if h[124] & 0x80
                else int(h[124:136].replace(b"\0", b" ").strip() or b"0", 8)
            )
        except ValueError:
            raise TarFormatError(f"unreadable tar header at byte {offset}") from None
        if stored != sum(h) - sum(h[148:156]) + 8 * 32:
            raise TarFormatError(f"tar header checksum mismatch at byte {offset}")
        if pax_size is not None and h[156:157] != b"x":  # a pax record's size overrides this header's
            size, pax_size = pax_size, None
        if size > max_member:
            raise TarFormatError(f"member at byte {offset} claims {size} bytes, more than the {max_member} allowed")
        pad = -size % 512
        data = _read_exact(f, size + pad)
        if len(data) < size + pad:
            member = h[:100].split(b"\0", 1)[0].decode("utf-8", "replace")
            raise TarFormatError(f"archive ends inside member {member!r} at byte {offset}")
        data = data[:size] if pad else data
        offset += 512 + size + pad
        kind = h[156:157]
        if kind == b"x":  # pax extended header: "LEN key=value\n" records; only path matters here
            for rec in data.split(b"\n"):
                _, _, kv = rec.partition(b" ")
                if kv.startswith(b"path="):
                    long_name = _text(kv[5:], "pax path", start)
                elif kv.startswith(b"size="):  # tar tools read the next member with this size: so do we
                    try:
                        pax_size = int(kv[5:])
                    except ValueError:
                        raise TarFormatError(f"unreadable pax size record {kv[:40]!r} before byte {offset}") from None
            continue
        if kind == b"L":  # GNU long name
            long_name = _text(data.rstrip(b"\0"), "GNU long name", start)
            continue
        if kind not in (b"0", b"\0", b"7"):  # directories, links, global headers: no sample data
            long_name = None
            continue
        if want is not None and h[297:329] != want:
            found = h[297:329].split(b"\0", 1)[0].decode("utf-8", "replace")
            raise TarGroupError(f"member at byte {offset - 512 - size - pad} has group {found!r}, expected {group!r}")
        if long_name is None:
            name = _text(h[:100].split(b"\0", 1)[0], "member name", start)
            prefix = _text(h[345:500].split(b"\0", 1)[0], "name prefix", start) if h[257:262] == b"ustar" else ""
            name = f"{prefix}/{name}" if prefix else name
        else:
            name, long_name = long_name, None
        yield name, data
