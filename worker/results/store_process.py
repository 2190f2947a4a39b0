"""The store process: `python -m worker.results.store_process`, started by an engine process
(worker/results/store_client.py) to store its capture jobs' files and record their success, away
from the engine's own GIL.

Why a process: every thread beside the engine thread that runs (Python, hashing, syscalls) takes
the GIL back from it at the return of each of its torch ops; a thread storing jobs without pause
leaves a decoding loop a third of its speed (bench/bench_store_contention.py). Here the engine
thread's process does only what needs the job's state (its text, its tensors packed once into
shared memory) and this process does the rest: the file's hashes, its write and rename, the
manifest, the success transaction, the earlier attempts' folders.

Protocol, over a Unix SEQPACKET socket (fd ACTQ_STORE_SOCKET_FD): the engine sends its settings
as JSON first (whatever their source, env or a test's own), then one datagram per job, its
sequence number in ASCII, with its file descriptors: a memfd holding an 8-byte little-endian
length N, N bytes of JSON (what to store and record, and where each tensor's bytes are), padding
to a multiple of 8, the file's safetensors header and the tensors packed there (the small ones);
then each shared capture arena the other tensors are column ranges of
(worker/hooks/shared_memory.py), read here with one copy per tensor. This process answers one
JSON datagram per job: `{"seq": S, "outcome": "succeeded" | "stale" | "cancel" | "failed" |
"redis", ...}` ("failed" with `error_type` and `message`); a datagram `ping` without fds is
answered `{"pong": true}` at once (the engine's watchdog, worker/results/store_client.py). Nothing
but that JSON and the tensors' bytes is ever decoded. When the socket closes (the engine ended),
this process ends once its jobs are answered."""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import socket
import struct
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

SOCKET_FD_ENV = "ACTQ_STORE_SOCKET_FD"
REPLY_BYTES = 8192  # the most an answer takes (an error's message is cut to fit)
MESSAGE_CHARS = 1500
SETTINGS_BYTES = 1 << 20  # the first datagram: the engine's settings as JSON
MAX_FDS = 8  # a job's request and its arenas (its own and its unedited twin's)
PING, PONG = b"ping", b'{"pong": true}'  # the engine asks whether this process still answers (no fds)
log = logging.getLogger("actq.store")


def read_request(fd: int) -> tuple[dict[str, Any], mmap.mmap, int]:
    """The request in memfd `fd`: (its JSON, the mapped region, where the header starts in it)."""
    region = _map(fd)
    (length,) = struct.unpack_from("<Q", region, 0)
    meta = json.loads(region[8 : 8 + length])
    return meta, region, file_start(length)


def _map(fd: int) -> mmap.mmap:
    return mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ)


def file_start(meta_length: int) -> int:
    """Where the header begins after an 8-byte length and `meta_length` bytes of JSON (8-aligned)."""
    return 8 + meta_length + (-meta_length % 8)


def file_parts(meta: dict[str, Any], packed: memoryview, regions: list[mmap.mmap]) -> list[tuple[str, memoryview]]:
    """Each tensor's bytes in file order, (name, bytes): a slice of the packed ones, or its rows
    gathered out of a shared region (one copy, here)."""
    import numpy as np

    parts = []
    for name, where in zip(meta["names"], meta["tensors"], strict=True):
        if "packed" in where:
            parts.append((name, packed[where["packed"] : where["packed"] + where["bytes"]]))
            continue
        rows = np.ndarray(
            where["shape"],
            np.uint8,
            buffer=regions[where["region"] - 1],
            offset=where["offset"],
            strides=where["strides"],
        )
        parts.append((name, np.ascontiguousarray(rows).data.cast("B")))
    return parts


