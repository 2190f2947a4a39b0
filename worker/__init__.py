"""The actq worker: a Celery app whose engine process holds one model and runs its jobs together."""
