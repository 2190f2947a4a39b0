"""What trusted code run on the served model (an nnsight job, worker/nnsight/jobs.py) may leave
behind, put back, or named where it cannot be: `ModelGuard` notes the model and the process
before the code runs and, after it, `restore()`s them and says what it found (`Restored`).

In the order it restores them:
- the recursion limit, before any deeper call (a low one makes every call fail);
- patches (worker/nnsight/guard_patches.py), by identity, with dict operations only: builtins first, then
  the namespaces of torch (its functions, torch.nn and its global hooks, torch.Tensor), the
  modules the model's code comes from and the transformers modules those use (masking,
  attention functions, rotary initialisation), every class in the MRO of the model's module
  types, of its config and of its tokenizer; then each module of the model (its forward, hooks,
  submodules, parameter and buffer objects, train mode), its config and generation config
  (every field, sub-configs), the tokenizer's attributes (chat template, special tokens, sides);
- process-wide settings, torch's and the interpreter's (worker/nnsight/guard_settings.py), read and set
  with torch's own functions again: before anything is summed, since a float32 sum depends on
  the thread count, and a default device of "meta" changes every tensor made;
- the tokenizer's backend (worker/nnsight/guard_tokenizer.py): padding and truncation put back; its
  vocabulary, added tokens, normalizer and pre-tokenizer checked;
- the parameters and buffers: each one's storage, dtype, shape and device (a `.data` replaced is
  pointed back at the noted storage), its version counter and a fingerprint of its values (the
  sum, float32 at least: an in-place write through autograd bumps the version, a write through
  `.data` changes the sum; a write that leaves every sum as it was, a permutation, is not seen).
  Values that changed are read again in place (the storage the running batch and its CUDA
  graphs hold stays): persistent ones from the model's files, then proven by the fingerprint;
  non-persistent buffers (rotary frequencies, absent from the files) from a copy taken before
  the code ran, proven bit for bit (one written back exactly counts as not written);
- threads: a new live thread the code started (not actq's own, named "actq-...") may change
  anything later: it is named.

What is put back by identity (the same object) or bit for bit is exact: `Restored.state` and
`weights` say what. What could not be put back or proven is in `Restored.unproven`: the engine
must then be replaced before it serves anyone. The guard itself never raises for what the code
did; a failure of its own is unproven too.
"""

from __future__ import annotations

import builtins
import logging
import sys
import threading
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from worker.nnsight.guard_patches import Found, Patches
from worker.nnsight.guard_settings import Settings
from worker.nnsight.guard_tokenizer import Backend, backend_of

log = logging.getLogger(__name__)

# Modules whose namespace trusted code could patch to change how the model computes: torch's,
# and the transformers modules every model's forward goes through (if imported).
_TORCH_MODULES = (
    "torch",
    "torch.functional",
    "torch._tensor",
    "torch.nn",
    "torch.nn.functional",
    "torch.nn.parameter",
    "torch.nn.init",
    "torch.overrides",
    "torch.library",
    "torch.utils._device",
    "torch._C",
    "torch._C._nn",
    "torch._C._linalg",
    "torch._C._special",
    "torch._C._fft",
)
_TRANSFORMERS_MODULES = (
    "transformers.masking_utils",
    "transformers.modeling_rope_utils",
    "transformers.modeling_utils",
    "transformers.modeling_layers",
    "transformers.modeling_flash_attention_utils",
    "transformers.integrations.sdpa_attention",
    "transformers.integrations.flash_attention",
    "transformers.integrations.flex_attention",
    "transformers.integrations.sdpa_paged",
    "transformers.integrations.flash_paged",
    "transformers.cache_utils",
    "transformers.activations",
    "transformers.pytorch_utils",
    "transformers.utils.generic",
    "transformers.utils.output_capturing",
    "transformers.utils.chat_template_utils",
    "transformers.generation.utils",
    "transformers.generation.logits_process",
    "transformers.generation.configuration_utils",
    "transformers.configuration_utils",
    "transformers.tokenization_utils_base",
    "transformers.tokenization_utils_tokenizers",
)
# transformers modules a modeling module imports from that no forward runs (auto classes, docs)
_NOT_FORWARD = ("transformers.models.auto", "transformers.utils.auto_docstring", "transformers.utils.doc")
# Modules whose classes are not followed (torch's own: bindings of C++ types, JIT and storage
# classes no forward uses); their functions and registries are.
_NO_CLASSES = frozenset({"torch", "torch._C", "torch._C._nn", "torch._C._linalg", "torch._C._special", "torch._C._fft"})
_OWN_THREADS = "actq-"  # actq's own threads (its time limit, its log writer) are not the code's
_THREAD_GRACE_S = 0.2  # how long a new thread may take to end after the code returned


