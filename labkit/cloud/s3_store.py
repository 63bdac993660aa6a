"""An s3:// prefix as a checkpoint store (AWS S3 or an S3-compatible server): create-only objects, a writer
lock object with a lease, and conditional replacement (the checkpoint `latest` pointer), like GCSStore.

    store = S3Store("s3://bucket/run", retry_deadline_s=60)   # or labkit.cloud.open_store("s3://bucket/run")

Credentials and the endpoint come from the usual AWS settings, read by botocore itself (AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY or AWS_PROFILE / ~/.aws; AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL for MinIO, R2 or a
local server), as data_tools reads s3:// shards. Needs boto3 >= 1.36 (the `[s3]` extra; requirements.txt pins it).

How each guarantee is made (S3 conditional writes: If-None-Match since Aug 2024, If-Match since Nov 2024;
conditional deletes on general-purpose buckets since Sep 2025, per AWS's announcements, not verified here):
  put_if_absent   PutObject If-None-Match: * ; 412 -> FileExistsError, unless the object there carries our
                  crc (a retry of our own upload whose reply was lost).
  put_if_version  PutObject If-Match: ETAG (If-None-Match: * to create); 412 -> VersionConflict.
  the writer lock `.writer.lock`, created create-only, proved by its ETag before each commit point, renewed
                  (If-Match) at most once a minute, aged by its LastModified against the same reply's Date
                  header (the server's clock, never this machine's); released by DeleteObject If-Match.
An ETag names content (plain S3: the MD5), not a write; the pointer and lock bodies differ per write that
matters (a step, a writer's random id), so a stale version or a taken-over lock shows a new ETag.

Verified here, against moto 5.2.5's server on 127.0.0.1 (tests/test_s3_store.py): If-None-Match: * on
PutObject (412), If-Match on PutObject (412; 404 NoSuchKey for a missing object) and If-Match on DeleteObject
(412, the object stays). Not verified here: the x-amz-checksum-crc32c header sent with `crc` (moto 5.2.5
neither checks nor echoes it; real S3 answers 400 BadDigest to a mismatch and echoes ChecksumCRC32C, compared
here), and the 409 ConditionalRequestConflict of two conditional writes racing on one key (moto never sends
it). One PutObject carries at most 5 GiB; larger needs a multipart upload, not written here.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from email.utils import parsedate_to_datetime

from labkit.cloud.gcs import check_bucket
from labkit.cloud.gcs_store import LEASE_S
from labkit.cloud.lease import ObjectLock
from labkit.cloud.protocol import VersionConflict
from labkit.cloud.store import LOCK, _Staging, _sweep, check_root
from labkit.redact import redact

MAX_PUT = 5 << 30  # S3's limit for one PutObject
META = "labkit-crc32c"  # user metadata: the crc32c an upload was sent with (how a retry finds its own object)
_TAKEN = {"PreconditionFailed", "412"}  # a condition did not hold
_RACE = {"ConditionalRequestConflict", "409"}  # real S3: another conditional write on the key is in flight
_MISSING = {"NoSuchKey", "404", "NotFound"}
_CREDS = "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE / ~/.aws"


def is_s3(url) -> bool:
    return str(url).startswith("s3://")


def parse_url(url: str) -> tuple[str, str]:
    """("bucket", "prefix/") of s3://bucket/prefix (prefix "" for the whole bucket)."""
    bucket, _, prefix = str(url)[len("s3://") :].partition("/")
    if not bucket:
        raise ValueError(f"{redact(url)!r}: expected s3://BUCKET/PREFIX")
    check_bucket("s3", bucket, str(url))  # user info or a bad name: a parameter error, before botocore sees it
    prefix = prefix.strip("/")
    return bucket, prefix + "/" if prefix else ""


def _code(e) -> str:
    err = e.response.get("Error") or {}
    return str(err.get("Code") or e.response.get("ResponseMetadata", {}).get("HTTPStatusCode"))


def _client(session, timeout: float, attempts: int):
    from botocore.config import Config

    cfg = Config(connect_timeout=timeout, read_timeout=timeout, retries={"max_attempts": attempts, "mode": "standard"})
    return session.client("s3", config=cfg)


