"""The values an intervention names by reference: a row (or the mean of the rows) of an earlier
job's captured tensor, or the rows a `patch` copies from one. The API reads them at submit to
check them (the caller's job, the same model, the module's width, every value finite) and the
worker reads them again, through the same code, when it prepares the job; the bytes read are
checked against the sha256 the source job's manifest recorded.

numpy only: the API process does not load torch.
"""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np

from shared.errors import InterventionError, StorageError, UnreadableRecord, VectorSetNotFound
from shared.interventions import JobVector, PatchSource, SetVector
from shared.jobs import JobStore
from shared.schemas import JobStatus, TensorInfo
from shared.storage.base import ArtifactStore
from shared.storage.tensors import read_tensor

MAX_REFERENCE_BYTES = 256 << 20  # the most one reference reads (a patch source's rows)


def to_float32(data: bytes, code: str, shape: list[int]) -> np.ndarray:
    """A safetensors tensor's bytes (`code`: F32, F16, BF16, F64) as float32 of `shape`."""
    if code == "BF16":
        bits = np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16
        values = bits.view(np.float32)
    else:
        kinds = {"F32": "<f4", "F16": "<f2", "F64": "<f8"}
        if code not in kinds:
            raise StorageError(f"a {code} tensor is not a floating-point activation")
        values = np.frombuffer(data, dtype=kinds[code]).astype(np.float32)
    return values.reshape(shape)


def _rows(store: ArtifactStore, key: str, info: TensorInfo, rows: tuple[int, int]) -> np.ndarray:
    """Rows [a, b) of a stored tensor as float32, checked against its recorded sha256 when all
    of it was read."""
    raw = read_tensor(store, key, info.name, rows)
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    entry = header[info.name]
    data = raw[8 + length :]
    if rows == (0, info.shape[0]) and info.sha256 is not None and hashlib.sha256(data).hexdigest() != info.sha256:
        raise StorageError(f"tensor {info.name!r} of job {key.split('/')[1]} changed in the store since it was written")
    return to_float32(data, entry["dtype"], list(entry["shape"]))


def _source(
    jobs: JobStore, owner: str | None, check_owner: bool, job_id: str, tensor: str, model: str, where: str
) -> tuple[TensorInfo, str]:
    """The source job's tensor (its manifest entry) and the file's key, or why it cannot be used."""
    try:
        record = jobs.get(job_id)
    except UnreadableRecord as exc:  # a newer version wrote it: named to its owner only
        if check_owner and exc.owner != owner:
            raise InterventionError(f"{where}: no job with id {job_id!r}") from None
        raise InterventionError(f"{where}: {exc.message}") from None
    if record is None or (check_owner and record.owner != owner):
        raise InterventionError(f"{where}: no job with id {job_id!r}")
    if record.model != model:
        raise InterventionError(
            f"{where}: job {job_id} ran model {record.model!r}, not {model!r}: its activations do not fit this model"
        )
    if record.status is not JobStatus.succeeded or record.activations is None:
        raise InterventionError(f"{where}: job {job_id} is {record.status.value} with no activations to read")
    for info in record.activations.tensors:
        if info.name == tensor:
            return info, record.activations.key
    known = ", ".join(t.name for t in record.activations.tensors)
    raise InterventionError(f"{where}: job {job_id} has no tensor {tensor!r}; its tensors: {known}")


def _finite(values: np.ndarray, where: str) -> np.ndarray:
    bad = int(np.count_nonzero(~np.isfinite(values)))
    if bad:
        raise InterventionError(f"{where}: {bad} of its values are not finite (NaN or inf); pick another row or job")
    return values


def job_vector(
    jobs: JobStore,
    store: ArtifactStore,
    ref: JobVector,
    model: str,
    width: int,
    owner: str | None,
    check_owner: bool,
    where: str,
) -> np.ndarray:
    """`[width]` float32: the row (or mean of rows) `ref` names."""
    info, key = _source(jobs, owner, check_owner, ref.job, ref.tensor, model, where)
    if info.features is not None or info.shape[-1] != width:
        kept = f"{len(info.features)} kept features" if info.features is not None else f"{info.shape[-1]} wide"
        raise InterventionError(
            f"{where}: tensor {ref.tensor!r} of job {ref.job} is {kept}; this module is {width} wide"
        )
    count = info.shape[0]
    if ref.mean:
        if count * width * 4 > MAX_REFERENCE_BYTES:
            raise InterventionError(f"{where}: the mean of {count} rows reads too much; take one row")
        return _finite(_rows(store, key, info, (0, count)).astype(np.float64).mean(axis=0).astype(np.float32), where)
    assert ref.row is not None
    row = ref.row + count if ref.row < 0 else ref.row
    if not 0 <= row < count:
        raise InterventionError(f"{where}: row {ref.row} is out of range: tensor {ref.tensor!r} has {count} rows")
    return _finite(_rows(store, key, info, (row, row + 1))[0], where)


