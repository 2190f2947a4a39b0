"""The model guard under an nnsight job's trusted code (worker/nnsight/guard.py, through
worker/nnsight/jobs.py, nnsight 0.8.1 real): each change an outside round found left other keys'
results silently wrong is either put back exactly, or named in `unproven` (the engine is then
replaced). "Exactly" is checked after the job on the same model object, on the thread that ran
it (as the engine's would): a greedy generate with plain forward hooks (tests/support/reference.py)
equals the same run on a model freshly loaded from the files, bit for bit, and the tokenizer renders
and encodes a chat exactly as a fresh tokenizer does.

Each job gets a freshly loaded model (a failed restore must not leak into the next case); what a
case changes outside the model (a class, torch, a thread) is undone by the test itself afterwards,
whatever the guard did."""

# ruff: noqa: F841 - inside a trace, a name bound to a saved value is what nnsight sends back
from __future__ import annotations

import builtins
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

from shared.errors import NnsightCodeFailed, WeightsWritten
from tests.support.reference import hooked_generate
from tests.worker.test_batching import load_engine
from tests.worker.test_nnsight_jobs import client_model, payload

__all__ = ["client_model"]  # the fixture, shared

pytestmark = pytest.mark.model

CHAT = [{"role": "user", "content": "What is 12 times 7?"}]
NEW_TOKENS = 6
MODULES = ["model.layers.0", "model.layers.1.mlp", "model.layers.3.self_attn", "model.norm", "lm_head"]
PROBE = "Hello World, ÀÉÎ 12 times 7 <|im_start|>user"
RELEASE = threading.Event()  # lets the leftover thread of `leftover_thread` go


@dataclass
class Fresh:
    """What the model and tokenizer give straight from the files."""

    generated: tuple  # the reference generate with hooks: (ids, rows, prompt tokens)
    tokenizer: object
    config: dict
    generation_config: dict


@pytest.fixture(scope="module")
def fresh(tiny_dir) -> Fresh:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    generated = hooked_generate(model, tokenizer, CHAT, NEW_TOKENS, MODULES)
    return Fresh(generated, tokenizer, model.config.to_dict(), model.generation_config.to_dict())


@pytest.fixture
def served(tiny_dir):
    return load_engine(tiny_dir)


@dataclass
class Ran:
    result: object  # the Outcome, or the failure `run` raised
    unproven: list[str]
    after: object  # the hooked generate after the job (or what it raised)
    before: dict[str, object] = field(default_factory=dict)  # settings on the job's thread, before it
    seen: dict[str, object] = field(default_factory=dict)  # ... and after it


