"""Patches trusted code can leave in the process (worker/nnsight/guard.py): a function replaced in
a module (`torch.nn.functional.silu`), a method on a class (`LlamaMLP.forward`), an entry added
to a registry held in a module or class (torch's global module hooks, transformers' attention
functions), a function's code swapped, an attribute of an object changed (the model's modules,
config and generation config, the tokenizer). `Patches` notes each namespace (a module's or an
object's `__dict__`, a class's attributes) by identity, each mutable container it holds (dict,
list, set: their items by identity, recursively), and each function's code and defaults;
`restore()` puts back exactly what changed, the same objects, so the restore is exact.

What it cannot put back by identity it names: a registration in torch's dispatcher
(torch.library) is not undone by restoring a Python set.

Every check is an identity comparison run in C (`map(operator.is_, ...)`): ~25,000 names and
~7,000 containers (SmolLM2's 400 modules) take a few milliseconds.
"""

from __future__ import annotations

import builtins
import operator
import types
from collections import OrderedDict, defaultdict
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any

_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class defined in Python, whose attributes can be set
# Names the interpreter adds to a namespace as it runs (a warning's once-registry), not patches.
_BENIGN = frozenset({"__warningregistry__"})
# Modules whose registries stand for something outside Python (a kernel registered in torch's
# dispatcher): restoring the container would not undo it.
_UNDOABLE = frozenset({"torch.library"})
# Containers followed: exactly these types (a subclass may compute its items: transformers' lazy
# auto mappings import every model when iterated).
_CONTAINERS = frozenset({dict, OrderedDict, defaultdict, list, set})
# Values that are never a registry object (the common ones, checked first: an ABC check is slow).
_PLAIN = frozenset(
    {
        types.FunctionType,
        types.BuiltinFunctionType,
        types.ModuleType,
        type,
        str,
        int,
        float,
        bool,
        type(None),
        tuple,
        frozenset,
        dict,
        list,
        set,
    }
)
_METHODS = frozenset({staticmethod, classmethod})
_MAX_DEPTH = 4  # containers inside containers (a config's rope parameters), followed this deep
_MISSING = object()
_CODE = operator.attrgetter("__code__")
_DEFAULTS = operator.attrgetter("__defaults__")
_KWDEFAULTS = operator.attrgetter("__kwdefaults__")


@dataclass(slots=True)
class _Namespace:
    label: str
    target: Any  # a dict (a module's or an object's __dict__) or a class
    noted: dict[str, object]
    owner: object = None  # the object whose __dict__ this is (its class is checked too)
    owner_type: type | None = None
    expected: frozenset[str] = frozenset()  # keys that may be added or replaced: put back silently

    def same(self) -> bool:
        now = vars(self.target) if isinstance(self.target, type) else self.target
        return (
            len(now) == len(self.noted)
            and all(map(operator.is_, now.values(), self.noted.values()))
            and now.keys() == self.noted.keys()
            and (self.owner_type is None or type(self.owner) is self.owner_type)
        )


@dataclass(slots=True)
class _Container:
    owner: str  # the namespace holding it, and where: reported as "owner: where"
    where: str
    target: Any  # a dict, list or set
    noted: Any
    undoable: bool = True
    silent: bool = False  # under a key its namespace expects to change: put back, not reported

    def same(self) -> bool:
        now, noted = self.target, self.noted
        if len(now) != len(noted):
            return False
        if isinstance(now, dict):
            return all(map(operator.is_, now.values(), noted.values())) and list(now) == list(noted)
        if isinstance(now, list):
            return all(map(operator.is_, now, noted))
        return bool(now == noted)


@dataclass
class Found:
    """What a restore found changed: put back exactly (`restored`: namespace -> names), or not."""

    restored: dict[str, set[str]] = field(default_factory=dict)
    unproven: list[str] = field(default_factory=list)

    def put_back(self, owner: str, *names: str) -> None:
        self.restored.setdefault(owner, set()).update(names)

    def lines(self) -> list[str]:
        return [f"{owner}: {', '.join(sorted(names))}" for owner, names in self.restored.items()]


