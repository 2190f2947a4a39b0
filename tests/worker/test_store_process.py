"""The store process (ACTQ_STORE_PROCESS, worker/results/store_process.py) with the tiny model, a
real Redis and a local store: the file it stores from a job's shared capture arena is the file the
engine's own threads write, byte for byte; a store process killed while it holds a job fails
that job with what ended it, leaves nothing published, and the next job starts another; one that
answers nothing (stopped) is ended by the engine's watchdog, one paused for less is left alone.
(tests/worker/test_attempt_files.py runs the fenced outcomes, stale attempts and cancels through both.)"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest
from safetensors.torch import load

from shared.attempts import Attempt
from shared.capture_spec import resolve
from shared.jobs import JobStore
from shared.schemas import JobRequest, JobStatus
from shared.settings import Settings
from shared.storage import job_prefix
from tests.worker.test_attempt_files import decoded, enqueued, worker
from tests.worker.test_batching import load_engine
from worker.engine import job_flow
from worker.hooks import shared_memory
from worker.results import store_client
from worker.results.artifacts import write_activations

pytestmark = pytest.mark.model

REQUEST = {
    "model": "m",
    "messages": [{"role": "user", "content": "Count to ten."}],
    "temperature": 0.0,
    "logprobs": True,
    "top_logprobs": 2,
    "capture": {"modules": ["model.layers.{0,3}", "model.layers.1.mlp"], "positions": "all", "dtype": "float16"},
}


@pytest.fixture(scope="module")
def served(tiny_dir):
    return load_engine(tiny_dir)


@pytest.fixture
def settings(redis_server, tmp_path) -> Iterator[Settings]:
    yield Settings(redis_url=redis_server.url, storage_url=(tmp_path / "data").as_uri(), store_process=True)
    store_client.close_all()


def claimed(jobs: JobStore, settings: Settings, served, request: JobRequest):
    record = enqueued(jobs, settings, request, resolve(request.capture, served.info))
    record, _ = jobs.claim(record.id, "host:A", 3)
    assert record is not None
    return record


def test_the_file_stored_from_shared_arenas_is_the_file_the_engine_writes(served, settings, jobs, store):
    store_client.process_for(settings).start()  # arenas made from now on are shared
    request = JobRequest.model_validate(REQUEST)
    record = claimed(jobs, settings, served, request)
    seq = decoded(served, request)
    generation = served.finish(seq, request)
    assert all(shared_memory.region_of(c.tensor) is not None for c in generation.captured)  # read there, not packed
    job_flow._record(worker(served, store, jobs, settings, "host:A"), record, time.perf_counter(), seq)
    done = jobs.get(record.id)
    assert done is not None and done.status is JobStatus.succeeded, done and done.error
    assert done.activations is not None
    stored = (store.root / done.activations.key).read_bytes()
    here = write_activations(store, record.id, "m", request.capture, generation, prefix="here")
    assert stored == (store.root / here.key).read_bytes()
    assert done.activations.sha256 == here.sha256
    assert [t.model_dump() for t in done.activations.tensors] == [t.model_dump() for t in here.tensors]
    assert done.activations.extra_sha256 == here.extra_sha256 and "top_logprobs" in here.extra
    assert load(stored)["model.layers.1.mlp"].shape[0] == len(generation.token_ids) - 1


def test_a_killed_store_process_fails_the_job_it_held_and_the_next_starts_another(served, settings, jobs, store):
    process = store_client.process_for(settings)
    process.start()
    child = process._proc
    assert child is not None
    request = JobRequest.model_validate(REQUEST)
    first, second = claimed(jobs, settings, served, request), claimed(jobs, settings, served, request)
    rt = worker(served, store, jobs, settings, "host:A")
    os.kill(child.pid, signal.SIGSTOP)  # it takes the job and does nothing with it
    seq = decoded(served, request)
    recording = threading.Thread(target=job_flow._record, args=(rt, first, time.perf_counter(), seq))
    recording.start()
    deadline = time.monotonic() + 60
    while not process._waiting and time.monotonic() < deadline:  # sent (registered as it is sent)
        time.sleep(0.05)
    with process._lock:  # the send, made under this lock, is over
        assert process._waiting
    os.kill(child.pid, signal.SIGKILL)
    recording.join(60)
    assert not recording.is_alive()
    failed = jobs.get(first.id)
    assert failed is not None and failed.status is JobStatus.failed and failed.error is not None
    assert failed.error.type == "internal_error"
    assert "the process storing its activations ended (killed by SIGKILL)" in failed.error.message
    assert store.folders(job_prefix(first.id)) == []  # nothing of it published
    job_flow._record(rt, second, time.perf_counter(), decoded(served, request))
    done = jobs.get(second.id)
    assert done is not None and done.status is JobStatus.succeeded
    assert process._proc is not None and process._proc.pid != child.pid
    assert store.folders(job_prefix(second.id)) == [Attempt.of(second).prefix(second.id)]


def stopped_while_storing(monkeypatch, silence: float, served, settings, jobs, store, record):
    """The store process started, the watchdog set to ping every 0.2 s and end it after `silence`
    seconds, the process stopped (SIGSTOP), and `record`'s job being stored through it on a thread
    of its own: (the process's handle, the process, the worker runtime, that thread)."""
    monkeypatch.setattr(store_client, "PING_SECONDS", 0.2)
    monkeypatch.setattr(store_client, "SILENCE_SECONDS", silence)
    process = store_client.process_for(settings)
    process.start()
    child = process._proc
    assert child is not None
    rt = worker(served, store, jobs, settings, "host:A")
    os.kill(child.pid, signal.SIGSTOP)
    seq = decoded(served, JobRequest.model_validate(REQUEST))
    recording = threading.Thread(target=job_flow._record, args=(rt, record, time.perf_counter(), seq))
    recording.start()
    return process, child, rt, recording


def test_a_store_process_that_answers_nothing_is_ended_and_fails_its_job_saying_so(
    served, settings, jobs, store, monkeypatch
):
    """Stopped (SIGSTOP), not dead: the engine's watchdog pings it while it holds a job, ends it once
    it answered nothing for SILENCE_SECONDS, and the job fails saying so instead of waiting for its
    time limit; the next job starts another process."""
    request = JobRequest.model_validate(REQUEST)
    first, second = claimed(jobs, settings, served, request), claimed(jobs, settings, served, request)
    process, child, rt, recording = stopped_while_storing(monkeypatch, 3.0, served, settings, jobs, store, first)
    recording.join(90)
    if child.poll() is None:  # the watchdog did not end it: never leave the test's teardown waiting on it
        child.kill()
        recording.join(60)
        pytest.fail("the job still waited on a store process that answered nothing")
    failed = jobs.get(first.id)
    assert failed is not None and failed.status is JobStatus.failed and failed.error is not None
    assert failed.error.type == "internal_error"
    assert "answered nothing for 3 s and was ended (killed by SIGKILL)" in failed.error.message
    assert store.folders(job_prefix(first.id)) == []
    job_flow._record(rt, second, time.perf_counter(), decoded(served, request))
    done = jobs.get(second.id)
    assert done is not None and done.status is JobStatus.succeeded
    assert process._proc is not None and process._proc.pid != child.pid


def test_a_store_process_paused_for_less_than_the_silence_keeps_its_job(served, settings, jobs, store, monkeypatch):
    """A pause shorter than SILENCE_SECONDS (then SIGCONT): it answers the pings again, is left
    alone, and stores the job."""
    record = claimed(jobs, settings, served, JobRequest.model_validate(REQUEST))
    process, child, _, recording = stopped_while_storing(monkeypatch, 8.0, served, settings, jobs, store, record)
    deadline = time.monotonic() + 60
    while not process._waiting and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # silent past several pings, well short of the silence
    os.kill(child.pid, signal.SIGCONT)  # (should it be gone already, the job's failure below says so)
    recording.join(90)
    assert not recording.is_alive()
    done = jobs.get(record.id)
    assert done is not None and done.status is JobStatus.succeeded, done and done.error
    assert process._proc is child and child.poll() is None
