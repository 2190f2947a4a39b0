"""The actq HTTP API: validate, record, enqueue, read. It never imports torch or loads a model."""
