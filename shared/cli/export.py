"""Export a results directory's activations as a table (`actq export`).

Reads a results directory written by `actq gsm8k` or `actq run-file` (`samples/<n>.json`; with
`--download` also `activations/<n>.safetensors` and `activations/<n>.<trace>.safetensors`) and
writes one row per (problem or prompt line, source, capture point):

    index, id, labels, source, prompt, messages, question, gold, text, correct, status, job_id,
    prompt_tokens, completion_span, token_ids, point, module, hook, layer, positions, reduce,
    start, stop, row_positions, features, shape, dtype, activations

`id` is a prompt line's id (as text) and `labels` its label fields as a JSON object (text), both
null for GSM8K; `question` and `gold` are null for a prompt file. `prompt` is the prompt's text:
a prompt line's `prompt`, the last user message of a `messages` line (the whole conversation is
`messages`, as JSON text; the chat template's rendering is the worker's and is not repeated here),
a GSM8K problem's question. `token_ids` are the job's tokens (prompt and generated), from the
file's `token_ids` tensor; each row of `activations` is the token `row_positions[i]` of them
(`start` to `stop`; null for a reduced capture, whose one row reduces [start, stop)).

`source` is "generated" (the sample's own generation job) or a trace's name ("gold",
"corrupted", ...); `text` is the completion or the traced assistant text (a prompt file's trace
line: its final assistant turn, null when it has none); `correct` is
`correct.flexible` for "generated" and the trace's own `correct` otherwise. `activations` is the
captured tensor as float32 rows, `list<list<float32>>` of shape [rows, width] (bfloat16 and
float16 captures are widened exactly); `shape` and `dtype` are the stored tensor's. Sources that
did not succeed or have no activations are skipped and counted on stderr.

A tool run (`actq gsm8k --mode with-tools`, run-file lines with `tools`) adds the columns `turn`
(the turn of the problem's conversation, from 0) and `tool_calls` (how many calls that turn made):
its "generated" rows are one per turn's job (`--turns all`, the default), or the first or last
turn's only (`--turns first|last`); `text` is the conversation's answer on every row, the turns'
own texts are in trajectories/<n>.jsonl.

Jobs instead of a results directory: `--jobs` picks the caller's jobs by GET /jobs filters (a
metadata tag, a user, a time) and exports them in submission order as samples of their own, with
the columns `created_at`, `user` and `metadata.<key>` added (export_jobs.py).

Formats: `parquet`, one file (default RESULTS/export.parquet) written a row group per sample, so
that only one sample's tensors are in memory at a time; `hf-dataset`, a `datasets` directory
(default RESULTS/hf-dataset) for `datasets.load_from_disk`. Both read without actq installed.
`saelens` packs every token's rows into windows SAELens reads as cached activations (export_saelens.py).
Activations come from the downloaded files when present, else one tensor at a time through the API,
each request retried through an outage for up to --retry-timeout seconds. When a fetch fails for
good, what was exported so far is kept in a partial file and the same command resumes from it
(export_partial.py).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.errors import ToolError

try:  # the `export` extra (numpy comes with datasets); pyarrow ships no type hints
    import numpy as np
    import pyarrow as pa  # type: ignore[import-untyped]
    import pyarrow.parquet as pq  # type: ignore[import-untyped]
except ImportError as exc:
    raise ToolError("actq export needs pyarrow and datasets: pip install 'actq[export]'") from exc

from shared.cli import export_partial
from shared.cli.export_partial import FetchFailed, Kept
from shared.cli.export_reader import TOKEN_IDS, Reader, next_sample
from shared.cli.probes import point_layer
from shared.result_samples import prompt_of, sources

FORMATS = ("parquet", "hf-dataset", "saelens")
TURNS = ("all", "first", "last")
TURN_COLUMNS = ("turn", "tool_calls")  # a tool run's, after the others
DEFAULT_OUT = {"parquet": "export.parquet", "hf-dataset": "hf-dataset", "saelens": "saelens"}
NOT_CAPTURES = (TOKEN_IDS,)  # in the file, but not a capture point


def _schema(extra: Iterable[str] = ()) -> Any:
    """The columns of every export, then `extra` (--jobs: created_at, a timestamp, and strings)."""
    types = {"created_at": pa.timestamp("us", tz="UTC"), "turn": pa.int64(), "tool_calls": pa.int64()}
    added = [(name, types.get(name, pa.string())) for name in extra]
    return pa.schema(
        [
            ("index", pa.int64()),
            ("id", pa.string()),
            ("labels", pa.string()),
            ("source", pa.string()),
            ("prompt", pa.string()),
            ("messages", pa.string()),
            ("question", pa.string()),
            ("gold", pa.string()),
            ("text", pa.string()),
            ("correct", pa.bool_()),
            ("status", pa.string()),
            ("job_id", pa.string()),
            ("prompt_tokens", pa.int64()),
            ("completion_span", pa.list_(pa.int64())),
            ("token_ids", pa.list_(pa.int64())),
            ("point", pa.string()),
            ("module", pa.string()),
            ("hook", pa.string()),
            ("layer", pa.int64()),
            ("positions", pa.string()),
            ("reduce", pa.string()),
            ("start", pa.int64()),
            ("stop", pa.int64()),
            ("row_positions", pa.list_(pa.int64())),
            ("features", pa.list_(pa.int64())),
            ("shape", pa.list_(pa.int64())),
            ("dtype", pa.string()),
            ("activations", pa.list_(pa.list_(pa.float32()))),
            *added,
        ]
    )


def _sample_paths(results: Path) -> list[Path]:
    paths = sorted(
        (results / "samples").glob("*.json"), key=lambda p: (0, int(p.stem), "") if p.stem.isdigit() else (1, 0, p.stem)
    )
    if not paths:
        raise ToolError(
            f"{results}/samples holds no sample files: is this a results directory of `actq gsm8k` or `actq run-file`?"
        )
    return paths


def _row_positions(entry: dict, tensor: np.ndarray) -> list[int] | None:
    """The token index (into token_ids) of each row: start, start+1, ... (None when reduced, or
    when the manifest does not say)."""
    start, stop = entry.get("start"), entry.get("stop")
    if (entry.get("reduce") or "none") != "none" or start is None or stop is None:
        return None
    rows = tensor.shape[0] if tensor.ndim >= 2 else 1
    return list(range(start, start + rows)) if stop - start == rows else None


def _rows_array(matrix: np.ndarray) -> Any:
    """One `list<list<float32>>` value: the tensor as [rows, width] (one row for a 0-/1-d tensor),
    built on the numpy buffer without a Python list."""
    shape = matrix.shape
    rows = shape[0] if matrix.ndim >= 2 else 1
    width = int(np.prod(shape[1:])) if matrix.ndim >= 2 else int(matrix.size)
    values = pa.array(np.ascontiguousarray(matrix, dtype=np.float32).reshape(-1), type=pa.float32())
    inner = pa.ListArray.from_arrays(pa.array(np.arange(rows + 1, dtype=np.int32) * width, type=pa.int32()), values)
    return pa.ListArray.from_arrays(pa.array(np.array([0, rows], dtype=np.int32), type=pa.int32()), inner)


def _sample_table(sample: dict, sources: list[tuple[str, dict]], reader: Reader, counts: Counter, schema: Any) -> Any:
    """One sample's rows as a pyarrow Table (None when it has none)."""
    columns: dict[str, list] = {field.name: [] for field in schema if field.name != "activations"}
    arrays: list[Any] = []
    for source, fields in sources:
        entries = [t for t in fields["activations"]["tensors"] if t["name"] not in NOT_CAPTURES]
        tensors = reader.read(sample, source, fields, [t["name"] for t in entries])
        token_ids = tensors.get(TOKEN_IDS)
        token_list = None if token_ids is None else [int(t) for t in token_ids.reshape(-1)]
        prompt, messages = prompt_of(sample)
        for entry in entries:
            tensor = tensors[entry["name"]]
            module = entry.get("module") or entry["name"]
            correct = fields.get("correct")
            row = {
                "index": sample.get("index"),
                "id": None if sample.get("id") is None else str(sample["id"]),
                "labels": None if sample.get("labels") is None else json.dumps(sample["labels"], allow_nan=False),
                "source": source,
                "prompt": prompt,
                "messages": messages,
                "question": sample.get("question"),
                "gold": None if sample.get("gold") is None else str(sample["gold"]),
                "text": fields.get("text"),
                "correct": correct if isinstance(correct, bool) else None,
                "status": fields.get("status"),
                "job_id": fields.get("job_id"),
                "prompt_tokens": fields.get("prompt_tokens"),
                "completion_span": fields.get("completion_span"),
                "token_ids": token_list,
                "point": entry["name"],
                "module": module,
                "hook": entry.get("hook"),
                "layer": point_layer(module)[0],
                "positions": entry.get("positions"),
                "reduce": entry.get("reduce") or "none",
                "start": entry.get("start"),
                "stop": entry.get("stop"),
                "row_positions": _row_positions(entry, tensor),
                "features": entry.get("features"),
                "shape": [int(n) for n in tensor.shape],
                "dtype": entry.get("dtype"),
                **sample.get("columns", {}),
                **({k: fields.get(k) for k in TURN_COLUMNS} if "turn" in columns else {}),
            }
            for name, value in row.items():
                columns[name].append(value)
            arrays.append(_rows_array(tensor))
            counts[source] += 1
    if not arrays:
        return None
    data = [
        pa.chunked_array(arrays, type=f.type) if f.name == "activations" else pa.array(columns[f.name], type=f.type)
        for f in schema
    ]
    return pa.Table.from_arrays(data, schema=schema)


