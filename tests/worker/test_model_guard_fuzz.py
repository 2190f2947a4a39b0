"""The model guard (worker/nnsight/guard.py) against random sequences of changes inside a guarded
block: attribute writes and monkeypatches over the model (modules, hooks, parameters, buffers,
config, generation config), torch (functions, classes, settings, global hooks), the interpreter
(stdout, switch interval, threads) and the tokenizer (template, special tokens, sides, backend).
The invariant: when `unproven` is empty, the model generates with plain forward hooks exactly
as a model freshly loaded from the files (tests/support/reference.py, bit for bit), its configs
equal a fresh one's, and the tokenizer renders and encodes a chat exactly as a fresh one.

Each example gets a freshly loaded model and tokenizer; whatever an example changed in the
process is undone afterwards by the test itself (`_reset`), whatever the guard did."""

from __future__ import annotations

import io
import sys
import threading
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.support.reference import hooked_generate

pytestmark = pytest.mark.model

CHAT = [{"role": "user", "content": "Name three colours."}]
NEW_TOKENS = 5
MODULES = ["model.layers.0", "model.layers.2.mlp", "model.norm", "lm_head"]
PROBE = "Hello World, ÀÉÎ 12 times 7 <|im_start|>user"
PATHS = ["model.layers.0", "model.layers.1.mlp", "model.layers.2.self_attn", "model.norm", "model.embed_tokens"]
PARAMETERS = ["model.layers.0.mlp.down_proj.weight", "model.norm.weight", "model.embed_tokens.weight"]
RELEASE = threading.Event()


def _wait() -> None:
    RELEASE.wait(60)


# -- the changes: each takes (model, tokenizer, k) ----------------------------------------------


def _train(model, tok, k):
    model.get_submodule(PATHS[k % len(PATHS)]).train()


def _hook(model, tok, k):
    model.get_submodule(PATHS[k % len(PATHS)]).register_forward_hook(
        lambda m, a, out: out * 0.5 if isinstance(out, torch.Tensor) else out
    )


def _pre_hook(model, tok, k):
    model.get_submodule(PATHS[k % len(PATHS)]).register_forward_pre_hook(lambda m, args: tuple(a * 2 for a in args))


def _instance_forward(model, tok, k):
    model.model.layers[k % 4].mlp.forward = lambda x: x * 0


def _submodule(model, tok, k):
    model.model.layers[k % 4].mlp = torch.nn.Identity()


def _attribute(model, tok, k):
    model.model.layers[k % 4].self_attn.scaling = 0.01


def _weight_in_place(model, tok, k):
    with torch.no_grad():
        model.get_parameter(PARAMETERS[k % 3]).mul_(1.5)


def _weight_data(model, tok, k):
    p = model.get_parameter(PARAMETERS[k % 3])
    p.data = [p.data.clone(), p.data.to(torch.bfloat16), p.data * 2, p.data[:1]][k % 4]


def _weight_object(model, tok, k):
    model.model.layers[k % 4].mlp.up_proj.weight = torch.nn.Parameter(torch.zeros(128, 64))


def _requires_grad(model, tok, k):
    model.get_parameter(PARAMETERS[k % 3]).requires_grad_(False)


def _buffer(model, tok, k):
    rotary = model.model.rotary_emb
    if k % 2:
        rotary.inv_freq.mul_(0.5)
    else:
        rotary.inv_freq = rotary.inv_freq * 0.5


def _model_to(model, tok, k):
    model.to([torch.bfloat16, torch.float16, torch.float64][k % 3])


def _config(model, tok, k):
    config = model.config
    if k % 3 == 0:
        config._attn_implementation = "eager"
    elif k % 3 == 1:
        config.rms_norm_eps = 0.5
    else:
        config.rope_parameters["rope_theta"] = 7.0


def _generation_config(model, tok, k):
    gc = model.generation_config
    [
        lambda: setattr(gc, "repetition_penalty", 4.0),
        lambda: setattr(gc, "bad_words_ids", [[17], [42]]),
        lambda: setattr(gc, "eos_token_id", 1),
        lambda: setattr(gc, "suppress_tokens", list(range(100))),
    ][k % 4]()


def _torch_function(model, tok, k):
    [
        lambda: setattr(torch.nn.functional, "silu", lambda x, inplace=False: x * 0),
        lambda: setattr(torch.nn.functional, "linear", lambda x, w, b=None: torch.zeros(*x.shape[:-1], w.shape[0])),
        lambda: setattr(torch.nn.functional, "scaled_dot_product_attention", lambda q, *a, **kw: q * 0),
        lambda: setattr(torch.Tensor, "__add__", lambda a, b: torch._C.TensorBase.__add__(a, b) * 1.001),
    ][k % 4]()


