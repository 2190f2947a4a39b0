"""`actq gsm8k --mode with-tools` against the live stack, with a model that calls the calculator
for real (the tiny model trained at test time, tests/support/tool_model.py): every turn a job,
calls answered by the calculator and fed back, trajectories and a summary of turns and calls,
resume mid-trajectory without duplicate jobs, then probes and an export over turns, and a with-
vs no-tools comparison. Each check is against an independent reference: the problem's own
expression and answer (tests/support/tool_model.py), `calculate` on it, the job records in Redis."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from shared import keys
from shared.calculator import TOOL, calculate
from shared.schemas import JobRecord
from tests.e2e.conftest import TOOL_MODEL
from tests.support.stack import SMOL, job_count
from tests.support.tool_model import final_answer, problems

pytestmark = pytest.mark.model

N = 12


def actq(live, *args: str) -> list[str]:
    return [sys.executable, "-m", "shared.cli", *args, "--api", live.base_url]


def write_dataset(path, n: int = N) -> list:
    """The tool model's word problems as a GSM8K JSONL (the answer ends "#### N")."""
    chosen = problems(n, seed=0)
    path.write_text("".join(json.dumps({"question": p.question, "answer": f"#### {p.answer}"}) + "\n" for p in chosen))
    return chosen


def trajectory(out, index: int) -> list[dict]:
    return [json.loads(line) for line in (out / "trajectories" / f"{index}.jsonl").read_text().splitlines()]


def records(redis_client, out) -> dict[str, JobRecord]:
    jobs = json.loads((out / "jobs.json").read_text())
    return {key: JobRecord.model_validate_json(redis_client.get(keys.job(job_id))) for key, job_id in jobs.items()}


def gsm8k(live, out, dataset, *extra: str) -> list[str]:
    # --style bare: the question alone, as the tool model was trained
    args = [
        "gsm8k",
        "--out",
        str(out),
        "--dataset",
        str(dataset),
        "--model",
        TOOL_MODEL,
        "--max-tokens",
        "48",
        "--style",
        "bare",
    ]
    return actq(live, *args, "--quiet", *extra)


