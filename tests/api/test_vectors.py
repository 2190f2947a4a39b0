"""Vector sets (`/vectors`) on the real app and a real Redis: an upload is checked whole (header,
offsets, dtypes, shapes, finite values) and refused with what to fix; a body over the limit is
refused before it is all read, with or without a Content-Length, and nothing is stored; a set is
another key's 404; deleting removes the file and the record; the worker's `load_vector` returns
the values and refuses a file changed in the store."""

from __future__ import annotations

import asyncio
import hashlib
import json
import struct
import uuid
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from safetensors.numpy import save

from api.main import create_app
from shared.errors import StorageError, TensorNotFound
from shared.settings import Settings
from shared.storage import open_store
from shared.vectors import VectorSet, load_vector

KEY_A, KEY_B = "vector-key-a", "vector-key-b"
STEER = np.linspace(-1, 1, 16, dtype=np.float32)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def vectors_file(**tensors: np.ndarray) -> bytes:
    return save({name.replace("__", "."): value for name, value in tensors.items()}, metadata={"source": "test"})


def raw_file(header: dict, data: bytes) -> bytes:
    """A safetensors file with a header of our own making (for headers the library would not write)."""
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def raw_text(text: bytes, data: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text + data


def upload(http: TestClient, body: bytes, headers: dict[str, str] | None = None, **kwargs):
    headers = {"content-type": "application/octet-stream", **(headers or {})}
    return http.post("/vectors", content=body, headers=headers, **kwargs)


def stored_files(tmp_path: Path) -> list[Path]:
    root = tmp_path / "data" / "vectors"
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


def vector_keys(redis_client) -> list[bytes]:
    return list(redis_client.scan_iter("actq:vector*"))


@pytest.fixture
def app_with(settings: Settings, redis_client):
    return lambda **changes: TestClient(create_app(settings.model_copy(update=changes)))


def test_upload_get_list_and_download_round_trip(http, tmp_path):
    body = vectors_file(**{"model__layers__3": STEER, "contrast": np.stack([STEER, -STEER])})
    created = upload(http, body, params={"label": "happy-sad"})
    assert created.status_code == 201, created.text
    record = created.json()
    assert created.headers["location"].endswith(f"/vectors/{record['id']}")
    assert record["tensors"] == {
        "model.layers.3": {"shape": [16], "dtype": "F32"},
        "contrast": {"shape": [2, 16], "dtype": "F32"},
    }
    assert record["sha256"] == hashlib.sha256(body).hexdigest() and record["bytes"] == len(body)
    assert record["key"] == f"vectors/{record['id']}/vectors.safetensors"
    assert record["label"] == "happy-sad" and record["metadata"] == {"source": "test"} and record["owner"] is None
    assert stored_files(tmp_path) == [tmp_path / "data" / record["key"]]

    assert http.get(f"/vectors/{record['id']}").json() == record
    second = upload(http, vectors_file(v=STEER)).json()
    assert [s["id"] for s in http.get("/vectors").json()] == [second["id"], record["id"]]  # newest first
    assert [s["id"] for s in http.get("/vectors", params={"limit": 1}).json()] == [second["id"]]

    download = http.get(f"/vectors/{record['id']}/file")
    assert download.status_code == 200 and download.content == body
    assert hashlib.sha256(download.content).hexdigest() == record["sha256"]
    assert download.headers["etag"] == f'"{record["sha256"]}"'


def _bf16(values: np.ndarray) -> tuple[bytes, np.ndarray]:
    """A BF16 file written by safetensors.torch, and its values as torch reads them back."""
    import torch
    from safetensors.torch import save as torch_save

    tensor = torch.from_numpy(values).to(torch.bfloat16)
    return torch_save({"v": tensor}), tensor.float().numpy()


@pytest.mark.parametrize("dtype", ["F32", "F16", "F64", "BF16"])
def test_float_dtypes_are_accepted_and_load_vector_returns_float32_values(http, settings, dtype):
    values = np.stack([STEER, 2 * STEER])
    if dtype == "BF16":
        body, expected = _bf16(values)
    else:
        stored = values.astype({"F32": np.float32, "F16": np.float16, "F64": np.float64}[dtype])
        body, expected = vectors_file(v=stored), stored.astype(np.float32)
    response = upload(http, body)
    assert response.status_code == 201, response.text
    record = VectorSet.model_validate(response.json())
    assert record.tensors["v"].dtype == dtype and record.tensors["v"].shape == [2, 16]
    loaded = load_vector(open_store(settings), record, "v")
    assert loaded.dtype == np.float32 and loaded.shape == (2, 16)
    assert np.array_equal(loaded, expected)  # exactly what was stored, widened to float32
    np.testing.assert_allclose(loaded, values, atol=1e-2)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values_are_refused_naming_the_tensor(http, tmp_path, redis_client, bad):
    broken = STEER.copy()
    broken[[2, 5]] = bad
    response = upload(http, vectors_file(good=STEER, steer__bad=broken))
    assert response.status_code == 422, response.text
    assert response.json()["error"] == "invalid_vectors"
    assert "tensor 'steer.bad' has 2 non-finite values (NaN or inf)" in response.json()["detail"]
    assert stored_files(tmp_path) == [] and vector_keys(redis_client) == []


def test_a_bf16_nan_is_refused(http):
    broken = STEER.copy()
    broken[0] = np.nan
    response = upload(http, _bf16(broken)[0])
    assert response.status_code == 422 and "tensor 'v' has 1 non-finite values" in response.json()["detail"]


def test_f64_values_beyond_float32_are_refused(http):
    response = upload(http, vectors_file(v=np.array([1.0, 1e300])))
    assert response.status_code == 422 and "beyond float32's range" in response.json()["detail"]


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (np.zeros((2, 3, 4), np.float32), "has shape [2, 3, 4]; a vector set holds [width] or [n, width]"),
        (np.zeros((0, 4), np.float32), "has shape [0, 4]"),
        (np.array(1.0, np.float32), "has shape []"),
        (np.zeros(4, np.int32), "'v' is 'I32'; vectors are F32, F16, BF16 or F64"),
    ],
)
def test_shapes_and_dtypes_that_are_not_vectors_are_refused(http, tensor, message):
    response = upload(http, vectors_file(v=tensor))
    assert response.status_code == 422, response.text
    assert message in response.json()["detail"]