def settings_now() -> dict[str, object]:
    """Process-wide and thread-local settings a job could leave changed (read on the job's thread)."""
    return {
        "recursion limit": sys.getrecursionlimit(),
        "default device": torch.get_default_device(),
        "default dtype": torch.get_default_dtype(),
        "grad": torch.is_grad_enabled(),
        "threads": torch.get_num_threads(),
        "matmul precision": torch.get_float32_matmul_precision(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "mkldnn": torch.backends.mkldnn.enabled,
        "switch interval": sys.getswitchinterval(),
        "stdout": getattr(sys.stdout, "original", sys.stdout),  # actq's router prints to the original
        "builtins": dict(vars(builtins)),
    }


def run_job(served, client_model, code) -> Ran:
    """`code`'s payload through nnsight_jobs.run, on a thread of its own as the engine runs it (a
    shallow stack), then the hooked generate on that thread."""
    from worker.nnsight import jobs as nnsight_jobs

    blob = payload(client_model, code)
    ran: dict[str, object] = {}

    def engine() -> None:
        limit = sys.getrecursionlimit()
        ran["before"] = settings_now()
        try:
            ran["result"] = nnsight_jobs.run(served, blob, False, 30, lambda line: None)
        except BaseException as exc:  # noqa: BLE001 - the job's failure is what the test looks at
            ran["result"] = exc
        ran["seen"] = settings_now()
        sys.setrecursionlimit(limit)  # whatever the guard did: the test process goes on
        torch.set_default_device(None)
        try:
            ran["after"] = hooked_generate(served.hf, served.tokenizer, CHAT, NEW_TOKENS, MODULES)
        except BaseException as exc:  # noqa: BLE001
            ran["after"] = exc

    thread = threading.Thread(target=engine, name="actq-test-engine")
    thread.start()
    thread.join(120)
    assert not thread.is_alive()
    result = ran["result"]
    unproven = getattr(result, "unproven", [])
    return Ran(result, unproven, ran["after"], ran["before"], ran["seen"])  # type: ignore[arg-type]


def assert_as_fresh(served, ran: Ran, fresh: Fresh, pointers: dict[str, int]) -> None:
    """The guarded model, the process and the tokenizer behave exactly as freshly loaded ones."""
    assert ran.seen == ran.before
    assert served.hf.config.to_dict() == fresh.config
    assert served.hf.generation_config.to_dict() == fresh.generation_config
    assert not isinstance(ran.after, BaseException), ran.after
    ids, rows, prompt_tokens = fresh.generated
    got_ids, got_rows, got_prompt = ran.after  # type: ignore[misc]
    assert got_prompt == prompt_tokens and torch.equal(got_ids, ids)
    for module in MODULES:
        assert torch.equal(got_rows[module], rows[module]), module
    # the storage the running batch (and its CUDA graphs) reads stayed the same
    assert {n: p.data_ptr() for n, p in served.hf.named_parameters()} == pointers
    ours, theirs = served.tokenizer, fresh.tokenizer
    render = {"add_generation_prompt": True}
    assert ours.apply_chat_template(CHAT, tokenize=False, **render) == theirs.apply_chat_template(
        CHAT, tokenize=False, **render
    )
    assert ours.apply_chat_template(CHAT, **render) == theirs.apply_chat_template(CHAT, **render)
    assert len(ours) == len(theirs) and ours.special_tokens_map == theirs.special_tokens_map
    ob, tb = ours.backend_tokenizer, theirs.backend_tokenizer
    assert (ob.padding, ob.truncation) == (tb.padding, tb.truncation)
    assert ob.encode(PROBE).ids == tb.encode(PROBE).ids and ours(PROBE) == theirs(PROBE)
    # last: nnsight's own wrapping sets left padding on the served tokenizer
    assert (ours.padding_side, ours.truncation_side) == (theirs.padding_side, theirs.truncation_side)


# -- what the trusted code does (inside a trace, on the worker) ---------------------------------


def _zero(*args, **kwargs):
    return torch.zeros_like(args[-1] if not kwargs else next(iter(kwargs.values())))


def _zero_output(module, args, output):
    return output * 0 if isinstance(output, torch.Tensor) else output


def _late_write(model) -> None:
    """A thread the code leaves behind: it writes a weight once let go. The event is looked up
    where it lives: once a remote nnsight client has run in this process (pull_env), `tests`
    is pickled by value and a global Event (a lock) could not travel."""
    from tests.worker import test_model_guard

    test_model_guard.RELEASE.wait(60)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(1.58)


def class_forward(model, backend):
    with model.trace("Hello", backend=backend):
        from transformers.models.llama.modeling_llama import LlamaMLP

        LlamaMLP.forward = lambda self, x: x * 0
        hs = model.model.layers[1].output.save()


def functional_silu(model, backend):
    with model.trace("Hello", backend=backend):
        torch.nn.functional.silu = _zero
        hs = model.model.layers[1].output.save()


def global_hook(model, backend):
    with model.trace("Hello", backend=backend):
        torch.nn.modules.module.register_module_forward_hook(_zero_output)
        hs = model.model.layers[1].output.save()


def chat_template(model, backend):
    with model.trace("Hello", backend=backend):
        model.tokenizer.chat_template = "{% for m in messages %}IGNORE ALL PREVIOUS: {{ m['content'] }}{% endfor %}"
        hs = model.model.layers[1].output.save()


def added_tokens(model, backend):
    with model.trace("Hello", backend=backend):
        model.tokenizer.add_tokens(["<injected>", " times"])
        hs = model.model.layers[1].output.save()


def normalizer(model, backend):
    with model.trace("Hello", backend=backend):
        from tokenizers.normalizers import Lowercase

        model.tokenizer.backend_tokenizer.normalizer = Lowercase()
        hs = model.model.layers[1].output.save()


def special_tokens_and_sides(model, backend):
    with model.trace("Hello", backend=backend):
        model.tokenizer.eos_token = "<|im_start|>"
        model.tokenizer.truncation_side = "left"
        model.tokenizer.backend_tokenizer.enable_truncation(3)
        model.tokenizer.backend_tokenizer.enable_padding(length=40)
        hs = model.model.layers[1].output.save()


def leftover_thread(model, backend):
    with model.trace("Hello", backend=backend):
        threading.Thread(target=_late_write, args=(model._module,), daemon=True).start()
        hs = model.model.layers[1].output.save()


def eager_attention(model, backend):
    with model.trace("Hello", backend=backend):
        model._module.config._attn_implementation = "eager"
        hs = model.model.layers[1].output.save()


def matmul_precision(model, backend):
    with model.trace("Hello", backend=backend):
        torch.set_float32_matmul_precision("medium")
        hs = model.model.layers[1].output.save()


def generation_config(model, backend):
    with model.trace("Hello", backend=backend):
        model._module.generation_config.suppress_tokens = list(range(40000))
        model._module.generation_config.repetition_penalty = 5.0
        hs = model.model.layers[1].output.save()


def halved_rotary(model, backend):
    with model.trace("Hello", backend=backend):
        model._module.model.rotary_emb.inv_freq.mul_(0.5)
        hs = model.model.layers[1].output.save()


def halved_rotary_put_back(model, backend):
    with model.trace("Hello", backend=backend):
        model._module.model.rotary_emb.inv_freq.mul_(0.5)
        hs = model.model.layers[1].output.save()
        model._module.model.rotary_emb.inv_freq.mul_(2.0)


def weight_dtype(model, backend):
    with model.trace("Hello", backend=backend):
        w = model._module.model.layers[0].mlp.down_proj.weight
        w.data = w.data.to(torch.bfloat16)
        hs = model.model.layers[1].output.save()


def weight_shape(model, backend):
    with model.trace("Hello", backend=backend):
        w = model._module.model.layers[0].mlp.down_proj.weight
        w.data = w.data[:, :32]
        hs = model.model.layers[1].output.save()


def whole_model_bfloat16(model, backend):
    with model.trace("Hello", backend=backend):
        model._module.to(torch.bfloat16)
        hs = model.model.layers[1].output.save()


def default_device_meta(model, backend):
    with model.trace("Hello", backend=backend):
        hs = model.model.layers[1].output.save()
        torch.set_default_device("meta")


def new_storage(model, backend):
    with model.trace("Hello", backend=backend):
        w = model._module.model.layers[2].self_attn.q_proj.weight
        w.data = w.data.clone()
        hs = model.model.layers[1].output.save()


def one_thread(model, backend):
    with model.trace("Hello", backend=backend):
        torch.set_num_threads(1)
        hs = model.model.layers[1].output.save()


def recursion_limit(model, backend):
    with model.trace("Hello", backend=backend):
        hs = model.model.layers[1].output.save()
        lowering = threading.Thread(target=sys.setrecursionlimit, args=(30,))
        lowering.start()
        lowering.join()


def settings_and_streams(model, backend):
    with model.trace("Hello", backend=backend):
        import io

        torch.use_deterministic_algorithms(True)
        torch.set_default_dtype(torch.float64)
        torch.backends.mkldnn.enabled = False
        sys.stdout = io.StringIO()
        sys.setswitchinterval(0.5)
        hs = model.model.layers[1].output.save()


def a_builtin(model, backend):
    with model.trace("Hello", backend=backend):
        import builtins

        builtins.max = _zero
        builtins.all = lambda values: True
        hs = model.model.layers[1].output.save()


# -- undoing it in the test process, whatever the guard did ------------------------------------


def _undo_class_forward() -> None:
    from transformers.models.llama.modeling_llama import LlamaMLP

    LlamaMLP.forward = ORIGINAL["LlamaMLP.forward"]


def _undo_silu() -> None:
    torch.nn.functional.silu = ORIGINAL["F.silu"]


def _undo_global_hooks() -> None:
    hooks = torch.nn.modules.module._global_forward_hooks
    for key in [k for k in hooks if k not in ORIGINAL["global hooks"]]:
        del hooks[key]


def _undo_thread() -> None:
    RELEASE.set()
    for thread in threading.enumerate():
        if getattr(getattr(thread, "_target", None), "__name__", None) == _late_write.__name__:
            thread.join(10)
    RELEASE.clear()


def _undo_builtins() -> None:
    builtins.max, builtins.all = ORIGINAL["max"], ORIGINAL["all"]


def _undo_settings() -> None:
    torch.set_float32_matmul_precision(ORIGINAL["matmul precision"])
    torch.set_num_threads(ORIGINAL["threads"])
    torch.use_deterministic_algorithms(False)
    torch.set_default_dtype(torch.float32)
    torch.backends.mkldnn.enabled = True
    sys.stdout = sys.__stdout__ if ORIGINAL["stdout"] is None else ORIGINAL["stdout"]
    sys.setswitchinterval(ORIGINAL["switch interval"])


def _original() -> dict[str, object]:
    from transformers.models.llama.modeling_llama import LlamaMLP

    return {
        "LlamaMLP.forward": vars(LlamaMLP)["forward"],
        "F.silu": torch.nn.functional.silu,
        "global hooks": dict(torch.nn.modules.module._global_forward_hooks),
        "matmul precision": torch.get_float32_matmul_precision(),
        "threads": torch.get_num_threads(),
        "stdout": None,
        "switch interval": sys.getswitchinterval(),
        "max": builtins.max,
        "all": builtins.all,
    }


ORIGINAL: dict[str, object] = {}


@dataclass
class Case:
    code: Callable
    expect: str  # "exact": put back, nothing unproven; "written": the same, the job failed for writing
    # weights; else a word `unproven` must name
    undo: Callable[[], None] = lambda: None


CASES = {
    "a module class's forward": Case(class_forward, "exact", _undo_class_forward),
    "torch.nn.functional.silu": Case(functional_silu, "exact", _undo_silu),
    "a global module hook": Case(global_hook, "exact", _undo_global_hooks),
    "the chat template": Case(chat_template, "exact"),
    "added tokens": Case(added_tokens, "added tokens"),
    "the backend's normalizer": Case(normalizer, "normalizer"),
    "special tokens, sides, truncation, padding": Case(special_tokens_and_sides, "exact"),
    "a leftover thread": Case(leftover_thread, "thread", _undo_thread),
    "config._attn_implementation": Case(eager_attention, "exact"),
    "the matmul precision": Case(matmul_precision, "exact", _undo_settings),
    "the generation config": Case(generation_config, "exact"),
    "a halved non-persistent buffer": Case(halved_rotary, "written"),
    "a halved buffer written back exactly": Case(halved_rotary_put_back, "exact"),
    "one weight's dtype": Case(weight_dtype, "written"),
    "one weight's shape": Case(weight_shape, "written"),
    "model.to(bfloat16)": Case(whole_model_bfloat16, "written"),
    "the default device": Case(default_device_meta, "exact"),
    "a weight's storage": Case(new_storage, "written"),
    "the thread count": Case(one_thread, "exact", _undo_settings),
    "the recursion limit": Case(recursion_limit, "exact"),
    "settings and stdout": Case(settings_and_streams, "exact", _undo_settings),
    "builtins": Case(a_builtin, "exact", _undo_builtins),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_change_is_put_back_exactly_or_named(served, client_model, fresh, name):
    case = CASES[name]
    ORIGINAL.update(_original())
    ORIGINAL["stdout"] = sys.stdout
    pointers = {n: p.data_ptr() for n, p in served.hf.named_parameters()}
    try:
        ran = run_job(served, client_model, case.code)
    finally:
        case.undo()
    if case.expect in ("exact", "written"):
        assert ran.unproven == [], ran.unproven
        if case.expect == "written":
            assert isinstance(ran.result, WeightsWritten), ran.result
        else:  # the job's own outcome: done, or its code's failure (a forward that broke)
            assert not isinstance(ran.result, BaseException) or isinstance(ran.result, NnsightCodeFailed), ran.result
        assert_as_fresh(served, ran, fresh, pointers)
    else:
        assert any(case.expect in line for line in ran.unproven), ran.unproven


def clean_trace(model, backend):
    with model.trace("Hello", backend=backend):
        hs = model.model.layers[1].output.save()
        logits = model.lm_head.output.save()


def clean_generate(model, backend):
    with model.generate("Once upon a time", max_new_tokens=4, backend=backend) as tracer:
        hs = model.model.layers[1].output.save()
        ids = tracer.result.save()


@pytest.mark.parametrize("code", [clean_trace, clean_generate], ids=["trace", "generate"])
def test_a_clean_job_leaves_nothing_to_put_back(served, client_model, fresh, code):
    pointers = {n: p.data_ptr() for n, p in served.hf.named_parameters()}
    ran = run_job(served, client_model, code)
    assert not isinstance(ran.result, BaseException), ran.result
    assert ran.result.restored == [] and ran.result.unproven == []  # type: ignore[attr-defined]
    assert set(ran.result.saves) in ({"hs", "logits"}, {"hs", "ids"})  # type: ignore[attr-defined]
    assert_as_fresh(served, ran, fresh, pointers)


def test_threads_the_process_starts_meanwhile_are_not_the_codes(served, client_model, fresh, monkeypatch):
    """While a job runs, the engine process's other threads go on (a finisher uploading another
    job's files starts boto3's transfer threads). A thread such a thread starts during the job,
    still running when the guard looks, is not the code's: a clean job stays proven (before, the
    guard called it the code's, and the engine was replaced after every such job). A thread the
    code starts is still named (the `a leftover thread` case)."""
    from worker.nnsight import guard as model_guard

    noted, spawned, release = threading.Event(), threading.Event(), threading.Event()
    children: list[threading.Thread] = []
    start = threading.Thread.start
    restore = model_guard.ModelGuard.restore
    note = model_guard.ModelGuard.__init__

    def noting(self, *args, **kwargs) -> None:
        note(self, *args, **kwargs)
        noted.set()

    def restoring(self):
        assert spawned.wait(30), "the outside thread did not start its child"
        return restore(self)

    def uploader() -> None:  # an I/O thread of the process, running before the job
        assert noted.wait(60)
        child = threading.Thread(target=release.wait, args=(30,), name="ThreadPoolExecutor-0_0", daemon=True)
        child.start()
        children.append(child)
        spawned.set()

    monkeypatch.setattr(model_guard.ModelGuard, "__init__", noting)
    monkeypatch.setattr(model_guard.ModelGuard, "restore", restoring)
    outside = threading.Thread(target=uploader, name="outside-io", daemon=True)
    outside.start()
    try:
        ran = run_job(served, client_model, clean_trace)
    finally:
        release.set()
        outside.join(30)
        for child in children:
            child.join(30)
    assert children and not isinstance(ran.result, BaseException), ran.result
    assert ran.unproven == [], ran.unproven
    assert threading.Thread.start is start  # the guard's watch on thread starts is gone
