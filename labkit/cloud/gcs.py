"""Google Cloud Storage access shared by data_tools and labkit.checkpoint.

    from labkit.cloud import gcs
    bucket, name = gcs.parse_url("gs://my-bucket/shards/train-000000.tar")
    gcs.upload_file("local.tar", "gs://my-bucket/shards/train-000000.tar")   # verified crc32c
    with gcs.open_read("gs://my-bucket/shards/train-000000.tar") as f: ...    # streaming

One `google.cloud.storage.Client` per process (created lazily, re-created after fork),
so connections are reused. With ``STORAGE_EMULATOR_HOST`` set (a loopback server, see
`labkit.cloud.emulator`) the client talks to it with anonymous credentials; otherwise it
uses Application Default Credentials.

Your own bucket, from a notebook:

    gcs.sign_in(P.data_dir, P.checkpoint_dir, project=P.gcp_project)  # only if a path is gs://
    gcs.check_access("gs://my-bucket/run1", write=True)   # clear errors: missing bucket, 403, no credentials

sign_in() uses what the platform offers: Colab `google.colab.auth.authenticate_user()`, Kaggle's
attached Google Cloud SDK credential (Add-ons > Google Cloud Services), elsewhere ADC (a TPU VM's
service account, or `gcloud auth application-default login`). The project comes from the argument,
then GOOGLE_CLOUD_PROJECT, then the credentials; without one the client still reads and writes
existing buckets (Colab's user credentials carry no project: `storage.Client()` would raise
"Project was not passed and could not be determined").
"""

from __future__ import annotations

import base64
import os
import re
import threading

from labkit import envsetup
from labkit.redact import redact  # URLs in messages: user info and token-like query values hidden (the one rule)

_lock = threading.Lock()
_client = None
_client_key = None
_project: str | None = None  # set_project() / sign_in(project=...): a notebook parameter wins

ROLE_HINT = (  # {target} and {role}: each one shell word, quoted where it needs it (shlex.quote)
    "grant it with: gcloud storage buckets add-iam-policy-binding {target} --member=user:YOU@example.com --role={role}"
)


class GCSAuthError(PermissionError):
    """No usable Google credentials; the message says how to sign in on this platform."""


class GCSPermissionError(PermissionError):
    """The credentials lack a permission on the bucket; the message names it and the role that has it."""


class BucketNotFoundError(FileNotFoundError):
    """The bucket does not exist (labkit never creates one silently); the message gives the command."""


def is_gcs(url: str | os.PathLike) -> bool:
    return isinstance(url, str) and url.startswith("gs://")


_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]")  # GCS's and S3's rules (S3: no _, at most 63)
CREDENTIALS_FROM = {
    "gs": "gs:// takes them from sign_in() / Application Default Credentials",
    "s3": "s3:// takes them from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE or ~/.aws",
}


def check_bucket(scheme: str, bucket: str, url: str) -> str:
    """`bucket` if it is a valid bucket name, else ValueError naming the (redacted) URL: a parameter error,
    never retried as a network failure. User info (`s3://KEY:SECRET@bucket`) is refused: credentials never
    travel in a bucket URL, and the name would carry them into every message and request."""
    if "@" in bucket or ":" in bucket:
        raise ValueError(
            f"{redact(url)}: a {scheme}:// URL carries no credentials ({CREDENTIALS_FROM.get(scheme, '')}); "
            "remove the user info before the bucket name"
        )
    if not _BUCKET.fullmatch(bucket):
        raise ValueError(
            f"{redact(url)}: {bucket!r} is no valid bucket name (3-63 lowercase letters, digits, '-', '.', '_')"
        )
    return bucket


def parse_url(url: str) -> tuple[str, str]:
    """'gs://bucket/a/b' -> ('bucket', 'a/b'). Raises ValueError naming the (redacted) URL when malformed."""
    if not is_gcs(url):
        raise ValueError(f"not a gs:// URL: {redact(url)!r}")
    rest = url[len("gs://") :]
    bucket, _, name = rest.partition("/")
    if not bucket:
        raise ValueError(f"gs:// URL has no bucket: {redact(url)!r}")
    return check_bucket("gs", bucket, url), name


def join(url: str, *parts: str) -> str:
    out = url.rstrip("/")
    for p in parts:
        out += "/" + p.strip("/")
    return out


def set_project(project: str | None) -> None:
    """The Google Cloud project for new clients (a notebook parameter); None: environment, then credentials."""
    global _project
    _project = project or None


def project_from_environment() -> str | None:
    for var in ("GOOGLE_CLOUD_PROJECT", "CLOUDSDK_CORE_PROJECT", "GCLOUD_PROJECT"):
        if os.environ.get(var):
            return os.environ[var]
    return None


