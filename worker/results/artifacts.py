"""Writing a job's activations: one safetensors file and a manifest.json beside it, in the
folder of the attempt that ran it (shared/storage/base.py: `jobs/<id>/attempt-<n>-<worker>/`)."""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

import torch

from shared.errors import StorageError
from shared.schemas import ActivationsManifest, CaptureSpec
from shared.storage import ArtifactStore
from shared.storage.tensors import write_file
from worker.batch.generation import Generation
from worker.batch.sequence import TokenScores
from worker.results.publishing import publish, scratch_file

FORMAT = "actq/1"
log = logging.getLogger(__name__)
# Files encoded (copied, hashed, written) at once: the work is CPU (the kernel's copy included), so
# more encoders than cores only contend with each other and with the engine's thread for the cores
# and the GIL (32 concurrent writers of small captures took 4x the CPU per file of one on 2 cores).
# The stores' waits (an upload, an outage) are outside it: a slow store still holds no encoder.
ENCODERS = max(1, (os.cpu_count() or 2) // 2)
_encoding = threading.BoundedSemaphore(ENCODERS)


def score_tensors(scores: TokenScores) -> dict[str, torch.Tensor]:
    """Log-probabilities as tensors: `logprobs` [N] float32 (NaN where nothing predicted the token:
    a trace's first), `logprob_token_ids` [N] int64 (the scored tokens) and, with top_logprobs k,
    `top_logprobs` [N, k] float32 and `top_logprob_ids` [N, k] int64 (a trace's first row: NaN and -1),
    `logprob_ranks` [N] int64 (each scored token's rank; 0 where nothing predicted it)."""
    values = [float("nan") if v is None else v for v in scores.values]
    out = {
        "logprobs": torch.tensor(values, dtype=torch.float32),
        "logprob_token_ids": torch.tensor(scores.tokens, dtype=torch.int64),
        "logprob_ranks": torch.tensor([r or 0 for r in scores.ranks], dtype=torch.int64),
    }
    if scores.k:
        out["top_logprobs"] = torch.tensor(
            [v or [float("nan")] * scores.k for v in scores.top_values], dtype=torch.float32
        )
        out["top_logprob_ids"] = torch.tensor([i or [-1] * scores.k for i in scores.top_ids], dtype=torch.int64)
    return out


BASELINE = "baseline/"  # the prefix of the unedited run's tensors (`baseline: true`)


@dataclass
class CaptureFile:
    """What a job's activations file holds, before it is written: its tensors in file order, the
    file's metadata, and each captured tensor's manifest entry but its sha256 (known once written)."""

    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]
    entries: list[dict]  # TensorInfo's fields, but sha256
    extra: list[str]  # the other tensors' names: token ids, log-probabilities


def capture_file(
    job_id: str, model: str, capture: CaptureSpec | None, generation: Generation, baseline: Generation | None = None
) -> CaptureFile:
    """The file of `generation`'s activations (and `baseline`'s: the same job run without its
    interventions, whose tensors are named `baseline/<name>`)."""
    positions = capture.positions if capture is not None else "all"
    reduce = capture.reduce if capture is not None else "none"
    captured = [(c.point.name, c, False) for c in generation.captured]
    tensors = {c.point.name: c.tensor for c in generation.captured}
    tensors["token_ids"] = generation.token_ids.contiguous()
    extra = score_tensors(generation.scores) if generation.scores is not None else {}
    if baseline is not None:
        captured += [(BASELINE + c.point.name, c, True) for c in baseline.captured]
        tensors.update({BASELINE + c.point.name: c.tensor for c in baseline.captured})
        extra[BASELINE + "token_ids"] = baseline.token_ids.contiguous()
        if baseline.scores is not None:
            extra.update({BASELINE + name: t for name, t in score_tensors(baseline.scores).items()})
    tensors.update(extra)
    metadata = {
        "format": FORMAT,
        "job_id": job_id,
        "model": model,
        "prompt_tokens": str(generation.prompt_tokens),
        "completion_tokens": str(generation.completion_tokens),
        "positions": positions,
        "reduce": reduce,
    }
    if generation.completion is not None:
        metadata["completion_span"] = f"{generation.completion[0]}:{generation.completion[1]}"
    entries = [
        {
            "name": name,
            "module": c.point.module,
            "hook": c.point.hook,
            "shape": list(c.tensor.shape),
            "dtype": str(c.tensor.dtype).removeprefix("torch."),
            "positions": positions,
            "start": c.start,
            "stop": c.stop,
            "bytes": c.tensor.numel() * c.tensor.element_size(),
            "reduce": reduce,
            "features": c.features,
            "baseline": unedited,
        }
        for name, c, unedited in captured
    ]
    return CaptureFile(tensors, metadata, entries, list(extra))


def write_activations(
    store: ArtifactStore,
    job_id: str,
    model: str,
    capture: CaptureSpec | None,
    generation: Generation,
    baseline: Generation | None = None,
    *,
    prefix: str,
) -> ActivationsManifest:
    """Write the file, then the manifest, under `prefix` (the attempt's folder: attempt_prefix);
    both are whole before this returns (the job is marked succeeded only afterwards). Another
    attempt of the same job writes under another prefix, never over these keys. `baseline`: the
    same job run without its interventions, whose tensors are named `baseline/<name>`."""
    file = capture_file(job_id, model, capture, generation, baseline)
    checksums: dict[str, str] = {}  # each tensor's sha256, filled while the file is written
    tmp = scratch_file(store)
    try:
        try:
            with _encoding:
                # no fsync here: put_file syncs a local store's file before its rename (S3 needs none)
                size, sha = write_file(tmp, file.tensors, file.metadata, fsync=False, tensor_sha256=checksums)
        except OSError as exc:
            raise StorageError(f"cannot write activations: {exc.strerror or exc}") from exc
        return publish(store, job_id, model, file.metadata, file.entries, file.extra, tmp, size, sha, checksums, prefix)
    finally:
        tmp.unlink(missing_ok=True)
