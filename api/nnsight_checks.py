"""What an nnsight request must pass before anything of it is stored (api/routes/nnsight.py):
the caller's key is one the operator trusts with code execution (ACTQ_NNSIGHT_KEYS), the
envelope is nnsight 0.8's, the client's nnsight and Python match the worker's closely enough
for its serialized objects to load, and the model key identifies the model a worker serves,
weights and all (api/nnsight_identity.py).

The payload itself is never read here: it is serialized code, and only the worker loads it."""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from api import nnsight_identity
from api.deps import Services, key_id, one_of
from shared.errors import BadRequest, Forbidden, Unauthorized, UnknownModel
from shared.schemas import ModelInfo

KEY_HEADER = "ndif-api-key"  # where nnsight's client sends its key
# The wrappers whose requests the worker can run: nnsight's transformers wrappers (LanguageModel's
# requests name TransformersModel).
CLASSES = ("nnsight.modeling.transformers.TransformersModel", "nnsight.modeling.language.LanguageModel")
SECTION = 'docs/nnsight.md, "Your own nnsight code"'


class Envelope(BaseModel):
    """The `data` form field of nnsight 0.8's POST /request (its RequestModel, without the blob)."""

    model_config = ConfigDict(extra="ignore")

    model_key: str
    session_id: str = ""
    compress: bool = False
    env: dict[str, Any] = {}


def nnsight_on(services: Services) -> list[str]:
    """The keys trusted with nnsight code; 403 when there are none (nnsight jobs are off)."""
    trusted = services.settings.nnsight_key_list
    if not trusted:
        raise Forbidden(
            "nnsight jobs run the sender's code as the worker, so a deployment serves them only to keys it names in "
            f"ACTQ_NNSIGHT_KEYS, and this one names none ({SECTION})"
        )
    return trusted


def trusted_caller(services: Services, key: str | None) -> str | None:
    """The caller's key id, when the key may send nnsight code; else 401 or 403 saying why."""
    settings = services.settings
    trusted = nnsight_on(services)
    if key is None:
        raise Unauthorized(
            f"send your actq API key as nnsight's API key (`{KEY_HEADER}` header: NDIF_API_KEY, or "
            "CONFIG.set_default_api_key)"
        )
    if not one_of(key, settings.api_key_list):
        raise Unauthorized("the API key is not valid")
    if not one_of(key, trusted):
        raise Forbidden(
            "this key may not send nnsight code: such code runs as the worker, so only keys in ACTQ_NNSIGHT_KEYS may; "
            "ask the operator, or use POST /jobs (declared capture and interventions)"
        )
    return key_id(key)


def check_env(env: dict[str, Any], info: ModelInfo) -> None:
    """nnsight's client always sends the attention implementation its model resolved to (so that
    a shared model runs as the client's would); actq runs the model as its worker loaded it, so
    that must be the worker's, and nothing else (a PEFT adapter) may come along."""
    others = sorted(k for k in env if k != "attn_implementation")
    if others:
        raise BadRequest(
            f"the request carries a per-request environment ({', '.join(others)}, e.g. a PEFT adapter): actq runs "
            "the model as its worker loaded it; build the client's model without it"
        )
    wanted = env.get("attn_implementation")
    if wanted is not None and info.attention is not None and wanted != info.attention:
        raise BadRequest(
            f"your model's attention implementation is {wanted!r}; the workers of {info.name} run "
            f"{info.attention!r}, and one model is shared by every job: build the client's model with "
            f"attn_implementation={info.attention!r}"
        )


def envelope(raw: str | None, max_bytes: int = 100_000) -> Envelope:
    if raw is None:
        raise BadRequest(
            "POST /request takes nnsight 0.8's multipart form: a `data` field (its RequestModel as JSON) and a `blob` "
            "file; send it with nnsight's client (`remote=True`) or actq's Client.nnsight"
        )
    if len(raw) > max_bytes:
        raise BadRequest(f"the `data` field is over {max_bytes:,} bytes; it holds only the request's envelope")
    try:
        found = Envelope.model_validate_json(raw)
    except ValidationError as exc:
        raise BadRequest(f"the `data` field is not nnsight's request envelope: {exc.errors()[0]['msg']}") from None
    return found


def _minor(text: str, parts: int) -> tuple[str, ...] | None:
    match = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    return None if match is None else match.groups()[:parts]


def check_versions(nnsight_version: str | None, python_version: str | None, info: ModelInfo) -> None:
    """The client's nnsight major.minor and Python major.minor are the worker's: its serialization of
    nnsight's objects and of code objects only loads there."""
    if info.nnsight_version is None:
        raise BadRequest(f"the workers of {info.name} do not have nnsight installed, so they cannot run nnsight jobs")
    client = _minor(nnsight_version or "", 2)
    if client is None:
        raise BadRequest(
            "the request does not say its nnsight version (`nnsight-version` header): send it with nnsight's own "
            f"client, nnsight {info.nnsight_version} (0.7 and older speak another protocol)"
        )
    if client != _minor(info.nnsight_version, 2):
        raise BadRequest(
            f"your nnsight is {nnsight_version}; the workers of {info.name} run nnsight {info.nnsight_version}: "
            f"install nnsight=={info.nnsight_version} (payloads serialize nnsight's objects, which change between "
            "minor versions; clients of 0.7 and older speak another protocol)"
        )
    python, served = _minor(python_version or "", 2), _minor(info.python_version or "", 2)
    wanted = ".".join(served or ("?",))
    if python is None:
        raise BadRequest(
            "the request does not say its Python version (`python-version` header): send it with nnsight's own "
            f"client, on Python {wanted}"
        )
    if python != served:
        raise BadRequest(
            f"your Python is {(python_version or '').split()[0]}; the workers of {info.name} run Python "
            f"{info.python_version}: use Python {wanted} "
            "(payloads carry compiled code, which only loads on the same minor version)"
        )


def repo_id(model_key: str) -> tuple[str, str | None]:
    """(repo id, revision) from `import.path.Class:{json}` (nnsight's model key)."""
    cls, sep, rest = model_key.partition(":")
    if not sep or cls not in CLASSES:
        raise BadRequest(
            f"model key {model_key[:200]!r} is not one this server runs: build the client's model with nnsight's "
            "LanguageModel or TransformersModel"
        )
    try:
        fields = json.loads(rest)
        name = fields["repo_id"]
    except (ValueError, KeyError, TypeError):
        raise BadRequest(f"model key {model_key[:200]!r} does not carry a repo_id") from None
    if not isinstance(name, str) or not name:
        raise BadRequest("the model key's repo_id is not a name")
    revision = fields.get("revision")
    return name, revision if isinstance(revision, str) else None


def served_model(services: Services, model_key: str) -> ModelInfo:
    """The served model the key identifies (api/nnsight_identity.py), or 422 naming what differs.
    May hash a folder's weights once: call it off the event loop."""
    name, revision = repo_id(model_key)
    infos = [info for n in services.registry.names() if (info := services.registry.get(n)) is not None]
    if not infos:
        raise UnknownModel("no model is served here yet (is a worker running?)")
    info = nnsight_identity.served_as(name, infos)
    if revision not in (None, "main"):
        raise BadRequest(
            f"the model key asks for revision {revision!r}; {info.name} is served as its worker loaded it: "
            "leave `revision` out"
        )
    return info
