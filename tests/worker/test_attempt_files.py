"""Two attempts of one job through the worker's own finishing path (worker/engine/job_flow.py `_record`:
artifacts, then the fenced outcome), with the tiny model, a local store, a real Redis and the
real API reading the result. As when a paused worker resumes after another re-ran its jobs: the
attempt the record names keeps its files, the stale one removes its own, and every reader of the
record gets the bytes the record describes (sha256, token count, text)."""

from __future__ import annotations

import hashlib
import io
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load

from api.main import create_app
from shared import keys
from shared.attempts import Attempt
from shared.broker import make_celery
from shared.capture_spec import resolve
from shared.jobs import JobStore, now
from shared.schemas import JobRecord, JobRequest, JobStatus, NnsightCall
from shared.settings import Settings
from shared.storage import LocalStore, job_prefix, legacy_nnsight_result_key
from tests.worker.test_batching import load_engine, prepare
from worker.batch.sequence import Sequence
from worker.engine import job_flow, runtime
from worker.nnsight.jobs import Outcome
from worker.results import store_client
from worker.results.artifacts import write_activations

pytestmark = pytest.mark.model

CAPTURE = {"modules": ["model.layers.{0,3}"], "positions": "all"}
SAMPLED = {"model": "m", "messages": [{"role": "user", "content": "Count to ten."}], "temperature": 1.0}


@pytest.fixture(scope="module")
def served(tiny_dir):
    return load_engine(tiny_dir)


@pytest.fixture(params=[False, True], ids=["in-process", "store-process"])
def settings(redis_server, tmp_path, request) -> Iterator[Settings]:
    """Each test twice: the files stored and the outcome recorded by the engine's own threads, and
    by the store process (ACTQ_STORE_PROCESS, worker/results/store_process.py)."""
    yield Settings(redis_url=redis_server.url, storage_url=(tmp_path / "data").as_uri(), store_process=request.param)
    store_client.close_all()


def worker(served, store, jobs, settings, name: str) -> runtime.Runtime:
    """What `_record` uses of a worker's runtime: its model, stores and settings (no engine
    thread, heartbeat or progress: the job has already been decoded)."""
    return runtime.Runtime(
        settings=settings,
        served=served,
        store=store,
        jobs=jobs,
        registry=None,  # type: ignore[arg-type]
        worker_id=name,
        stop=threading.Event(),
        core=None,  # type: ignore[arg-type]
        progress=None,  # type: ignore[arg-type]
    )


def enqueued(jobs: JobStore, settings: Settings, request: JobRequest, points) -> JobRecord:
    record = JobRecord(
        id=str(uuid.uuid4()),
        status=JobStatus.queued,
        model="m",
        request=request,
        max_tokens=24,
        capture_points=points,
        created_at=now(),
    )
    jobs.enqueue([record], make_celery(settings))
    return record


def claimed_twice(jobs: JobStore, settings: Settings, request: JobRequest, points) -> tuple[JobRecord, JobRecord]:
    """A job claimed by worker A, then again by worker B (A paused past its heartbeat TTL and the
    lost-message check sent the job again): the record as each claim left it."""
    record = enqueued(jobs, settings, request, points)
    first, _ = jobs.claim(record.id, "host:A", 3)
    second, _ = jobs.claim(record.id, "host:B", 3)
    assert first is not None and second is not None and second.attempts == 2
    return first, second


def decoded(served, request: JobRequest, max_tokens: int = 24) -> Sequence:
    """The job decoded alone by the engine's decoder, as the engine thread hands it over."""
    seq = prepare(served, request, max_tokens)
    with torch.inference_mode():
        decoder = served.decoder()
        try:
            decoder.admit(seq)
            while not seq.ended:
                decoder.step()
        finally:
            decoder.close()
    return seq


def generated_text(served, seq: Sequence) -> str:
    return served.tokenizer.decode(seq.all_ids()[0][seq.prompt_tokens :], skip_special_tokens=True)


