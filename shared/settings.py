"""The one settings object. Every `ACTQ_*` environment variable is read here and nowhere else."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlparse

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from shared.schemas import CaptureSpec

DEFAULT_DATA_DIR, DEFAULT_CACHE_DIR = Path.home() / ".local" / "share" / "actq", Path.home() / ".cache" / "actq"


class Settings(BaseSettings):
    """actq settings, read from `ACTQ_*` environment variables (and a `.env` file)."""

    model_config = SettingsConfigDict(env_prefix="ACTQ_", env_file=".env", extra="ignore")

    api_url: str = Field(
        "http://127.0.0.1:8000", description="Where `actq run-file`, `actq gsm8k` and `actq probe` reach the API."
    )
    api_key: str | None = Field(
        None, description="The key `actq run-file`, `gsm8k`, `probe` and `export` send (`Authorization: Bearer`)."
    )
    api_keys: str | None = Field(
        None,
        description="Comma-separated API keys; when set, every endpoint but /health, /livez and /readyz needs "
        "`Authorization: Bearer <key>`.",
    )
    operator_keys: str | None = Field(
        None,
        description="Comma-separated operator keys: valid API keys that may also read /metrics and counts across keys "
        "(queue positions, queued jobs per model in /health).",
    )
    nnsight_keys: str | None = Field(
        None,
        description="Comma-separated API keys (each one of ACTQ_API_KEYS or ACTQ_OPERATOR_KEYS) that may send their "
        "own nnsight code (`remote=True`, POST /request). Such code runs as the worker, with its rights: name only "
        "keys whose holders you would also give a shell on the worker. Empty: nnsight jobs are refused.",
    )
    nnsight_max_request_bytes: int = Field(
        64 << 20,
        ge=1024,
        description="Largest nnsight payload POST /request accepts, as sent and decompressed (413 above it).",
    )
    nnsight_max_result_bytes: int = Field(
        1 << 30, ge=1024, description="Largest result an nnsight job may save (its job fails above it)."
    )
    nnsight_time_limit: float | None = Field(
        None,
        gt=0,
        description=(
            "Seconds an nnsight job may run before it is interrupted and failed as a timeout; code that will not "
            "stop is ended with its engine half as long again later (at least 10 s), at most ACTQ_JOB_TIME_LIMIT. "
            "Unset: 300 with ACTQ_NNSIGHT_ENGINE=own, 60 with `shared` (there it pauses everyone's batch)."
        ),
    )
    nnsight_engine: Literal["own", "shared"] = Field(
        "own",
        description=(
            "Where a worker runs nnsight jobs. `own`: in an engine process of their own, with its own copy of the "
            "model (started at the first nnsight job, stopped when idle), so nothing trusted code does reaches "
            "anyone else's jobs. `shared`: on the capture engine's model, between decoding steps (one copy of the "
            "weights; for a single-user box or a GPU without room for two copies)."
        ),
    )
    nnsight_device: str | None = Field(
        None,
        description=(
            "The device of the nnsight engine's copy of the model with ACTQ_NNSIGHT_ENGINE=own (`cpu`, `cuda`, "
            "`cuda:1`...); unset: the capture engine's (ACTQ_DEVICE)."
        ),
    )
    nnsight_memory_fraction: float | None = Field(
        None,
        gt=0,
        le=1,
        description=(
            "With ACTQ_NNSIGHT_ENGINE=own on a GPU: the share of the device's memory the nnsight engine may "
            "allocate (torch's per-process memory fraction); past it its job fails `out_of_memory` instead of "
            "taking memory the capture engine needs. Unset: no cap."
        ),
    )
    nnsight_max_host_bytes: int | None = Field(
        None,
        ge=1 << 28,
        description=(
            "With ACTQ_NNSIGHT_ENGINE=own: the most private host memory the nnsight engine process may map "
            "(RLIMIT_DATA); past it an allocation fails and so does its job (`out_of_memory`). Unset: no cap (the "
            "kernel's OOM killer still picks that process first)."
        ),
    )
    nnsight_idle_seconds: float = Field(
        600.0,
        gt=0,
        description=(
            "With ACTQ_NNSIGHT_ENGINE=own: seconds without an nnsight job after which the nnsight engine stops and "
            "its copy of the model is freed (the next nnsight job starts it again)."
        ),
    )
    nnsight_link_seconds: int = Field(
        3600, gt=0, description="How long an nnsight result's download link (sent without a key) stays valid."
    )
    default_capture_by_model: Annotated[dict[str, CaptureSpec], NoDecode] = Field(
        {},
        description=(
            "The capture of an OpenAI-route request that sends none, per served model, for clients that cannot send "
            'one (lm-eval, LangChain): JSON, `{"<model>": <capture spec>}`, each as `capture` in POST /jobs.'
        ),
    )
    default_capture_by_key: Annotated[dict[str, CaptureSpec], NoDecode] = Field(
        {},
        description=(
            'The same per API key: JSON, `{"<key>": <capture spec>}`, each key one of ACTQ_API_KEYS or '
            "ACTQ_OPERATOR_KEYS; it wins over the model's."
        ),
    )
    public_docs: bool = Field(
        False, description="With API keys on: serve /docs, /redoc and /openapi.json without a key."
    )
    flower_basic_auth: str | None = Field(
        None,
        description=(
            "`user:password` for `actq flower` (Flower's dashboard and API); required unless --unauthenticated."
        ),
    )
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="Broker, job store and model registry. `actq run` starts an embedded Redis when unset.",
    )
    model: str = Field(
        "smollm2-135m",
        description="What the worker serves: `smollm2-135m` (built in), a Hugging Face id or a local path.",
    )
    model_name: str | None = Field(
        None, description="Name clients use for the worker's model; defaults to ACTQ_MODEL (a path's folder name)."
    )
    model_cache_dir: Path = Field(
        DEFAULT_CACHE_DIR / "models", description="Where converted models (the built-in one) are kept."
    )
    storage_url: str = Field(
        DEFAULT_DATA_DIR.as_uri(), description="Where activations go: `file:///abs/dir` or `s3://bucket/prefix`."
    )
    s3_endpoint_url: str | None = Field(
        None, description="S3-compatible endpoint (MinIO, SeaweedFS); unset for AWS. Credentials: the AWS chain."
    )
    s3_public_endpoint_url: str | None = Field(
        None,
        description=(
            "The S3 endpoint as clients reach it, when they cannot reach ACTQ_S3_ENDPOINT_URL (MinIO in docker compose "
            "is http://minio:9000 inside, http://localhost:9000 or the host's name outside): download links "
            "(presigned URLs) are signed for it, while the API and workers keep using ACTQ_S3_ENDPOINT_URL. Unset: "
            "links point at ACTQ_S3_ENDPOINT_URL."
        ),
    )
    s3_region: str | None = Field(None, description="S3 region; unset: the AWS config chain (or us-east-1).")
    s3_multipart_chunk_bytes: int = Field(
        8 << 20, ge=5 << 20, description="Uploads larger than this go up in parts of this size."
    )
    presign_expiry_seconds: int = Field(
        3600, ge=1, le=7 * 24 * 3600, description="Lifetime of presigned S3 download URLs."
    )
    device: str = Field("auto", description="`auto` (cuda when available, else cpu), `cpu`, `cuda`, `cuda:1`...")
    device_map: str | None = Field(
        None,
        description=(
            "Load the model across this box's devices through accelerate: `auto`, `balanced`, "
            "`balanced_low_0`, `sequential`, or a JSON file mapping module names to devices "
            '(`{"model.layers.0": 0, "lm_head": "cpu", ...}`; `disk` offloads under ACTQ_MODEL_CACHE_DIR). '
            "Unset: the whole model on ACTQ_DEVICE."
        ),
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="Model weights dtype: `auto` is bfloat16 on cuda, float32 on cpu."
    )
    cuda_graphs: bool = Field(
        True,
        description=(
            "Replay the decoding step as one CUDA graph per batch-size bucket on a GPU (0: run it eagerly, for "
            "debugging). Steps of batches with captures or edits run eagerly today."
        ),
    )
    allow_special_tokens: bool = Field(
        False,
        description=(
            "Read special-token strings in message text (`<|im_start|>`...) as special tokens: only for trusted "
            "users (by default they are text, so no message can forge a turn of the chat template)."
        ),
    )
    chat_template: Path | None = Field(
        None,
        description="A Jinja chat template file for the worker's model, replacing the tokenizer's own (or giving a "
        "base model one, so that it takes `messages`).",
    )
    trust_remote_code: bool = Field(
        False,
        description=(
            "Let the worker run Python code shipped inside the model folder or hub repo (needed by some "
            "architectures): only for models you trust; the worker logs a warning when on."
        ),
    )
    torch_threads: int | None = Field(
        None,
        ge=1,
        description=(
            "torch CPU threads of each engine process. Default: 1 on 2 cores or fewer, else the cores less one, "
            "which leaves room for the API, Redis and the Celery process (figures: docs/benchmarks.md)."
        ),
    )
    torch_interop_threads: int = Field(
        1, ge=1, description="torch inter-op threads of each engine process: it runs one model step at a time."
    )
    max_request_bytes: int = Field(
        4 << 20,
        ge=1024,
        description="Largest request body the API reads (413 above it, before parsing); bounds per-request work.",
    )
    vector_max_bytes: int = Field(
        64 << 20,
        ge=1024,
        description="Largest vector set file POST /vectors accepts (413 above it, refused before it is all read).",
    )
    max_schema_bytes: int = Field(
        256 << 10,
        ge=1024,
        description="Tools (names, descriptions, parameters) and response_format schemas one request may carry, as "
        "JSON, all together (a schema repeated across a request's jobs counts once); 413 above it, before any "
        "schema is checked.",
    )
    content_checks_per_key: int = Field(
        1,
        ge=1,
        description="Requests of one API key (all callers together when keys are off) whose large bodies, JSON "
        "Schemas and grammars are checked at once, on threads off the event loop; its next ones wait their turn.",
    )
    content_check_threads: int = Field(
        2,
        ge=1,
        description="Threads of one API process for those checks, all keys together (parsing holds the GIL: more "
        "threads let more keys wait less, not the work go faster).",
    )
    max_vector_sets_per_key: int = Field(
        1000,
        ge=0,
        description="Vector sets one API key (all callers together when keys are off) may keep; 429 beyond, "
        "nothing stored (0: no limit).",
    )
    max_tokens_limit: int = Field(1024, ge=1, description="Largest `max_tokens` a request may ask for.")
    default_max_tokens: int = Field(
        256, ge=1, description="`max_tokens` when a request gives none (capped at ACTQ_MAX_TOKENS_LIMIT)."
    )
    capture_budget_bytes: int = Field(
        1 << 30, ge=1, description="Largest estimated capture (bytes stored for one job) a job may request."
    )
    job_memory_budget_bytes: int = Field(
        4 << 30,
        ge=1,
        description="Largest estimated worker memory (bytes) a job may need: its capture, KV cache and activations.",
    )
    max_long_polls: int = Field(
        2000,
        ge=1,
        description="Long polls (GET /jobs/{id}?wait=, /v1/chat/completions) one API process holds; 429 beyond.",
    )
    max_long_polls_per_key: int = Field(
        500,
        ge=0,
        description="Long polls and nnsight WebSocket sessions (/subscribe) one API key holds in one API process; "
        "429 beyond (0: only ACTQ_MAX_LONG_POLLS bounds them). Callers without keys are bounded by "
        "ACTQ_MAX_LONG_POLLS alone.",
    )
    fair_share_jobs: int = Field(
        8,
        ge=1,
        description="Jobs of one API key that queue in a model's first lane; the key's further jobs (while it holds "
        "this many queued or running) queue in later lanes that workers take from only when the earlier ones are "
        "empty, so one key's burst does not make other keys' jobs wait behind it.",
    )
    max_queued_jobs_per_key: int = Field(
        10_000,
        ge=0,
        description="Jobs one API key (all callers together when keys are off) may have queued or running; "
        "429 beyond, nothing queued (0: no limit).",
    )
    max_queued_bytes_per_key: int = Field(
        256 << 30,
        ge=0,
        description="Estimated capture bytes of the jobs one API key may have queued or running; 429 beyond, "
        "nothing queued (0: no limit).",
    )
    redis_max_connections: int = Field(
        64, ge=2, description="Redis connections per API process for its async work (requests wait for a free one)."
    )
    logprobs_inline_tokens: int = Field(
        4096,
        ge=0,
        le=1_000_000,
        description="Most log-probability entries a job's result holds inline; a longer output's are tensors in "
        "its activations file (logprobs, top_logprobs, top_logprob_ids).",
    )
    result_inline_bytes: int = Field(
        16 << 10,
        ge=1024,
        description="A job result whose JSON is larger (log-probabilities, a long text) is stored apart from the "
        "job's record, so GET /jobs/{id} stays small; GET /jobs/{id}/result reads the whole result.",
    )
    max_batch: int = Field(
        16,
        ge=1,
        le=256,
        description="Jobs a worker runs together in one batch (1: one at a time, bit-exact with a solo run).",
    )
    ready_jobs: int = Field(
        0,
        ge=0,
        le=256,
        description="Jobs a worker claims beyond ACTQ_MAX_BATCH and prepares, so that a place a job leaves is taken at "
        "the next step (bulk runs; docs/operations.md#batching). They show `running` until they join; an engine "
        "lost meanwhile costs them an attempt.",
    )
    batch_wait_ms: float = Field(
        20.0, ge=0, description="How long an idle worker waits for more jobs to start a batch with the first."
    )
    prefill_chunk_tokens: int = Field(
        512,
        ge=16,
        le=1 << 20,
        description="The most prompt positions one forward pass feeds while other jobs decode: a longer prompt or "
        "trace runs in chunks between decoding steps, so it never freezes the running batch.",
    )
    batch_memory_budget_bytes: int = Field(
        4 << 30,
        ge=1,
        description="Estimated KV cache and capture bytes of a batch; a job joins only while the batch stays under it.",
    )
    kv_cache_max_bytes: int = Field(
        4 << 30,
        ge=0,
        description="Most bytes of a worker's KV cache for its running batch (the slots' keys and values, every "
        "slot as long as the longest running job's prompt and max_tokens); a job that would take it past this waits "
        "for running jobs to end, and one that would alone fails as out_of_memory naming this setting (0: no cap).",
    )
    kv_cache_shrink_seconds: float = Field(
        30.0,
        ge=0,
        description="Seconds a worker's KV cache stays larger than its running jobs need (after a long job ended, "
        "or while idle) before it shrinks and its memory goes back to the system.",
    )
    job_soft_time_limit: float = Field(1800, gt=0, description="Seconds before a running job is failed as a timeout.")
    job_time_limit: float = Field(
        1860, gt=0, description="Seconds before a job that has not ended is failed and its stuck engine restarted."
    )
    visibility_timeout: int = Field(
        7200, gt=0, description="Redis broker redelivery timeout for unacknowledged jobs; must exceed the hard limit."
    )
    redis_outage_seconds: float = Field(
        120.0,
        ge=0,
        description="How long a worker retries a job's state change while Redis is unreachable (0: not at all).",
    )
    storage_outage_seconds: float = Field(
        60.0,
        ge=0,
        description="How long a worker retries an upload while the S3 endpoint is unreachable (0: not at all).",
    )
    storage_backlog_jobs: int = Field(
        64,
        ge=1,
        description="Jobs whose files a worker may have waiting to be stored (a slow or unreachable store); past "
        "it, its next capture jobs wait before joining a batch. Jobs that store nothing never wait for the store.",
    )
    storage_backlog_bytes: int = Field(
        1 << 30,
        ge=1,
        description="Bytes of captured activations a worker may hold waiting to be stored; past it, its next "
        "capture jobs wait before joining a batch (a job larger than this alone joins once nothing else waits).",
    )
    store_process: bool = Field(False, description="Capture jobs stored and recorded by a process of their own.")
    storage_min_free_bytes: int = Field(
        1 << 30,
        ge=0,
        description="A local store with less free space than this shows as `low` in GET /health (status "
        "`degraded`, with the bytes left); 0: never.",
    )
    lost_message_check_seconds: float = Field(
        10.0,
        gt=0,
        description="Seconds between a worker's checks for jobs whose broker message no live worker will run "
        "(lost in a Redis outage, or held by a worker whose heartbeat expired); one found at two checks this "
        "far apart is sent again.",
    )
    max_attempts: int = Field(3, ge=1, description="Deliveries of one job before it is failed as `worker_lost`.")
    job_retention_seconds: int = Field(7 * 24 * 3600, gt=0, description="How long job records are kept.")
    heartbeat_interval: float = Field(1.0, gt=0, description="Seconds between worker heartbeats.")
    heartbeat_ttl: float = Field(
        4.0,
        gt=0,
        description="A worker with no heartbeat for this long is not live (a worker that stops leaves at once; "
        "one that dies, after this long).",
    )
    worker_start_timeout: float = Field(
        300.0, gt=0, description="Seconds the worker's engine process may take to load the model."
    )

    @field_validator("default_capture_by_model", "default_capture_by_key", mode="before")
    @classmethod
    def _json_object(cls, value: object) -> object:
        """The environment gives JSON text; a broken one is named with what to give instead."""
        if not isinstance(value, str):
            return value
        try:
            return json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as exc:
            raise ValueError(
                f'is not JSON ({exc}); give an object of capture specs, e.g. {{"<name>": {{"preset": "residual"}}}}'
            ) from None

    @field_validator("s3_public_endpoint_url", mode="before")
    @classmethod
    def _endpoint(cls, value: object) -> object:
        """A URL with a scheme and a host (links are signed for the host; `localhost:9000` has none); empty: unset."""
        if value == "":
            return None
        if isinstance(value, str) and (urlparse(value).scheme not in ("http", "https") or not urlparse(value).netloc):
            raise ValueError(f"{value!r} is not an endpoint: give http(s)://host[:port], e.g. http://localhost:9000")
        return value

    @model_validator(mode="after")
    def _keyed_settings_name_keys(self) -> Settings:
        """Settings that name API keys name valid ones (a typo would silently apply to no one)."""
        for setting, named, why in (
            (
                "ACTQ_DEFAULT_CAPTURE_BY_KEY",
                list(self.default_capture_by_key),
                "a default capture applies to the callers of a valid key",
            ),
            ("ACTQ_NNSIGHT_KEYS", self.nnsight_key_list, "trust is given to a valid key"),
        ):
            unknown = [key for key in named if key not in self.api_key_list]
            if unknown:
                shown = ", ".join(f"{key[:4]}..." for key in unknown)
                raise ValueError(
                    f"{setting} names {len(unknown)} key(s) ({shown}) that are not in ACTQ_API_KEYS or "
                    f"ACTQ_OPERATOR_KEYS: {why}"
                )
        return self

    @model_validator(mode="after")
    def _limits_are_consistent(self) -> Settings:
        if self.job_soft_time_limit >= self.job_time_limit:
            raise ValueError("ACTQ_JOB_SOFT_TIME_LIMIT must be below ACTQ_JOB_TIME_LIMIT")
        if self.heartbeat_ttl <= self.heartbeat_interval:
            raise ValueError("ACTQ_HEARTBEAT_TTL must exceed ACTQ_HEARTBEAT_INTERVAL")
        if self.device_map is not None and self.device != "auto":
            raise ValueError("set ACTQ_DEVICE or ACTQ_DEVICE_MAP, not both (a device map places every module)")
        return self

    @property
    def api_key_list(self) -> list[str]:
        """Every key that authenticates (operator keys included); empty: the API is open."""
        return self.operator_key_list + [k.strip() for k in (self.api_keys or "").split(",") if k.strip()]

    @property
    def nnsight_limit(self) -> float:
        """ACTQ_NNSIGHT_TIME_LIMIT, or its default for where nnsight jobs run: shorter on the shared
        engine, where an nnsight job pauses every other job's batch."""
        if self.nnsight_time_limit is not None:
            return self.nnsight_time_limit
        return 300.0 if self.nnsight_engine == "own" else 60.0

    @property
    def nnsight_key_list(self) -> list[str]:
        return [k.strip() for k in (self.nnsight_keys or "").split(",") if k.strip()]

    @property
    def operator_key_list(self) -> list[str]:
        return [k.strip() for k in (self.operator_keys or "").split(",") if k.strip()]

    @property
    def max_tokens_default(self) -> int:
        return min(self.default_max_tokens, self.max_tokens_limit)

    @property
    def served_model_name(self) -> str:
        """The name requests use for this worker's model."""
        if self.model_name:
            return self.model_name
        path = Path(self.model).expanduser()
        return path.name if path.is_dir() else self.model


@lru_cache
def get_settings() -> Settings:
    """The process's settings, read once."""
    return Settings()
