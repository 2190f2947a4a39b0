"""A GSM8K run's residual stream, captured through the live stack, exported with `actq export
--format saelens` and read by SAELens's own ActivationsStore, unchanged: every row it reads is the
captured row (from the run's downloaded files), each window row's labels name the right job and
token, the padding is what SAELens leaves out, and an SAE trains on it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from shared.cli.cancel import run_label
from tests.e2e.test_gsm8k import actq, run_env
from tests.support.stack import TINY

CONTEXT = 16
WIDTH = 64  # the tiny model's hidden size


@pytest.fixture(scope="module")
def exported(live, tmp_path_factory):
    import subprocess

    out = tmp_path_factory.mktemp("sae") / "run"
    cmd = actq(
        live, "gsm8k", "--out", str(out), "--dataset", "synthetic", "--limit", "6", "--model", TINY,
        "--max-tokens", "6", "--positions", "all", "--layers", "all", "--download", "--quiet",
    )  # fmt: skip
    done = subprocess.run(cmd, env=run_env(live), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    label = run_label("gsm8k", json.loads((out / "run.json").read_text())["run_id"])
    through_api = ["--label", label, "--out", str(out.parent / "api")]  # the run's jobs read through the API
    for source in ([str(out)], through_api):  # both now: each e2e test starts from an empty job space
        args = ["export", *source, "--format", "saelens", "--context-size", str(CONTEXT)]
        done = subprocess.run(actq(live, *args), env=run_env(live), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    return out, json.loads((out / "saelens" / "actq-export.json").read_text())


def _store(path, hook):
    from sae_lens import ActivationsStore

    return ActivationsStore(
        model=None, dataset=None, streaming=False, hook_name=hook, hook_head_index=None,
        context_size=CONTEXT, d_in=WIDTH, n_batches_in_buffer=4, total_training_tokens=10_000,
        store_batch_size_prompts=1, train_batch_size_tokens=64, prepend_bos=False,
        normalize_activations="none", device=torch.device("cpu"), dtype="float32",
        cached_activations_path=str(path), exclude_special_tokens=torch.tensor([-1]),
    )  # fmt: skip


def test_saelens_reads_every_captured_row_and_each_labels_job_and_token(exported):
    """Window by window through SAELens's store (one window a batch): its activations equal the
    float16 rows of the downloaded capture files exactly (widened), its token ids and the labels
    the export adds beside them name the job and position each row came from, every row of every
    job once in order, and SAELens's own filter drops exactly the padding."""
    import datasets

    out, meta = exported
    points = [c["name"] for c in meta["columns"]]
    assert points == [f"model.layers.{i}" for i in range(4)] and {c["dtype"] for c in meta["columns"]} == {"float16"}
    jobs = json.loads((out / "jobs.json").read_text())
    assert [j["job_id"] for j in meta["jobs"]] == [jobs[str(i)] for i in range(6)]
    captured = {}
    for i, job in enumerate(meta["jobs"]):
        sample = json.loads((out / "samples" / f"{i}.json").read_text())
        assert job["sample"] == i and sample["job_id"] == job["job_id"]
        with safe_open(str(out / sample["activations_file"]), framework="pt") as f:
            captured[i] = {name: f.get_tensor(name) for name in [*points, "token_ids"]}
            prompt = sample["prompt_tokens"]
        # a row per token the model read: every one but the last generated, which it never reads
        assert all(captured[i][p].shape[0] == len(captured[i]["token_ids"]) - 1 for p in points)
        captured[i]["prompt"], captured[i]["rows"] = prompt, len(captured[i]["token_ids"]) - 1
    labels = datasets.load_from_disk(str(out / "saelens")).with_format("torch", columns=["actq_job", "actq_position"])
    expected = [(i, p) for i in captured for p in range(captured[i]["rows"])]
    assert meta["rows"] == len(expected) and meta["windows"] == -(-len(expected) // CONTEXT)
    for point in points:
        store = _store(out / "saelens", point)
        seen = []
        for window in range(meta["windows"]):
            acts, token_ids = store.get_raw_llm_batch(raise_on_epoch_end=True)
            row = labels[window]
            for offset in range(CONTEXT):
                job, position = int(row["actq_job"][offset]), int(row["actq_position"][offset])
                if job == -1:  # the last window's padding
                    assert token_ids[offset] == -1 and not acts[offset].any() and window == meta["windows"] - 1
                    continue
                seen.append((job, position))
                assert token_ids[offset] == captured[job]["token_ids"][position]
                assert torch.equal(acts[offset], captured[job][point][position].float()), (point, job, position)
        assert seen == expected
    store = _store(out / "saelens", points[2])
    kept = sum(len(store.get_filtered_llm_batch(raise_on_epoch_end=True)) for _ in range(meta["windows"]))
    assert kept == meta["rows"]  # exclude_special_tokens=[-1]: every real row, no padding
    assert meta["generated_rows"] == sum(c["rows"] - c["prompt"] for c in captured.values()) == 6 * 5


def test_an_sae_trains_on_the_export_with_saelens(exported):
    """SAELens's trainer, fed by its own store of the export: 150 steps bring the reconstruction
    error of every exported row of layer 2 well under the untrained SAE's."""
    from sae_lens import SAETrainer, StandardTrainingSAE, StandardTrainingSAEConfig
    from sae_lens.config import SAETrainerConfig

    out, meta = exported
    torch.manual_seed(0)
    sae = StandardTrainingSAE(StandardTrainingSAEConfig(d_in=WIDTH, d_sae=4 * WIDTH, l1_coefficient=0.1))
    store = _store(out / "saelens", "model.layers.2")
    rows = torch.cat([store.get_filtered_llm_batch() for _ in range(meta["windows"])])
    assert rows.shape == (meta["rows"], WIDTH)

    def error() -> float:
        with torch.no_grad():
            return float(((sae.decode(sae.encode(rows)) - rows) ** 2).mean())

    before = error()
    steps = {"total_training_samples": 150 * 64, "train_batch_size_samples": 64, "n_batches_for_norm_estimate": 4}
    cfg = SAETrainerConfig(**steps, lr=1e-3, lr_end=1e-3)
    trainer = SAETrainer(cfg=cfg, sae=sae, data_provider=_store(out / "saelens", "model.layers.2"))
    trained = trainer.fit()
    assert trainer.n_training_steps == 150 and trained is sae
    assert error() < 0.5 * before, (before, error())


def test_the_reader_streams_jobs_rows_through_the_api_from_s3(live_s3):
    """shared/activations.py over jobs whose files are in S3: each chunk a row range through the
    API, shuffled within a buffer smaller than the jobs' rows: every row once per epoch, equal to
    the whole file downloaded and sha256-checked, with its job, position and token."""
    from shared.activations import activations
    from shared.client import Client

    capture = {"modules": ["model.layers.1"], "positions": "all"}
    with Client(live_s3.base_url, timeout=60) as client:
        jobs = [
            client.submit("tiny-s3", [{"role": "user", "content": f"Count to {n}."}], max_tokens=8, capture=capture)
            for n in (3, 4, 5)
        ]
        whole = {}
        for job in jobs:
            assert job.wait(timeout=120).status == "succeeded", job.error
            whole[job.id] = job.activations()
        expected = {(j, p) for j, t in whole.items() for p in range(len(t["model.layers.1"]))}
        reader = activations(
            [job.id for job in jobs], "model.layers.1", client=client, batch_size=7, chunk=5, shuffle=12, labels=True
        )
        assert reader.rows == len(expected) > 12
        for _ in range(2):
            seen = []
            for batch, labels in reader:
                for i in range(len(batch)):
                    job, position = reader.jobs[int(labels["job"][i])].job_id, int(labels["position"][i])
                    assert torch.equal(batch[i], whole[job]["model.layers.1"][position].float()), (job, position)
                    assert labels["token_id"][i] == whole[job]["token_ids"][position]
                    seen.append((job, position))
            assert len(seen) == len(set(seen)) and set(seen) == expected
        generated = activations(jobs, "model.layers.1", client=client, tokens="generated")  # Job objects too
        assert generated.rows == sum(job.result.usage.completion_tokens - 1 for job in jobs)


def test_the_runs_jobs_picked_through_the_api_export_the_same_windows(exported):
    """`actq export --label RUN --format saelens`: the run's jobs read through the API (no file of
    the results directory) give the same windows, and the jobs table names the run."""
    import datasets

    out, meta = exported
    label = run_label("gsm8k", json.loads((out / "run.json").read_text())["run_id"])
    picked = json.loads((out.parent / "api" / "actq-export.json").read_text())
    assert [j["job_id"] for j in picked["jobs"]] == [j["job_id"] for j in meta["jobs"]]
    assert {j["run"] for j in picked["jobs"]} == {label} and picked["rows"] == meta["rows"]
    ours, theirs = (datasets.load_from_disk(str(p)).with_format("numpy") for p in (out / "saelens", out.parent / "api"))
    for column in ["token_ids", "actq_job", "actq_position", "actq_generated", "model.layers.0", "model.layers.3"]:
        assert np.array_equal(np.asarray(ours[column]), np.asarray(theirs[column])), column
