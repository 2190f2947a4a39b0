"""A model folder's fingerprint (shared/model_identity.py): the same weights however they are
sharded, every changed tensor or config key named, and nothing read that is not a regular file."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from shared import model_identity as identity

CONFIG = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 8, "torch_dtype": "float32"}


def tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "model.embed_tokens.weight": rng.standard_normal((16, 8), dtype=np.float32),
        "model.layers.0.mlp.down_proj.weight": rng.standard_normal((8, 8), dtype=np.float32),
        "model.layers.1.mlp.down_proj.weight": rng.standard_normal((8, 8), dtype=np.float32),
        "model.norm.weight": np.ones(8, dtype=np.float32),
    }


def folder(path: Path, weights: dict[str, np.ndarray] | None = None, shards: int = 1, **config) -> Path:
    """A model folder as `save_pretrained` writes one: config.json and `shards` safetensors files."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({**CONFIG, "_name_or_path": str(path), **config}))
    items = sorted((weights or tensors()).items())
    for i in range(shards):
        part = dict(items[i::shards])
        save_file(part, str(path / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"), metadata={"shard": str(i)})
    return path


def fingerprint(path: Path):
    return identity.fingerprint(identity.read_folder(path))


def test_the_same_weights_sharded_otherwise_or_saved_elsewhere_have_one_fingerprint(tmp_path):
    one = fingerprint(folder(tmp_path / "a"))
    two = fingerprint(folder(tmp_path / "b", shards=3, transformers_version="9.9"))
    assert one == two  # _name_or_path and transformers_version say where and by what, not which model
    assert one.bytes == sum(t.nbytes for t in tensors().values())
    assert identity.weight_differences(two, one) == []


def test_a_changed_tensor_is_named_after_the_headers_agree(tmp_path):
    served = fingerprint(folder(tmp_path / "served"))
    tuned = tensors()
    tuned["model.layers.1.mlp.down_proj.weight"] = tuned["model.layers.1.mlp.down_proj.weight"] + 1e-3
    copy = identity.read_folder(folder(tmp_path / "ft", tuned))
    assert identity.header_differences(copy, served) == []  # names, dtypes and shapes agree: only data tells
    said = identity.weight_differences(identity.fingerprint(copy), served)
    assert said == ["the weights differ from the served ones in 1 of 4 tensors: model.layers.1.mlp.down_proj.weight"]


def test_headers_name_config_keys_missing_tensors_and_other_dtypes(tmp_path):
    served = fingerprint(folder(tmp_path / "served"))
    other = tensors()
    del other["model.norm.weight"]
    other["model.embed_tokens.weight"] = other["model.embed_tokens.weight"].astype(np.float16)
    found = identity.read_folder(folder(tmp_path / "other", other, num_hidden_layers=3))
    said = identity.header_differences(found, served)
    assert said == [
        "config.json differs: num_hidden_layers (3 here, 2 served)",
        "tensors the served model has are missing: model.norm.weight",
        "tensors differ in dtype or shape: model.embed_tokens.weight (F16 16x8 here, F32 16x8 served)",
    ]


def test_only_regular_files_are_read_and_a_fifo_never_blocks(tmp_path):
    base = folder(tmp_path / "m")
    (base / "config.json").unlink()
    os.symlink("/dev/zero", base / "config.json")  # endless if read
    with pytest.raises(identity.NotAModelFolder, match="config.json is not a regular file"):
        identity.read_folder(base)
    (base / "config.json").unlink()
    (base / "config.json").write_text(json.dumps(CONFIG))
    os.mkfifo(base / "extra.safetensors")  # opening a FIFO to read blocks until a writer comes
    with pytest.raises(identity.NotAModelFolder, match="extra.safetensors is not a regular file"):
        identity.read_folder(base)


def test_a_symlinked_file_is_followed_to_a_regular_one(tmp_path):
    """The Hugging Face cache's snapshot folders hold symlinks to blobs."""
    real = folder(tmp_path / "blobs")
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    for name in os.listdir(real):
        os.symlink(real / name, snapshot / name)
    assert fingerprint(snapshot) == fingerprint(real)


def _header(entries: dict) -> bytes:
    raw = json.dumps(entries).encode()
    return struct.pack("<Q", len(raw)) + raw


@pytest.mark.parametrize(
    ("start", "says"),
    [
        (struct.pack("<Q", 1 << 40), "header length is"),
        (struct.pack("<Q", 4) + b"nope", "header is not JSON"),
        (_header({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}), "not a valid safetensors file"),
        (_header({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1 << 40]}}), "not a valid safetensors file"),
        (_header({"w": {"dtype": "XX", "shape": [1], "data_offsets": [0, 4]}}), "not a valid safetensors file"),
    ],
)
def test_a_broken_safetensors_header_is_refused_before_any_data_is_read(tmp_path, start, says):
    base = folder(tmp_path / "m")
    (base / "model-00001-of-00001.safetensors").write_bytes(start + b"\0" * 16)
    with pytest.raises(identity.NotAModelFolder, match=says):
        identity.read_folder(base)


def test_a_folder_without_weights_or_config_cannot_be_fingerprinted(tmp_path):
    base = folder(tmp_path / "m")
    for name in os.listdir(base):
        if name.endswith(".safetensors"):
            os.remove(base / name)
    with pytest.raises(identity.NotAModelFolder, match="no \\*.safetensors"):
        identity.read_folder(base)
    (base / "config.json").unlink()
    with pytest.raises(identity.NotAModelFolder, match="no config.json"):
        identity.read_folder(base)


def test_the_work_of_reading_a_folder_is_bounded(tmp_path, monkeypatch):
    """A folder with more entries, or safetensors headers larger all together, than the bounds is refused
    before it is read further (the bounds made small here: 100,000 entries and 100 MB of headers)."""
    crowded = folder(tmp_path / "crowded")
    for i in range(12):
        (crowded / f"note-{i}.txt").write_text("x")
    monkeypatch.setattr(identity, "MAX_ENTRIES", 10)
    with pytest.raises(identity.NotAModelFolder, match="over 10 entries"):
        identity.read_folder(crowded)
    monkeypatch.undo()
    sharded = folder(tmp_path / "sharded", shards=4)
    header = (sharded / "model-00001-of-00004.safetensors").read_bytes()
    one = 8 + struct.unpack("<Q", header[:8])[0]
    monkeypatch.setattr(identity, "MAX_HEADER_BYTES", one * 2)
    with pytest.raises(identity.NotAModelFolder, match="headers add up to over"):
        identity.read_folder(sharded)