class Patches:
    """Namespaces noted now; `add_*` to note more before the code runs."""

    def __init__(self) -> None:
        self.namespaces: list[_Namespace] = []
        self.containers: list[_Container] = []
        self.functions: list[types.FunctionType] = []
        self.labels: list[tuple[str, str]] = []  # each function's (namespace, name)
        self._seen: set[int] = set()

    # -- noting -------------------------------------------------------------------------------

    def add_module(self, module: types.ModuleType, classes: bool = True) -> None:
        """A module's namespace, its containers and functions, the registries it holds, and (with
        `classes`) the classes defined in it. Add `builtins` first: it is restored first."""
        space = vars(module)
        if id(space) in self._seen:
            return
        self._seen.add(id(space))
        name = module.__name__
        self.namespaces.append(_Namespace(name, space, dict(space)))
        self._names(name, space.items(), undoable=name not in _UNDOABLE)
        for key, value in list(space.items()):
            if type(value) not in _PLAIN and isinstance(value, MutableMapping) and not isinstance(value, type):
                if not type(value).__name__.startswith("_Lazy"):
                    self.add_object(f"{name}.{key}", value)  # a registry (transformers' ALL_ATTENTION_FUNCTIONS)
                    self.add_class(type(value))
        if classes:
            for value in [v for v in space.values() if isinstance(v, type) and v.__module__ == name]:
                self.add_class(value)

    def add_class(self, cls: type) -> None:
        """The attributes of `cls` and of every class in its MRO that Python code can change."""
        for klass in cls.__mro__:
            if not klass.__flags__ & _HEAPTYPE or id(klass) in self._seen:
                continue
            self._seen.add(id(klass))
            label = f"class {klass.__module__}.{klass.__qualname__}"
            noted = dict(vars(klass))
            self.namespaces.append(_Namespace(label, klass, noted))
            self._names(label, noted.items())
            for key, value in [(k, v) for k, v in noted.items() if type(v) in _METHODS]:
                if type(value.__func__) is types.FunctionType:
                    self._function(label, key, value.__func__)

    def _names(self, owner: str, items: Any, undoable: bool = True) -> None:
        """The functions and containers among a namespace's items."""
        items = list(items)
        for key, value in [(k, v) for k, v in items if type(v) is types.FunctionType]:
            self._function(owner, key, value)
        for key, value in [(k, v) for k, v in items if type(v) in _CONTAINERS]:
            self._container(owner, key, value, 0, undoable)

    def add_object(
        self, label: str, obj: object, deep: tuple[type, ...] = (), expected: frozenset[str] = frozenset()
    ) -> None:
        """An object's attributes (its `__dict__` and its class), its containers, and the objects
        it holds that are instances of `deep` (a config's sub-configs), the same way."""
        space = getattr(obj, "__dict__", None)
        if not isinstance(space, dict) or id(space) in self._seen:
            return
        self._seen.add(id(space))
        noted = dict(space)
        self.namespaces.append(_Namespace(label, space, noted, obj, type(obj), expected))
        for key, value in [
            (k, v) for k, v in noted.items() if type(v) in _CONTAINERS or (deep and isinstance(v, deep))
        ]:
            if type(value) in _CONTAINERS:
                self._container(label, key, value, 0, deep=deep, silent=key in expected)
            else:
                self.add_object(f"{label}.{key}", value, deep)

    def _container(
        self,
        owner: str,
        where: str,
        value: Any,
        depth: int,
        undoable: bool = True,
        deep: tuple[type, ...] = (),
        silent: bool = False,
    ) -> None:
        """A dict, list or set: its items by identity, and the containers (and `deep` objects)
        among them, down to `_MAX_DEPTH`."""
        if depth >= _MAX_DEPTH or id(value) in self._seen:
            return
        self._seen.add(id(value))
        self.containers.append(_Container(owner, where, value, value.copy(), undoable, silent))
        if not value or type(value) is set:  # most are a module's empty hook dicts; a set holds no container
            return
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in [(k, v) for k, v in items if type(v) in _CONTAINERS or (deep and isinstance(v, deep))]:
            if type(item) in _CONTAINERS:
                self._container(owner, f"{where}[{key!r}]", item, depth + 1, undoable, deep, silent)
            else:
                self.add_object(f"{owner}.{where}[{key!r}]", item, deep)

    def _function(self, owner: str, where: str, function: types.FunctionType) -> None:
        if id(function) not in self._seen:
            self._seen.add(id(function))
            self.functions.append(function)
            self.labels.append((owner, where))

    def seal(self) -> None:
        """Note the functions' code and defaults (after the last `add_*`)."""
        fs = self.functions
        self.codes = (list(map(_CODE, fs)), list(map(_DEFAULTS, fs)), list(map(_KWDEFAULTS, fs)))

    # -- restoring ---------------------------------------------------------------------------

    def restore(self, found: Found) -> None:
        """Put back every namespace, container and function that changed; say so in `found`.
        builtins first (noted first), with no call to a builtin until it is put back."""
        spaces = self.namespaces
        if spaces and spaces[0].target is vars(builtins):
            _restore_builtins(spaces[0], found)
            spaces = spaces[1:]
        for space in spaces:
            if not space.same():
                _restore_namespace(space, found)
        for container in self.containers:
            if container.same():
                continue
            if not container.undoable:
                found.unproven.append(f"{container.owner}.{container.where} changed (a registration outside Python)")
                continue
            try:
                _put_back(container.target, container.noted)
            except Exception as exc:  # noqa: BLE001 - a container the code made unusable
                found.unproven.append(f"{container.owner}.{container.where} changed and could not be put back ({exc})")
                continue
            if not container.silent:
                found.put_back(container.owner, container.where)
        fs = self.functions
        now = (list(map(_CODE, fs)), list(map(_DEFAULTS, fs)), list(map(_KWDEFAULTS, fs)))
        if all(all(map(operator.is_, a, b)) for a, b in zip(now, self.codes, strict=True)):
            return
        for i, f in enumerate(fs):
            noted = tuple(part[i] for part in self.codes)
            if all(map(operator.is_, (part[i] for part in now), noted)):
                continue
            owner, where = self.labels[i]
            try:
                f.__code__, f.__defaults__, f.__kwdefaults__ = noted
                found.put_back(owner, f"{where} (its code)")
            except Exception as exc:  # noqa: BLE001
                found.unproven.append(f"{owner}.{where}: its code changed and could not be put back ({exc})")