def patch_rows(
    jobs: JobStore,
    store: ArtifactStore,
    source: PatchSource,
    model: str,
    module: str,
    hook: str,
    width: int,
    owner: str | None,
    check_owner: bool,
    where: str,
) -> tuple[int, np.ndarray]:
    """(token position of the first row, rows `[n, width]` float32) a patch copies from."""
    info, key = _source(jobs, owner, check_owner, source.job, source.tensor, model, where)
    if info.module != module or info.hook != hook:
        raise InterventionError(
            f"{where}: tensor {source.tensor!r} is the {info.hook} of {info.module!r}; this edit is the {hook} of "
            f"{module!r}: patch from a capture of the same module and hook"
        )
    if info.reduce != "none" or info.features is not None or info.positions == "last":
        raise InterventionError(
            f"{where}: tensor {source.tensor!r} was reduced or cut (reduce, features or positions 'last'): a patch "
            "needs one full row per position"
        )
    if info.shape[0] * width * 4 > MAX_REFERENCE_BYTES:
        raise InterventionError(f"{where}: tensor {source.tensor!r} is too large to patch from")
    return info.start, _finite(_rows(store, key, info, (0, info.shape[0])), where)


def set_vector(
    jobs: JobStore, store: ArtifactStore, ref: SetVector, width: int, owner: str | None, check_owner: bool, where: str
) -> np.ndarray:
    """`[width]` float32: a tensor (or one row of it) of an uploaded vector set (the caller's)."""
    from shared.vectors import VectorSets, load_vector

    try:
        record = VectorSets(jobs.redis, store).get(ref.vector_id, owner, check_owner)
    except VectorSetNotFound:
        raise InterventionError(f"{where}: no vector set with id {ref.vector_id!r}") from None
    info = record.tensors.get(ref.name)
    if info is None:
        known = ", ".join(sorted(record.tensors))
        raise InterventionError(f"{where}: vector set {ref.vector_id} has no tensor {ref.name!r}; its tensors: {known}")
    if info.shape[-1] != width:
        raise InterventionError(
            f"{where}: tensor {ref.name!r} of vector set {ref.vector_id} is {info.shape[-1]} wide; "
            f"this module is {width}"
        )
    if len(info.shape) == 2 and ref.row is None:
        raise InterventionError(f"{where}: tensor {ref.name!r} is {info.shape[0]} vectors; pick one with `row`")
    if len(info.shape) == 1 and ref.row is not None:
        raise InterventionError(f"{where}: tensor {ref.name!r} is one vector; leave out `row`")
    values = load_vector(store, record, ref.name)
    if ref.row is None:
        return values
    row = ref.row + info.shape[0] if ref.row < 0 else ref.row
    if not 0 <= row < info.shape[0]:
        raise InterventionError(f"{where}: row {ref.row} is out of range: tensor {ref.name!r} has {info.shape[0]} rows")
    return values[row]


class References:
    """The stored values one job's interventions name, read for the API's checks and again by the
    worker (`owner`: the job's API key; `check_owner`: whether keys are on)."""

    def __init__(
        self,
        jobs: JobStore,
        store: ArtifactStore,
        model: str,
        owner: str | None,
        check_owner: bool,
        memo: dict | None = None,
    ) -> None:
        self.jobs, self.store, self.model, self.owner, self.check_owner = jobs, store, model, owner, check_owner
        # what was read already (a batch of jobs naming one vector reads it once); keyed by caller too
        self.memo = {} if memo is None else memo

    def vector(self, ref: JobVector | SetVector, width: int, where: str) -> np.ndarray:
        key = ("vector", self.owner, self.model, ref.model_dump_json(), width)
        if key not in self.memo:
            if isinstance(ref, JobVector):
                found = job_vector(self.jobs, self.store, ref, self.model, width, self.owner, self.check_owner, where)
            else:
                found = set_vector(self.jobs, self.store, ref, width, self.owner, self.check_owner, where)
            self.memo[key] = found
        return self.memo[key]

    def patch(self, source: PatchSource, module: str, hook: str, width: int, where: str) -> tuple[int, np.ndarray]:
        key = ("patch", self.owner, self.model, source.model_dump_json(), module, hook, width)
        if key not in self.memo:
            self.memo[key] = patch_rows(
                self.jobs, self.store, source, self.model, module, hook, width, self.owner, self.check_owner, where
            )
        return self.memo[key]
