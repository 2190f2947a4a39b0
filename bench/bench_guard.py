"""The model guard's cost per nnsight job (worker/nnsight/guard.py): noting the model and the
process before the code (`ModelGuard(...)`) and checking and putting back after (`restore()`),
on a model the code left as it was (the common case: nothing to read again), on the CPU.

Models: the tiny test Llama (built from SmolLM2's tokenizer) and the built-in SmolLM2-135M
(float32, 30 layers). Medians over REPEAT runs, after one warm-up, of the wall time and of the
process's CPU time (all threads: steadier than the wall time on a shared machine); the torch
thread count as the worker would have it (the machine's default unless --threads).

    python bench/bench_guard.py [--repeat 20] [--threads N] [--json out.json]

Run it on another checkout to compare (`PYTHONPATH=/path/to/other python bench/bench_guard.py`):
a guard without the `tokenizer` argument is timed without it.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from shared.settings import Settings  # noqa: E402


def _served(path: Path):
    from worker.batch.served import ServedModel
    from worker.model.loading import load

    return ServedModel(load(Settings(model=str(path), model_name="bench")))


def _time(served, repeat: int) -> dict[str, float]:
    from worker.nnsight.guard import ModelGuard

    kwargs = {"tokenizer": served.tokenizer} if "tokenizer" in inspect.signature(ModelGuard).parameters else {}

    def reload():
        raise AssertionError("nothing was written: nothing to read again")

    note, restore, cpu = [], [], []
    for i in range(repeat + 1):
        began, began_cpu = time.perf_counter(), time.process_time()
        guard = ModelGuard(served.hf, reload, **kwargs)
        noted = time.perf_counter()
        found = guard.restore()
        done, done_cpu = time.perf_counter(), time.process_time()
        assert not found.weights and not getattr(found, "unproven", []), found
        if i:  # the first is a warm-up
            note.append(noted - began)
            restore.append(done - noted)
            cpu.append(done_cpu - began_cpu)
    return {
        "note_ms": round(statistics.median(note) * 1000, 1),
        "restore_ms": round(statistics.median(restore) * 1000, 1),
        "total_ms": round(statistics.median(a + b for a, b in zip(note, restore, strict=True)) * 1000, 1),
        "cpu_ms": round(statistics.median(cpu) * 1000, 1),  # all threads' CPU time: steadier on a shared box
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from tests.support.tiny_model import build
    from worker.model.loading import ensure_smollm2

    smol = ensure_smollm2(Settings().model_cache_dir)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tiny = build(Path(tmp) / "tiny", smol)
        for name, path in (("tiny", tiny), ("smollm2-135m", smol)):
            served = _served(path)
            results[name] = {"parameters": sum(p.numel() for p in served.hf.parameters()), **_time(served, args.repeat)}
            print(f"{name}: {results[name]}", flush=True)
    results["threads"] = torch.get_num_threads()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
