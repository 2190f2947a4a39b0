"""The Celery worker's task threads: one per job it holds in its engine, a batch's worth and the
jobs ready to take a place as it frees (ACTQ_READY_JOBS), read from the environment as a deployed
worker reads it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from shared.settings import Settings

ROOT = Path(__file__).resolve().parent.parent.parent


def test_a_worker_holds_a_batch_and_the_ready_jobs_it_is_told():
    from worker.celery_app import task_threads

    assert task_threads(Settings(max_batch=32)) == 32  # none ready by default
    assert task_threads(Settings(max_batch=1)) == 1
    assert task_threads(Settings(max_batch=32, ready_jobs=8)) == 40
    assert task_threads(Settings(max_batch=4, ready_jobs=12)) == 16


def test_the_celery_app_takes_its_concurrency_from_the_environment():
    check = "import worker.celery_app as c; print(c.app.conf.worker_concurrency)"
    env = {**os.environ, "ACTQ_MAX_BATCH": "8", "ACTQ_READY_JOBS": "5"}
    done = subprocess.run([sys.executable, "-c", check], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "13"
