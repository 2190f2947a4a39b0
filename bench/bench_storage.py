"""What storing and fetching activations costs against the raw operations underneath.

  local write  - actq's write_activations to a LocalStore (safetensors file, sha256, fsync, atomic
                 rename, manifest) vs writing the same safetensors bytes to a file with write+fsync;
  S3 upload    - write_activations to an S3Store (SeaweedFS on loopback: file, sha256, boto3
                 transfer-manager upload, manifest) vs a raw boto3 `upload_file` of the same file;
  single read  - bytes fetched from S3 by GET /jobs/{id}/activations/{name}'s reader, per tensor,
                 against the tensor's bytes + the safetensors header.

Targets: both throughput ratios (actq / raw) >= 0.8; single-tensor reads <= tensor + header + 1%.
Medians over --runs runs, the two sides of each pair run alternately.

    python bench/bench_storage.py [--mb 256] [--runs 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # for tests.s3_server (the SeaweedFS launcher the tests use)

import torch  # noqa: E402
from safetensors.torch import save  # noqa: E402

from shared.schemas import CapturePoint  # noqa: E402
from shared.storage import LocalStore, attempt_prefix, manifest_key  # noqa: E402
from shared.storage.s3 import S3Store  # noqa: E402
from shared.storage.tensors import read_tensor  # noqa: E402
from tests.support.s3_server import ACCESS_KEY, BUCKET, SECRET_KEY, SeaweedS3  # noqa: E402
from worker.batch.generation import CapturedTensor, Generation  # noqa: E402
from worker.results.artifacts import write_activations  # noqa: E402

TARGET_THROUGHPUT = 0.8
TARGET_READ_OVERHEAD = 0.01


def synthetic_generation(total_mb: int) -> Generation:
    """Nine [T, 576] float32 tensors (3 layers x 3 points, as the pipeline benchmark) totalling ~total_mb."""
    rows = max(1, total_mb * (1 << 20) // (9 * 576 * 4))
    generator = torch.Generator().manual_seed(0)
    captured = []
    for layer in (7, 15, 23):
        for suffix in ("", ".input_layernorm", ".post_attention_layernorm"):
            path = f"model.layers.{layer}{suffix}"
            tensor = torch.randn(rows, 576, generator=generator)
            captured.append(
                CapturedTensor(
                    point=CapturePoint(name=path, module=path, hook="output"), tensor=tensor, start=0, stop=rows
                )
            )
    return Generation(
        text="",
        finish_reason="length",
        prompt_tokens=rows - 31,
        completion_tokens=32,
        token_ids=torch.arange(rows + 1),
        captured=captured,
    )


def raw_bytes(generation: Generation) -> bytes:
    tensors = {c.point.name: c.tensor for c in generation.captured}
    tensors["token_ids"] = generation.token_ids
    return save(tensors)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def raw_file_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def actq_write(store: LocalStore | S3Store, job: str, generation: Generation) -> None:
    """actq's own write: file, sha256, manifest, in the folder of the job's first attempt."""
    write_activations(store, job, "bench", None, generation, prefix=attempt_prefix(job, 1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="activation bytes per job, in MiB (default 256)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    generation = synthetic_generation(args.mb)
    data = raw_bytes(generation)
    size = len(data)
    results: dict = {"bytes": size, "runs": args.runs, "command": " ".join([sys.executable, *sys.argv])}
    with tempfile.TemporaryDirectory(prefix="actq-bench-storage-") as tmp:
        root = Path(tmp)
        local = LocalStore(root / "local")
        local_times = {"actq": [], "raw": []}
        for _ in range(args.runs):
            raw_path = local.scratch_dir() / f"raw-{uuid.uuid4()}"
            local_times["raw"].append(timed(lambda raw_path=raw_path: raw_file_write(raw_path, data)))
            raw_path.unlink()  # outside the timing, as the actq side's clean-up below
            job = str(uuid.uuid4())
            local_times["actq"].append(timed(lambda job=job: actq_write(local, job, generation)))
            local.delete_prefix(f"jobs/{job}")

        server = SeaweedS3(root / "s3").start()
        try:
            os.environ.update(
                AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_DEFAULT_REGION="us-east-1"
            )
            s3 = S3Store(BUCKET, "bench", endpoint_url=server.endpoint, region="us-east-1", chunk_bytes=8 << 20)
            raw_client = server.client()
            source = root / "upload.safetensors"
            source.write_bytes(data)
            s3_times = {"actq": [], "raw": []}
            for _ in range(args.runs):
                key = f"raw/{uuid.uuid4()}"
                s3_times["raw"].append(timed(lambda key=key: raw_client.upload_file(str(source), BUCKET, key)))
                raw_client.delete_object(Bucket=BUCKET, Key=key)
                job = str(uuid.uuid4())
                s3_times["actq"].append(timed(lambda job=job: actq_write(s3, job, generation)))
                last_job = job
            reads = []
            manifest = json.loads(s3.read_range(manifest_key(attempt_prefix(last_job, 1)), 0, 1 << 20))
            header = 8 + int.from_bytes(s3.read_range(manifest["key"], 0, 8), "little")
            for info in manifest["tensors"]:
                before = s3.bytes_read
                read_tensor(s3, manifest["key"], info["name"], None)
                reads.append(
                    {
                        "name": info["name"],
                        "tensor_bytes": info["bytes"],
                        "header_bytes": header,
                        "bytes_read": s3.bytes_read - before,
                    }
                )
        finally:
            server.stop()

    def throughput(times: list[float]) -> float:
        return size / statistics.median(times) / (1 << 20)

    report = {}
    for name, times in (("local write", local_times), ("S3 upload", s3_times)):
        ours, raw = throughput(times["actq"]), throughput(times["raw"])
        report[name] = {
            "actq_mib_s": ours,
            "raw_mib_s": raw,
            "ratio": ours / raw,
            "pass": ours / raw >= TARGET_THROUGHPUT,
            "actq_s": times["actq"],
            "raw_s": times["raw"],
        }
    worst = max(r["bytes_read"] / (r["tensor_bytes"] + r["header_bytes"]) for r in reads)
    results.update(report, single_tensor_reads=reads, worst_read_ratio=worst)

    print(f"command: {results['command']}")
    print(f"payload: {size:,} bytes per job (9 float32 tensors + token_ids), {args.runs} runs, medians")
    for name, r in report.items():
        verdict = "PASS" if r["pass"] else "FAIL"
        print(
            f"  {name:<12} actq {r['actq_mib_s']:8.1f} MiB/s   raw {r['raw_mib_s']:8.1f} MiB/s   "
            f"ratio {r['ratio']:.2f} (target >= {TARGET_THROUGHPUT})  {verdict}"
        )
    print(
        f"  single-tensor reads: {len(reads)} tensors, bytes read / (tensor + header) at worst {worst:.4f} "
        f"(target <= {1 + TARGET_READ_OVERHEAD})  {'PASS' if worst <= 1 + TARGET_READ_OVERHEAD else 'FAIL'}"
    )
    print(
        f"    e.g. {reads[0]['name']}: read {reads[0]['bytes_read']:,} = tensor {reads[0]['tensor_bytes']:,} + header {reads[0]['header_bytes']:,}"
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
