"""`actq export` on a hand-made results directory: no server, no model. The written files are read
back in a separate Python that cannot import actq, as a user of the data would."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from shared.cli import export
from shared.errors import ToolError

W = 6
COLUMNS = [
    "index",
    "id",
    "labels",
    "source",
    "prompt",
    "messages",
    "question",
    "gold",
    "text",
    "correct",
    "status",
    "job_id",
    "prompt_tokens",
    "completion_span",
    "token_ids",
    "point",
    "module",
    "hook",
    "layer",
    "positions",
    "reduce",
    "start",
    "stop",
    "row_positions",
    "features",
    "shape",
    "dtype",
    "activations",
]


def _entry(name, tensor, module=None, hook="output", positions="all", start=0, reduce=None, features=None):
    entry = {
        "name": name,
        "module": module or name,
        "hook": hook,
        "shape": list(tensor.shape),
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "positions": positions,
        "start": start,
        "stop": start + (tensor.shape[0] if reduce is None else 5),
        "bytes": tensor.numel() * tensor.element_size(),
    }
    if reduce is not None:
        entry["reduce"] = reduce
    if features is not None:
        entry["features"] = features
    return entry


def _source(root, file, job_id, captures, files=True):
    """Writes the safetensors file (with token_ids, as the worker does); returns the sample fields
    that describe it: job_id, status, activations (the manifest), activations_file."""
    tensors = {name: tensor for name, tensor, _ in captures}
    tensors["token_ids"] = torch.arange(12, dtype=torch.int64)
    if files:
        (root / file).parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(root / file))
    manifest = {
        "uri": f"file:///store/{job_id}",
        "key": job_id,
        "sha256": "0" * 64,
        "bytes": 0,
        "tensors": [_entry(name, tensor, **kw) for name, tensor, kw in captures],
        "extra": [],
    }
    return {"job_id": job_id, "status": "succeeded", "activations": manifest, "activations_file": file}


def make_results(root, files=True):
    """Three samples as `actq gsm8k --capture-on ...` writes them: 0 generated with two traces, 1 traced
    only (its corrupted trace failed: its gold trace is still exported), 2 failed.
    Returns {(index, source, point): the tensor as float32 nested lists}: what the export must hold."""
    gen = torch.Generator().manual_seed(0)

    def rand(rows, width, dtype):
        return torch.randn(rows, width, generator=gen).to(dtype)

    (root / "samples").mkdir(parents=True)
    expected = {}

    def add(index, source, captures):
        for name, tensor, _ in captures:
            expected[f"{index}|{source}|{name}"] = tensor.float().tolist()
        return captures

    generated0 = add(
        0,
        "generated",
        [
            ("model.layers.1", rand(5, W, torch.float16), {}),
            ("model.layers.2:input", rand(5, W, torch.bfloat16), {"module": "model.layers.2", "hook": "input"}),
        ],
    )
    gold0 = add(
        0,
        "gold",
        [
            ("model.layers.1", rand(1, W, torch.float32), {"positions": "completion", "start": 7, "reduce": "mean"}),
            ("model.norm", rand(3, W, torch.bfloat16), {"positions": "completion", "start": 7}),
        ],
    )
    corrupted0 = add(
        0,
        "corrupted",
        [("model.layers.1", rand(1, 2, torch.float16), {"reduce": "last", "features": [1, 3], "start": 2})],
    )
    gold1 = add(1, "gold", [("model.layers.1", rand(4, W, torch.float16), {})])
    samples = [
        {
            "index": 0,
            "question": "What is 2+3?",
            "gold": "5",
            "completion": "2+3 = 5. The answer is 5.",
            "extracted": {"strict": "5", "flexible": "5"},
            "correct": {"strict": True, "flexible": True},
            **_source(root, "activations/0.safetensors", "job-0", generated0, files),
            "error": None,
            "finish_reason": "stop",
            "prompt_tokens": 7,
            "completion_tokens": 5,
            "traces": {
                "gold": {
                    **_source(root, "activations/0.gold.safetensors", "trace-0-gold", gold0, files),
                    "error": None,
                    "text": "The answer is 5.",
                    "answer": "5",
                    "correct": True,
                    "prompt_tokens": 12,
                    "completion_span": [7, 12],
                    "logprob_total": -3.5,
                    "completion_logprob": -1.25,
                },
                "corrupted": {
                    **_source(root, "activations/0.corrupted.safetensors", "trace-0-corrupted", corrupted0, files),
                    "error": None,
                    "text": "The answer is 6.",
                    "answer": "6",
                    "correct": False,
                    "prompt_tokens": 12,
                    "completion_span": [7, 12],
                    "logprob_total": -9.0,
                    "completion_logprob": -6.5,
                },
            },
        },
        {  # a run of traces only: no generation fields; failed, as one of its traces did
            "index": 1,
            "question": "What is 1+1?",
            "gold": "2",
            "completion": None,
            "correct": None,
            "job_id": None,
            "completion_tokens": None,
            "status": "failed",
            "activations": None,
            "activations_file": None,
            "traces": {
                "gold": {
                    **_source(root, "activations/1.gold.safetensors", "trace-1-gold", gold1, files),
                    "error": None,
                    "text": "The answer is 2.",
                    "answer": "2",
                    "correct": True,
                    "prompt_tokens": 10,
                    "completion_span": [6, 10],
                    "logprob_total": -2.0,
                    "completion_logprob": -0.5,
                },
                "corrupted": {
                    "job_id": "trace-1-corrupted",
                    "status": "failed",
                    "error": {"type": "out_of_memory", "message": "no"},
                    "text": "The answer is 3.",
                    "answer": "3",
                    "correct": False,
                    "prompt_tokens": None,
                    "completion_span": None,
                    "logprob_total": None,
                    "completion_logprob": None,
                    "activations": None,
                    "activations_file": None,
                },
            },
        },
        {
            "index": 2,
            "question": "What is 9-4?",
            "gold": "5",
            "completion": "",
            "extracted": {"strict": None, "flexible": None},
            "correct": {"strict": False, "flexible": False},
            "job_id": "job-2",
            "status": "failed",
            "error": {"type": "timeout", "message": "too slow"},
            "finish_reason": None,
            "prompt_tokens": None,
            "completion_tokens": None,
            "activations": None,
            "activations_file": None,
        },
    ]
    for sample in samples:
        (root / "samples" / f"{sample['index']}.json").write_text(json.dumps(sample))
    return expected


# Run in a fresh interpreter whose imports of actq's packages fail, outside the repository.
READER = textwrap.dedent(
    """
    import sys

    BLOCKED = {"shared", "api", "worker", "tests"}


    class NoActq:
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in BLOCKED:
                raise ImportError(f"{name}: actq is not installed here")
            return None


    sys.meta_path.insert(0, NoActq())
    assert not [m for m in sys.modules if m.partition(".")[0] in BLOCKED]

    import json
    import math

    import datasets
    import pandas

    try:
        import shared  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("shared was importable")

    parquet, dataset_dir, expected_file = sys.argv[1:4]
    expected = json.load(open(expected_file))


    def as_lists(value):
        return [[float(x) for x in row] for row in value]


    def rows_of(records, how):
        out = []
        for record in records:
            key = f"{record['index']}|{record['source']}|{record['point']}"
            assert as_lists(record["activations"]) == expected[key], f"{how}: {key} differs"
            meta = {k: v for k, v in record.items() if k != "activations"}
            for k, v in meta.items():
                if hasattr(v, "tolist"):
                    meta[k] = v.tolist()
                elif isinstance(v, float) and math.isnan(v):
                    meta[k] = None
            out.append(meta)
        return out


    from_disk = datasets.load_from_disk(dataset_dir)
    from_parquet = datasets.load_dataset("parquet", data_files=parquet, split="train")
    frame = pandas.read_parquet(parquet)
    print(
        json.dumps(
            {
                "features": str(from_disk.features["activations"]),
                "load_from_disk": {"columns": from_disk.column_names, "rows": rows_of(from_disk, "load_from_disk")},
                "load_dataset": {"columns": from_parquet.column_names, "rows": rows_of(from_parquet, "load_dataset")},
                "pandas": {"columns": list(frame.columns), "rows": rows_of(frame.to_dict("records"), "pandas")},
            }
        )
    )
    """
)


def read_without_actq(tmp_path, parquet, dataset_dir, expected):
    expected_file = tmp_path / "expected.json"
    expected_file.write_text(json.dumps(expected))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), HF_DATASETS_CACHE=str(tmp_path / "hf" / "datasets"))
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", READER, str(parquet), str(dataset_dir), str(expected_file)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_both_formats_read_back_without_actq(tmp_path, capsys):
    results = tmp_path / "results"
    expected = make_results(results)

    parquet = export.run(results, format="parquet", out=None, api=None)
    report = capsys.readouterr().err
    dataset_dir = export.run(results, format="hf-dataset", out=None, api=None)

    assert parquet == results / "export.parquet" and parquet.is_file()
    assert dataset_dir == results / "hf-dataset" and (dataset_dir / "state.json").is_file()
    assert "exported 6 rows from 2 samples (generated 2, gold 3, corrupted 1)" in report
    assert "generated: failed 1" in report and "corrupted: failed 1" in report
    assert not [p for p in results.iterdir() if p.name.startswith(".")]  # no staging left behind

    read = read_without_actq(tmp_path, parquet, dataset_dir, expected)
    assert read["features"] == "List(List(Value('float32')))"
    for how in ("load_from_disk", "load_dataset", "pandas"):
        assert read[how]["columns"] == COLUMNS, how
        rows = read[how]["rows"]
        keys = [(r["index"], r["source"], r["point"]) for r in rows]
        assert keys == [
            (0, "generated", "model.layers.1"),
            (0, "generated", "model.layers.2:input"),
            (0, "gold", "model.layers.1"),
            (0, "gold", "model.norm"),
            (0, "corrupted", "model.layers.1"),
            (1, "gold", "model.layers.1"),
        ], how
        by_key = dict(zip(keys, rows, strict=True))
        generated = by_key[(0, "generated", "model.layers.2:input")]
        assert generated["text"] == "2+3 = 5. The answer is 5." and generated["correct"] is True
        assert generated["module"] == "model.layers.2" and generated["hook"] == "input" and generated["layer"] == 2
        assert generated["shape"] == [5, W] and generated["dtype"] == "bfloat16" and generated["job_id"] == "job-0"
        assert generated["reduce"] == "none" and generated["completion_span"] is None
        assert generated["prompt_tokens"] == 7 and generated["status"] == "succeeded"
        assert generated["prompt"] == "What is 2+3?" and generated["messages"] is None
        assert generated["token_ids"] == list(range(12)) and generated["row_positions"] == [0, 1, 2, 3, 4]
        assert by_key[(0, "gold", "model.norm")]["row_positions"] == [7, 8, 9]
        gold = by_key[(0, "gold", "model.layers.1")]
        assert gold["reduce"] == "mean" and gold["shape"] == [1, W] and gold["dtype"] == "float32"
        assert gold["start"] == 7 and gold["stop"] == 12 and gold["completion_span"] == [7, 12]
        assert gold["text"] == "The answer is 5." and gold["job_id"] == "trace-0-gold"
        assert gold["row_positions"] is None and gold["prompt"] == "What is 2+3?"  # reduced: one row
        assert by_key[(0, "gold", "model.norm")]["layer"] is None
        corrupted = by_key[(0, "corrupted", "model.layers.1")]
        assert corrupted["correct"] is False and corrupted["features"] == [1, 3] and corrupted["shape"] == [1, 2]
        assert corrupted["dtype"] == "float16" and corrupted["layer"] == 1
        traced_only = by_key[(1, "gold", "model.layers.1")]
        assert traced_only["question"] == "What is 1+1?" and traced_only["gold"] == "2" and traced_only["correct"]


def test_a_prompt_files_rows_carry_the_prompt_token_ids_and_positions(tmp_path):
    """`actq run-file` samples: a prompt line, a chat line and a trace line scoring a reply."""
    import pyarrow.parquet as pq

    results = tmp_path / "results"
    (results / "samples").mkdir(parents=True)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    scored = [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}]
    lines = [
        {"id": "add", "labels": {"topic": "math"}, "prompt": "2 + 2 =", "mode": "generate", "text": " 4"},
        {"id": 1, "labels": {"topic": "chat"}, "messages": chat, "mode": "generate", "text": "Red"},
        {"id": 2, "labels": {"topic": "math"}, "messages": scored, "mode": "trace", "text": ""},
    ]
    for index, line in enumerate(lines):
        capture = [("model.layers.1", torch.randn(3, W), {"start": 4 + index})]
        sample = {"index": index, **line, **_source(results, f"activations/{index}.safetensors", f"j{index}", capture)}
        (results / "samples" / f"{index}.json").write_text(json.dumps(sample))
    rows = pq.read_table(export.run(results)).to_pylist()
    assert [(r["prompt"], r["text"]) for r in rows] == [("2 + 2 =", " 4"), ("Name a colour.", "Red"), ("2+3?", "5")]
    assert rows[0]["messages"] is None and json.loads(rows[1]["messages"]) == chat
    assert json.loads(rows[2]["messages"]) == scored and rows[2]["question"] is None
    assert all(r["token_ids"] == list(range(12)) for r in rows)
    assert [r["row_positions"] for r in rows] == [[4, 5, 6], [5, 6, 7], [6, 7, 8]]
    assert [(r["positions"], r["start"], r["stop"]) for r in rows] == [("all", 4, 7), ("all", 5, 8), ("all", 6, 9)]


def test_export_help_names_run_file_results():
    from shared.cli.app import cli

    shown = CliRunner().invoke(cli, ["export", "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert shown.exit_code == 0 and "actq run-file" in shown.output and "actq gsm8k" in shown.output


def test_explicit_out_and_rerun_replace_earlier_exports(tmp_path):
    results = tmp_path / "results"
    make_results(results)
    target = tmp_path / "out" / "acts.parquet"
    assert export.run(results, format="parquet", out=target, api=None) == target
    assert export.run(results, format="parquet", out=target, api=None) == target
    dataset_dir = tmp_path / "out" / "ds"
    for _ in range(2):
        assert export.run(results, format="hf-dataset", out=dataset_dir, api=None) == dataset_dir
    assert (dataset_dir / "state.json").is_file()
    not_a_dataset = tmp_path / "keep"
    not_a_dataset.mkdir()
    (not_a_dataset / "notes.txt").write_text("mine")
    with pytest.raises(ToolError, match="not a dataset directory"):
        export.run(results, format="hf-dataset", out=not_a_dataset, api=None)
    assert (not_a_dataset / "notes.txt").read_text() == "mine"


def test_activations_not_downloaded_are_fetched_through_the_api(tmp_path, monkeypatch):
    results = tmp_path / "results"
    make_results(results, files=False)
    stored = {}
    for sample_file in (results / "samples").glob("*.json"):
        sample = json.loads(sample_file.read_text())
        for fields in [sample, *(sample.get("traces") or {}).values()]:
            for entry in (fields.get("activations") or {}).get("tensors", []):
                stored[(fields["job_id"], entry["name"])] = torch.full(entry["shape"], 0.5, dtype=torch.bfloat16)
            if (fields.get("activations") or {}).get("tensors"):
                stored[(fields["job_id"], "token_ids")] = torch.arange(3)
    calls = []

    class FakeJob:
        def __init__(self, job_id):
            self.job_id = job_id

        def tensor(self, name):
            calls.append((self.job_id, name))
            return stored[(self.job_id, name)]

    class FakeClient:
        def __init__(self, base_url, api_key=None, timeout=30.0, **_retrying):
            assert base_url == "http://api.test" and api_key == "k"

        def job(self, job_id):
            return FakeJob(job_id)

        def close(self):
            pass

    monkeypatch.setattr("shared.cli.remote.Client", FakeClient)
    out = export.run(results, format="parquet", out=None, api="http://api.test", api_key="k")
    assert sorted(calls) == sorted(stored)
    import pyarrow.parquet as pq

    table = pq.read_table(out)
    assert table.num_rows == 6
    assert table.column("activations").to_pylist()[0] == [[0.5] * W] * 5
    assert table.column("token_ids").to_pylist()[0] == [0, 1, 2]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_activations_neither_downloaded_nor_fetchable(tmp_path, monkeypatch):
    results = tmp_path / "results"
    make_results(results, files=False)
    with pytest.raises(ToolError, match="--download, or give --api") as raised:
        export.run(results, format="parquet", out=None, api=f"http://127.0.0.1:{_closed_port()}")
    assert "sample 0 (generated)" in raised.value.message
    monkeypatch.setenv("ACTQ_API_URL", f"http://127.0.0.1:{_closed_port()}")  # the default API
    with pytest.raises(ToolError, match="fetching them failed: cannot reach the actq API at http://127.0.0.1"):
        export.run(results, format="hf-dataset", out=None, api=None)
    assert not (results / "export.parquet").exists() and not (results / "hf-dataset").exists()
    assert not [p for p in results.iterdir() if p.name.startswith(".")]


def test_unknown_format_and_bad_results(tmp_path):
    results = tmp_path / "results"
    make_results(results)
    with pytest.raises(ToolError, match="unknown export format 'csv'"):
        export.run(results, format="csv", out=None, api=None)
    with pytest.raises(ToolError, match="no sample files"):
        export.run(tmp_path, format="parquet", out=None, api=None)
    with pytest.raises(ToolError, match="no such results directory"):
        export.run(tmp_path / "missing", format="parquet", out=None, api=None)


def test_nothing_to_export(tmp_path):
    results = tmp_path / "results"
    (results / "samples").mkdir(parents=True)
    (results / "samples" / "0.json").write_text(json.dumps({"index": 0, "status": "failed", "job_id": "j"}))
    with pytest.raises(ToolError, match="no sample has activations to export"):
        export.run(results, format="parquet", out=None, api=None)
    assert not (results / "export.parquet").exists()


def test_command_line(tmp_path):
    from shared.cli.app import cli

    results = tmp_path / "results"
    make_results(results)
    done = CliRunner().invoke(
        cli, ["export", str(results), "--format", "parquet", "--out", str(tmp_path / "x.parquet")]
    )
    assert done.exit_code == 0, done.output
    assert f"wrote {tmp_path / 'x.parquet'}" in done.output


def test_jobs_filters_are_checked_before_anything_is_asked(tmp_path):
    from shared.cli.export_jobs import parse_filters

    assert parse_filters(["metadata.run=lmeval1", "user=alice", "created_after=2025-01-31T12:00:00Z"]) == {
        "metadata.run": "lmeval1",
        "user": "alice",
        "created_after": "2025-01-31T12:00:00Z",
    }
    assert parse_filters(["metadata.note=a=b"]) == {"metadata.note": "a=b"}  # the first = splits
    for bad, message in (
        ("run=lmeval1", "is not a job filter: give --jobs metadata.run=lmeval1"),
        ("metadata.=x", "is not a job filter"),
        ("metadata.run", "is not a job filter"),
        ("status=failed", "is not a job filter"),
    ):
        with pytest.raises(ToolError, match=message):
            parse_filters([bad])
    with pytest.raises(ToolError, match="names metadata.run twice"):
        parse_filters(["metadata.run=a", "metadata.run=b"])
    port = _closed_port()  # nothing is asked of the API for a bad filter
    with pytest.raises(ToolError, match="is not a job filter"):
        export.run(None, jobs=["run=x"], api=f"http://127.0.0.1:{port}", out=tmp_path / "x.parquet")
    with pytest.raises(ToolError, match="cannot reach the actq API"):
        export.run(None, jobs=["metadata.run=x"], api=f"http://127.0.0.1:{port}", out=tmp_path / "x.parquet")
    assert list(tmp_path.iterdir()) == []


def test_a_results_directory_or_jobs_one_of_the_two(tmp_path):
    results = tmp_path / "results"
    make_results(results)
    for given in ({"results": None}, {"results": results, "jobs": ["metadata.run=a"]}):
        with pytest.raises(ToolError, match="give a results directory or --jobs filters"):
            export.run(**given)
    from shared.cli.app import cli

    shown = CliRunner().invoke(cli, ["export", "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert "--jobs" in shown.output and "metadata.KEY=VALUE" in shown.output