@dataclass
class Restored:
    """What the guard found changed: put back exactly (`weights`, `state`), or not (`unproven`)."""

    weights: list[str] = field(default_factory=list)  # parameters or buffers whose values changed
    state: list[str] = field(default_factory=list)  # everything else put back: "where: what"
    unproven: list[str] = field(default_factory=list)  # changed, and not proven as before

    @property
    def weights_written(self) -> bool:
        return bool(self.weights)


@dataclass
class _Tensor:
    tensor: torch.Tensor
    alias: torch.Tensor  # `tensor.data` as noted: keeps its storage, dtype, shape and strides
    pointer: int
    version: int
    requires_grad: bool
    grad: torch.Tensor | None

    def moved(self) -> bool:
        t, a = self.tensor, self.alias
        return (
            t.data_ptr() != self.pointer
            or t.dtype != a.dtype
            or t.shape != a.shape
            or t.stride() != a.stride()
            or t.storage_offset() != a.storage_offset()
            or t.device != a.device
        )


def _fingerprint(tensors: dict[str, _Tensor]) -> torch.Tensor:
    """Each tensor's sum, accumulated in float32 at least, in one stacked result (one host read for
    all). A reduction over the same values on the same device and threads gives the same bits, so
    sums are compared exactly; float32 sums read memory at its speed (float64 ones were 7x slower:
    300 ms a pass on SmolLM2 on the CPU)."""
    sums = [
        t.tensor.detach().sum(dtype=torch.float32 if t.tensor.element_size() < 4 else None)
        for t in tensors.values()
        if t.tensor.is_floating_point()
    ]
    if not sums:
        return torch.zeros(0, dtype=torch.float64, device="cpu")
    return torch.stack([s.to("cpu", torch.float64) for s in sums])


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same dtype, shape and bytes (NaNs and signed zeros included)."""
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    return torch.equal(
        a.detach().reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8)
    )


def _threads() -> dict[int, str]:
    """Every live Python thread (those `_thread` started directly too): ident -> name."""
    named = {t.ident: t.name for t in threading.enumerate()}
    return {ident: named.get(ident, "(a thread started with _thread)") for ident in sys._current_frames()}


class _Births:
    """Who started each thread while the guard watches: `threading.Thread.start` is wrapped to
    note the starting thread on the new one. The process's other threads keep working during a
    job (a finisher uploading another job's files starts boto3's transfer threads): a thread
    started by a thread that was already running, other than the one the code runs on, or by a
    thread such a thread started, is not the code's."""

    ATTRIBUTE = "_actq_started_by"

    def __init__(self) -> None:
        self.original = threading.Thread.start
        attribute, original = self.ATTRIBUTE, self.original

        def start(thread: threading.Thread) -> None:
            setattr(thread, attribute, threading.get_ident())
            original(thread)

        threading.Thread.start = start  # type: ignore[method-assign,assignment]

    def close(self) -> None:
        threading.Thread.start = self.original  # type: ignore[method-assign]

    def outsiders(self, new: dict[int, str], before: dict[int, str], code_thread: int) -> set[int]:
        """The threads of `new` that something other than the code started (see the class)."""
        objects = {t.ident: t for t in threading.enumerate()}
        outside = set(before) - {code_thread}
        found: set[int] = set()
        changed = True
        while changed:  # a thread started by an outsider's thread is an outsider's too
            changed = False
            for ident in new:
                starter = getattr(objects.get(ident), self.ATTRIBUTE, None)
                if ident not in found and (starter in outside or starter in found):
                    found.add(ident)
                    changed = True
        return found


