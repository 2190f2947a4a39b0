"""`actq export --format saelens`: captured rows packed into fixed windows that SAELens reads as
cached activations, with every window row traceable to its job and token.

The output is a `datasets.save_to_disk` directory, the layout SAELens's own activation cacher
writes and its `ActivationsStore` reads (`use_cached_activations` with `cached_activations_path`):

  <point>          Array2D(context_size, width): one column per captured point, named by its module
                   path (`model.layers.3`; an input capture `model.layers.3:input`), float16 or
                   float32 as captured, bfloat16 widened exactly to float32
  token_ids        int32 [context_size]: the token each row is at
  actq_job         int32 [context_size]: the row's job, an index into `jobs` of actq-export.json
  actq_position    int32 [context_size]: the row's position in its job's tokens (prompt, then generated)
  actq_generated   int8  [context_size]: 1 generated (a trace's: its traced reply), 0 prompt

Rows are taken in order (samples, then sources, then positions) from the positions that every
exported point captured (a reduced capture has no per-token rows and is not exported), filtered
by `--tokens` (all, prompt, generated), and packed across jobs into windows of `--context-size`,
as SAELens packs its own dataset text. The last window is padded with token id -1, job -1,
position -1 and zero activations: SAELens leaves it out with `exclude_special_tokens=[-1]`.
actq-export.json, inside the directory, holds the columns (module, hook, width, dtype as stored
and as written), the jobs table (job id, sample index, prompt id, source, run label, run id), the
counts and the padding token id. Nothing is published until the export is whole.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from shared.activations import TOKENS  # all, prompt, generated: the reader's choice too
from shared.cli.export_partial import FetchFailed
from shared.cli.export_reader import TOKEN_IDS, Reader, next_sample
from shared.errors import ToolError
from shared.result_samples import reply_start

PAD_TOKEN_ID = -1
META_FILE = "actq-export.json"
DEFAULT_CONTEXT = 128
MAX_CONTEXT = 1 << 16
BATCH_BYTES = 64 << 20  # the activations written to the arrow file at a time
LABELS = ("actq_job", "actq_position", "actq_generated")


@dataclass(frozen=True)
class Column:
    """One exported capture point: a dataset column of `width` features."""

    name: str
    module: str
    hook: str
    width: int
    stored: str  # the dtype in the capture file
    dtype: str  # the dtype written: float16 or float32


@dataclass(frozen=True)
class Job:
    """Where a window row comes from: `actq_job` indexes a list of these."""

    job_id: str | None
    sample: int | None
    id: str | None
    source: str
    run: str | None  # the run label (metadata.run), when the job carried one
    run_id: str | None  # the results directory's run id (run.json)


def _columns(entries: list[dict], tensors: dict[str, np.ndarray], picked: list[str] | None) -> list[Column]:
    """The exportable points of the first source with any: per-token rows (no reduction), 2-d."""
    columns = []
    for entry in entries:
        name = entry["name"]
        if picked is not None and name not in picked:
            continue
        tensor = tensors[name]
        if (entry.get("reduce") or "none") != "none" or tensor.ndim != 2 or entry.get("start") is None:
            if picked is not None:
                raise ToolError(f"--module {name}: its capture has no row per token (reduce or shape); pick another")
            continue
        dtype = "float16" if tensor.dtype == np.float16 else "float32"
        module, hook = entry.get("module") or name, entry.get("hook") or "output"
        columns.append(Column(name, module, hook, tensor.shape[1], str(entry.get("dtype")), dtype))
    if picked is not None:
        missing = sorted(set(picked) - {c.name for c in columns})
        if missing:
            raise ToolError(
                f"--module {', '.join(missing)}: not captured; captured: {', '.join(e['name'] for e in entries)}"
            )
    return columns


class _Windows:
    """Rows packed into windows of `context` and appended to an arrow file a batch at a time."""

    def __init__(self, columns: list[Column], context: int, path: Path) -> None:
        from datasets import Array2D, Features, Sequence, Value  # type: ignore[import-untyped]
        from datasets.arrow_writer import ArrowWriter  # type: ignore[import-untyped]

        self.columns, self.context = columns, context
        features = {c.name: Array2D((context, c.width), c.dtype) for c in columns}
        features[TOKEN_IDS] = Sequence(Value("int32"), length=context)
        features |= {name: Sequence(Value("int32"), length=context) for name in LABELS[:2]}
        features["actq_generated"] = Sequence(Value("int8"), length=context)
        self.writer = ArrowWriter(features=Features(features), path=str(path))
        row_bytes = sum(c.width * np.dtype(c.dtype).itemsize for c in columns)
        self.batch_rows = max(1, BATCH_BYTES // (row_bytes * context)) * context
        self.pending: list[dict[str, np.ndarray]] = []
        self.held = 0
        self.windows = self.rows = self.padding = 0

    def add(self, rows: dict[str, np.ndarray]) -> None:
        count = len(rows[TOKEN_IDS])
        if count:
            self.pending.append(rows)
            self.held += count
            self.rows += count
        if self.held >= self.batch_rows:
            self._write(self.held - self.held % self.context)

    def close(self) -> None:
        if self.held:
            pad = -self.held % self.context
            if pad:
                self.pending.append(self._padding(pad))
                self.held += pad
                self.padding = pad
            self._write(self.held)
        self.writer.finalize()
        self.writer.close()

    def _padding(self, count: int) -> dict[str, np.ndarray]:
        rows: dict[str, np.ndarray] = {c.name: np.zeros((count, c.width), dtype=c.dtype) for c in self.columns}
        rows |= {name: np.full(count, PAD_TOKEN_ID, dtype=np.int32) for name in (TOKEN_IDS, *LABELS[:2])}
        rows["actq_generated"] = np.full(count, PAD_TOKEN_ID, dtype=np.int8)
        return rows

    def _write(self, count: int) -> None:
        """Write the first `count` held rows (a multiple of the context) as windows."""
        joined = {name: np.concatenate([rows[name] for rows in self.pending]) for name in self.pending[0]}
        windows = count // self.context
        batch = {
            name: values[:count].reshape(windows, self.context, *values.shape[1:]) for name, values in joined.items()
        }
        self.writer.write_batch(batch)
        self.windows += windows
        left = {name: values[count:] for name, values in joined.items()}
        self.held -= count
        self.pending = [left] if self.held else []


def _source_rows(
    columns: list[Column], entries: dict[str, dict], tensors: dict[str, np.ndarray], fields: dict, tokens: str, job: int
) -> dict[str, np.ndarray] | str:
    """A source's rows at the positions every column captured, filtered by `tokens`; or why none."""
    token_ids = tensors.get(TOKEN_IDS)
    if token_ids is None:
        return "no token ids in its file"
    for column in columns:
        entry, tensor = entries.get(column.name), tensors.get(column.name)
        if entry is None or tensor is None or (entry.get("reduce") or "none") != "none" or entry.get("start") is None:
            return f"{column.name} not captured per token"
        if tensor.ndim != 2 or tensor.shape[1] != column.width:
            return f"{column.name} has shape {list(tensor.shape)}, not [rows, {column.width}]"
        if tensor.dtype != np.dtype(column.dtype):  # never narrowed: a column holds one dtype as captured
            return f"{column.name} is {tensor.dtype} here, {column.dtype} in the export"
    start = max(int(entries[c.name]["start"]) for c in columns)
    stop = min(int(entries[c.name]["start"]) + tensors[c.name].shape[0] for c in columns)
    boundary = reply_start(fields)
    if boundary is None:
        return "its prompt length is not recorded"
    positions = np.arange(start, max(start, stop), dtype=np.int64)
    positions = positions[positions < len(token_ids)]
    if tokens == "prompt":
        positions = positions[positions < boundary]
    elif tokens == "generated":
        positions = positions[positions >= boundary]
    rows: dict[str, np.ndarray] = {}
    for column in columns:
        first = int(entries[column.name]["start"])
        rows[column.name] = tensors[column.name][positions - first].astype(column.dtype, copy=False)
    rows[TOKEN_IDS] = token_ids.reshape(-1)[positions].astype(np.int32)
    rows["actq_job"] = np.full(len(positions), job, dtype=np.int32)
    rows["actq_position"] = positions.astype(np.int32)
    rows["actq_generated"] = (positions >= boundary).astype(np.int8)
    return rows


