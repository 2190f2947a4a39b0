"""lm-evaluation-harness 0.4.13 from PyPI, stock and unmodified, against actq serving the built-in
SmolLM2: `local-completions` at batch size 1 and 4, with token-id and with text prompts, and
`local-chat-completions` with its chat template, over the local tasks in lm_eval_tasks/ (a
multiple-choice task and a generate_until task on synthetic data; no hub).

Every multiple-choice score lm-eval logs (each choice's log-likelihood and is_greedy, each sample's
acc and acc_norm) equals a plain transformers computation on the same model in float32 (1e-4), and
every generated answer equals transformers' greedy `generate` from the same prompt tokens, cut at
the same stop strings. lm-eval sends a batch as one request with a list of prompts: each prompt is
a job of its own.

lm-eval finds the server's tokenizer by itself (GET /tokenizer_info, POST /tokenize and
POST /detokenize at the server root, with no model named) only where one model is served, as
`actq serve` does: those runs use a stack of their own with one SmolLM2 worker. The session's stack
serves several models; there lm-eval is given the tokenizer (`tokenizer_backend=huggingface`,
`tokenizer=<the model's folder>`), and the chat route needs none."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pyarrow.parquet as pq  # type: ignore[import-untyped]
import pytest
import redis
import torch

from shared.cli.redis_server import RedisServer
from tests.e2e.conftest import own_stack
from tests.e2e.lm_eval_tasks import runs, synthetic
from tests.e2e.lm_eval_tasks.reference import Reference, encode_pair
from tests.support.stack import SMOL, TestStack, job_count

pytestmark = pytest.mark.slow

MC_ITEMS, GEN_ITEMS, ROLLING_ITEMS = 4, 4, 4  # 4 x 4 choices: each scored against transformers
CHOICES = 4
TOLERANCE = 1e-4
JOBS = MC_ITEMS * CHOICES + GEN_ITEMS  # one job per lm-eval request: a prompt, whatever the batch size
# The server's capture for OpenAI-route requests that send none (lm-eval cannot send one):
# block 15's output at every prompt position, so that each scored choice has its activations.
LAYER = 15
DEFAULT_CAPTURE = {"modules": [f"model.layers.{LAYER}"], "positions": "prompt", "dtype": "float16"}


@pytest.fixture(scope="module")
def served(live: TestStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestStack]:
    """A stack of its own (its own Redis) serving only SmolLM2, as `actq serve` does, with a
    default capture for the model (ACTQ_DEFAULT_CAPTURE_BY_MODEL)."""
    root = tmp_path_factory.mktemp("lm-eval-stack")
    default = json.dumps({SMOL: DEFAULT_CAPTURE})
    with (
        RedisServer(root / "redis") as server,
        own_stack(root / "stack", live.env, ACTQ_REDIS_URL=server.url, ACTQ_DEFAULT_CAPTURE_BY_MODEL=default) as stack,
    ):
        stack.start_worker("smol-lm-eval", {"ACTQ_MODEL": SMOL})
        yield stack


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthetic.write(tmp_path_factory.mktemp("lm-eval-data"), MC_ITEMS, GEN_ITEMS, ROLLING_ITEMS)


@pytest.fixture(scope="module")
def reference(smol_dir: Path) -> Reference:
    return Reference.load(smol_dir)


def completions_args(stack: TestStack, **extra: Any) -> dict[str, Any]:
    """`--model_args` for local-completions as a user writes them; max_retries=1: a refusal fails at once."""
    return {"base_url": f"{stack.base_url}/v1/completions", "model": SMOL, "max_retries": 1, **extra}


def argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


def check_multiple_choice(results: dict[str, Any], reference: Reference) -> None:
    """Each choice's (log-likelihood, is_greedy) and each sample's acc/acc_norm against transformers."""
    samples = results["samples"]["actq_mc"]
    assert sorted(s["doc_id"] for s in samples) == list(range(MC_ITEMS))
    right = right_norm = 0
    for sample in samples:
        pairs = [tuple(args) for args in sample["arguments"]]  # (context, " " + choice), one per choice
        assert [continuation for _, continuation in pairs] == [" " + c for c in sample["doc"]["choices"]]
        want = [reference.loglikelihood(context, continuation) for context, continuation in pairs]
        got = [tuple(resp) for resp in sample["filtered_resps"]]
        assert len(got) == CHOICES
        for (value, greedy), (expected, expected_greedy) in zip(got, want, strict=True):
            assert abs(value - expected) <= TOLERANCE, (sample["doc_id"], got, want)
            assert greedy is expected_greedy, (sample["doc_id"], got, want)
        lengths = [float(len(c)) for c in sample["doc"]["choices"]]
        gold = sample["target"]
        hit = argmax([v for v, _ in want]) == gold
        hit_norm = argmax([v / n for (v, _), n in zip(want, lengths, strict=True)]) == gold
        assert (sample["acc"], sample["acc_norm"]) == (float(hit), float(hit_norm)), sample["doc_id"]
        right, right_norm = right + hit, right_norm + hit_norm
    scores = results["results"]["actq_mc"]
    assert scores["acc,none"] == pytest.approx(right / MC_ITEMS)
    assert scores["acc_norm,none"] == pytest.approx(right_norm / MC_ITEMS)


def check_generation(results: dict[str, Any], reference: Reference, prompt_ids: Any) -> list[str]:
    """Each answer against transformers' greedy generate from `prompt_ids(context)`; the answers."""
    samples = results["samples"]["actq_gen"]
    assert sorted(s["doc_id"] for s in samples) == list(range(GEN_ITEMS))
    answers = []
    for sample in samples:
        [(context, gen_kwargs)] = sample["arguments"]
        assert gen_kwargs["until"] == ["\n"] and gen_kwargs["max_gen_toks"] == 8
        [answer] = sample["filtered_resps"]
        expected = reference.generate(prompt_ids(context), gen_kwargs["max_gen_toks"], gen_kwargs["until"])
        assert answer == expected, (sample["doc_id"], answer, expected)
        answers.append(answer)
    assert any(a.strip() for a in answers), answers  # the model wrote something: the equality means something
    return answers


