"""The safetensors format, both ways, where the library has no API for what we need:

- writing a file in one pass while hashing it (the worker knows the file's sha256 and each
  tensor's without reading it back), a few writev calls per file;
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
from collections.abc import Iterator

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


def header_bytes(entries: list[tuple[str, str, list[int], int]], metadata: dict[str, str]) -> bytes:
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape, size in entries:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # keep the data 8-byte aligned
    return struct.pack("<Q", len(text)) + text


GROUP_BYTES = 1 << 20  # tensors written (and hashed) together: the copies a write holds (two groups at most)
PIPELINED_BYTES = 64 << 20  # from this size, the hashing runs on a second thread beside the writes
IOV_MAX = 512  # buffers per writev call (Linux takes 1,024)


def write_file(
    path, tensors: dict, metadata: dict[str, str], fsync: bool = True, tensor_sha256: dict[str, str] | None = None
) -> tuple[int, str]:
    """Write torch tensors as a safetensors file (fsynced unless told otherwise) and return
    (bytes, sha256). With `tensor_sha256`, each tensor's own sha256 (of its bytes alone) is put
    there too: what a download of one tensor is checked against without reading it back.

    The tensors go in groups of up to GROUP_BYTES: each made contiguous (a column range of a
    job's capture arena is copied once, here), hashed, and the group written with one `writev`;
    hashlib and writev release the GIL, and no Python runs per row. A small file (most jobs'
    captures) is hashed in the calling thread: handing pieces to another thread costs more than
    it saves when many jobs are written at once. From PIPELINED_BYTES the hashing runs on a
    second thread, a group behind the writes, so a large file is written at the disk's speed."""
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
    header = header_bytes(entries, metadata)
    digest = hashlib.sha256(header)
    total = len(header) + sum(entry[3] for entry in entries)

    def hash_group(group: list[tuple[str, memoryview]]) -> None:
        for name, view in group:
            digest.update(view)  # the file's, in file order
            if tensor_sha256 is not None:
                tensor_sha256[name] = hashlib.sha256(view).hexdigest()

    pipelined = total >= PIPELINED_BYTES
    pool = _hashing_thread() if pipelined else None
    hashed = None
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, [memoryview(header)])
        for group in _groups(tensors, torch):
            if pool is not None:
                if hashed is not None:
                    hashed.result()  # a group behind: at most two groups' copies held
                hashed = pool.submit(hash_group, group)
            else:
                hash_group(group)
            _write_all(fd, [view for _, view in group])
        if hashed is not None:
            hashed.result()
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
        if pool is not None:
            pool.shutdown(wait=True)
    return total, digest.hexdigest()


def _hashing_thread():
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="actq-sha256")


def _groups(tensors: dict, torch) -> Iterator[list[tuple[str, memoryview]]]:
    """(name, bytes) of the tensors in order, a group of up to GROUP_BYTES at a time (a larger
    tensor is a group alone); each tensor made contiguous just before its group is written."""
    group: list[tuple[str, memoryview]] = []
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if group and size + nbytes > GROUP_BYTES:
            yield group
            group, size = [], 0
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        group.append((name, memoryview(flat.view(torch.uint8).numpy())))
        size += nbytes
    if group:
        yield group


def _write_all(fd: int, views: list[memoryview]) -> None:
    """Every byte of `views`, in order, with as few writev calls as the kernel allows."""
    pending = [v.cast("B") for v in views if v.nbytes]
    while pending:
        written = os.writev(fd, pending[:IOV_MAX])
        while pending and written >= pending[0].nbytes:
            written -= pending[0].nbytes
            pending.pop(0)
        if written:
            pending[0] = pending[0][written:]


def encode(tensors: dict[str, tuple[str, list[int], bytes]], metadata: dict[str, str]) -> bytes:
    """A safetensors file from (dtype, shape, raw bytes) per name."""
    entries = [(name, dtype, shape, len(data)) for name, (dtype, shape, data) in tensors.items()]
    return header_bytes(entries, metadata) + b"".join(data for _, _, data in tensors.values())


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
    head = header_bytes([(name, dtype, shape, end - begin)], metadata)
    return TensorSlice(head, data_start + begin, end - begin, picked)


def read_tensor(store: ArtifactStore, key: str, name: str, rows: tuple[int | None, int | None] | None) -> bytes:
    """One tensor as a small safetensors file, reading only the header and that tensor's bytes."""
    part = tensor_slice(store, key, name, rows)
    return part.head + store.read_range(key, part.offset, part.length)
