"""POST /request and nnsight's helper routes on the real app over a real Redis, a model published
as a worker publishes it (its files' fingerprint included), and no worker: what the API decides
at submit. A refused request stores and queues nothing."""

from __future__ import annotations

import json
import platform
import shutil
import struct
from pathlib import Path

import pytest
import redis
import zstandard
from fastapi.testclient import TestClient

from api.main import create_app
from shared import model_identity
from shared.registry import ModelRegistry
from shared.settings import Settings
from tests.api.conftest import LIMITS
from tests.shared.test_model_identity import folder, tensors
from tests.support.models import tiny_llama

TRUSTED, PLAIN = "trusted-key-0123456789", "plain-key-0123456789"
CLASS = "nnsight.modeling.transformers.TransformersModel"
PAYLOAD = b"\x80\x04\x95" + bytes(range(256)) * 40  # a pickle's first bytes: the API never loads it
GiB = 1 << 30


@pytest.fixture
def served_dir(tmp_path) -> Path:
    return folder(tmp_path / "served" / "tiny")


@pytest.fixture
def settings(redis_server, tmp_path) -> Settings:
    return Settings(
        redis_url=redis_server.url,
        storage_url=(tmp_path / "data").as_uri(),
        api_keys=f"{TRUSTED},{PLAIN}",
        nnsight_keys=TRUSTED,
        **LIMITS,
    )


def served_info(served_dir: Path, name: str = "tiny", **fields):
    return tiny_llama(name).model_copy(
        update={
            "source": str(served_dir),
            "nnsight_version": "0.8.1",
            "python_version": platform.python_version(),
            "attention": "sdpa",
            "fingerprint": model_identity.fingerprint(model_identity.read_folder(served_dir)),
            "packages": {"nnsight": "0.8.1", "torch": "2.13.0+cpu", "transformers": "5.23.0"},
            **fields,
        }
    )