F32 = {"dtype": "F32", "shape": [2]}
EIGHT = bytes(8)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"", "not a safetensors file: the body has 0 bytes"),
        (b"this is not a safetensors file at all", "not a safetensors file: its header length"),
        (struct.pack("<Q", 10_000) + b'{"v": {}}', "header length (10,000 bytes) does not fit in the 17-byte body"),
        (struct.pack("<Q", 2**64 - 1) + b"{}", "does not fit"),
        (struct.pack("<Q", 4) + b"\xff\xfe{}", "its header is not UTF-8 JSON"),
        (struct.pack("<Q", 3) + b"[1]", "its header is not a JSON object"),
        (raw_file({"__metadata__": {"a": "b"}}, b""), "the file holds no tensors"),
        (raw_file({"v": {**F32, "data_offsets": [0, 8]}}, EIGHT + EIGHT), "data_offsets end at byte 8; the data"),
        (raw_file({"v": {**F32, "data_offsets": [0, 8]}}, bytes(4)), "data_offsets end at byte 8"),
        (raw_file({"v": {**F32, "data_offsets": [0, 12]}}, bytes(12)), "data_offsets [0, 12] span 12 bytes"),
        (
            raw_file({"a": {**F32, "data_offsets": [0, 8]}, "b": {**F32, "data_offsets": [4, 12]}}, bytes(12)),
            "tensor 'b': its data_offsets do not follow on (it overlaps the one before it)",
        ),
        (
            raw_file({"a": {**F32, "data_offsets": [0, 8]}, "b": {**F32, "data_offsets": [12, 20]}}, bytes(20)),
            "leaves 4 bytes unused before it",
        ),
        (
            raw_text(b'{"v":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"v":{"dtype":"F16"}}', EIGHT),
            "its header names 'v' twice",
        ),
        (raw_file({"bad name!": {**F32, "data_offsets": [0, 8]}}, EIGHT), "tensor name 'bad name!': use 1 to 200"),
        (raw_file({"v": {**F32, "data_offsets": [0, 8], "x": 1}}, EIGHT), "must have exactly dtype, shape"),
        (raw_file({"v": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}}, EIGHT), "vectors are F32"),
        (raw_file({"v": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, bytes(4)), "list of integers"),
        (
            raw_file({"__metadata__": {"k": 1}, "v": {**F32, "data_offsets": [0, 8]}}, EIGHT),
            "__metadata__ must map strings to strings",
        ),
        (
            raw_file({"__metadata__": {str(i): "" for i in range(65)}, "v": {**F32, "data_offsets": [0, 8]}}, EIGHT),
            "__metadata__ has 65 entries; at most 64",
        ),
        (
            raw_file({"__metadata__": {"k": "x" * 1001}, "v": {**F32, "data_offsets": [0, 8]}}, EIGHT),
            "over 1000 characters",
        ),
    ],
)
def test_files_that_are_not_valid_safetensors_are_refused_saying_why(http, tmp_path, redis_client, body, message):
    response = upload(http, body)
    assert response.status_code == 422, response.text
    assert response.json()["error"] == "invalid_vectors"
    assert message in response.json()["detail"], response.json()["detail"]
    assert stored_files(tmp_path) == [] and vector_keys(redis_client) == []


