"""Ten decoding steps under the torch profiler (CPU and CUDA activity): Hugging Face `generate`
beside each of actq's decoders, on Qwen2-0.5B's shape in bfloat16 (bench/bench_gpu.py's model).

Arms: `generate` (eager, dynamic cache); `compacted`, the decoder of one left-padded timeline
(worker/batch/decoding.py: the engine before slots, still the one of sliding-window models); `slots`, the
persistent batch run eagerly; `graphs`, the persistent batch with each step replayed as a CUDA
graph. Per step it reports the wall time (the device synchronised before and after), the time the
GPU spent in kernels, kernel launches from the host (`cudaLaunchKernel` and kin; a replayed graph
is one `cudaGraphLaunch`), calls that wait for the device (`cudaStreamSynchronize`,
`cudaDeviceSynchronize`, `cudaEventSynchronize`, blocking `cudaMemcpy`), reads of tensor values
into Python (tests/support/host_reads.py) and the host threads that ran operators. `generate`'s
figures are (N+1 tokens - 1 token) / N, as bench/bench_step.py takes them. With --out, each arm's
trace at the first batch size (Chrome format, gzipped) is written there.

    python bench/profile_gpu.py [--batch 1 32] [--steps 10] [--out DIR]
"""

from __future__ import annotations

import argparse
import gzip
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # shared, worker, tests.support

LAUNCHES = {"cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch"}
WAITS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"}


def figures(prof) -> dict[str, float]:
    launches = waits = graphs = 0
    kernel_us = 0.0
    threads = set()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernel_us += event.device_time
            continue
        if event.name in LAUNCHES:
            launches += 1
            graphs += event.name == "cudaGraphLaunch"
        elif event.name in WAITS:
            waits += 1
        if event.name.startswith("aten::"):
            threads.add(event.thread)
    return {
        "launches": launches,
        "graph_launches": graphs,
        "waits": waits,
        "kernel_ms": kernel_us / 1e3,
        "threads": len(threads),
    }


def trace(prof, out: Path | None, name: str) -> None:
    if out is None:
        return
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        with raw.open("rb") as source, gzip.open(out / f"trace-{name}.json.gz", "wb") as target:
            shutil.copyfileobj(source, target)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(run, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def profiled(run):
    from tests.support.host_reads import HostReads

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sync()
    with profile(activities=activities) as prof:
        run()
        sync()
    with HostReads() as reads:
        run()
    sync()
    return prof, reads.count


def generate_arm(served, texts: list[str], steps: int, out: Path | None, name: str) -> dict:
    tokenizer, model = served.tokenizer, served.hf
    tokenizer.padding_side = "left"
    inputs = tokenizer(texts, return_tensors="pt", padding=True).to(served.loaded.device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def run(n: int):
        return lambda: model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=pad)

    with torch.inference_mode():
        for _ in range(2):
            run(steps + 1)()
        wall = (timed(run(steps + 1)) - timed(run(1))) / steps
        long_prof, long_reads = profiled(run(steps + 1))
        short_prof, short_reads = profiled(run(1))
    trace(long_prof, out, name)
    long, short = figures(long_prof), figures(short_prof)
    row = {key: (long[key] - short[key]) / steps for key in long if key != "threads"}
    return {"step_ms": wall * 1e3, **row, "reads": (long_reads - short_reads) / steps, "threads": long["threads"]}


def decoder_arm(make, seqs, steps: int, out: Path | None, name: str) -> dict:
    with torch.inference_mode():
        decoder = make()
        decoder.eos_ids = set()  # a random model: never end early
        try:
            for seq in seqs:
                decoder.admit(seq)
            for _ in range(3):  # the prefill, then warm steps (a graph is captured at its first use)
                decoder.step()

            def run() -> None:
                for _ in range(steps):
                    decoder.step()

            wall = timed(run, repeats=3) / steps
            prof, reads = profiled(run)
        finally:
            decoder.close()
    trace(prof, out, name)
    row = figures(prof)
    per = {key: value / steps for key, value in row.items() if key != "threads"}
    return {"step_ms": wall * 1e3, **per, "reads": reads / steps, "threads": row["threads"]}


def arms(graphs, eager, batch: int, steps: int, gsm8k: Path | None, out: Path | None):
    """(arm, figures) for each arm at `batch` rows, the prompts GSM8K questions."""
    from bench.bench_gpu import chats
    from shared.schemas import JobRequest
    from worker.batch.decoding import Decoder

    conversations = chats(gsm8k, batch)
    texts = [graphs.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]

    def seqs(served):
        requests = [JobRequest.model_validate({"model": "m", "messages": c}) for c in conversations]
        return [served.prepare(request, [], 4 * steps + 8) for request in requests]

    pad = graphs._pad()["pad_token_id"]
    yield "generate", generate_arm(graphs, texts, steps, out, f"generate-{batch}")
    compacted = decoder_arm(
        lambda: Decoder(graphs.hf, graphs.tokenizer, pad), seqs(graphs), steps, out, f"compacted-{batch}"
    )
    yield "compacted", compacted
    yield "slots", decoder_arm(lambda: eager.decoder(batch), seqs(eager), steps, out, f"slots-{batch}")
    yield "graphs", decoder_arm(lambda: graphs.decoder(batch), seqs(graphs), steps, out, f"graphs-{batch}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--gsm8k", type=Path, help="a GSM8K JSONL file to take the questions from (else synthetic)")
    parser.add_argument("--out", type=Path, help="write each arm's Chrome trace here (gzipped)")
    parser.add_argument("--allow-cpu", action="store_true", help="without CUDA, a smoke run on a tiny model")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print("profile_gpu.py needs CUDA (or --allow-cpu for a smoke run)", file=sys.stderr)
        return 2
    from bench.bench_gpu import QWEN2_05B, SMOKE, build_model
    from shared.settings import Settings
    from worker.batch.served import ServedModel
    from worker.model.loading import load

    steps = args.steps
    with tempfile.TemporaryDirectory(prefix="actq-profile-") as tmp:
        device, dtype = ("cuda", "bfloat16") if cuda else ("cpu", "float32")
        folder = build_model(Path(tmp) / "model", QWEN2_05B if cuda else SMOKE, dtype)
        graphs = ServedModel(load(Settings(model=str(folder), model_name="m", device=device, dtype=dtype)))
        graphs.hf.generation_config.eos_token_id = None
        eager = ServedModel(graphs.loaded, cuda_graphs=False)
        name = torch.cuda.get_device_name() if cuda else "CPU (smoke run: the figures mean nothing)"
        print(f"device: {name}; torch {torch.__version__}; {'Qwen2-0.5B shape' if cuda else 'tiny Qwen2'}, {dtype}")
        header = ["arm", "batch", "step_ms", "kernel_ms", "launches", "graph_launches", "waits", "reads", "threads"]
        print("".join(f"{h:>15}" for h in header), flush=True)
        for batch in args.batch:
            out = args.out if batch == args.batch[0] else None  # traces of the first batch size only
            for arm, row in arms(graphs, eager, batch, steps, args.gsm8k, out):
                print(f"{arm:>15}{batch:>15}" + "".join(f"{row[h]:>15.2f}" for h in header[2:]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
