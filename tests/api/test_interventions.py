"""Interventions at submit, over HTTP against the live API (no worker): every bad edit is a 4xx
that names it and says what to fix, and nothing is queued; a good one is queued with its
(edit, module) pairs resolved. References to stored values (an earlier job's captured rows, a
vector set) are read and checked at submit: the caller's, the same model, the module's width,
finite values."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.numpy import save

from api.main import create_app
from shared.attempts import Attempt
from shared.jobs import JobStore
from shared.schemas import CapturePoint, CaptureSpec
from shared.settings import Settings
from shared.storage import open_store
from tests.support.stack import TINY, job_count, queued_messages
from worker.batch.generation import CapturedTensor, Generation
from worker.results.artifacts import write_activations

MESSAGES = [{"role": "user", "content": "What is 2+3?"}]
WIDTH = 64  # tests/support/models.tiny_llama's hidden size
KEY_A, KEY_B = "edit-key-a", "edit-key-b"


def edit(**fields):
    return {"module": "model.layers.1", "op": "add", "vector": [0.5] * WIDTH, **fields}


def body(*edits, **changes):
    base = {"model": TINY, "messages": MESSAGES, "max_tokens": 8, "interventions": list(edits)}
    base.update(changes)
    return base


BAD = [
    ("dunder module", body(edit(module="model.layers.0.__dict__")), "segment '__dict__' is not a name"),
    (
        "unknown module",
        body(edit(module="model.layers.9")),
        "interventions[0]: module 'model.layers.9' names no module",
    ),
    ("last-position module", body(edit(module="lm_head", vector=[1.0] * 49152)), "only computes the last position"),
    ("wrong width", body(edit(vector=[1.0] * 63)), "interventions[0].vector has 63 values; module 'model.layers.1'"),
    (
        "wrong width for the module",
        body(edit(module="model.layers.1.mlp.up_proj")),
        "is 128 wide",
    ),
    ("NaN coefficient", body(edit(coeff="NaN")), "coeff, factor and value must be a finite number"),
    ("huge coefficient", body(edit(coeff=1e308)), "magnitude at most 10000"),
    ("inf in a vector", body(edit(vector=[0.0] * 63 + ["Infinity"])), "not finite numbers"),
    ("1e308 in a vector", body(edit(vector=[1e308] + [0.0] * 63)), "first at index 0"),
    ("no module", body({"op": "zero"}), "name the module to edit"),
    ("unknown op", body(edit(op="steer")), "Input should be 'add', 'scale', 'zero', 'project_out' or 'patch'"),
    ("add without vector", body({"module": "model.layers.1", "op": "add"}), "op 'add' needs vector"),
    ("scale with a vector", body(edit(op="scale", factor=2.0)), "op 'scale' takes no vector"),
    ("features out of range", body({"module": "model.layers.1", "op": "zero", "features": [64]}), "out of range"),
    ("patch without source", body({"module": "model.layers.1", "op": "patch"}), "op 'patch' needs source"),
    ("gate with two thresholds", body(edit(when={"probe": [1.0] * WIDTH, "above": 0, "below": 1})), "one threshold"),
    ("gate probe width", body(edit(when={"probe": [1.0] * 8, "above": 0})), "when.probe has 8 values"),
    ("bad window", body(edit(positions={"prompt": ["1::2"]})), 'a window is "a:b"'),
    ("negative step", body(edit(positions={"generated": [-1]})), "generated steps count from 0"),
    ("step past max_tokens", body(edit(positions={"generated": [8]})), "starts at or after max_tokens (8)"),
    (
        "trace with generated steps",
        body(edit(positions="generated"), mode="trace", max_tokens=None),
        "a trace job generates nothing",
    ),
    ("preset layer", body({"preset": "residual", "layers": [7], "op": "zero"}), "layer 7 is out of range"),
    ("unknown preset", body({"preset": "nope", "op": "zero"}), "has no preset 'nope'"),
    ("baseline without edits", {**body(), "interventions": None, "baseline": True}, "give `interventions`"),
    ("too many edits", body(*[edit()] * 65), "at most 64"),
    ("ten thousand edits", body(*[edit()] * 10_000), "at most 64"),
    ("bad job id", body(edit(vector={"job": "../../etc", "tensor": "x", "row": 0})), "String should match pattern"),
    (
        "unknown job",
        body(edit(vector={"job": "00000000-0000-4000-8000-000000000000", "tensor": "x", "row": 0})),
        "no job",
    ),
    (
        "unknown vector set",
        body(edit(vector={"vector_id": "00000000-0000-4000-8000-000000000000", "name": "v"})),
        "no vector set",
    ),
]


@pytest.mark.parametrize(("case", "payload", "message"), BAD, ids=[b[0] for b in BAD])
def test_bad_interventions_are_refused_and_nothing_is_queued(http, redis_client, case, payload, message):
    before = job_count(redis_client), queued_messages(redis_client, TINY)
    response = http.post("/jobs", json=payload)
    assert response.status_code == 422, response.text
    assert message in response.json()["detail"], response.json()
    assert (job_count(redis_client), queued_messages(redis_client, TINY)) == before


def test_the_openai_routes_refuse_the_same_edits_with_a_400(http, redis_client):
    before = job_count(redis_client)
    chat = {"model": TINY, "messages": MESSAGES, "interventions": [edit(vector=[1.0] * 3)]}
    response = http.post("/v1/chat/completions", json=chat)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "interventions" and "has 3 values" in error["message"]
    assert job_count(redis_client) == before


def test_a_good_edit_is_queued_with_its_modules_resolved(http, redis_client):
    payload = body(
        edit(module="model.layers.{1,2}", coeff=4.0, positions={"prompt": [-1], "generated": ":4"}),
        {"preset": "residual", "layers": [-1], "op": "project_out", "vector": [1.0] * WIDTH, "value": 0.5},
        baseline=True,
    )
    response = http.post("/jobs", json=payload)
    assert response.status_code == 202, response.text
    record = json.loads(redis_client.get(f"actq:job:{response.json()['id']}"))
    assert record["request"]["baseline"] is True
    assert [(p["index"], p["module"], p["width"]) for p in record["edit_points"]] == [
        (0, "model.layers.1", 64),
        (0, "model.layers.2", 64),
        (1, "model.layers.3", 64),
    ]


def finished_job(app: TestClient, settings: Settings, redis_client, values: np.ndarray, headers=None, model=TINY):
    """A job that captured `model.layers.1` at every position, finished as a worker finishes one:
    its file written by the worker's own writer."""
    fields = {"messages": MESSAGES} if model == TINY else {"prompt": "2+3="}
    capture = {"modules": ["model.layers.1"], "positions": "all"}
    response = app.post("/jobs", json={"model": model, "max_tokens": 4, "capture": capture, **fields}, headers=headers)
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    store = JobStore(redis_client, 3600)
    running, _ = store.claim(job_id, "worker", 3)
    point = CapturePoint(name="model.layers.1", module="model.layers.1", hook="output")
    rows = torch.from_numpy(values.astype(np.float32))
    generation = Generation(
        text="5",
        finish_reason="stop",
        prompt_tokens=rows.shape[0] - 3,
        completion_tokens=4,
        token_ids=torch.arange(rows.shape[0] + 1),
        captured=[CapturedTensor(point, rows, 0, rows.shape[0])],
    )
    attempt = Attempt.of(running)
    manifest = write_activations(
        open_store(settings), job_id, model, CaptureSpec(**capture), generation, prefix=attempt.prefix(job_id)
    )
    result = {
        "text": "5",
        "finish_reason": "stop",
        "usage": {"prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5},
    }
    store.succeed(job_id, result, manifest.model_dump(), attempt=attempt)
    return job_id


def test_references_to_an_earlier_jobs_rows_are_checked_at_submit(http, settings, redis_client):
    rng = np.random.default_rng(0)
    good = rng.standard_normal((6, WIDTH))
    source = finished_job(http, settings, redis_client, good)
    row = {"job": source, "tensor": "model.layers.1", "row": -1}
    assert http.post("/jobs", json=body(edit(vector=row))).status_code == 202
    assert http.post("/jobs", json=body(edit(vector={**row, "row": None, "mean": True}))).status_code == 202
    patch = {"module": "model.layers.1", "op": "patch", "source": {"job": source, "tensor": "model.layers.1"}}
    assert http.post("/jobs", json=body(patch)).status_code == 202

    bad = good.copy()
    bad[2, 5] = np.nan
    poisoned = finished_job(http, settings, redis_client, bad)
    other = finished_job(http, settings, redis_client, good, model="tiny-base")
    before = job_count(redis_client)
    cases = [
        (edit(vector={**row, "row": 6}), "row 6 is out of range: tensor 'model.layers.1' has 6 rows"),
        (
            edit(vector={**row, "tensor": "model.layers.2"}),
            "has no tensor 'model.layers.2'; its tensors: model.layers.1",
        ),
        (edit(vector={**row, "job": poisoned, "row": 2}), "1 of its values are not finite"),
        (edit(vector={**row, "job": other}), "ran model 'tiny-base', not 'tiny'"),
        ({**patch, "source": {"job": other, "tensor": "model.layers.1"}}, "ran model 'tiny-base'"),
        ({**patch, "module": "model.layers.2"}, "patch from a capture of the same module and hook"),
        (edit(module="model.layers.1.mlp.up_proj", vector=row), "this module is 128 wide"),
    ]
    for bad_edit, message in cases:
        response = http.post("/jobs", json=body(bad_edit))
        assert response.status_code == 422 and message in response.json()["detail"], (message, response.text)
    assert job_count(redis_client) == before


def test_another_keys_jobs_and_vector_sets_are_unknown(settings, redis_client):
    keyed = settings.model_copy(update={"api_keys": f"{KEY_A},{KEY_B}"})
    a, b = {"authorization": f"Bearer {KEY_A}"}, {"authorization": f"Bearer {KEY_B}"}
    from shared.registry import ModelRegistry
    from tests.support.models import tiny_llama

    registry = ModelRegistry(redis_client, keyed.heartbeat_ttl)
    registry.publish(tiny_llama())
    registry.heartbeat(tiny_llama(), "worker-tiny")
    with TestClient(create_app(keyed)) as app:
        source = finished_job(app, keyed, redis_client, np.ones((6, WIDTH)), headers=a)
        buffer = io.BytesIO(save({"steer": np.ones(WIDTH, dtype=np.float32)}))
        uploaded = app.post("/vectors", content=buffer.getvalue(), headers=a)
        assert uploaded.status_code == 201, uploaded.text
        vector_id = uploaded.json()["id"]
        mine = [
            edit(vector={"job": source, "tensor": "model.layers.1", "row": 0}),
            edit(vector={"vector_id": vector_id, "name": "steer"}),
        ]
        for good in mine:
            assert app.post("/jobs", json=body(good), headers=a).status_code == 202
        before = job_count(redis_client)
        for theirs, message in zip(mine, ["no job with id", "no vector set with id"], strict=True):
            response = app.post("/jobs", json=body(theirs), headers=b)
            assert response.status_code == 422 and message in response.json()["detail"], response.text
        assert job_count(redis_client) == before
        wrong = app.post("/jobs", json=body(edit(vector={"vector_id": vector_id, "name": "nope"})), headers=a)
        assert wrong.status_code == 422 and "has no tensor 'nope'; its tensors: steer" in wrong.json()["detail"]
