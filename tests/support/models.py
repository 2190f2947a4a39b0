"""A model description as a worker would publish it, for API tests that run without a worker:
the module list of the tiny Llama in tests/support/tiny_model.py (4 layers, hidden 64, SmolLM2's
vocabulary), in forward-execution order, with the same capturable sides and widths."""

from __future__ import annotations

from shared.schemas import ModelInfo, ModuleInfo

SMOLLM2_VOCAB = 49152


def tiny_llama(name: str = "tiny", layers: int = 4, hidden: int = 64, intermediate: int = 128) -> ModelInfo:
    kv = hidden // 2  # 2 key/value heads of the 4 attention heads

    def module(path: str, out: int | None, inp: int | None, all_positions: bool = True) -> ModuleInfo:
        return ModuleInfo(path=path, output_dim=out, input_dim=inp, all_positions=all_positions)

    modules = [module("model.embed_tokens", hidden, None)]
    for i in range(layers):
        p = f"model.layers.{i}"
        modules += [
            module(f"{p}.input_layernorm", hidden, hidden),
            module(f"{p}.self_attn.q_proj", hidden, hidden),
            module(f"{p}.self_attn.k_proj", kv, hidden),
            module(f"{p}.self_attn.v_proj", kv, hidden),
            module(f"{p}.self_attn.o_proj", hidden, hidden),
            module(f"{p}.self_attn", hidden, None),
            module(f"{p}.post_attention_layernorm", hidden, hidden),
            module(f"{p}.mlp.gate_proj", intermediate, hidden),
            module(f"{p}.mlp.act_fn", intermediate, intermediate),
            module(f"{p}.mlp.up_proj", intermediate, hidden),
            module(f"{p}.mlp.down_proj", hidden, intermediate),
            module(f"{p}.mlp", hidden, hidden),
            module(p, hidden, hidden),
        ]
    modules += [
        module("model.norm", hidden, hidden),
        module("model", hidden, None),
        module("lm_head", SMOLLM2_VOCAB, hidden, all_positions=False),
    ]
    return ModelInfo(
        name=name,
        source=f"/models/{name}",
        architecture="LlamaForCausalLM",
        num_layers=layers,
        hidden_size=hidden,
        vocab_size=SMOLLM2_VOCAB,
        max_context=256,
        dtype="float32",
        device="cpu",
        modules=modules,
        presets={
            "residual": [f"model.layers.{i}" for i in range(layers)],
            "attention": [f"model.layers.{i}.self_attn" for i in range(layers)],
            "mlp": [f"model.layers.{i}.mlp" for i in range(layers)],
        },
        template_tokens=30,  # what a worker measures for SmolLM2's tokenizer and template
        template_tokens_per_message=6,
        max_token_bytes=81,
    )
