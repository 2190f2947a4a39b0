"""`actq run-file` as a user runs it, against the live stack (tiny model): a 12-line prompt file,
killed mid-run and resumed with nothing submitted twice, then a probe on one of its label columns."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow.parquet as pq
from safetensors.numpy import load_file

from shared import keys
from shared.schemas import JobRecord
from tests.e2e.test_api_keys import ALPHA, keyed_api  # noqa: F401 - the keyed API fixture
from tests.e2e.test_gsm8k import actq, kill_after_samples, run_env
from tests.support.stack import TINY, job_count


def prompt_lines() -> list[dict]:
    """Twelve lines: raw prompts and chats, ids of both kinds, a label column, per-line max_tokens
    (so the jobs end in waves, not all at one step) and one trace line scoring a given reply."""
    lines: list[dict] = []
    for i in range(11):
        line: dict = {"topic": "arithmetic" if i % 2 else "geography", "difficulty": i % 3}
        if i % 3 == 0:
            line["prompt"] = f"Question {i}: what is {i} + {i}? Answer:"
        else:
            line["messages"] = [{"role": "user", "content": f"Tell me fact number {i}."}]
        if i % 4 != 1:
            line["id"] = f"q-{i}" if i % 2 else i * 100
        line["max_tokens"] = 6 + 12 * i
        lines.append(line)
    lines.append(
        {
            "id": "scored",
            "mode": "trace",
            "messages": [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}],
            "logprobs": True,
            "topic": "arithmetic",
            "difficulty": 0,
        }
    )
    return lines


def test_a_prompt_file_killed_mid_run_resumes_without_duplicates_then_probes(live, tmp_path, redis_client):
    prompts = tmp_path / "prompts.jsonl"
    lines = prompt_lines()
    prompts.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    out = tmp_path / "run"
    args = ["run-file", str(prompts), "--out", str(out), "--model", TINY, "--download", "--quiet"]
    before = job_count(redis_client)
    kill_after_samples(actq(live, *args), run_env(live), out, 3)
    finished_before = len(list((out / "samples").glob("*.json")))
    assert 3 <= finished_before < 12, finished_before
    queued = json.loads((out / "jobs.json").read_text())
    assert len(queued) == 12  # all were queued before the kill

    second = subprocess.run(actq(live, *args), env=run_env(live), capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout.strip().splitlines()[-1]) == {
        "prompts": 12,
        "finished": 12,
        "succeeded": 12,
        "failed": 0,
    }
    samples = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [s["index"] for s in samples] == list(range(12))
    assert job_count(redis_client) - before == 12  # one job per line across both invocations
    assert {s["job_id"] for s in samples} == set(queued.values()) and len(set(queued.values())) == 12

    for number, (line, sample) in enumerate(zip(lines, samples, strict=True)):
        assert sample["id"] == line.get("id", number)
        assert sample["labels"] == {"topic": line["topic"], "difficulty": line["difficulty"]}
        assert sample["status"] == "succeeded"
        record = JobRecord.model_validate_json(redis_client.get(keys.job(sample["job_id"])))
        sent = record.request
        assert (sent.prompt, sent.messages is not None) == (line.get("prompt"), "messages" in line)
        tensors = load_file(str(out / sample["activations_file"]))
        captured = {t["name"] for t in sample["activations"]["tensors"]}
        assert len(captured) == 3 and captured < set(tensors) and "token_ids" in tensors  # the residual preset
        if line.get("mode") == "trace":
            assert sent.mode == "trace" and sent.capture.positions == "completion" and sent.max_tokens is None
            start, stop = sample["completion_span"]
            assert sample["text"] == "" and sample["completion_logprob"] < 0 and sample["logprob_total"] < 0
            assert all(len(tensors[name]) == stop - start for name in captured)
        else:
            assert sent.max_tokens == line["max_tokens"] and sent.temperature == 0.0
            assert sample["completion_tokens"] == line["max_tokens"] or sample["finish_reason"] == "stop"
            assert sent.capture.positions == "generated"

    probe = subprocess.run(
        actq(live, "probe", str(out), "--label", "topic", "--folds", "3"),
        env=run_env(live),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert probe.returncode == 0, probe.stderr
    report = json.loads((out / "probes.json").read_text())
    assert report["label"] == "topic" and report["n_samples"] == 12
    trained = [p for p in report["probes"] if "balanced_accuracy_mean" in p]
    assert trained and all(0.0 <= p["balanced_accuracy_mean"] <= 1.0 for p in trained)

    exported = subprocess.run(
        actq(live, "export", str(out)), env=run_env(live), capture_output=True, text=True, timeout=300
    )
    assert exported.returncode == 0, exported.stderr
    table = pq.read_table(out / "export.parquet").to_pylist()
    assert len(table) == 12 * 3  # every line x the three residual blocks
    by_line = {row["index"]: row for row in table}
    for number, (line, sample) in enumerate(zip(lines, samples, strict=True)):
        row = by_line[number]
        assert (row["id"], json.loads(row["labels"])) == (str(sample["id"]), sample["labels"])
        assert row["prompt"] == line.get("prompt", (line.get("messages") or [{}])[0].get("content"))
        tokens = load_file(str(out / sample["activations_file"]))["token_ids"].tolist()
        assert row["token_ids"] == tokens and row["row_positions"] == list(range(row["start"], row["stop"]))
        if number != 11:
            assert row["text"] == sample["text"] and row["messages"] == (
                json.dumps(line["messages"]) if "messages" in line else None
            )
    traced = by_line[11]
    assert traced["completion_span"] == samples[11]["completion_span"] and traced["question"] is None
    assert (traced["prompt"], traced["text"]) == ("2 + 2?", "4")  # the scored reply, not the empty generation

    changed = prompts.read_text().replace("fact number 2.", "fact number two.")
    prompts.write_text(changed)
    refused = subprocess.run(actq(live, *args), env=run_env(live), capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "holds a run with other settings (prompts_sha256)" in refused.stderr


def test_run_file_on_a_keyed_api_and_refused_requests_leave_nothing_behind(live, keyed_api, tmp_path):  # noqa: F811
    """With ACTQ_API_KEYS on: without the key, one line naming --api-key; a typo'd module or a layer
    the model lacks is the API's 422 in one line, before --out exists, so the corrected command
    (same --out) runs; with the key (--api-key or ACTQ_API_KEY) it succeeds."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "2 + 2 =", "max_tokens": 3, "topic": "math"}\n{"prompt": "Hi", "max_tokens": 2}\n')
    out = tmp_path / "run"
    base = [sys.executable, "-m", "shared.cli", "run-file", str(prompts), "--out", str(out), "--api", keyed_api]
    base += ["--model", TINY, "--quiet"]

    def refused(*extra: str, env: dict | None = None) -> str:
        done = subprocess.run([*base, *extra], env={**run_env(live), **(env or {})}, capture_output=True, text=True)
        assert done.returncode == 2 and "Traceback" not in done.stderr + done.stdout, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and keyed_api in lines[0], done.stderr
        assert not out.exists()
        return lines[0]

    assert "--api-key KEY or ACTQ_API_KEY" in refused()
    assert "401" in refused("--api-key", "not-a-key")
    assert "model.layer.8" in refused("--api-key", ALPHA, "--module", "model.layer.8")
    assert "422" in refused("--api-key", ALPHA, "--layers", "0,99")
    done = subprocess.run(
        [*base, "--layers", "0,-1"], env={**run_env(live), "ACTQ_API_KEY": ALPHA}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["succeeded"] == 2
    again = subprocess.run([*base, "--layers", "0,-1", "--api-key", ALPHA], env=run_env(live), capture_output=True)
    assert again.returncode == 0, again.stderr  # resumed: every line is done
