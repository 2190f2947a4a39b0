"""The actq worker: a Celery app whose child process holds one model and runs one job at a time."""
