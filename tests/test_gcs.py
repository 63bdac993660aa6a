"""labkit.cloud.gcs with your own bucket: missing bucket (real loopback GCS server), 403s (a tiny HTTP server on
127.0.0.1 answering like GCS), no credentials, no project, and sign-in only when a path is gs://."""

import json
import threading
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from labkit.cloud import gcs


def test_missing_bucket_names_it_and_the_command(gcs_server):
    with pytest.raises(gcs.BucketNotFoundError) as e:
        gcs.check_access("gs://no-such-bucket-labkit/run1", write=True)
    msg = str(e.value)
    assert "'no-such-bucket-labkit'" in msg and "gcloud storage buckets create gs://no-such-bucket-labkit" in msg
    assert isinstance(e.value, FileNotFoundError)


def test_existing_bucket_passes_the_write_check(gcs_bucket):
    b = gcs.check_access(f"gs://{gcs_bucket}/ckpt", write=True)
    assert b.name == gcs_bucket
    assert list(gcs.client().list_blobs(gcs_bucket)) == []  # the probe object is gone


class _GCS403(BaseHTTPRequestHandler):
    """Answers like GCS for a user with no bucket-level permission: buckets.get 403; objects per `allow`."""

    allow: set = set()

    def _send(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _deny(self, perm):
        self._send(403, {"error": {"code": 403, "message": f"caller does not have {perm} access"}})

    def do_GET(self):
        if "/o" in self.path.split("?")[0]:
            return self._send(200, {"items": []}) if "list" in self.allow else self._deny("storage.objects.list")
        self._deny("storage.buckets.get")

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if "create" in self.allow:
            return self._send(200, {"name": "x", "bucket": "b", "generation": "1"})
        self._deny("storage.objects.create")

    def log_message(self, *args):
        pass


@pytest.fixture
def forbidding_server(monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _GCS403)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{server.server_address[1]}")
    yield _GCS403
    server.shutdown()
    _GCS403.allow = set()


def test_403_everywhere_names_the_permission_and_role(forbidding_server):
    with pytest.raises(gcs.GCSPermissionError) as e:
        gcs.ensure_bucket("gs://their-bucket/data")
    msg = str(e.value)
    assert "gs://their-bucket" in msg and "storage.objects.list" in msg and "roles/storage.objectAdmin" in msg
    assert "gcloud storage buckets add-iam-policy-binding gs://their-bucket" in msg


def test_object_admin_without_buckets_get_can_read_but_not_write(forbidding_server):
    forbidding_server.allow = {"list"}
    assert gcs.ensure_bucket("gs://shared-bucket").name == "shared-bucket"  # 403 on buckets.get is fine
    with pytest.raises(gcs.GCSPermissionError, match=r"storage\.objects\.create.*roles/storage\.objectAdmin"):
        gcs.check_access("gs://shared-bucket/ckpt", write=True)


def _real_credentials_env(monkeypatch, tmp_path):
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    for var in (
        "GOOGLE_CLOUD_PROJECT",
        "CLOUDSDK_CORE_PROJECT",
        "GCLOUD_PROJECT",
        "KAGGLE_KERNEL_RUN_TYPE",
        "KAGGLE_URL_BASE",
        "COLAB_RELEASE_TAG",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))  # no gcloud ADC file
    monkeypatch.setenv("NO_GCE_CHECK", "True")  # never ask a metadata server
    monkeypatch.setattr(gcs, "_client", None)
    monkeypatch.setattr(gcs, "_project", None)


def test_no_credentials_is_a_clear_error(monkeypatch, tmp_path):
    _real_credentials_env(monkeypatch, tmp_path)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    with pytest.raises(gcs.GCSAuthError, match="gcloud auth application-default login"):
        gcs.client()
    assert gcs.sign_in("data/shards", "checkpoints/x") is None  # nothing on gs://: no sign-in asked
    with pytest.raises(gcs.GCSAuthError):
        gcs.sign_in("data/shards", "gs://b/ckpt")  # a gs:// checkpoint path alone asks for it


def test_user_credentials_without_project(monkeypatch, tmp_path):
    """Colab's authenticate_user() leaves user credentials with no project: the client still builds."""
    _real_credentials_env(monkeypatch, tmp_path)
    cred = tmp_path / "adc.json"
    cred.write_text(
        json.dumps({"type": "authorized_user", "client_id": "x", "client_secret": "y", "refresh_token": "z"})
    )
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(cred))
    assert gcs.client().project is None
    gcs.set_project("my-proj")
    assert gcs.client().project == "my-proj"
    monkeypatch.setattr(gcs, "_project", None)
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", "env-proj")
    assert gcs.client().project == "env-proj"


def test_sign_in_on_colab_calls_authenticate_user(monkeypatch, tmp_path):
    _real_credentials_env(monkeypatch, tmp_path)
    cred = tmp_path / "adc.json"
    cred.write_text(
        json.dumps({"type": "authorized_user", "client_id": "x", "client_secret": "y", "refresh_token": "z"})
    )
    calls = []
    auth = types.SimpleNamespace(
        authenticate_user=lambda **kw: (
            calls.append(kw),
            monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(cred)),
        )
    )
    colab = types.ModuleType("google.colab")
    colab.auth = auth
    monkeypatch.setitem(__import__("sys").modules, "google.colab", colab)
    monkeypatch.setitem(__import__("sys").modules, "google.colab.auth", auth)
    how = gcs.sign_in("gs://mine/shards", "checkpoints/local", project="proj-1")
    assert how.startswith("colab") and calls == [{"project_id": "proj-1"}]
    assert gcs.client().project == "proj-1"
