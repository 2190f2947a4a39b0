"""The independent reference for interventions: plain PyTorch forward hooks that edit a module's
value on a plain Hugging Face `generate` (or one forward pass), written from docs/interventions.md's
definitions and nothing of actq's. Positions: the first pass feeds [0, P); pass k >= 1 feeds
position P - 1 + k."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tests.support.reference import encode

# (value [S, W] float32 of the positions `positions`, positions) -> the edited value
Edit = Callable[[torch.Tensor, list[int]], torch.Tensor]


def add(vector: torch.Tensor, coeff: float, selected: set[int], normalize: bool = False) -> Edit:
    def edit(value: torch.Tensor, positions: list[int]) -> torch.Tensor:
        out = value.clone()
        for s, p in enumerate(positions):
            if p in selected:
                v = vector / vector.norm() * value[s].norm() if normalize else vector
                out[s] = value[s] + coeff * v
        return out

    return edit


def scale(factor: float, features: list[int] | None, selected: set[int]) -> Edit:
    def edit(value: torch.Tensor, positions: list[int]) -> torch.Tensor:
        out = value.clone()
        cols = features if features is not None else list(range(value.shape[1]))
        for s, p in enumerate(positions):
            if p in selected:
                out[s, cols] = value[s, cols] * factor
        return out

    return edit


def zero(features: list[int] | None, selected: set[int]) -> Edit:
    return scale(0.0, features, selected)


def project_out(direction: torch.Tensor, value_along: float, selected: set[int]) -> Edit:
    unit = direction / direction.norm()

    def edit(value: torch.Tensor, positions: list[int]) -> torch.Tensor:
        out = value.clone()
        for s, p in enumerate(positions):
            if p in selected:
                out[s] = value[s] - (torch.dot(value[s], unit) - value_along) * unit
        return out

    return edit


def patch(rows: torch.Tensor, first: int, selected: set[int]) -> Edit:
    def edit(value: torch.Tensor, positions: list[int]) -> torch.Tensor:
        out = value.clone()
        for s, p in enumerate(positions):
            if p in selected:
                out[s] = rows[p - first]
        return out

    return edit


def gated(inner: Edit, probe: torch.Tensor, bias: float, above: float | None, below: float | None) -> Edit:
    """Apply `inner` only at positions whose score probe . value + bias crosses the threshold."""

    def edit(value: torch.Tensor, positions: list[int]) -> torch.Tensor:
        score = value @ probe + bias
        fire = score > above if above is not None else score < below
        edited = inner(value, positions)
        return torch.where(fire[:, None], edited, value)

    return edit


def edited_generate(
    model,
    tokenizer,
    messages,
    max_new_tokens: int,
    edits: list[tuple[str, str, Edit]],  # (module, hook, edit), applied in this order on a module
    capture: list[str],
):
    """Greedy generate with the edits and capture hooks (registered after the edits: they see the
    edited values). Returns (token_ids [P+N], {path: [rows, W]}, P)."""
    encoded = encode(tokenizer, messages)
    prompt = int(encoded["input_ids"].shape[1])
    calls: dict[tuple[str, str], int] = {}
    handles = []

    def positions_of(key: tuple[str, str], seq: int) -> list[int]:
        k = calls.get(key, 0)
        calls[key] = k + 1
        return list(range(seq)) if k == 0 else [prompt - 1 + k]

    by_key: dict[tuple[str, str], list[Edit]] = {}
    for module, hook, edit in edits:
        by_key.setdefault((module, hook), []).append(edit)
    for (module, hook), chain in by_key.items():
        target = model.get_submodule(module)

        def run(value: torch.Tensor, key=(module, hook), chain=chain) -> torch.Tensor:
            flat = value[0].reshape(value.shape[1], -1) if value.dim() >= 3 else value
            positions = positions_of(key, flat.shape[0])
            edited = flat.float()
            for edit in chain:
                edited = edit(edited, positions)
            return edited.to(value.dtype).reshape(value.shape)

        if hook == "output":

            def on_output(_m, _a, output, run=run):
                if isinstance(output, tuple):
                    return (run(output[0]), *output[1:])
                return run(output)

            handles.append(target.register_forward_hook(on_output))
        else:

            def on_input(_m, args, kwargs, run=run):
                if args:
                    return (run(args[0]), *args[1:]), kwargs
                name = next(iter(kwargs))
                return args, {**kwargs, name: run(kwargs[name])}

            handles.append(target.register_forward_pre_hook(on_input, with_kwargs=True))
    steps: dict[str, list[torch.Tensor]] = {path: [] for path in capture}
    for path in capture:

        def keep(_m, _a, output, path=path):
            value = output[0] if isinstance(output, tuple) else output
            steps[path].append(value.detach().float().reshape(-1, value.shape[-1]).clone())

        handles.append(model.get_submodule(path).register_forward_hook(keep))
    try:
        with torch.inference_mode():
            ids = model.generate(
                **encoded, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id
            )
    finally:
        for handle in handles:
            handle.remove()
    rows = {path: torch.cat(steps[path]) for path in capture}
    return ids[0], rows, prompt
