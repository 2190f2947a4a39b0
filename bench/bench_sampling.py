"""What the vectorised sampler dispatches per decoding step for a batch that mixes sampling
settings, against a batch whose every row has every setting (CPU, counted, not timed).

    python bench/bench_sampling.py [--rows 16]

Each row of the table is a job's settings (worker/model/sampling.py); the parts of `sample` run for
every row or for none (`Features`), so a batch mixing greedy rows, top_k, min_p, penalties and
logit_bias dispatches the same operations as one where every row asks for all of them: one kind
of launch sequence per feature set, and a CUDA graph per feature set in use. Counted with a
TorchDispatchMode (each aten call is one kernel launch on a GPU, or fewer when fused)."""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from worker.model.sampling import Features, RowSampling, SamplingTable, sample, token_counts

VOCAB, CONTEXT, GENERATED = 49152, 64, 32  # SmolLM2's vocabulary; 32 of 64 tokens generated


class Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls += 1
        return func(*args, **(kwargs or {}))


def ops(rows: list[RowSampling]) -> tuple[int, Features]:
    """aten calls of one `sample` over `rows`, and the feature set they need."""
    n = len(rows)
    table = SamplingTable(n, VOCAB, {2}, "cpu")
    features = Features()
    for i, row in enumerate(rows):
        table.set_row(i, row)
        features = features | row.features
    tokens = torch.randint(0, VOCAB, (n, CONTEXT))
    seen = token_counts(
        tokens,
        torch.zeros(n, dtype=torch.long),
        torch.full((n,), CONTEXT - 1),
        torch.full((n,), CONTEXT - GENERATED),
        VOCAB,
    )
    with Count() as count:
        sample(torch.randn(n, VOCAB), table, torch.full((n,), GENERATED), penalties=seen, features=features)
    return count.calls, features


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16)
    rows = parser.parse_args().rows
    every = RowSampling(
        temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=1, repetition_penalty=1.2,
        presence_penalty=0.5, frequency_penalty=0.3, logit_bias={5: 2.0}, min_tokens=3,
    )  # fmt: skip
    kinds = [
        RowSampling(),
        RowSampling(temperature=0.7, seed=2),
        RowSampling(temperature=1.0, top_k=5, seed=3),
        RowSampling(repetition_penalty=1.3),
        RowSampling(logit_bias={7: -100.0}),
        RowSampling(temperature=1.0, min_p=0.1, seed=4),
        RowSampling(presence_penalty=1.0, frequency_penalty=0.5),
        every,
    ]
    batches = {
        "every row greedy": [RowSampling()] * rows,
        "every row every setting": [every] * rows,
        f"{len(kinds)} kinds mixed": [kinds[i % len(kinds)] for i in range(rows)],
    }
    print(f"aten calls of one sampling step, {rows} rows, vocabulary {VOCAB}")
    for name, batch in batches.items():
        calls, _ = ops(batch)
        print(f"  {name:26s} {calls:4d}")


if __name__ == "__main__":
    main()
