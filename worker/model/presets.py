"""Presets: named module sets resolved from the loaded model itself, one module per decoder block.

    residual   each decoder block's output: the residual stream after that block
    attention  each block's attention module (its output is what attention adds to the stream,
               before any post-attention norm)
    mlp        each block's MLP module (what the MLP adds, before any post-MLP norm); in a
               mixture-of-experts block, the module that routes to the experts and sums them

The decoder blocks are found in the module tree, not by name: the `ModuleList` whose every element
was entered once per step with a `hidden_size`-wide output, one element per layer (the vision
tower of a multimodal checkpoint never runs on text, so only the language model's blocks qualify).
Inside a block, the attention and MLP modules are its direct children whose class says so
(`...Attention`, `...MLP`, RecurrentGemma's `...Mlp`): transformers names its classes that way on
every architecture. A mixture-of-experts block's MLP is named anything (`mlp`, `block_sparse_moe`,
`feed_forward`; `...SparseMoeBlock`, `...MoE`, `...Moe`) but always holds its experts as a child
named `experts`: the direct child that does is the block's MLP. A block whose experts are summed
with another MLP beside them (GraniteMoeHybrid's `shared_mlp`) has no one module for what its MLP
adds, and gives no `mlp`. A block without an MLP class (OPT writes `fc1`/`fc2` into the block)
uses its last hidden-wide linear layer, the MLP's output projection. A preset any block cannot
give is not published (a state-space block has neither attention nor MLP: only `residual`).
"""

from __future__ import annotations

import torch

from shared.schemas import ModuleInfo

ATTENTION_CLASS_WORDS = ("Attention",)
MLP_CLASS_WORDS = ("MLP", "Mlp", "FeedForward", "FFN")
EXPERTS = "experts"  # the child of a mixture-of-experts block that holds its experts, on every architecture


def decoder_blocks(model: torch.nn.Module, modules: list[ModuleInfo], hidden: int, layers: int) -> list[str]:
    """Paths of the decoder blocks in order, or [] when no module list looks like them."""
    listed = {m.path: m for m in modules}
    found: list[list[str]] = []
    for path, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) == 0:
            continue
        paths = [f"{path}.{i}" for i in range(len(module))]
        if all(p in listed and listed[p].output_dim == hidden and listed[p].all_positions for p in paths):
            found.append(paths)
    exact = [paths for paths in found if len(paths) == layers]
    candidates = exact or found
    return max(candidates, key=len) if candidates else []


def _child(model: torch.nn.Module, block: str, order: dict[str, int], words: tuple[str, ...]) -> str | None:
    hits = [
        f"{block}.{name}"
        for name, child in model.get_submodule(block).named_children()
        if any(word in type(child).__name__ for word in words) and f"{block}.{name}" in order
    ]
    return hits[0] if len(hits) == 1 else None


def _experts_block(model: torch.nn.Module, block: str, order: dict[str, int]) -> list[str]:
    """The block's direct children that hold experts (a child named `experts`): its
    mixture-of-experts module, whatever its class or attribute name."""
    return [
        f"{block}.{name}"
        for name, child in model.get_submodule(block).named_children()
        if isinstance(getattr(child, EXPERTS, None), torch.nn.Module) and f"{block}.{name}" in order
    ]


def _mlp(
    model: torch.nn.Module, block: str, order: dict[str, int], listed: dict[str, ModuleInfo], hidden: int
) -> str | None:
    """The module whose output is what the block's MLP adds: its experts block, else its MLP
    class, else its last hidden-wide linear layer. None when an experts block has another MLP
    beside it (their outputs are summed inside the block: no module gives the sum)."""
    experts = _experts_block(model, block, order)
    if experts:
        mlps = [
            f"{block}.{name}"
            for name, child in model.get_submodule(block).named_children()
            if any(word in type(child).__name__ for word in MLP_CLASS_WORDS) and f"{block}.{name}" in order
        ]
        beside = [path for path in mlps if path not in experts]
        return experts[0] if len(experts) == 1 and not beside else None
    return _child(model, block, order, MLP_CLASS_WORDS) or _last_hidden_linear(model, block, listed, hidden)


def _last_hidden_linear(model: torch.nn.Module, block: str, listed: dict[str, ModuleInfo], hidden: int) -> str | None:
    linears = [
        f"{block}.{name}"
        for name, child in model.get_submodule(block).named_children()
        if isinstance(child, torch.nn.Linear) and child.out_features == hidden and f"{block}.{name}" in listed
    ]
    return linears[-1] if linears else None


def resolve_presets(
    model: torch.nn.Module, modules: list[ModuleInfo], hidden: int, layers: int
) -> dict[str, list[str]]:
    """{preset: one module path per decoder block} for the presets this model can give."""
    blocks = decoder_blocks(model, modules, hidden, layers)
    if not blocks:
        return {}
    listed = {m.path: m for m in modules}
    order = {m.path: i for i, m in enumerate(modules)}
    presets: dict[str, list[str]] = {"residual": blocks}
    attention = [_child(model, block, order, ATTENTION_CLASS_WORDS) for block in blocks]
    if all(path is not None and listed[path].output_dim is not None for path in attention):
        presets["attention"] = [p for p in attention if p is not None]
    mlp = [_mlp(model, block, order, listed, hidden) for block in blocks]
    if all(path is not None and listed[path].output_dim is not None for path in mlp):
        presets["mlp"] = [p for p in mlp if p is not None]
    return presets