class _Stopped(Exception):
    """A fetch failed for good part-way: `reason`, and the samples still to export."""

    def __init__(self, reason: str, missing: int) -> None:
        super().__init__(reason)
        self.reason, self.missing = reason, missing


def _write_parquet(
    samples: Iterable[dict],
    total: int,
    target: Path,
    reader: Reader,
    schema: Any,
    turns: str = "all",
    kept: Kept | None = None,
) -> tuple[int, Counter, Counter]:
    """Write every exportable row of `samples` to `target`, a row group per sample, after the
    rows of a partial export (`kept`); (samples, rows by source, skipped by reason). A fetch that
    fails for good closes `target` whole with what it has and raises `_Stopped`."""
    from tqdm import tqdm  # type: ignore[import-untyped]  # tqdm ships no type hints

    skipped: Counter = Counter()
    counts: Counter = Counter(kept.counts if kept is not None else {})
    exported = kept.samples if kept is not None else 0
    writer = None
    if kept is not None and kept.samples:
        writer = pq.ParquetWriter(str(target), kept.schema(schema))
        kept.copy_into(writer)
    handled = 0
    progress = tqdm(total=total, desc="export", unit="sample", disable=None, file=sys.stderr)
    iterator = iter(samples)
    try:
        while (sample := next_sample(iterator, reader)) is not None:
            own: Counter = Counter()
            table = _sample_table(sample, list(sources(sample, skipped, turns)), reader, own, schema)
            if table is not None:
                if writer is None:
                    writer = pq.ParquetWriter(str(target), schema if kept is None else kept.schema(schema))
                writer.write_table(table)
                exported += 1
                counts += own
            handled += 1
            progress.update(1)
    except FetchFailed as exc:
        raise _Stopped(exc.message, total - handled) from None
    finally:
        progress.close()
        reader.close()
        if writer is not None:
            writer.close()
    if writer is None:
        detail = ", ".join(f"{reason} {n}" for reason, n in sorted(skipped.items())) or "none"
        raise ToolError(f"{reader.results or 'these jobs'}: no sample has activations to export (skipped: {detail})")
    return exported, counts, skipped


