"""`actq gsm8k` and `actq probe` as a user runs them, against the live stack (tiny model)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from shared import keys
from shared.cli.gsm8k import data
from shared.cli.gsm8k.scoring import score
from shared.schemas import JobRecord
from tests.support.stack import TINY, job_count


def actq(live, *args: str) -> list[str]:
    return [sys.executable, "-m", "shared.cli", *args, "--api", live.base_url]


def run_env(live) -> dict:
    return {**os.environ, **live.env}


def kill_after_samples(cmd: list[str], env: dict, out, count: int, timeout: float = 120) -> None:
    """Start a bulk run and SIGKILL it once OUT/samples holds `count` samples."""
    process = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    while len(list((out / "samples").glob("*.json"))) < count if (out / "samples").exists() else True:
        assert time.monotonic() < deadline and process.poll() is None, (
            process.stderr.read() if process.poll() is not None and process.stderr else "slow"
        )
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.communicate()  # reaps it and closes its pipes


def job_records(redis_client, out) -> dict[int, JobRecord]:
    """Problem index -> the job's record as Redis holds it (the request as the API stored it)."""
    jobs = json.loads((out / "jobs.json").read_text())
    return {int(i): JobRecord.model_validate_json(redis_client.get(keys.job(job_id))) for i, job_id in jobs.items()}


