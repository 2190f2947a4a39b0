"""How fast captured activations reach an SAE trainer: `actq export --format saelens` and the
streaming reader (shared/activations.py), on a results directory made here.

`--jobs` jobs (64) of `--rows` rows (2,048) of one capture point `--width` wide (896, float16:
Qwen2-0.5B's residual stream), as `actq gsm8k --download` leaves them (one safetensors file and
one sample file a job). Then, `--runs` times each (medians): the export into windows of
`--context` tokens (rows/s and MB/s of activations, the command's own work: no process start),
and the reader over every row as float32 batches of 4,096, in order and shuffled within a buffer
of 65,536 rows.

    .venv/bin/python bench/bench_sae_data.py [--jobs 64] [--rows 2048] [--width 896] [--context 1024] [--runs 3]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from shared.activations import activations  # noqa: E402
from shared.cli import export  # noqa: E402

POINT = "model.layers.12"


def results_dir(root: Path, jobs: int, rows: int, width: int) -> None:
    (root / "samples").mkdir(parents=True)
    (root / "activations").mkdir()
    generator = torch.Generator().manual_seed(0)
    for i in range(jobs):
        tensor = torch.randn(rows, width, generator=generator).half()
        save_file({POINT: tensor, "token_ids": torch.arange(rows + 1)}, str(root / f"activations/{i}.safetensors"))
        entry = {"name": POINT, "module": POINT, "hook": "output", "shape": [rows, width], "dtype": "float16",
                 "start": 0, "stop": rows}  # fmt: skip
        sample = {"index": i, "status": "succeeded", "job_id": f"job-{i}", "prompt_tokens": rows // 8,
                  "activations": {"tensors": [entry]}, "activations_file": f"activations/{i}.safetensors"}  # fmt: skip
        (root / "samples" / f"{i}.json").write_text(json.dumps(sample))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=64)
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--width", type=int, default=896)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    rows = args.jobs * args.rows
    stored = rows * args.width * 2
    with tempfile.TemporaryDirectory(prefix="actq-bench-sae-", dir=ROOT.parent) as tmp:
        root = Path(tmp) / "run"
        results_dir(root, args.jobs, args.rows, args.width)
        timings: dict[str, list[float]] = {"export": [], "reader, in order": [], "reader, shuffled": []}
        for _ in range(args.runs):
            started = time.perf_counter()
            with contextlib.redirect_stderr(io.StringIO()):  # its one-line report
                export.run(root, format="saelens", saelens={"context": args.context})
            timings["export"].append(time.perf_counter() - started)
            for name, shuffle in (("reader, in order", 0), ("reader, shuffled", 65536)):
                started, seen = time.perf_counter(), 0
                for batch in activations(root, POINT, batch_size=4096, chunk=4096, shuffle=shuffle):
                    seen += len(batch)
                assert seen == rows
                timings[name].append(time.perf_counter() - started)
    print(f"command: {' '.join([sys.executable, *sys.argv])}")
    print(f"{args.jobs} jobs x {args.rows} rows x {args.width} float16 ({stored / 1e6:.0f} MB); medians of {args.runs}")
    for name, seconds in timings.items():
        median = statistics.median(seconds)
        print(f"  {name:<18} {median:6.2f} s  {rows / median:>10,.0f} rows/s  {stored / 1e6 / median:7.0f} MB/s stored")
    return 0


if __name__ == "__main__":
    sys.exit(main())
