"""`actq probe` pools exactly the rows each pooling names, on real runs: a prompt file mixing
generation lines, traces of a reply (with a completion) and prompt-only traces (without one),
captured at every position by the live stack's worker, then captured again reduced by the worker.
Every feature `actq probe` trains on is recomputed here from the raw safetensors files and the
samples' token counts with plain numpy, and the poolings a line cannot have are refused for that
line (noted), never filled in with another pooling's vector."""

from __future__ import annotations

import json
import subprocess

import numpy as np
from safetensors.numpy import load_file

from shared.cli import probes
from tests.e2e.test_gsm8k import actq, run_env
from tests.support.stack import TINY


def lines() -> list[dict]:
    out: list[dict] = []
    for i in range(12):
        kind = ("generate", "reply", "prompt")[i % 3]
        line: dict = {"id": f"l{i}", "sentiment": "pos" if i % 2 else "neg", "kind": kind}
        if kind == "generate":
            line |= {"prompt": f"Say something about the number {i}.", "max_tokens": 4 + i}
        elif kind == "reply":
            reply = "I love it." if i % 2 else "I hate it."
            turns = [{"role": "user", "content": f"Review {i}?"}, {"role": "assistant", "content": reply}]
            line |= {"mode": "trace", "messages": turns}
        else:
            line |= {"mode": "trace", "prompt": f"A {'great' if i % 2 else 'bad'} day number {i}."}
        out.append(line)
    return out


def expected_features(out, samples: list[dict]) -> dict[tuple[str, str], dict[str, np.ndarray]]:
    """(point, pooling) -> {line id: vector}, from the raw files: row i of a capture is position
    start + i; a generation ran prompt + completion - 1 positions, the generated tokens were
    predicted at [prompt - 1, prompt + completion - 1); a trace ran its prompt, its reply is the
    completion span."""
    found: dict[tuple[str, str], dict[str, np.ndarray]] = {}
    for sample in samples:
        tensors = load_file(str(out / sample["activations_file"]))
        for entry in sample["activations"]["tensors"]:
            rows = tensors[entry["name"]].astype(np.float32)
            start, stop = entry["start"], entry["stop"]
            assert rows.shape[0] == (1 if entry.get("reduce", "none") != "none" else stop - start)
            vectors: dict[str, np.ndarray] = {}
            if entry.get("reduce", "none") != "none":
                vectors[f"reduced_{entry['reduce']}"] = rows[0]
            else:
                vectors["last"] = rows[-1]
                p = sample["prompt_tokens"]
                if sample["mode"] == "trace":
                    ran = p
                    if sample["completion_span"]:
                        a, b = sample["completion_span"]
                        vectors["mean_completion"] = rows[a - start : b - start].mean(axis=0)
                else:
                    ran = p + sample["completion_tokens"] - 1
                    vectors["mean_generated"] = rows[p - 1 - start : ran - start].mean(axis=0)
                assert (start, stop) == (0, ran), "captured at every position the job ran"
                vectors["mean_all"] = rows.mean(axis=0)
            for pooling, vector in vectors.items():
                found.setdefault((entry["name"], pooling), {})[sample["id"]] = vector
    return found


def _run(live, tmp_path, name: str, *options: str) -> tuple:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines()))
    out = tmp_path / name
    args = ["run-file", str(prompts), "--out", str(out), "--model", TINY, "--download", "--quiet", *options]
    done = subprocess.run(actq(live, *args), env=run_env(live), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    samples = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [s["status"] for s in samples] == ["succeeded"] * 12
    return out, samples


def test_every_pooling_is_the_mean_of_the_rows_it_names(live, tmp_path):
    out, samples = _run(live, tmp_path, "all-positions", "--positions", "all", "--module", "model.layers.{0,3}")
    kinds = {s["id"]: s["labels"]["kind"] for s in samples}
    assert {s["mode"] for s in samples} == {"generate", "trace"}
    assert all(s["completion_span"] for s in samples if kinds[s["id"]] == "reply")
    assert not any(s["completion_span"] for s in samples if kinds[s["id"]] == "prompt")

    expected = expected_features(out, samples)
    features, labels, meta = probes.load_dataset(out, label="sentiment")
    ids = [samples[i]["id"] for i in range(12)]  # the rows, in line order
    assert meta["n_samples"] == 12 and meta["sources"] == {"generated": 4, "trace": 8}
    assert list(labels) == [s["labels"]["sentiment"] for s in samples]
    assert set(features) == set(expected)
    for key, by_line in expected.items():
        rows = [ids[i] for i in meta["members"][key]]
        assert rows == [i for i in ids if i in by_line], key  # exactly the lines that have this pooling
        np.testing.assert_allclose(features[key], np.stack([by_line[i] for i in rows]), rtol=1e-6, err_msg=str(key))
    for point in ("model.layers.0", "model.layers.3"):
        generated = {ids[i] for i in meta["members"][(point, "mean_generated")]}
        completion = {ids[i] for i in meta["members"][(point, "mean_completion")]}
        assert generated == {i for i, k in kinds.items() if k == "generate"}
        assert completion == {i for i, k in kinds.items() if k == "reply"}
        for sample in samples:  # a mean over several rows is not the last row: nothing was substituted
            many = (sample["completion_tokens"] or 0) > 1 or kinds[sample["id"]] == "reply"
            for pooling in ("mean_generated", "mean_completion"):
                if many and sample["id"] in expected[(point, pooling)]:
                    mean, last = expected[(point, pooling)][sample["id"]], expected[(point, "last")][sample["id"]]
                    assert not np.allclose(mean, last), (point, pooling, sample["id"])

    probe = subprocess.run(
        actq(live, "probe", str(out), "--label", "sentiment", "--folds", "2"),
        env=run_env(live),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert probe.returncode == 0, probe.stderr
    report = json.loads((out / "probes.json").read_text())
    n = {(p["point"], p["pooling"]): p["n"] for p in report["probes"]}
    assert n[("model.layers.3", "last")] == n[("model.layers.3", "mean_all")] == 12
    assert n[("model.layers.3", "mean_generated")] == n[("model.layers.3", "mean_completion")] == 4
    assert report["notes"] == [
        "mean_completion: not computed for 4 of 12 rows (no completion (the trace has no final assistant turn)); "
        "those rows are left out of its probes"
    ]


def test_a_reduced_capture_is_its_one_row(live, tmp_path):
    out, samples = _run(
        live, tmp_path, "reduced", "--positions", "all", "--reduce", "mean", "--module", "model.layers.2"
    )
    expected = expected_features(out, samples)
    assert set(expected) == {("model.layers.2", "reduced_mean")}
    features, _, meta = probes.load_dataset(out, label="sentiment")
    assert set(features) == set(expected) and meta["notes"] == []
    by_line = expected[("model.layers.2", "reduced_mean")]
    np.testing.assert_allclose(
        features[("model.layers.2", "reduced_mean")], np.stack([by_line[s["id"]] for s in samples])
    )
