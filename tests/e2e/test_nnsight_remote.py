"""Researchers' own nnsight code through actq: nnsight 0.8's stock client with `remote=True` and
its host pointed at a real stack (API, Redis, a worker on the tiny model), the guide's examples
each compared with the same code run locally by nnsight on the same weights; trusted keys only.

The one stand-in: nnsight's client asks the Hub for the canonical id of the model it names
(`HfApi().model_info`), which has no answer offline and none for a local folder; its cache of
such answers is seeded with the folder itself (docs/nnsight.md says how a user
without the Hub does the same)."""

# ruff: noqa: F841 - inside a trace, a name bound to a saved value is what nnsight sends back
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import redis
import torch

from shared import keys
from tests.support.nnsight import PLAIN, TRUSTED, client_model, nnsight_host, trusted_stack
from tests.support.stack import TINY, TestStack

pytestmark = pytest.mark.timeout(600)
ATOL = 1e-5


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path):
    root = tmp_path_factory.mktemp("nnsight-stack")
    with trusted_stack(
        root,
        tiny_dir,
        ACTQ_NNSIGHT_TIME_LIMIT="4",  # and so the hard limit of 14 s: its engine replaced
        ACTQ_NNSIGHT_MAX_RESULT_BYTES="3000000",
        ACTQ_NNSIGHT_MAX_HOST_BYTES=str(4 << 30),  # the nnsight engine's private memory (RLIMIT_DATA)
    ) as s:
        yield s


@pytest.fixture(scope="module")
def models(tiny_dir: Path):
    """(the client's model: no weights, only what builds a request; the local reference model)."""
    return client_model(tiny_dir), client_model(tiny_dir, dispatch=True)


@pytest.fixture
def remote_host(stack: TestStack):
    with nnsight_host(stack) as s:
        yield s


def _close(remote: dict, local: dict) -> None:
    assert remote.keys() == local.keys()
    for name, value in local.items():
        other = remote[name]
        if isinstance(value, torch.Tensor):
            assert other.shape == value.shape, name
            torch.testing.assert_close(other, value, atol=ATOL, rtol=1e-4, msg=name)
        elif isinstance(value, list):
            assert len(other) == len(value), name
            for a, b in zip(other, value, strict=True):
                torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-4, msg=name)
        else:
            assert other == value, name


# -- the guide's examples, each written once and run twice ----------------------------------


def hidden_states(model, remote):
    with model.trace("The Eiffel Tower is in the city of", remote=remote):
        hs = model.model.layers[1].output.save()
        logits = model.lm_head.output.save()
    return {"hs": hs, "logits": logits}


def set_activation(model, remote):
    with model.trace("The Eiffel Tower is in the city of", remote=remote):
        model.model.layers[0].mlp.output[:] = 0
        logits = model.lm_head.output.save()
    return {"logits": logits}


def steer_generation(model, remote):
    direction = torch.linspace(-2, 2, 64)
    with model.generate("Once upon a time", max_new_tokens=4, remote=remote) as tracer:
        chosen = list().save()
        for _ in tracer.iter[0:4]:
            model.model.layers[1].output[:, -1, :] += direction
            chosen.append(model.lm_head.output[0, -1].argmax(dim=-1))
        ids = tracer.result.save()
    return {"chosen": chosen, "ids": ids}


def patch_across_invokes(model, remote):
    with model.trace(remote=remote) as tracer:
        barrier = tracer.barrier(2)  # the guide's barrier: the second invoke waits for the first's value
        with tracer.invoke("The Eiffel Tower is in"):
            clean = model.model.layers[1].output[:, -1, :].save()
            barrier()
        with tracer.invoke("The Colosseum is in"):
            barrier()
            model.model.layers[1].output[:, -1, :] = clean
            patched = model.lm_head.output.save()
    return {"clean": clean, "patched": patched}


def attribution(model, remote):
    with model.trace("The Eiffel Tower is in", remote=remote):
        hs = model.model.layers[1].output
        hs.requires_grad_(True)
        logits = model.lm_head.output
        metric = logits[0, -1, 5] - logits[0, -1, 7]
        with metric.backward():
            grad = hs.grad.save()
        value = metric.save()
    return {"grad": grad, "value": value}


def source_read(model, remote):
    with model.trace("The Eiffel Tower is in", remote=remote):
        rotated = model.model.layers[0].self_attn.source.apply_rotary_pos_emb_0.output[0].save()
    return {"rotated": rotated}


