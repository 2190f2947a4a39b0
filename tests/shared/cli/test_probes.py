"""Probes on synthetic results directories: no network, no model."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from shared.cli import probes
from shared.errors import ToolError

H = 16
LAYERS = (3, 6, 9)
KINDS = ("input_layernorm", "post_attention_layernorm")
NAMES = [f"model.layers.{layer}.{kind}" for layer in LAYERS for kind in KINDS]


def make_results(root, n=80, signal_layer=6, positions="all", labels=None, files=True, failed=0, seed=0):
    """A results directory like `actq gsm8k --download` writes. Sample i's label is i % 2 == 0 unless
    `labels` is given; a permuted copy goes in `meta.shuffled`. Capture points of `signal_layer` are
    shifted by +/-2 along a fixed direction according to the label; the rest are noise.
    Returns {index: {name: rows}} (what a fetch callable would download)."""
    rng = np.random.default_rng(seed)
    direction = rng.normal(size=H)
    direction /= np.linalg.norm(direction)
    labels = [i % 2 == 0 for i in range(n)] if labels is None else labels
    shuffled = rng.permutation(labels).tolist()
    (root / "samples").mkdir(parents=True)
    (root / "activations").mkdir()
    stored = {}
    for i in range(n + failed):
        prompt, completion = int(rng.integers(10, 21)), int(rng.integers(5, 16))
        total, end = prompt + completion, prompt + completion - 1  # the last token is never run: T - 1 rows
        start, stop = {"all": (0, end), "generated": (prompt - 1, end), "prompt": (0, prompt)}[positions]
        tensors, entries = {"token_ids": rng.integers(0, 1000, size=total).astype(np.int64)}, []
        for name in NAMES:
            rows = rng.normal(size=(stop - start, H))
            if i < n and f".{signal_layer}." in name:
                rows += direction * (2.0 if labels[i] else -2.0)
            tensors[name] = rows.astype(np.float16)
            entries.append(
                {
                    "name": name,
                    "module": name,
                    "hook": "output",
                    "shape": [stop - start, H],
                    "dtype": "float16",
                    "positions": positions,
                    "start": start,
                    "stop": stop,
                    "bytes": (stop - start) * H * 2,
                }
            )
        stored[i] = tensors
        if files:
            save_file(tensors, str(root / "activations" / f"{i}.safetensors"))
        sample = {
            "index": i,
            "question": f"q{i}",
            "gold": "1",
            "completion": "x",
            "extracted": {"strict": None, "flexible": None},
            "correct": {"strict": False, "flexible": labels[i] if i < n else False},
            "meta": {"shuffled": shuffled[i] if i < n else False},
            "job_id": f"job{i}",
            "status": "succeeded" if i < n else "failed",
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "activations": {
                "uri": "s3://b/k",
                "key": "k",
                "sha256": "0",
                "bytes": 0,
                "download_url": None,
                "tensors": entries,
            }
            if i < n
            else None,
            "activations_file": f"activations/{i}.safetensors" if i < n else None,
        }
        (root / "samples" / f"{i}.json").write_text(json.dumps(sample))
    return stored


def by_key(report):
    return {(p["layer"], p["kind"].split(".")[-1], p["pooling"]): p for p in report["probes"]}


@pytest.fixture(scope="module")
def separable(tmp_path_factory):
    root = tmp_path_factory.mktemp("separable")
    make_results(root, n=200, failed=3)
    return root


def test_signal_layer_is_found_and_noise_is_chance(separable):
    report = probes.run(separable)
    assert report["n_samples"] == 200 and report["skipped_samples"] == {"failed": 3}
    found = by_key(report)
    assert len(found) == len(NAMES) * 3  # last, mean_all, mean_generated
    for (layer, kind, _pooling), p in found.items():
        assert p["n"] == 200 and p["class_counts"] == {"false": 100, "true": 100} and p["folds"] == 5
        assert p["majority_accuracy"] == 0.5 and p["majority_balanced_accuracy"] == 0.5
        assert p["kind"] == f"model.layers.*.{kind}" and p["point"] == f"model.layers.{layer}.{kind}"
        if layer == 6:
            assert p["balanced_accuracy_mean"] > 0.9, p
        else:
            assert p["balanced_accuracy_mean"] < 0.7, p
    on_disk = json.loads((separable / "probes.json").read_text())
    assert on_disk["label"] == "answer_correct" and on_disk["probes"] == report["probes"]
    assert (separable / "probes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_shuffled_labels_via_dotted_path_are_chance(separable):
    report = probes.run(separable, label="meta.shuffled")
    assert report["label"] == "meta.shuffled" and len(report["probes"]) == len(NAMES) * 3
    for p in report["probes"]:
        assert p["balanced_accuracy_mean"] < 0.7, p


def test_custom_column_and_missing_label_skipped(tmp_path):
    make_results(tmp_path, n=40)
    for i in range(40):
        path = tmp_path / "samples" / f"{i}.json"
        sample = json.loads(path.read_text())
        if i < 36:
            sample["meta"]["difficulty"] = ["easy", "hard", "medium"][i % 3]
        path.write_text(json.dumps(sample))
    features, labels, meta = probes.load_dataset(tmp_path, label="meta.difficulty")
    assert meta["skipped"] == {"missing_label": 4} and meta["n_samples"] == 36
    assert sorted(set(labels)) == ["easy", "hard", "medium"]
    assert features[(NAMES[0], "last")].shape == (36, H)
    entry = probes.train_probes(features, labels, folds=3)[0]
    assert entry["class_counts"] == {"easy": 12, "hard": 12, "medium": 12}
    assert entry["majority_balanced_accuracy"] == pytest.approx(1 / 3) and entry["folds"] == 3


def test_generated_positions(tmp_path):
    make_results(tmp_path, n=60, positions="generated")
    found = by_key(probes.run(tmp_path))
    assert found[(6, "input_layernorm", "mean_generated")]["balanced_accuracy_mean"] > 0.9
    assert found[(6, "input_layernorm", "last")]["balanced_accuracy_mean"] > 0.9


def test_prompt_positions_have_no_mean_generated(tmp_path):
    make_results(tmp_path, n=20, positions="prompt")
    report = probes.run(tmp_path)
    assert {p["pooling"] for p in report["probes"]} == {"last"}
    assert report["notes"] == [
        "mean_all: not computed for 20 of 20 rows (the capture (positions 'prompt') does not hold every position "
        "of the job's positions); those rows are left out of its probes",
        "mean_generated: not computed for 20 of 20 rows (the capture (positions 'prompt') does not hold every "
        "position of the generated tokens); those rows are left out of its probes",
    ]


def test_pooling_uses_exactly_the_rows_it_names():
    rows = np.arange(30, dtype=np.float16)[:, None].repeat(2, axis=1)  # row i holds position start + i
    job = probes.Job("generated", prompt_tokens=12, completion_tokens=19)  # fed: 12 + 18 = 30 positions
    pooled, refused = probes.pool(rows, 0, job)  # generated: positions 11..29
    assert pooled["mean_generated"] == pytest.approx([20.0, 20.0]) and pooled["last"].tolist() == [29.0, 29.0]
    assert pooled["mean_all"] == pytest.approx([14.5, 14.5]) and refused == {}
    pooled, refused = probes.pool(rows[11:], 11, job, positions="generated")
    assert pooled["mean_generated"] == pytest.approx([20.0, 20.0]) and "mean_all" in refused
    pooled, refused = probes.pool(rows[:12], 0, job, positions="prompt")
    assert set(pooled) == {"last"} and set(refused) == {"mean_all", "mean_generated"}
    pooled, refused = probes.pool(rows[29:], 29, job, positions="last")  # one row is not every generated row
    assert (
        set(pooled) == {"last"} and "does not hold every position of the generated tokens" in refused["mean_generated"]
    )
    trace = probes.Job("trace", prompt_tokens=30, completion_span=(20, 28))
    pooled, refused = probes.pool(rows, 0, trace)
    assert pooled["mean_completion"] == pytest.approx([23.5, 23.5]) and pooled["mean_all"] == pytest.approx(
        [14.5, 14.5]
    )
    pooled, refused = probes.pool(rows[20:28], 20, trace, positions="completion")
    assert pooled["mean_completion"] == pytest.approx([23.5, 23.5]) and set(refused) == {"mean_all"}
    prompt_only = probes.Job("trace", prompt_tokens=30)
    pooled, refused = probes.pool(rows, 0, prompt_only)
    assert set(pooled) == {"last", "mean_all"} and refused["mean_completion"].startswith("no completion")
    assert "mean_generated" not in pooled | refused  # a trace generated nothing


def test_one_class_is_skipped_but_written(tmp_path):
    make_results(tmp_path, n=12, labels=[True] * 12)
    report = probes.run(tmp_path)
    assert report["probes"] and all("one class" in p["skipped"] for p in report["probes"])
    assert json.loads((tmp_path / "probes.json").read_text())["probes"][0]["skipped"]
    assert (tmp_path / "probes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_singleton_class_is_skipped(tmp_path):
    make_results(tmp_path, n=12, labels=[True] * 11 + [False])
    assert all("at least 2" in p["skipped"] for p in probes.run(tmp_path)["probes"])


def test_missing_activations_without_fetch(tmp_path):
    make_results(tmp_path, n=6, files=False)
    with pytest.raises(ToolError, match="--download.*--api"):
        probes.load_dataset(tmp_path)


def test_fetch_is_used_when_files_are_absent(tmp_path):
    stored = make_results(tmp_path, n=30, files=False)
    calls = []

    def fetch(sample, name):
        calls.append((sample["index"], name))
        return stored[sample["index"]][name]

    report = probes.run(tmp_path, fetch=fetch, folds=3)
    assert len(calls) == 30 * len(NAMES) and ("token_ids" not in {n for _, n in calls})
    assert (
        report["n_samples"] == 30 and by_key(report)[(6, "input_layernorm", "last")]["balanced_accuracy_mean"] >= 0.85
    )


def test_bfloat16_files(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file as save_torch

    path = tmp_path / "bf16.safetensors"
    save_torch({"a": torch.arange(6, dtype=torch.bfloat16).reshape(3, 2), "token_ids": torch.arange(3)}, str(path))
    out = probes.read_file(path, ["a"])
    assert out["a"].dtype == np.float32 and out["a"].tolist() == [[0, 1], [2, 3], [4, 5]]


def test_point_layer():
    assert probes.point_layer("model.layers.12.post_attention_layernorm") == (
        12,
        "model.layers.*.post_attention_layernorm",
    )
    assert probes.point_layer("model.layers.3") == (3, "model.layers.*")
    assert probes.point_layer("model.norm") == (None, "model.norm")


def test_a_reduced_capture_is_pooled_as_its_one_row():
    row = np.arange(4, dtype=np.float32)[None, :]
    pooled, refused = probes.pool(row, 3, probes.Job("generated", 4, 1), reduce="mean")
    assert list(pooled) == ["reduced_mean"] and refused == {}


def test_traces_of_one_problem_stay_in_one_fold_and_are_probed_together(tmp_path):
    """Gold and corrupted traces of 40 problems: labels from each trace's `correct`, one row per
    trace, grouped by problem (a probe that only memorised problems would be at chance)."""
    rng = np.random.default_rng(1)
    (tmp_path / "samples").mkdir()
    (tmp_path / "activations").mkdir()
    direction = rng.normal(size=H)
    direction *= 4 / np.linalg.norm(direction)
    for i in range(40):
        sample = {"index": i, "question": f"q{i}", "gold": "1", "status": "succeeded", "job_id": None, "traces": {}}
        base = rng.normal(size=(6, H))  # the problem's own rows, shared by its two traces
        for source, right in (("gold", True), ("corrupted", False)):
            rows = (base + rng.normal(size=(6, H)) * 0.1 + direction * (1.0 if right else -1.0)).astype(np.float32)
            save_file({"model.layers.2": rows}, str(tmp_path / "activations" / f"{i}.{source}.safetensors"))
            entry = {"name": "model.layers.2", "module": "model.layers.2", "hook": "output", "shape": [6, H]}
            entry |= {"dtype": "float32", "positions": "completion", "start": 10, "stop": 16, "bytes": 6 * H * 4}
            sample["traces"][source] = {
                "job_id": f"{i}-{source}",
                "status": "succeeded",
                "correct": right,
                "completion_span": [10, 16],
                "prompt_tokens": 17,
                "activations": {"tensors": [entry]},
                "activations_file": f"activations/{i}.{source}.safetensors",
            }
        (tmp_path / "samples" / f"{i}.json").write_text(json.dumps(sample))
    features, labels, meta = probes.load_dataset(tmp_path, source="all")
    assert meta["n_samples"] == 80 and meta["sources"] == {"gold": 40, "corrupted": 40}
    assert sorted(set(labels)) == ["false", "true"] and meta["groups"][:2] == [0, 0]
    assert set(features) == {("model.layers.2", "last"), ("model.layers.2", "mean_completion")}
    report = probes.run(tmp_path, source="all", folds=5)
    assert report["source"] == "all" and all(p["balanced_accuracy_mean"] > 0.9 for p in report["probes"])
    only_gold = probes.load_dataset(tmp_path, source="gold")[2]
    assert only_gold["n_samples"] == 40 and only_gold["sources"] == {"gold": 40}
    nothing = probes.load_dataset(tmp_path)[2]  # the problems have no job of their own in this run
    assert nothing["n_samples"] == 0 and nothing["skipped"] == {"no_sample_capture": 40}


def _run_file_results(root, rows_of, labels_of, n):
    """A results directory like `actq run-file --download` writes: trace lines (`mode: trace`)
    captured at every position, `labels` holding each line's columns."""
    (root / "samples").mkdir()
    (root / "activations").mkdir()
    for i in range(n):
        rows = rows_of(i).astype(np.float32)
        entry = {"name": "model.layers.1", "module": "model.layers.1", "hook": "output", "shape": list(rows.shape)}
        entry |= {"dtype": "float32", "positions": "all", "start": 0, "stop": len(rows), "bytes": rows.nbytes}
        save_file({"model.layers.1": rows}, str(root / "activations" / f"{i}.safetensors"))
        sample = {"index": i, "id": i, "labels": labels_of(i), "mode": "trace", "job_id": f"j{i}"}
        sample |= {"status": "succeeded", "prompt_tokens": len(rows), "completion_span": None}
        sample |= {"activations": {"tensors": [entry]}, "activations_file": f"activations/{i}.safetensors"}
        (root / "samples" / f"{i}.json").write_text(json.dumps(sample))