def jobs_made(stack: TestStack, run: Any) -> int:
    """How many job records `run()` added to the stack's Redis."""
    client = redis.Redis.from_url(stack.redis_url)
    try:
        before = job_count(client)
        run()
        return job_count(client) - before
    finally:
        client.close()


@pytest.mark.parametrize("tokenized", [True, False], ids=["token-ids", "text"])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_local_completions_scores_and_generates_as_transformers_does(
    served: TestStack, data_dir: Path, reference: Reference, batch_size: int, tokenized: bool
) -> None:
    outcome: dict[str, Any] = {}

    def run() -> None:
        outcome["lm"], outcome["results"] = runs.evaluate(
            "local-completions",
            completions_args(served, tokenized_requests=tokenized),
            ["actq_mc", "actq_gen"],
            data_dir,
            batch_size=batch_size,
        )

    made = jobs_made(served, run)
    lm, results = outcome["lm"], outcome["results"]
    # tokenizer_backend "auto" found the server's tokenizer: no hub, no local tokenizer
    assert lm.tokenizer_backend == "remote" and lm.eot_token_id == reference.tokenizer.eos_token_id
    check_multiple_choice(results, reference)
    check_generation(results, reference, reference.text_ids)
    assert made == JOBS  # one job per prompt, whether sent one by one or `batch_size` to a request


def test_perplexity_is_the_same_from_token_ids_and_from_text(
    served: TestStack, data_dir: Path, reference: Reference
) -> None:
    """loglikelihood_rolling (perplexity): lm-eval puts the model's prefix token before each
    document. With token ids that is the token's id; with `tokenized_requests=False` it sends the
    tokens decoded back to text, `"<|im_start|>The capital..."`, and the special-token string must
    be read as that token, as the tokenizer and vLLM read it, or every document gains the string's
    pieces as tokens and its perplexity is silently wrong. Both modes equal a transformers forward
    pass over the same tokens, and give the same perplexity."""
    perplexities = {}
    for tokenized in (True, False):
        lm, results = runs.evaluate(
            "local-completions",
            completions_args(served, tokenized_requests=tokenized),
            ["actq_rolling"],
            data_dir,
            batch_size=4,
        )
        samples = results["samples"]["actq_rolling"]
        assert sorted(s["doc_id"] for s in samples) == list(range(ROLLING_ITEMS))
        prefix = lm.prefix_token_id
        assert reference.tokenizer.convert_ids_to_tokens(prefix) in reference.tokenizer.all_special_tokens
        for sample in samples:
            [(text,)] = [tuple(args) for args in sample["arguments"]]
            assert text == sample["doc"]["text"]
            expected = reference.rolling_loglikelihood(text, prefix)
            [value] = sample["filtered_resps"]
            assert abs(value - expected) <= TOLERANCE, (tokenized, sample["doc_id"], value, expected)
        perplexities[tokenized] = results["results"]["actq_rolling"]["word_perplexity,none"]
    assert perplexities[True] == pytest.approx(perplexities[False], rel=1e-5), perplexities


def test_several_models_served_lm_eval_given_the_tokenizer(
    live_smol: TestStack, data_dir: Path, reference: Reference, smol_dir: Path
) -> None:
    """The session's stack serves several models: the server's tokenizer routes cannot tell which
    one lm-eval means, so it is given the model's own tokenizer (a local folder: no hub)."""
    from lm_eval.utils import check_remote_tokenizer_support  # type: ignore[import-untyped]

    # what tokenizer_backend=auto asks first: unanswered here (the routes want a model named), so
    # lm-eval would go to the hub by the model's name
    assert not check_remote_tokenizer_support(f"{live_smol.base_url}/v1/completions", max_retries=1)
    lm, results = runs.evaluate(
        "local-completions",
        completions_args(live_smol, tokenizer_backend="huggingface", tokenizer=str(smol_dir)),
        ["actq_mc", "actq_gen"],
        data_dir,
        batch_size=4,
    )
    assert lm.tokenizer_backend == "huggingface"
    check_multiple_choice(results, reference)
    check_generation(results, reference, reference.text_ids)


