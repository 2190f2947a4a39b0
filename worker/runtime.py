"""What a worker's engine process holds for its lifetime: the settings, the one model (in the
served model), the engine core that batches its jobs, the stores, a heartbeat thread that
keeps the model listed as live, and a thread answering the API's tokenizer calls."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import redis

from shared.jobs import JobStore
from shared.registry import ModelRegistry
from shared.settings import Settings
from shared.stats import record_steps
from shared.storage import ArtifactStore, open_store
from worker.progress import ProgressWatch

if TYPE_CHECKING:
    from worker.engine_core import EngineCore
    from worker.served_model import ServedModel

log = logging.getLogger(__name__)
WATCH_INTERVAL = 0.05  # seconds between rounds of progress writes and cancel-flag reads


@dataclass
class Runtime:
    settings: Settings
    served: ServedModel
    store: ArtifactStore
    jobs: JobStore
    registry: ModelRegistry
    worker_id: str
    stop: threading.Event
    core: EngineCore
    progress: ProgressWatch


_runtime: Runtime | None = None


def start(settings: Settings) -> Runtime:
    """Load the model once, publish it, and start heartbeats. Runs in the engine process."""
    global _runtime
    from worker.engine_core import EngineCore
    from worker.models import load
    from worker.served_model import ServedModel
    from worker.tokenizer_service import TokenizerService

    # Timeouts: a Redis that stops answering is an outage (JobStore waits it out), never a hang.
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=10, socket_connect_timeout=10)
    loaded = load(settings)
    served = ServedModel(loaded, allow_special_tokens=settings.allow_special_tokens, cuda_graphs=settings.cuda_graphs)
    log.info("%s decodes %s", served.info.name, served.describe_decoder())
    if settings.allow_special_tokens:
        log.warning("ACTQ_ALLOW_SPECIAL_TOKENS is on: special-token strings in messages become special tokens")
    max_batch = served.max_batch(settings.max_batch)
    if max_batch > 1:  # the engine core feeds long texts in chunks: what the API's estimate counts
        served.info.prefill_chunk_tokens = settings.prefill_chunk_tokens
    registry = ModelRegistry(client, settings.heartbeat_ttl)
    registry.publish(served.info)
    worker_id = f"{socket.gethostname()}:{os.getpid()}"
    stop = threading.Event()
    jobs = JobStore(client, settings.job_retention_seconds, settings.redis_outage_seconds)
    _runtime = Runtime(
        settings=settings,
        served=served,
        store=open_store(settings, wait_for_outages=True),
        jobs=jobs,
        registry=registry,
        worker_id=worker_id,
        stop=stop,
        core=EngineCore(
            served,
            max_batch=max_batch,
            wait_s=settings.batch_wait_ms / 1000,
            budget_bytes=settings.batch_memory_budget_bytes,
            chunk_tokens=settings.prefill_chunk_tokens,
            on_death=lambda exc: _engine_died(registry, served.info.name, worker_id, exc),
        ).start(),
        progress=ProgressWatch(jobs, WATCH_INTERVAL).start(),
    )
    registry.heartbeat(served.info, worker_id)
    threading.Thread(target=_beat, args=(_runtime,), name="actq-heartbeat", daemon=True).start()
    TokenizerService(served, client, stop).start()  # POST /tokenize etc.; ends with `stop`
    log.info("serving %s (%s on %s, %s) as %s", served.info.name, loaded.source, loaded.device, loaded.dtype, worker_id)
    return _runtime


def _engine_died(registry: ModelRegistry, model: str, worker_id: str, exc: BaseException) -> None:
    """The engine thread died: stop listing this engine as live, then end the process (the worker
    restarts it and its jobs go back to the queue)."""
    from worker.engine_core import exit_process

    try:
        registry.remove_worker(model, worker_id)
    except redis.RedisError:
        pass  # its heartbeat expires after ACTQ_HEARTBEAT_TTL
    exit_process(exc)


def _beat(runtime: Runtime) -> None:
    last = time.monotonic()
    while not runtime.stop.wait(runtime.settings.heartbeat_interval):
        if not runtime.core.alive:  # a dead engine thread never looks live (the process is ending)
            return
        sizes, tokens = runtime.core.stats.take()
        now = time.monotonic()
        try:
            runtime.registry.heartbeat(runtime.served.info, runtime.worker_id)
            record_steps(
                runtime.registry.redis,
                runtime.served.info.name,
                runtime.worker_id,
                sizes,
                runtime.core.max_batch,
                tokens / max(now - last, 1e-9),
            )
        except redis.RedisError as exc:  # keep beating once Redis is back (these steps' figures are lost)
            log.warning("heartbeat failed: %s", exc)
        last = now


def stop() -> None:
    if _runtime is None:
        return
    _runtime.stop.set()
    _runtime.core.stop()
    _runtime.progress.stop()
    try:
        _runtime.registry.remove_worker(_runtime.served.info.name, _runtime.worker_id)
    except redis.RedisError:
        pass


def get() -> Runtime:
    if _runtime is None:
        raise RuntimeError("the worker runtime is not started (worker_process_init did not run)")
    return _runtime