def _run_id(results: Path | None) -> str | None:
    try:
        return str(json.loads((results / "run.json").read_text())["run_id"]) if results is not None else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write(
    samples: Iterable[dict],
    reader: Reader,
    out: Path,
    context: int = DEFAULT_CONTEXT,
    tokens: str = "all",
    modules: list[str] | None = None,
) -> tuple[dict, Counter]:
    """Export every sample's captured rows to the dataset directory `out` (replaced when it holds
    an earlier dataset); returns (what actq-export.json says, skipped sources by reason)."""
    from shared.cli.export import replace_dataset
    from shared.result_samples import sources

    if tokens not in TOKENS:
        raise ToolError(f"--tokens {tokens!r}: one of {', '.join(TOKENS)}")
    if not 1 <= context <= MAX_CONTEXT:
        raise ToolError(f"--context-size {context}: give a number of tokens from 1 to {MAX_CONTEXT}")
    if out.exists() and not out.is_dir():
        raise ToolError(f"{out} exists and is not a directory: give another --out")
    run_id = _run_id(reader.results)
    skipped: Counter = Counter()
    jobs: list[Job] = []
    columns: list[Column] | None = None
    windows: _Windows | None = None
    generated = 0
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
        iterator = iter(samples)
        try:
            while (sample := next_sample(iterator, reader)) is not None:
                for source, fields in sources(sample, skipped):
                    entries = {t["name"]: t for t in fields["activations"]["tensors"] if t["name"] != TOKEN_IDS}
                    tensors = reader.read(sample, source, fields, list(entries), native=True)
                    if columns is None:
                        columns = _columns(list(entries.values()), tensors, modules)
                        if not columns:
                            skipped[f"{source}: no per-token capture"] += 1
                            columns = None
                            continue
                        windows = _Windows(columns, context, Path(tmp) / "windows.arrow")
                    assert windows is not None
                    rows = _source_rows(columns, entries, tensors, fields, tokens, len(jobs))
                    if isinstance(rows, str):
                        skipped[f"{source}: {rows}"] += 1
                        continue
                    label = (sample.get("columns") or {}).get("metadata.run")
                    prompt_id = None if sample.get("id") is None else str(sample["id"])
                    jobs.append(Job(fields.get("job_id"), sample.get("index"), prompt_id, source, label, run_id))
                    windows.add(rows)
                    generated += int(rows["actq_generated"].sum())
        except FetchFailed as exc:
            raise ToolError(f"{exc.message}; nothing was written to {out}") from None
        finally:
            reader.close()
        if windows is None or not windows.rows:
            detail = ", ".join(f"{reason} {n}" for reason, n in sorted(skipped.items())) or "none"
            raise ToolError(f"{reader.results or 'these jobs'}: no captured row to export (skipped: {detail})")
        windows.close()
        assert columns is not None
        staged = Path(tmp) / "dataset"
        _save(Path(tmp) / "windows.arrow", staged)
        meta = {
            "format": "saelens cached activations (actq export --format saelens)",
            "context_size": context,
            "tokens": tokens,
            "pad_token_id": PAD_TOKEN_ID,
            "windows": windows.windows,
            "rows": windows.rows,
            "generated_rows": generated,
            "padding_rows": windows.padding,
            "columns": [asdict(c) for c in columns],
            "jobs": [asdict(j) for j in jobs],
        }
        (staged / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
        replace_dataset(staged, out)
    return meta, skipped


def _save(arrow: Path, staged: Path) -> None:
    """The arrow file as a `save_to_disk` directory (shards of at most 1 GB)."""
    import datasets

    dataset = datasets.Dataset.from_file(str(arrow))
    shown = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # the export reports itself in one line
    try:
        dataset.save_to_disk(str(staged), max_shard_size="1GB")
    finally:
        del dataset
        if shown:
            datasets.enable_progress_bars()


def report(meta: dict, skipped: Counter) -> None:
    """The export in one line on stderr: windows, rows by kind, padding, skipped sources."""
    line = (
        f"exported {meta['rows']} rows ({meta['generated_rows']} generated) from {len(meta['jobs'])} sources in "
        f"{meta['windows']} windows of {meta['context_size']} tokens ({', '.join(c['name'] for c in meta['columns'])})"
    )
    if meta["padding_rows"]:
        line += f"; the last window padded with {meta['padding_rows']} rows of token id {PAD_TOKEN_ID}"
    if skipped:
        line += "; skipped sources: " + ", ".join(f"{reason} {n}" for reason, n in sorted(skipped.items()))
    print(line, file=sys.stderr)
