"""The engine process: `python -m worker.engine_process`, started by the Celery worker (see
engine_client.py). It loads the one model, publishes it, and runs every job it is handed in the
scheduler's batches.

Protocol: one JSON object per line, nothing else is ever decoded:
  stdin (from the worker)      {"run": JOB_ID}
  fd REPLY_FD (to the worker)  {"ready": WORKER_ID}   once the model is loaded and published
                               {"started": JOB_ID}    the job joined a batch
                               {"started": JOB_ID, "limit": S}  ... with its own hard limit (an nnsight job)
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
            runner.submit(
                job_id,
                reply=lambda job, outcome: send({"done": job, "outcome": outcome}),
                started=lambda job, limit=None: send({"started": job, **({} if limit is None else {"limit": limit})}),
            )
    finally:
        runtime.stop()
    os._exit(0)  # daemon threads (finishers, heartbeat) end with the process


if __name__ == "__main__":
    main()
