"""Publishing a job's written activations file: stored under its attempt's folder, then its
manifest beside it (worker/results/artifacts.py writes the file in the engine's process,
worker/results/store_process.py in the store process). Nothing here needs torch."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

from shared.errors import StorageError
from shared.schemas import ActivationsManifest, TensorInfo
from shared.storage import ArtifactStore, activations_key, manifest_key

log = logging.getLogger(__name__)


def scratch_file(store: ArtifactStore) -> Path:
    """A new empty file in the store's scratch folder (what `publish` stores)."""
    try:
        fd, name = tempfile.mkstemp(dir=store.scratch_dir(), suffix=".safetensors")
        os.close(fd)
    except OSError as exc:
        raise StorageError(f"cannot write activations: {exc.strerror or exc}") from exc
    return Path(name)


def publish(
    store: ArtifactStore,
    job_id: str,
    model: str,
    metadata: dict[str, str],
    entries: list[dict],
    extra: list[str],
    tmp: Path,
    size: int,
    sha: str,
    checksums: dict[str, str],
    prefix: str,
) -> ActivationsManifest:
    """Store the written file `tmp` (`size` bytes, sha256 `sha`, each tensor's in `checksums`)
    under `prefix`, then its manifest beside it; a file left without its manifest is removed."""
    key = activations_key(prefix)
    uri = store.put_file(key, tmp, sync_folder=False)  # the manifest's put, in this folder, syncs it
    infos = [TensorInfo(**entry, sha256=checksums[entry["name"]]) for entry in entries]
    others = {name: checksums[name] for name in ("token_ids", *extra)}
    manifest = ActivationsManifest(
        uri=uri, key=key, sha256=sha, bytes=size, tensors=infos, extra=extra, extra_sha256=others
    )
    document = {"job_id": job_id, "model": model, "metadata": metadata, **manifest.model_dump(exclude_none=True)}
    try:
        store.put_bytes(manifest_key(prefix), json.dumps(document).encode())  # indent would be the slow encoder
    except StorageError:  # remove the file that has no manifest (the job fails with the first error)
        try:
            store.delete_prefix(prefix)  # this attempt's alone: never another attempt's files
        except StorageError as exc:
            log.warning("job %s: activations without a manifest left at %s: %s", job_id, uri, exc.message)
        raise
    return manifest