class ModelGuard:
    """Note `model` (and `tokenizer`) and the process now; `restore()` after the code ran."""

    def __init__(
        self,
        model: torch.nn.Module,
        reload: Callable[[], dict[str, torch.Tensor]],
        expected: frozenset[str] = frozenset(),
        tokenizer: object = None,
        tokenizer_expected: frozenset[str] = frozenset(),
    ) -> None:
        """`reload()`: the model's state dict as its files hold it (on any device); `expected`:
        module attributes the code is known to add or change (put back, not reported); the same
        for `tokenizer`'s attributes in `tokenizer_expected`."""
        self.settings = Settings()  # first: the recursion limit is restored from it first
        self.threads = _threads()
        self.code_thread = threading.get_ident()  # the code runs on the thread that notes the model
        self.model, self.reload = model, reload
        self.patches = Patches()
        self.patches.add_module(builtins, classes=False)
        for module in _watched_modules(model, tokenizer):
            self.patches.add_module(module, classes=module.__name__ not in _NO_CLASSES)
        classes = {type(m) for m in model.modules()} | {type(tokenizer), type(model.config)}
        for cls in [*classes, torch.nn.Module, torch.Tensor, torch.nn.Parameter]:
            self.patches.add_class(cls)
        for name, module in model.named_modules():
            self.patches.add_object(name or "(the model)", module, expected=expected)
        configs = _config_types()
        self.patches.add_object("model.config", model.config, deep=configs)
        if getattr(model, "generation_config", None) is not None:
            self.patches.add_object("model.generation_config", model.generation_config, deep=configs)
        self.backend = None
        if tokenizer is not None:
            self.patches.add_object("tokenizer", tokenizer, expected=tokenizer_expected)
            backend = backend_of(tokenizer)
            self.backend = Backend(backend) if backend is not None else None
        self.tensors = {
            name: _Tensor(t, t.data, t.data_ptr(), t._version, t.requires_grad, t.grad)
            for name, t in [
                *model.named_parameters(remove_duplicate=False),
                *model.named_buffers(remove_duplicate=False),
            ]
        }
        for name, t in self.tensors.items():
            self.patches.add_object(name, t.tensor)
        self.patches.seal()
        self.transient = {  # buffers the files do not hold, kept as they are now
            f"{prefix}{'.' if prefix else ''}{b}": module._buffers[b].detach().clone()
            for prefix, module in model.named_modules(remove_duplicate=False)
            for b in module._non_persistent_buffers_set
            if module._buffers.get(b) is not None
        }
        self.sums = _fingerprint(self.tensors)
        self.births = _Births()  # last: nothing above may fail with it installed (restore removes it)

    def restore(self) -> Restored:
        """Put back what the code changed; read changed weights again. Never raises for what the
        code did: what cannot be put back or proven is in `unproven`."""
        if sys.getrecursionlimit() != self.settings.recursion_limit:  # before any deeper call
            sys.setrecursionlimit(self.settings.recursion_limit)
        found = Found()
        try:
            # patches first (dict operations only, no torch call): the settings are read and set
            # back, and the weights summed, with torch's own functions and classes
            self.patches.restore(found)
            restored, differ = self.settings.restore()
            if restored:
                found.put_back("settings", *restored)
            found.unproven += [f"{name} changed and could not be set back" for name in differ]
            if self.backend is not None:
                restored, differ = self.backend.restore()
                if restored:
                    found.put_back("tokenizer backend", *restored)
                found.unproven += [f"the tokenizer's {what} changed" for what in differ]
            weights = self._restore_tensors(found)
        except Exception as exc:  # the guard's own failure: nothing is proven
            log.exception("the model guard could not finish")
            found.unproven.append(f"the guard could not finish ({type(exc).__name__}: {exc})")
            weights = []
        found.unproven += self._leftover_threads()
        return Restored(weights=weights, state=found.lines(), unproven=found.unproven)

    def _restore_tensors(self, found: Found) -> list[str]:
        """Each parameter's and buffer's object state, then its values; returns those written."""
        changed = set()
        for name, t in self.tensors.items():
            if t.tensor.requires_grad != t.requires_grad:
                t.tensor.requires_grad_(t.requires_grad)
                found.put_back(name, "requires_grad")
            if t.tensor.grad is not t.grad:
                t.tensor.grad = t.grad
                found.put_back(name, "grad")
            if t.moved():
                t.tensor.data = t.alias  # the noted storage again (a `.data =`, `.to()`, `set_()`)
                found.put_back(name, "data")
                changed.add(name)
            if t.tensor._version != t.version:
                changed.add(name)
        changed |= self._differing_sums()
        # a transient buffer is proven by its copy: one written back bit for bit was not changed
        changed -= {
            n for n in changed if n in self.transient and _bitwise_equal(self.tensors[n].tensor, self.transient[n])
        }
        if changed:
            self._reload(sorted(changed), found)
        return sorted(changed)

    def _differing_sums(self) -> set[str]:
        sums = _fingerprint(self.tensors)
        floating = [name for name, t in self.tensors.items() if t.tensor.is_floating_point()]
        if sums.shape != self.sums.shape:
            return set(floating)
        differ = ~((sums == self.sums) | (sums.isnan() & self.sums.isnan()))
        return {name for name, bad in zip(floating, differ.tolist(), strict=True) if bad}

    def _reload(self, names: list[str], found: Found) -> None:
        """Copy the files' values (a transient buffer: the noted copy) into the noted tensors, in
        place (their storage stays); then prove them as before: a transient buffer bit for bit
        against its copy, the rest by their fingerprint."""
        log.warning("trusted code wrote to %d weight tensors (%s...); reading them again", len(names), names[:3])
        persistent = [n for n in names if n not in self.transient]
        fresh = self.reload() if persistent else {}
        missing = set()
        with torch.no_grad():
            for name in names:
                t = self.tensors[name]
                source = self.transient.get(name, fresh.get(name))
                if source is None:
                    missing.add(name)
                    found.unproven.append(f"{name} was written and the model's files do not hold it")
                else:
                    t.tensor.copy_(source.to(t.tensor.device, t.tensor.dtype))
        moved = {n for n, t in self.tensors.items() if t.moved()}
        transient = {n for n in self.transient if not _bitwise_equal(self.tensors[n].tensor, self.transient[n])}
        still = sorted(((self._differing_sums() - set(self.transient)) | moved | transient) - missing)
        found.unproven += [f"{name}: its values could not be read back exactly" for name in still]

    def _leftover_threads(self) -> list[str]:
        def new() -> dict[int, str]:
            started = {i: n for i, n in _threads().items() if i not in self.threads and not n.startswith(_OWN_THREADS)}
            outsiders = self.births.outsiders(started, self.threads, self.code_thread)
            return {i: n for i, n in started.items() if i not in outsiders}

        try:
            deadline = time.monotonic() + _THREAD_GRACE_S
            while (left := new()) and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            self.births.close()
        return [f"a thread {name!r} the code started is still running" for name in left.values()]