def _no_credentials(detail: str = "") -> GCSAuthError:
    place = envsetup.detect_platform()
    how = {
        "colab": "call labkit.cloud.gcs.sign_in(path) (google.colab.auth.authenticate_user() under the hood)",
        "kaggle": "attach your Google account under Add-ons > Google Cloud Services (Cloud Storage), "
        "then call labkit.cloud.gcs.sign_in(path)",
    }.get(
        place.split("-")[0],
        "run `gcloud auth application-default login` (or use a VM whose service "
        "account has access), then call labkit.cloud.gcs.sign_in(path)",
    )
    return GCSAuthError(
        f"no Google credentials for Cloud Storage ({place}): {how}" + (f" [{detail}]" if detail else "")
    )


def client():
    """The process-wide storage client (one per pid, emulator setting, project and credentials file)."""
    global _client, _client_key
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    key = (
        os.getpid(),
        emulator,
        _project,
        project_from_environment(),
        os.environ.get("GOOGLE_APPLICATION_CREDENTIALS"),
    )
    with _lock:
        if _client is None or _client_key != key:
            from google.cloud import storage

            if emulator:
                from google.auth.credentials import AnonymousCredentials

                _client = storage.Client(
                    project=_project or project_from_environment() or "labkit-local", credentials=AnonymousCredentials()
                )
            else:
                import google.auth
                from google.auth.exceptions import DefaultCredentialsError

                try:
                    creds, cred_project = google.auth.default()
                except DefaultCredentialsError as e:
                    raise _no_credentials(redact(str(e).splitlines()[0])) from None
                # project=None explicitly (not left out): the client then works without a project for
                # existing buckets instead of raising "Project was not passed and could not be determined"
                _client = storage.Client(
                    project=_project or project_from_environment() or cred_project, credentials=creds
                )
            _client_key = key
        return _client


def sign_in(*paths, project: str | None = None) -> str | None:
    """Sign in to Google Cloud when any of the paths is gs:// (data, checkpoints...); returns how, or None
    when no path needs it. Colab: authenticate_user(); Kaggle: the attached Cloud SDK credential;
    elsewhere: Application Default Credentials, checked now so a missing sign-in fails here, not mid-run."""
    global _client
    if project:
        set_project(project)
    if not any(is_gcs(str(p)) for p in paths if p):
        return None
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        return "emulator (anonymous)"
    place = envsetup.detect_platform()
    if place.startswith("colab"):
        from google.colab import auth

        auth.authenticate_user(**({"project_id": _project} if _project else {}))
        how = "colab (google.colab.auth.authenticate_user)"
    elif place.startswith("kaggle"):
        try:
            from kaggle_secrets import UserSecretsClient

            credential = UserSecretsClient().get_gcloud_credential()
        except Exception as e:  # noqa: BLE001 - kaggle_secrets raises its own NotFoundError/BackendError
            raise _no_credentials(f"{type(e).__name__}: {e}") from None
        path = os.path.join(os.path.expanduser("~"), "gcloud_credential.json")
        with open(path, "w") as f:
            f.write(credential)
        os.environ["GOOGLE_APPLICATION_CREDENTIALS"] = path
        how = "kaggle (attached Google Cloud SDK credential)"
    else:
        how = "application default credentials"
    with _lock:
        _client = None  # new credentials: the next client() picks them up
    client()  # raises GCSAuthError now when there are none
    return how


def _bucket_name(url_or_bucket: str) -> str:
    return parse_url(url_or_bucket)[0] if is_gcs(url_or_bucket) else url_or_bucket


def _forbidden(bucket: str, permission: str, role: str, e) -> GCSPermissionError:
    who = getattr(getattr(client(), "_credentials", None), "service_account_email", None) or "your account"
    return GCSPermissionError(
        f"{who} may not use gs://{bucket}: it lacks {permission} (HTTP 403). The role {role} has it; "
        + ROLE_HINT.format(target=envsetup.shell_words(f"gs://{bucket}"), role=envsetup.shell_words(role))
        + f" (or pick a bucket you own). [{redact(str(e).splitlines()[0])[:200]}]"  # redacted, then cut
    )


def _missing(bucket: str, url: str) -> BucketNotFoundError:
    proj = _project or project_from_environment() or "YOUR_PROJECT"
    return BucketNotFoundError(
        f"GCS bucket {bucket!r} does not exist (from {redact(url)!r}); labkit never creates one silently. Create it "
        "in the TPU's region: "
        + envsetup.shell_words("gcloud", "storage", "buckets", "create", f"gs://{bucket}", f"--project={proj}")
        + " --location=us-central1"
    )


def blob(url: str):
    bucket, name = parse_url(url)
    if not name:
        raise ValueError(f"gs:// URL names a bucket, not an object: {redact(url)!r}")
    return client().bucket(bucket).blob(name)


