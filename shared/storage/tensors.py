"""The safetensors format, both ways, where the library has no API for what we need:

- writing a file in one pass while hashing it (the worker knows the file's sha256 without reading
  it back; the hash runs on another core while the bytes are written);
- reading one tensor (or some of its rows) out of a stored file without fetching the rest: the
  8-byte header length, the JSON header, then exactly the tensor's byte range.

Layout (https://github.com/huggingface/safetensors): u64 little-endian header length N, N bytes
of JSON `{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str: str}}`, then the
tensors' bytes, offsets relative to the end of the header. Files are read back with the
safetensors library in the tests."""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct

from shared.dtypes import CODE_BYTES, SAFETENSORS_CODE
from shared.errors import BadRequest, StorageError, TensorNotFound
from shared.storage.base import ArtifactStore

MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own limit


def parse_rows(text: str | None) -> tuple[int | None, int | None] | None:
    """`start:stop` (either may be empty) -> (start, stop); None for no slicing."""
    if text is None:
        return None
    parts = text.split(":")
    # ASCII digits only: str.isdigit() also accepts superscripts and other scripts' digits ("²").
    if len(parts) != 2 or not all(p == "" or (p.isascii() and p.isdigit()) for p in parts):
        raise BadRequest(f"rows={text!r}: use start:stop with non-negative integers, e.g. rows=0:16")
    return tuple(int(p) if p else None for p in parts)  # type: ignore[return-value]


def read_header(store: ArtifactStore, key: str) -> tuple[int, dict]:
    raw = store.read_range(key, 0, 8)
    if len(raw) != 8:
        raise StorageError(f"{key} is not a safetensors file")
    (length,) = struct.unpack("<Q", raw)
    if length > MAX_HEADER_BYTES:
        raise StorageError(f"{key} has an implausible safetensors header ({length} bytes)")
    return 8 + length, json.loads(store.read_range(key, 8, length))


def _header(entries: list[tuple[str, str, list[int], int]], metadata: dict[str, str]) -> bytes:
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape, size in entries:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # keep the data 8-byte aligned
    return struct.pack("<Q", len(text)) + text


def write_file(
    path, tensors: dict, metadata: dict[str, str], fsync: bool = True, tensor_sha256: dict[str, str] | None = None
) -> tuple[int, str]:
    """Write torch tensors as a safetensors file (fsynced unless told otherwise) and return
    (bytes, sha256), computing the hash on a second thread while the file is written. With
    `tensor_sha256`, each tensor's own sha256 (of its bytes alone) is put there too, on the same
    thread: what a download of one tensor is checked against without reading it back. A tensor
    that is not contiguous (a column range of a job's capture arena) is made so just before its
    bytes are written, one at a time: the write holds at most a few tensors' copies."""
    import queue
    import threading

    import torch

    entries = [
        (
            name,
            SAFETENSORS_CODE[str(tensor.dtype).removeprefix("torch.")],
            list(tensor.shape),
            tensor.numel() * tensor.element_size(),
        )
        for name, tensor in tensors.items()
    ]
    header = _header(entries, metadata)
    pieces: queue.Queue[tuple[str | None, memoryview] | None] = queue.Queue(maxsize=2)
    digest = hashlib.sha256(header)

    def sha256() -> None:
        while (item := pieces.get()) is not None:
            name, view = item
            digest.update(view)  # releases the GIL
            if tensor_sha256 is not None and name is not None:
                tensor_sha256[name] = hashlib.sha256(view).hexdigest()

    # The hash runs on another core through the whole write *and* the fsync (each tensor's bytes
    # are in memory and do not change), so it costs no wall time unless it is slower than the disk.
    hashing = threading.Thread(target=sha256, name="actq-sha256", daemon=True)
    hashing.start()
    size = len(header)
    try:
        with open(path, "wb") as handle:
            handle.write(header)
            for name, tensor in tensors.items():
                flat = tensor.detach().cpu().contiguous().reshape(-1)
                view = memoryview(flat.view(torch.uint8).numpy())
                handle.write(view)
                pieces.put((name, view))
                size += view.nbytes
            handle.flush()
            if fsync:
                os.fsync(handle.fileno())
    finally:
        pieces.put(None)
        hashing.join()
    return size, digest.hexdigest()


def encode(tensors: dict[str, tuple[str, list[int], bytes]], metadata: dict[str, str]) -> bytes:
    """A safetensors file from (dtype, shape, raw bytes) per name."""
    entries = [(name, dtype, shape, len(data)) for name, (dtype, shape, data) in tensors.items()]
    return _header(entries, metadata) + b"".join(data for _, _, data in tensors.values())


class TensorSlice:
    """One tensor (or some of its rows) as a small safetensors file: its own `head` (length and
    JSON header) followed by `length` bytes of the stored file from `offset`, to be streamed."""

    def __init__(self, head: bytes, offset: int, length: int, rows: tuple[int, int] | None) -> None:
        self.head, self.offset, self.length, self.rows = head, offset, length, rows

    @property
    def size(self) -> int:
        return len(self.head) + self.length


def tensor_slice(store: ArtifactStore, key: str, name: str, rows: tuple[int | None, int | None] | None) -> TensorSlice:
    """Where one tensor's bytes are in a stored file, reading only the file's header."""
    data_start, header = read_header(store, key)
    info = header.get(name) if name != "__metadata__" else None
    if info is None:
        names = ", ".join(k for k in header if k != "__metadata__")
        raise TensorNotFound(f"no tensor named {name!r} in this job's activations; tensors: {names}")
    dtype, shape = info["dtype"], list(info["shape"])
    begin, end = info["data_offsets"]
    picked = None
    if rows is not None:
        if not shape:
            raise BadRequest(f"{name} is a scalar; it has no rows to slice")
        first = 0 if rows[0] is None else rows[0]
        last = shape[0] if rows[1] is None else min(rows[1], shape[0])
        if first >= last:
            raise BadRequest(f"rows={first}:{rows[1]} selects nothing: {name} has {shape[0]} rows")
        row_bytes = math.prod(shape[1:]) * CODE_BYTES[dtype]
        begin, end = begin + first * row_bytes, begin + last * row_bytes
        shape[0] = last - first
        picked = (first, last)
    metadata = {k: str(v) for k, v in header.get("__metadata__", {}).items()}
    if picked is not None:
        metadata["rows"] = f"{picked[0]}:{picked[1]}"
    head = _header([(name, dtype, shape, end - begin)], metadata)
    return TensorSlice(head, data_start + begin, end - begin, picked)


def read_tensor(store: ArtifactStore, key: str, name: str, rows: tuple[int | None, int | None] | None) -> bytes:
    """One tensor as a small safetensors file, reading only the header and that tensor's bytes."""
    part = tensor_slice(store, key, name, rows)
    return part.head + store.read_range(key, part.offset, part.length)
