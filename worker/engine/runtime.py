"""What a worker's engine process holds for its lifetime: the settings, the one model (in the
served model), the engine core that batches its jobs, the stores, a heartbeat thread that
keeps the model listed as live, and a thread answering the API's tokenizer calls."""

from __future__ import annotations

import gc
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import redis

from shared.jobs import JobStore
from shared.outages import REDIS, outage
from shared.registry import ModelRegistry
from shared.settings import Settings
from shared.stats import record_holds, record_steps
from shared.storage import ArtifactStore, open_store
from worker.engine.progress import ProgressWatch

if TYPE_CHECKING:
    from worker.batch.served import ServedModel
    from worker.engine.core import EngineCore

log = logging.getLogger(__name__)
SCRATCH_GRACE = 3600.0  # seconds past the store outage window before a scratch file is called orphaned
EX_REPLACED = 75  # the engine process ended itself to be replaced (EX_TEMPFAIL)
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
    role: str = "capture"  # or "nnsight" (worker/engine/process.py)


_runtime: Runtime | None = None


def start(
    settings: Settings,
    role: str = "capture",
    replace: Callable[[str, list[str]], None] | None = None,
    worker_id: str | None = None,
) -> Runtime:
    """Load the model once, publish it, and start heartbeats. Runs in the engine process.
    `worker_id`: its name in Redis (claims, heartbeats): the worker's Celery node name, else
    `host:pid` (`:nnsight` added for the nnsight engine). `role`:
    `capture` (every job but nnsight ones; publishes the model and answers the API's tokenizer
    calls) or `nnsight` (trusted code on a copy of the model of its own: worker/engine/process.py).
    `replace(job_id, reasons)`: told when trusted code left this process in a state it cannot prove
    whole (the process is replaced once that job is answered)."""
    global _runtime
    from worker.batch.served import ServedModel
    from worker.engine.core import EngineCore
    from worker.engine.tokenizer_service import TokenizerService
    from worker.model.loading import load
    from worker.model.slot_sizing import CacheLimits

    capture = role == "capture"
    if not capture:
        settings = _nnsight_engine_settings(settings)
    # Timeouts: a Redis that stops answering is an outage (JobStore waits it out), never a hang.
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=10, socket_connect_timeout=10)
    settings = _set_threads(settings)
    loaded = load(settings)
    served = ServedModel(
        loaded,
        allow_special_tokens=settings.allow_special_tokens,
        cuda_graphs=settings.cuda_graphs,
        cache_limits=CacheLimits(settings.kv_cache_max_bytes, settings.kv_cache_shrink_seconds),
    )
    log.info("%s decodes %s", served.info.name, served.describe_decoder())
    if settings.allow_special_tokens:
        log.warning("ACTQ_ALLOW_SPECIAL_TOKENS is on: special-token strings in messages become special tokens")
    max_batch = served.max_batch(settings.max_batch) if capture else 1
    if max_batch > 1 and not served.state_slots:  # the engine core feeds long texts in chunks: what the API's
        served.info.prefill_chunk_tokens = settings.prefill_chunk_tokens  # estimate counts (state slots: whole)
    registry = ModelRegistry(client, settings.heartbeat_ttl)
    if capture:
        registry.publish(served.info)
    worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}" + ("" if capture else ":nnsight")
    stop = threading.Event()
    jobs = JobStore(client, settings.job_retention_seconds, settings.redis_outage_seconds)
    grace = settings.redis_outage_seconds + settings.storage_outage_seconds + 60

    def replaced(job_id: str, reasons: list[str]) -> None:
        if replace is not None:
            replace(job_id, reasons)
        # the process ends once the job is answered; if its answer cannot be written, it ends anyway
        timer = threading.Timer(grace, _exit_replaced)
        timer.daemon = True
        timer.start()

    store = open_store(settings, wait_for_outages=True)
    # a file still in scratch this long after its write ended is no write's: its writer was killed
    swept = store.sweep_scratch(settings.storage_outage_seconds + SCRATCH_GRACE)
    if swept:
        log.info("removed %d scratch files that killed writers left (never published)", swept)
    if capture and settings.store_process:
        from worker.results import store_client

        store_client.process_for(settings).start()
    _runtime = Runtime(
        settings=settings,
        served=served,
        store=store,
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
            on_death=lambda exc: _engine_died(registry, served.info.name, worker_id, capture, exc),
            on_replace=replaced,
        ).start(),
        progress=ProgressWatch(jobs, WATCH_INTERVAL, served.gate).start(),
        role=role,
    )
    _beat_once(_runtime)
    threading.Thread(target=_beat, args=(_runtime,), name="actq-heartbeat", daemon=True).start()
    if capture:
        TokenizerService(served, client, stop).start()  # POST /tokenize etc.; ends with `stop`
    log.info(
        "serving %s (%s on %s, %s, %d torch threads) as %s (%s engine)",
        served.info.name,
        loaded.source,
        loaded.device,
        loaded.dtype,
        settings.torch_threads,
        worker_id,
        role,
    )
    freeze_heap()
    return _runtime


def freeze_heap() -> None:
    """The objects alive once the model is served (its modules and parameters, the libraries': about
    450,000 with the benches' tiny model) out of the cyclic collector's reach (`gc.freeze`), as
    vLLM's engine core does once started. A full collection walks every tracked object while holding the GIL,
    and every thread of this process waits: capture jobs (their points, buffers and manifests, about
    1,200 tracked objects each) brought one or two full collections per 256 jobs, 0.35-0.45 s each
    on 2 cores, during which the engine thread could not take a step. Frozen objects are never
    collected: what becomes cyclic garbage among them later (nothing the engine frees) stays."""
    gc.collect()
    gc.freeze()