def test_a_run_end_to_end_then_probes(live, tmp_path, redis_client):
    out = tmp_path / "run"
    cmd = actq(
        live,
        "gsm8k",
        "--out",
        str(out),
        "--dataset",
        "samples",
        "--model",
        TINY,
        "--max-tokens",
        "8",
        "--download",
        "--quiet",
    )
    done = subprocess.run(cmd, env=run_env(live), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["complete"] and summary["problems"] == summary["finished"] == summary["succeeded"] == 12
    assert set(summary["accuracy"]) == {"strict", "flexible"} and summary["generated_tokens"] == 12 * 8
    lines = (out / "results.jsonl").read_text().splitlines()
    assert [json.loads(line)["index"] for line in lines] == list(range(12))
    sample = json.loads((out / "samples" / "3.json").read_text())
    assert sample["gold"] == "6" and sample["completion"] and sample["completion_tokens"] == 8
    # the sample holds the scorer's verdict on this very completion (what the random model wrote varies)
    assert {k: sample[k] for k in ("extracted", "correct")} == score(sample["completion"], "6")
    # the default capture: the residual preset (each decoder block's output) at blocks spread over
    # the tiny model's 4: spread_layers(4) == [1, 2, 3]
    settings = json.loads((out / "run.json").read_text())["settings"]
    assert settings["capture"] == {
        "preset": "residual",
        "layers": [1, 2, 3],
        "hook": "output",
        "positions": "generated",
        "dtype": "float16",
    }
    names = [t["name"] for t in sample["activations"]["tensors"]]
    assert names == ["model.layers.1", "model.layers.2", "model.layers.3"]
    assert all(
        t["shape"] == [8, 64] and t["dtype"] == "float16" and t["positions"] == "generated"
        for t in sample["activations"]["tensors"]
    )
    assert (out / sample["activations_file"]).is_file()
    # auto picked chat (the tiny model has a chat template): messages as today, no stop
    assert settings["prompt_format"] == "chat"
    record = job_records(redis_client, out)[3]
    assert record.request.prompt is None and record.request.stop == []
    assert [m.model_dump() for m in record.request.messages or []] == data.messages(
        data.load("samples")[3], "zero-shot"
    )

    probe = subprocess.run(
        actq(live, "probe", str(out)), env=run_env(live), capture_output=True, text=True, timeout=300
    )
    assert probe.returncode == 0, probe.stderr
    report = json.loads((out / "probes.json").read_text())
    assert report["n_samples"] == 12 and len(report["probes"]) == 6  # 3 points x 2 poolings
    assert {p["point"] for p in report["probes"]} == set(names)
    assert (out / "probes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_resume_after_a_kill_submits_nothing_twice(live, tmp_path, redis_client, tiny_dir):
    """The run is killed once some problems have finished; the same command finishes the rest and
    submits nothing twice. Its worker runs batches of 4, so the twelve problems end in three
    waves (with larger batches the tiny model ends all twelve at the same step)."""
    live.start_worker("tiny-b4", {"ACTQ_MODEL": str(tiny_dir), "ACTQ_MODEL_NAME": "tiny-b4", "ACTQ_MAX_BATCH": "4"})
    out = tmp_path / "run"
    args = ["gsm8k", "--out", str(out), "--dataset", "samples", "--model", "tiny-b4", "--max-tokens", "120", "--quiet"]
    before = job_count(redis_client)
    kill_after_samples(actq(live, *args), run_env(live), out, 3)
    finished_before = len(list((out / "samples").glob("*.json")))
    assert 3 <= finished_before < 12
    assert len(json.loads((out / "jobs.json").read_text())) == 12  # all were queued before the kill

    second = subprocess.run(actq(live, *args), env=run_env(live), capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    samples = [json.loads(p.read_text()) for p in (out / "samples").glob("*.json")]
    assert sorted(s["index"] for s in samples) == list(range(12))
    assert all(s["status"] == "succeeded" for s in samples)
    assert len({s["job_id"] for s in samples}) == 12
    assert {s["job_id"] for s in samples} == set(json.loads((out / "jobs.json").read_text()).values())
    assert job_count(redis_client) - before == 12  # one job per problem across both invocations

    changed = subprocess.run(
        actq(live, *args[:-1], "--max-tokens", "5", "--quiet"),
        env=run_env(live),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert changed.returncode != 0 and "holds a run with other settings (max_tokens)" in changed.stderr
    live.stop_process("worker-tiny-b4")


def test_ctrl_c_leaves_a_consistent_directory(live, tmp_path, tiny_dir):
    """Ctrl-C mid-run: finished problems keep their samples, the summary says incomplete, and
    the same command resumes to the end. Its worker runs batches of 4 (the twelve problems end in
    three waves: in one batch the tiny model ends all twelve at the same step) and is paused
    around the interrupt so that the run is surely mid-way."""
    model = "tiny-b4c"
    live.start_worker(model, {"ACTQ_MODEL": str(tiny_dir), "ACTQ_MODEL_NAME": model, "ACTQ_MAX_BATCH": "4"})
    out = tmp_path / "run"
    args = ["gsm8k", "--out", str(out), "--dataset", "samples", "--model", model, "--max-tokens", "120", "--quiet"]
    worker = live.processes[f"worker-{model}"].pid
    os.killpg(worker, signal.SIGSTOP)
    try:
        process = subprocess.Popen(
            actq(live, *args), env=run_env(live), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        deadline = time.monotonic() + 120
        while not (out / "jobs.json").exists():  # every problem is queued; none can have run
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.05)
        os.killpg(worker, signal.SIGCONT)
        while not (out / "samples").exists() or not list((out / "samples").glob("*.json")):
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.01)
        os.killpg(worker, signal.SIGSTOP)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:
        os.killpg(worker, signal.SIGCONT)
    assert process.returncode == 130 and "run the same command to resume" in stderr
    summary = json.loads((out / "summary.json").read_text())
    finished = len(list((out / "samples").glob("*.json")))
    assert not summary["complete"] and summary["finished"] == finished and 1 <= finished < 12
    resumed = subprocess.run(actq(live, *args), env=run_env(live), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0 and json.loads((out / "summary.json").read_text())["finished"] == 12
    live.stop_process(f"worker-{model}")


def test_plain_prompt_format_sends_raw_question_answer_prompts(live, tmp_path, redis_client):
    """--prompt-format plain on a model that has a chat template (auto would pick chat): every job
    is a raw "Question: ...\nAnswer:" prompt with the stop string, and the run remembers the format."""
    out = tmp_path / "run"
    args = ["gsm8k", "--out", str(out), "--dataset", "samples", "--model", TINY, "--limit", "3", "--max-tokens", "6"]
    done = subprocess.run(
        actq(live, *args, "--prompt-format", "plain", "--quiet"),
        env=run_env(live),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["complete"] and summary["problems"] == summary["succeeded"] == 3
    assert summary["settings"]["prompt_format"] == "plain"
    problems = data.load("samples")
    records = job_records(redis_client, out)
    assert sorted(records) == [0, 1, 2]
    for index, record in records.items():
        request = record.request
        assert request.messages is None and request.prompt is not None
        assert request.prompt.startswith("Question: ") and request.prompt.endswith("\nAnswer:")
        assert request.prompt == data.plain_prompt(problems[index], "zero-shot")
        assert request.stop == ["\n\nQuestion:"]
        assert record.status == "succeeded" and record.result is not None and record.result.usage.completion_tokens <= 6
        sample = json.loads((out / "samples" / f"{index}.json").read_text())
        assert sample["job_id"] == record.id
        assert [t["name"] for t in sample["activations"]["tensors"]] == [f"model.layers.{i}" for i in (1, 2, 3)]

    # the same directory with another format is another run: refused before anything is queued
    before = job_count(redis_client)
    chat = subprocess.run(
        actq(live, *args, "--prompt-format", "chat", "--quiet"),
        env=run_env(live),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert chat.returncode == 2 and "holds a run with other settings (prompt_format)" in chat.stderr
    assert job_count(redis_client) == before


def test_gold_and_corrupted_traces_then_probes_and_export(live, tmp_path, redis_client):
    """`--capture-on generated,gold,corrupted`: three jobs per problem (one generation, two trace
    jobs over the gold solution and its wrong-answer copy), each problem's sample written once
    all three ended; then `actq probe --source all` on one row per capture, and `actq export` to
    Parquet, read back with pandas."""
    out = tmp_path / "traced"
    cmd = actq(
        live, "gsm8k", "--out", str(out), "--dataset", "synthetic", "--limit", "10", "--model", TINY,
        "--max-tokens", "4", "--capture-on", "generated,gold,corrupted", "--reduce", "mean", "--download", "--quiet",
    )  # fmt: skip
    done = subprocess.run(cmd, env=run_env(live), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    jobs = json.loads((out / "jobs.json").read_text())
    assert sorted(jobs) == sorted(
        [str(i) for i in range(10)] + [f"{i}:{s}" for i in range(10) for s in ("corrupted", "gold")]
    )
    problem = data.load("synthetic")[4]
    sample = json.loads((out / "samples" / "4.json").read_text())
    assert sample["status"] == "succeeded" and sample["completion_tokens"] == 4
    gold, corrupted = sample["traces"]["gold"], sample["traces"]["corrupted"]
    assert gold["correct"] is True and corrupted["correct"] is False and gold["answer"] == problem.gold
    assert gold["text"].endswith(f"The answer is {problem.gold}.") and corrupted["answer"] != problem.gold
    record = JobRecord.model_validate_json(redis_client.get(keys.job(jobs["4:gold"])))
    assert record.request.mode == "trace" and record.request.logprobs and record.request.max_tokens is None
    messages = [m.model_dump() for m in record.request.messages or []]
    assert messages == [*data.messages(problem, "zero-shot"), {"role": "assistant", "content": gold["text"]}]
    start, stop = gold["completion_span"]
    for entry in gold["activations"]["tensors"]:
        assert entry["positions"] == "completion" and entry["reduce"] == "mean" and entry["shape"] == [1, 64]
        assert (entry["start"], entry["stop"]) == (start, stop)
    assert gold["completion_logprob"] < 0 and gold["logprob_total"] < gold["completion_logprob"]
    assert (out / gold["activations_file"]).is_file() and gold["activations_file"].endswith("4.gold.safetensors")

    probe = subprocess.run(
        actq(live, "probe", str(out), "--source", "all"), env=run_env(live), capture_output=True, text=True, timeout=300
    )
    assert probe.returncode == 0, probe.stderr
    report = json.loads((out / "probes.json").read_text())
    assert report["n_samples"] == 30 and report["sources"] == {"generated": 10, "gold": 10, "corrupted": 10}
    assert {p["pooling"] for p in report["probes"]} == {"reduced_mean"} and len(report["probes"]) == 3

    exported = subprocess.run(
        actq(live, "export", str(out), "--format", "parquet"), env=run_env(live), capture_output=True, text=True
    )
    assert exported.returncode == 0, exported.stderr
    import pandas as pd

    table = pd.read_parquet(out / "export.parquet")
    assert len(table) == 10 * 3 * 3  # problems x sources x capture points
    row = table[(table["index"] == 4) & (table["source"] == "gold") & (table["point"] == "model.layers.2")].iloc[0]
    assert bool(row["correct"]) is True and list(row["shape"]) == [1, 64] and row["reduce"] == "mean"


def test_a_capture_the_api_refuses_is_one_line_and_leaves_no_out(live, tmp_path):
    """A typo'd module or a block the model lacks: the API's 422 in one line, before --out exists,
    so the corrected command runs in the same directory (no "holds a run with other settings")."""
    out = tmp_path / "run"
    args = ["gsm8k", "--out", str(out), "--dataset", "samples", "--limit", "2", "--model", TINY, "--max-tokens", "4"]
    for bad in (["--module", "model.layer.1"], ["--layers", "0,99"]):
        done = subprocess.run(actq(live, *args, "--quiet", *bad), env=run_env(live), capture_output=True, text=True)
        assert done.returncode == 2 and "Traceback" not in done.stderr + done.stdout, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and live.base_url in lines[0] and "422" in lines[0], done.stderr
        assert not out.exists()
    done = subprocess.run(actq(live, *args, "--quiet"), env=run_env(live), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["succeeded"] == 2
