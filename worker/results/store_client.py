"""The engine's side of the store process (worker/results/store_process.py, which says why and
how): a capture job's file is packed once into shared memory here, and that process hashes and
stores it, writes its manifest and records the job's success. The process is started at the first
job and again after it ended; a job it held when it ended fails with what ended it, and a process
that stops answering while it holds jobs is ended (`PING_SECONDS`, `SILENCE_SECONDS`)."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import mmap
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any

import redis
import torch

from shared.dtypes import SAFETENSORS_CODE
from shared.errors import InternalError, JobFailure
from shared.job_transactions import CancelAsked
from shared.settings import Settings
from shared.storage.tensors import header_bytes
from worker.hooks import shared_memory
from worker.results.artifacts import CaptureFile
from worker.results.store_process import PING, REPLY_BYTES, SOCKET_FD_ENV, file_start
from worker.rules.failures import exit_status

log = logging.getLogger(__name__)
# While the process holds jobs it is pinged every PING_SECONDS; one that answers nothing for
# SILENCE_SECONDS (stopped, frozen: its main thread answers at once, whatever its jobs are doing)
# is killed, and its jobs fail as when it dies, rather than waiting for their time limit.
PING_SECONDS = 2.0
SILENCE_SECONDS = 30.0


def pack(meta: dict[str, Any], file: CaptureFile) -> list[int]:
    """The fds the store process is handed for `file`: first a memfd holding `meta` (with where
    each tensor's bytes are, as `tensors`), the file's safetensors header and the bytes of the
    tensors outside any shared region; then each shared region (worker/hooks/shared_memory.py)
    a tensor views: those tensors are read from it there, never copied here."""
    entries: list[tuple[str, str, list[int], int]] = []
    layout: list[dict[str, Any]] = []
    packed: list[tuple[torch.Tensor, int, int]] = []
    regions: dict[int, int] = {}  # a region's memfd -> its place among the fds sent (1, 2, ...)
    at = 0  # bytes packed so far
    for name, tensor in file.tensors.items():
        n = tensor.numel() * tensor.element_size()
        entries.append((name, SAFETENSORS_CODE[str(tensor.dtype).removeprefix("torch.")], list(tensor.shape), n))
        found = shared_memory.region_of(tensor) if n and tensor.dim() and tensor.stride(-1) == 1 else None
        if found is None:
            layout.append({"packed": at, "bytes": n})
            packed.append((tensor, at, n))
            at += n
            continue
        size = tensor.element_size()
        layout.append(
            {
                "region": regions.setdefault(found[0], len(regions) + 1),
                "offset": tensor.data_ptr() - tensor.untyped_storage().data_ptr(),
                "shape": [*tensor.shape[:-1], tensor.shape[-1] * size],  # in bytes
                "strides": [stride * size for stride in tensor.stride()[:-1]] + [1],
            }
        )
    header = header_bytes(entries, file.metadata)
    text = json.dumps({**meta, "header": len(header), "names": list(file.tensors), "tensors": layout}).encode()
    begin = file_start(len(text))
    fd = os.memfd_create("actq-capture", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, begin + len(header) + at)
        with mmap.mmap(fd, begin + len(header) + at) as region:
            region[:8] = struct.pack("<Q", len(text))
            region[8 : 8 + len(text)] = text
            region[begin : begin + len(header)] = header
            if packed:
                data = torch.frombuffer(region, dtype=torch.uint8)
                start = begin + len(header)
                for tensor, offset, n in packed:
                    if n:
                        _copy_bytes(tensor, data[start + offset : start + offset + n])
                del data
    except BaseException:
        os.close(fd)
        raise
    return [fd, *regions]


def _copy_bytes(tensor: torch.Tensor, target: torch.Tensor) -> None:
    """`tensor`'s bytes in C order into the uint8 `target`, in one copy."""
    if tensor.dim() == 0 or tensor.stride(-1) != 1:
        tensor = tensor.contiguous().reshape(-1)
    rows = tensor.detach().cpu().view(torch.uint8)
    target.view(rows.shape).copy_(rows)


def failure_named(error_type: str, message: str) -> JobFailure:
    """The JobFailure whose `error_type` is `error_type` (a JobFailure of that type when no class has it)."""
    classes = [JobFailure]
    while classes:
        cls = classes.pop()
        if cls.error_type == error_type:
            return cls(message)
        classes.extend(cls.__subclasses__())
    failure = JobFailure(message)
    failure.error_type = error_type
    return failure


class _Waiter:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.answer: dict[str, Any] = {}


class StoreProcess:
    """One store process per engine process (per its settings), shared by the threads that finish
    capture jobs. The process is handed `settings` first (the engine's, however it got them)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen | None = None
        self._waiting: dict[int, tuple[subprocess.Popen, _Waiter]] = {}
        self._seq = itertools.count(1)
        self._pongs: set[int] = set()  # processes (pids) that answered a ping since the watchdog last looked
        self._silent: dict[int, float] = {}  # processes the watchdog killed: how long they said nothing

    def start(self) -> None:
        """Start the process now, if it is not running (else the first job starts it)."""
        with self._lock:
            self._running_socket()
        shared_memory.enable()

    def _running_socket(self) -> socket.socket:
        """The running process's socket, the process started first if none runs (the lock held)."""
        if self._sock is not None and self._proc is not None and self._proc.poll() is None:
            return self._sock
        return self._start()

    def store(self, job_id: str, meta: dict[str, Any], file: CaptureFile) -> int | None:
        """Store `file` and record job `job_id`'s success as `meta` says (the store process's
        `_store`); returns the bytes stored, or None when the attempt had lost the job (its files
        removed). Raises CancelAsked, redis.RedisError or the job's JobFailure as recording it in
        this process would have."""
        fds = pack({**meta, "job_id": job_id}, file)
        waiter = _Waiter()
        try:
            with self._lock:
                sock = self._running_socket()
                seq = next(self._seq)
                self._waiting[seq] = (self._proc, waiter)  # type: ignore[assignment]  # started above
                try:
                    socket.send_fds(sock, [str(seq).encode()], fds)
                except OSError as exc:  # it ended as this was sent: its reader answers every waiter
                    log.warning("job %s: the store process did not take it: %s", job_id, exc)
        finally:
            os.close(fds[0])  # the regions' memfds are their arenas' (closed when those are freed)
        waiter.done.wait()
        answer = waiter.answer
        outcome = answer.get("outcome")
        if outcome == "succeeded":
            return int(answer["bytes"])
        if outcome == "stale":
            return None
        if outcome == "cancel":
            raise CancelAsked(job_id)
        if outcome == "redis":
            raise redis.ConnectionError(answer.get("message", "Redis is unreachable"))
        raise failure_named(str(answer.get("error_type", "internal_error")), str(answer.get("message", answer)))

    def _start(self) -> socket.socket:
        """Start the process (the lock held): its socket, read by a thread of its own."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "worker.results.store_process"],
                pass_fds=[theirs.fileno()],
                env={**os.environ, SOCKET_FD_ENV: str(theirs.fileno())},
                stdin=subprocess.DEVNULL,
            )
        finally:
            theirs.close()
        try:
            ours.send(self.settings.model_dump_json().encode())
        except OSError:  # it died at once: its reader answers whoever waits, and the next job starts another
            log.exception("the store process %d did not take its settings", proc.pid)
        self._sock, self._proc = ours, proc
        threading.Thread(target=self._read, args=(ours, proc), name="actq-store-replies", daemon=True).start()
        threading.Thread(target=self._watch, args=(ours, proc), name="actq-store-watchdog", daemon=True).start()
        log.info("store process %d started", proc.pid)
        return ours

    def _read(self, sock: socket.socket, proc: subprocess.Popen) -> None:
        """Answer each waiter as the process answers; once it ended, every waiter it left."""
        while True:
            try:
                data = sock.recv(REPLY_BYTES)
            except OSError:
                data = b""
            if not data:
                break
            answer = json.loads(data)
            if answer.get("pong"):
                with self._lock:
                    self._pongs.add(proc.pid)
                continue
            with self._lock:
                held = self._waiting.pop(int(answer["seq"]), None)
            if held is not None:
                held[1].answer = answer
                held[1].done.set()
        code = proc.wait()
        with self._lock:
            left = [waiter for seq, (owner, waiter) in list(self._waiting.items()) if owner is proc]
            self._waiting = {seq: held for seq, held in self._waiting.items() if held[0] is not proc}
            if self._proc is proc:
                self._proc, self._sock = None, None
            silent = self._silent.pop(proc.pid, None)
            self._pongs.discard(proc.pid)
        sock.close()
        ended = f"ended ({exit_status(code)})"
        if silent is not None:
            ended = f"answered nothing for {silent:g} s and was ended ({exit_status(code)})"
        why = f"the process storing its activations {ended} before it was stored"
        if left:
            log.error("store process %d ended (%s) with %d jobs unanswered", proc.pid, exit_status(code), len(left))
        for waiter in left:
            waiter.answer = {"outcome": "failed", "error_type": InternalError.error_type, "message": why}
            waiter.done.set()

    def _watch(self, sock: socket.socket, proc: subprocess.Popen) -> None:
        """Ping the process while it holds jobs; kill it once it answered nothing for SILENCE_SECONDS
        (its reader then fails the jobs it held, saying so)."""
        asked: float | None = None  # when the oldest ping still unanswered was sent
        while proc.poll() is None:
            time.sleep(PING_SECONDS)
            with self._lock:
                holding = any(owner is proc for owner, _ in self._waiting.values())
                answered = proc.pid in self._pongs
                self._pongs.discard(proc.pid)
            if answered or not holding:
                asked = None
            if not holding:
                continue
            if asked is None:
                asked = time.monotonic()
            elif time.monotonic() - asked >= SILENCE_SECONDS:
                quiet = SILENCE_SECONDS
                log.error("store process %d answered nothing for %g s while it held jobs: ending it", proc.pid, quiet)
                with self._lock:
                    self._silent[proc.pid] = quiet
                proc.kill()
                return
            with contextlib.suppress(OSError):  # a full socket (a stopped process) or one just closed
                sock.send(PING, socket.MSG_DONTWAIT)

    def close(self) -> None:
        """End the process (it answers the jobs it holds first); a later job starts another."""
        with self._lock:
            sock, proc, self._sock, self._proc = self._sock, self._proc, None, None
        if sock is not None:
            sock.shutdown(socket.SHUT_WR)  # its recv sees the end; the reader closes the socket
        if proc is not None:
            proc.wait()


_processes: dict[str, StoreProcess] = {}
_processes_lock = threading.Lock()


def process_for(settings: Settings) -> StoreProcess:
    """The store process of these settings (one per engine process; tests run several)."""
    key = settings.model_dump_json()
    with _processes_lock:
        if key not in _processes:
            _processes[key] = StoreProcess(settings)
        return _processes[key]


def close_all() -> None:
    """End every store process this process started."""
    with _processes_lock:
        processes = list(_processes.values())
        _processes.clear()
    for process in processes:
        process.close()
