"""The capture -> probe -> steer -> re-measure loop as a user runs it, against the live stack (tiny
model): a labelled prompt file captured and probed, then run again at two strengths with the
probe's direction added, measured by a probe; and `actq gsm8k --steer` scored by accuracy."""

from __future__ import annotations

import json
import subprocess

import numpy as np
from safetensors.numpy import load_file

from shared import keys
from shared.schemas import JobRecord
from tests.e2e.test_gsm8k import actq, run_env
from tests.support.stack import TINY, job_count


def run(live, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(actq(live, *args), env=run_env(live), capture_output=True, text=True, timeout=300)


def prompt_file(path) -> None:
    lines = []
    for i in range(12):
        topic = "sea" if i % 2 else "city"
        text = ["The waves and the salty breeze", "The traffic and the office towers"][i % 2 == 0]
        lines.append({"prompt": f"{text}, number {i}:", "max_tokens": 6, "topic": topic})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_probe_then_steer_a_prompt_file_and_measure_it_with_a_probe(live, tmp_path, redis_client):
    prompts, probed = tmp_path / "prompts.jsonl", tmp_path / "probed"
    prompt_file(prompts)
    common = ["--model", TINY, "--positions", "all", "--dtype", "float32", "--download", "--quiet"]
    captured = run(live, "run-file", str(prompts), "--out", str(probed), *common)
    assert captured.returncode == 0, captured.stderr
    done = run(live, "probe", str(probed), "--label", "topic", "--folds", "3")
    assert done.returncode == 0, done.stderr
    directions = probed / "probe-directions.safetensors"
    assert "probe-directions.safetensors (each probe's direction, for --steer)" in done.stdout
    vectors = load_file(str(directions))
    assert {"model.layers.1", "model.layers.3"} <= set(vectors)

    # Steer at layer 1 with layer 1's best probe; measure with layer 3's best probe.
    out = tmp_path / "steered"
    steering = [
        *["--steer", str(directions), "--at", "model.layers.1", "--coeff", "0", "--coeff", "8"],
        *["--probe", f"{directions}:model.layers.3"],
    ]
    before = job_count(redis_client)
    sets_before = len(live_vectors(live))
    steered = run(live, "run-file", str(prompts), "--out", str(out), *common, *steering)
    assert steered.returncode == 0, steered.stderr
    assert job_count(redis_client) - before == 24  # 12 lines x 2 strengths
    assert len(live_vectors(live)) == sets_before + 1  # the one tensor uploaded as a set
    report = json.loads((out / "steering.json").read_text())
    assert (out / "steering.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["metric"] == "probe_probability:model.layers.3" and report["module"] == "model.layers.1"
    assert report["direction"]["label"] == "topic" and report["name"] == "model.layers.1"
    rows = {row["coeff"]: row for row in report["strengths"]}
    assert set(rows) == {0.0, 8.0} and all(row["n"] == 12 and row["not_scored"] == 0 for row in rows.values())
    assert all(0.0 <= row["metric"] <= 1.0 for row in rows.values())
    assert rows[0.0]["edited_positions"] == 0 and rows[8.0]["edited_positions"] > 0
    assert rows[8.0]["mean_score"] != rows[0.0]["mean_score"]  # layer 3 sees the edit made at layer 1

    # coefficient 0 is the unsteered run: the same texts and activations as the probed run
    reference = [json.loads(line) for line in (out / "steer" / "coeff=0" / "results.jsonl").read_text().splitlines()]
    original = [json.loads(line) for line in (probed / "results.jsonl").read_text().splitlines()]
    assert [s["text"] for s in reference] == [s["text"] for s in original]
    for mine, theirs in zip(reference, original, strict=True):
        assert "interventions" not in mine
        got = load_file(str(out / "steer" / "coeff=0" / mine["activations_file"]))
        expected = load_file(str(probed / theirs["activations_file"]))
        # batched with other jobs than before: equal within float32 rounding, not bit for bit
        np.testing.assert_allclose(got["model.layers.1"], expected["model.layers.1"], rtol=1e-4, atol=1e-4)
    # the steered jobs carried the edit: in their requests and their results
    vector_id = json.loads((out / "steer" / "run.json").read_text())["vector_id"]
    for sample in (json.loads(line) for line in (out / "steer" / "coeff=8" / "results.jsonl").read_text().splitlines()):
        record = JobRecord.model_validate_json(redis_client.get(keys.job(sample["job_id"])))
        (edit,) = record.request.model_dump()["interventions"]
        assert (edit["module"], edit["op"], edit["coeff"]) == ("model.layers.1", "add", 8.0)
        assert edit["vector"] == {"vector_id": vector_id, "name": "model.layers.1", "row": None}
        (applied,) = sample["interventions"]
        assert applied["total"] > 0 and applied["module"] == "model.layers.1"

    # run again: everything is found, nothing is submitted or uploaded twice
    again = run(live, "run-file", str(prompts), "--out", str(out), *common, *steering)
    assert again.returncode == 0, again.stderr
    assert job_count(redis_client) - before == 24 and len(live_vectors(live)) == sets_before + 1
    assert json.loads((out / "steering.json").read_text())["strengths"] == report["strengths"]

    # a module the model lacks: the API's 422 in one line, nothing written, the upload removed
    bad = tmp_path / "bad"
    refused = run(
        live,
        "run-file",
        str(prompts),
        "--out",
        str(bad),
        *common,
        *steering[:2],
        "--steer-name",
        "model.layers.1",
        "--at",
        "model.nope",
        "--coeff",
        "2",
    )
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "422" in refused.stderr and "model.nope" in refused.stderr
    assert not bad.exists() and len(live_vectors(live)) == sets_before + 1


def live_vectors(live) -> list[dict]:
    with live.client() as http:
        return http.get("/vectors", params={"limit": 1000}).json()


def test_gsm8k_steered_by_a_vector_set_id_scores_each_strength(live, tmp_path, redis_client):
    from safetensors.numpy import save

    with live.client() as http:
        width = next(m for m in http.get("/models").json() if m["name"] == TINY)["hidden_size"]
        direction = np.random.default_rng(0).normal(size=width).astype(np.float32)
        uploaded = http.post("/vectors", content=save({"model.layers.2": direction})).json()
    out = tmp_path / "gsm8k"
    args = ["gsm8k", "--out", str(out), "--dataset", "synthetic", "--limit", "4", "--model", TINY]
    args += ["--max-tokens", "8", "--no-capture", "--quiet", "--steer", uploaded["id"], "--at", "model.layers.2"]
    done = run(live, *args, "--coeff", "0", "--coeff", "-3", "--normalize")
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "steering.json").read_text())
    assert report["metric"] == "accuracy_flexible" and report["vector_id"] == uploaded["id"] and report["normalize"]
    assert [row["coeff"] for row in report["strengths"]] == [-3.0, 0.0]
    for row in report["strengths"]:
        assert row["n"] == 4 and row["metric"] == row["flexible"] and 0 <= row["strict"] <= 1
        summary = json.loads((out / row["dir"] / "summary.json").read_text())
        assert summary["accuracy"] == {"strict": row["strict"], "flexible": row["flexible"]}
    assert report["strengths"][0]["edited_positions"] > 0 and report["strengths"][1]["edited_positions"] == 0
    assert '"coeff": -3.0' in done.stdout and "steering.png" in done.stdout
    assert (out / "steering.png").read_bytes()[:4] == b"\x89PNG"
