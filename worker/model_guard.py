"""What trusted code run on the served model (an nnsight job, worker/nnsight_jobs.py) may leave
behind, put back: `ModelGuard` notes the model before the code runs and, after it, restores
every module's own state (its forward, hooks, submodules, parameter and buffer objects, train or
eval mode, which parameters need gradients) and checks a fingerprint of the weights' values.

The fingerprint per parameter and buffer is its storage pointer, version counter and its sum
(float32 at least): an in-place write through autograd bumps the version, a write through `.data` changes
the sum (a write that leaves every sum exactly as it was, a permutation, is not seen). Values that
changed are read again from the model's own files, in place, so that the storage the running
batch and its CUDA graphs hold stays the same.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)

# Module attributes that are containers PyTorch mutates in place (hooks, children, tensors).
_CONTAINERS = (
    "_parameters",
    "_buffers",
    "_modules",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
    "_non_persistent_buffers_set",
)


@dataclass
class Restored:
    """What the guard found changed and put back."""

    weights: list[str] = field(default_factory=list)  # parameters or buffers whose values changed
    state: list[str] = field(default_factory=list)  # modules whose other state changed

    @property
    def weights_written(self) -> bool:
        return bool(self.weights)


@dataclass
class _Tensor:
    tensor: torch.Tensor
    pointer: int
    version: int
    requires_grad: bool


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
        return torch.zeros(0, dtype=torch.float64)
    return torch.stack([s.to("cpu", torch.float64) for s in sums])


class ModelGuard:
    """Note `model` now; `restore()` after the code ran."""

    def __init__(
        self,
        model: torch.nn.Module,
        reload: Callable[[], dict[str, torch.Tensor]],
        expected: frozenset[str] = frozenset(),
    ) -> None:
        """`reload()`: the model's state dict as its files hold it (on any device); `expected`:
        module attributes the code is known to add (removed, not reported)."""
        self.model, self.reload, self.expected = model, reload, expected
        self.modules = dict(model.named_modules(remove_duplicate=False))
        self.dicts = {name: dict(module.__dict__) for name, module in self.modules.items()}
        self.containers = {
            name: {attr: (module.__dict__[attr].copy() if attr in module.__dict__ else None) for attr in _CONTAINERS}
            for name, module in self.modules.items()
        }
        self.tensors = {
            name: _Tensor(t, t.data_ptr(), t._version, t.requires_grad)
            for name, t in [
                *model.named_parameters(remove_duplicate=False),
                *model.named_buffers(remove_duplicate=False),
            ]
        }
        self.sums = _fingerprint(self.tensors)

    def restore(self) -> Restored:
        """Put every module's state back as noted; read changed weights again from the files."""
        found = Restored()
        for name, module in self.modules.items():
            attributes = self._restore_module(module, self.dicts[name], self.containers[name]) - self.expected
            if attributes:
                found.state.append(f"{name or '(the model)'}: {', '.join(sorted(attributes))}")
        changed = [
            name
            for name, t in self.tensors.items()
            if t.tensor.data_ptr() != t.pointer or t.tensor._version != t.version
        ]
        for t in self.tensors.values():
            t.tensor.requires_grad_(t.requires_grad)
        sums = _fingerprint(self.tensors)
        floating = [name for name, t in self.tensors.items() if t.tensor.is_floating_point()]
        if sums.shape != self.sums.shape:
            changed = floating
        else:
            differ = ~((sums == self.sums) | (sums.isnan() & self.sums.isnan()))
            changed += [name for name, bad in zip(floating, differ.tolist(), strict=True) if bad]
        if changed:
            found.weights = sorted(set(changed))
            self._reload(found.weights)
        return found

    @staticmethod
    def _restore_module(module: torch.nn.Module, noted: dict, containers: dict) -> set[str]:
        """Put one module's state back; returns the attributes that had changed."""
        now = module.__dict__
        changed = set()
        for key in [k for k in now if k not in noted]:  # what the code added (nnsight's controller, ...)
            del now[key]
            changed.add(key)
        for key, value in noted.items():  # what it replaced (a forward, a container, the train flag)
            if key not in now or now[key] is not value:
                now[key] = value
                changed.add(key)
        for attr, copy in containers.items():  # what it changed inside a container (a hook, a child)
            if copy is None:
                continue
            current = noted[attr]
            if isinstance(current, set):
                same = current == copy
            else:
                same = list(current) == list(copy) and all(current[k] is v for k, v in copy.items())
            if not same:
                current.clear()
                current.update(copy)
                changed.add(attr)
        return changed

    def _reload(self, names: list[str]) -> None:
        """Copy the files' values into the noted tensors, in place (their storage stays)."""
        log.warning("trusted code wrote to %d weight tensors (%s...); reading them again", len(names), names[:3])
        fresh = self.reload()
        with torch.no_grad():
            for name, t in self.tensors.items():
                if name in fresh:
                    t.tensor.copy_(fresh[name].to(t.tensor.device, t.tensor.dtype))
            # a buffer not in the files (rotary frequencies) is recomputed by its module's own init;
            # such buffers are not weights: say so if one was written
        unreadable = [n for n in names if n not in fresh]
        if unreadable:
            raise RuntimeError(
                f"trusted code wrote to {', '.join(unreadable[:5])}, which the model's files do not hold; the "
                "engine must be restarted to serve exact results"
            )
        self.sums = _fingerprint(self.tensors)
        for t in self.tensors.values():
            t.version = t.tensor._version


_MISSING = object()
