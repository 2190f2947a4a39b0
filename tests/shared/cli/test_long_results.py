"""A result the API keeps apart (`result.stored`, its text cut to the first 200 characters in the
job's record when `text_truncated`): `actq run-file` and `actq gsm8k` write the whole text, read
through `GET /jobs/{id}/result` (shared/client.py Job.result_data), and nothing more when the
record's text is whole."""

from __future__ import annotations

from shared.cli import batch, run_file
from shared.cli.batch import Item
from shared.cli.gsm8k import data
from shared.cli.gsm8k.runner import Run, RunSettings
from shared.client import Job

LONG = "The answer is 42. " * 400  # 7,200 characters


class Answer:
    def __init__(self, body: dict) -> None:
        self.body = body

    def json(self) -> dict:
        return self.body


class StubClient:
    """Answers GET /jobs/{id}/result with the whole result, and counts the requests."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str]] = []

    def _request(self, method: str, path: str, **kwargs: object) -> Answer:
        self.requests.append((method, path))
        return Answer(whole())


def whole() -> dict:
    usage = {"prompt_tokens": 5, "completion_tokens": 1600, "total_tokens": 1605}
    return {"text": LONG, "finish_reason": "length", "usage": usage, "logprobs": None}


def job(client: StubClient, truncated: bool) -> Job:
    kept = {**whole(), "text": LONG[:200] if truncated else LONG}
    kept["stored"] = {"bytes": 20_000, "text_truncated": truncated, "url": "/jobs/j1/result"}
    return Job(client, {"id": "j1", "status": "succeeded", "result": kept, "activations": None})  # type: ignore[arg-type]


def test_run_file_writes_the_whole_text_of_a_result_kept_apart(tmp_path):
    client = StubClient()
    run = batch.BatchRun(tmp_path / "run", "run-file", {"model": "tiny"}, main="job")
    item = Item(key=0, requests={}, data=(0, {"prompt": "count", "topic": "x"}))
    sample = run_file.record(run, item, job(client, truncated=True), download=False)
    assert sample["text"] == LONG and sample["completion_tokens"] == 1600
    assert client.requests == [("GET", "/jobs/j1/result")]
    assert run_file.record(run, item, job(client, truncated=False), download=False)["text"] == LONG
    assert len(client.requests) == 1  # the record's text was whole: nothing fetched


def test_gsm8k_scores_the_whole_completion_of_a_result_kept_apart(tmp_path):
    client = StubClient()
    problem = data.Problem(index=3, question="6 times 7?", answer="6*7=42\n#### 42")
    run = Run(tmp_path / "run", RunSettings(model="tiny", dataset="samples"))
    sample = run.record(problem, {"generated": job(client, truncated=True)}, download=False)
    assert sample["completion"] == LONG and sample["correct"]["strict"] is True
    assert client.requests == [("GET", "/jobs/j1/result")]