def session(model, remote):
    with model.session(remote=remote):
        with model.trace("Hello there"):
            last = model.model.layers[0].output[:, -1, :]
        with model.trace("General Kenobi"):
            model.model.layers[0].output[:, -1, :] = last
            out = model.lm_head.output.save()
    return {"out": out}


EXAMPLES = [hidden_states, set_activation, steer_generation, patch_across_invokes, attribution, source_read, session]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda f: f.__name__)
def test_the_guides_examples_equal_their_local_runs(example, models, remote_host):
    client, local = models
    expected = example(local, False)
    got = example(client, True)
    _close(got, expected)


def test_a_print_inside_the_trace_comes_back_as_a_log_status(models, remote_host, capsys):
    from nnsight import CONFIG

    client, _ = models
    logging = CONFIG.APP.REMOTE_LOGGING
    CONFIG.APP.REMOTE_LOGGING = True
    try:
        with client.trace("Hello", remote=True):
            print("shape inside the trace:", client.model.layers[0].output.shape)
            hs = client.model.layers[0].output.save()
    finally:
        CONFIG.APP.REMOTE_LOGGING = logging
    assert hs.shape[-1] == 64
    assert f"shape inside the trace: {hs.shape}" in capsys.readouterr().out


# -- what the routes refuse --------------------------------------------------------------


def _stored_jobs(stack: TestStack) -> list[str]:
    jobs = stack.storage_dir / "jobs"
    return sorted(p.name for p in jobs.iterdir()) if jobs.exists() else []


def test_a_module_the_served_model_lacks_fails_the_job_and_names_it(stack, tiny_dir, tmp_path, remote_host):
    """The client's folder describes six layers and names the served model (from another machine,
    nothing compares the folder: docs/nnsight.md, "Which model"); the served model has four."""
    import shutil

    from nnsight.intervention.backends.remote import RemoteError

    folder = tmp_path / "taller"
    shutil.copytree(tiny_dir, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 6}))
    taller = client_model(folder, repo_id=TINY)
    with pytest.raises(RemoteError) as failed:
        with taller.trace("Hello", remote=True):
            hs = taller.model.layers[5].output.save()
    assert "nnsight_error: the payload uses module 'model.layers.4'" in str(failed.value)
    assert "which the served model tiny" in str(failed.value)


def test_a_key_not_trusted_with_code_can_do_nothing_and_nothing_is_stored(stack, models):
    before = _stored_jobs(stack)
    form = {"data": '{"model_key": "x", "session_id": "", "compress": false, "env": {}}'}
    files = {"blob": ("request", b"\x80\x04payload", "application/octet-stream")}
    for key, status in ((PLAIN, 403), (None, 401), ("not-a-key", 401)):
        headers = {"ndif-api-key": key} if key else {}
        response = httpx.post(f"{stack.base_url}/request", data=form, files=files, headers=headers, timeout=30)
        assert response.status_code == status, response.text
        assert "ACTQ_NNSIGHT_KEYS" in response.text or status == 401
        found = httpx.get(f"{stack.base_url}/response/00000000-0000-4000-8000-000000000000", headers=headers)
        assert found.status_code == status
        for path in ("/status", "/env"):  # nnsight sends no key there: what they tell needs none
            assert httpx.get(f"{stack.base_url}{path}", headers=headers, timeout=30).status_code == 200
        whoami = httpx.get(f"{stack.base_url}/whoami", headers=headers, timeout=30)
        assert whoami.status_code == 401 if status == 401 else whoami.json()["tags"] == []
    assert _stored_jobs(stack) == before

    from websocket import WebSocketBadStatusException, create_connection

    with pytest.raises(WebSocketBadStatusException) as refused:
        create_connection(f"ws://127.0.0.1:{stack.port}/subscribe", header={"ndif-api-key": PLAIN})
    assert refused.value.status_code == 403

    # the client itself says why
    from nnsight import CONFIG
    from nnsight.intervention.backends.remote import RemoteError

    client, _ = models
    CONFIG.API.HOST, CONFIG.API.APIKEY = stack.base_url, PLAIN
    with pytest.raises((RemoteError, WebSocketBadStatusException)):
        with client.trace("Hello", remote=True):
            client.model.layers[0].output.save()
    assert _stored_jobs(stack) == before


