"""The architecture matrix through the whole stack: one representative of each decoding path served
by a real worker of the session's stack (slots: GPT-2, also a base model; state slots: Mamba, whose
batch of one computes bit for bit what `generate` does; the one-job-at-a-time decoder, the
compacting decoder (a sliding-window model's batch of one, caches slots cannot hold) and the
models whose attention in slots sums in another order than `generate`'s (sliding windows under a
mask: Mistral, Gemma 2 and 3; RecurrentGemma and the hybrids over a gathered slot) are checked in
process within the tolerance: tests/worker/test_solo.py, test_state_decoding.py, test_batching.py,
test_slots.py, and at a batch of one exactly, test_architectures.py), every listed
module captured through the API and compared with plain forward hooks on the same weights (tests/support/reference.py,
cloning in the hook). Every architecture is checked in process the same way
(tests/worker/test_architectures.py); these check the way through a worker, its file and the API.

One worker at a time (the fixture is module-scoped and parametrized, so pytest runs every test of
one architecture before starting the next). Float32 on the CPU: the values must be identical.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load as load_safetensors
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support.architectures import BY_KEY, Arch, available, build
from tests.support.reference import hooked_generate, select
from tests.support.stack import TestStack, job_count
from tests.worker.test_architectures import BASE_MODELS, MESSAGES, NEW_TOKENS, PROMPT, max_diff

# Each decoding path's representative, and what its worker says of how it decodes.
REPRESENTATIVES = {
    "gpt2": "decodes in slots",
    "mamba": "decodes batched, each job's recurrent state in a slot",
}


@dataclass
class Served:
    arch: Arch
    name: str
    folder: Path
    model: torch.nn.Module
    tokenizer: object
    info: dict  # its GET /models entry


@pytest.fixture(scope="module", params=list(REPRESENTATIVES))
def served(request, live: TestStack, tmp_path_factory, smol_dir: Path) -> Iterator[Served]:
    arch: Arch = BY_KEY[request.param]
    reason = available(arch)
    if reason:
        pytest.skip(reason)
    folder = build(arch, tmp_path_factory.mktemp("archs") / arch.key, smol_dir, arch.key not in BASE_MODELS)
    name = f"arch-{arch.key.replace('_', '-')}"
    live.start_worker(name, {"ACTQ_MODEL": str(folder), "ACTQ_MODEL_NAME": name})
    try:
        assert REPRESENTATIVES[arch.key] in live.logs[f"worker-{name}"].read_text(errors="replace")
        with httpx.Client(base_url=live.base_url, timeout=60) as http:
            info = next(m for m in http.get("/models").json() if m["name"] == name)
        assert REPRESENTATIVES[arch.key].removeprefix("decodes ") in info["decoding"]  # published with the model
        model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        yield Served(arch, name, folder, model, tokenizer, info)
    finally:
        live.stop_process(f"worker-{name}")


def run_job(live: TestStack, http: httpx.Client, body: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    job = live.wait(http, live.submit(http, body), timeout=180)
    assert job["status"] == "succeeded", (job, live.log_tail(f"worker-{body['model']}"))
    data = http.get(job["activations"]["download_url"]) if job["activations"] else None
    return job, load_safetensors(data.content) if data is not None else {}


def module_table(live: TestStack, served: Served) -> dict[str, dict]:
    """The model's description as its worker published it (widths and position coverage)."""
    import redis

    from shared.registry import ModelRegistry

    client = redis.Redis.from_url(live.redis_url)
    try:
        info = ModelRegistry(client, heartbeat_ttl=60).get(served.name)
    finally:
        client.close()
    assert info is not None
    return {m.path: m.model_dump() for m in info.modules}


def test_presets_resolve_to_one_module_per_block(served: Served, live, http, record_property):
    info = served.info
    presets = info["presets"]
    assert set(presets) == set(served.arch.presets), presets  # Arch.presets: a state-space block has no attention
    listed = set(info["modules"])
    for name, paths in presets.items():
        assert len(paths) == info["num_layers"] and set(paths) <= listed, (name, paths)
    blocks = presets["residual"]
    for kind in set(presets) - {"residual"}:  # each block's own module, inside that block
        assert all(p.startswith(block + ".") for p, block in zip(presets[kind], blocks, strict=True)), presets[kind]
    record_property("modules_listed", len(info["modules"]))
    for kind, paths in presets.items():
        record_property(kind, paths[0])

    preset = "mlp" if "mlp" in presets else "residual"
    body = {
        "model": served.name,
        "prompt": PROMPT,
        "max_tokens": 2,
        "capture": {"preset": preset, "layers": [-1, 0]},
    }
    job, _ = run_job(live, http, body)
    names = [t["name"] for t in job["activations"]["tensors"]]
    assert names == [presets[preset][0], presets[preset][-1]]


def test_every_module_output_equals_forward_hooks(served: Served, live, http, record_property):
    table = module_table(live, served)
    modules = [p for p, m in table.items() if m["output_dim"] is not None and m["all_positions"]]
    prompt = MESSAGES if served.info["chat_template"] else PROMPT
    field = "messages" if isinstance(prompt, list) else "prompt"
    body = {"model": served.name, field: prompt, "max_tokens": NEW_TOKENS, "capture": {"modules": modules}}
    job, tensors = run_job(live, http, body)
    ids, rows, prompt_tokens = hooked_generate(served.model, served.tokenizer, prompt, NEW_TOKENS, modules)
    assert torch.equal(tensors["token_ids"], ids)
    new_tokens = len(ids) - prompt_tokens
    want = {p: select(rows[p], "all", prompt_tokens, new_tokens) for p in modules}
    worst = max_diff(tensors, want, {p: p for p in modules})
    record_property("max_abs_output", worst)
    assert worst == 0.0, f"{served.arch.key}: output captures differ from forward hooks by {worst}"


