"""An engine process: `python -m worker.engine.process`, started by the Celery worker (see
worker/engine_client.py). It loads the one model, publishes it, and runs every job it is handed in the
scheduler's batches. Its role (ACTQ_ENGINE_ROLE) is `capture` (every job but nnsight ones) or
`nnsight` (trusted code on a copy of the model of its own, ACTQ_NNSIGHT_ENGINE=own).

Protocol: one JSON object per line, nothing else is ever decoded:
  stdin (from the worker)      {"run": JOB_ID}
                               {"closing": true}      the worker is stopping: no more heartbeats (it
                                                      takes no new job); running jobs go on
  fd REPLY_FD (to the worker)  {"ready": WORKER_ID}   once the model is loaded and published
                               {"started": JOB_ID, "attempt": [N, WORKER]}  the job joined a batch, as
                                                      the attempt its claim made (shared/attempts.py)
                               {"started": JOB_ID, "attempt": ..., "limit": S, "alone": true}  ... trusted
                                                      code, with the model to itself and a hard limit of its own
                               {"storing": JOB_ID}    the job left its batch; only its files and
                                                      outcome remain to be written (jobs that write files)
                               {"done": JOB_ID, "outcome": "done" | "redis"}
                               {"replace": [REASON, ...]}  trusted code left the process in a state it
                                                      cannot prove whole: it exits (EX_REPLACED) after this
                               {"dead": REASON}       why the process ends, before it does: the engine
                                                      thread's fatal error (exit 70), the model that cannot
                                                      be served (exit 1), a failure of this loop (exit 70)
stdout and stderr stay free for logs. When stdin closes (the worker stopped or died) the process
unpublishes itself and exits. It claims jobs and beats under the worker's Celery node name
(NODE_ENV, set by the worker), or `host:pid` when started without one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.attempts import Attempt

REPLY_FD_ENV = "ACTQ_ENGINE_REPLY_FD"
ROLE_ENV = "ACTQ_ENGINE_ROLE"
NODE_ENV = "ACTQ_ENGINE_NODE"
EX_SOFTWARE = 70  # the process ended on a bug of its own (engine_core.ENGINE_THREAD_DIED is the same status)


def reason(exc: BaseException) -> str:
    """An exception in words for a `dead` message: its type and text, bounded, never raising."""
    try:
        return f"{type(exc).__name__}: {exc}"[:2000]
    except BaseException:  # noqa: BLE001 - its __str__ may raise too
        return type(exc).__name__


def main() -> None:
    from shared.settings import get_settings

    settings = get_settings()
    role = os.environ.get(ROLE_ENV, "capture")
    logging.basicConfig(
        level=logging.INFO,
        format=f"[%(asctime)s: %(levelname)s/{'engine' if role == 'capture' else role + '-engine'}] %(message)s",
        stream=sys.stderr,
    )
    log = logging.getLogger("actq.engine")
    from shared.outages import quiet_retries

    quiet_retries()  # a Redis or store outage: one line when it starts, one when it ends (shared/outages.py)
    replies = os.fdopen(int(os.environ[REPLY_FD_ENV]), "w", buffering=1, encoding="utf-8")
    lock = threading.Lock()
    to_replace: dict[str, list[str]] = {}  # job id -> why the process must be replaced once it is answered

    def send(message: dict) -> None:
        with lock:
            replies.write(json.dumps(message) + "\n")

    def dead(why: str) -> None:
        """Tell the worker why this process ends (it records it in the log and the jobs' errors)."""
        try:
            send({"dead": why})
        except (OSError, ValueError):  # the worker is gone (a closed pipe): nobody to tell
            pass

    def started(job_id: str, limit: float | None = None, attempt: Attempt | None = None) -> None:
        message: dict = {"started": job_id}
        if attempt is not None:
            message["attempt"] = [attempt.number, attempt.worker]
        if limit is not None:
            message["limit"], message["alone"] = limit, True
        send(message)

    def storing(job: str) -> None:
        """Only the worker's prefetch hears it: a worker gone (a closed pipe) loses nothing by it."""
        with contextlib.suppress(OSError, ValueError):
            send({"storing": job})

    def reply(job: str, outcome: str) -> None:
        send({"done": job, "outcome": outcome})
        reasons = to_replace.pop(job, None)
        if reasons is not None:
            send({"replace": reasons})
            log.warning("replacing this engine process: %s", "; ".join(reasons)[:2000])
            from worker.engine.runtime import EX_REPLACED

            os._exit(EX_REPLACED)

    try:
        from worker.engine import core as engine_core
        from worker.engine import job_flow, runtime

        engine_core.last_words = dead
        rt = runtime.start(
            settings,
            role,
            replace=lambda job, reasons: to_replace.__setitem__(job, reasons),
            worker_id=os.environ.get(NODE_ENV),
        )
    except Exception as exc:
        dead(f"cannot serve model {settings.model}: {reason(exc)}")
        log.critical("cannot serve model %s", settings.model, exc_info=True)
        sys.exit(1)
    send({"ready": rt.worker_id})
    try:
        for line in sys.stdin:
            message = json.loads(line)
            if message.get("closing"):
                runtime.unpublish()
                continue
            job_id = str(message["run"])
            job_flow.submit(job_id, reply=reply, started=started, storing=storing)
    except Exception as exc:  # a bug of this loop: say it, then end as the engine thread's death does
        dead(f"the engine process's job loop failed: {reason(exc)}")
        log.critical("the engine process's job loop failed; exiting", exc_info=True)
        with contextlib.suppress(Exception):
            runtime.stop()
        os._exit(EX_SOFTWARE)
    finally:
        runtime.stop()
    os._exit(0)  # daemon threads (finishers, heartbeat) end with the process


if __name__ == "__main__":
    main()