def test_with_tools_calls_the_calculator_feeds_it_back_and_scores_the_answer(live_tools, tmp_path, redis_client):
    chosen = write_dataset(tmp_path / "problems.jsonl")
    out = tmp_path / "with"
    before = job_count(redis_client)
    done = subprocess.run(
        gsm8k(live_tools, out, tmp_path / "problems.jsonl", "--mode", "with-tools", "--download"),
        env={**os.environ, **live_tools.env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    samples = [json.loads((out / "samples" / f"{i}.json").read_text()) for i in range(N)]
    total_turns = sum(s["turns"] for s in samples)
    assert job_count(redis_client) - before == total_turns == len(json.loads((out / "jobs.json").read_text()))

    called = 0
    for problem, sample in zip(chosen, samples, strict=True):
        turns = trajectory(out, sample["index"])
        assert [t["turn"] for t in turns] == list(range(sample["turns"])) and sample["turns"] <= 4
        assert [t["job_id"] for t in turns] == [j["job_id"] for j in sample["turn_jobs"]]
        assert turns[0]["messages"] == [{"role": "user", "content": problem.question}]
        for before_turn, after in zip(turns, turns[1:], strict=False):
            # what turn t + 1 sent: turn t's messages, its calls, and each call's calculator result
            fed = after["messages"][len(before_turn["messages"]) :]
            assert fed[0] == {"role": "assistant", "tool_calls": before_turn["tool_calls"]} | (
                {"content": before_turn["content"]} if before_turn["content"] else {}
            )
            for call, message in zip(before_turn["tool_calls"], fed[1:], strict=True):
                expression = json.loads(call["function"]["arguments"]).get("expression")
                reference = calculate(expression).text if call["function"]["name"] == "calculator" else None
                assert message == {"role": "tool", "tool_call_id": call["id"], "content": message["content"]}
                if reference is not None:
                    assert message["content"] == reference
        first_call = turns[0]["tool_calls"][:1]
        if first_call and json.loads(first_call[0]["function"]["arguments"]) == {"expression": problem.expression}:
            called += 1
        if sample["ended"] == "answer":
            assert sample["completion"] == turns[-1]["text"] and not turns[-1]["tool_calls"]
        # the activations of every turn, the last one's as the sample's own
        assert all((out / j["activations_file"]).is_file() for j in sample["turn_jobs"])
        assert sample["activations_file"] == sample["turn_jobs"][-1]["activations_file"]
    # the model was trained to call the calculator with the problem's expression, then answer with its
    # result: most problems go exactly that way, two turns, and are right
    assert called >= N * 3 // 4, [trajectory(out, i)[0]["text"] for i in range(N)]
    right = [s for s, p in zip(samples, chosen, strict=True) if s["completion"] == final_answer(p.answer)]
    assert len(right) >= N // 2 and all(s["correct"]["strict"] for s in right)
    tools = summary["tools"]
    assert tools["turns"] == total_turns and tools["tool_calls"] == sum(s["tool_calls"] for s in samples)
    assert tools["turns_per_item_mean"] == round(total_turns / N, 4)
    assert tools["per_item"] == {str(s["index"]): {"turns": s["turns"], "tool_calls": s["tool_calls"]} for s in samples}
    assert summary["accuracy"]["strict"] == sum(s["correct"]["strict"] for s in samples) / N
    assert summary["generated_tokens"] == sum(j["completion_tokens"] for s in samples for j in s["turn_jobs"])

    # every turn is a job with the run's capture, the calculator as its tool, metadata naming it
    run_id = json.loads((out / "run.json").read_text())["run_id"]
    for key, record in records(redis_client, out).items():
        index, turn = key.split(":turn")
        label = f"gsm8k-{run_id[:16]}"  # the run's label: `actq cancel --run`, `actq export --label`
        assert record.request.metadata == {"actq_run": run_id, "problem": index, "turn": turn, "run": label}
        assert [t.rendered() for t in record.request.tools or []] == [TOOL] and record.request.tool_choice == "auto"
        assert record.request.capture is not None and record.request.capture.positions == "generated"

    # the probe and the export over turns; a comparison with a run without tools
    env = {**os.environ, **live_tools.env}
    probe = subprocess.run(
        actq(live_tools, "probe", str(out), "--turns", "all", "--label", "ended"),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert probe.returncode == 0 or "only one class" in probe.stdout, probe.stderr
    export = subprocess.run(
        actq(live_tools, "export", str(out), "--turns", "all"), env=env, capture_output=True, text=True, timeout=300
    )
    assert export.returncode == 0, export.stderr
    import pyarrow.parquet as pq

    table = pq.read_table(out / "export.parquet", columns=["index", "turn", "tool_calls", "job_id"])
    points = len([t for t in samples[0]["activations"]["tensors"] if t["name"] != "token_ids"])
    assert table.num_rows == total_turns * points
    rows = set(zip(*(table.column(c).to_pylist() for c in ("index", "turn", "job_id")), strict=True))
    assert rows == {(s["index"], j["turn"], j["job_id"]) for s in samples for j in s["turn_jobs"]}


def test_probe_versus_compares_a_with_tools_run_with_a_no_tools_run(live_smol, tmp_path):
    """The seed question: the same problems with and without the calculator (the built-in model,
    its tools rendered by the worker's fallback prompt); `actq probe --versus` labels each row with
    its run and probes every capture point for it (first turns: the one that read the question)."""
    env = {**os.environ, **live_smol.env}
    out, plain = tmp_path / "with", tmp_path / "without"
    common = ["--dataset", "samples", "--limit", "6", "--model", SMOL, "--max-tokens", "12", "--download", "--quiet"]
    for where, extra in ((out, ["--mode", "with-tools", "--max-turns", "2"]), (plain, [])):
        done = subprocess.run(
            actq(live_smol, "gsm8k", "--out", str(where), *common, *extra),
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        assert json.loads((where / "summary.json").read_text())["succeeded"] == 6
    versus = subprocess.run(
        actq(live_smol, "probe", str(out), "--versus", str(plain), "--turns", "first", "--folds", "3"),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert versus.returncode == 0, versus.stderr
    report = json.loads((out / "versus-without" / "probes.json").read_text())
    assert report["label"] == "run" and report["n_samples"] == 12, report
    assert report["runs"] == {"with-tools": str(out), "no-tools": str(plain)}
    assert all(p["class_counts"] == {"no-tools": 6, "with-tools": 6} for p in report["probes"])
    # the with-tools prompt holds the tools and the no-tools one does not: at every layer the
    # generation conditioned on it, its tokens' mean, is told apart (its last token alone need not be)
    generated = [p for p in report["probes"] if p["pooling"] == "mean_generated"]
    assert len(generated) == 3 and all(p["balanced_accuracy_mean"] > 0.5 for p in generated), report["probes"]
    assert (out / "versus-without" / "probes.png").is_file()


def test_a_run_killed_mid_trajectory_resumes_at_the_next_turn_without_duplicate_jobs(
    live_tools, tmp_path, redis_client, tool_model_dir
):
    """SIGKILL once some problem's first turn is recorded (its second turn may be queued); the same
    command continues every problem at its next turn: recorded turns are not submitted again, a
    queued one is found again by its idempotency key, and one job per turn exists in the end. Its
    worker runs batches of 4, so the problems' turns end in waves."""
    live_tools.start_worker(
        "tool-b4", {"ACTQ_MODEL": str(tool_model_dir), "ACTQ_MODEL_NAME": "tool-b4", "ACTQ_MAX_BATCH": "4"}
    )
    write_dataset(tmp_path / "problems.jsonl")
    out = tmp_path / "run"
    args = [
        "gsm8k",
        "--out",
        str(out),
        "--dataset",
        str(tmp_path / "problems.jsonl"),
        "--model",
        "tool-b4",
        "--max-tokens",
        "48",
        "--mode",
        "with-tools",
        "--style",
        "bare",
        "--quiet",
    ]
    env = {**os.environ, **live_tools.env}
    before = job_count(redis_client)
    process = subprocess.Popen(actq(live_tools, *args), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not list((out / "trajectories").glob("*.jsonl")) if (out / "trajectories").exists() else True:
        assert time.monotonic() < deadline and process.poll() is None, (
            process.stderr.read() if process.stderr else "slow"
        )
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.communicate()
    recorded = {int(p.stem): trajectory(out, int(p.stem)) for p in (out / "trajectories").glob("*.jsonl")}
    assert recorded and len(list((out / "samples").glob("*.json"))) < N  # stopped mid-way
    queued = json.loads((out / "jobs.json").read_text())

    again = subprocess.run(actq(live_tools, *args), env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    samples = [json.loads((out / "samples" / f"{i}.json").read_text()) for i in range(N)]
    jobs = json.loads((out / "jobs.json").read_text())
    assert all(jobs[key] == job_id for key, job_id in queued.items())  # a queued turn is the same job
    for index, turns in recorded.items():  # recorded turns are kept as they were, and continued
        now = trajectory(out, index)
        assert now[: len(turns)] == turns and [t["turn"] for t in now] == list(range(len(now)))
    total = sum(s["turns"] for s in samples)
    assert job_count(redis_client) - before == total == len(jobs)  # one job per turn, both invocations
    assert {j["job_id"] for s in samples for j in s["turn_jobs"]} == set(jobs.values())
    assert json.loads((out / "summary.json").read_text())["tools"]["turns"] == total
    live_tools.stop_process("worker-tool-b4")


def test_run_file_lines_with_the_calculator_run_the_same_loop(live_tools, tmp_path, redis_client):
    """A prompt file whose lines carry `tools`: each line a conversation, its calls answered, its
    trajectory recorded, its label kept; jobs tagged with the line and the turn."""
    chosen = problems(4, seed=0)
    prompts = tmp_path / "prompts.jsonl"
    lines = [
        {"messages": [{"role": "user", "content": p.question}], "tools": [TOOL], "op": p.expression.split()[1]}
        for p in chosen
    ]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "run"
    args = ["run-file", str(prompts), "--out", str(out), "--model", TOOL_MODEL, "--max-tokens", "48", "--quiet"]
    done = subprocess.run(
        actq(live_tools, *args), env={**os.environ, **live_tools.env}, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["succeeded"] == 4 and summary["settings"]["max_turns"] == 4
    for number, problem in enumerate(chosen):
        sample = json.loads((out / "samples" / f"{number}.json").read_text())
        turns = trajectory(out, number)
        assert sample["labels"] == {"op": problem.expression.split()[1]} and sample["turns"] == len(turns)
        assert sample["text"] == (turns[-1]["text"] if sample["ended"] == "answer" else turns[-1]["content"] or "")
        for turn in turns[:-1]:
            assert [r["content"] for r in turn["tool_results"]] == [
                calculate(json.loads(c["function"]["arguments"]).get("expression")).text for c in turn["tool_calls"]
            ]
    calling = [json.loads((out / "samples" / f"{n}.json").read_text())["tool_calls"] for n in range(4)]
    assert sum(calling) >= 3  # the model calls the calculator for (nearly) every problem
    for key, record in records(redis_client, out).items():
        line, turn = key.split(":turn")
        assert record.request.metadata is not None and record.request.metadata["line"] == line
        assert record.request.metadata["turn"] == turn