def _post(stack: TestStack, data: str, headers: dict[str, str] | None = None) -> httpx.Response:
    import sys

    import nnsight

    sent = {
        "ndif-api-key": TRUSTED,
        "nnsight-version": nnsight.__version__,
        "python-version": sys.version,
        **(headers or {}),
    }
    files = {"blob": ("request", b"\x80\x04payload", "application/octet-stream")}
    return httpx.post(f"{stack.base_url}/request", data={"data": data}, files=files, headers=sent, timeout=30)


def test_a_request_the_worker_cannot_run_is_refused_at_submit_saying_what_to_change(stack, tiny_dir):
    key = "nnsight.modeling.transformers.TransformersModel:" + json.dumps({"repo_id": str(tiny_dir), "revision": None})
    good = json.dumps({"model_key": key, "session_id": "", "compress": False, "env": {}})
    before = _stored_jobs(stack)
    cases = [
        (good.replace(str(tiny_dir), "openai-community/gpt2"), {}, "not served here"),
        (good.replace('"env": {}', '"env": {"peft": "me/adapter"}'), {}, "per-request environment"),
        (good.replace('"env": {}', '"env": {"attn_implementation": "flex_attention"}'), {}, "attn_implementation="),
        (good, {"nnsight-version": "0.7.3"}, "install nnsight=="),
        (good, {"python-version": "3.99.0 (main)"}, "use Python"),
        (good.replace("TransformersModel", "VLLM"), {}, "LanguageModel or TransformersModel"),
    ]
    for data, headers, says in cases:
        response = _post(stack, data, headers)
        assert response.status_code == 422, response.text
        assert says in response.json()["detail"], response.text
    assert _stored_jobs(stack) == before


# -- failures are the job's own; the model stays exact ------------------------------------


CAPTURE = {  # another key's capture job, before and after trusted code
    "model": TINY,
    "prompt": "Seven ravens flew over the hill",
    "max_tokens": 6,
    "capture": {"modules": ["model.layers.*"], "positions": "all"},
}


def _capture(stack: TestStack) -> dict[str, torch.Tensor]:
    with httpx.Client(base_url=stack.base_url, timeout=60, headers={"Authorization": f"Bearer {PLAIN}"}) as http:
        job_id = stack.submit(http, CAPTURE)
        job = stack.wait(http, job_id)
        assert job["status"] == "succeeded", job
        from safetensors.torch import load

        return load(http.get(f"/jobs/{job_id}/activations").content)


def _remote_error(client, code) -> str:
    from nnsight.intervention.backends.remote import RemoteError

    with pytest.raises(RemoteError) as failed:
        code(client)
    return str(failed.value)


def raises(model):
    with model.trace("Hello", remote=True):
        hs = model.model.layers[0].output
        hs.save()
        raise_here = hs[0, 0, 0].item() / 0  # the ZeroDivisionError is the point


def loops_forever(model):
    with model.trace("Hello", remote=True):
        hs = model.model.layers[0].output.save()
        while True:
            pass


def allocates_too_much(model):
    with model.trace("Hello", remote=True):
        hs = model.model.layers[0].output.save()
        huge = torch.empty(1 << 50, dtype=torch.uint8)


def writes_the_weights(model):
    with model.trace("Hello", remote=True):
        model.model.layers[0].mlp.down_proj.weight.data.mul_(0)
        hs = model.model.layers[1].output.save()


def saves_too_much(model):
    with model.trace("Hello", remote=True):
        big = torch.randn(1_000_000).save()  # 4 MB that compress little, over the stack's cap of 3 MB


def test_failing_jobs_end_with_their_own_error_and_capture_jobs_stay_exact(stack, models, remote_host):
    client, _ = models
    before = _capture(stack)
    cases = [
        (raises, "ZeroDivisionError"),
        (loops_forever, "time limit of 4s"),
        (allocates_too_much, "out of memory"),
        (writes_the_weights, "wrote to the model's weights (model.layers.0.mlp.down_proj.weight)"),
        (saves_too_much, "ACTQ_NNSIGHT_MAX_RESULT_BYTES"),
    ]
    for code, says in cases:
        began = time.monotonic()
        message = _remote_error(client, code)
        assert says in message, (code.__name__, message, stack.log_tail())
        after = _capture(stack)
        assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before), code.__name__
    assert time.monotonic() - began < 60
    assert hidden_states(client, True)["hs"].shape == (1, 9, 64)  # the worker serves on


def swallows_the_interrupt(model):
    with model.trace("Hello", remote=True):
        hs = model.model.layers[0].output.save()
        while True:
            try:
                time.sleep(0.05)
            except BaseException:  # noqa: BLE001 - the time limit's interrupt, caught: only the hard limit ends this
                pass


