"""Values a model or a function reads from outside its arguments, as part of a program's key.

A compiled program keeps what its Python code read while it was traced: a temperature that a
``method=`` function closes over, a module-level constant read in ``__call__``, a field of a
global config. ``model.apply`` reads them anew on every call; an ensemble's call compiled once
and kept the first values without a word after they changed. So what such code reads is part
of the program's key, and a changed value compiles anew, once per value; the first such compile
warns, naming the value and how to pass it instead.

What is read is found from the bytecode of the user's code reachable from the call (the model's
classes, the ``method=`` function, the loss, what they name): the globals it loads and the
``module.name`` it reads of a user's module, its closure cells and defaults, its classes'
attributes; within those, numbers and strings, small NumPy arrays by content (large ones and JAX
arrays by identity), functions and classes by identity (then their code too), and what
containers, dataclasses, namespaces and user objects hold. Names the code assigns itself (a
``global`` trace counter) are not inputs. The JAX stack's and the standard library's code is not
walked (their globals are theirs).
"""

from __future__ import annotations

import argparse
import dataclasses
import dis
import functools
import inspect
import sys
import types
from collections.abc import Hashable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import numpy as np
from flax import nnx

from ensemble._core import typed
from ensemble._warn import warn_user

_LIBRARIES = frozenset(sys.stdlib_module_names) | {
    "chex",
    "einops",
    "ensemble",
    "flax",
    "jax",
    "jaxlib",
    "ml_dtypes",
    "numpy",
    "optax",
    "orbax",
    "rollout",
    "typing_extensions",
}
_REMEMBERED = 64  # calls' values kept to tell which value changed
_MAX_ITEMS = 1024  # of one container or object: beyond that it is keyed by identity
_MAX_DEPTH = 4  # containers within containers
_SMALL_ARRAY = 1024  # NumPy arrays up to this many elements are keyed by content
_GLOBAL_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})
_ATTRIBUTE_LOADS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})
_STORES = frozenset({"STORE_GLOBAL", "DELETE_GLOBAL", "STORE_DEREF", "DELETE_DEREF"})


def _theirs(obj: Any) -> bool:
    """A library's function or class (its globals are the library's, not the user's). A
    function's globals say where its code is (``__module__`` is copied by functools.wraps)."""
    if isinstance(obj, types.ModuleType):
        module = obj.__name__
    else:
        module = getattr(obj, "__globals__", {}).get("__name__") or getattr(obj, "__module__", "")
    return (module if isinstance(module, str) else "").split(".")[0] in _LIBRARIES


def _scalar(v: Any) -> bool:
    return v is None or isinstance(v, bool | int | float | complex | str | bytes | np.generic)


class _Reads(NamedTuple):
    loads: tuple[str, ...]  # globals loaded
    pairs: tuple[tuple[str, str], ...]  # (global, attribute): ``cfg.beta``
    stores: frozenset[str]  # globals and cells the code assigns
    own: frozenset[str]  # attributes read of the first argument: ``self.scale``


@functools.lru_cache(maxsize=4096)
def _reads(code: types.CodeType) -> _Reads:
    """What a function's code reads from outside (nested code, such as comprehensions and
    inner functions, included), from its bytecode: so ``self.out`` is no read of a global
    ``out``, and a name the code assigns (``global TRACES; TRACES += 1``, a ``nonlocal``
    counter) is no input. Once per code object."""
    loads, pairs, stores, own = [], [], set(), set()
    first = {code.co_varnames[0], "self"} if code.co_argcount else {"self"}
    previous, of_first = None, False
    for ins in dis.get_instructions(code):
        if ins.opname in _GLOBAL_LOADS:
            loads.append(ins.argval)
        elif ins.opname in _STORES:
            stores.add(ins.argval)
        elif ins.opname in _ATTRIBUTE_LOADS and previous in _GLOBAL_LOADS:
            pairs.append((loads[-1], ins.argval))
        elif ins.opname in _ATTRIBUTE_LOADS and of_first:
            own.add(ins.argval)
        previous = ins.opname
        of_first = ins.opname in ("LOAD_FAST", "LOAD_DEREF") and ins.argval in first
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            nested = _reads(const)
            loads, pairs = loads + list(nested.loads), pairs + list(nested.pairs)
            stores, own = stores | nested.stores, own | nested.own
    loads = [n for n in dict.fromkeys(loads) if n not in stores]
    pairs = [p for p in dict.fromkeys(pairs) if p[0] not in stores]
    return _Reads(tuple(loads), tuple(pairs), frozenset(stores), frozenset(own))


