"""actq's own package beside the API and the worker.

The contract both sides import (importing it never imports torch, `api` or `worker`):
    settings     the one settings object (ACTQ_* variables)
    keys         every Redis key and Celery name
    errors       the one error hierarchy
    states       job states; schemas: request, record and response shapes (pydantic)
    dtypes       capture and safetensors dtype tables
    jobs         JobStore: every operation on a job's keys; idempotency: Idempotency-Keys
    registry     served models and live workers; stats: job figures for /metrics
    capture_spec the capture-path grammar, resolution, positions and the size estimate
    broker       the Celery app's configuration and a job's broker message
    storage/     artifact stores (local directory, S3) and the safetensors format

For users, beside the contract (neither side imports them):
    client       the Python SDK (httpx only)
    cli/         the `actq` command and what only it uses
"""
