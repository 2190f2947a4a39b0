"""Which weights a model folder holds, read without torch: its `config.json` (less the keys that
only say where and by what it was saved) and every tensor of its `*.safetensors` files, each
tensor's bytes hashed. The worker fingerprints the files it loaded its model from
(worker/model/loading.py) and publishes that; the API compares the folder an nnsight client names
with it (api/nnsight_identity.py) and says what differs.

A folder is read only so far: `config.json` and the `*.safetensors` files directly in it, each
opened without blocking and read only when it is a regular file (a symlink is followed to one:
the Hugging Face cache's snapshots are symlinks to blobs), headers bounded by the format's own
limit. Comparing against a model first reads the headers alone (config, tensor names, dtypes,
shapes): only a folder that agrees there has its data hashed, so the work is bounded by the
size of the model compared with.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.schemas import ModelFingerprint

CONFIG = "config.json"
# Keys that change with how a folder was saved, not with the model: where from, by which transformers.
IGNORED_CONFIG_KEYS = frozenset({"_name_or_path", "transformers_version", "_commit_hash"})
MAX_CONFIG_BYTES = 1 << 20
MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own limit on a header; also on all of a folder's together
MAX_FILES = 4096
MAX_ENTRIES = 100_000  # names listed in a folder before it is refused
CHUNK = 8 << 20
ITEM_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}  # fmt: skip


class NotAModelFolder(ValueError):
    """The folder cannot be fingerprinted; the message says why (for the person who named it)."""


@dataclass(frozen=True)
class Tensor:
    dtype: str
    shape: tuple[int, ...]
    file: str
    begin: int  # absolute offsets in the file
    end: int

    @property
    def described(self) -> str:
        return f"{self.dtype} {'x'.join(map(str, self.shape)) or 'scalar'}"


@dataclass(frozen=True)
class Folder:
    """A model folder's headers: what can be compared before any tensor data is read."""

    path: Path
    config: dict[str, Any]
    tensors: dict[str, Tensor]
    signature: tuple[tuple[str, int, int, int, int], ...]  # (file, size, mtime_ns, inode, device) each


def _open(path: Path) -> int:
    """A descriptor on `path` if it is (or links to) a regular file; O_NONBLOCK: a FIFO never blocks."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise NotAModelFolder(f"{path.name} cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotAModelFolder(f"{path.name} is not a regular file")
    return fd


def _read_exactly(fd: int, size: int, name: str) -> bytes:
    parts, left = [], size
    while left:
        part = os.read(fd, min(left, CHUNK))
        if not part:
            raise NotAModelFolder(f"{name} ends early (changed while it was read?)")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def _config(folder: Path) -> dict[str, Any]:
    fd = _open(folder / CONFIG)
    try:
        size = os.fstat(fd).st_size
        if size > MAX_CONFIG_BYTES:
            raise NotAModelFolder(f"{CONFIG} is over {MAX_CONFIG_BYTES:,} bytes")
        raw = _read_exactly(fd, size, CONFIG)
    finally:
        os.close(fd)
    try:
        config = json.loads(raw)
    except ValueError:
        raise NotAModelFolder(f"{CONFIG} is not JSON") from None
    if not isinstance(config, dict):
        raise NotAModelFolder(f"{CONFIG} does not hold a JSON object")
    return {k: v for k, v in config.items() if k not in IGNORED_CONFIG_KEYS}


def _header(fd: int, name: str, size: int) -> dict[str, Tensor]:
    if size < 8:
        raise NotAModelFolder(f"{name} is not a safetensors file (too short)")
    (length,) = struct.unpack("<Q", _read_exactly(fd, 8, name))
    if length > min(MAX_HEADER_BYTES, size - 8):
        raise NotAModelFolder(f"{name} is not a safetensors file (its header length is {length:,} bytes)")
    try:
        header = json.loads(_read_exactly(fd, length, name))
    except ValueError:
        raise NotAModelFolder(f"{name} is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise NotAModelFolder(f"{name} is not a safetensors file (its header is not an object)")
    start, found = 8 + length, {}
    for tensor, entry in header.items():
        if tensor == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            count = 1
            for dim in shape:
                count *= dim
            valid = all(isinstance(d, int) and d >= 0 for d in shape) and 0 <= begin <= end <= size - start
            valid = valid and end - begin == count * ITEM_BYTES[dtype]
        except (KeyError, TypeError, ValueError):
            valid = False
        if not valid:
            raise NotAModelFolder(f"{name} is not a valid safetensors file (tensor {str(tensor)[:100]!r})")
        found[tensor] = Tensor(dtype, shape, name, start + begin, start + end)
    return found


def read_folder(folder: Path) -> Folder:
    """The folder's config and tensor table (headers only); NotAModelFolder saying why not."""
    names = []
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                names.append(entry.name)
                if len(names) > MAX_ENTRIES:
                    raise NotAModelFolder(f"the folder holds over {MAX_ENTRIES:,} entries: not a model folder")
    except OSError as exc:
        raise NotAModelFolder(f"the folder cannot be listed ({exc.strerror})") from None
    names.sort()
    files = [n for n in names if n.endswith(".safetensors")]
    if CONFIG not in names:
        raise NotAModelFolder(f"the folder holds no {CONFIG}")
    if not files:
        raise NotAModelFolder("the folder holds no *.safetensors file (weights in another format cannot be compared)")
    if len(files) > MAX_FILES:
        raise NotAModelFolder(f"the folder holds over {MAX_FILES} safetensors files")
    config = _config(folder)
    tensors: dict[str, Tensor] = {}
    signature = []
    headers = 0
    for name in files:
        fd = _open(folder / name)
        try:
            st = os.fstat(fd)
            signature.append((name, st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev))
            table = _header(fd, name, st.st_size)
            headers += os.lseek(fd, 0, os.SEEK_CUR)
            if headers > MAX_HEADER_BYTES:
                raise NotAModelFolder(f"the safetensors headers add up to over {MAX_HEADER_BYTES:,} bytes")
            for tensor, found in table.items():
                if tensor in tensors:
                    raise NotAModelFolder(f"tensor {tensor[:100]!r} is in both {tensors[tensor].file} and {name}")
                tensors[tensor] = found
        finally:
            os.close(fd)
    st = os.stat(folder / CONFIG)
    signature.append((CONFIG, st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev))
    return Folder(folder, config, tensors, tuple(signature))