def test_limits_on_tensors_and_width():
    from shared.errors import InvalidVectors
    from shared.vectors import validate_file

    with pytest.raises(InvalidVectors, match="holds 3 tensors; a vector set holds at most 2"):
        validate_file(vectors_file(a=STEER, b=STEER, c=STEER), max_tensors=2)
    with pytest.raises(InvalidVectors, match="'a' is 16 wide; at most 8"):
        validate_file(vectors_file(a=STEER), max_width=8)
    tensors, metadata = validate_file(vectors_file(a=STEER))
    assert tensors["a"].shape == [16] and metadata == {"source": "test"}


def test_bodies_over_the_limit_are_refused_and_nothing_is_stored(app_with, tmp_path, redis_client):
    big = vectors_file(v=np.zeros(1024, np.float32))  # over 4 KiB
    assert len(big) > 4096
    with app_with(vector_max_bytes=4096) as http:
        declared = upload(http, big)
        assert declared.status_code == 413, declared.text
        assert declared.json() == {
            "error": "payload_too_large",
            "detail": "a vector set file is at most 4,096 bytes (ACTQ_VECTOR_MAX_BYTES); send fewer tensors",
        }

        def chunks():
            for start in range(0, len(big), 1000):
                yield big[start : start + 1000]

        chunked = http.post("/vectors", content=chunks())
        assert chunked.request.headers.get("content-length") is None
        assert chunked.request.headers["transfer-encoding"] == "chunked"
        assert chunked.status_code == 413 and chunked.json()["error"] == "payload_too_large"
        assert upload(http, vectors_file(v=np.zeros(16, np.float32))).status_code == 201  # under it: fine
    assert len(stored_files(tmp_path)) == 1
    assert len([k for k in vector_keys(redis_client) if b"vector-set:" in k]) == 1