@pytest.fixture
def http(settings: Settings, redis_client: redis.Redis, served_dir: Path, tmp_path):
    """`tiny` served from `served_dir`; `smol` as the built-in is, made from a Hub checkpoint."""
    smol_files = folder(tmp_path / "smol-files", tensors(seed=1))
    smol = served_info(
        smol_files, "smol", source="/elsewhere/smollm2-135m", hub_id="HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    registry = ModelRegistry(redis_client, settings.heartbeat_ttl)
    for info in (served_info(served_dir), smol):
        registry.publish(info)
        registry.heartbeat(info, f"worker-{info.name}")
    with TestClient(create_app(settings)) as client:
        yield client


def send(http: TestClient, repo_id: str, payload: bytes = PAYLOAD, compress: bool = False, key: str = TRUSTED):
    model_key = f"{CLASS}:" + json.dumps({"repo_id": repo_id, "revision": None})
    data = json.dumps({"model_key": model_key, "session_id": "", "compress": compress, "env": {}})
    headers = {"ndif-api-key": key, "nnsight-version": "0.8.1", "python-version": platform.python_version()}
    files = {"blob": ("request", payload, "application/octet-stream")}
    return http.post("/request", data={"data": data}, files=files, headers=headers)


def stored(settings: Settings) -> list[str]:
    root = Path(settings.storage_url.removeprefix("file://"))
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.exists() else []


def refused(http, settings, redis_client, status, says, *args, **kwargs) -> str:
    keys_before, files_before = redis_client.dbsize(), stored(settings)
    response = send(http, *args, **kwargs)
    assert response.status_code == status, response.text
    assert says in response.json()["detail"], response.text
    assert redis_client.dbsize() == keys_before and stored(settings) == files_before  # nothing stored or queued
    return response.json()["detail"]


# -- which model (issue 46, item 4) -------------------------------------------------------


def test_a_folder_named_like_the_served_model_with_other_weights_is_refused_naming_them(
    http, settings, redis_client, tmp_path
):
    tuned = tensors()
    tuned["model.layers.0.mlp.down_proj.weight"] = tuned["model.layers.0.mlp.down_proj.weight"] * 1.01
    fine_tuned = folder(tmp_path / "ft" / "tiny", tuned)  # the served model's name, a fine-tuned copy's weights
    detail = refused(http, settings, redis_client, 422, "is not the model served as tiny", str(fine_tuned))
    assert "weights differ from the served ones in 1 of 4 tensors: model.layers.0.mlp.down_proj.weight" in detail
    taller = folder(tmp_path / "taller" / "tiny", num_hidden_layers=3)
    refused(http, settings, redis_client, 422, "num_hidden_layers (3 here, 2 served)", str(taller))


def test_a_copy_of_the_served_files_anywhere_and_the_served_name_are_accepted(http, served_dir, tmp_path):
    copy = Path(shutil.copytree(served_dir, tmp_path / "mine" / "any-name"))
    for repo_id in (str(copy), str(copy) + "/", str(served_dir), "tiny"):
        response = send(http, repo_id)
        assert response.status_code == 200 and response.json()["status"] == "RECEIVED", (repo_id, response.text)
        assert response.json()["description"] == "queued for tiny"


def test_a_hub_id_the_built_in_was_only_made_from_is_refused(http, settings, redis_client):
    """The built-in model is a Q4_1 GGUF dequantized: the Hub's bf16 weights are not the served ones."""
    refused(
        http, settings, redis_client, 422, "was made from that Hub checkpoint but does not serve its weights",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("repo_id", "says"),
    [
        ("models/tiny", "not served here"),  # a relative folder is a Hub id to nnsight: not one served
        ("./models/tiny", "relative path"),
        ("/srv/models/../models/tiny", "not a normalised path"),
        ("/no/such/folder/tiny", "cannot read on its host"),
        ("~/models/tiny", "relative path"),
    ],
)
def test_paths_are_refused_unless_absolute_normalised_and_readable(http, settings, redis_client, repo_id, says):
    refused(http, settings, redis_client, 422, says, repo_id)


def test_a_folder_without_weights_cannot_identify_the_served_model(http, settings, redis_client, tmp_path):
    bare = folder(tmp_path / "bare" / "tiny")
    for path in bare.glob("*.safetensors"):
        path.unlink()
    refused(http, settings, redis_client, 422, "holds no *.safetensors file", str(bare))


# -- the payload before anything loads it (item 3) --------------------------------------------


def zstd_bomb(decompressed: int = 16 * GiB) -> bytes:
    """A zstd frame of RLE blocks (128 KiB of zeros from 4 bytes each) that declares and expands to
    `decompressed` bytes: 512 KiB for 16 GiB. nnsight's loader allocates the declared size at once."""
    block = 128 << 10
    header = struct.pack("<IB", 0xFD2FB528, 0xE0) + struct.pack("<Q", decompressed)  # single segment, 8-byte size
    count = decompressed // block
    body = bytearray()
    for i in range(count):
        last = 1 if i == count - 1 else 0
        body += ((block << 3) | (1 << 1) | last).to_bytes(3, "little") + b"\0"
    return header + bytes(body)


def test_a_zstd_bomb_is_refused_at_submit_from_its_header(http, settings, redis_client):
    bomb = zstd_bomb()
    assert len(bomb) < 513 << 10
    assert zstandard.get_frame_parameters(bomb).content_size == 16 * GiB
    detail = refused(http, settings, redis_client, 413, "decompresses to 17,179,869,184 bytes", "tiny", bomb, True)
    assert "ACTQ_NNSIGHT_MAX_REQUEST_BYTES" in detail


def test_compressed_payloads_must_declare_a_bounded_size_and_ratio(http, settings, redis_client):
    small_bomb = zstd_bomb(64 << 20)  # 64 MiB from 2 KiB: under the size limit, far past the ratio
    refused(http, settings, redis_client, 413, "over 1000:1", "tiny", small_bomb, True)
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(PAYLOAD)
    refused(http, settings, redis_client, 422, "does not declare its decompressed size", "tiny", unsized, True)
    refused(http, settings, redis_client, 422, "does not start with a zstd frame", "tiny", PAYLOAD, True)
    sized = zstandard.ZstdCompressor(level=6).compress(PAYLOAD)  # as nnsight's client compresses
    assert send(http, "tiny", sized, compress=True).status_code == 200


def test_a_payload_that_is_not_a_pickle_of_nnsights_protocol_is_refused(http, settings, redis_client):
    refused(http, settings, redis_client, 422, "serialization, protocol 4", "tiny", b"PK\x03\x04 not a pickle")
    refused(http, settings, redis_client, 422, "serialization, protocol 4", "tiny", b"\x80\x02old pickle")
    not_pickled = zstandard.ZstdCompressor().compress(b"#!/bin/sh\n" * 10)
    refused(http, settings, redis_client, 422, "serialization, protocol 4, zstd-compressed", "tiny", not_pickled, True)


# -- what the client reads back (item 7) --------------------------------------------


def test_get_job_shows_an_nnsight_job_as_mode_nnsight(http):
    job_id = send(http, "tiny").json()["id"]
    job = http.get(f"/jobs/{job_id}", headers={"Authorization": f"Bearer {TRUSTED}"}).json()
    assert job["mode"] == "nnsight" and job["status"] == "queued"


def test_status_and_env_answer_without_a_key_and_name_no_folder(http, served_dir):
    """nnsight.status() and nnsight.compare() send no key."""
    status = http.get("/status")
    assert status.status_code == 200, status.text
    deployments = status.json()["deployments"]
    assert set(deployments) == {"tiny", "smol"}
    assert deployments["tiny"]["repo_id"] == "tiny" and deployments["tiny"]["application_state"] == "RUNNING"
    assert json.loads(deployments["tiny"]["model_key"].partition(":")[2]) == {"repo_id": "tiny", "revision": None}
    assert str(served_dir) not in status.text and "/elsewhere" not in status.text
    env = http.get("/env")
    assert env.status_code == 200
    assert env.json() == {
        "python_version": platform.python_version(),
        "packages": {"nnsight": "0.8.1", "torch": "2.13.0+cpu", "transformers": "5.23.0"},
    }


def test_status_and_env_say_nnsight_is_off_where_no_key_is_trusted(redis_client, settings):
    with TestClient(create_app(settings.model_copy(update={"nnsight_keys": None}))) as http:
        for path in ("/status", "/env"):
            response = http.get(path)
            assert response.status_code == 403 and "ACTQ_NNSIGHT_KEYS" in response.text
