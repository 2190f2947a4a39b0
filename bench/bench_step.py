"""What one decoding step of the engine costs, beside Hugging Face `generate`'s own step.

Arms: `generate`; `compacted`, the decoder of one left-padded timeline that models with sliding
windows keep (worker/batch/decoding.py); `slots`, the persistent batch in slots (worker/batch/slot_decoding.py).
On a model whose compute is nearly free (a random Llama, 4 layers, hidden 64), a step's time is
the engine's own work: the part a GPU does not speed up. Per step, for batch sizes and numbers of
capture points, it reports the mean wall time, the host
synchronisations (reads of a tensor's values into Python: `.item()`, `int(t)`, `bool(t)`,
`.tolist()`; on a GPU each waits for the device), the copies (`aten::copy_`), the gathers of
captured rows out of the model's values (`aten::index_select`: one per captured (module, hook)
per step, each followed on a GPU by one non-blocking copy to the host) and all operator calls.
Times are means over `--steps` steps (captured rows reach the jobs every 32 steps), `generate`'s
as (N tokens - 1 token) / (N - 1). Counts come from the torch profiler, host reads from a torch
function mode (tests/support/host_reads.py).

    .venv/bin/python bench/bench_step.py                      # CPU, the tiny model
    .venv/bin/python bench/bench_step.py --device cuda --dtype bfloat16 --hidden 896 --layers 24
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support, from a checkout

SYNC = "aten::_local_scalar_dense"
COPY = "aten::copy_"


def build_model(folder: Path, hidden: int, layers: int) -> Path:
    from shared.settings import Settings
    from tests.support.tiny_model import build
    from worker.model.loading import ensure_smollm2

    smol = ensure_smollm2(Settings().model_cache_dir)
    if hidden == 64:
        return build(folder, smol, num_hidden_layers=layers, max_position_embeddings=4096)
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(smol, local_files_only=True)
    heads = max(1, hidden // 64)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        vocab_size=len(tokenizer),
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def counts(prof) -> tuple[int, int, int]:
    syncs = copies = ops = 0
    for event in prof.key_averages():
        if not event.key.startswith("aten::"):
            continue
        ops += event.count
        if event.key == SYNC:
            syncs += event.count
        elif event.key == COPY:
            copies += event.count
    return syncs, copies, ops


def prompts(batch: int) -> list[str]:
    return [
        f"Question {i}: a farmer has {i + 3} cows and buys {2 * i + 1} more. How many cows now?" for i in range(batch)
    ]


def engine_arm(
    served, batch: int, points: int, steps: int, sample: bool, compacted: bool = False, edits: int = 0
) -> dict:
    from shared.capture_spec import resolve
    from shared.intervention_check import resolve as resolve_edits
    from shared.schemas import CaptureSpec, JobRequest
    from tests.support.host_reads import HostReads

    modules = [m.path for m in served.info.modules if m.output_dim is not None and m.all_positions][:points]
    spec = CaptureSpec(modules=modules, positions="generated") if points else None
    fields = {"temperature": 0.8, "seed": 1} if sample else {}
    layers = served.info.num_layers
    width = served.info.hidden_size
    edited = [
        {"module": f"model.layers.{(i * layers) // max(1, edits)}", "op": "add", "vector": [0.01] * width}
        for i in range(edits)
    ]
    seqs = []
    for text in prompts(batch):
        request = JobRequest(
            model="m",
            messages=[{"role": "user", "content": text}],
            capture=spec,
            interventions=edited or None,
            **fields,
        )
        n = 3 * steps + 4
        points_of = resolve(spec, served.info) if spec else []
        edit_points = resolve_edits(request.interventions, served.info, False, n) if edited else None
        seqs.append(served.prepare(request, points_of, n, None, edit_points))
    with torch.inference_mode():
        if compacted:  # the decoder before slots (still the one of sliding-window models)
            from worker.batch.decoding import Decoder

            decoder = Decoder(served.hf, served.tokenizer, served._pad()["pad_token_id"])
        else:
            decoder = served.decoder(batch)
        decoder.eos_ids = set()  # a random model: never end early
        try:
            for seq in seqs:
                decoder.admit(seq)
            decoder.step()  # warm
            started = time.perf_counter()
            for _ in range(steps):
                decoder.step()
            elapsed = time.perf_counter() - started  # a mean: work done every few steps counts in full
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(steps):
                    decoder.step()
            with HostReads() as reads:
                for _ in range(steps):
                    decoder.step()
        finally:
            decoder.close()
    _, copies, ops = counts(prof)
    gathers = sum(e.count for e in prof.key_averages() if e.key == "aten::index_select")
    return {
        "step_ms": elapsed / steps * 1e3,
        "syncs": reads.count / steps,
        "copies": copies / steps,
        "gathers": gathers / steps,
        "ops": ops / steps,
        "points": len(modules),
        "edits": edits,
    }


def generate_arm(served, batch: int, steps: int, sample: bool) -> dict:
    from tests.support.host_reads import HostReads

    tokenizer, model = served.tokenizer, served.hf
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
        for t in prompts(batch)
    ]
    tokenizer.padding_side = "left"
    inputs = tokenizer(texts, return_tensors="pt", padding=True).to(model.device)
    settings = {"do_sample": True, "temperature": 0.8} if sample else {"do_sample": False}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def run(n: int) -> None:
        model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, pad_token_id=pad, **settings)

    with torch.inference_mode():
        run(2)
        long_times, short_times = [], []
        for _ in range(3):
            started = time.perf_counter()
            run(steps + 1)
            long_times.append(time.perf_counter() - started)
            started = time.perf_counter()
            run(1)
            short_times.append(time.perf_counter() - started)
        with profile(activities=[ProfilerActivity.CPU]) as long_prof:
            run(steps + 1)
        with profile(activities=[ProfilerActivity.CPU]) as short_prof:
            run(1)
        with HostReads() as long_reads:
            run(steps + 1)
        with HostReads() as short_reads:
            run(1)
    long_counts, short_counts = counts(long_prof), counts(short_prof)
    per = [(a - b) / steps for a, b in zip(long_counts, short_counts, strict=True)]
    return {
        "step_ms": (statistics.median(long_times) - statistics.median(short_times)) / steps * 1e3,
        "syncs": (long_reads.count - short_reads.count) / steps,
        "gathers": 0.0,
        "copies": per[1],
        "ops": per[2],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--points", type=int, nargs="+", default=[0, 6, 60])
    parser.add_argument("--edits", type=int, nargs="+", default=[0], help="an add at this many layers (slots arm)")
    parser.add_argument(
        "--steps", type=int, default=64, help="a multiple of 32 (captured rows reach the jobs every 32 steps)"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--sample", action="store_true", help="temperature 0.8 (seeded) instead of greedy")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from shared.settings import Settings
    from worker.batch.served import ServedModel
    from worker.model.loading import load

    folder = build_model(Path(tempfile.mkdtemp(prefix="bench-step-")) / "model", args.hidden, args.layers)
    served = ServedModel(load(Settings(model=str(folder), model_name="m", device=args.device, dtype=args.dtype)))
    rows = []
    print(
        f"{'arm':<10}{'batch':>6}{'points':>7}{'edits':>6}{'ms/step':>9}{'reads':>7}{'copies':>8}{'gathers':>8}{'ops':>8}"
    )
    for batch in args.batch:
        arms: list[tuple[str, int | None, int]] = [("generate", None, 0)]
        arms += [("compacted", p, 0) for p in args.points]
        arms += [("slots", p, e) for e in args.edits for p in args.points]
        for name, points, edits in arms:
            if points is None:
                row = generate_arm(served, batch, args.steps, args.sample)
                row.update(points=0, edits=0)
            else:
                compacted = name == "compacted"
                row = engine_arm(served, batch, points, args.steps, args.sample, compacted=compacted, edits=edits)
            row.update(arm=name, batch=batch)
            rows.append(row)
            print(
                f"{name:<10}{batch:>6}{row['points']:>7}{row['edits']:>6}{row['step_ms']:>9.2f}{row['syncs']:>7.1f}"
                f"{row['copies']:>8.1f}{row['gathers']:>8.1f}{row['ops']:>8.0f}",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