def _config_types() -> tuple[type, ...]:
    from transformers import GenerationConfig, PretrainedConfig

    return (PretrainedConfig, GenerationConfig)


def _watched_modules(model: torch.nn.Module, tokenizer: object) -> list[types.ModuleType]:
    """torch's modules, the transformers modules every forward uses, the modules the model's,
    config's and tokenizer's classes come from, and the transformers modules those import from."""
    names = [*_TORCH_MODULES, *_TRANSFORMERS_MODULES]
    modules = [m for name in names if isinstance(m := sys.modules.get(name), types.ModuleType)]
    modules += [m for m in vars(torch.nn.modules).values() if isinstance(m, types.ModuleType)]
    classes = {type(m) for m in model.modules()} | {type(model.config), type(tokenizer)}
    homes = {klass.__module__ for cls in classes for klass in cls.__mro__}
    own = [m for name in sorted(homes) if isinstance(m := sys.modules.get(name), types.ModuleType)]
    modules += own
    for module in own:  # one step further: where the modeling code's functions and classes come from
        if not module.__name__.startswith(("transformers", "transformers_modules")):
            continue
        for value in list(vars(module).values()):
            home = getattr(value, "__module__", None) if isinstance(value, (type, types.FunctionType)) else None
            if isinstance(home, str) and home.startswith("transformers") and not home.startswith(_NOT_FORWARD):
                modules.append(sys.modules[home])
    return list({id(m): m for m in modules if isinstance(m, types.ModuleType)}.values())