def test_a_body_without_content_length_is_not_read_past_the_limit(settings, tmp_path, redis_client):
    """On the ASGI level (the test client reads a whole body before sending it): an endless body is
    refused once the limit has arrived, after a bounded number of chunks."""
    app = create_app(settings.model_copy(update={"vector_max_bytes": 4096}))
    received, sent = 0, []

    async def receive():
        nonlocal received
        received += 1
        return {"type": "http.request", "body": b"\x00" * 1000, "more_body": True}  # never ends

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/vectors",
        "raw_path": b"/vectors",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", b"testserver"), (b"transfer-encoding", b"chunked")],
        "client": ("127.0.0.1", 1234),
        "server": ("testserver", 80),
    }
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 10))
    assert sent[0]["status"] == 413
    assert received == 5  # 5,000 bytes: the first chunk past 4,096
    assert stored_files(tmp_path) == [] and vector_keys(redis_client) == []


def test_another_key_cannot_see_get_download_or_delete_a_set(app_with, tmp_path):
    with app_with(api_keys=f"{KEY_A},{KEY_B}") as http:
        assert http.post("/vectors", content=vectors_file(v=STEER)).status_code == 401
        mine = upload(http, vectors_file(v=STEER), headers=bearer(KEY_A)).json()
        assert mine["owner"] is not None and KEY_A not in json.dumps(mine)  # a hash of the key, never the key
        unknown = str(uuid.uuid4())
        for method, path in [("GET", ""), ("GET", "/file"), ("DELETE", "")]:
            theirs = http.request(method, f"/vectors/{mine['id']}{path}", headers=bearer(KEY_B))
            nobody = http.request(method, f"/vectors/{unknown}{path}", headers=bearer(KEY_B))
            assert theirs.status_code == nobody.status_code == 404, theirs.text
            assert theirs.json()["error"] == nobody.json()["error"] == "vector_set_not_found"
            assert theirs.json()["detail"] == nobody.json()["detail"].replace(unknown, mine["id"])
        assert http.get("/vectors", headers=bearer(KEY_B)).json() == []
        assert [s["id"] for s in http.get("/vectors", headers=bearer(KEY_A)).json()] == [mine["id"]]
        assert http.get(f"/vectors/{mine['id']}/file", headers=bearer(KEY_A)).status_code == 200
    assert len(stored_files(tmp_path)) == 1  # B's DELETE removed nothing
    with app_with() as http:  # keys off again: everything is open, as for jobs
        assert http.get(f"/vectors/{mine['id']}").json() == mine
        assert http.get("/vectors").json() == []  # the listing of callers without keys


@pytest.mark.parametrize("bad_id", ["not-a-uuid", "..", "%2E%2E%2Fjobs", "00000000-0000-0000-0000-000000000000"])
def test_ids_that_are_not_uuid4s_are_unknown(http, bad_id):
    for method, path in [("GET", ""), ("GET", "/file"), ("DELETE", "")]:
        response = http.request(method, f"/vectors/{bad_id}{path}")
        assert response.status_code == 404, (method, path, response.text)


def test_delete_removes_the_file_and_the_record(http, tmp_path, redis_client):
    record = upload(http, vectors_file(v=STEER)).json()
    kept = upload(http, vectors_file(w=STEER)).json()
    assert len(stored_files(tmp_path)) == 2
    assert http.delete(f"/vectors/{record['id']}").status_code == 204
    assert http.get(f"/vectors/{record['id']}").status_code == 404
    assert http.get(f"/vectors/{record['id']}/file").status_code == 404
    assert http.delete(f"/vectors/{record['id']}").status_code == 404
    assert not (tmp_path / "data" / "vectors" / record["id"]).exists()
    assert stored_files(tmp_path) == [tmp_path / "data" / kept["key"]]
    assert [s["id"] for s in http.get("/vectors").json()] == [kept["id"]]
    assert redis_client.get(f"actq:vector-set:{record['id']}") is None
    assert redis_client.zcard("actq:vector-sets:_") == 1


