"""Outages injected for real: Redis restarted under 200 queued jobs, the S3 server stopped in the
middle of a run, a local store whose disk fills up, a whole worker (parent and child) killed.
Each runs on a stack of its own so the session's stack never sees the fault."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from datetime import datetime

import httpx
import pytest
import redis

from shared import keys
from shared.cli.processes import free_port
from shared.cli.redis_server import RedisServer
from tests.e2e.conftest import own_stack
from tests.support.stack import TERMINAL, assert_stored_once
from tests.support.tmpfs import mounted_tmpfs

pytestmark = pytest.mark.slow


def tiny_body(model: str, max_tokens: int = 4, **extra) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Count to ten."}],
        "max_tokens": max_tokens,
        "capture": {"modules": ["model.layers.{0,3}"], "positions": "all"},
        **extra,
    }


def submit_batch(http: httpx.Client, body: dict, count: int, first: dict | None = None) -> list[str]:
    """`count` jobs of `body` in one batch; `first` replaces the first one (e.g. a longer job)."""
    entries = [{"request": first or body}] + [{"request": body}] * (count - 1)
    response = http.post("/jobs/batch", json={"jobs": entries})
    assert response.status_code == 202, response.text
    return [j["id"] for j in response.json()["jobs"]]


def wait_all(s, http: httpx.Client, ids: list[str], timeout: float) -> list[dict]:
    """Every job's final record; fails naming the jobs that never finished."""
    deadline = time.monotonic() + timeout
    pending, done = list(ids), {}
    while pending and time.monotonic() < deadline:
        job = http.get(f"/jobs/{pending[0]}", params={"wait": 5}).json()
        if job["status"] in TERMINAL:
            done[job["id"]] = job
            pending.pop(0)
    assert not pending, (
        f"{len(pending)} jobs unfinished, e.g. {http.get(f'/jobs/{pending[0]}').json()}\n{s.log_tail('worker-w')}"
    )
    return [done[i] for i in ids]