def test_local_chat_completions_with_the_chat_template(
    live_smol: TestStack, data_dir: Path, reference: Reference
) -> None:
    """The generate_until task through /v1/chat/completions: lm-eval sends the chat as messages and
    the server applies the model's chat template (lm-eval has no tokenizer here)."""
    lm, results = runs.evaluate(
        "local-chat-completions",
        {"base_url": f"{live_smol.base_url}/v1/chat/completions", "model": SMOL, "max_retries": 1},
        ["actq_gen"],
        data_dir,
        chat=True,
    )
    assert lm.tokenizer is None

    def chat_ids(context: Any) -> list[int]:
        assert isinstance(context, tuple)  # lm-eval's JsonChatStr (logged as a plain tuple): the messages it sends
        messages = json.loads(context[0])
        assert messages[-1]["role"] == "user" and messages[-1]["content"].startswith("Question: ")
        return reference.chat_ids(messages)

    check_generation(results, reference, chat_ids)


def test_the_runs_activations_export_to_one_parquet_file_matched_to_lm_evals_samples(
    served: TestStack, data_dir: Path, reference: Reference, tmp_path: Path
) -> None:
    """The manual's commands (docs/lm-eval.md): `lm_eval` (its CLI, batch size 4, the server's tokenizer) against a
    labelled base URL (`/runs/<label>/v1/completions`) of a stack with a default capture for the
    model, then `actq export --label <label>`: one Parquet file, a row per job of that run and no
    other, each matched to its lm-eval sample (and choice) by the prompt's tokens, which POST
    /tokenize gives from the sample's logged text. lm-eval sends no capture, no metadata and keeps
    no job id: the URL's label tags every job, scoring included, and the prompt matches rows."""
    label = f"lm-eval-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    model_args = f"base_url={served.base_url}/runs/{label}/v1/completions,model={SMOL}"
    run = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args", model_args]
    run += ["--tasks", "actq_mc,actq_gen", "--include_path", str(synthetic.TASKS), "--batch_size", "4"]
    run += ["--log_samples", "--output_path", str(tmp_path / "lm-eval")]
    done = subprocess.run(run, cwd=data_dir, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    other = httpx.post(  # a job of the same stack outside the run: not exported with it
        f"{served.base_url}/v1/completions",
        json={"model": SMOL, "prompt": "Question: 1 + 1?", "max_tokens": 2},
        timeout=120,
    )
    assert other.status_code == 200, other.text
    parquet = tmp_path / "activations.parquet"
    export = [sys.executable, "-m", "shared.cli", "export", "--label", label]
    export += ["--out", str(parquet), "--api", served.base_url]
    done = subprocess.run(export, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    rows = pq.read_table(parquet).to_pylist()
    by_prompt = {tuple(row["token_ids"][: row["prompt_tokens"]]): row for row in rows}
    assert len(rows) == len(by_prompt) == JOBS  # a row per job of the run (one capture point), no prompt twice
    assert {row["metadata.run"] for row in rows} == {label}
    assert other.headers["x-actq-job-id"] not in {row["job_id"] for row in rows}
    [mc_file] = (tmp_path / "lm-eval").glob("*/samples_actq_mc_*.jsonl")
    [gen_file] = (tmp_path / "lm-eval").glob("*/samples_actq_gen_*.jsonl")
    matched: dict[str, tuple[str, int, int]] = {}  # job id -> (task, doc_id, choice)
    with httpx.Client(base_url=served.base_url, timeout=60) as http:

        def tokens(text: str) -> tuple[int, ...]:
            answer = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
            return tuple(answer.json()["tokens"])

        for line in mc_file.read_text().splitlines():
            sample = json.loads(line)
            for choice, args in enumerate(sample["arguments"].values()):
                ids = tokens(args["arg_0"] + args["arg_1"])
                context, continuation = encode_pair(reference.tokenizer, args["arg_0"], args["arg_1"])
                assert list(ids) == context + continuation  # what lm-eval sent, as lm-eval cut it
                row = by_prompt[ids]
                matched[row["job_id"]] = ("actq_mc", sample["doc_id"], choice)
                assert (row["point"], row["positions"]) == (f"model.layers.{LAYER}", "prompt")
                assert row["shape"] == [len(ids), reference.model.config.hidden_size]
                expected = reference.block_output(list(ids), LAYER)
                torch.testing.assert_close(torch.tensor(row["activations"]), expected, rtol=1e-2, atol=1e-2)
        for line in gen_file.read_text().splitlines():
            sample = json.loads(line)
            row = by_prompt[tokens(sample["arguments"]["gen_args_0"]["arg_0"])]
            matched[row["job_id"]] = ("actq_gen", sample["doc_id"], 0)
            assert row["text"] == sample["filtered_resps"][0]  # the job's answer is the one lm-eval scored
    assert len(matched) == JOBS  # every lm-eval request found its own job's row
