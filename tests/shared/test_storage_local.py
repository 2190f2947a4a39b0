"""The local artifact store: atomic writes, keys that cannot escape the root, URL parsing."""

from __future__ import annotations

import pytest

from shared.errors import StorageError
from shared.settings import Settings
from shared.storage import LocalStore, activations_key, attempt_prefix, check_key, manifest_key, open_store


def test_put_file_moves_whole_file_under_key(tmp_path):
    store = LocalStore(tmp_path / "root")
    src = store.scratch_dir() / "x.part"
    src.write_bytes(b"payload")
    prefix = attempt_prefix("abc", 2, "host-1.example:4242")
    assert prefix == "jobs/abc/attempt-2-host-1.example-4242"  # the worker id made a valid key part
    uri = store.put_file(activations_key(prefix), src)
    dest = tmp_path / "root" / "jobs" / "abc" / "attempt-2-host-1.example-4242" / "activations.safetensors"
    assert uri == dest.as_uri() and dest.read_bytes() == b"payload" and not src.exists()
    store.put_bytes(manifest_key(prefix), b"{}")
    assert list((tmp_path / "root" / ".tmp").iterdir()) == []  # no temp file left behind
    store.put_bytes(manifest_key(attempt_prefix("abc", 1)), b"{}")
    store.put_bytes("jobs/abc/nnsight-request.bin", b"x")  # a file, not a folder
    assert store.folders("jobs/abc") == ["jobs/abc/attempt-1", prefix]
    assert store.folders("jobs/none") == []
    store.delete_prefix("jobs/abc")
    assert not (tmp_path / "root" / "jobs" / "abc").exists()


@pytest.mark.parametrize(
    "key", ["../etc/passwd", "/abs", "jobs/../../x", "jobs//x", "jobs/.hidden", "jobs/x\x00", "", "a b"]
)
def test_keys_cannot_escape_the_root(key, tmp_path):
    with pytest.raises(ValueError, match="invalid storage key"):
        check_key(key)
    with pytest.raises(ValueError):
        LocalStore(tmp_path).local_path(key)


def test_a_failed_write_is_a_storage_error(tmp_path):
    (tmp_path / "jobs").write_text("a file where a directory should be")
    store = LocalStore(tmp_path)
    with pytest.raises(StorageError, match="cannot store jobs/a/manifest.json"):
        store.put_bytes("jobs/a/manifest.json", b"{}")


def test_storage_urls(tmp_path):
    assert open_store(Settings(storage_url=tmp_path.as_uri())).root == tmp_path.resolve()
    s3 = open_store(Settings(storage_url="s3://bucket/some/prefix/", s3_endpoint_url="http://127.0.0.1:1"))
    assert (s3.bucket, s3.prefix, s3.uri("jobs/a/x")) == ("bucket", "some/prefix", "s3://bucket/some/prefix/jobs/a/x")
    with pytest.raises(ValueError, match="unsupported scheme 'ftp'"):
        open_store(Settings(storage_url="ftp://host/x"))
    with pytest.raises(ValueError, match="must be local"):
        open_store(Settings(storage_url="file://otherhost/x"))
    with pytest.raises(ValueError, match="name a bucket"):
        open_store(Settings(storage_url="s3:///x"))


@pytest.mark.parametrize("read", ["stream", "read_range"])
def test_a_missing_file_is_a_storage_error_naming_its_key_not_the_servers_path(read, tmp_path):
    """What reaches a job's error (an nnsight job whose payload was deleted) names the key only."""
    store = LocalStore(tmp_path / "data")
    key = "jobs/abc/nnsight-request"
    with pytest.raises(StorageError) as raised:
        b"".join(store.stream(key)) if read == "stream" else store.read_range(key, 0, 4)
    assert raised.value.message == f"cannot read {key}: No such file or directory"
