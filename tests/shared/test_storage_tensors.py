"""Our one-pass safetensors writer and range reader, checked with the safetensors library itself."""

from __future__ import annotations

import hashlib

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load, load_file

from shared.errors import BadRequest, TensorNotFound
from shared.storage import LocalStore
from shared.storage.tensors import parse_rows, read_tensor, write_file


@pytest.fixture
def tensors():
    generator = torch.Generator().manual_seed(0)
    return {
        "model.layers.1": torch.randn(7, 5, generator=generator),
        "model.layers.1:input": torch.randn(7, 5, generator=generator).to(torch.bfloat16),
        "lm_head": torch.randn(3, 11, generator=generator).to(torch.float16),
        "token_ids": torch.arange(8, dtype=torch.int64),
    }


def test_written_file_is_what_the_library_reads_and_the_hash_is_of_its_bytes(tmp_path, tensors):
    path = tmp_path / "a.safetensors"
    size, sha = write_file(path, tensors, {"job_id": "j", "positions": "all"})
    data = path.read_bytes()
    assert size == len(data) and sha == hashlib.sha256(data).hexdigest()
    loaded = load_file(path)
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor)
    with safe_open(str(path), "pt") as handle:
        assert handle.metadata() == {"job_id": "j", "positions": "all"}


@pytest.mark.parametrize("pipelined", [False, True])
def test_groups_the_hashing_thread_and_short_writes_give_the_same_file(tmp_path, tensors, monkeypatch, pipelined):
    """Tensors written in groups of a few bytes (column ranges of one arena, as a job's capture
    is), hashed inline or on the second thread, through a writev that takes at most 5 bytes and
    3 buffers a call: the same bytes, the file's sha256 and each tensor's."""
    import os

    from shared.storage import tensors as module

    arena = torch.randn(7, 15, generator=torch.Generator().manual_seed(1))
    given = {"a": arena[:, :5], "b": arena[:, 5:12], **tensors, "c": arena[:, 12:]}  # views, not contiguous
    expected = tmp_path / "one-go.safetensors"
    size, sha = write_file(expected, given, {"job_id": "j"})
    real_writev = os.writev
    calls = []

    def short_writev(fd, buffers):
        calls.append(len(buffers))
        assert len(buffers) <= 3
        return real_writev(fd, [bytes(buffers[0])[:5]])  # the kernel may write less than asked

    monkeypatch.setattr(module, "GROUP_BYTES", 400)  # two or three tensors a group
    monkeypatch.setattr(module, "PIPELINED_BYTES", 0 if pipelined else 1 << 40)
    monkeypatch.setattr(module, "IOV_MAX", 3)
    monkeypatch.setattr(module.os, "writev", short_writev)
    sums: dict[str, str] = {}
    path = tmp_path / "grouped.safetensors"
    assert write_file(path, given, {"job_id": "j"}, tensor_sha256=sums) == (size, sha)
    assert path.read_bytes() == expected.read_bytes() and sha == hashlib.sha256(path.read_bytes()).hexdigest()
    assert len(calls) >= size // 5 and max(calls) == 3  # every short write resumed where it stopped
    for name, tensor in given.items():
        assert torch.equal(load_file(path)[name], tensor)
        raw = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        assert sums[name] == hashlib.sha256(raw).hexdigest()


def test_one_tensor_reads_header_and_exactly_its_bytes(tmp_path, tensors):
    store = LocalStore(tmp_path)
    (tmp_path / "jobs" / "j").mkdir(parents=True)
    write_file(tmp_path / "jobs/j/a.safetensors", tensors, {"job_id": "j"})
    header = 8 + int.from_bytes((tmp_path / "jobs/j/a.safetensors").read_bytes()[:8], "little")
    for name, tensor in tensors.items():
        before = store.bytes_read
        one = load(read_tensor(store, "jobs/j/a.safetensors", name, None))
        assert torch.equal(one[name], tensor)
        assert store.bytes_read - before == header + tensor.numel() * tensor.element_size()
    rows = load(read_tensor(store, "jobs/j/a.safetensors", "model.layers.1:input", parse_rows("2:5")))
    assert torch.equal(rows["model.layers.1:input"], tensors["model.layers.1:input"][2:5])
    assert torch.equal(
        load(read_tensor(store, "jobs/j/a.safetensors", "token_ids", parse_rows(":3")))["token_ids"], torch.arange(3)
    )
    assert torch.equal(
        load(read_tensor(store, "jobs/j/a.safetensors", "lm_head", parse_rows("1:99")))["lm_head"],
        tensors["lm_head"][1:],
    )
    with pytest.raises(TensorNotFound, match="tensors: model.layers.1, model.layers.1:input, lm_head, token_ids"):
        read_tensor(store, "jobs/j/a.safetensors", "__metadata__", None)
    with pytest.raises(BadRequest, match="selects nothing"):
        read_tensor(store, "jobs/j/a.safetensors", "lm_head", parse_rows("3:3"))


@pytest.mark.parametrize("text", ["1", "a:b", "-1:3", "1:2:3", "1 :2", "²:", "0:٣", "𝟘:1"])
def test_bad_rows(text):
    with pytest.raises(BadRequest, match="use start:stop"):
        parse_rows(text)