def _sha256_of(fd: int, begin: int, end: int, name: str) -> str:
    digest = hashlib.sha256()
    os.lseek(fd, begin, os.SEEK_SET)
    left = end - begin
    while left:
        part = os.read(fd, min(left, CHUNK))
        if not part:
            raise NotAModelFolder(f"{name} ends early (changed while it was read?)")
        digest.update(part)
        left -= len(part)
    return digest.hexdigest()


def config_sha256(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def fingerprint(folder: Folder) -> ModelFingerprint:
    """Hash every tensor's bytes (the folder's whole weights: call `differences_in_headers` first)."""
    hashes: dict[str, str] = {}
    by_file: dict[str, list[str]] = {}
    for tensor, found in folder.tensors.items():
        by_file.setdefault(found.file, []).append(tensor)
    for file, tensors in by_file.items():
        fd = _open(folder.path / file)
        try:
            for tensor in sorted(tensors, key=lambda t: folder.tensors[t].begin):
                found = folder.tensors[tensor]
                hashes[tensor] = _sha256_of(fd, found.begin, found.end, file)
        finally:
            os.close(fd)
    lines = [f"{t} {folder.tensors[t].described} {hashes[t]}\n" for t in sorted(hashes)]
    return ModelFingerprint(
        config_sha256=config_sha256(folder.config),
        config=folder.config,
        weights_sha256=hashlib.sha256("".join(lines).encode()).hexdigest(),
        tensors={t: f"{folder.tensors[t].described} {hashes[t][:16]}" for t in sorted(hashes)},
        bytes=sum(t.end - t.begin for t in folder.tensors.values()),
    )


def _shown(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 60 else text[:57] + "..."


def _listed(items: list[str], limit: int = 5) -> str:
    return ", ".join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")


def config_differences(config: dict[str, Any], served: ModelFingerprint) -> list[str]:
    """Each config key whose value differs: `num_hidden_layers (6 here, 4 served)`."""
    keys = sorted(set(config) | set(served.config))
    missing = object()
    found = []
    for key in keys:
        mine, theirs = config.get(key, missing), served.config.get(key, missing)
        if mine != theirs:
            here = "absent" if mine is missing else _shown(mine)
            there = "absent" if theirs is missing else _shown(theirs)
            found.append(f"{key} ({here} here, {there} served)")
    return found


def header_differences(folder: Folder, served: ModelFingerprint) -> list[str]:
    """What differs from the served model before any data is read: config keys, tensor names,
    dtypes and shapes. Empty: the data decides."""
    said = []
    config = config_differences(folder.config, served)
    if config:
        said.append(f"{CONFIG} differs: {_listed(config)}")
    theirs = {t: d.rsplit(" ", 1)[0] for t, d in served.tensors.items()}
    missing = sorted(set(theirs) - set(folder.tensors))
    extra = sorted(set(folder.tensors) - set(theirs))
    if missing:
        said.append(f"tensors the served model has are missing: {_listed(missing)}")
    if extra:
        said.append(f"tensors the served model lacks: {_listed(extra)}")
    reshaped = [
        f"{t} ({folder.tensors[t].described} here, {theirs[t]} served)"
        for t in sorted(set(theirs) & set(folder.tensors))
        if folder.tensors[t].described != theirs[t]
    ]
    if reshaped:
        said.append(f"tensors differ in dtype or shape: {_listed(reshaped)}")
    return said


def weight_differences(mine: ModelFingerprint, served: ModelFingerprint) -> list[str]:
    """The tensors whose bytes differ (after `header_differences` found nothing)."""
    if mine.weights_sha256 == served.weights_sha256:
        return []
    changed = sorted(t for t, d in mine.tensors.items() if served.tensors.get(t) != d)
    if not changed:
        return ["the weights differ from the served ones"]
    count = f"{len(changed)} of {len(served.tensors)}"
    return [f"the weights differ from the served ones in {count} tensors: {_listed(changed)}"]
