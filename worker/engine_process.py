"""The engine process: `python -m worker.engine_process`, started by the Celery worker (see
engine_client.py). It loads the one model, publishes it, and runs every job it is handed in the
scheduler's batches.

Protocol: one JSON object per line, nothing else is ever decoded:
  stdin (from the worker)      {"run": JOB_ID}
  fd REPLY_FD (to the worker)  {"ready": WORKER_ID}   once the model is loaded and published
                               {"started": JOB_ID, "attempt": [N, WORKER]}  the job joined a batch, as
                                                      the attempt its claim made (shared/attempts.py)
                               {"started": JOB_ID, "attempt": ..., "limit": S}  ... with its own hard
                                                      limit (an nnsight job)
                               {"done": JOB_ID, "outcome": "done" | "redis"}
stdout and stderr stay free for logs. When stdin closes (the worker stopped or died) the process
unpublishes itself and exits.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.attempts import Attempt

REPLY_FD_ENV = "ACTQ_ENGINE_REPLY_FD"


def main() -> None:
    from shared.settings import get_settings

    settings = get_settings()
    logging.basicConfig(
        level=logging.INFO,
        format="[%(asctime)s: %(levelname)s/engine] %(message)s",
        stream=sys.stderr,
    )
    log = logging.getLogger("actq.engine")
    replies = os.fdopen(int(os.environ[REPLY_FD_ENV]), "w", buffering=1, encoding="utf-8")
    lock = threading.Lock()

    def send(message: dict) -> None:
        with lock:
            replies.write(json.dumps(message) + "\n")

    def started(job_id: str, limit: float | None = None, attempt: Attempt | None = None) -> None:
        message: dict = {"started": job_id}
        if attempt is not None:
            message["attempt"] = [attempt.number, attempt.worker]
        if limit is not None:
            message["limit"] = limit
        send(message)

    from worker import runner, runtime

    try:
        rt = runtime.start(settings)
    except Exception:
        log.critical("cannot serve model %s", settings.model, exc_info=True)
        sys.exit(1)
    send({"ready": rt.worker_id})
    try:
        for line in sys.stdin:
            message = json.loads(line)
            job_id = str(message["run"])
            runner.submit(job_id, reply=lambda job, outcome: send({"done": job, "outcome": outcome}), started=started)
    finally:
        runtime.stop()
    os._exit(0)  # daemon threads (finishers, heartbeat) end with the process


if __name__ == "__main__":
    main()
