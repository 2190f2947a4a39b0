"""An nnsight job's way into the engine (worker/engine/nnsight_io.py) with a real served model, store and
Redis: a stored payload reaches nnsight only decompressed under the API's cap (a zstd bomb that
got into storage past an older API fails its job, without the engine allocating what its frame
declares; a payload nnsight's client compressed runs as before), and the job's first LOG line
says what runs instead of the client's own settings."""

# ruff: noqa: F841 - inside a trace, a name bound to a saved value is what nnsight sends back
from __future__ import annotations

import hashlib
import resource
import threading
import uuid
from datetime import UTC, datetime

import pytest
import redis
import torch
import zstandard

from shared import keys
from shared.errors import PayloadMismatch
from shared.jobs import JobStore
from shared.registry import ModelRegistry
from shared.schemas import JobRecord, JobRequest, NnsightCall
from shared.settings import Settings
from shared.storage import nnsight_request_key, open_store
from tests.api.test_nnsight_requests import zstd_bomb
from worker.engine import nnsight_io
from worker.engine.runtime import Runtime

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def served(tiny_dir):
    from worker.batch.served import ServedModel
    from worker.model.loading import load

    return ServedModel(load(Settings(model=str(tiny_dir), model_name="m")))


@pytest.fixture
def runtime(served, redis_server, redis_client: redis.Redis, tmp_path):
    settings = Settings(redis_url=redis_server.url, storage_url=(tmp_path / "data").as_uri())
    return Runtime(
        settings=settings,
        served=served,
        store=open_store(settings),
        jobs=JobStore(redis_client, settings.job_retention_seconds),
        registry=ModelRegistry(redis_client, settings.heartbeat_ttl),
        worker_id="test",
        stop=threading.Event(),
        core=None,  # type: ignore[arg-type]  # not reached: the job is only prepared here
        progress=None,  # type: ignore[arg-type]
    )


def stored_job(rt: Runtime, payload: bytes) -> JobRecord:
    job_id = str(uuid.uuid4())
    rt.store.put_bytes(nnsight_request_key(job_id), payload)
    call = NnsightCall(
        model_key="x",
        sha256=hashlib.sha256(payload).hexdigest(),
        bytes=len(payload),
        compress=True,
        nnsight_version="0.8.1",
        python_version="3.11",
    )
    request = JobRequest(model="m", mode="nnsight", nnsight=call)
    return JobRecord(id=job_id, status="queued", model="m", request=request, max_tokens=0, created_at=datetime.now(UTC))


def test_a_stored_zstd_bomb_fails_its_job_before_nnsight_decompresses_it(runtime):
    record = stored_job(runtime, zstd_bomb())  # 512 KiB declaring 16 GiB: nnsight would allocate it at once
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(PayloadMismatch, match="ACTQ_NNSIGHT_MAX_REQUEST_BYTES"):
        nnsight_io.job(runtime, record, lambda outcome: None, lambda: None)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 200_000  # KiB: no 16 GiB, nor 64 MiB


def test_a_payload_compressed_as_nnsights_client_does_runs(runtime, tiny_dir):
    from nnsight.schema.request import RequestModel
    from nnsight.tracing.backend import Backend

    from tests.support.nnsight import client_model

    sent: list[bytes] = []

    class Keep(Backend):
        def __call__(self, tracer):
            sent.append(RequestModel.serialize(tracer, compress=True))

    model = client_model(tiny_dir)
    with model.trace("Hello", backend=Keep()):
        hs = model.model.layers[0].output.save()
    alone = nnsight_io.job(runtime, stored_job(runtime, sent[0]), lambda outcome: None, lambda: None)
    with runtime.served.lock:
        outcome = alone.run()
    local = client_model(tiny_dir, dispatch=True)
    with local.trace("Hello"):
        expected = local.model.layers[0].output.save()
    torch.testing.assert_close(outcome.saves["hs"], expected, atol=1e-5, rtol=1e-4)


def test_the_first_log_line_says_what_runs_instead_of_the_clients_own_settings(runtime, redis_client):
    payload = zstandard.ZstdCompressor().compress(b"\x80\x04\x95 not run here")
    record = stored_job(runtime, payload)
    nnsight_io.job(runtime, record, lambda outcome: None, lambda: None)
    nnsight_io.flush_logs(record.id)
    lines = [line.decode() for line in redis_client.lrange(keys.nnsight_log(record.id), 0, -1)]
    assert len(lines) == 1, lines
    for said in ("runs on m as served", "dtype float32", "attention sdpa", "padding on the left", "dtype=float32"):
        assert said in lines[0], lines[0]
    assert "seed inside the trace (torch.manual_seed)" in lines[0]
    assert nnsight_io.served_settings(runtime) == {
        "dtype": "float32",
        "attn_implementation": "sdpa",
        "padding_side": "left",
        "random_state": nnsight_io.RANDOM_STATE,
    }