def _result_samples(paths: list[Path], done: set | None = None) -> Iterator[dict]:
    for path in paths:
        sample = json.loads(path.read_text())
        sample.setdefault("index", int(path.stem) if path.stem.isdigit() else None)
        if done and sample["index"] in done:
            continue
        yield sample


def _report(exported: int, counts: Counter, skipped: Counter, kept: Kept | None = None) -> None:
    by_source = ", ".join(f"{source} {n}" for source, n in counts.items())
    line = f"exported {sum(counts.values())} rows from {exported} samples ({by_source})"
    if kept is not None and kept.samples:
        line += f", {kept.samples} of them kept from {kept.path} (not fetched again)"
    if skipped:
        line += "; skipped sources: " + ", ".join(f"{reason} {n}" for reason, n in sorted(skipped.items()))
    print(line, file=sys.stderr)


def replace_dataset(staged: Path, out: Path) -> None:
    """Move a finished export into place, replacing an earlier export there."""
    if out.is_dir():
        if any(out.iterdir()) and not (out / "state.json").is_file():
            raise ToolError(f"{out} exists and is not a dataset directory: give another --out")
        shutil.rmtree(out)
    os.replace(staged, out)


def run(
    results: Path | None,
    format: str = "parquet",
    out: Path | None = None,
    api: str | None = None,
    api_key: str | None = None,
    jobs: list[str] | None = None,
    turns: str = "all",
    retry_timeout: float | None = None,
    saelens: dict[str, Any] | None = None,
) -> Path:
    """Export `results`, or the jobs the `jobs` filters pick (export_jobs.py), as `format` to `out`
    (default inside `results`, else in the working directory); returns the path written.
    Activations not downloaded are fetched from `api` (default ACTQ_API_URL) with `api_key`
    (default ACTQ_API_KEY), each request retried for up to `retry_timeout` seconds (default 60).
    When a fetch fails for good, the samples exported so far are kept in a partial file that the
    next run resumes from (export_partial.py); otherwise nothing is left on disk when it fails:
    folders made for `out` are removed again. `turns`: a tool run's turns to export (all, first
    or last). `saelens`: --format saelens's options (export_saelens.py `write`)."""
    if turns not in TURNS:
        raise ToolError(f"--turns {turns!r}: one of {', '.join(TURNS)}")
    if format not in FORMATS:
        raise ToolError(f"unknown export format {format!r} (one of: {', '.join(FORMATS)})")
    if (results is None) == (not jobs):
        raise ToolError("give a results directory or --jobs filters (a metadata tag, a user), one of the two")
    if results is not None:
        results = Path(results)
        if not results.is_dir():
            raise ToolError(f"{results}: no such results directory")
    out = Path(out) if out is not None else (results or Path()) / DEFAULT_OUT[format]
    if format == "parquet" and out.is_dir():
        raise ToolError(f"{out} is a directory: give a file name for the parquet export")
    if format != "parquet" and out.exists() and not out.is_dir():
        raise ToolError(f"{out} exists and is not a directory: give another --out")
    export = export_partial.identity(results, jobs or [], turns)
    with _samples(results, jobs or [], api, api_key, out, export, retry_timeout) as source:  # refused first
        made = [p for p in reversed(out.parent.absolute().parents) if not p.exists()]
        made += [out.parent.absolute()] if not out.parent.exists() else []
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            if format == "saelens":
                from shared.cli import export_saelens

                export_saelens.report(*export_saelens.write(source.samples, source.reader, out, **(saelens or {})))
                return out
            exported, counts, skipped = _export(source, format, out, turns)
        except BaseException:
            for folder in reversed(made):  # the folders made for `out`, deepest first, when still empty
                try:
                    folder.rmdir()
                except OSError:
                    break
            raise
    _report(exported, counts, skipped, source.kept)
    return out