def _attributes_read(c: type) -> frozenset[str]:
    """The ``self.name`` a user's class's methods read: what of an instance its code uses."""
    names: set[str] = set()
    for k in c.__mro__:
        if not _theirs(k):
            for attr in list(vars(k).values()):
                attr = getattr(attr, "wrapped", attr)  # Flax wraps a module's descriptors
                f = inspect.unwrap(getattr(attr, "fget", None) or getattr(attr, "__func__", attr))
                if isinstance(f, types.FunctionType):
                    names |= _reads(f.__code__).own
    return frozenset(names)


def _key(obj: Any) -> Hashable:
    """``obj`` itself where it is hashable (a function, a class), else its identity."""
    try:
        hash(obj)
    except Exception:
        return ("id", id(obj))
    return obj


def _held(v: Any) -> dict[Any, Any] | None:
    """What a config-like value holds: a container's items, a dataclass's fields (a linen
    module's too), a namespace's or a user object's attributes (not a library's objects)."""
    if isinstance(v, dict):
        return v
    if isinstance(v, list | tuple | set | frozenset):
        return dict(enumerate(v))
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        names = (f.name for f in dataclasses.fields(v) if f.name not in ("parent", "name"))
        return {k: getattr(v, k, None) for k in names}
    if isinstance(v, argparse.Namespace | types.SimpleNamespace) or not _theirs(type(v)):
        held = getattr(v, "__dict__", None)
        return held if isinstance(held, dict) else None
    return None


_FUNCTIONS = types.FunctionType | types.MethodType | functools.partial | staticmethod | classmethod


