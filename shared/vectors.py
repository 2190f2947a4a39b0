"""Uploaded vector sets (steering vectors for interventions): one safetensors file of 1-D `[W]` or
2-D `[n, W]` float tensors, checked whole on upload, stored at `vectors/<id>/vectors.safetensors`
and recorded in Redis per API key, with no expiry (a set lives until it is deleted).

The upload is parsed here, not by the safetensors library: the API must say exactly what is wrong
with a file a user sent (a header past the end, a gap between tensors, a NaN in `layer.3`), and
it must not trust a header's offsets before checking them. The worker reads a set back with
`load_vector`, which checks the stored file's sha256 first: a file changed in the store is an
error, never a silently different intervention. numpy only, no torch: the API imports this."""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
import uuid
from datetime import UTC, datetime
from typing import Annotated, Any, cast

import numpy as np
import redis
from pydantic import Field

from shared import keys
from shared.errors import InvalidVectors, StorageError, TensorNotFound, TooManyVectorSets, VectorSetNotFound
from shared.schemas import Strict
from shared.storage.base import ArtifactStore

MAX_TENSORS = 256
MAX_WIDTH = 1_048_576
MAX_METADATA_ENTRIES = 64
MAX_METADATA_CHARS = 1000
MAX_LABEL_CHARS = 200
# A header holding the most tensors and metadata allowed is well under this; a larger one is
# refused before it is parsed (a header of millions of tiny entries would cost far more memory
# as Python objects than as bytes).
MAX_HEADER_BYTES = 1 << 20
FLOAT32_MAX = float(np.finfo(np.float32).max)
# safetensors code -> how its bytes are read (BF16: the raw 16 bits, widened by `_decode`)
DTYPES: dict[str, str] = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "BF16": "<u2"}
_NAME = re.compile(r"[A-Za-z0-9_.:/-]{1,200}")
_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")
_ENTRY_FIELDS = {"dtype", "shape", "data_offsets"}

# Add a set unless its owner already holds `limit` (> 0) of them: the count and the write in one
# step, so concurrent uploads cannot pass the limit together.
_CREATE = """
local limit = tonumber(ARGV[4])
if limit > 0 and redis.call('ZCARD', KEYS[2]) >= limit then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[3])
return 1
"""


class VectorInfo(Strict):
    shape: list[int]  # [W] or [n, W]
    dtype: str  # the safetensors code: F32, F16, BF16 or F64


class VectorSet(Strict):
    """What Redis keeps for an uploaded vector set (and what the API answers)."""

    id: str
    owner: str | None = None  # id of the API key that uploaded it; others get 404
    label: Annotated[str, Field(max_length=MAX_LABEL_CHARS)] | None = None
    created_at: datetime
    key: str  # where the file is in the artifact store
    sha256: str  # of the whole file: load_vector checks it
    bytes: int
    tensors: dict[str, VectorInfo]
    metadata: dict[str, str] = {}  # the file's safetensors `__metadata__`


def is_vector_id(text: str) -> bool:
    """Vector set ids are uuid4s; anything else is unknown before any key is built from it."""
    return _ID.fullmatch(text) is not None


def vector_prefix(vector_id: str) -> str:
    return f"vectors/{vector_id}"


def vector_key(vector_id: str) -> str:
    return f"vectors/{vector_id}/vectors.safetensors"


def new_vector_set(data: bytes, owner: str | None, label: str | None = None) -> VectorSet:
    """The record of an upload, once `validate_file` has accepted it (raises InvalidVectors)."""
    tensors, metadata = validate_file(data)
    vector_id = str(uuid.uuid4())
    return VectorSet(
        id=vector_id,
        owner=owner,
        label=label,
        created_at=datetime.now(UTC),
        key=vector_key(vector_id),
        sha256=hashlib.sha256(data).hexdigest(),
        bytes=len(data),
        tensors=tensors,
        metadata=metadata,
    )


# -- the file ------------------------------------------------------------------------------------


class _Entry:
    """One tensor of a checked file: where its bytes are (absolute offsets into the file)."""

    def __init__(self, name: str, dtype: str, shape: list[int], begin: int, end: int) -> None:
        self.name, self.dtype, self.shape, self.begin, self.end = name, dtype, shape, begin, end

    @property
    def count(self) -> int:
        return math.prod(self.shape)


