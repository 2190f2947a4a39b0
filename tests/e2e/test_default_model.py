"""The built-in SmolLM2-135M-Instruct, end to end, and the README's first command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_safetensors
from transformers import AutoModelForCausalLM, AutoTokenizer

from shared.broker import make_celery
from shared.settings import Settings
from tests.support.reference import hooked_generate, select
from tests.support.stack import SMOL

pytestmark = pytest.mark.slow

MESSAGES = [
    {"role": "system", "content": "You are a careful math tutor."},
    {"role": "user", "content": "Tom has 3 apples and buys 5 more. How many apples does he have?"},
]


def test_full_lifecycle_every_token_matches_forward_hooks(live_smol, smol_dir):
    with live_smol.client() as http:
        model = next(m for m in http.get("/models").json() if m["name"] == SMOL)
        assert model["num_layers"] == 30 and model["hidden_size"] == 576 and model["dtype"] == "float32"
        body = {
            "model": SMOL,
            "messages": MESSAGES,
            "max_tokens": 24,
            "temperature": 0,
            "capture": {
                "modules": [
                    "model.layers.{8,12,16}.input_layernorm",
                    "model.layers.{8,12,16}",
                    "model.layers.29.post_attention_layernorm",
                ],
                "positions": "all",
                "dtype": "float32",
            },
        }
        job = live_smol.wait(http, live_smol.submit(http, body), timeout=300)
        assert job["status"] == "succeeded", (job, live_smol.log_tail("worker-smol"))
        tensors = load_safetensors(http.get(f"/jobs/{job['id']}/activations").content)

    reference = AutoModelForCausalLM.from_pretrained(smol_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    modules = [t["module"] for t in job["activations"]["tensors"]]
    assert len(modules) == 7
    new_tokens = job["result"]["usage"]["completion_tokens"]
    ids, rows, prompt_tokens = hooked_generate(reference, tokenizer, MESSAGES, 24, modules)
    assert torch.equal(tensors["token_ids"], ids)
    assert job["result"]["text"] == tokenizer.decode(ids[prompt_tokens:], skip_special_tokens=True)
    for info in job["activations"]["tensors"]:
        expected = select(rows[info["module"]], "all", prompt_tokens, new_tokens)
        assert info["shape"] == [prompt_tokens + new_tokens - 1, 576]
        assert torch.equal(tensors[info["name"]], expected), info["name"]


def test_control_commands_answer_while_a_job_runs(live_smol):
    """Why prefork: the worker's parent answers `inspect ping` while its child generates."""
    with live_smol.client() as http:
        body = {
            "model": SMOL,
            "messages": [{"role": "user", "content": "Write a long story about a cat."}],
            "max_tokens": 120,
            "capture": {"modules": ["model.layers.*"], "positions": "last"},
        }
        job_id = live_smol.submit(http, body)
        deadline = time.monotonic() + 60
        while http.get(f"/jobs/{job_id}").json()["status"] == "queued" and time.monotonic() < deadline:
            time.sleep(0.01)
        celery = make_celery(Settings(redis_url=live_smol.redis_url, model=SMOL))
        started = time.monotonic()
        replies = celery.control.inspect(timeout=1.0).ping()
        elapsed = time.monotonic() - started
        running = http.get(f"/jobs/{job_id}").json()
        assert running["status"] == "running", "the job ended before the ping; make it longer"
        assert replies and all(reply == {"ok": "pong"} for reply in replies.values())
        assert running["worker"] in replies, (running["worker"], replies)  # the busy worker answered
        assert elapsed < 2.0
        assert live_smol.wait(http, job_id, timeout=300)["status"] == "succeeded"


def _run_processes(home: Path) -> set[str]:
    """Workers, API processes and Redis servers started by this test's `actq run`: those whose
    environment has its own HOME (inherited by every process it starts), so that processes other
    tests or another checkout start meanwhile on the same machine do not count."""
    found = subprocess.run(
        ["pgrep", "-f", "worker.celery_app|uvicorn api.main|redis-server"], capture_output=True, text=True
    )
    ours = set()
    for pid in found.stdout.split():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if f"HOME={home}".encode() in environ:
            ours.add(pid)
    return ours


def test_actq_run_does_the_main_job_and_leaves_nothing_behind(smol_dir, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACTQ_")}
    home = tmp_path / "home"  # where the default store (~/.local/share/actq) would be
    env.update(ACTQ_MODEL_CACHE_DIR=str(smol_dir.parent), HOME=str(home))
    out = tmp_path / "demo"
    done = subprocess.run(
        [
            *[sys.executable, "-m", "shared.cli", "run", "--problems", "3", "--max-tokens", "24"],
            *["--probe-problems", "12", "--out", str(out)],
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    text = done.stdout
    assert "embedded Redis on redis://127.0.0.1:" in text and "the model answers actq's own sample problems" in text
    assert "3/3 problems answered by smollm2-135m" in text and "accuracy: strict " in text
    answers, traced = out / "answers", out / "gold-vs-corrupted"
    assert f"activations in {answers / 'activations'}" in text and f"probe plot: {traced / 'probes.png'}" in text
    summary = json.loads((answers / "summary.json").read_text())
    assert summary["complete"] and summary["succeeded"] == 3 and summary["generated_tokens"] <= 3 * 24
    assert len(list((answers / "activations").glob("*.safetensors"))) == 3
    sample = json.loads((answers / "samples" / "0.json").read_text())
    # The residual preset on SmolLM2's 30 layers: layers 8, 15, 22.
    assert [t["name"] for t in sample["activations"]["tensors"]] == [f"model.layers.{i}" for i in (8, 15, 22)]
    # The probes: gold vs corrupted solutions of 12 synthetic problems, every layer's residual stream
    # at the end of the answer (reduced by the worker to its last row), one probe per layer.
    report = json.loads((traced / "probes.json").read_text())
    assert report["n_samples"] == 24 and report["sources"] == {"corrupted": 12, "gold": 12}
    assert [p["layer"] for p in report["probes"]] == list(range(30)) and "skipped" not in report["probes"][0]
    assert {p["pooling"] for p in report["probes"]} == {"reduced_last"}
    assert "probes for 'is this solution's final answer right?' (24 traces, chance 0.50)" in text
    assert (traced / "probes.png").read_bytes()[:4] == b"\x89PNG"
    # The loop closed: the 3 problems again with the best probe's direction added at its layer, at
    # -0.25, 0 and 0.25 times the residual stream's norm; coefficient 0 is the unsteered run.
    steering = json.loads((out / "steered" / "steering.json").read_text())
    best = max(report["probes"], key=lambda p: p["balanced_accuracy_mean"])
    assert steering["module"] == best["point"] and steering["normalize"] and steering["metric"] == "accuracy_flexible"
    assert [row["coeff"] for row in steering["strengths"]] == [-0.25, 0.0, 0.25]
    assert all(row["n"] == 3 for row in steering["strengths"])
    assert [row["edited_positions"] > 0 for row in steering["strengths"]] == [True, False, True]
    assert f"3/3: the 3 problems again, {best['point']}'s probe direction added there" in text
    assert f"steered at {best['point']}, flexible accuracy by coeff: -0.25: " in text
    assert f"steering plot: {out / 'steered' / 'steering.png'}" in text
    assert (out / "steered" / "steering.png").read_bytes()[:4] == b"\x89PNG"
    assert not (home / ".local" / "share" / "actq").exists()  # no second copy of the demo's files
    assert _run_processes(home) == set()  # no worker, API or Redis left running