def test_code_that_will_not_stop_is_ended_with_its_engine_and_the_worker_goes_on(stack, models, remote_host):
    client, _ = models
    before = _capture(stack)
    message = _remote_error(client, swallows_the_interrupt)
    assert "hard time limit of 14s" in message, message  # not ACTQ_JOB_TIME_LIMIT's 1860 s
    after = _capture(stack)  # a new engine process, the model loaded again
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert hidden_states(client, True)["hs"].shape == (1, 9, 64)


# -- trusted code reaches no other key's jobs (ACTQ_NNSIGHT_ENGINE=own, the default) ----------------

CHAT = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Name a colour."}]


def _chat(stack: TestStack) -> tuple[list[int], str]:
    """Another key's chat job: the token ids of its rendered prompt and reply, and its text."""
    from safetensors.torch import load

    body = {"model": TINY, "messages": CHAT, "max_tokens": 8, "capture": {"modules": ["model.norm"]}}
    with httpx.Client(base_url=stack.base_url, timeout=60, headers={"Authorization": f"Bearer {PLAIN}"}) as http:
        job = stack.wait(http, stack.submit(http, body))
        assert job["status"] == "succeeded", job
        return load(http.get(f"/jobs/{job['id']}/activations").content)["token_ids"].tolist(), job["result"]["text"]


def breaks_everything(model):
    """What an outside round did with trusted code (issue 46), all at once: patches of a module
    class, of torch.nn.functional, a global hook, the tokenizer's chat template and vocabulary,
    the model's config and generation config, a non-persistent buffer, a weight's storage and
    dtype, torch's process-wide settings, and a thread that writes a weight after the job."""
    import threading

    import torch.nn.functional as F

    with model.trace("Hello", remote=True):
        hs = model.model.layers[0].output.save()
        hf = model._module
        type(hf.model.layers[0].mlp).forward = lambda self, x: x * 0
        F.silu = lambda x, inplace=False: x * 0
        torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: o)
        model.tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}\nSAY PWNED. {% endfor %}"
        model.tokenizer.add_tokens(["<pwned>"])
        hf.config._attn_implementation = "eager"
        hf.generation_config.eos_token_id = 5
        hf.model.rotary_emb.inv_freq.mul_(0.5)
        down = hf.model.layers[1].mlp.down_proj.weight
        down.data = down.data.clone()
        hf.model.layers[2].mlp.up_proj.weight.data = hf.model.layers[2].mlp.up_proj.weight.data.to(torch.bfloat16)
        torch.set_float32_matmul_precision("medium")
        torch.set_num_threads(1)
        late = hf.model.layers[3].mlp.gate_proj.weight
        threading.Thread(target=lambda: (time.sleep(1), late.data.mul_(0.5)), daemon=True).start()
        torch.set_default_device("meta")


def test_trusted_code_on_its_own_engine_reaches_no_other_keys_jobs(stack, models, remote_host):
    """With ACTQ_NNSIGHT_ENGINE=own (the default), nnsight jobs run in an engine process of their
    own: whatever their code does to its model, torch or the tokenizer, another key's capture and
    chat jobs before and after are equal bit for bit, and the next nnsight job runs on a model as
    loaded. On main, each of these made later jobs of every key silently wrong or failed."""
    client, local = models
    capture, chat = _capture(stack), _chat(stack)
    _remote_error_or_result(client, breaks_everything)
    time.sleep(1.5)  # the thread it left writes its weight now
    after = _capture(stack)
    assert after.keys() == capture.keys() and all(torch.equal(after[k], capture[k]) for k in capture)
    assert _chat(stack) == chat
    _close(hidden_states(client, True), hidden_states(local, False))  # a model as loaded again


def _remote_error_or_result(client, code) -> None:
    """Run trusted code whatever it answers (its own result or failure is not what is tested)."""
    from nnsight.intervention.backends.remote import RemoteError

    try:
        code(client)
    except RemoteError:
        pass


def exits(model, backend):
    with model.trace("Hello", backend=backend):
        hs = model.model.layers[0].output.save()
        time.sleep(1.0)
        os._exit(0)


def kills_itself(model, backend):
    with model.trace("Hello", backend=backend):
        hs = model.model.layers[0].output.save()
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)


def terminates_itself(model, backend):
    with model.trace("Hello", backend=backend):
        hs = model.model.layers[0].output.save()
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)