def _restore_builtins(space: _Namespace, found: Found) -> None:
    """builtins' namespace put back with dict methods and comprehensions only: until it is, `len`,
    `all` or `isinstance` may be the code's."""
    now, noted = space.target, space.noted
    added = [k for k in now if k not in noted]
    replaced = [k for k in noted if now.get(k, _MISSING) is not noted[k]]
    for key in added:
        del now[key]
    for key in replaced:
        now[key] = noted[key]
    if added or replaced:
        found.put_back(space.label, *added, *replaced)


def _restore_namespace(space: _Namespace, found: Found) -> None:
    target, noted = space.target, space.noted
    if space.owner_type is not None and type(space.owner) is not space.owner_type:
        try:
            space.owner.__class__ = space.owner_type
            found.put_back(space.label, "__class__")
        except Exception as exc:  # noqa: BLE001
            found.unproven.append(f"{space.label}: its class changed and could not be put back ({exc})")
    now = dict(vars(target)) if isinstance(target, type) else target
    added = [k for k in now if k not in noted and k not in _BENIGN and not _submodule(space.label, k, now[k])]
    replaced = [k for k, v in noted.items() if k not in now or now[k] is not v]
    try:
        if isinstance(target, type):
            for key in added:
                delattr(target, key)
            for key in replaced:
                setattr(target, key, noted[key])
        else:
            for key in added:
                del now[key]
            for key in replaced:
                now[key] = noted[key]
    except Exception as exc:  # noqa: BLE001 - a class that refuses the attribute back
        found.unproven.append(f"{space.label}: {', '.join(sorted({*added, *replaced}))} could not be put back ({exc})")
        return
    changed = {*added, *replaced} - space.expected
    if changed:
        found.put_back(space.label, *changed)


def _submodule(label: str, key: str, value: object) -> bool:
    """A submodule imported meanwhile (`import torch._dynamo` binds `torch._dynamo`): not a patch."""
    return isinstance(value, types.ModuleType) and value.__name__ == f"{label}.{key}"


def _put_back(target: Any, noted: Any) -> None:
    if isinstance(target, list):
        target[:] = noted
    else:
        target.clear()
        target.update(noted)
