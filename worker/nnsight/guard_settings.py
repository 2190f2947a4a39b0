"""Process-wide settings trusted code can change (worker/nnsight/guard.py): torch's (threads,
matmul precision, default dtype and device, deterministic algorithms, anomaly mode, grad and
autocast state, backend flags, SDPA backends, the torch function and dispatch mode stacks) and
the interpreter's (recursion limit, switch interval, trace and profile functions, stdout and
stderr, hooks, gc, os.environ, the working directory). `Settings()` reads them all; `restore()`
sets back each that differs and reads it again: the names of those it put back, and of those
that stay different.

Thread-local ones (grad mode, autocast, the mode stacks, the default device) are the calling
thread's: note and restore on the engine thread, the one that ran the code. They are put back
first, before the guard computes anything: a float32 sum depends on the thread count, and a
default device of "meta" or a leftover mode would change every tensor the guard makes.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

_UNREADABLE = "(unreadable)"
_RESTORE_ROUNDS = 3  # some settings are coupled (the matmul precision and the fp32_precision flags)
_FP32_PRECISIONS = ("", "cuda.matmul.", "cudnn.", "cudnn.conv.", "cudnn.rnn.")
_FP32_PRECISIONS_CPU = ("mkldnn.", "mkldnn.matmul.", "mkldnn.conv.", "mkldnn.rnn.")
_SDP_KINDS = ("flash", "mem_efficient", "math", "cudnn", "overrideable", "fa3")
_SYS_OBJECTS = ("stdout", "stderr", "stdin", "excepthook", "displayhook", "unraisablehook", "breakpointhook")
# torch._C getter/setter pairs (`_get_NAME`, `_set_NAME`), by the name torch documents them under
_C_PAIRS = {
    "cpu_allow_fp16_reduced_precision_reduction": "torch cpu fp16 reduced-precision reduction",
    "cublas_allow_fp16_accumulation": "torch.backends.cuda.matmul.allow_fp16_accumulation",
    "cublas_allow_tf32": "torch.backends.cuda.matmul.allow_tf32",
    "cudnn_allow_tf32": "torch.backends.cudnn.allow_tf32",
    "onednn_allow_tf32": "torch.backends.mkldnn.allow_tf32",
    "cudnn_enabled": "torch.backends.cudnn.enabled",
    "cudnn_benchmark": "torch.backends.cudnn.benchmark",
    "cudnn_deterministic": "torch.backends.cudnn.deterministic",
    "mkldnn_enabled": "torch.backends.mkldnn.enabled",
    "mkldnn_deterministic": "torch.backends.mkldnn.deterministic",
    "nnpack_enabled": "torch.backends.nnpack.enabled",
    "qengine": "torch.backends.quantized.engine",
    "linalg_preferred_backend": "torch.backends.cuda.preferred_linalg_library",
    "blas_preferred_backend": "torch.backends.cuda.preferred_blas_library",
    "rocm_fa_preferred_backend": "torch.backends.cuda.preferred_rocm_fa_library",
    "sdp_priority_order": "torch SDPA backend priority",
    "math_sdp_allow_fp16_bf16_reduction": "torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed",
    "graph_executor_optimize": "torch JIT graph executor optimize",
    "deterministic_fill_uninitialized_memory": "torch.utils.deterministic.fill_uninitialized_memory",
    "torch_function_state": "torch function state",
}
# pairs whose value is a tuple the setter takes as arguments
_C_TUPLES = {
    f"cublas_allow_{t}_reduced_precision_reduction": f"torch.backends.cuda.matmul.allow_{t}_reduced_precision_reduction"
    for t in ("fp16", "bf16")
}


@dataclass(frozen=True)
class Setting:
    name: str
    get: Callable[[], Any]
    set: Callable[[Any], object]

    def read(self) -> object:
        try:
            return self.get()
        except Exception as exc:  # noqa: BLE001 - torch refuses some reads after a mix of its APIs
            return (_UNREADABLE, type(exc).__name__)


def _attribute(owner: object, path: str, label: str) -> Setting:
    *parents, last = path.split(".")

    def target() -> object:
        obj = owner
        for part in parents:
            obj = getattr(obj, part)
        return obj

    return Setting(label, lambda: getattr(target(), last), lambda value: setattr(target(), last, value))


def _c_pairs() -> list[Setting]:
    c: Any = torch._C
    out = []
    for table, splat in ((_C_PAIRS, False), (_C_TUPLES, True)):
        for name, label in table.items():
            get, put = getattr(c, f"_get_{name}", None), getattr(c, f"_set_{name}", None)
            if get is not None and put is not None:
                out.append(Setting(label, get, _splat(put) if splat else put))
    for kind in _SDP_KINDS:
        get, put = getattr(c, f"_get_{kind}_sdp_enabled", None), getattr(c, f"_set_sdp_use_{kind}", None)
        if get is not None and put is not None:
            out.append(Setting(f"torch.backends.cuda.{kind}_sdp_enabled()", get, put))
    return out


def _splat(put: Callable[..., object]) -> Callable[[Any], object]:
    return lambda value: put(*value)


def _set_deterministic(value: Any) -> None:
    mode, warn_only = value
    torch.use_deterministic_algorithms(mode, warn_only=warn_only)


def _set_anomaly(value: Any) -> None:
    enabled, check_nan = value
    torch.set_anomaly_enabled(enabled, check_nan)


def _set_environ(noted: Any) -> None:
    for key in [k for k in os.environ if k not in noted]:
        del os.environ[key]
    for key, text in noted.items():
        if os.environ.get(key) != text:
            os.environ[key] = text


def _set_gc(value: Any) -> None:
    enabled, thresholds = value
    gc.set_threshold(*thresholds)
    (gc.enable if enabled else gc.disable)()


def _denormals_flushed() -> bool:
    """Whether this thread flushes denormal floats to zero (torch.set_flush_denormal has no getter)."""
    tiny = torch.tensor([1e-39], dtype=torch.float32, device="cpu")
    return bool((tiny * 1.0).item() == 0.0)


def _autocast(device: str) -> list[Setting]:
    def put(value: Any) -> None:
        torch.set_autocast_enabled(device, value[0])
        torch.set_autocast_dtype(device, value[1])

    return [
        Setting(
            f"autocast on {device}", lambda: (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)), put
        )
    ]


def _default_device_context() -> object:
    return getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None)


def _set_default_device_context(value: Any) -> None:
    """Back to the noted default device (a DeviceContext at the bottom of this thread's function
    mode stack, or none)."""
    torch.set_default_device(None)
    if value is not None:
        torch.set_default_device(value.device)


def _mode_stacks() -> tuple[tuple[object, ...], tuple[object, ...]]:
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return tuple(_get_current_function_mode_stack()), tuple(_get_current_dispatch_mode_stack())


def _set_mode_stacks(value: Any) -> None:
    from torch.overrides import _pop_mode, _push_mode
    from torch.utils._python_dispatch import _pop_mode as _pop_dispatch
    from torch.utils._python_dispatch import _push_mode as _push_dispatch

    functions, dispatch = value
    while torch._C._len_torch_function_stack():
        _pop_mode()
    for mode in functions:
        _push_mode(mode)
    while torch._C._len_torch_dispatch_stack():
        _pop_dispatch()
    for mode in dispatch:
        _push_dispatch(mode)


def _refuse(value: Any) -> None:
    raise RuntimeError("inference mode cannot be set back from outside its context")


def all_settings() -> list[Setting]:
    """Every setting the guard notes, in the order it restores them (the default device and the
    mode stacks first: they decide where the rest of the restore makes its tensors)."""
    device_module: Any = torch.utils._device
    fp32 = (*_FP32_PRECISIONS, *_FP32_PRECISIONS_CPU)
    return [
        Setting("torch default device", _default_device_context, _set_default_device_context),
        Setting("torch function and dispatch mode stacks", _mode_stacks, _set_mode_stacks),
        _attribute(device_module, "CURRENT_DEVICE", "torch.utils._device.CURRENT_DEVICE"),
        Setting("torch.get_default_dtype()", torch.get_default_dtype, torch.set_default_dtype),
        Setting("torch.get_num_threads()", torch.get_num_threads, torch.set_num_threads),
        Setting("torch.get_num_interop_threads()", torch.get_num_interop_threads, torch.set_num_interop_threads),
        Setting("torch matmul precision", torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
        Setting(
            "torch deterministic algorithms",
            lambda: (
                torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled(),
            ),
            _set_deterministic,
        ),
        Setting(
            "torch anomaly mode",
            lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
            _set_anomaly,
        ),
        Setting("torch grad mode", torch.is_grad_enabled, torch._C._set_grad_enabled),
        Setting("torch inference mode", torch.is_inference_mode_enabled, _refuse),
        Setting("torch forward grad mode", torch._C._is_fwd_grad_enabled, torch._C._set_fwd_grad_enabled),
        Setting("torch autograd threads", torch._C._is_multithreading_enabled, torch._C._set_multithreading_enabled),
        Setting("torch autocast cache", torch.is_autocast_cache_enabled, torch.set_autocast_cache_enabled),
        *_autocast("cpu"),
        *(_autocast("cuda") if torch.cuda.is_available() else []),
        Setting("torch flush denormal", _denormals_flushed, lambda v: torch.set_flush_denormal(bool(v))),
        *_c_pairs(),
        _attribute(torch, "backends.opt_einsum.enabled", "torch.backends.opt_einsum.enabled"),
        _attribute(torch, "backends.opt_einsum.strategy", "torch.backends.opt_einsum.strategy"),
        *(_attribute(torch, f"backends.{p}fp32_precision", f"torch.backends.{p}fp32_precision") for p in fp32),
        *(
            [Setting("torch.cuda.current_device()", torch.cuda.current_device, torch.cuda.set_device)]
            if torch.cuda.is_available()
            else []
        ),
        Setting("sys.getswitchinterval()", sys.getswitchinterval, sys.setswitchinterval),
        Setting("sys.gettrace()", sys.gettrace, sys.settrace),
        Setting("sys.getprofile()", sys.getprofile, sys.setprofile),
        Setting("threading.gettrace()", threading.gettrace, threading.settrace),
        Setting("threading.getprofile()", threading.getprofile, threading.setprofile),
        Setting("sys.get_int_max_str_digits()", sys.get_int_max_str_digits, sys.set_int_max_str_digits),
        *(_attribute(sys, name, f"sys.{name}") for name in _SYS_OBJECTS),
        _attribute(threading, "excepthook", "threading.excepthook"),
        Setting("gc", lambda: (gc.isenabled(), gc.get_threshold()), _set_gc),
        Setting("os.environ", lambda: dict(os.environ), _set_environ),
        Setting("the working directory", os.getcwd, os.chdir),
    ]


class Settings:
    """The settings as noted now (on this thread)."""

    def __init__(self) -> None:
        self.recursion_limit = sys.getrecursionlimit()
        self.settings = all_settings()
        self.values = [s.read() for s in self.settings]

    def restore(self) -> tuple[list[str], list[str]]:
        """Set back every setting that differs; returns (the names put back, the names that stay
        different)."""
        restored = []
        if sys.getrecursionlimit() != self.recursion_limit:
            sys.setrecursionlimit(self.recursion_limit)
            restored.append("sys.getrecursionlimit()")
        differ = self._differing()
        for _ in range(_RESTORE_ROUNDS):
            if not differ:
                break
            for i in differ:
                with contextlib.suppress(Exception):
                    self.settings[i].set(self.values[i])
                if self.settings[i].name not in restored:
                    restored.append(self.settings[i].name)
            differ = self._differing()
        unproven = [self.settings[i].name for i in differ]
        return [name for name in restored if name not in unproven], unproven

    def _differing(self) -> list[int]:
        return [i for i, setting in enumerate(self.settings) if not _same(setting.read(), self.values[i])]


def _same(a: object, b: object) -> bool:
    """The same object, or equal values of one type (a number, a dtype, an enum, a tuple of them)."""
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - a value whose == raises is not the same
        return False
