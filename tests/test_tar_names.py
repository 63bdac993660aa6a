"""Tar members as tar tools read them: a name that is not UTF-8 is a corrupt member named by shard and offset
(skipped with skip_corrupt), and a pax `size=` record sets the next member's size, as it does for tarfile."""

import io
import tarfile

import pytest

from data_tools.tario import TarFormatError, iter_tar


def _member(tf, name, data: bytes):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tf.addfile(info, io.BytesIO(data))


def test_a_name_that_is_not_utf8_is_named_not_a_bare_unicode_error():
    buf = io.BytesIO()
    with tarfile.open(
        fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT, encoding="utf-8", errors="surrogateescape"
    ) as tf:
        _member(tf, "s0.cls", b"1")
        _member(tf, b"s1\xff\xfe.cls".decode("utf-8", "surrogateescape"), b"2")
    buf.seek(0)
    it = iter_tar(buf)
    assert next(it) == ("s0.cls", b"1")
    with pytest.raises(TarFormatError, match=r"member name b's1\\xff\\xfe.cls' at byte 1024 is not UTF-8"):
        next(it)


def _block(name: bytes, size_field: int, kind: bytes) -> bytes:
    h = bytearray(512)
    h[: len(name)] = name
    h[100:108] = b"0000644\0"
    h[108:116] = h[116:124] = b"0000000\0"
    h[124:136] = b"%011o\0" % size_field
    h[136:148] = b"00000000000\0"
    h[156:157] = kind
    h[257:263] = b"ustar\0"
    h[263:265] = b"00"
    h[148:156] = b" " * 8
    h[148:156] = b"%06o\0 " % sum(h)
    return bytes(h)


def test_a_pax_size_record_sets_the_members_size_as_tar_tools_read_it():
    record = b"size=5\n"
    rec = b"%d %s" % (len(record) + 3, record)  # "LEN size=5\n", LEN counting itself
    pax = _block(b"PaxHeader", len(rec), b"x") + rec.ljust(512, b"\0")
    member = _block(b"s0.txt", 0, b"0") + b"hello".ljust(512, b"\0")  # the ustar size says 0, pax says 5
    data = pax + member + b"\0" * 1024
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        (m,) = tf.getmembers()
        assert (m.name, m.size, tf.extractfile(m).read()) == ("s0.txt", 5, b"hello")
    assert list(iter_tar(io.BytesIO(data))) == [("s0.txt", b"hello")]


def test_the_stream_names_the_shard_and_skip_corrupt_skips(tmp_path):
    from data_tools.manifest import ShardError
    from data_tools.shard_reader import read_shard

    path = tmp_path / "odd-000000.tar"
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT, encoding="utf-8", errors="surrogateescape") as tf:
        _member(tf, "s0.cls", b"1")
        _member(tf, b"s1\xff.cls".decode("utf-8", "surrogateescape"), b"2")
    kw = dict(entry=None, generation=None, verify=False, timeout=10)
    with pytest.raises(ShardError, match=r"shard .*odd-000000.tar: corrupt .* is not UTF-8"):
        list(read_shard(str(path), skip_corrupt=False, **kw))
    lost = []
    got = list(read_shard(str(path), skip_corrupt=True, count_skip=lost.append, **kw))
    assert len(got) <= 1 and lost == [1]  # the sample being assembled when the bad name came may be lost with it