class S3Store(ObjectLock, _Staging):
    """s3://bucket/prefix: create-only objects (If-None-Match), a lock object, and conditional replacement
    (If-Match: the ETag last read; None to create)."""

    def __init__(self, root, retry_deadline_s: float = 60):
        self.root = check_root(root).rstrip("/")
        self.bucket, self.prefix = parse_url(self.root)
        try:  # a session of its own: boto3's default one keeps the credentials it found first
            import boto3
        except ImportError:
            raise ImportError("writing to s3:// needs boto3: pip install boto3") from None
        session, timeout = boto3.session.Session(), min(120, retry_deadline_s + 5)
        # botocore's standard retries: a random backoff of up to 1, 2, 4, 8 s between tries; 5 tries wait up to
        # 15 s in all, 3 up to 3 s: the count that stays within retry_deadline_s
        self._s3 = _client(session, timeout, attempts=5 if retry_deadline_s >= 15 else 3)
        # no retries for a replacement guarded by If-Match: a retry could read a 412 for our own first success
        self._once = _client(session, timeout, attempts=1)
        self.endpoint = self._s3.meta.endpoint_url
        with self._errors(None, "ListBucket"):  # missing bucket: FileNotFoundError now, not at the first save
            self._s3.head_bucket(Bucket=self.bucket)
        self._rm_hint = "remove it with `aws s3 rm"
        self._tmp = os.path.join(tempfile.gettempdir(), "labkit-ckpt")
        os.makedirs(self._tmp, exist_ok=True)
        _sweep(self._tmp)  # a killed run otherwise leaks one checkpoint-sized file per kill

    def url(self, name):
        return f"{self.root}/{name}"

    def local_path(self, name):
        return None

    def _key(self, name):
        return self.prefix + name

    @contextlib.contextmanager
    def _errors(self, name, action):
        """botocore's errors as the ones a local file gives, naming the object, the bucket or what to set."""
        from botocore.exceptions import ClientError, HTTPClientError, NoCredentialsError
        from botocore.exceptions import ConnectionError as Unreachable

        url = f"s3://{self.bucket}" if name is None else self.url(name)
        try:
            yield
        except NoCredentialsError:
            raise PermissionError(f"{url}: no AWS credentials ({_CREDS})") from None
        except ClientError as e:
            code = _code(e)
            if code == "NoSuchBucket" or (name is None and code in _MISSING):
                raise FileNotFoundError(
                    f"bucket {self.bucket} does not exist at {self.endpoint} (create it, or point AWS_ENDPOINT_URL_S3 "
                    "at the server that holds it)"
                ) from None
            if code in _MISSING:
                raise FileNotFoundError(f"{url} does not exist (deleted from the bucket?)") from None
            if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                raise PermissionError(
                    f"{url}: access denied ({code}); the credentials ({_CREDS}) need s3:{action} on bucket {self.bucket}"
                ) from None
            if code in ("BadDigest", "InvalidDigest", "XAmzContentChecksumMismatch"):
                raise OSError(f"crc32c mismatch for {url}: the server's checksum of the bytes sent is not ours") from e
            raise OSError(redact(f"{url}: {action} failed ({code}): {e}")) from e
        except (Unreachable, HTTPClientError) as e:  # no endpoint, timeouts (after botocore's retries)
            raise ConnectionError(
                f"{url}: {action} could not reach the S3 endpoint {self.endpoint} (AWS_ENDPOINT_URL_S3 sets another): "
                f"{type(e).__name__}: {redact(e)}"
            ) from None

    # -- objects ------------------------------------------------------------------------------------
    def _put(self, client, name, src, crc=None, **cond) -> dict:
        kw = dict(Bucket=self.bucket, Key=self._key(name), **cond)
        if crc is not None:  # real S3 recomputes it and refuses a mismatch (400 BadDigest)
            kw.update(ChecksumCRC32C=crc, Metadata={META: crc})
        if isinstance(src, bytes):
            return client.put_object(Body=src, **kw)
        size = os.path.getsize(src)
        if size > MAX_PUT:
            raise OSError(
                f"{src} is {size >> 20} MiB: one S3 PutObject carries at most 5 GiB and this store does no multipart "
                f"upload; save a smaller state, or shard it (format='sharded') before writing to {self.url(name)}"
            )
        with open(src, "rb") as f:
            return client.put_object(Body=f, **kw)

    def _quiet(self, call, codes, name, **kw):
        """call(Bucket=, Key=, **kw)'s reply, or None when S3 answered one of `codes` (a 404, a 412)."""
        from botocore.exceptions import ClientError

        try:
            return call(Bucket=self.bucket, Key=self._key(name), **kw)
        except ClientError as e:
            if _code(e) in codes:
                return None
            raise

    def _mine(self, name, crc) -> bool:
        """Is the object now at `name` our own upload (the crc we sent), retried after a lost reply?"""
        head = self._quiet(self._s3.head_object, _MISSING, name, ChecksumMode="ENABLED")
        return None not in (head, crc) and crc in (head.get("ChecksumCRC32C"), head.get("Metadata", {}).get(META))

    def _upload(self, name, src, crc, create: bool):
        from botocore.exceptions import ClientError

        with self._errors(name, "PutObject"):
            try:
                r = self._put(self._s3, name, src, crc, **({"IfNoneMatch": "*"} if create else {}))
            except ClientError as e:  # 409 (real S3): another create of this name is in flight: taken too
                if not (create and _code(e) in _TAKEN | _RACE):
                    raise
                if self._mine(name, crc):
                    return
                raise FileExistsError(f"{self.url(name)} already exists: another writer saved this name") from None
        if crc is not None and r.get("ChecksumCRC32C") not in (None, crc):
            raise OSError(f"crc32c mismatch for {self.url(name)}: local {crc}, server {r['ChecksumCRC32C']}")

    def put_if_absent(self, name, src, crc=None):
        self._upload(name, src, crc, create=True)

    def put(self, name, src, crc=None):
        self._upload(name, src, crc, create=False)

    def get(self, name) -> bytes:
        with self._errors(name, "GetObject"):
            return self._s3.get_object(Bucket=self.bucket, Key=self._key(name))["Body"].read()

    def open(self, name):
        """A streaming read (botocore's StreamingBody, an io.IOBase: a context manager); a missing object is
        FileNotFoundError here, at the GetObject, before any read."""
        with self._errors(name, "GetObject"):
            return self._s3.get_object(Bucket=self.bucket, Key=self._key(name))["Body"]

    def list(self, prefix: str = "") -> list[str]:
        out = []
        with self._errors(prefix, "ListBucket"):
            for page in self._s3.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.prefix + prefix
            ):
                out += [o["Key"][len(self.prefix) :] for o in page.get("Contents", [])]
        return sorted(n for n in out if n != LOCK)

    def delete(self, name):
        with self._errors(name, "DeleteObject"):  # S3 answers 204 for a missing key too
            self._s3.delete_object(Bucket=self.bucket, Key=self._key(name))

    def move(self, src, dst):
        """S3 has no rename: CopyObject (made by the server, up to 5 GiB), then the delete."""
        with self._errors(src, "CopyObject"):
            self._s3.copy_object(
                Bucket=self.bucket, Key=self._key(dst), CopySource={"Bucket": self.bucket, "Key": self._key(src)}
            )
        self.delete(src)

    # -- a versioned object (the checkpoint pointer: labkit.checkpoint.pointer) --------------------------------
    def get_versioned(self, name):
        """(bytes or None, ETag; None when there is none: the next put_if_version then creates only)."""
        with self._errors(name, "GetObject"):
            r = self._quiet(self._s3.get_object, _MISSING, name)
            return (None, None) if r is None else (r["Body"].read(), r["ETag"])

    def put_if_version(self, name, data, version):
        from botocore.exceptions import ClientError

        cond = {"IfNoneMatch": "*"} if version is None else {"IfMatch": version}
        with self._errors(name, "PutObject"):
            try:
                return self._put(self._once, name, data, **cond)["ETag"]
            except ClientError as e:
                if _code(e) in _TAKEN | _RACE | _MISSING:  # 404: deleted since it was read
                    raise VersionConflict(f"{self.url(name)}: not at version {version}") from None
                raise

    # -- one writer: the rules are labkit.cloud.lease's; here, its five operations on the lock object -------------
    def acquire_writer(self, takeover: bool = False) -> None:
        """Take the lock object (create-only, If-None-Match: *) before the first byte, as GCSStore does:
        takeover=True (a run that resumed this root) replaces another holder's lock with a warning; one older
        than LEASE_S on the server's clock, or left by a dead pid on this host, is taken over too."""
        self._acquire(takeover, LEASE_S)

    def check_writer(self) -> None:
        """Prove we still hold the lock right before a commit point: its ETag must be the one we wrote, else
        RuntimeError and nothing is committed. Cost: one HeadObject per commit point; the lock is rewritten
        (If-Match, the renewal its age is read from) at most once a minute. release_writer deletes it with
        If-Match: our ETag; a server that ignores If-Match on a delete (older S3-compatible ones) would delete
        a lock taken over between that check and the delete: the check narrows that window."""
        self._check(LEASE_S)

    def _lock_create(self, body):
        with self._errors(LOCK, "PutObject"):
            r = self._quiet(self._s3.put_object, _TAKEN | _RACE, LOCK, Body=body, IfNoneMatch="*")
        return None if r is None else r["ETag"]

    def _lock_read(self):
        """One GetObject gives all three: the age is its LastModified against the same reply's Date header."""
        with self._errors(LOCK, "GetObject"):
            r = self._quiet(self._s3.get_object, _MISSING, LOCK)
            if r is None:
                return None
            data = r["Body"].read()
        date = r["ResponseMetadata"].get("HTTPHeaders", {}).get("date")
        # no Date header (a proxy dropped it): age 0, i.e. never stale; both have whole seconds
        age = (parsedate_to_datetime(date) - r["LastModified"]).total_seconds() if date else 0.0
        return data, r["ETag"], age

    def _lock_version(self):
        with self._errors(LOCK, "GetObject"):
            head = self._quiet(self._s3.head_object, _MISSING, LOCK)
        return None if head is None else head["ETag"]

    def _lock_replace(self, body, etag):
        with self._errors(LOCK, "PutObject"):  # no retries (_once): a retry could read a 412 for our own success
            r = self._quiet(self._once.put_object, _TAKEN | _RACE | _MISSING, LOCK, Body=body, IfMatch=etag)
        return None if r is None else r["ETag"]

    def _lock_delete(self, etag):
        with self._errors(LOCK, "DeleteObject"):  # 412: taken over since the check; 404: gone already
            self._quiet(self._s3.delete_object, _TAKEN | _RACE | _MISSING, LOCK, IfMatch=etag)