# The engine thread gives the GIL up inside every torch op and takes it back after; a thread beside
# it running Python (claiming jobs, recording results, progress) keeps it until it waits on I/O or
# this interval runs out (Python's default: 5 ms). bench/bench_bulk.py side by side on 2 cores:
# 0.78x of `generate` at 0.5 ms against 0.74x at 5 ms (medians of 4), 0.70x against 0.66x (of 3).
SWITCH_INTERVAL_S = 0.0005


def _set_threads(settings: Settings) -> Settings:
    """torch's threads in this engine process, before any torch work: ACTQ_TORCH_THREADS (default:
    room left for the API, Redis and Celery: shared/settings.py) and ACTQ_TORCH_INTEROP_THREADS;
    and how soon a thread holding the GIL hands it back (`SWITCH_INTERVAL_S`).
    Returns the settings with the thread count resolved (what `load` applies and logs show)."""
    import torch

    threads = torch_threads_for(settings)
    torch.set_num_threads(threads)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        torch.set_num_interop_threads(settings.torch_interop_threads)
    except RuntimeError as exc:  # set once per process, before any inter-op work: a second start keeps the first
        log.debug("torch's inter-op threads stay %d: %s", torch.get_num_interop_threads(), exc)
    return settings.model_copy(update={"torch_threads": threads})


def _nnsight_engine_settings(settings: Settings) -> Settings:
    """The nnsight engine's settings: its device (ACTQ_NNSIGHT_DEVICE), and the bounds on what its
    trusted code may take from the machine: a share of the GPU's memory, a cap on private host
    memory, and first place for the kernel's OOM killer (so a runaway job ends this process, never
    the capture engine beside it)."""
    if settings.nnsight_device is not None:
        settings = settings.model_copy(update={"device": settings.nnsight_device, "device_map": None})
    try:
        with open("/proc/self/oom_score_adj", "w") as handle:
            handle.write("1000")
    except OSError as exc:  # not Linux, or not allowed: said, not fatal
        log.warning("could not make the nnsight engine the OOM killer's first choice: %s", exc)
    if settings.nnsight_max_host_bytes is not None:
        import resource

        cap = settings.nnsight_max_host_bytes
        resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    if settings.nnsight_memory_fraction is not None:
        import torch

        if torch.cuda.is_available():
            device = torch.device(settings.device if settings.device.startswith("cuda") else "cuda")
            torch.cuda.set_per_process_memory_fraction(settings.nnsight_memory_fraction, device)
    return settings


def _exit_replaced() -> None:
    log.error("this engine was to be replaced once its trusted job was answered; the answer did not come: exiting")
    os._exit(EX_REPLACED)


def _engine_died(registry: ModelRegistry, model: str, worker_id: str, capture: bool, exc: BaseException) -> None:
    """The engine thread died: stop listing this engine as live, then end the process (the worker
    restarts it and its jobs go back to the queue)."""
    from worker.engine.core import exit_process

    try:
        if capture:
            registry.remove_worker(model, worker_id)
    except BaseException:  # noqa: BLE001 - the way out must not fail: its heartbeat expires after ACTQ_HEARTBEAT_TTL
        pass
    exit_process(exc)


def _beat_once(runtime: Runtime, since: float | None = None) -> float:
    """One heartbeat: the engine is live, and what it did since `since` (its steps, its exclusive
    runs' holds) goes to Redis. Returns when."""
    now = time.monotonic()
    name = runtime.served.info.name
    try:
        if runtime.role == "capture":
            sizes, tokens = runtime.core.stats.take()
            runtime.registry.heartbeat(runtime.served.info, runtime.worker_id)
            if since is not None:
                record_steps(
                    runtime.registry.redis,
                    name,
                    runtime.worker_id,
                    sizes,
                    runtime.core.max_batch,
                    tokens / max(now - since, 1e-9),
                    runtime.core.stats.cache,
                )
        record_holds(runtime.registry.redis, name, runtime.settings.nnsight_engine, runtime.core.stats.take_holds())
    except redis.RedisError as exc:  # keep beating once Redis is back (these steps' figures are lost)
        outage(REDIS).failed(exc)
    else:
        outage(REDIS).ok()
    return now


def _beat(runtime: Runtime) -> None:
    last = time.monotonic()
    while not runtime.stop.wait(runtime.settings.heartbeat_interval) and not _unpublished.is_set():
        if not runtime.core.alive:  # a dead engine thread never looks live (the process is ending)
            return
        last = _beat_once(runtime, last)


_unpublished = threading.Event()  # the worker is stopping: no more heartbeats


def unpublish() -> None:
    """The worker is stopping: stop the heartbeat and leave the live workers now (jobs running go on)."""
    _unpublished.set()
    if _runtime is None or _runtime.role != "capture":
        return
    try:
        _runtime.registry.remove_worker(_runtime.served.info.name, _runtime.worker_id)
    except redis.RedisError:
        pass


def stop() -> None:
    if _runtime is None:
        return
    _runtime.stop.set()
    _runtime.core.stop()
    _runtime.progress.stop()
    try:
        if _runtime.role == "capture":
            _runtime.registry.remove_worker(_runtime.served.info.name, _runtime.worker_id)
    except redis.RedisError:
        pass


def get() -> Runtime:
    if _runtime is None:
        raise RuntimeError("the worker runtime is not started (worker_process_init did not run)")
    return _runtime


def torch_threads_for(settings: Settings, cores: int | None = None) -> int:
    """The torch threads of an engine process: ACTQ_TORCH_THREADS, else 1 on 2 cores or fewer and
    the cores less one above (`cores`: the cores this process may run on, when not given)."""
    if settings.torch_threads:
        return settings.torch_threads
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return 1 if cores <= 2 else cores - 1