def _class_patch(model, tok, k):
    from transformers.models.llama import modeling_llama

    [
        lambda: setattr(modeling_llama.LlamaRMSNorm, "forward", lambda self, x: x),
        lambda: setattr(modeling_llama.LlamaMLP, "forward", lambda self, x: x * 0),
        lambda: setattr(modeling_llama, "apply_rotary_pos_emb", lambda q, k, *a, **kw: (q, k)),
        lambda: setattr(modeling_llama.LlamaDecoderLayer.forward, "__code__", (lambda *a, **kw: a[1]).__code__),
    ][k % 4]()


def _global_hook(model, tok, k):
    if k % 2:
        torch.nn.modules.module.register_module_forward_hook(
            lambda m, a, out: out * 0 if isinstance(out, torch.Tensor) else out
        )
    else:
        torch.nn.modules.module.register_module_forward_pre_hook(lambda m, args: args)


def _torch_setting(model, tok, k):
    [
        lambda: torch.set_num_threads(1),
        lambda: torch.set_float32_matmul_precision("medium"),
        lambda: torch.set_default_dtype(torch.float64),
        lambda: torch.use_deterministic_algorithms(True),
        lambda: torch.set_grad_enabled(False),
        lambda: setattr(torch.backends.mkldnn, "enabled", False),
        lambda: torch.set_flush_denormal(True),
        lambda: torch.set_default_device("meta"),
        lambda: torch.set_autocast_enabled("cpu", True),
    ][k % 9]()


def _interpreter(model, tok, k):
    if k % 3 == 0:
        sys.stdout = io.StringIO()
    elif k % 3 == 1:
        sys.setswitchinterval(0.25)
    else:
        threading.Thread(target=_wait, daemon=True).start()


def _tokenizer(model, tok, k):
    [
        lambda: setattr(tok, "chat_template", "{% for m in messages %}{{ m['content'] }}{% endfor %}"),
        lambda: setattr(tok, "padding_side", "left"),
        lambda: setattr(tok, "truncation_side", "left"),
        lambda: setattr(tok, "eos_token", "<|im_start|>"),
        lambda: tok.add_tokens(["<injected>"]),
        lambda: tok.backend_tokenizer.enable_truncation(4),
        lambda: tok.backend_tokenizer.enable_padding(length=64),
        lambda: setattr(tok, "model_max_length", 3),
        lambda: tok.init_kwargs.update(clean_up_tokenization_spaces=True),
        lambda: setattr(tok, "clean_up_tokenization_spaces", True),
    ][k % 10]()


CHANGES: list[Callable] = [
    _train,
    _hook,
    _pre_hook,
    _instance_forward,
    _submodule,
    _attribute,
    _weight_in_place,
    _weight_data,
    _weight_object,
    _requires_grad,
    _buffer,
    _model_to,
    _config,
    _generation_config,
    _torch_function,
    _class_patch,
    _global_hook,
    _torch_setting,
    _interpreter,
    _tokenizer,
]


# -- the process as it was, put back by the test ------------------------------------------------


def _noted() -> dict[str, object]:
    from transformers.models.llama import modeling_llama

    F = torch.nn.functional
    return {
        "F": {name: getattr(F, name) for name in ("silu", "linear", "scaled_dot_product_attention")},
        "Tensor": dict(vars(torch.Tensor)),
        "llama": {name: vars(cls).get("forward") for name, cls in _llama_classes().items()},
        "rotary": modeling_llama.apply_rotary_pos_emb,
        "decoder code": modeling_llama.LlamaDecoderLayer.forward.__code__,
        "hooks": {
            name: dict(getattr(torch.nn.modules.module, name))
            for name in ("_global_forward_hooks", "_global_forward_pre_hooks")
        },
        "threads": torch.get_num_threads(),
        "precision": torch.get_float32_matmul_precision(),
        "stdout": sys.stdout,
        "switch": sys.getswitchinterval(),
    }


def _llama_classes():
    from transformers.models.llama import modeling_llama

    return {"RMSNorm": modeling_llama.LlamaRMSNorm, "MLP": modeling_llama.LlamaMLP}


