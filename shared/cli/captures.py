"""What a bulk run captures: the model to use and its default capture (the residual preset at a
few blocks), shared by `actq run-file` and `actq gsm8k`."""

from __future__ import annotations

from typing import Any

from shared.client import Client
from shared.errors import ToolError


def spread_layers(num_layers: int, count: int = 3) -> list[int]:
    """`count` layer indices spread over the depth (quarter, half, three quarters for 3)."""
    return sorted({max(0, min(num_layers - 1, round(num_layers * (i + 1) / (count + 1)))) for i in range(count)})


def residual_capture(info: dict, positions: str = "generated", dtype: str = "float16", layers: str = "spread") -> dict:
    """The default capture: the model's `residual` preset (each decoder block's output: the
    residual stream after that block) at three blocks spread over the depth (`layers` "spread"),
    every block ("all") or the listed ones ("0,4,-1"), from its GET /models entry. A model that
    publishes no residual preset needs --module."""
    blocks = (info.get("presets") or {}).get("residual")
    if not blocks:
        known = ", ".join(sorted(info.get("presets") or {})) or "none"
        raise ToolError(
            f"model {info['name']!r} publishes no `residual` preset (its presets: {known}), so the default "
            "capture cannot be chosen; name what to capture with --module PATH (repeatable; GET /models "
            "lists its modules), or run with --no-capture"
        )
    if layers == "spread":
        picked: list[int] | None = spread_layers(len(blocks))
    elif layers == "all":
        picked = None
    else:
        try:
            picked = [int(x) for x in layers.split(",")]
        except ValueError:
            raise ToolError(f"--layers {layers!r}: spread, all, or block indices like 0,6,-1") from None
    return {
        "preset": "residual",
        **({"layers": picked} if picked is not None else {}),
        "hook": "output",
        "positions": positions,
        "dtype": dtype,
    }


def choose_model(client: Client, model: str | None) -> tuple[str, dict[str, Any] | None]:
    """The model to run (the one live model when none is named) and its GET /models entry (None
    for a model that was never served)."""
    served = client.models()
    if model is None:
        if len(served) != 1:
            raise ToolError(f"name a --model; live models: {', '.join(m['name'] for m in served) or 'none'}")
        model = served[0]["name"]
    info = next((m for m in served if m["name"] == model), None)
    if info is None:  # no live worker now; a model served before is still known (its jobs queue)
        info = next((m for m in client.models(include_offline=True) if m["name"] == model), None)
    return model, info


def choose_capture(
    model: str,
    info: dict[str, Any] | None,
    module: list[str] | None,
    no_capture: bool,
    positions: str,
    dtype: str,
    layers: str,
    reduce: str,
) -> dict[str, Any] | None:
    """The capture spec from the command's options: none, the listed modules, or the residual preset."""
    if no_capture:
        return None
    if module:
        capture: dict[str, Any] = {"modules": list(module), "hook": "output", "positions": positions, "dtype": dtype}
    elif info is not None:
        capture = residual_capture(info, positions=positions, dtype=dtype, layers=layers)
    else:
        raise ToolError(f"no worker has published model {model!r}, so its residual preset is unknown; give --module")
    if reduce != "none":
        capture["reduce"] = reduce
    return capture