def test_the_count_per_key_is_limited(app_with, tmp_path):
    with app_with(api_keys=f"{KEY_A},{KEY_B}", max_vector_sets_per_key=2) as http:
        first = upload(http, vectors_file(v=STEER), headers=bearer(KEY_A)).json()
        assert upload(http, vectors_file(v=STEER), headers=bearer(KEY_A)).status_code == 201
        refused = upload(http, vectors_file(v=STEER), headers=bearer(KEY_A))
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"] == "too_many_vector_sets" and "retry-after" in refused.headers
        assert "ACTQ_MAX_VECTOR_SETS_PER_KEY" in refused.json()["detail"]
        assert len(stored_files(tmp_path)) == 2
        assert upload(http, vectors_file(v=STEER), headers=bearer(KEY_B)).status_code == 201  # per key
        assert http.delete(f"/vectors/{first['id']}", headers=bearer(KEY_A)).status_code == 204
        assert upload(http, vectors_file(v=STEER), headers=bearer(KEY_A)).status_code == 201


def test_the_count_is_checked_again_as_a_set_is_recorded(app_with, tmp_path, monkeypatch):
    """Uploads that all passed the first check (concurrent ones): the count is checked again in
    the same Redis step that records a set, and a refused set's stored file is removed."""
    from shared.vectors import VectorSets

    monkeypatch.setattr(VectorSets, "check_room", lambda self, owner: None)
    with app_with(max_vector_sets_per_key=1) as http:
        kept = upload(http, vectors_file(v=STEER)).json()
        refused = upload(http, vectors_file(v=STEER))
        assert refused.status_code == 429 and refused.json()["error"] == "too_many_vector_sets"
        assert [s["id"] for s in http.get("/vectors").json()] == [kept["id"]]
    assert stored_files(tmp_path) == [tmp_path / "data" / kept["key"]]


def test_load_vector_refuses_a_file_changed_in_the_store(http, settings, tmp_path):
    values = np.stack([STEER, -STEER])
    record = VectorSet.model_validate(upload(http, vectors_file(v=values, w=STEER)).json())
    store = open_store(settings)
    assert np.array_equal(load_vector(store, record, "v"), values)
    assert np.array_equal(load_vector(store, record, "w"), STEER)
    with pytest.raises(TensorNotFound, match="no tensor named 'x' in vector set .*; tensors: v, w"):
        load_vector(store, record, "x")
    path = tmp_path / "data" / record.key
    original = path.read_bytes()
    path.write_bytes(original[:-4] + np.float32(7).tobytes())  # same size, one value changed
    with pytest.raises(StorageError, match=f"vector set {record.id} changed in the store"):
        load_vector(store, record, "v")
    path.write_bytes(original + b"\x00")  # one byte longer
    with pytest.raises(StorageError, match="changed in the store"):
        load_vector(store, record, "w")
    path.unlink()
    with pytest.raises(StorageError):
        load_vector(store, record, "v")


def test_an_upload_over_a_limit_above_the_request_limit_names_the_vector_limit(app_with, tmp_path):
    """The body limit in front of every route lets a vector set upload up to its own limit, and
    refuses one over it in the upload's words (the issue: a 72 MB upload named the 4 MiB
    ACTQ_MAX_REQUEST_BYTES)."""
    big = b"\0" * (6 << 20)
    with app_with(max_request_bytes=1 << 20, vector_max_bytes=5 << 20) as http:
        for body in (big, iter([big[i : i + (1 << 20)] for i in range(0, len(big), 1 << 20)])):
            refused = upload(http, body)  # type: ignore[arg-type]
            assert refused.status_code == 413, refused.text
            assert refused.json() == {
                "error": "payload_too_large",
                "detail": "a vector set file is at most 5,242,880 bytes (ACTQ_VECTOR_MAX_BYTES); send fewer tensors",
            }
        # under the vector limit but over the request limit: read, and checked as a file
        assert upload(http, vectors_file(v=np.zeros(400_000, np.float32))).status_code == 201
    assert len(stored_files(tmp_path)) == 1
