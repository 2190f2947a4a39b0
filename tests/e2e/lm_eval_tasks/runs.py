"""lm-eval 0.4.13 run in this process, stock: its own model classes (`local-completions`,
`local-chat-completions`) built from the registry as `lm_eval --model NAME --model_args ...` builds
them, and `simple_evaluate` over this folder's tasks only (the built-in ones are not indexed: it
saves seconds and needs nothing from the hub). The data files are read from `data_dir`, where
lm_eval runs, as the tasks' relative `data_files` say (synthetic.py writes them)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from tests.e2e.lm_eval_tasks.synthetic import TASKS


def evaluate(
    model: str,
    model_args: dict[str, Any],
    tasks: list[str],
    data_dir: Path,
    *,
    batch_size: int = 1,
    chat: bool = False,
    **options: Any,
) -> tuple[Any, dict[str, Any]]:
    """(the lm-eval model object, simple_evaluate's results with every sample logged); `options`
    go to simple_evaluate (e.g. `limit`)."""
    from lm_eval import simple_evaluate  # type: ignore[import-untyped]
    from lm_eval.api.registry import get_model  # type: ignore[import-untyped]
    from lm_eval.tasks import TaskManager  # type: ignore[import-untyped]

    lm = get_model(model)(**model_args, batch_size=batch_size)
    with contextlib.chdir(data_dir):
        results = simple_evaluate(
            model=lm,
            tasks=tasks,
            task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
            log_samples=True,
            apply_chat_template=chat,
            bootstrap_iters=0,  # no standard errors: nothing here reads them
            **options,
        )
    assert results is not None
    return lm, dict(results)
