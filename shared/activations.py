"""Captured rows of one capture point as `[batch, width]` tensors, for any trainer: an SAE
(dictionary_learning's `trainSAE` takes the iterator as it is), a probe loop, your own code.

    from shared.activations import activations

    rows = activations("runs/smol", "model.layers.15", batch_size=1024, shuffle=65536, labels=True)
    for batch, labels in rows:                  # one epoch: every row once
        ...                                     # labels: job (an index into rows.jobs), position,
                                                # token_id, generated (bool), as [batch] tensors

A source is a results directory of `actq gsm8k` or `actq run-file` (its downloaded files, read
by range from a memory map; a job whose file was not downloaded is read through the API with
`client`), or jobs (ids or `Job`s) read through the API with `client`: each range of rows is one
`GET /jobs/{id}/activations/{point}?rows=a:b`, which the API reads by range from its disk or S3.
No whole file is loaded: rows are read `chunk` at a time, and at most `shuffle + chunk` rows
are held. `shuffle=0` keeps the order (jobs as listed, positions in order); `shuffle=N` reads the
chunks in a random order and shuffles rows within a buffer of N (a new order each epoch, from
`seed`). `tokens` picks the prompt's rows, the generated ones or all; a capture reduced on the
server (one row per job) has no rows per token and is refused. float16 and bfloat16 rows are
widened exactly to `dtype` (float32; None keeps them as stored).
"""

from __future__ import annotations

import json
import random
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from shared.client import Client
    from shared.client_jobs import Job

TOKENS = ("all", "prompt", "generated")


@dataclass(frozen=True)
class JobRows:
    """One job's rows of the point: positions `start` to `stop` of its tokens (prompt, then
    generated), the prompt's length, and where they are read from."""

    job_id: str | None
    sample: int | None  # the results directory's sample index
    source: str  # "generated", a trace's name ("gold"), or "job" for a job given by id
    start: int
    stop: int
    prompt_tokens: int
    first: int  # the position of the tensor's first row
    file: Path | None  # a downloaded file, else read through the API


