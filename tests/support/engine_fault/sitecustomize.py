"""Test-only fault (tests/e2e/test_faults.py): put this folder on a worker's PYTHONPATH with
ENGINE_FAULT_ONCE=<a path that does not exist>, and the first engine process to load
worker.engine.core creates that file and has its engine thread raise from outside every guarded
call at the fifth turn of its loop with a batch running: the bug the watchdog exists for. Engine
processes started later find the file and run normally. Nothing outside the tests imports this."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

MARKER = os.environ.get("ENGINE_FAULT_ONCE")
TURN = 5


def _arm(module: object) -> None:
    try:
        os.close(os.open(MARKER or "", os.O_CREAT | os.O_EXCL | os.O_WRONLY))  # the first engine only
    except FileExistsError:
        return
    core = module.EngineCore  # type: ignore[attr-defined]
    tick = core.tick
    turns = [0]

    def failing(self: object, decoder: object) -> None:
        if decoder.rows:  # type: ignore[attr-defined]
            turns[0] += 1
            if turns[0] == TURN:
                raise RuntimeError("injected: a bug outside every guarded call")
        tick(self, decoder)

    core.tick = failing


class _ArmOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        if name != "worker.engine.core":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module: object) -> None:
            load(module)  # type: ignore[arg-type]
            _arm(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if MARKER:
    sys.meta_path.insert(0, _ArmOnImport())
