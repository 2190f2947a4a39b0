"""Trusted nnsight code on the served model (documented as code execution, docs/nnsight.md): the run
itself and the guard that puts the model and the process back after it."""
