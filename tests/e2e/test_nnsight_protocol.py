"""What nnsight 0.8.1's stock client with `remote=True` meets at actq besides the guide's examples
(tests/e2e/test_nnsight_remote.py), on a real stack: a folder must hold the served weights, not
merely their name; what the client sets but actq does not use is said, and what ran is what was
said; nnsight.status() and nnsight.compare() work; attention weights come out of the served
`sdpa` model by the manual's route, equal to eager attention's."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import httpx
import pytest
import torch

from tests.support.nnsight import TRUSTED, client_model, nnsight_host, trusted_stack
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


# -- what travels ----------------------------------------------------------------------------


def two_invokes(model, remote):
    with model.trace(remote=remote) as tracer:
        with tracer.invoke("Hi"):
            short = model.lm_head.output.save()
        with tracer.invoke(PROMPT):
            long = model.lm_head.output.save()
    return short, long


def test_what_the_client_sets_but_actq_does_not_use_is_said_and_is_what_ran(stack, tiny_dir, remote_host, capsys):
    """A bfloat16 client that pads on the right: the run is float32 and pads on the left, as its first
    LOG line and the job's `result.nnsight.served` say, and as a local float32 left-padded run gets."""
    client = client_model(tiny_dir, dtype=torch.bfloat16)
    client.tokenizer.padding_side = "right"
    capsys.readouterr()
    remote = two_invokes(client, True)
    printed = capsys.readouterr().out
    found = re.search(r"\[([0-9a-f-]{36})\] LOG\s+(actq: runs on tiny as served: [^\n]*)", printed)
    assert found is not None, printed
    job_id, note = found.groups()
    for said in ("dtype float32", "padding on the left", "dtype=float32", "torch.manual_seed"):
        assert said in note, note

    expected = two_invokes(client_model(tiny_dir, dispatch=True), False)  # float32; nnsight pads on the left
    for got, want in zip(remote, expected, strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)
    own = client_model(tiny_dir, dtype=torch.bfloat16, dispatch=True)  # what the client would get locally
    own.tokenizer.padding_side = "right"
    theirs = two_invokes(own, False)
    assert (theirs[0].float() - remote[0]).abs().max() > 0.1  # so the client's settings did not apply

    with httpx.Client(base_url=stack.base_url, headers={"Authorization": f"Bearer {TRUSTED}"}) as http:
        job = http.get(f"/jobs/{job_id}").json()
    served = job["result"]["nnsight"]["served"]
    assert job["mode"] == "nnsight"
    assert {k: served[k] for k in ("dtype", "attn_implementation", "padding_side")} == {
        "dtype": "float32",
        "attn_implementation": "sdpa",
        "padding_side": "left",
    }
    assert "seed inside the trace" in served["random_state"]


# -- nnsight's own helpers ------------------------------------------------------------------


def test_nnsight_status_and_compare_work_against_actq(stack, remote_host, capsys):
    """Both send no key; before, actq answered 401 and nnsight.status() printed "Service: Down"."""
    import nnsight
    from nnsight import ndif

    status = nnsight.status()
    assert status.status is ndif.NdifStatus.Status.UP, capsys.readouterr().err
    assert TINY in status and status[TINY]["state"] == "RUNNING" and status[TINY]["model_class"] == "TransformersModel"
    ndif._REMOTE_ENV = None  # nnsight caches the server's environment per process
    compared = nnsight.compare()
    assert compared.python_matches
    assert {"nnsight", "torch", "transformers"} <= set(compared.packages)
    assert compared.critical_mismatches == {}  # this client and the worker share one environment
    assert "Down" not in capsys.readouterr().err


# -- attention weights ----------------------------------------------------------------------


def attention_weights(model, layer: int):
    """docs/nnsight.md, "Attention weights": from the rotated queries and keys, in the trace."""
    with model.trace(PROMPT, remote=True):
        query, key = model.model.layers[layer].self_attn.source.apply_rotary_pos_emb_0.output
        key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        scores = query @ key.transpose(-1, -2) * query.shape[-1] ** -0.5
        causal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
        weights = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1).save()
    return weights


def test_attention_weights_from_the_served_sdpa_model_equal_eager_attentions(stack, tiny_dir, remote_host):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    client = client_model(tiny_dir)
    eager = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="eager")
    inputs = AutoTokenizer.from_pretrained(tiny_dir)(PROMPT, return_tensors="pt")
    with torch.no_grad():
        reference = eager(**inputs, output_attentions=True).attentions
    for layer in (0, 3):
        weights = attention_weights(client, layer)
        assert (
            weights.shape
            == reference[layer].shape
            == (1, 4, inputs["input_ids"].shape[1], inputs["input_ids"].shape[1])
        )
        torch.testing.assert_close(weights, reference[layer], atol=1e-6, rtol=1e-5)
