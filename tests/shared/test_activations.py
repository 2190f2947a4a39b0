"""The activations reader (shared/activations.py) on hand-made results directories: every row once
per epoch, in order or shuffled, each with the right labels, and its memory bounded by its
buffer while reading a capture many times larger (measured in a process of its own). The same
reader through the API and S3: tests/e2e/test_saelens.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from shared.activations import activations
from tests.shared.cli.test_export_saelens import make_results

ROOT = Path(__file__).resolve().parents[2]


def _rows(truth, point, tokens="all"):
    """(job id, position) -> float32 row, in the order the jobs and positions come."""
    out = {}
    for job_id, (ids, prompt, captured) in truth.items():
        for position, row in captured[point].items():
            if tokens == "all" or (position >= prompt) == (tokens == "generated"):
                out[(job_id, position)] = (torch.from_numpy(row), ids[position], position >= prompt)
    return out


def _seen(reader):
    """Every (job id, position) an epoch yields, in order, each checked against its row."""
    seen, batches = [], []
    for batch, labels in reader:
        batches.append(len(batch))
        for i in range(len(batch)):
            key = (reader.jobs[int(labels["job"][i])].job_id, int(labels["position"][i]))
            seen.append((key, batch[i], int(labels["token_id"][i]), bool(labels["generated"][i])))
    return seen, batches


@pytest.mark.parametrize("point", ["model.layers.1", "model.layers.2:input"])
def test_in_order_every_row_once_with_its_labels(tmp_path, point):
    truth = make_results(tmp_path / "r", late_input=point.endswith(":input"))
    reader = activations(tmp_path / "r", point, batch_size=4, chunk=3, labels=True)
    expected = _rows(truth, point)
    seen, batches = _seen(reader)
    assert [key for key, *_ in seen] == list(expected)  # jobs as listed, positions in order
    for key, row, token, generated in seen:
        want_row, want_token, want_generated = expected[key]
        assert row.dtype == torch.float32 and torch.equal(row, want_row), key  # float16/bfloat16 widened exactly
        assert (token, generated) == (want_token, want_generated)
    assert reader.rows == len(expected) and batches == [4] * (len(expected) // 4) + [len(expected) % 4] * (
        len(expected) % 4 > 0
    )
    assert len(reader) == len(batches)


def test_shuffled_every_row_once_per_epoch_in_a_new_order(tmp_path):
    truth = make_results(tmp_path / "r", lengths=[(5, 9)] * 6)
    expected = _rows(truth, "model.layers.1")
    reader = activations(tmp_path / "r", "model.layers.1", batch_size=5, chunk=4, shuffle=16, seed=3, labels=True)
    orders = []
    for _ in range(2):
        seen, batches = _seen(reader)
        keys = [key for key, *_ in seen]
        assert sorted(keys) == sorted(expected) and len(keys) == len(set(keys)) == 84
        assert all(torch.equal(row, expected[key][0]) for key, row, *_ in seen)
        assert all(b == 5 for b in batches[:-1])
        orders.append(keys)
    assert orders[0] != list(expected) and orders[1] != orders[0]
    again = activations(tmp_path / "r", "model.layers.1", batch_size=5, chunk=4, shuffle=16, seed=3, labels=True)
    assert [key for key, *_ in _seen(again)[0]] == orders[0]  # the seed fixes each epoch's order


@pytest.mark.parametrize("tokens", ["prompt", "generated"])
def test_tokens_picks_the_rows(tmp_path, tokens):
    truth = make_results(tmp_path / "r")
    reader = activations(tmp_path / "r", "model.layers.1", tokens=tokens, batch_size=100, labels=True)
    seen, _ = _seen(reader)
    assert [key for key, *_ in seen] == list(_rows(truth, "model.layers.1", tokens))
    assert {generated for *_, generated in seen} == {tokens == "generated"}


def test_without_labels_and_as_stored(tmp_path):
    make_results(tmp_path / "r")
    batches = list(activations(tmp_path / "r", "model.layers.1", batch_size=8, dtype=None))
    assert all(isinstance(b, torch.Tensor) and b.dtype == torch.float16 and b.shape[1] == 6 for b in batches)
    assert sum(len(b) for b in batches) == 27


def test_what_it_cannot_read_is_named(tmp_path):
    make_results(tmp_path / "r")
    cases = [
        (
            ("model.layers.9",),
            {},
            "no capture 'model.layers.9' .captured: model.layers.1, model.layers.2:input, model.norm",
        ),
        (("model.norm",), {}, "model.norm was reduced on the server .reduce=mean.: no row per token"),
        (("model.layers.1",), {"tokens": "some"}, "tokens='some': one of all, prompt, generated"),
        (("model.layers.1",), {"batch_size": 0}, "batch_size=0: a positive number of rows"),
        (("model.layers.1",), {"shuffle": -1}, "shuffle=-1"),
    ]
    for args, options, message in cases:
        with pytest.raises(ValueError, match=message):
            activations(tmp_path / "r", *args, **options)
    with pytest.raises(ValueError, match="no such results directory"):
        activations(tmp_path / "none", "model.layers.1")
    (tmp_path / "r" / "activations" / "1.safetensors").unlink()
    with pytest.raises(ValueError, match="1.json .generated.: its activations are not downloaded; give client="):
        activations(tmp_path / "r", "model.layers.1")
    with pytest.raises(ValueError, match="jobs are read through the API: give client="):
        activations(["job-0"], "model.layers.1")


def test_memory_stays_within_the_buffer_while_reading_a_capture_many_times_larger(tmp_path):
    """24 jobs of 2,048 rows x 512 float32 (96 MiB on disk), read shuffled through a buffer of
    2,048 rows (4 MiB): the reading process's resident memory, sampled at every batch, grows by a
    small part of the capture; with a buffer larger than the capture (the reader then holds it all
    before shuffling) the same measure grows by all of it."""
    results = tmp_path / "big"
    (results / "samples").mkdir(parents=True)
    (results / "activations").mkdir()
    from safetensors.torch import save_file

    for index in range(24):
        file = f"activations/{index}.safetensors"
        rows = torch.full((2048, 512), float(index))
        save_file({"model.layers.1": rows, "token_ids": torch.arange(2049)}, str(results / file))
        entry = {"name": "model.layers.1", "shape": [2048, 512], "dtype": "float32", "start": 0, "stop": 2048}
        sample = {"index": index, "status": "succeeded", "job_id": f"j{index}", "prompt_tokens": 100,
                  "activations": {"tensors": [entry]}, "activations_file": file}  # fmt: skip
        (results / "samples" / f"{index}.json").write_text(json.dumps(sample))
    script = textwrap.dedent(f"""
        import json, os, torch
        from shared.activations import activations

        def rss():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

        for shuffle in (2048, 1 << 30):
            reader = activations({str(results)!r}, "model.layers.1", batch_size=256, chunk=512, shuffle=shuffle)
            start = peak = rss()
            rows, total = 0, torch.zeros(512, dtype=torch.float64)
            for batch in reader:
                rows += len(batch)
                total += batch.double().sum(0)
                peak = max(peak, rss())
            del reader, batch
            print(json.dumps({{"rows": rows, "sum": total[0].item(), "grew_mib": (peak - start) / 2**20}}))
    """)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}  # freed buffers go back to the system at once
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    grew = []
    for line in done.stdout.strip().splitlines()[-2:]:
        found = json.loads(line)
        assert found["rows"] == 24 * 2048 and found["sum"] == 2048 * sum(range(24))  # every row once
        grew.append(found["grew_mib"])
    # 96 MiB read: through a buffer of 2,048 rows (4 MiB), then one larger than the capture (it holds it all)
    assert grew[0] < 32 and grew[1] > 96, grew
