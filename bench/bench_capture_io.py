"""Capture writes against the disk's own rate, and against S3's, in one run.

Two shapes of capture, each written by actq (worker/results/artifacts.py `write_activations`: the
safetensors file from the job's capture arena, each tensor's sha256 and the file's, fsync, the
atomic rename into the job's attempt folder, the manifest) and, side by side, as the raw bytes:

  small   --small-jobs jobs (256) as a bulk run of the tiny model writes them: 55 modules at 63
          generated positions (widths 64 and 128, float32: 1.2 MB a job), column ranges of one
          arena per job, written by --threads threads (the worker's store pool) through the
          worker's encoder gate
  large   --large-jobs jobs (2) capturing every layer's residual stream at every position of a
          Qwen2-0.5B-shaped model (24 layers x 2,048 positions x 896, float16: 88 MB a job)

The disk: the same bytes per job written with one `write` and an `fsync` into one file, on the
same file system (the local store's), by the same number of threads. S3 (SeaweedFS on loopback,
the tests' server): actq's `write_activations` to an S3Store against boto3's `upload_file` of the
same bytes. Reported as MB/s and as a fraction of the raw rate (medians of --runs, the sides
alternating), with each side's CPU seconds (this process: user + system).

    .venv/bin/python bench/bench_capture_io.py [--runs 3] [--small-jobs 256] [--large-jobs 2]
                                               [--threads 8] [--no-s3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.support.s3_server, from a checkout

import torch  # noqa: E402
from safetensors.torch import save  # noqa: E402

from shared.schemas import CapturePoint  # noqa: E402
from shared.storage import LocalStore, attempt_prefix  # noqa: E402
from shared.storage.s3 import S3Store  # noqa: E402
from worker.batch.generation import CapturedTensor, Generation  # noqa: E402
from worker.results.artifacts import ENCODERS, write_activations  # noqa: E402

SMALL_WIDTHS = [64] * 35 + [128] * 20  # the tiny Llama's 55 output-capturable modules but lm_head


def generation(widths: list[int], rows: int, dtype: torch.dtype, seed: int) -> Generation:
    """A finished job's capture: one arena [rows, sum(widths)], each module a column range of it."""
    arena = torch.randn(rows, sum(widths), generator=torch.Generator().manual_seed(seed)).to(dtype)
    captured, offset = [], 0
    for i, width in enumerate(widths):
        path = f"model.layers.{i}"
        point = CapturePoint(name=path, module=path, hook="output")
        captured.append(CapturedTensor(point=point, tensor=arena[:, offset : offset + width], start=0, stop=rows))
        offset += width
    return Generation(
        text="", finish_reason="length", prompt_tokens=rows // 2, completion_tokens=rows - rows // 2,
        token_ids=torch.arange(rows + 1), captured=captured,
    )  # fmt: skip


def raw_bytes(job: Generation) -> bytes:
    tensors = {c.point.name: c.tensor.contiguous() for c in job.captured}
    tensors["token_ids"] = job.token_ids
    return save(tensors)


def cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


def measure(run: Callable[[int], None], jobs: int, threads: int) -> tuple[float, float]:
    """(seconds, CPU seconds) to run `run(i)` for every job on `threads` threads."""
    started, spent = time.perf_counter(), cpu()
    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(run, range(jobs)))
    return time.perf_counter() - started, cpu() - spent


def disk_write(folder: Path, data: bytes) -> Callable[[int], None]:
    def run(i: int) -> None:
        path = folder / f"raw-{uuid.uuid4().hex}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)

    return run


def actq_write(store: LocalStore | S3Store, jobs: list[Generation], tag: str) -> Callable[[int], None]:
    def run(i: int) -> None:
        job = f"{tag}-{uuid.uuid4().hex}"
        write_activations(store, job, "bench", None, jobs[i % len(jobs)], prefix=attempt_prefix(job, 1))

    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--small-jobs", type=int, default=256)
    parser.add_argument("--large-jobs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=8, help="writing threads (the worker's store pool)")
    parser.add_argument("--no-s3", action="store_true", help="skip the S3 side (no SeaweedFS binary)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    shapes = {
        "small": ([generation(SMALL_WIDTHS, 63, torch.float32, seed) for seed in range(8)], args.small_jobs),
        "large": ([generation([896] * 24, 2048, torch.float16, 0)], args.large_jobs),
    }
    results: dict = {"command": " ".join([sys.executable, *sys.argv]), "encoders": ENCODERS, "threads": args.threads}
    with tempfile.TemporaryDirectory(prefix="actq-bench-capture-io-", dir=ROOT.parent) as tmp:
        root = Path(tmp)
        stores: dict[str, tuple[LocalStore | S3Store, Callable[[bytes], Callable[[int], None]]]] = {}
        local = LocalStore(root / "local")
        stores["disk"] = (local, lambda data: disk_write(local.scratch_dir(), data))
        server = None
        if not args.no_s3:
            from tests.support.s3_server import ACCESS_KEY, BUCKET, SECRET_KEY, SeaweedS3

            server = SeaweedS3(root / "s3").start()
            os.environ.update(
                AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_DEFAULT_REGION="us-east-1"
            )
            s3 = S3Store(BUCKET, "bench", endpoint_url=server.endpoint, region="us-east-1", chunk_bytes=8 << 20)
            client = server.client()
            source = root / "upload.safetensors"

            def s3_raw(data: bytes) -> Callable[[int], None]:
                source.write_bytes(data)
                return lambda i: client.upload_file(str(source), BUCKET, f"raw/{uuid.uuid4().hex}")

            stores["S3"] = (s3, s3_raw)
        try:
            for where, (store, raw_side) in stores.items():
                for shape, (jobs, count) in shapes.items():
                    data = raw_bytes(jobs[0])
                    raw = raw_side(data)
                    ours = actq_write(store, jobs, shape)
                    threads = args.threads if shape == "small" else 1
                    runs: dict[str, list[tuple[float, float]]] = {"actq": [], "raw": []}
                    for _ in range(args.runs):
                        runs["raw"].append(measure(raw, count, threads))
                        runs["actq"].append(measure(ours, count, threads))
                    total = len(data) * count
                    row = {side: {"mb_s": total / 1e6 / statistics.median(s for s, _ in r),
                                  "cpu_s": statistics.median(c for _, c in r), "runs": r} for side, r in runs.items()}  # fmt: skip
                    row |= {"bytes_per_job": len(data), "jobs": count, "threads": threads}
                    row["ratio"] = row["actq"]["mb_s"] / row["raw"]["mb_s"]
                    results[f"{where} {shape}"] = row
                    if isinstance(store, LocalStore):
                        store.delete_prefix("jobs")
        finally:
            if server is not None:
                server.stop()
    print(f"command: {results['command']}")
    print(f"encoders (files encoded at once): {ENCODERS}; {os.cpu_count()} cores; medians of {args.runs} runs")
    print(f"{'':<14}{'per job':>10}{'jobs':>6}{'threads':>8}{'actq MB/s':>11}{'raw MB/s':>10}{'ratio':>7}"
          f"{'actq CPU s':>12}{'raw CPU s':>11}")  # fmt: skip
    for name, row in results.items():
        if not isinstance(row, dict):
            continue
        print(
            f"{name:<14}{row['bytes_per_job'] / 1e6:>8.1f}MB{row['jobs']:>6}{row['threads']:>8}"
            f"{row['actq']['mb_s']:>11.1f}{row['raw']['mb_s']:>10.1f}{row['ratio']:>7.2f}"
            f"{row['actq']['cpu_s']:>12.2f}{row['raw']['cpu_s']:>11.2f}"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