def _bad(text: str) -> InvalidVectors:
    return InvalidVectors(f"not a safetensors file: {text}")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """JSON allows a name twice (the last would silently win); a header must not."""
    seen: set[str] = set()
    for name, _ in pairs:
        if name in seen:
            raise _bad(f"its header names {name[:50]!r} twice")
        seen.add(name)
    return dict(pairs)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse(data: bytes, max_tensors: int, max_width: int) -> tuple[list[_Entry], dict[str, str]]:
    """The header of a whole file, every check but the values'; entries in file order."""
    if len(data) < 8:
        raise _bad(f"the body has {len(data)} bytes; a file starts with an 8-byte header length")
    (length,) = struct.unpack("<Q", data[:8])
    if length < 2 or 8 + length > len(data):
        raise _bad(
            f"its header length ({length:,} bytes) does not fit in the {len(data):,}-byte body "
            "(a truncated or different kind of file?)"
        )
    if length > MAX_HEADER_BYTES:
        raise InvalidVectors(f"the file's header is {length:,} bytes; a vector set's is at most {MAX_HEADER_BYTES:,}")
    try:
        header = json.loads(data[8 : 8 + length].decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise _bad("its header is not UTF-8 JSON") from None
    if not isinstance(header, dict):
        raise _bad("its header is not a JSON object")
    metadata = _metadata(header.pop("__metadata__", {}))
    if not header:
        raise InvalidVectors("the file holds no tensors; a vector set needs at least one")
    if len(header) > max_tensors:
        raise InvalidVectors(f"the file holds {len(header)} tensors; a vector set holds at most {max_tensors}")
    entries = [_entry(name, info, 8 + length, max_width) for name, info in header.items()]
    at = 8 + length
    for entry in sorted(entries, key=lambda e: e.begin):
        if entry.begin != at:
            where = (
                "overlaps the one before it"
                if entry.begin < at
                else f"leaves {entry.begin - at} bytes unused before it"
            )
            raise _bad(f"tensor {entry.name!r}: its data_offsets do not follow on (it {where})")
        at = entry.end
    if at != len(data):
        raise _bad(
            f"the tensors' data_offsets end at byte {at - 8 - length:,}; the data after the header "
            f"is {len(data) - 8 - length:,} bytes"
        )
    return entries, metadata


def _metadata(value: object) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise _bad("its __metadata__ must map strings to strings")
    if len(value) > MAX_METADATA_ENTRIES:
        raise InvalidVectors(f"__metadata__ has {len(value)} entries; at most {MAX_METADATA_ENTRIES} are kept")
    long = [k for k, v in value.items() if len(k) > MAX_METADATA_CHARS or len(v) > MAX_METADATA_CHARS]
    if long:
        raise InvalidVectors(
            f"__metadata__ entry {long[0][:50]!r} is over {MAX_METADATA_CHARS} characters (key or value); shorten it"
        )
    return cast("dict[str, str]", value)


def _entry(name: str, info: object, data_start: int, max_width: int) -> _Entry:
    if not _NAME.fullmatch(name):
        raise InvalidVectors(f"tensor name {name[:50]!r}: use 1 to 200 characters among letters, digits and _ . : / -")
    if not isinstance(info, dict) or set(info) != _ENTRY_FIELDS:
        raise _bad(f"tensor {name!r} must have exactly dtype, shape and data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise InvalidVectors(f"tensor {name!r} is {str(dtype)[:20]!r}; vectors are F32, F16, BF16 or F64")
    if not isinstance(shape, list) or not all(_is_int(d) for d in shape):
        raise _bad(f"tensor {name!r} has a shape that is not a list of integers")
    if len(shape) not in (1, 2) or min(shape) < 1:
        raise InvalidVectors(
            f"tensor {name!r} has shape {shape}; a vector set holds [width] or [n, width] tensors, no dimension 0"
        )
    if shape[-1] > max_width:
        raise InvalidVectors(f"tensor {name!r} is {shape[-1]:,} wide; at most {max_width:,}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) and o >= 0 for o in offsets):
        raise _bad(f"tensor {name!r}: data_offsets must be [begin, end]")
    size = math.prod(shape) * np.dtype(DTYPES[dtype]).itemsize
    if offsets[1] - offsets[0] != size:
        raise _bad(
            f"tensor {name!r}: data_offsets {offsets} span {offsets[1] - offsets[0]} bytes; {dtype} {shape} is {size}"
        )
    return _Entry(name, dtype, list(shape), data_start + offsets[0], data_start + offsets[1])


def _decode(data: bytes, entry: _Entry) -> np.ndarray:
    """A tensor's values as stored (F16, F32, F64), BF16 widened to float32 (exactly)."""
    raw = np.frombuffer(data, dtype=DTYPES[entry.dtype], count=entry.count, offset=entry.begin)
    if entry.dtype == "BF16":  # bfloat16 is float32's top 16 bits
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw


def validate_file(
    data: bytes, max_tensors: int = MAX_TENSORS, max_width: int = MAX_WIDTH
) -> tuple[dict[str, VectorInfo], dict[str, str]]:
    """Check an uploaded file whole: its header (length, JSON, names, dtypes, shapes, offsets that
    tile the data exactly) and every value (finite). Returns its tensors and `__metadata__`;
    raises InvalidVectors (422) saying what to fix."""
    entries, metadata = _parse(data, max_tensors, max_width)
    for entry in entries:
        values = _decode(data, entry)
        bad = entry.count - int(np.count_nonzero(np.isfinite(values)))
        if bad:
            raise InvalidVectors(
                f"tensor {entry.name!r} has {bad} non-finite values (NaN or inf); vectors must be finite"
            )
        if entry.dtype == "F64" and float(np.abs(values).max()) > FLOAT32_MAX:
            raise InvalidVectors(
                f"tensor {entry.name!r} has values beyond float32's range (|v| > {FLOAT32_MAX:.3g}); "
                "vectors are applied as float32 at most"
            )
    return {e.name: VectorInfo(shape=e.shape, dtype=e.dtype) for e in entries}, metadata


def load_vector(store: ArtifactStore, record: VectorSet, name: str) -> np.ndarray:
    """One tensor of a stored set as float32 `[W]` or `[n, W]` (the worker's read). The whole
    file is read and its sha256 checked against the record first (StorageError if it differs)."""
    if name not in record.tensors:
        raise TensorNotFound(
            f"no tensor named {name!r} in vector set {record.id}; tensors: {', '.join(sorted(record.tensors))}"
        )
    data = store.read_range(record.key, 0, record.bytes + 1)  # one byte more: a longer file shows
    if len(data) != record.bytes or hashlib.sha256(data).hexdigest() != record.sha256:
        raise StorageError(f"vector set {record.id} changed in the store (its sha256 no longer matches)")
    widest = max(info.shape[-1] for info in record.tensors.values())
    entries, _ = _parse(data, len(record.tensors), widest)  # the header checked at upload, unchanged
    entry = next(e for e in entries if e.name == name)
    return _decode(data, entry).astype(np.float32).reshape(entry.shape)


# -- the records ---------------------------------------------------------------------------------


class VectorSets:
    """Vector set records in Redis: `keys.vector_set(id)` (JSON) and a per-owner index. With
    `max_per_owner` > 0, an owner holds at most that many (TooManyVectorSets, 429, beyond)."""

    def __init__(self, client: redis.Redis, store: ArtifactStore, max_per_owner: int = 0) -> None:
        self.redis = client
        self.store = store
        self.max_per_owner = max_per_owner

    def _full(self) -> TooManyVectorSets:
        return TooManyVectorSets(
            f"this API key holds {self.max_per_owner} vector sets (ACTQ_MAX_VECTOR_SETS_PER_KEY); "
            "delete some (DELETE /vectors/{id}) before uploading more"
        )

    def check_room(self, owner: str | None) -> None:
        """Raise TooManyVectorSets when `owner` is at the limit: before a file is stored for nothing."""
        if self.max_per_owner and self.redis.zcard(keys.vector_sets_index(owner)) >= self.max_per_owner:
            raise self._full()

    def create(self, record: VectorSet) -> None:
        """Record a set whose file is stored; the limit is checked in the same step."""
        argv: list[str | int] = [
            record.model_dump_json(),
            repr(record.created_at.timestamp()),
            record.id,
            self.max_per_owner,
        ]
        index = keys.vector_sets_index(record.owner)
        if not self.redis.eval(_CREATE, 2, keys.vector_set(record.id), index, *argv):
            raise self._full()

    def get(self, vector_id: str, owner: str | None, check_owner: bool = True) -> VectorSet:
        """A set of `owner`'s; a malformed id, an unknown one and another owner's set are all
        VectorSetNotFound with the same message. `check_owner=False` (API keys off, as for jobs):
        any set with that id."""
        raw = self.redis.get(keys.vector_set(vector_id)) if is_vector_id(vector_id) else None
        record = VectorSet.model_validate_json(cast(bytes, raw)) if raw is not None else None
        if record is None or (check_owner and record.owner != owner):
            raise VectorSetNotFound(f"no vector set with id {vector_id!r}")
        return record

    def list(self, owner: str | None, limit: int) -> list[VectorSet]:
        """`owner`'s sets, newest first."""
        ids = [
            i.decode() for i in cast("list[bytes]", self.redis.zrevrange(keys.vector_sets_index(owner), 0, limit - 1))
        ]
        raws = cast("list[bytes | None]", self.redis.mget([keys.vector_set(i) for i in ids])) if ids else []
        return [VectorSet.model_validate_json(raw) for raw in raws if raw is not None]

    def delete(self, vector_id: str, owner: str | None, check_owner: bool = True) -> None:
        """The stored file first, then the record: a failure leaves a record that can be deleted again."""
        record = self.get(vector_id, owner, check_owner)
        self.store.delete_prefix(vector_prefix(record.id))
        with self.redis.pipeline() as pipe:
            pipe.delete(keys.vector_set(record.id))
            pipe.zrem(keys.vector_sets_index(record.owner), record.id)
            pipe.execute()
