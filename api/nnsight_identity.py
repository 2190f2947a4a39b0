"""Whether the model an nnsight client names is one a worker serves, weights and all
(docs/nnsight.md, "Which model"). nnsight's client builds its model on the meta device and names
it in the request by its `repo_id`: a Hub id, a folder, or whatever `huggingface._ID_CACHE` maps
the folder to. actq accepts:

- the served model's own name (`ACTQ_MODEL_NAME`): the client asks for what is served;
- the Hub id a worker loaded its model by (then the weights are that id's);
- a folder the API can read whose config and weights are the served model's (shared/model_identity.py).

Refused, naming what differs: a folder that merely has the served model's name, a fine-tuned or
re-quantized copy, the Hub id a served model was only *made from* (the built-in model is a Q4_1
GGUF dequantized: not the Hub's bf16 weights), a folder the API cannot read (it cannot be
verified), a relative or unnormalised path. A folder's fingerprint is kept per path while its
files' sizes, times and inodes stay the same, so a folder is hashed once.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path

from shared import model_identity as identity
from shared.errors import BadRequest
from shared.schemas import ModelFingerprint, ModelInfo

SECTION = 'docs/nnsight.md, "Which model"'
MAX_PATH = 4096
_KEPT = 16  # folders whose fingerprints are kept
_lock = threading.Lock()  # one folder hashed at a time: a second request for it waits and reuses the first's
_kept: OrderedDict[str, tuple[tuple, identity.Folder, ModelFingerprint | None]] = OrderedDict()


def looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~", ".\\")) or "\\" in name or name.count("/") > 1


def _by_name(name: str, infos: list[ModelInfo]) -> ModelInfo:
    for info in infos:
        if name == info.name or (name == info.source and not looks_like_path(info.source)):
            return info
    for info in infos:
        if name == info.hub_id:
            raise BadRequest(
                f"the model key names {name!r}: {info.name} was made from that Hub checkpoint but does not serve its "
                "weights (it serves a converted copy: the built-in model is the checkpoint's Q4_1 GGUF, dequantized, "
                "and its logits differ from the Hub's bf16 weights). Name the served model: build the client's model "
                f"from the folder `actq prepare-model` prints, or map your folder to the served name with "
                f"`huggingface._ID_CACHE[folder] = {info.name!r}` ({SECTION})"
            )
    shown = "; ".join(f"{i.name}" + (f" (Hub id {i.source})" if not looks_like_path(i.source) else "") for i in infos)
    raise BadRequest(
        f"the model key names {name!r}, which is not served here. Served: {shown}. Name one of them, by its name "
        f"(`huggingface._ID_CACHE[folder] = name`), or by a folder holding its files ({SECTION})"
    )


def _folder(name: str) -> Path:
    """The folder a path-like repo id names, resolved once; refused unless absolute and normalised."""
    if len(name) > MAX_PATH or "\x00" in name:
        raise BadRequest("the model key's repo_id is not a usable path")
    if not os.path.isabs(name):
        raise BadRequest(
            f"the model key names the folder {name[:200]!r} by a relative path, which the API cannot resolve: build "
            f"the client's model from the folder's absolute path ({SECTION})"
        )
    normal = os.path.normpath(name)
    if name not in (normal, normal + "/"):
        raise BadRequest(
            f"the model key names the folder {name[:200]!r}, which is not a normalised path (no `.`, `..` or `//`): "
            f"use {normal[:200]!r}"
        )
    real = Path(os.path.realpath(normal))
    if not real.is_dir():
        raise BadRequest(
            f"the model key names the folder {name[:200]!r}, which the API cannot read on its host, so it cannot be "
            "compared with the served model. From another machine, name the served model instead: "
            f"`huggingface._ID_CACHE[folder] = '<served name>'` ({SECTION})"
        )
    return real


def _signature(folder: Path) -> tuple:
    """The files a fingerprint reads, with their sizes, times and inodes (changes when a file does)."""
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors") or n == identity.CONFIG)
        stats = [(n, os.stat(folder / n)) for n in names[: identity.MAX_FILES + 1]]
    except OSError:
        return ()
    return tuple((n, s.st_size, s.st_mtime_ns, s.st_ino, s.st_dev) for n, s in stats)


def _read(folder: Path) -> tuple[tuple, identity.Folder, ModelFingerprint | None]:
    signature = _signature(folder)
    kept = _kept.get(str(folder))
    if kept is not None and kept[0] == signature and signature:
        _kept.move_to_end(str(folder))
        return kept
    found = identity.read_folder(folder)
    entry = (signature, found, None)
    _keep(folder, entry)
    return entry


def _keep(folder: Path, entry: tuple[tuple, identity.Folder, ModelFingerprint | None]) -> None:
    _kept[str(folder)] = entry
    _kept.move_to_end(str(folder))
    while len(_kept) > _KEPT:
        _kept.popitem(last=False)


def _compare(folder: Path, info: ModelInfo) -> list[str]:
    """What differs between the folder and the served model (empty: the same model)."""
    assert info.fingerprint is not None
    signature, found, weights = _read(folder)
    differ = identity.header_differences(found, info.fingerprint)
    if differ:
        return differ
    if weights is None:  # headers agree: the data is as large as the served model's, and read once
        weights = identity.fingerprint(found)
        _keep(folder, (signature, found, weights))
    return identity.weight_differences(weights, info.fingerprint)


def _by_folder(name: str, infos: list[ModelInfo]) -> ModelInfo:
    folder = _folder(name)
    known = [i for i in infos if i.fingerprint is not None]
    if not known:
        names = ", ".join(repr(i.name) for i in infos)
        raise BadRequest(
            f"the model key names the folder {name[:200]!r}, but no served model publishes the fingerprint of its "
            f"weights (its worker predates this check, or its files are not safetensors), so no folder can be "
            f"compared with it: name the served model instead ({names}: `huggingface._ID_CACHE[folder] = name`)"
        )
    closest: tuple[tuple[bool, int], ModelInfo, list[str]] | None = None  # named like the folder first
    with _lock:
        for info in known:
            try:
                differ = _compare(folder, info)
            except identity.NotAModelFolder as exc:
                raise BadRequest(
                    f"the model key names the folder {name[:200]!r}, which cannot be compared with the served model: "
                    f"{exc}. Use a folder holding the served model's config.json and safetensors ({SECTION})"
                ) from None
            if not differ:
                return info
            rank = (folder.name not in (info.name, Path(info.source).name), len(differ))
            if closest is None or rank < closest[0]:
                closest = (rank, info, differ)
    assert closest is not None
    _, info, differ = closest
    raise BadRequest(
        f"the folder {name[:200]!r} is not the model served as {info.name}: {'; '.join(differ)}. nnsight runs your "
        f"code on the served weights, never on your folder's, so its results would not be your model's. Use a folder "
        f"holding the served files (`actq prepare-model` prints the built-in's), or serve your model with a worker "
        f"of its own (ACTQ_MODEL={name[:200]}) ({SECTION})"
    )


def served_as(name: str, infos: list[ModelInfo]) -> ModelInfo:
    """The served model a client's repo id identifies; BadRequest saying what differs otherwise.
    May read and hash a folder: call it off the event loop."""
    return _by_folder(name, infos) if looks_like_path(name) else _by_name(name, infos)