class Activations:
    """An iterable of `[batch, width]` tensors (with `labels`: `(tensor, labels)`), one epoch per
    iteration; `jobs` lists where rows come from (a label's `job` indexes it) and `rows` counts them."""

    def __init__(
        self,
        jobs: list[JobRows],
        point: str,
        client: Client | None,
        batch_size: int,
        shuffle: int,
        chunk: int,
        seed: int,
        labels: bool,
        dtype: torch.dtype | None,
    ) -> None:
        self.jobs, self.point, self.client = jobs, point, client
        self.batch_size, self.shuffle, self.chunk, self.seed = batch_size, shuffle, chunk, seed
        self.labels, self.dtype = labels, dtype
        self.rows = sum(job.stop - job.start for job in jobs)
        self.epoch = 0
        self._token_ids: dict[int, Any] = {}

    def __len__(self) -> int:
        """Batches per epoch."""
        return -(-self.rows // self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        import torch

        order = random.Random(self.seed * 1_000_003 + self.epoch)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        self.epoch += 1
        units = [
            (j, a, min(a + self.chunk, job.stop))
            for j, job in enumerate(self.jobs)
            for a in range(job.start, job.stop, self.chunk)
        ]
        if self.shuffle:
            order.shuffle(units)
        # One buffer, reused: chunks are copied in, batches gathered out (copies: a batch never
        # aliases the buffer), what stays moved to its front. Its peak: the buffer and half of it.
        fill = max(self.shuffle, self.batch_size)
        buffer: dict[str, Any] = {}
        count = 0
        for j, a, b in units:
            read = self._read(j, a, b)
            if not buffer:
                size = min(fill + self.chunk, self.rows)  # never more than the epoch's rows
                buffer = {k: v.new_empty((size, *v.shape[1:])) for k, v in read.items()}
            for k, v in read.items():
                buffer[k][count : count + len(v)] = v
            count += b - a
            if count >= fill:
                count = yield from self._drain(buffer, count, generator, keep=self.shuffle // 2)
        if count:
            yield from self._drain(buffer, count, generator, keep=None)

    def _drain(self, buffer: dict[str, Any], count: int, generator: Any, keep: int | None) -> Generator[Any, None, int]:
        """Yield whole batches from the buffer's `count` rows (shuffled when asked) but `keep` of
        them at least, which it moves to the buffer's front; returns how many it left. `keep=None`:
        the epoch's end, every row (its last batch may be short)."""
        import torch

        order = torch.randperm(count, generator=generator) if self.shuffle else torch.arange(count)
        emit = count if keep is None else (count - keep) // self.batch_size * self.batch_size
        for first in range(0, emit, self.batch_size):
            picked = order[first : min(first + self.batch_size, emit)]
            batch = {k: v[picked] for k, v in buffer.items()}
            rows = batch.pop("rows")
            yield (rows, batch) if self.labels else rows
        rest = order[emit:]
        for v in buffer.values():
            v[: len(rest)] = v[rest]
        return len(rest)

    def _read(self, j: int, a: int, b: int) -> dict[str, Any]:
        """Rows at positions a to b of job j (`rows`), and their labels."""
        import torch

        job = self.jobs[j]
        rows = _read_rows(job, self.point, self.client, a - job.first, b - job.first)
        if self.dtype is not None:
            rows = rows.to(self.dtype)
        if not self.labels:  # nothing else to gather and shuffle beside the rows
            return {"rows": rows}
        positions = torch.arange(a, b)
        return {
            "rows": rows,
            "job": torch.full((b - a,), j, dtype=torch.long),
            "position": positions,
            "token_id": self._tokens(j)[a:b],
            "generated": positions >= job.prompt_tokens,
        }

    def _tokens(self, j: int) -> Any:
        """Job j's token ids (read once; the small tensor beside the captures)."""
        if j not in self._token_ids:
            self._token_ids[j] = _read_token_ids(self.jobs[j], self.client)
        return self._token_ids[j]


def _read_rows(job: JobRows, point: str, client: Client | None, a: int, b: int) -> Any:
    if job.file is not None:
        from safetensors import safe_open

        with safe_open(str(job.file), framework="pt") as f:
            return f.get_slice(point)[a:b]
    assert client is not None and job.job_id is not None
    return client.job(job.job_id).tensor(point, rows=(a, b))


def _read_token_ids(job: JobRows, client: Client | None) -> Any:
    if job.file is not None:
        from safetensors import safe_open

        with safe_open(str(job.file), framework="pt") as f:
            return f.get_tensor("token_ids").long().reshape(-1)
    assert client is not None and job.job_id is not None
    return client.job(job.job_id).tensor("token_ids").long().reshape(-1)


def _job_rows(
    entries: list[dict], point: str, tokens: str, where: str, prompt_tokens: Any, base: dict[str, Any]
) -> JobRows:
    """The rows of `point` a manifest's entries say a job holds, within `tokens`."""
    entry = next((e for e in entries if e.get("name") == point), None)
    if entry is None:
        captured = ", ".join(str(e.get("name")) for e in entries if e.get("name") != "token_ids") or "nothing"
        raise ValueError(f"{where}: no capture {point!r} (captured: {captured})")
    if (entry.get("reduce") or "none") != "none" or entry.get("start") is None or len(entry.get("shape") or []) != 2:
        raise ValueError(f"{where}: {point} was reduced on the server (reduce={entry.get('reduce')}): no row per token")
    if not isinstance(prompt_tokens, int):
        raise ValueError(f"{where}: its prompt length is not recorded")
    first = int(entry["start"])
    start, stop = first, first + int(entry["shape"][0])
    if tokens == "prompt":
        stop = min(stop, prompt_tokens)
    elif tokens == "generated":
        start = max(start, prompt_tokens)
    return JobRows(**base, start=start, stop=max(start, stop), prompt_tokens=prompt_tokens, first=first)


def _from_results(results: Path, point: str, tokens: str, client: Client | None) -> list[JobRows]:
    from shared.result_samples import reply_start, sources

    paths = sorted(
        (results / "samples").glob("*.json"),
        key=lambda p: (not p.stem.isdigit(), int(p.stem) if p.stem.isdigit() else 0, p.stem),
    )
    if not paths:
        raise ValueError(
            f"{results}/samples holds no sample files: is this a results directory of actq gsm8k or run-file?"
        )
    from collections import Counter

    jobs = []
    for path in paths:
        sample = json.loads(path.read_text())
        for source, fields in sources(sample, Counter()):
            file = fields.get("activations_file")
            local = results / file if file and (results / file).is_file() else None
            where = f"{path.name} ({source})"
            if local is None and client is None:
                raise ValueError(
                    f"{where}: its activations are not downloaded; give client= to read them through the API"
                )
            boundary = reply_start(fields)
            base = {
                "job_id": fields.get("job_id"),
                "sample": sample.get("index", int(path.stem) if path.stem.isdigit() else None),
                "source": source,
                "file": local,
            }
            jobs.append(_job_rows(fields["activations"]["tensors"], point, tokens, where, boundary, base))
    return jobs


def _from_jobs(given: Iterable[str | Job], point: str, tokens: str, client: Client | None) -> list[JobRows]:
    if client is None:
        raise ValueError("jobs are read through the API: give client=Client(...)")
    jobs = []
    for item in given:
        job = client.job(item) if isinstance(item, str) else item if item.done else item.refresh()
        if job.status != "succeeded" or not job.manifest:
            raise ValueError(f"job {job.id} is {job.status} and has no activations to read")
        result = job.result
        assert result is not None
        span = result.completion_span  # a trace: its traced reply starts there
        boundary = span[0] if span else result.usage.prompt_tokens
        base = {"job_id": job.id, "sample": None, "source": "job", "file": None}
        jobs.append(_job_rows(job.manifest["tensors"], point, tokens, f"job {job.id}", boundary, base))
    return jobs


def activations(
    source: str | Path | Iterable[str | Job],
    point: str,
    *,
    client: Client | None = None,
    batch_size: int = 1024,
    shuffle: int = 0,
    chunk: int = 4096,
    seed: int = 0,
    tokens: str = "all",
    labels: bool = False,
    dtype: torch.dtype | None | str = "float32",
) -> Activations:
    """The rows of capture `point` (a module path, `PATH:input` for an input capture) of a
    results directory or of jobs, as an iterable of `[batch, width]` tensors (module docstring)."""
    import torch

    if tokens not in TOKENS:
        raise ValueError(f"tokens={tokens!r}: one of {', '.join(TOKENS)}")
    for name, value in (("batch_size", batch_size), ("chunk", chunk)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: a positive number of rows")
    if not isinstance(shuffle, int) or shuffle < 0:
        raise ValueError(f"shuffle={shuffle!r}: 0 (in order) or a buffer of rows")
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if isinstance(source, str | Path):
        results = Path(source)
        if not results.is_dir():
            raise ValueError(f"{results}: no such results directory")
        jobs = _from_results(results, point, tokens, client)
    else:
        jobs = _from_jobs(source, point, tokens, client)
    return Activations(jobs, point, client, batch_size, shuffle, chunk, seed, labels, dtype)  # type: ignore[arg-type]