def test_every_module_input_equals_forward_hooks(served: Served, live, http, record_property):
    table = module_table(live, served)
    modules = [p for p, m in table.items() if m["input_dim"] is not None and m["all_positions"]]
    prompt = MESSAGES if served.info["chat_template"] else PROMPT
    field = "messages" if isinstance(prompt, list) else "prompt"
    body = {
        "model": served.name,
        field: prompt,
        "max_tokens": NEW_TOKENS,
        "capture": {"modules": modules, "hook": "input"},
    }
    job, tensors = run_job(live, http, body)
    ids, rows, prompt_tokens = hooked_generate(
        served.model, served.tokenizer, prompt, NEW_TOKENS, modules, hook="input"
    )
    assert torch.equal(tensors["token_ids"], ids)
    new_tokens = len(ids) - prompt_tokens
    want = {p: select(rows[p], "all", prompt_tokens, new_tokens) for p in modules}
    worst = max_diff(tensors, want, {f"{p}:input": p for p in modules})
    record_property("max_abs_input", worst)
    assert worst == 0.0, f"{served.arch.key}: input captures differ from forward hooks by {worst}"


def test_a_raw_prompt_runs_and_captures_the_generated_rows_of_every_module(served: Served, live, http, record_property):
    """`prompt` is tokenized as `tokenizer(text)` (no template); `generated` rows include modules
    that only see the last position (the LM head)."""
    table = module_table(live, served)
    modules = [p for p, m in table.items() if m["output_dim"] is not None]
    body = {
        "model": served.name,
        "prompt": PROMPT,
        "max_tokens": NEW_TOKENS,
        "capture": {"modules": modules, "positions": "generated"},
    }
    job, tensors = run_job(live, http, body)
    ids, rows, prompt_tokens = hooked_generate(served.model, served.tokenizer, PROMPT, NEW_TOKENS, modules)
    assert torch.equal(tensors["token_ids"], ids)
    assert job["result"]["usage"]["prompt_tokens"] == prompt_tokens == len(served.tokenizer(PROMPT)["input_ids"])
    new_tokens = len(ids) - prompt_tokens
    want = {
        p: select(rows[p], "generated", prompt_tokens, new_tokens) if table[p]["all_positions"] else rows[p]
        for p in modules
    }
    worst = max_diff(tensors, want, {p: p for p in modules})
    record_property("raw_prompt_ok", worst == 0.0)
    assert worst == 0.0, f"{served.arch.key}: raw-prompt captures differ from forward hooks by {worst}"


def test_a_preset_the_model_lacks_or_a_layer_past_its_depth_is_refused(served: Served, http, redis_client):
    before = job_count(redis_client)
    depth = served.info["num_layers"]
    for capture, message in (
        ({"preset": "heads"}, "has no preset 'heads'"),
        ({"preset": "residual", "layers": [depth]}, f"layer {depth} is out of range"),
    ):
        response = http.post("/jobs", json={"model": served.name, "prompt": PROMPT, "capture": capture})
        assert response.status_code == 422 and message in response.json()["detail"], response.text
    assert job_count(redis_client) == before


def test_a_base_model_says_so_and_refuses_messages_with_the_fix(served: Served, http, redis_client):
    assert served.info["chat_template"] is (served.arch.key not in BASE_MODELS)
    if served.info["chat_template"]:
        return  # messages run on it: test_every_module_output_equals_forward_hooks
    before = job_count(redis_client)
    response = http.post("/jobs", json={"model": served.name, "messages": MESSAGES})
    assert response.status_code == 422, response.text
    error = response.json()
    assert error["error"] == "no_chat_template"
    assert "send the text as `prompt`" in error["detail"] and "ACTQ_CHAT_TEMPLATE" in error["detail"]
    assert job_count(redis_client) == before


def test_a_chat_template_file_gives_a_base_model_messages(live, http, tmp_path, smol_dir):
    """ACTQ_CHAT_TEMPLATE: the file's template renders messages on a template-less model; an
    unreadable one stops the worker with the reason and a non-zero exit."""
    from shared.cli.local_stack import worker_command
    from shared.cli.processes import spawn, stop

    gpt2 = BY_KEY["gpt2"]
    if reason := available(gpt2):
        pytest.skip(reason)
    folder = build(gpt2, tmp_path / "base", smol_dir, chat_template=False)
    template = tmp_path / "chat.jinja"
    template.write_text(AutoTokenizer.from_pretrained(smol_dir).chat_template)

    log = tmp_path / "worker-bad-template.log"
    env = {**live.env, "ACTQ_MODEL": str(folder), "ACTQ_CHAT_TEMPLATE": str(tmp_path / "missing.jinja")}
    process = spawn(worker_command(), log, env)
    try:
        code = process.wait(timeout=120)
    finally:
        stop(process)
    assert code != 0 and "ACTQ_CHAT_TEMPLATE" in log.read_text(errors="replace")

    live.start_worker(
        "templated", {"ACTQ_MODEL": str(folder), "ACTQ_MODEL_NAME": "templated", "ACTQ_CHAT_TEMPLATE": str(template)}
    )
    try:
        info = next(m for m in http.get("/models").json() if m["name"] == "templated")
        assert info["chat_template"] is True
        job, _ = run_job(live, http, {"model": "templated", "messages": MESSAGES, "max_tokens": 2})
        tokenizer = AutoTokenizer.from_pretrained(folder)
        expected = tokenizer.apply_chat_template(
            MESSAGES, chat_template=template.read_text(), add_generation_prompt=True, return_dict=True
        )
        assert job["result"]["usage"]["prompt_tokens"] == len(expected["input_ids"])
    finally:
        live.stop_process("worker-templated")
