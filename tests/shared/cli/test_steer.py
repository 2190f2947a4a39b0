"""The capture -> probe -> steer loop's pieces without a stack: probe directions in activation
space (`actq probe`'s probe-directions.safetensors), the steering options and their refusals
(one line, exit 2, nothing written), and the sweep's report."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from shared.cli import probes, steer
from shared.errors import ToolError
from tests.shared.cli.test_cli_errors import actq, one_line_error
from tests.shared.cli.test_probes import NAMES, H, make_results


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    root = tmp_path_factory.mktemp("probed")
    make_results(root, n=120)
    report = probes.run(root, folds=3)
    return root, report


def read_directions(path):
    with safe_open(str(path), framework="np") as f:
        metadata = f.metadata()
        return {name: f.get_tensor(name) for name in f.keys()}, metadata


def test_each_probe_direction_is_the_pipelines_decision_function_on_raw_activations(probed):
    root, report = probed
    tensors, metadata = read_directions(root / probes.DIRECTIONS_FILE)
    features, labels, meta = probes.load_dataset(root)
    rng = np.random.default_rng(7)
    held_out = rng.normal(size=(50, H)) * 3 + 1  # rows the probes never saw
    checked = 0
    for entry in report["probes"]:
        key = (entry["point"], entry["pooling"])
        name = f"{entry['point']}:{entry['pooling']}"
        assert entry["direction"] == name and entry["positive_class"] == "true"
        unit, info = tensors[name], json.loads(metadata[name])
        assert unit.dtype == np.float32 and unit.shape == (H,)
        assert abs(float(np.linalg.norm(unit.astype(np.float64))) - 1) < 1e-6
        assert info["pooling"] == entry["pooling"] and info["module"] == entry["point"] and info["hook"] == "output"
        assert (info["label"], info["positive_class"], info["negative_class"]) == ("answer_correct", "true", "false")
        assert info["layer"] == entry["layer"] and info["balanced_accuracy"] == round(
            entry["balanced_accuracy_mean"], 6
        )
        rows = meta["members"][key]
        model = probes.fit_probe(features[key], labels[rows])  # the same fit on the same rows
        expected = model.decision_function(held_out)
        got = info["norm"] * (held_out @ unit.astype(np.float64)) + info["bias"]
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)
        # the score points toward the positive class: its rows score higher
        scores = info["norm"] * (features[key] @ unit.astype(np.float64)) + info["bias"]
        positive = labels[rows] == "true"
        assert scores[positive].mean() > scores[~positive].mean()
        checked += 1
    assert checked == len(NAMES) * 3


def test_a_points_bare_name_is_its_best_pooling(probed):
    root, report = probed
    tensors, metadata = read_directions(root / probes.DIRECTIONS_FILE)
    assert set(tensors) == set(NAMES) | {f"{p['point']}:{p['pooling']}" for p in report["probes"]}
    for point in NAMES:
        entries = [p for p in report["probes"] if p["point"] == point]
        best = max(entries, key=lambda p: p["balanced_accuracy_mean"])
        assert json.loads(metadata[point])["pooling"] == best["pooling"]
        np.testing.assert_array_equal(tensors[point], tensors[f"{point}:{best['pooling']}"])
    assert json.loads(metadata["actq"])["kind"] == "probe-directions"
    # the signal layer's direction is the one the data was shifted along (make_results' seed 0)
    rng = np.random.default_rng(0)
    shift = rng.normal(size=H)
    shift /= np.linalg.norm(shift)
    assert float(np.dot(tensors["model.layers.6.input_layernorm"], shift)) > 0.6
    assert abs(float(np.dot(tensors["model.layers.3.input_layernorm"], shift))) < 0.6  # a noise layer


def test_a_label_of_one_class_or_three_writes_no_directions(tmp_path):
    make_results(tmp_path, n=60, labels=[i % 3 for i in range(60)])
    report = probes.run(tmp_path, label="correct.flexible", folds=3)
    assert all("direction" not in p for p in report["probes"])
    assert not (tmp_path / probes.DIRECTIONS_FILE).exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"steer": "v.safetensors", "at": None, "coeff": ["1"]}, "--steer needs --at MODULE"),
        ({"steer": "v.safetensors", "at": "model.layers.1", "coeff": None}, "--steer needs --coeff C"),
        ({"steer": None, "at": "model.layers.1", "coeff": ["1"]}, "--at, --coeff steer a run: add --steer"),
        ({"steer": "v", "at": "m", "coeff": ["nan"]}, "--coeff 'nan': give a finite number"),
        ({"steer": "v", "at": "m", "coeff": ["inf"]}, "--coeff 'inf': give a finite number"),
        ({"steer": "v", "at": "m", "coeff": ["2e4"]}, "of magnitude at most 10000"),
        ({"steer": "v", "at": "m", "coeff": ["x"]}, "--coeff 'x' is not a number"),
    ],
)
def test_option_refusals(args, message):
    with pytest.raises(ToolError, match=message.replace("(", r"\(")):
        steer.options(**args)


def test_options_keep_each_strength_once_and_zero_as_the_reference():
    opts = steer.options("v", "model.layers.3", ["0", "-0", "4", "4.0", "-1.5"])
    assert opts is not None and opts.coeffs == [0.0, 4.0, -1.5]
    assert [steer.coeff_label(c) for c in opts.coeffs] == ["0", "4", "-1.5"]
    assert steer.intervention(opts, "id", "name", 0.0) is None
    assert steer.intervention(opts, "id", "name", 4.0) == [
        {
            "module": "model.layers.3",
            "op": "add",
            "vector": {"vector_id": "id", "name": "name"},
            "coeff": 4.0,
            "normalize": False,
        }
    ]


def test_which_tensor_of_a_file_steers(tmp_path):
    path = tmp_path / "v.safetensors"
    save_file({"model.layers.2": np.ones(H, np.float32), "other": np.zeros(H, np.float32)}, str(path))
    pick = steer.read_tensor
    assert pick(path, None, "model.layers.2").name == "model.layers.2"  # the one named like --at
    assert pick(path, "other", "model.layers.2").name == "other"
    with pytest.raises(ToolError, match="has 2 tensors and none named 'model.layers.5'.*--steer-name"):
        pick(path, None, "model.layers.5")
    with pytest.raises(ToolError, match="has no tensor 'nope'"):
        pick(path, "nope", "model.layers.2")
    single = tmp_path / "one.safetensors"
    save_file({"x": np.ones(H, np.float32)}, str(single))
    assert pick(single, None, "model.layers.9").name == "x"  # the only one
    stack = tmp_path / "stack.safetensors"
    save_file({"s": np.ones((2, H), np.float32)}, str(stack))
    with pytest.raises(ToolError, match=r"tensor 's' is \(2, 16\).*give one vector"):
        pick(stack, None, "m")
    text = tmp_path / "notes.safetensors"
    text.write_text("not a safetensors file at all")
    with pytest.raises(ToolError, match="not a safetensors file"):
        pick(text, None, "m")
    with pytest.raises(ToolError, match="no such file, and not a vector-set id"):
        steer.read_vector(steer.Options(str(tmp_path / "missing.safetensors"), "m", [1.0]))
    by_id = steer.read_vector(steer.Options("0b9f3c2e-8d4a-4f6b-9c1d-2e3f4a5b6c7d", "m", [1.0]))
    assert by_id.vector_id == "0b9f3c2e-8d4a-4f6b-9c1d-2e3f4a5b6c7d" and by_id.values is None


def test_probe_metric_reads_a_directions_file(probed, tmp_path):
    root, _ = probed
    file = root / probes.DIRECTIONS_FILE
    probe = steer.read_probe(f"{file}:model.layers.6.input_layernorm:mean_all")
    assert (probe.point, probe.pooling, probe.positive) == ("model.layers.6.input_layernorm", "mean_all", "true")
    with pytest.raises(ToolError, match="holds 24 probes: name one"):
        steer.read_probe(str(file))
    plain = tmp_path / "plain.safetensors"
    save_file({"v": np.ones(H, np.float32)}, str(plain))
    with pytest.raises(ToolError, match="has no probe metadata"):
        steer.read_probe(str(plain))
    # its module joins the capture, and a pooling the capture cannot give is refused
    capture = {"preset": "residual", "layers": [1], "hook": "output", "positions": "all", "dtype": "float16"}
    info = {"presets": {"residual": [f"model.layers.{i}" for i in range(8)]}}
    added = steer.capture_with_probe(capture, info, probe)
    assert added["modules"] == ["model.layers.6.input_layernorm"] and added["preset"] == "residual"
    with pytest.raises(ToolError, match="run with --positions all"):
        steer.capture_with_probe({**capture, "positions": "generated"}, info, probe)
    with pytest.raises(ToolError, match="run without --reduce"):
        steer.capture_with_probe({**capture, "reduce": "mean"}, info, probe)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--at", "model.layers.1", "--coeff", "2"], "--at, --coeff steer a run: add --steer"),
        (["--steer", "{vec}", "--coeff", "2"], "--steer needs --at MODULE"),
        (["--steer", "{vec}", "--at", "model.layers.1"], "--steer needs --coeff C"),
        (["--steer", "{vec}", "--at", "model.layers.1", "--coeff", "nan"], "--coeff 'nan': give a finite number"),
        (["--steer", "{vec}", "--at", "model.layers.1", "--coeff", "big"], "--coeff 'big' is not a number"),
        (["--steer", "{bad}", "--at", "model.layers.1", "--coeff", "2"], "not a safetensors file"),
        (["--steer", "{vec}", "--steer-name", "x", "--at", "m", "--coeff", "2"], "has no tensor 'x'"),
        (["--steer", "{vec}", "--at", "m", "--coeff", "2"], "none named 'm' (the --at module)"),
    ],
)
@pytest.mark.parametrize("command", ["gsm8k", "run-file"])
def test_the_commands_refuse_bad_steering_in_one_line_and_write_nothing(tmp_path, command, extra, message):
    vec = tmp_path / "v.safetensors"
    save_file({"a": np.ones(4, np.float32), "b": np.ones(4, np.float32)}, str(vec))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00" * 3)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "2 + 2 ="}\n')
    out = tmp_path / "out"
    head = ["gsm8k", "--dataset", "samples"] if command == "gsm8k" else ["run-file", str(prompts)]
    args = [a.format(vec=vec, bad=bad) for a in extra]
    line = one_line_error(actq(*head, "--out", str(out), *args))
    assert message in line, line
    assert not out.exists()


def test_report_and_plot_from_strengths(tmp_path):
    opts = steer.Options("v", "model.layers.3", [0.0, 2.0])
    vector = steer.Vector(name="model.layers.3", vector_id="id", metadata={"label": "x"})
    swept = steer.Sweep(tmp_path, opts, vector, state={"vectors": "v"})
    for coeff, totals in ((0.0, []), (2.0, [5, 7])):
        run_dir = tmp_path / "steer" / f"coeff={steer.coeff_label(coeff)}"
        run_dir.mkdir(parents=True)
        samples = [
            {
                "status": "succeeded",
                "completion_tokens": 3 + int(coeff),
                **({"interventions": [{"total": t}]} if totals else {}),
            }
            for t in (totals or [0, 0])
        ]
        (run_dir / "results.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    summaries = {c: {"succeeded": 2, "failed": 0} for c in (0.0, 2.0)}
    content = steer.report(swept, summaries, steer.length_metric, "mean_completion_tokens", "tiny")
    rows = {r["coeff"]: r for r in content["strengths"]}
    assert rows[0.0] == {
        "coeff": 0.0,
        "dir": "steer/coeff=0",
        "n": 2,
        "metric": 3.0,
        "succeeded": 2,
        "failed": 0,
        "edited_positions": 0,
    }
    assert rows[2.0]["metric"] == 5.0 and rows[2.0]["edited_positions"] == 12
    assert json.loads((tmp_path / "steering.json").read_text()) == content
    assert (tmp_path / "steering.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