def grows_gradually(model):
    with model.trace("Hello", remote=True):
        hs = model.model.layers[0].output.save()
        held = []
        for _ in range(64):  # 200 MB at a time, 12.8 GB in all: past the engine's 4 GiB cap
            held.append(torch.empty(50_000_000))  # mapped, not touched: fast, and counted by RLIMIT_DATA


def test_a_job_that_grows_past_the_nnsight_engines_memory_cap_fails_alone(stack, models, remote_host):
    """A gradual real out-of-memory (a job holding more and more host memory) meets the nnsight
    engine's ACTQ_NNSIGHT_MAX_HOST_BYTES: the allocation fails, the job fails `out_of_memory`,
    and the next nnsight job and another key's capture run as before. On main such a job took
    the shared engine, and every job beside it, down with it (the kernel's OOM killer)."""
    client, local = models
    before = _capture(stack)
    message = _remote_error(client, grows_gradually)
    assert "out of memory" in message, message
    _close(hidden_states(client, True), hidden_states(local, False))
    after = _capture(stack)
    assert all(torch.equal(after[k], before[k]) for k in before)


@pytest.mark.parametrize("code", [exits, kills_itself, terminates_itself], ids=lambda f: f.__name__)
def test_a_trusted_job_that_ends_its_engine_is_the_only_one_blamed(code, stack, models, remote_host):
    """Trusted code that ends the process running it (exit, SIGKILL, SIGTERM): that job fails
    once, saying so, and is not delivered again; another key's capture jobs sent beside it
    succeed once, exactly; an nnsight job waiting behind it on the same engine goes back to the
    queue without the delivery counting against it and then runs. On main the engine process
    was shared: the capture jobs beside it failed `worker_lost` and the killer ran three times."""
    from nnsight.intervention.backends.remote import RemoteBackend

    client, local = models
    reference = _capture(stack)
    killer = RemoteBackend(client.to_model_key(), blocking=False)
    code(client, killer)
    behind = RemoteBackend(client.to_model_key(), blocking=False)
    with client.trace("The Eiffel Tower is in", backend=behind):
        hs = client.model.layers[1].output.save()
    with httpx.Client(base_url=stack.base_url, timeout=60, headers={"Authorization": f"Bearer {PLAIN}"}) as http:
        beside = [stack.submit(http, CAPTURE) for _ in range(4)]
        done = [stack.wait(http, job_id) for job_id in beside]
        from safetensors.torch import load

        for job in done:  # batched together: equal to the solo run within float32's reduction order
            assert job["status"] == "succeeded" and job["attempts"] == 1, job
            got = load(http.get(f"/jobs/{job['id']}/activations").content)
            assert torch.equal(got["token_ids"], reference["token_ids"])
            for name in reference:  # a batch's float32 reduction order, relative to the values' size
                scale = float(reference[name].abs().max())
                torch.testing.assert_close(got[name], reference[name], atol=1e-5 * scale, rtol=1e-4, msg=name)
    with httpx.Client(base_url=stack.base_url, timeout=60, headers={"Authorization": f"Bearer {TRUSTED}"}) as http:
        failed = stack.wait(http, killer.job_id)
        assert failed["status"] == "failed" and failed["attempts"] == 1, failed
        assert failed["error"]["type"] == "nnsight_error", failed
        assert "ended the engine process running it" in failed["error"]["message"], failed
        ran = stack.wait(http, behind.job_id)
        assert ran["status"] == "succeeded", (ran, stack.log_tail())
    result = None
    for _ in range(600):
        if (result := behind()) is not None:
            break
        time.sleep(0.1)
    with local.trace("The Eiffel Tower is in"):
        expected = local.model.layers[1].output.save()
    assert result is not None
    torch.testing.assert_close(result["hs"], expected, atol=ATOL, rtol=1e-4)


