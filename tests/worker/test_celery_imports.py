"""The Celery process never imports torch (tests/e2e/test_engine_death.py checks a running worker):
here, in seconds, what it imports at start, its task module and the engine client, in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
CHECK = """
import sys
import worker.celery_app, worker.engine_client, worker.engine.process, worker.lost_messages, worker.broker_transport
heavy = sorted(name for name in ("torch", "transformers") if name in sys.modules)
print(",".join(heavy) or "none")
"""


def test_the_celery_process_imports_no_torch():
    done = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "none", done.stdout
