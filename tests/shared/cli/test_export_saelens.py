"""`actq export --format saelens` on hand-made results directories: no server, no model. The
dataset is read back with `datasets` alone and checked row by row against the tensors written
(SAELens itself reads a real run's export in tests/e2e/test_gsm8k.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from shared.cli import export
from shared.errors import ToolError
from tests.shared.cli.test_export import _entry  # a manifest entry as the worker writes it

W1, W2 = 6, 4


def make_results(root, lengths=((4, 5), (3, 7), (6, 2)), late_input=False):
    """Samples as `actq gsm8k --positions all --download` writes them, one job each, whose tokens
    are `prompt + generated` long: `model.layers.1` (float16, every position), `model.layers.2:input`
    (bfloat16; from the first generated position with `late_input`), and a reduced capture that no
    window can hold. Returns {job id: (token ids, prompt tokens, {point: float32 rows by position})}."""
    gen = torch.Generator().manual_seed(0)
    (root / "samples").mkdir(parents=True)
    (root / "activations").mkdir()
    (root / "run.json").write_text(json.dumps({"run_id": "a" * 32, "settings": {}}))
    truth = {}
    for index, (prompt, generated) in enumerate(lengths):
        total = prompt + generated
        token_ids = torch.randint(0, 1000, (total,), generator=gen)
        start2 = prompt if late_input else 0
        one = torch.randn(total, W1, generator=gen).to(torch.float16)
        two = torch.randn(total - start2, W2, generator=gen).to(torch.bfloat16)
        mean = torch.randn(1, W1, generator=gen)
        file = f"activations/{index}.safetensors"
        save_file({"model.layers.1": one, "model.layers.2:input": two, "model.norm": mean, "token_ids": token_ids},
                  str(root / file))  # fmt: skip
        tensors = [
            _entry("model.layers.1", one),
            _entry("model.layers.2:input", two, module="model.layers.2", hook="input", start=start2),
            _entry("model.norm", mean, reduce="mean"),
            {"name": "token_ids", "shape": [total], "dtype": "int64"},
        ]
        job_id = f"job-{index}"
        sample = {
            "index": index,
            "question": f"q{index}",
            "status": "succeeded",
            "job_id": job_id,
            "prompt_tokens": prompt,
            "completion_tokens": generated,
            "activations": {"tensors": tensors},
            "activations_file": file,
        }
        (root / "samples" / f"{index}.json").write_text(json.dumps(sample))
        rows = {
            "model.layers.1": {p: one[p].float().numpy() for p in range(total)},
            "model.layers.2:input": {start2 + i: two[i].float().numpy() for i in range(total - start2)},
        }
        truth[job_id] = (token_ids.tolist(), prompt, rows)
    return truth


def _read(out):
    """The export as datasets reads it (no actq code): a row per (window, offset)."""
    import datasets

    dataset = datasets.load_from_disk(str(out)).with_format("numpy")
    meta = json.loads((out / "actq-export.json").read_text())
    rows = []
    for window in dataset:
        for offset in range(meta["context_size"]):
            rows.append({name: window[name][offset] for name in dataset.column_names})
    return dataset, meta, rows


def test_every_captured_row_is_in_a_window_once_in_order_with_its_job_and_position(tmp_path):
    truth = make_results(tmp_path / "r")
    out = export.run(tmp_path / "r", format="saelens", saelens={"context": 8})
    assert out == tmp_path / "r" / "saelens"
    dataset, meta, rows = _read(out)
    assert dataset.features["model.layers.1"].shape == (8, W1) and dataset.features["model.layers.1"].dtype == "float16"
    assert dataset.features["model.layers.2:input"].dtype == "float32"  # bfloat16, widened exactly
    assert dataset.features["token_ids"].feature.dtype == "int32"
    assert "model.norm" not in dataset.column_names  # reduced: no row per token
    assert [c["name"] for c in meta["columns"]] == ["model.layers.1", "model.layers.2:input"]
    assert [c["stored"] for c in meta["columns"]] == ["float16", "bfloat16"]
    assert [(j["job_id"], j["sample"], j["run_id"]) for j in meta["jobs"]] == [
        (f"job-{i}", i, "a" * 32) for i in range(3)
    ]
    real = [r for r in rows if r["actq_job"] != -1]
    expected = [(job, p) for job, (ids, _, _) in truth.items() for p in range(len(ids))]
    assert [(meta["jobs"][r["actq_job"]]["job_id"], r["actq_position"]) for r in real] == expected
    for r in real:
        ids, prompt, captured = truth[meta["jobs"][r["actq_job"]]["job_id"]]
        position = int(r["actq_position"])
        assert r["token_ids"] == ids[position] and r["actq_generated"] == (position >= prompt)
        for name, by_position in captured.items():
            assert np.array_equal(r[name].astype(np.float32), by_position[position]), (name, position)
    assert meta["rows"] == len(real) == 27 and meta["generated_rows"] == 5 + 7 + 2
    pad = rows[len(real) :]  # 27 rows: 4 windows of 8, the last holding 5 rows of padding
    assert len(pad) == meta["padding_rows"] == 5 and meta["windows"] == len(dataset) == 4
    assert all(r["token_ids"] == -1 and r["actq_position"] == -1 and r["actq_generated"] == -1 for r in pad)
    assert all(not r["model.layers.1"].any() for r in pad)


@pytest.mark.parametrize("tokens", ["prompt", "generated"])
def test_tokens_picks_the_prompt_or_the_generated_rows(tmp_path, tokens):
    truth = make_results(tmp_path / "r")
    out = export.run(tmp_path / "r", format="saelens", saelens={"context": 4, "tokens": tokens})
    _, meta, rows = _read(out)
    real = [r for r in rows if r["actq_job"] != -1]
    expected = [
        (job, p)
        for job, (ids, prompt, _) in truth.items()
        for p in range(len(ids))
        if (p >= prompt) == (tokens == "generated")
    ]
    assert [(meta["jobs"][r["actq_job"]]["job_id"], r["actq_position"]) for r in real] == expected
    assert meta["tokens"] == tokens


def test_only_positions_every_point_captured_and_the_points_picked(tmp_path):
    """`model.layers.2:input` from the first generated token on: with both points, the prompt rows
    are left out; `--module model.layers.1` alone keeps them."""
    truth = make_results(tmp_path / "r", late_input=True)
    _, meta, rows = _read(export.run(tmp_path / "r", format="saelens", saelens={"context": 5}))
    positions = [(meta["jobs"][r["actq_job"]]["job_id"], r["actq_position"]) for r in rows if r["actq_job"] != -1]
    assert positions == [(job, p) for job, (ids, prompt, _) in truth.items() for p in range(prompt, len(ids))]
    out = tmp_path / "one"
    export.run(tmp_path / "r", format="saelens", out=out, saelens={"context": 5, "modules": ["model.layers.1"]})
    dataset, meta, rows = _read(out)
    assert [c["name"] for c in meta["columns"]] == ["model.layers.1"] and "model.layers.2:input" not in dataset.features
    assert meta["rows"] == sum(len(ids) for ids, _, _ in truth.values())


def test_bad_options_are_refused_before_anything_is_written(tmp_path):
    make_results(tmp_path / "r")
    cases = [
        ({"context": 0}, "--context-size 0"),
        ({"tokens": "some"}, "--tokens 'some'"),
        ({"modules": ["model.layers.9"]}, "model.layers.9: not captured; captured: model.layers.1"),
        ({"modules": ["model.norm"]}, "model.norm: its capture has no row per token"),
    ]
    for options, message in cases:
        with pytest.raises(ToolError, match=message.replace("(", r"\(").replace(".", r"\.")):
            export.run(tmp_path / "r", format="saelens", saelens=options)
        assert not (tmp_path / "r" / "saelens").exists()
        assert not [p for p in (tmp_path / "r").iterdir() if p.name.startswith(".saelens")]
    (tmp_path / "file").write_text("x")
    with pytest.raises(ToolError, match="not a directory"):
        export.run(tmp_path / "r", format="saelens", out=tmp_path / "file")


def test_a_rerun_replaces_the_dataset_and_the_command_line_says_what_it_wrote(tmp_path):
    from shared.cli.app import cli

    make_results(tmp_path / "r")
    args = ["export", str(tmp_path / "r"), "--format", "saelens", "--context-size", "16", "--tokens", "generated"]
    for _ in range(2):
        done = CliRunner().invoke(cli, args)
        assert done.exit_code == 0, done.output
        assert "exported 14 rows (14 generated) from 3 sources in 1 windows of 16 tokens" in done.output
        assert "padded with 2 rows of token id -1" in done.output
    assert json.loads((tmp_path / "r" / "saelens" / "actq-export.json").read_text())["windows"] == 1


def test_nothing_per_token_to_export(tmp_path):
    make_results(tmp_path / "r")
    for path in (tmp_path / "r" / "samples").iterdir():
        sample = json.loads(path.read_text())
        sample["activations"]["tensors"] = [t for t in sample["activations"]["tensors"] if t["name"] == "model.norm"]
        path.write_text(json.dumps(sample))
    with pytest.raises(ToolError, match="no captured row to export .skipped: generated: no per-token capture 3"):
        export.run(tmp_path / "r", format="saelens")


def test_a_traces_reply_is_its_completion_span(tmp_path):
    """A trace job generates nothing: its prompt_tokens count the whole text and its reply is its
    completion span, which is what actq_generated marks (and --tokens generated keeps)."""
    truth = make_results(tmp_path / "r", lengths=[(4, 5)])
    path = tmp_path / "r" / "samples" / "0.json"
    sample = json.loads(path.read_text())
    trace = {k: sample.pop(k) for k in ("status", "job_id", "activations", "activations_file")}
    sample |= {"job_id": None, "status": "succeeded", "activations": None}
    sample["traces"] = {"gold": {**trace, "prompt_tokens": 9, "completion_span": [6, 9]}}
    path.write_text(json.dumps(sample))
    _, meta, rows = _read(export.run(tmp_path / "r", format="saelens", saelens={"context": 9}))
    assert [(j["job_id"], j["source"]) for j in meta["jobs"]] == [("job-0", "gold")]
    assert [int(r["actq_generated"]) for r in rows] == [0] * 6 + [1] * 3
    _, meta, rows = _read(export.run(tmp_path / "r", format="saelens", saelens={"context": 3, "tokens": "generated"}))
    assert [int(r["actq_position"]) for r in rows] == [6, 7, 8] and len(truth["job-0"][0]) == 9


def test_a_job_captured_in_another_dtype_is_skipped_not_narrowed(tmp_path, capsys):
    truth = make_results(tmp_path / "r")
    path = tmp_path / "r" / "activations" / "1.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.1"] = tensors["model.layers.1"].float()  # float32 where the others are float16
    save_file(tensors, str(path))
    _, meta, rows = _read(export.run(tmp_path / "r", format="saelens", saelens={"context": 4}))
    assert [j["job_id"] for j in meta["jobs"]] == ["job-0", "job-2"]
    assert meta["rows"] == len(truth["job-0"][0]) + len(truth["job-2"][0])
    assert (
        "skipped sources: generated: model.layers.1 is float32 here, float16 in the export 1" in capsys.readouterr().err
    )
