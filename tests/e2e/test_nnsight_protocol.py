"""What nnsight 0.8.1's stock client with `remote=True` meets at actq besides the guide's examples
(tests/e2e/test_nnsight_remote.py), on a real stack: a folder must hold the served weights, not
merely their name; what the client sets but actq does not use is said, and what ran is what was
said; nnsight.status() and nnsight.compare() work; attention weights come out of the served
`sdpa` model by the manual's route, equal to eager attention's."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.support.nnsight import client_model, nnsight_host, trusted_stack
from tests.support.stack import TINY, TestStack

pytestmark = pytest.mark.timeout(600)
ATOL = 1e-5
PROMPT = "The Eiffel Tower is in the city of"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path):
    with trusted_stack(tmp_path_factory.mktemp("nnsight-protocol"), tiny_dir) as s:
        yield s


@pytest.fixture
def remote_host(stack: TestStack):
    with nnsight_host(stack) as s:
        yield s


def _stored_jobs(stack: TestStack) -> list[str]:
    jobs = stack.storage_dir / "jobs"
    return sorted(p.name for p in jobs.iterdir()) if jobs.exists() else []


def hidden(model, remote):
    with model.trace(PROMPT, remote=remote):
        hs = model.model.layers[2].output.save()
        logits = model.lm_head.output.save()
    return hs, logits


# -- which model ---------------------------------------------------------------------------


def test_a_fine_tuned_copy_named_like_the_served_model_is_refused_and_an_exact_copy_runs(
    stack, tiny_dir, tmp_path, remote_host
):
    from nnsight.intervention.backends.remote import RemoteError
    from safetensors.torch import load_file, save_file

    fine_tuned = Path(shutil.copytree(tiny_dir, tmp_path / "ft" / TINY))  # `.../ft/tiny`: the served name
    weights = next(fine_tuned.glob("*.safetensors"))
    tensors = load_file(weights)
    tensors["model.layers.1.mlp.down_proj.weight"] += 0.05
    save_file(tensors, weights, metadata={"format": "pt"})
    before = _stored_jobs(stack)
    tuned = client_model(fine_tuned)
    with pytest.raises(RemoteError) as refused:
        hidden(tuned, True)
    said = str(refused.value)
    assert f"is not the model served as {TINY}" in said, said
    assert "weights differ from the served ones in 1 of" in said and "model.layers.1.mlp.down_proj.weight" in said
    assert _stored_jobs(stack) == before

    # the same files under any other name and path are the served model: remote equals local
    copy = Path(shutil.copytree(tiny_dir, tmp_path / "elsewhere" / "my-copy"))
    got = hidden(client_model(copy), True)
    expected = hidden(client_model(tiny_dir, dispatch=True), False)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-4)
