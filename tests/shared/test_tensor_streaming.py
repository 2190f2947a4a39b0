"""One tensor served by byte range (issue 22): each tensor's sha256 is recorded while the file is
written, and a tensor (or some rows) streams in chunks after the file's header, never whole."""

from __future__ import annotations

import hashlib

import torch
from safetensors.torch import load

from shared.storage import LocalStore
from shared.storage.tensors import parse_rows, read_tensor, tensor_slice, write_file


def tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "model.layers.1": torch.randn(64, 1024, generator=generator),
        "model.layers.1:input": torch.randn(64, 8, generator=generator).to(torch.bfloat16),
        "token_ids": torch.arange(64, dtype=torch.int64),
    }


def test_each_tensors_sha256_is_recorded_while_the_file_is_written(tmp_path):
    sums: dict[str, str] = {}
    write_file(tmp_path / "a.safetensors", tensors(), {"job_id": "j"}, tensor_sha256=sums)
    for name, tensor in tensors().items():
        raw = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        assert sums[name] == hashlib.sha256(raw).hexdigest()


def test_a_tensor_streams_by_range_in_chunks(tmp_path):
    store = LocalStore(tmp_path)
    (tmp_path / "jobs" / "j").mkdir(parents=True)
    key = "jobs/j/a.safetensors"
    write_file(tmp_path / key, tensors(), {"job_id": "j"})
    for name, rows in (("model.layers.1", None), ("model.layers.1", "3:40"), ("model.layers.1:input", ":5")):
        part = tensor_slice(store, key, name, parse_rows(rows))
        before = store.bytes_read
        chunks = list(store.stream_range(key, part.offset, part.length, chunk=4096))
        assert store.bytes_read - before == part.length and max(len(c) for c in chunks) <= 4096
        streamed = part.head + b"".join(chunks)
        assert streamed == read_tensor(store, key, name, parse_rows(rows)) and len(streamed) == part.size
        expected = tensors()[name] if rows is None else tensors()[name][slice(*parse_rows(rows))]
        assert torch.equal(load(streamed)[name], expected)