def assert_readers_get_the_record(settings: Settings, jobs: JobStore, store: LocalStore, job_id: str, served) -> None:
    """The record names the winner's folder, nothing else is stored, and the API's download and
    ranged tensor read give the bytes the record describes."""
    record = jobs.get(job_id)
    assert record is not None and record.status is JobStatus.succeeded and record.activations is not None
    winner = Attempt.of(record)
    assert store.folders(job_prefix(job_id)) == [winner.prefix(job_id)]
    assert record.activations.key == winner.prefix(job_id) + "/activations.safetensors"
    with TestClient(create_app(settings)) as http:
        whole = http.get(f"/jobs/{job_id}/activations")
        assert whole.status_code == 200, whole.text
        assert hashlib.sha256(whole.content).hexdigest() == record.activations.sha256
        assert len(whole.content) == record.activations.bytes
        tensors = load(whole.content)
        one = http.get(f"/jobs/{job_id}/activations/token_ids")
        assert one.status_code == 200 and torch.equal(load(one.content)["token_ids"], tensors["token_ids"])
    usage = record.result.usage
    ids = tensors["token_ids"]
    assert len(ids) == usage.prompt_tokens + usage.completion_tokens
    assert served.tokenizer.decode(ids[usage.prompt_tokens :], skip_special_tokens=True) == record.result.text
    assert tensors["model.layers.0"].shape[0] == len(ids) - 1


@pytest.mark.parametrize("stale_finishes", ["last", "first"])
def test_only_the_attempt_the_record_names_keeps_its_files(served, settings, jobs, store, stale_finishes):
    """Sampled, unseeded: the two attempts draw different texts. Whichever ends first, the record
    holds B's outcome (the current attempt), its manifest names B's file, and A's folder is gone."""
    request = JobRequest.model_validate({**SAMPLED, "capture": CAPTURE})
    first, second = claimed_twice(jobs, settings, request, resolve(request.capture, served.info))
    stale, current = decoded(served, request), decoded(served, request)
    assert generated_text(served, stale) != generated_text(served, current)  # two draws, two texts
    wanted = generated_text(served, current)
    a, b = worker(served, store, jobs, settings, "host:A"), worker(served, store, jobs, settings, "host:B")
    order = [(a, first, stale), (b, second, current)]
    for rt, record, seq in order if stale_finishes == "first" else order[::-1]:
        job_flow._record(rt, record, time.perf_counter(), seq)
        if rt is a:  # A lost: nothing of it is left, whatever the record says now
            assert Attempt.of(first).prefix(first.id) not in store.folders(job_prefix(first.id))
    assert_readers_get_the_record(settings, jobs, store, first.id, served)
    record = jobs.get(first.id)
    assert record.result.text == wanted and Attempt.of(record) == Attempt(2, "host:B")


def test_the_winner_removes_what_an_earlier_attempt_left(served, settings, jobs, store):
    """An earlier attempt that uploaded its file and then died before recording (its engine
    killed) left a folder; the attempt that records the outcome removes it. Greedy: both decode
    the same tokens, and only one file stays."""
    request = JobRequest.model_validate({**SAMPLED, "temperature": 0.0, "capture": CAPTURE})
    first, second = claimed_twice(jobs, settings, request, resolve(request.capture, served.info))
    died = served.finish(decoded(served, request), request)
    write_activations(store, first.id, "m", request.capture, died, prefix=Attempt.of(first).prefix(first.id))
    assert store.folders(job_prefix(first.id)) == [Attempt.of(first).prefix(first.id)]
    job_flow._record(
        worker(served, store, jobs, settings, "host:B"), second, time.perf_counter(), decoded(served, request)
    )
    assert_readers_get_the_record(settings, jobs, store, first.id, served)


def nnsight_job(jobs: JobStore, settings: Settings) -> tuple[JobRecord, JobRecord]:
    call = NnsightCall(model_key="m", sha256="0" * 64, bytes=1, nnsight_version="0.8.1", python_version="3.11")
    request = JobRequest(model="m", mode="nnsight", nnsight=call)
    return claimed_twice(jobs, settings, request, [])