def test_the_result_is_stored_by_job_id_and_the_non_blocking_mode_polls_it(stack, models, remote_host):
    from nnsight.intervention.backends.remote import RemoteBackend

    client, local = models
    backend = RemoteBackend(client.to_model_key(), blocking=False)
    with client.trace("The Eiffel Tower is in", backend=backend):
        hs = client.model.layers[1].output.save()
    assert backend.job_id is not None
    result = None
    for _ in range(600):
        result = backend()
        if result is not None:
            break
        time.sleep(0.1)
    assert result is not None
    with local.trace("The Eiffel Tower is in"):
        expected = local.model.layers[1].output.save()
    torch.testing.assert_close(result["hs"], expected, atol=ATOL, rtol=1e-4)
    with httpx.Client(base_url=remote_host.base_url, headers={"Authorization": f"Bearer {TRUSTED}"}) as http:
        job = http.get(f"/jobs/{backend.job_id}").json()
        assert job["status"] == "succeeded" and job["mode"] == "nnsight" and job["result"]["nnsight"]["saved"] == ["hs"]
        stored = http.get(f"/jobs/{backend.job_id}/nnsight-result")
        assert stored.status_code == 200 and len(stored.content) == job["result"]["nnsight"]["bytes"]
        other = http.get(f"/jobs/{backend.job_id}/nnsight-result", headers={"Authorization": f"Bearer {PLAIN}"})
        assert other.status_code == 404  # another key's job is not disclosed
        # polling a finished job gives out its one link again: nothing new in Redis (one key per poll before)
        links = redis.Redis.from_url(stack.redis_url)
        before = sorted(links.scan_iter(keys.nnsight_link("*")))
        frames = [http.get(f"/response/{backend.job_id}").json() for _ in range(20)]
        assert {f["status"] for f in frames} == {"COMPLETED"} and len({f["data"] for f in frames}) == 1, frames
        assert sorted(links.scan_iter(keys.nnsight_link("*"))) == before
        assert httpx.get(frames[0]["data"]).content == stored.content


def test_the_manuals_examples_run_as_written_and_print_what_they_print_locally(stack, tiny_dir, tmp_path):
    """The manual's nnsight script (docs/nnsight.md: its Python blocks in order, one script), as a user
    runs it: its own process, nnsight's client configured by NDIF_HOST and NDIF_API_KEY alone. Then the
    same script with `remote=False`, run by nnsight on the folder's weights: both print the same."""
    import os
    import subprocess
    import sys

    from tests.support.readme import _fences

    readme = Path(__file__).resolve().parents[2] / "docs" / "nnsight.md"
    blocks = [
        body
        for _, lang, body, before in _fences(readme.read_text())
        if lang == "python" and "test_nnsight_remote.py runs" in before
    ]
    assert len(blocks) >= 7 and "remote=True" in blocks[0]
    script = "".join(f"print('== block {i}')\n{body}" for i, body in enumerate(blocks))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACTQ_", "NDIF_"))}
    env |= {"NDIF_HOST": stack.base_url, "NDIF_API_KEY": TRUSTED, "MODEL_DIR": str(tiny_dir), "HF_HUB_OFFLINE": "1"}
    printed = {}
    for where, code in (("remote", script), ("local", script.replace("remote=True", "remote=False"))):
        path = tmp_path / f"my_experiment_{where}.py"
        path.write_text(code)
        done = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (where, done.stdout[-2000:], done.stderr[-3000:])
        lines = done.stdout.splitlines()
        printed[where] = [line for line in lines if line.strip() and "\x1b[K" not in line]  # not nnsight's statuses
    remote, local = printed["remote"], printed["local"]
    assert remote == local, (remote, local)
    assert remote[1].startswith("(1, 9, 64) ")  # the first example's shape
    assert "True" in remote and "UP" in remote and "{}" in remote  # edit; status; compare


def test_actqs_client_runs_a_trace_over_plain_http_and_raises_a_failed_jobs_traceback(stack, models):
    from shared.client import Client, JobFailed

    client_model, local = models
    with Client(stack.base_url, api_key=TRUSTED) as client:
        backend = client.nnsight(client_model)
        with client_model.trace("The Eiffel Tower is in", backend=backend):
            hs = client_model.model.layers[1].output.save()
        with local.trace("The Eiffel Tower is in"):
            expected = local.model.layers[1].output.save()
        torch.testing.assert_close(hs, expected, atol=ATOL, rtol=1e-4)
        assert backend.saves.keys() == {"hs"} and backend.job_id is not None
        with pytest.raises(JobFailed) as failed:
            with client_model.trace("Hello", backend=client.nnsight(client_model)):
                hs = client_model.model.layers[0].output
                hs.save()
                hs[0, 0, 0].item() / 0
        assert failed.value.error_type == "nnsight_error" and "ZeroDivisionError" in failed.value.detail
    with Client(stack.base_url, api_key=PLAIN) as client, pytest.raises(Exception) as refused:
        with client_model.trace("Hello", backend=client.nnsight(client_model)):
            client_model.model.layers[0].output.save()
    assert "ACTQ_NNSIGHT_KEYS" in str(refused.value)