def _reset(noted) -> None:
    from transformers.models.llama import modeling_llama

    for name, value in noted["F"].items():
        setattr(torch.nn.functional, name, value)
    for name in [k for k in vars(torch.Tensor) if k not in noted["Tensor"]]:
        delattr(torch.Tensor, name)
    for name, cls in _llama_classes().items():
        cls.forward = noted["llama"][name]
    modeling_llama.apply_rotary_pos_emb = noted["rotary"]
    modeling_llama.LlamaDecoderLayer.forward.__code__ = noted["decoder code"]
    for name, hooks in noted["hooks"].items():
        live = getattr(torch.nn.modules.module, name)
        live.clear()
        live.update(hooks)
    torch.set_default_device(None)
    torch.set_num_threads(noted["threads"])
    torch.set_float32_matmul_precision(noted["precision"])
    torch.set_default_dtype(torch.float32)
    torch.use_deterministic_algorithms(False)
    torch.set_grad_enabled(True)
    torch.backends.mkldnn.enabled = True
    torch.set_flush_denormal(False)
    torch.set_autocast_enabled("cpu", False)
    sys.stdout = noted["stdout"]
    sys.setswitchinterval(noted["switch"])
    RELEASE.set()
    for thread in threading.enumerate():
        if getattr(thread, "_target", None) is _wait:
            thread.join(10)
    RELEASE.clear()


# -- the property --------------------------------------------------------------------------------


def _settings() -> dict[str, object]:
    """The process-wide and thread-local settings the changes touch, as read now."""
    return {
        "default device": torch.get_default_device(),
        "default dtype": torch.get_default_dtype(),
        "threads": torch.get_num_threads(),
        "matmul precision": torch.get_float32_matmul_precision(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "grad": torch.is_grad_enabled(),
        "mkldnn": torch.backends.mkldnn.enabled,
        "denormals flushed": bool((torch.tensor([1e-39], device="cpu") * 1.0).item() == 0.0),
        "autocast": torch.is_autocast_enabled("cpu"),
        "stdout": sys.stdout,
        "switch interval": sys.getswitchinterval(),
        "threads alive": sorted(t.name for t in threading.enumerate()),
    }


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """The reference generate with hooks on a model fresh from the files, its configs, and a
    fresh tokenizer (only read)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    generated = hooked_generate(model, tokenizer, CHAT, NEW_TOKENS, MODULES)
    return generated, model.config.to_dict(), model.generation_config.to_dict(), tokenizer


@settings(
    max_examples=20,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(st.lists(st.tuples(st.sampled_from(CHANGES), st.integers(0, 11)), min_size=1, max_size=8))
def test_when_nothing_is_unproven_the_model_and_tokenizer_are_as_loaded(tiny_dir, reference, changes):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.nnsight.guard import ModelGuard

    (ids, rows, prompt_tokens), config, generation, fresh = reference
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)

    def reload():
        return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).state_dict()

    noted, before = _noted(), _settings()
    try:
        guard = ModelGuard(model, reload, tokenizer=tokenizer)
        for change, k in changes:
            try:
                change(model, tokenizer, k)
            except Exception:  # noqa: BLE001 - a change that does not apply here is no change
                pass
        found = guard.restore()
        event("unproven" if found.unproven else "put back, checked")
        if found.unproven:
            return
        assert _settings() == before, found
        got_ids, got_rows, got_prompt = hooked_generate(model, tokenizer, CHAT, NEW_TOKENS, MODULES)
        assert got_prompt == prompt_tokens and torch.equal(got_ids, ids), found
        for module in MODULES:
            assert torch.equal(got_rows[module], rows[module]), (module, found)
        assert model.config.to_dict() == config and model.generation_config.to_dict() == generation
        render = {"add_generation_prompt": True}
        assert tokenizer.apply_chat_template(CHAT, tokenize=False, **render) == fresh.apply_chat_template(
            CHAT, tokenize=False, **render
        )
        assert tokenizer.apply_chat_template(CHAT, **render) == fresh.apply_chat_template(CHAT, **render)
        assert tokenizer(PROBE) == fresh(PROBE) and len(tokenizer) == len(fresh)
        assert tokenizer.backend_tokenizer.encode(PROBE).ids == fresh.backend_tokenizer.encode(PROBE).ids
        assert tokenizer.special_tokens_map == fresh.special_tokens_map
        assert (tokenizer.padding_side, tokenizer.truncation_side) == (fresh.padding_side, fresh.truncation_side)
        assert tokenizer.model_max_length == fresh.model_max_length
    finally:
        _reset(noted)
