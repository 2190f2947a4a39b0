"""What constrained decoding (worker/rules/constrained.py) costs per decoding step, beside free decoding.

The real `Decoder` on a model whose compute is nearly free (the tiny random Llama, 4 layers,
hidden 64, SmolLM2's tokenizer: a step's time is the engine's own work, the part a GPU does not
speed up) or on the built-in SmolLM2 (`--model smollm2`). Per batch size, side by side in one run:
all rows free, and all rows under a JSON schema (greedy). A step's time is taken only while every
row of the batch still runs (the first `--steps` steps after the prefill), medians over the steps
of a run, then the median over `--repeats` runs. Also the one-time costs: building llguidance's
view of the tokenizer (once per model), compiling a job's grammar (once per job), and the
submit-time check `grammar_problem` (once per request, in the API).

    .venv/bin/python bench/bench_constrained.py [--batches 1 16] [--repeats 5] [--steps 24] [--json out.json]
    .venv/bin/python bench/bench_constrained.py --model smollm2 --device cuda   # on a GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support, from a checkout

# strings long enough that a random model is still inside the reply after `--steps` steps
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 200, "maxLength": 400},
        "score": {"type": "integer"},
        "kind": {"enum": ["a", "b", "c"]},
    },
    "required": ["title", "score", "kind"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


def load(which: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.settings import Settings
    from worker.model.loading import ensure_smollm2

    folder = ensure_smollm2(Settings().model_cache_dir)
    if which == "tiny":
        from tests.support.tiny_model import build

        folder = build(Path(tempfile.mkdtemp()) / "tiny", folder, max_position_embeddings=4096)
    return AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


def requests(constrained: bool, batch: int) -> list[Any]:
    from shared.schemas import JobRequest

    extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}}
    return [
        JobRequest.model_validate(
            {
                "model": "m",
                "messages": [{"role": "user", "content": f"Item {i}: describe it."}],
                **(extra if constrained else {}),
            }
        )
        for i in range(batch)
    ]


def step_times(
    model, tokenizer, grammars, constrained: bool, batch: int, steps: int, device: str = "cpu"
) -> list[float]:
    """One run: the batch's prefill, then the time of each step while all rows still run."""
    from worker.batch.decoding import Decoder
    from worker.batch.sequence import Sequence

    seqs = []
    for req in requests(constrained, batch):
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_dict=True, return_tensors="pt"
        )["input_ids"].to(device)
        seqs.append(
            Sequence(
                prompt_ids=ids,
                max_tokens=steps + 2,
                constraint=grammars.constraint(req, None) if constrained else None,
            )
        )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    decoder = Decoder(model, tokenizer, pad)
    times = []
    with torch.inference_mode():
        decoder.admit_many(seqs)
        for _ in range(steps):
            if len(decoder.rows) < batch:
                break
            started = time.perf_counter()
            decoder.step()  # its tokens reach the host: the step has finished on the device
            times.append(time.perf_counter() - started)
    decoder.close()
    return times


def one_time(tokenizer, vocab: int, eos: set[int], repeats: int) -> dict[str, float]:
    from shared.grammars import grammar_problem
    from shared.schemas import JobRequest
    from shared.tools import ToolFormat
    from worker.rules.constrained import Grammars

    build = []
    for _ in range(repeats):
        grammars = Grammars(tokenizer, vocab, eos)
        started = time.perf_counter()
        grammars.lltokenizer()
        build.append(time.perf_counter() - started)
    schema_req = requests(True, 1)[0]
    tool_req = JobRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "2+3?"}], "tools": [TOOL], "tool_choice": "required"}
    )
    compile_s, check_s, tool_compile_s, tool_check_s = [], [], [], []
    for _ in range(max(repeats, 20)):
        for req, fmt, compiled, checked in (
            (schema_req, None, compile_s, check_s),
            (tool_req, ToolFormat.HERMES, tool_compile_s, tool_check_s),
        ):
            started = time.perf_counter()
            grammars.constraint(req, fmt)
            compiled.append(time.perf_counter() - started)
            started = time.perf_counter()
            assert grammar_problem(req, fmt) is None
            checked.append(time.perf_counter() - started)
    med = statistics.median
    return {
        "tokenizer_ms": med(build) * 1e3,
        "compile_schema_ms": med(compile_s) * 1e3,
        "compile_tool_ms": med(tool_compile_s) * 1e3,
        "check_schema_ms": med(check_s) * 1e3,
        "check_tool_ms": med(tool_check_s) * 1e3,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (llguidance's executor has its own)")
    parser.add_argument("--device", default="cpu", help="e.g. cuda: the model and the batch on that device")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model, tokenizer = load(args.model)
    model = model.to(args.device)
    eos_id = model.generation_config.eos_token_id
    eos = set(eos_id if isinstance(eos_id, list) else [eos_id])
    from worker.rules.constrained import Grammars

    once = one_time(tokenizer, model.config.vocab_size, eos, args.repeats)
    grammars = Grammars(tokenizer, model.config.vocab_size, eos)
    rows = []
    for batch in args.batches:
        step_times(
            model, tokenizer, grammars, True, batch, 2, args.device
        )  # warm-up: first-call costs out of the figures
        figures: dict[str, list[float]] = {"free": [], "constrained": []}
        counted = {"free": 0, "constrained": 0}
        for _ in range(args.repeats):
            for arm in ("free", "constrained"):  # interleaved: drift hits both arms alike
                times = step_times(model, tokenizer, grammars, arm == "constrained", batch, args.steps, args.device)
                figures[arm].append(statistics.median(times))
                counted[arm] = len(times)
        free, constrained = (statistics.median(figures[arm]) * 1e3 for arm in ("free", "constrained"))
        rows.append(
            {
                "batch": batch,
                "free_ms": free,
                "constrained_ms": constrained,
                "ratio": constrained / free,
                "extra_us_per_row": (constrained - free) * 1e3 / batch,
                "steps": min(counted.values()),
            }
        )

    print(
        f"model: {args.model} on {args.device}, vocab {model.config.vocab_size}, torch threads {args.threads}, repeats {args.repeats}"
    )
    print(
        f"one-time: llguidance tokenizer {once['tokenizer_ms']:.0f} ms (per model); compile a job's grammar: "
        f"schema {once['compile_schema_ms']:.2f} ms, forced tool call {once['compile_tool_ms']:.2f} ms; "
        f"submit check (grammar_problem): schema {once['check_schema_ms']:.2f} ms, tool {once['check_tool_ms']:.2f} ms"
    )
    header = (
        f"{'batch':>5} {'free ms/step':>12} {'constrained ms/step':>19} {'ratio':>6} {'extra us/row':>12} {'steps':>5}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['batch']:>5} {r['free_ms']:>12.3f} {r['constrained_ms']:>19.3f} {r['ratio']:>6.2f} "
            f"{r['extra_us_per_row']:>12.1f} {r['steps']:>5}"
        )
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "one_time": once, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
