"""The independent reference for captured activations: plain PyTorch forward hooks on a plain
Hugging Face `generate`, sliced by the documented position rules. No nnsight, no actq engine."""

from __future__ import annotations

import torch


def _first(value):
    if hasattr(value, "to_tuple"):  # a transformers ModelOutput
        value = value.to_tuple()
    return value[0] if isinstance(value, (tuple, list)) else value


def _rows(value: torch.Tensor) -> torch.Tensor:
    """A step's value as `[S, W]` (docs/capture.md): `[1, S, H]` loses its batch dim, `[1, S, heads, D]`
    flattens its trailing dims, OPT's `[S, H]` is already rows."""
    if value.dim() == 2:
        return value
    return value[0].reshape(value.shape[1], -1)


def encode(tokenizer, prompt):
    """A chat (a list of messages) through the chat template, or raw text (a str) as `tokenizer(text)`."""
    if isinstance(prompt, str):
        return dict(tokenizer(prompt, return_tensors="pt"))
    return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_dict=True, return_tensors="pt")


def hooked_generate(model, tokenizer, messages, max_new_tokens, modules, hook="output", **generate_kwargs):
    """Greedy (unless told otherwise) generate with hooks; returns (token_ids [P+N], {path: [rows, H]}, P).
    `messages` is a chat, or a str for a raw prompt."""
    encoded = encode(tokenizer, messages)
    steps: dict[str, list[torch.Tensor]] = {path: [] for path in modules}
    handles = []
    for path in modules:
        module = model.get_submodule(path)
        if hook == "output":

            def on_output(_module, _args, output, path=path):
                steps[path].append(_first(output).detach().float().clone())

            handles.append(module.register_forward_hook(on_output))
        else:

            def on_input(_module, args, kwargs, path=path):
                value = args[0] if args else next(iter(kwargs.values()))
                steps[path].append(value.detach().float().clone())

            handles.append(module.register_forward_pre_hook(on_input, with_kwargs=True))
    generate_kwargs.setdefault("do_sample", False)
    try:
        with torch.inference_mode():
            ids = model.generate(
                **encoded, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.eos_token_id, **generate_kwargs
            )
    finally:
        for handle in handles:
            handle.remove()
    rows = {path: torch.cat([_rows(s) for s in steps[path]], dim=0) for path in modules}
    return ids[0], rows, int(encoded["input_ids"].shape[1])


def select(rows: torch.Tensor, positions: str, prompt_tokens: int, new_tokens: int) -> torch.Tensor:
    """Rows for a positions choice, for a module that sees every position (docs/capture.md, "Positions")."""
    fed = prompt_tokens + new_tokens - 1
    assert rows.shape[0] == fed, (rows.shape, fed)
    return {
        "all": rows,
        "prompt": rows[:prompt_tokens],
        "generated": rows[prompt_tokens - 1 :],
        "last": rows[fed - 1 :],
    }[positions]


def hooked_forward(model, input_ids: torch.Tensor, modules: list[str]):
    """One plain forward pass `model(input_ids)` with forward hooks (cloning in the hook); returns
    ({path: [P, W] float32}, logits [P, V] float32)."""
    kept: dict[str, torch.Tensor] = {}
    handles = []
    for path in modules:

        def on_output(_module, _args, output, path=path):
            kept[path] = _rows(_first(output)).detach().float().clone()

        handles.append(model.get_submodule(path).register_forward_hook(on_output))
    try:
        with torch.inference_mode():
            logits = model(input_ids=input_ids).logits[0].float()
    finally:
        for handle in handles:
            handle.remove()
    return kept, logits


def reference_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, first: int, k: int = 0):
    """log_softmax of `logits` [P, V] scoring token_ids[first:] (each by the position before it):
    (values [n], top-k values [n, k], top-k ids [n, k])."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)[first - 1 : len(token_ids) - 1]
    chosen = logprobs.gather(1, token_ids[first:].view(-1, 1))[:, 0]
    top = torch.topk(logprobs, k, dim=-1) if k else None
    return chosen, (top.values if top else None), (top.indices if top else None)


def sampled_reference(model, token_ids: torch.Tensor, prompt_tokens: int, sampling, eos_ids: set[int]) -> list[int]:
    """The tokens a sampled job must have drawn: the one sampler (worker/model/sampling.py, whose
    draws are tested against the softmax they sample from in tests/worker/test_sampling.py) applied,
    at each generated position, to plain `model(token_ids)`'s logits over the job's own tokens
    (teacher-forced, no cache) with the row's settings `sampling` (a RowSampling) and its count of
    generated tokens. A decoder that handed the sampler other logits, another seed or another count
    draws otherwise."""
    from worker.model.sampling import SamplingTable, sample, token_counts

    with torch.inference_mode():
        logits = model(input_ids=token_ids[None]).logits[0].float()
    vocab = logits.shape[-1]
    table = SamplingTable(1, vocab, eos_ids, logits.device)
    table.set_row(0, sampling)
    drawn = []
    for generated in range(len(token_ids) - prompt_tokens):
        at = prompt_tokens - 1 + generated  # the position whose logits pick the next token
        seen = token_ids[None, : at + 1]
        zero, last = torch.zeros(1, dtype=torch.long), torch.full((1,), at)
        penalties = token_counts(seen, zero, last, torch.full((1,), prompt_tokens), vocab)
        count = torch.full((1,), generated)
        drawn.append(int(sample(logits[at : at + 1], table, count, penalties, features=sampling.features)[0]))
    return drawn