def _write(path: Path, views: list[memoryview]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
    try:
        for view in views:
            while view:
                view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def _store(
    store: Any, jobs: Any, settings: Any, meta: dict[str, Any], header: memoryview, parts: list[tuple[str, memoryview]]
) -> dict[str, Any]:
    """Hash and store one job's file and manifest, then record its success: the outcome to answer."""
    import redis

    from shared.attempts import Attempt, StaleAttempt
    from shared.errors import JobFailure, StorageError
    from shared.job_transactions import CancelAsked
    from worker.results import attempt_files
    from worker.results.publishing import publish, scratch_file
    from worker.rules.failures import failure_of

    job_id = meta["job_id"]
    attempt = Attempt(meta["attempt"][0], meta["attempt"][1])
    try:
        digest = hashlib.sha256(header)
        checksums = {}
        for name, part in parts:
            digest.update(part)
            checksums[name] = hashlib.sha256(part).hexdigest()
        size = len(header) + sum(part.nbytes for _, part in parts)
        tmp = scratch_file(store)
        try:
            try:
                _write(tmp, [header, *(part for _, part in parts)])
            except OSError as exc:
                raise StorageError(f"cannot write activations: {exc.strerror or exc}") from exc
            manifest = publish(
                store, job_id, meta["model"], meta["metadata"], meta["entries"], meta["extra"], tmp,
                size, digest.hexdigest(), checksums, attempt.prefix(job_id),
            )  # fmt: skip
        finally:
            tmp.unlink(missing_ok=True)
        jobs.succeed(job_id, meta["result"], manifest.model_dump(), settings.result_inline_bytes, attempt=attempt)
        attempt_files.tidy(store, job_id, attempt, succeeded=True)
        return {"outcome": "succeeded", "bytes": size}
    except StaleAttempt as lost:
        attempt_files.discard(store, job_id, lost)
        return {"outcome": "stale"}
    except CancelAsked:
        return {"outcome": "cancel"}
    except redis.RedisError as exc:
        return {"outcome": "redis", "message": str(exc)[:MESSAGE_CHARS]}
    except Exception as exc:  # noqa: BLE001 - the job's failure, answered: never this process's end
        failure = exc if isinstance(exc, JobFailure) else failure_of(exc, f"storing job {job_id}")
        return {"outcome": "failed", "error_type": failure.error_type, "message": failure.message[:MESSAGE_CHARS]}


def main() -> None:
    import redis

    from shared.jobs import JobStore
    from shared.settings import Settings
    from shared.storage import open_store

    logging.basicConfig(level=logging.INFO, format="[%(asctime)s: %(levelname)s/store] %(message)s", stream=sys.stderr)
    sock = socket.socket(fileno=int(os.environ[SOCKET_FD_ENV]))
    first = sock.recv(SETTINGS_BYTES)
    if not first:  # the engine ended before it said anything
        return
    settings = Settings.model_validate_json(first)
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=10, socket_connect_timeout=10)
    jobs = JobStore(client, settings.job_retention_seconds, settings.redis_outage_seconds)
    store = open_store(settings, wait_for_outages=True)
    answering = threading.Lock()
    # one thread per job waiting: a slow store's upload holds only its own job (as the engine's pool did)
    pool = ThreadPoolExecutor(max_workers=max(settings.max_batch, 2), thread_name_prefix="actq-store")

    def run(seq: int, fds: list[int]) -> None:
        try:
            meta, region, at = read_request(fds[0])
            shared = [_map(fd) for fd in fds[1:]]
            try:
                with memoryview(region) as whole:
                    header = whole[at : at + meta["header"]]
                    parts = file_parts(meta, whole[at + meta["header"] :], shared)
                    answer = _store(store, jobs, settings, meta, header, parts)
                    del header, parts
            finally:
                for mapped in (region, *shared):
                    try:
                        mapped.close()
                    except BufferError:  # a view still held (by an exception's traceback): unmapped when freed
                        pass
        except Exception as exc:  # an unreadable request: answered, never this process's end
            log.exception("request %d could not be read", seq)
            why = f"{type(exc).__name__}: {exc}"[:MESSAGE_CHARS]
            answer = {"outcome": "failed", "error_type": "internal_error", "message": why}
        finally:
            for fd in fds:
                os.close(fd)
        with answering:
            sock.send(json.dumps({"seq": seq, **answer}).encode())

    while True:
        message, fds, _, _ = socket.recv_fds(sock, 64, MAX_FDS)
        if not message:  # the engine closed its end: it ended
            break
        if message == PING and not fds:  # answered here, never behind the jobs in the pool
            with answering:
                sock.send(PONG)
            continue
        if not fds:
            log.error("a request came without its file; ignored")
            continue
        pool.submit(run, int(message), fds)
    pool.shutdown(wait=True)


if __name__ == "__main__":
    main()