def test_group_by_keeps_a_group_in_one_fold(tmp_path):
    """20 authors of 4 lines each; a line's label is its author's, and its rows carry only its
    author's own random direction (no signal shared across authors). Split line by line, a probe
    recognises the authors it saw in training; grouped by author (`--group-by author`) it meets
    only unseen authors and is at chance."""
    rng = np.random.default_rng(3)
    authors = [rng.normal(size=H) * 3 for _ in range(20)]
    _run_file_results(
        tmp_path,
        rows_of=lambda i: authors[i // 4] + rng.normal(size=(5, H)) * 0.3,
        labels_of=lambda i: {"author": f"a{i // 4}", "style": "plain" if (i // 4) % 2 else "ornate"},
        n=80,
    )
    by_line = {p["pooling"]: p for p in probes.run(tmp_path, label="style", folds=4)["probes"]}
    grouped = probes.run(tmp_path, label="style", folds=4, group_by="author")
    assert grouped["group_by"] == "author" and grouped["sources"] == {"trace": 80}
    by_author = {p["pooling"]: p for p in grouped["probes"]}
    assert set(by_line) == set(by_author) == {"last", "mean_all"}  # prompt-only traces: no completion
    assert by_line["mean_all"]["balanced_accuracy_mean"] > 0.9
    assert by_author["mean_all"]["balanced_accuracy_mean"] < 0.75
    with pytest.raises(ToolError, match="--group-by nothing: sample 0 has no such field"):
        probes.run(tmp_path, label="style", group_by="nothing")