def wait_running(http: httpx.Client, job_id: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while (status := http.get(f"/jobs/{job_id}").json()["status"]) != "running":
        assert status == "queued" and time.monotonic() < deadline, status
        time.sleep(0.005)


def wait_started(http: httpx.Client, job_id: str, timeout: float = 60) -> None:
    """Until the job has left the queue: it runs, or ran already (a short job may start and end
    between two polls)."""
    deadline = time.monotonic() + timeout
    while http.get(f"/jobs/{job_id}").json()["status"] == "queued":
        assert time.monotonic() < deadline, "still queued"
        time.sleep(0.005)


def assert_one_artifact_each(s, jobs: list[dict]) -> None:
    for job in jobs:
        assert_stored_once(s.storage_dir, job)


def test_redis_restart_with_200_jobs_queued(live, tiny_dir, tmp_path, own_redis):
    """Redis (append-only) stopped and started again on the same port under 200 queued jobs: the
    API answers 503 naming Redis while it is down, never 500, and recovers by itself; the worker
    reconnects by itself; every job succeeds exactly once; the worker's prefetch ends where it
    began (worker/storing_room.py)."""
    with own_stack(tmp_path / "stack", live.env, ACTQ_REDIS_URL=own_redis.url) as s:
        s.start_worker("w", {"ACTQ_MODEL": str(tiny_dir), "ACTQ_MODEL_NAME": "tiny-rr"})
        with s.client() as http:
            ids = submit_batch(
                http, tiny_body("tiny-rr", max_tokens=8), 200, first=tiny_body("tiny-rr", max_tokens=200)
            )
            wait_running(http, ids[0])  # one job is generating when Redis goes away
            own_redis.stop()  # SIGTERM: Redis writes its append-only file and exits
            down = {
                "GET /jobs/{id}": http.get(f"/jobs/{ids[-1]}"),
                "GET /jobs/{id}?wait": http.get(f"/jobs/{ids[-1]}", params={"wait": 1}),
                "POST /jobs": http.post("/jobs", json=tiny_body("tiny-rr")),
                "POST /jobs/batch": http.post("/jobs/batch", json={"jobs": [{"request": tiny_body("tiny-rr")}]}),
                "GET /models": http.get("/models"),
                "GET /health": http.get("/health"),
            }
            for what, response in down.items():
                assert response.status_code == 503, (what, response.status_code, response.text)
                assert "Redis" in response.json()["detail"], (what, response.text)
            time.sleep(3)
            own_redis.start()
            deadline = time.monotonic() + 30
            while (health := http.get("/health")).status_code != 200:
                assert time.monotonic() < deadline, health.text
                time.sleep(0.2)
            jobs = wait_all(s, http, ids, timeout=300)
            assert jobs[0]["attempts"] == 1 and jobs[0]["result"]["usage"]["completion_tokens"] == 200  # outcome kept
            assert [j["status"] for j in jobs] == ["succeeded"] * 200, [
                (j["id"], j["status"], j["error"]) for j in jobs if j["status"] != "succeeded"
            ]
            assert_one_artifact_each(s, jobs)
            client = redis.Redis.from_url(own_redis.url)
            assert client.zcard(keys.queued("tiny-rr")) == 0
            assert len(set(client.scan_iter(match=keys.job("*"), count=1000))) == 200  # none lost, none made twice
            client.close()
            # the reconnected consumer's prefetch is back to the batch's places (16), not the pool's 32 threads
            assert _prefetch(s, "tiny-rr") == 16


def test_jobs_whose_broker_message_was_lost_or_stranded_still_run(live, tiny_dir, tmp_path, own_redis):
    """A Redis outage can take a job's message with it (a BRPOP that Redis never answered) or leave
    it in `unacked` with no task holding it (delivered just before the consumer lost Redis; both
    seen in the restart test above). The job stays queued in the store. A worker notices at two
    checks in a row and sends the message again; each job runs once, like the others."""
    with own_stack(tmp_path / "stack", live.env, ACTQ_REDIS_URL=own_redis.url) as s:
        worker = {"ACTQ_MODEL": str(tiny_dir), "ACTQ_MODEL_NAME": "tiny-lost", "ACTQ_LOST_MESSAGE_CHECK_SECONDS": "1"}
        s.start_worker("w", worker)
        s.wait_workers()
        s.stop_process("worker-w")  # the model is known; its jobs wait for a worker
        queue = keys.queue("tiny-lost")
        with s.client() as http:
            ids = submit_batch(http, tiny_body("tiny-lost"), 4)
            client = redis.Redis.from_url(own_redis.url)
            lost = json.loads(client.rpop(queue))
            stranded = json.loads(client.rpop(queue))
            tag = stranded["properties"]["delivery_tag"]
            client.hset("unacked", tag, json.dumps([stranded, "", queue]))
            client.zadd("unacked_index", {tag: time.time()})
            assert [lost["headers"]["id"], stranded["headers"]["id"]] == ids[:2]
            s.start_worker("w", worker)
            jobs = wait_all(s, http, ids, timeout=120)
        assert [(j["status"], j["attempts"]) for j in jobs] == [("succeeded", 1)] * 4
        assert_one_artifact_each(s, jobs)
        log = s.log_tail("worker-w", chars=100_000)
        assert f"job {ids[0]} was queued with no broker message" in log
        assert f"job {ids[1]}: its message is stranded in unacked, held by no live worker" in log
        assert client.llen(queue) == 0 and client.hlen("unacked") == 0
        client.close()


def test_an_outcome_redis_did_not_take_in_time_runs_again(live, tiny_dir, tmp_path, own_redis):
    """Redis is away longer than ACTQ_REDIS_OUTAGE_SECONDS while a job ends: its outcome cannot
    be recorded. The job runs again once Redis is back and succeeds once, with its own files
    (before, its task raised, Celery acknowledged the message, and the job stayed `running` on
    a live engine with no message: nothing ever ran it again)."""
    with own_stack(tmp_path / "stack", live.env, ACTQ_REDIS_URL=own_redis.url) as s:
        worker = {
            "ACTQ_MODEL": str(tiny_dir),
            "ACTQ_MODEL_NAME": "tiny-gone",
            "ACTQ_REDIS_OUTAGE_SECONDS": "1",
            "ACTQ_LOST_MESSAGE_CHECK_SECONDS": "1",
        }
        s.start_worker("w", worker)
        with s.client() as http:
            job_id = s.submit(http, tiny_body("tiny-gone", max_tokens=200))
            wait_running(http, job_id)
            own_redis.stop()
            time.sleep(6)  # the job ends meanwhile; recording its outcome gives up after 1 s
            own_redis.start()
            deadline = time.monotonic() + 30
            while http.get("/health").status_code != 200:
                assert time.monotonic() < deadline
                time.sleep(0.2)
            [job] = wait_all(s, http, [job_id], timeout=120)
        assert job["status"] == "succeeded" and job["attempts"] == 2, job
        assert job["result"]["usage"]["completion_tokens"] == 200
        folder = s.storage_dir / "jobs" / job_id
        deadline = time.monotonic() + 30  # the winner removes the first attempt's folder after its record
        while len(list(folder.iterdir())) > 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert_stored_once(s.storage_dir, job)


def test_kill_9_of_the_whole_worker_redelivers_its_jobs(live, tiny_dir, tmp_path, own_redis):
    """SIGKILL of a worker's parent and child together: nothing acknowledges its messages, so Redis
    hands them out again once the visibility timeout passes (10 s here; a job may not run longer
    than 7 s). A new worker finishes every job; the one that was generating has attempts 2. (A job
    takes 0.7-1.8 s here; with a 4 s limit the first one, which also warms the engine, timed out
    in a CI run of twice the usual length.)"""
    visibility = 10
    limits = {
        "ACTQ_JOB_SOFT_TIME_LIMIT": "6",
        "ACTQ_JOB_TIME_LIMIT": "7",
        "ACTQ_VISIBILITY_TIMEOUT": str(visibility),
        "ACTQ_MAX_BATCH": "1",
    }
    model = {"ACTQ_MODEL": str(tiny_dir), "ACTQ_MODEL_NAME": "tiny-kw"}
    with own_stack(tmp_path / "stack", live.env, ACTQ_REDIS_URL=own_redis.url, **limits) as s, s.client() as http:
        worker = s.start_worker("w", model)
        ids = submit_batch(http, tiny_body("tiny-kw", max_tokens=200), 6)
        wait_running(http, ids[1])
        time.sleep(0.2)
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
        killed = time.time()
        time.sleep(1)
        stuck = [http.get(f"/jobs/{i}").json() for i in ids]
        statuses = [job["status"] for job in stuck]
        assert statuses[:2] == ["succeeded", "running"] and set(statuses[2:]) == {"queued"}, [
            (job["status"], job["error"]) for job in stuck
        ]
        s.start_worker("w2", model)
        jobs = wait_all(s, http, ids, timeout=120)
        assert [j["status"] for j in jobs] == ["succeeded"] * 6, [(j["status"], j["error"]) for j in jobs]
        assert [j["attempts"] for j in jobs] == [1, 2, 1, 1, 1, 1]
        rerun = datetime.fromisoformat(jobs[1]["started_at"]).timestamp()
        assert rerun - killed >= visibility - 1, "redelivered before the visibility timeout"
        assert_one_artifact_each(s, jobs)


@pytest.mark.parametrize("outage_seconds", [60, 1])
def test_s3_server_stopped_mid_run(live, tiny_dir, tmp_path, outage_seconds):
    """SeaweedFS stopped while 30 capture jobs run, then started again. A worker that waits out
    outages (ACTQ_STORAGE_OUTAGE_SECONDS=60, the default) succeeds every job once S3 is back; one
    that waits 1 s fails the jobs that met the outage, naming the unreachable endpoint. A failed
    job leaves no object, a succeeded one exactly its file and manifest; none is stuck."""
    from tests.support.s3_server import BUCKET, SeaweedS3

    s3 = SeaweedS3(tmp_path / "seaweedfs").start()
    try:
        env = {**s3.env("outage"), "ACTQ_STORAGE_OUTAGE_SECONDS": str(outage_seconds)}
        with own_stack(tmp_path / "stack", live.env, **env) as s, s.client() as http:
            s.start_worker("w", {"ACTQ_MODEL": str(tiny_dir), "ACTQ_MODEL_NAME": "tiny-s3o"})
            # long enough that the jobs are still generating when S3 stops
            ids = submit_batch(http, tiny_body("tiny-s3o", max_tokens=48), 30)
            wait_started(http, ids[3])
            s3.stop()
            time.sleep(3)
            s3.start()
            restarted = time.time()
            jobs = wait_all(s, http, ids, timeout=300)
            listing = s3.client().list_objects_v2(Bucket=BUCKET, Prefix="outage/jobs/").get("Contents", [])
            stored: dict[str, set[str]] = {}
            for item in listing:
                job_id, name = item["Key"].split("/", 3)[2:4]
                stored.setdefault(job_id, set()).add(name)
            failed = [j for j in jobs if j["status"] != "succeeded"]
            for job in jobs:
                if job["status"] == "succeeded":
                    folder = job["activations"]["key"].split("/")[2]  # the attempt the record names
                    wanted = {f"{folder}/activations.safetensors", f"{folder}/manifest.json"}
                    assert stored.get(job["id"]) == wanted, (job["id"], stored.get(job["id"]))
                else:
                    assert job["status"] == "failed" and job["error"]["type"] == "storage_error", job
                    assert f"S3 endpoint {s3.endpoint} is unreachable" in job["error"]["message"], job["error"]
                    assert job["id"] not in stored, stored.get(job["id"])
            if outage_seconds == 60:
                assert not failed, failed[0]
                spanned = [j for j in jobs if datetime.fromisoformat(j["finished_at"]).timestamp() >= restarted]
                # a job that began while S3 was down (2 s or more before it was back) waited it out
                assert spanned and datetime.fromisoformat(spanned[0]["started_at"]).timestamp() < restarted - 2
            else:
                assert failed, "no job met the outage"
            after = s.wait(http, s.submit(http, tiny_body("tiny-s3o")))  # the worker goes on
            assert after["status"] == "succeeded"
    finally:
        s3.stop()


def _seconds(job: dict) -> float:
    """From submission to the recorded outcome."""
    return (datetime.fromisoformat(job["finished_at"]) - datetime.fromisoformat(job["created_at"])).total_seconds()


def _prefetch(s, model: str) -> int:
    """The prefetch of `model`'s worker, as Celery reports it (`inspect stats`: its consumer's QoS)."""
    from shared.broker import make_celery
    from shared.settings import Settings

    replies = make_celery(Settings(redis_url=s.redis_url)).control.inspect(timeout=5.0).stats() or {}
    (stats,) = [reply for node, reply in replies.items() if node.startswith(f"actq-{model}-")]
    return int(stats["prefetch_count"])


def test_an_s3_outage_holds_only_the_jobs_that_store(live, tiny_dir, tmp_path):
    """Issue 47: S3 stopped for 20 s while a worker runs a mix. Capture jobs wait the outage out
    (ACTQ_STORAGE_OUTAGE_SECONDS=60) and, past ACTQ_STORAGE_BACKLOG_JOBS jobs waiting to store,
    later capture jobs wait to join a batch, saying why; jobs that capture nothing finish in
    about their normal time, long before S3 is back (before, they queued behind the uploads on
    the two finisher threads and took the whole outage). The worker's batch holds 4 jobs
    (ACTQ_MAX_BATCH=4), as many as are uploading: the jobs storing leave their places to the next
    ones (worker/storing_room.py; before, their task threads held the worker's every message and
    the jobs that store nothing were not even fetched until S3 was back). The API stays live and
    ready; /health says the store cannot be used."""
    from tests.support.s3_server import BUCKET, SeaweedS3

    outage = 20.0
    s3 = SeaweedS3(tmp_path / "seaweedfs").start()
    try:
        with own_stack(tmp_path / "stack", live.env, **s3.env("mixed")) as s, s.client() as http:
            s.start_worker(
                "w",
                {
                    "ACTQ_MODEL": str(tiny_dir),
                    "ACTQ_MODEL_NAME": "tiny-mix",
                    "ACTQ_STORAGE_BACKLOG_JOBS": "2",
                    "ACTQ_MAX_BATCH": "4",
                },
            )
            plain = {**tiny_body("tiny-mix", max_tokens=16), "capture": None}
            capture = tiny_body("tiny-mix", max_tokens=4)
            wait_all(s, http, submit_batch(http, plain, 2), timeout=120)  # warm
            normal = max(_seconds(j) for j in wait_all(s, http, submit_batch(http, plain, 4), timeout=120))
            assert _prefetch(s, "tiny-mix") == 4  # nothing storing: no more messages than the batch's places
            s3.stop()
            stopped = time.monotonic()
            uploading = submit_batch(http, capture, 4)  # decoded in a moment, then waiting for S3
            time.sleep(3)
            held = submit_batch(http, capture, 2)
            quick = submit_batch(http, plain, 4)
            done = wait_all(s, http, quick, timeout=outage)
            assert time.monotonic() - stopped < outage - 5, "the jobs that store nothing waited for S3"
            assert [j["status"] for j in done] == ["succeeded"] * 4, done
            slowest = max(_seconds(j) for j in done)
            assert slowest <= 3 * normal + 5, (slowest, normal)
            waiting = [http.get(f"/jobs/{i}").json()["status"] for i in uploading + held]
            assert waiting == ["running"] * 6, waiting
            assert http.get("/livez").status_code == 200
            assert http.get("/readyz").json() == {"status": "ready", "redis": "ok"}
            health = http.get("/health")
            assert health.status_code == 503 and "is unreachable" in health.json()["storage"], health.text
            assert _prefetch(s, "tiny-mix") == 8  # the 4 jobs storing: 4 more, the room's limit
            log = s.log_tail("worker-w", chars=100_000)
            for job_id in held:
                assert f"job {job_id} waits to join a batch: the files of 4 jobs are waiting to be stored" in log
            time.sleep(max(0.0, outage - (time.monotonic() - stopped)))
            s3.start()
            stored = wait_all(s, http, uploading + held, timeout=180)
            assert [j["status"] for j in stored] == ["succeeded"] * 6, [j["error"] for j in stored]
            listing = s3.client().list_objects_v2(Bucket=BUCKET, Prefix="mixed/jobs/").get("Contents", [])
            assert {item["Key"].removeprefix("mixed/") for item in listing} == {
                key
                for j in stored
                for key in (
                    j["activations"]["key"],
                    j["activations"]["key"].replace("activations.safetensors", "manifest.json"),
                )
            }
            print(f"no capture: normal {normal:.2f} s, during the outage at most {slowest:.2f} s")
    finally:
        s3.stop()


def test_disk_full_on_the_local_store(live, tiny_dir, tmp_path):
    """The local store on a 1 MiB tmpfs, filled up: a capture job fails as storage_error saying
    the disk is full and leaves no file; the worker survives and, once there is room, stores the
    next job whole."""
    with mounted_tmpfs(tmp_path / "full", "1m") as mount:
        with own_stack(tmp_path / "stack", live.env, ACTQ_STORAGE_URL=mount.as_uri()) as s, s.client() as http:
            s.start_worker("w", {"ACTQ_MODEL": str(tiny_dir), "ACTQ_MODEL_NAME": "tiny-full"})
            filler = mount / "filler"
            with open(filler, "wb") as handle:  # leave about 16 KiB free; the capture needs more
                handle.write(b"\0" * ((1 << 20) - (16 << 10)))
            body = tiny_body("tiny-full", max_tokens=32)
            failed = s.wait(http, s.submit(http, body))
            assert failed["status"] == "failed" and failed["error"]["type"] == "storage_error", failed
            assert "No space left on device" in failed["error"]["message"], failed["error"]
            assert not [p for p in (mount / "jobs" / failed["id"]).rglob("*") if p.is_file()]
            assert not any((mount / ".tmp").iterdir()), list((mount / ".tmp").iterdir())
            assert http.get(f"/jobs/{failed['id']}/activations").status_code == 409
            filler.unlink()
            ok = s.wait(http, s.submit(http, body))
            assert ok["status"] == "succeeded" and ok["activations"]["bytes"] > 16 << 10
            assert_one_artifact_each(s, [ok])


def _refuse(kind: str, client: redis.Redis, redis_dir) -> None:
    if kind == "oom":  # maxmemory reached under noeviction
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", 1)
    elif kind == "readonly":  # it became a replica (of a master that is not there)
        client.replicaof("127.0.0.1", free_port())
    else:  # MISCONF: the filesystem under its append-only file is full
        with open(redis_dir / "filler", "wb", buffering=0) as handle:  # unbuffered: closing it writes nothing
            try:
                while True:
                    handle.write(b"\0" * (64 << 10))
            except OSError:
                pass
        try:  # a write that cannot reach the AOF; its own error comes at the next beforeSleep
            client.set("actq-test:trigger", "x" * 4096)
        except redis.ResponseError as exc:  # the worker's own writes met the full disk first
            assert str(exc).startswith("MISCONF"), exc
        deadline = time.monotonic() + 10
        while client.info("persistence")["aof_last_write_status"] != "err":
            assert time.monotonic() < deadline, "Redis never failed to write its AOF"
            time.sleep(0.05)


def _allow(kind: str, client: redis.Redis, redis_dir) -> None:
    if kind == "oom":
        client.config_set("maxmemory", 0)
    elif kind == "readonly":
        client.replicaof("NO", "ONE")
    else:
        (redis_dir / "filler").unlink()


@pytest.mark.parametrize("kind", ["oom", "readonly", "misconf"])
def test_redis_refusing_writes_for_a_few_seconds_loses_nothing(live, tiny_dir, tmp_path, kind):
    """Redis refuses writes for 4 s (OOM, READONLY, or MISCONF from a full filesystem under its
    append-only file: issue 22) while 20 jobs are queued and one generates. POST /jobs answers 503
    naming the refusal; the worker never exits (kombu's own transport died with "Unrecoverable
    error ... MISCONF"); once Redis accepts writes again every job succeeds exactly once."""
    redis_dir = tmp_path / "redis"
    redis_dir.mkdir()
    if kind == "misconf":
        command = ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(redis_dir)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    server = RedisServer(redis_dir).start()
    client = redis.Redis.from_url(server.url, decode_responses=True)
    reasons = {
        "oom": "refuses writes: OOM",
        "readonly": "refuses writes: READONLY",
        "misconf": "refuses writes: MISCONF",
    }
    try:
        with own_stack(tmp_path / "stack", live.env, ACTQ_REDIS_URL=server.url) as s, s.client() as http:
            worker = s.start_worker("w", {"ACTQ_MODEL": str(tiny_dir), "ACTQ_MODEL_NAME": "tiny-rw"})
            ids = submit_batch(http, tiny_body("tiny-rw", max_tokens=8), 20, first=tiny_body("tiny-rw", max_tokens=120))
            wait_running(http, ids[0])
            _refuse(kind, client, redis_dir)
            refused = http.post("/jobs", json=tiny_body("tiny-rw"))
            assert refused.status_code == 503 and reasons[kind] in refused.json()["detail"], refused.text
            time.sleep(4)
            assert worker.poll() is None, s.log_tail("worker-w")
            _allow(kind, client, redis_dir)
            jobs = wait_all(s, http, ids, timeout=240)
            assert [j["status"] for j in jobs] == ["succeeded"] * 20, [(j["status"], j["error"]) for j in jobs]
            assert_one_artifact_each(s, jobs)
            assert worker.poll() is None and "Unrecoverable error" not in s.log_tail("worker-w", chars=200_000)
            after = s.wait(http, s.submit(http, tiny_body("tiny-rw")))  # the worker goes on
            assert after["status"] == "succeeded"
            assert len(set(client.scan_iter(match=keys.job("*"), count=1000))) == 21
    finally:
        client.close()
        server.stop()
        if kind == "misconf":
            subprocess.run(["umount", str(redis_dir)], check=False)