@dataclass
class _Source:
    """What an export reads: its samples (how many), the reader of their tensors, the schema,
    and what a partial export before it kept."""

    samples: Iterable[dict]
    total: int
    reader: Reader
    schema: Any
    kept: Kept


@contextmanager
def _samples(
    results: Path | None,
    jobs: list[str],
    api: str | None,
    api_key: str | None,
    out: Path,
    export: str,
    retry_timeout: float | None = None,
) -> Iterator[_Source]:
    """A results directory's samples, or the picked jobs' (whose reading through the API, here
    and while exporting, fails as one line naming the API), but those a partial export kept."""
    if results is not None:
        paths = _sample_paths(results)
        # a tool run (trajectories/) adds the turn columns
        extra = TURN_COLUMNS if (results / "trajectories").is_dir() else ()
        schema = _schema(extra)
        kept = export_partial.read(out, "index", export, schema)
        total = len(paths) - sum(1 for p in paths if p.stem.isdigit() and int(p.stem) in kept.done)
        reader = Reader(results, api, api_key, retry_seconds=retry_timeout)
        yield _Source(_result_samples(paths, kept.done), total, reader, schema, kept)
        return
    from shared.cli import export_jobs, remote

    params = export_jobs.parse_filters(jobs)
    url, key = remote.resolve(api, api_key)
    seconds = remote.DEFAULT_SECONDS if retry_timeout is None else retry_timeout
    with remote.reaching(url), remote.client(url, key, retry_seconds=seconds) as client:
        summaries = export_jobs.picked(client, params)
        names = export_jobs.columns(summaries)
        schema = _schema(names)
        kept = export_partial.read(out, "job_id", export, schema)
        samples = export_jobs.samples(client, summaries, names, skip=kept.done)
        total = sum(1 for summary in summaries if summary["id"] not in kept.done)
        yield _Source(samples, total, Reader(None, url, key, client=client, url=url), schema, kept)


def _export(source: _Source, format: str, out: Path, turns: str = "all") -> tuple[int, Counter, Counter]:
    kept = source.kept
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
        staged_parquet = Path(tmp) / "export.parquet"
        try:
            exported, counts, skipped = _write_parquet(
                source.samples, source.total, staged_parquet, source.reader, source.schema, turns, kept
            )
        except _Stopped as stop:
            if not staged_parquet.is_file():  # nothing exported, now or before
                raise export_partial.stopped(stop.reason, None, 0, 0, stop.missing) from None
            written = pq.ParquetFile(str(staged_parquet))
            samples = len(set(written.read(columns=[kept.key_column]).column(0).to_pylist()))
            rows = written.metadata.num_rows
            os.replace(staged_parquet, kept.path)
            raise export_partial.stopped(stop.reason, kept.path, samples, rows, stop.missing) from None
        if format == "parquet":
            os.replace(staged_parquet, out)
        else:
            try:
                import datasets  # type: ignore[import-untyped]
            except ImportError as exc:
                raise ToolError("--format hf-dataset needs datasets: pip install 'actq[export]'") from exc

            dataset = datasets.Dataset.from_parquet(str(staged_parquet), cache_dir=str(Path(tmp) / "cache"))
            staged = Path(tmp) / "dataset"
            dataset.save_to_disk(str(staged))
            del dataset
            replace_dataset(staged, out)
    kept.path.unlink(missing_ok=True)  # the export is whole: the partial file is in it
    return exported, counts, skipped