class _Walk:
    """Collects ``(where, value)`` for what user code reachable from the roots reads."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.found: list[tuple[str, Hashable]] = []

    def _first(self, obj: Any) -> bool:
        if id(obj) in self.seen or _theirs(obj):
            return False
        self.seen.add(id(obj))
        return True

    def function(self, f: Any) -> None:
        if isinstance(f, types.MethodType):  # what its code uses of self: not all it holds
            only = _attributes_read(type(f.__self__))
            self.value("self", f.__self__, f.__func__.__qualname__, only=only)
        if isinstance(f, functools.partial):
            for i, arg in enumerate((*f.args, *f.keywords.values())):
                self.value(f"argument {i}", arg, "a functools.partial")
            f = f.func
        f = inspect.unwrap(getattr(f, "__func__", f))  # Flax wraps module methods: the code within
        if not isinstance(f, types.FunctionType) or not self._first(f):
            return
        where, (loads, pairs, stores, _) = f.__qualname__, _reads(f.__code__)
        for name in loads:
            if name in f.__globals__:  # an object read as cfg.beta: what the code reads of it
                only = frozenset(a for g, a in pairs if g == name) or None
                self.value(name, f.__globals__[name], where, only=only)
        for name, attr in pairs:
            module = f.__globals__.get(name)
            if isinstance(module, types.ModuleType) and not _theirs(module):
                try:  # (a module's own __getattr__ may raise anything: the code reads it too)
                    self.value(f"{name}.{attr}", getattr(module, attr), where)
                except Exception:
                    continue
        for i, default in enumerate((*(f.__defaults__ or ()), *(f.__kwdefaults__ or {}).values())):
            self.value(f"default {i}", default, where)
        for name, cell in zip(f.__code__.co_freevars, f.__closure__ or (), strict=True):
            if name not in stores:
                try:
                    self.value(name, cell.cell_contents, where)
                except ValueError:  # a cell not yet filled
                    continue

    def cls(self, c: type) -> None:
        """A user's class: its methods' code, and its class attributes (``scale = 1.0``)."""
        if not self._first(c):
            return
        for k in c.__mro__:
            if _theirs(k):
                continue
            for name, attr in list(vars(k).items()):
                if name.startswith("__") and name != "__call__":
                    continue  # (dunders a dataclass or a metaclass made)
                attr = getattr(attr, "wrapped", attr)  # Flax wraps a module's descriptors
                attr = attr.fget if isinstance(attr, property) else attr
                self.value(f"{k.__qualname__}.{name}", attr, k.__qualname__)

    def value(
        self, name: str, v: Any, where: str, depth: int = 0, only: frozenset | None = None
    ) -> None:
        """``only``: the attributes of an object that the code reads (None: all it holds)."""
        label = f"{name!r} (read by {where})"
        if isinstance(v, types.ModuleType | jax.core.Tracer):
            return  # a module's globals are its own; a traced value is the caller's trace's
        if _scalar(v):
            self.found.append((label, typed(v)))
        elif isinstance(v, np.ndarray) and v.size <= _SMALL_ARRAY:  # (mutable in place)
            self.found.append((label, (v.shape, str(v.dtype), v.tobytes())))
        elif isinstance(v, jax.Array | np.ndarray):
            self.found.append((label, ("array", id(v), np.shape(v), str(v.dtype))))
        elif isinstance(v, type):
            self.found.append((label, _key(v)))
            self.cls(v)
        elif isinstance(v, _FUNCTIONS):
            self.found.append((label, _key(inspect.unwrap(getattr(v, "__func__", v)))))
            self.function(v)
        else:
            if isinstance(v, nn.Module | nnx.Module) or (callable(v) and not _theirs(type(v))):
                self.cls(type(v))  # its code (a callable object's __call__), and what it uses
                only = _attributes_read(type(v)) if only is None else only
            self.fields(name, v, where, depth, only)

    def fields(self, name: str, v: Any, where: str, depth: int, only: frozenset | None) -> None:
        """What a config, a container, a module's fields or a user object holds."""
        held = _held(v)
        if held is None or depth >= _MAX_DEPTH or id(v) in self.seen:
            return
        self.seen.add(id(v))
        if only is not None:
            held = {k: held[k] for k in only if k in held}
        if len(held) > _MAX_ITEMS:
            self.found.append((f"{name!r} (read by {where})", ("id", id(v), len(held))))
            return
        for k, x in list(held.items()):
            if isinstance(k, int) or (isinstance(k, str) and not k.startswith("_")):
                part = f"{name}.{k}" if isinstance(k, str) else f"{name}[{k}]"
                self.value(part, x, where, depth + 1)


def outside_values(*roots: Any) -> tuple[tuple[str, Hashable], ...]:
    """What the user code reachable from ``roots`` (functions, classes, modules, callable
    objects) reads from outside its arguments, as ``(where, value)`` pairs for a program's key."""
    walk = _Walk()
    for root in roots:
        if root is not None and not isinstance(root, str):
            walk.value("fn", root, "the call")
    return tuple(walk.found)


class OutsideValues:
    """Keys programs by :func:`outside_values` and warns, once, when one changed: each new
    value compiles a program of its own."""

    def __init__(self, call: str) -> None:
        self.call = call
        self.last: dict[tuple[int, ...], tuple[tuple[str, Hashable], ...]] = {}
        self.warned = False

    def __call__(self, *roots: Any) -> tuple[tuple[str, Hashable], ...]:
        values = outside_values(*roots)
        if self.warned:
            return values
        same_roots = tuple(map(id, roots))  # (another method= is no change of a value)
        last = self.last.get(same_roots)
        if len(self.last) >= _REMEMBERED:
            self.last.clear()
        self.last[same_roots] = values
        if last is None or last == values:
            return values
        before = set(last)
        changed = [k for k, v in values if (k, v) not in before]
        if changed:
            self.warned = True
            warn_user(
                f"{self.call} compiled anew: {changed[0]} changed since its last call. A "
                "compiled program keeps what its code read from outside its arguments, so "
                "each new value compiles once; pass a value that changes between calls as an "
                "argument (an array is traced and compiles once).",
            )
        return values
