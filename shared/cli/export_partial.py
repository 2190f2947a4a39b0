"""An export that stopped part-way (`actq export`): what was fetched is kept, and the next run
of the same command goes on from it.

When a fetch through the API fails for good (after the client's retries: an outage longer than
--retry-timeout, a job deleted meanwhile), the export stops there and writes the rows of every
sample exported so far to a partial file beside the output, `<out>.partial.parquet` (for the
default `export.parquet`: `export.partial.parquet`), readable like a finished export. The error
says why it stopped, how many samples are in the partial file, how many are missing, and that
running the same command again resumes: the partial file's samples are copied into the new
export without being fetched again, then the missing ones are fetched; the partial file is
removed once the export is whole.

A partial file records which export it belongs to (the results directory or the --jobs
filters, and --turns) in its Parquet metadata; one from another export is refused, never mixed in.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]

from shared.errors import ToolError

METADATA_KEY = b"actq_export"


class FetchFailed(ToolError):
    """A fetch through the API failed for good; the message says what and why."""


def partial_path(out: Path) -> Path:
    """Where an export to `out` keeps what it fetched when it stops part-way."""
    stem = out.name.removesuffix(".parquet")
    return out.with_name(f"{stem}.partial.parquet")


def identity(results: Path | None, jobs: list[str], turns: str) -> str:
    """What an export is of, as recorded in its partial file."""
    source = {"results": str(results.resolve())} if results is not None else {"jobs": sorted(jobs)}
    return json.dumps({**source, "turns": turns}, sort_keys=True)


@dataclass
class Kept:
    """A partial file's content: its path, the key of each sample in it (`index`, or `job_id`
    for --jobs), its rows by source, and the export it belongs to."""

    path: Path
    key_column: str
    export: str
    done: set = field(default_factory=set)
    counts: Counter = field(default_factory=Counter)

    @property
    def samples(self) -> int:
        return len(self.done)

    def schema(self, schema: Any) -> Any:
        """`schema` marked with the export it belongs to."""
        return schema.with_metadata({**(schema.metadata or {}), METADATA_KEY: self.export.encode()})

    def key(self, sample: dict) -> Any:
        return sample.get(self.key_column)

    def copy_into(self, writer: Any) -> None:
        """Every row group of the partial file into `writer` (the new export's)."""
        if not self.done:
            return
        kept = pq.ParquetFile(str(self.path))
        for group in range(kept.num_row_groups):
            writer.write_table(kept.read_row_group(group))


def read(out: Path, key_column: str, export: str, schema: Any) -> Kept:
    """The partial file of an export to `out` (empty when there is none); a ToolError when it
    belongs to another export, or to an export of other columns."""
    path = partial_path(out)
    kept = Kept(path, key_column, export)
    if not path.is_file():
        return kept
    try:
        found = pq.ParquetFile(str(path))
        recorded = (found.schema_arrow.metadata or {}).get(METADATA_KEY, b"").decode()
        table = found.read(columns=[key_column, "source"])
    except (OSError, pa.ArrowException) as exc:
        raise ToolError(f"{path} is not a partial export this command can resume ({exc}): remove it") from None
    if recorded != export or not found.schema_arrow.remove_metadata().equals(schema.remove_metadata()):
        raise ToolError(f"{path} holds a partial export of something else: remove it, or give another --out")
    kept.done = {key for key in table.column(key_column).to_pylist() if key is not None}
    kept.counts = Counter(table.column("source").to_pylist())
    return kept


def stopped(reason: str, kept: Path | None, samples: int, rows: int, missing: int) -> ToolError:
    """The error of an export that stopped: why, what is kept where, what is missing, how to resume."""
    if kept is None:  # nothing fetched: the reason alone, as before any sample
        return ToolError(reason)
    return ToolError(
        f"{reason}; the {samples} samples exported so far ({rows} rows) are kept in {kept}, {missing} samples are "
        "missing: run the same command again to resume (the kept samples are not fetched again)"
    )