def crc32c_b64(path_or_bytes) -> str:
    """Base64 big-endian crc32c, the form GCS reports in `blob.crc32c`."""
    import google_crc32c

    c = google_crc32c.Checksum()
    if isinstance(path_or_bytes, (bytes, bytearray, memoryview)):
        c.update(bytes(path_or_bytes))
    else:
        with open(path_or_bytes, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                c.update(chunk)
    return base64.b64encode(c.digest()).decode()


def upload_file(
    path: str | os.PathLike, url: str, *, if_generation_match=None, timeout: float = 120, retry=None
) -> object:
    """Upload a local file and check the server's crc32c against ours. Returns the blob.

    Raises IOError naming the object if the checksums differ (the object is then deleted)."""
    b = blob(url)
    kwargs = {"timeout": timeout, "checksum": "crc32c"}
    if if_generation_match is not None:
        kwargs["if_generation_match"] = if_generation_match
    if retry is not None:
        kwargs["retry"] = retry
    b.upload_from_filename(str(path), **kwargs)
    local = crc32c_b64(path)
    if b.crc32c != local:
        raise OSError(f"crc32c mismatch after upload of {path} to {redact(url)}: local {local}, server {b.crc32c}")
    return b


def open_read(url: str, chunk_size: int = 8 << 20):
    """A streaming binary file object for a gs:// object (no temp file, no subprocess)."""
    b = blob(url)
    return b.open("rb", chunk_size=chunk_size)


def exists(url: str) -> bool:
    return blob(url).exists()


def ensure_bucket(url_or_bucket: str):
    """Return the bucket, raising a clear error if it does not exist (it is never created silently).

    A user with only roles/storage.objectAdmin on a bucket may not read its metadata (storage.buckets.get,
    403): then listing objects decides (404: missing; 403: no access at all)."""
    name = _bucket_name(url_or_bucket)
    from google.api_core import exceptions
    from google.auth.exceptions import RefreshError

    bucket = client().bucket(name)
    try:
        bucket.reload(timeout=30)
        return bucket
    except exceptions.NotFound:
        raise _missing(name, url_or_bucket) from None
    except exceptions.Unauthorized as e:
        raise _no_credentials(redact(str(e).splitlines()[0])[:200]) from None
    except RefreshError as e:
        raise _no_credentials(f"credentials expired or revoked: {redact(e)}") from None
    except exceptions.Forbidden:
        pass  # objectAdmin-only: fall through to an object-level check
    try:
        next(iter(client().list_blobs(name, max_results=1, timeout=30)), None)
    except exceptions.NotFound:
        raise _missing(name, url_or_bucket) from None
    except exceptions.Forbidden as e:
        raise _forbidden(
            name, "storage.objects.list (and storage.buckets.get)", "roles/storage.objectAdmin", e
        ) from None
    return bucket


def check_access(url: str, *, write: bool = False):
    """Fail early, with the fix, if `url`'s bucket is missing or the credentials cannot read (and, with
    write=True, create and delete objects) there. The write probe is one tiny object, deleted at once."""
    bucket = ensure_bucket(url)
    if write:
        from google.api_core import exceptions

        _, prefix = parse_url(url if is_gcs(url) else f"gs://{url}")
        probe = bucket.blob(join(prefix, f".labkit-write-check-{os.getpid()}").lstrip("/"))
        try:
            probe.upload_from_string(b"", timeout=30)
        except exceptions.Forbidden as e:
            raise _forbidden(bucket.name, "storage.objects.create", "roles/storage.objectAdmin", e) from None
        try:
            probe.delete(timeout=30)
        except exceptions.Forbidden as e:
            raise _forbidden(bucket.name, "storage.objects.delete", "roles/storage.objectAdmin", e) from None
    return bucket


def stat_with_server_time(url: str, timeout: float = 30):
    """(the object's metadata as a dict, or None when it does not exist; the server's clock now) in one
    request. Ages of objects (a writer lock's lease) are measured on the server's clock: `updated` is the
    server's time of the last write, and the response's Date header its time now (1 s resolution), so a
    host whose clock is off by minutes still measures the right age. Uses the client's own HTTP session
    (credentials, emulator host) because the client's metadata calls do not expose response headers."""
    from email.utils import parsedate_to_datetime
    from urllib.parse import quote

    from google.api_core import exceptions

    bucket, name = parse_url(url)
    c = client()
    r = c._http.get(c._connection.build_api_url(f"/b/{bucket}/o/{quote(name, safe='')}"), timeout=timeout)
    if r.status_code not in (200, 404):
        raise exceptions.from_http_response(r)
    now = parsedate_to_datetime(r.headers["Date"])
    return (r.json() if r.status_code == 200 else None), now


def parse_time(rfc3339: str):
    """A GCS timestamp ("2026-11-25T04:39:50.453477Z") as an aware datetime."""
    from datetime import datetime

    return datetime.fromisoformat(rfc3339.replace("Z", "+00:00"))