def test_an_nnsight_result_is_fenced_the_same_way(served, settings, jobs, store):
    first, second = nnsight_job(jobs, settings)
    saves = {a: Outcome(saves={"hs": torch.full((3,), float(n))}, restored=[], held_s=0.0) for n, a in enumerate("AB")}
    b = worker(served, store, jobs, settings, "host:B")
    job_flow._record(b, second, time.perf_counter(), saves["B"])  # type: ignore[arg-type]
    job_flow._record(worker(served, store, jobs, settings, "host:A"), first, time.perf_counter(), saves["A"])  # type: ignore[arg-type]
    record = jobs.get(first.id)
    assert record.result.nnsight.key == Attempt.of(second).prefix(first.id) + "/nnsight-result.pt"
    assert store.folders(job_prefix(first.id)) == [Attempt.of(second).prefix(first.id)]
    with TestClient(create_app(settings)) as http:
        got = http.get(f"/jobs/{first.id}/nnsight-result")
    assert got.status_code == 200 and hashlib.sha256(got.content).hexdigest() == record.result.nnsight.sha256
    assert torch.equal(torch.load(io.BytesIO(got.content), weights_only=True)["hs"], torch.full((3,), 1.0))  # B's saves


def test_an_nnsight_result_recorded_before_attempt_folders_is_still_read(served, settings, jobs, store):
    """A record written by an older worker names no key: its saves are at the job's old place."""
    first, _ = nnsight_job(jobs, settings)
    data = b"saves written by an older worker"
    store.put_bytes(legacy_nnsight_result_key(first.id), data)
    output = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "saved": ["hs"]}
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    jobs.succeed(first.id, {"text": "", "finish_reason": "stop", "usage": usage, "nnsight": output}, None)
    with TestClient(create_app(settings)) as http:
        got = http.get(f"/jobs/{first.id}/nnsight-result")
    assert got.status_code == 200 and got.content == data


def claimed_once(jobs: JobStore, settings: Settings, request: JobRequest, points) -> JobRecord:
    claimed, _ = jobs.claim(enqueued(jobs, settings, request, points).id, "host:A", 3)
    assert claimed is not None
    return claimed


def test_a_cancel_accepted_while_the_last_step_ran_wins_over_the_success(served, settings, jobs, store):
    """The API answered 202 to a cancel while the job ran; the job's last step came before the
    progress thread's next round, so the engine never saw the flag. The transaction that would
    record its success reads the flag: the job ends `cancelled` with its text, and the file it had
    written is removed (CI's `actq cancel` test saw such jobs end `succeeded`)."""
    request = JobRequest.model_validate({**SAMPLED, "temperature": 0.0, "capture": CAPTURE})
    record = claimed_once(jobs, settings, request, resolve(request.capture, served.info))
    seq = decoded(served, request)
    with TestClient(create_app(settings)) as http:
        asked = http.post(f"/jobs/{record.id}/cancel")
        assert asked.status_code == 202, asked.text
        job_flow._record(worker(served, store, jobs, settings, "host:A"), record, time.perf_counter(), seq)
        ended = http.get(f"/jobs/{record.id}").json()
        assert ended["status"] == "cancelled" and ended["error"]["type"] == "cancelled", ended
        assert ended["result"]["text"] == generated_text(served, seq)
        assert ended["result"]["finish_reason"] == "cancelled" and ended["activations"] is None
        assert store.folders(job_prefix(record.id)) == []  # its file was written, then removed
        again = http.post(f"/jobs/{record.id}/cancel")
        assert again.status_code == 409 and "already ended cancelled" in again.text


def test_a_job_that_succeeded_first_is_not_told_it_will_be_cancelled(served, settings, jobs, store, redis_client):
    """The other order: the success is recorded, then the cancel arrives: 409 naming `succeeded`
    (never a 202 for a job that will not be cancelled), no flag set, the result kept."""
    request = JobRequest.model_validate({**SAMPLED, "temperature": 0.0, "capture": CAPTURE})
    record = claimed_once(jobs, settings, request, resolve(request.capture, served.info))
    job_flow._record(
        worker(served, store, jobs, settings, "host:A"), record, time.perf_counter(), decoded(served, request)
    )
    with TestClient(create_app(settings)) as http:
        late = http.post(f"/jobs/{record.id}/cancel")
        assert late.status_code == 409 and "already ended succeeded" in late.text, late.text
    assert not redis_client.exists(keys.cancel(record.id))
    assert_readers_get_the_record(settings, jobs, store, record.id, served)
