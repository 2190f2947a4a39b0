"""What the nnsight end-to-end tests share: a stack whose API trusts one key with nnsight code,
and nnsight's stock client model over a folder (no weights: what builds a request)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from shared.cli.redis_server import RedisServer
from tests.support.stack import TINY, TestStack

TRUSTED, PLAIN = "trusted-key-0123456789", "plain-key-0123456789"


@contextmanager
def trusted_stack(root: Path, tiny_dir: Path, **overrides: str) -> Iterator[TestStack]:
    """Its own Redis, API and a worker serving the tiny model as `tiny`; TRUSTED may send nnsight code."""
    from tests.e2e.conftest import STACK_ENV, own_stack

    with RedisServer(root / "redis") as server:
        env = {**STACK_ENV, "ACTQ_MODEL_CACHE_DIR": str(root / "cache"), "ACTQ_REDIS_URL": server.url}
        with own_stack(root, env, ACTQ_API_KEYS=f"{TRUSTED},{PLAIN}", ACTQ_NNSIGHT_KEYS=TRUSTED, **overrides) as s:
            s.start_worker(TINY, {"ACTQ_MODEL": str(tiny_dir), "ACTQ_MODEL_NAME": TINY})
            yield s


def client_model(folder: Path, repo_id: str | None = None, **kwargs: Any) -> Any:
    """nnsight's TransformersModel over `folder`, named in requests as `repo_id` (the folder itself
    by default): the Hub's answer for a local folder, seeded as docs/nnsight.md says."""
    from nnsight.modeling import huggingface
    from nnsight.modeling.transformers import TransformersModel
    from transformers import AutoTokenizer

    huggingface._ID_CACHE[str(folder)] = repo_id or str(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return TransformersModel(str(folder), task="text-generation", tokenizer=tokenizer, **kwargs)


@contextmanager
def nnsight_host(stack: TestStack, key: str = TRUSTED) -> Iterator[TestStack]:
    """nnsight's client pointed at the stack with `key`, as NDIF_HOST and NDIF_API_KEY would."""
    from nnsight import CONFIG

    before = CONFIG.API.HOST, CONFIG.API.APIKEY
    CONFIG.API.HOST, CONFIG.API.APIKEY = stack.base_url, key
    try:
        yield stack
    finally:
        CONFIG.API.HOST, CONFIG.API.APIKEY = before
