"""Values a model or a function reads from outside its arguments, as part of a program's key.

A compiled program keeps what its Python code read while it was traced: a temperature that a
``method=`` function closes over, a module-level constant read in ``__call__``, a field of a
global config. ``model.apply`` reads them anew on every call; an ensemble's call compiles once,
and kept the first values without a word after they changed. So the values such code reads
(closure cells and the globals its code names: numbers, strings, arrays by identity, functions
and classes by identity, the scalar fields of config-like objects and dicts) are part of the
program's key: a changed one compiles anew, once per value, and the first such compile warns,
naming the value and how to pass it instead. The code walked is the user's: functions and
classes of the JAX stack and the standard library are not (their globals are theirs).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import itertools
import sys
import types
from collections.abc import Hashable, Iterable
from typing import Any

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
_MAX_FIELDS = 64  # of one config-like object: beyond that it is no config


def _theirs(obj: Any) -> bool:
    """A library's function or class (its globals are the library's, not the user's). A
    function's globals say where its code is (``__module__`` is copied by functools.wraps)."""
    module = getattr(obj, "__globals__", {}).get("__name__") or getattr(obj, "__module__", None)
    return (module or "").split(".")[0] in _LIBRARIES


def _scalar(v: Any) -> bool:
    return v is None or isinstance(v, bool | int | float | complex | str | bytes | np.generic)


@functools.lru_cache(maxsize=4096)
def _names(code: types.CodeType) -> tuple[str, ...]:
    """The names a function's code reads as globals (or attributes), its nested code
    (comprehensions, inner functions) too; once per code object: a call walks them each time."""
    nested = (_names(c) for c in code.co_consts if isinstance(c, types.CodeType))
    return tuple(dict.fromkeys(itertools.chain(code.co_names, *nested)))


@functools.lru_cache(maxsize=1024)
def _methods(c: type) -> tuple[Any, ...]:
    """The functions a user's class defines (not those of a library's classes it extends)."""
    found = []
    for k in c.__mro__:
        if not _theirs(k):
            for name, attr in vars(k).items():
                if name == "__call__" or not name.startswith("__"):  # (dataclass-made dunders)
                    found.append(attr.fget if isinstance(attr, property) else attr)
    return tuple(found)


def _fields(v: Any) -> dict[str, Any] | None:
    """A config-like object's scalar fields (a dataclass, a namespace, a dict), else None."""
    if isinstance(v, dict):
        items = v
    elif isinstance(v, argparse.Namespace | types.SimpleNamespace) or (
        dataclasses.is_dataclass(v) and not isinstance(v, type | nn.Module)
    ):
        items = vars(v)
    else:
        return None
    if len(items) > _MAX_FIELDS:
        return None
    return {k: x for k, x in items.items() if isinstance(k, str) and _scalar(x)}


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
        if isinstance(f, types.MethodType):
            self.value("self", f.__self__, f.__func__.__qualname__)
            f = f.__func__
        if isinstance(f, staticmethod | classmethod):
            f = f.__func__
        f = inspect.unwrap(f)  # a decorator's wrapper (Flax wraps module methods): the code within
        if not isinstance(f, types.FunctionType) or not self._first(f):
            return
        where = f.__qualname__
        names = _names(f.__code__)
        for name in names:
            if name in f.__globals__:
                self.value(name, f.__globals__[name], where)
                self.module_fields(name, f.__globals__[name], names, where)
        for name, cell in zip(f.__code__.co_freevars, f.__closure__ or (), strict=True):
            try:
                self.value(name, cell.cell_contents, where)
            except ValueError:  # a cell not yet filled
                continue

    def module_fields(self, name: str, v: Any, names: Iterable[str], where: str) -> None:
        """A user's module read as ``config.beta``: the scalars of it the code names."""
        if isinstance(v, types.ModuleType) and v.__name__.split(".")[0] not in _LIBRARIES:
            for field in names:
                x = getattr(v, field, None)
                if _scalar(x) and x is not None:
                    self.found.append((f"{name}.{field} (read by {where})", typed(x)))

    def attributes(self, obj: Any) -> None:
        """What a user's callable object holds (its ``self.w``), read by its ``__call__``."""
        held = getattr(obj, "__dict__", None)
        if isinstance(held, dict) and not _theirs(type(obj)) and len(held) <= _MAX_FIELDS:
            for name, v in held.items():
                self.value(f"self.{name}", v, type(obj).__qualname__)

    def cls(self, c: type) -> None:
        if self._first(c):
            for method in _methods(c):
                self.function(method)

    def value(self, name: str, v: Any, where: str) -> None:
        label = f"{name!r} (read by {where})"
        if isinstance(v, types.ModuleType | jax.core.Tracer):
            return  # a module's globals are its own; a traced value is the caller's trace's
        if _scalar(v):
            self.found.append((label, typed(v)))
        elif isinstance(v, jax.Array | np.ndarray):
            self.found.append((label, ("array", id(v), np.shape(v), str(v.dtype))))
        elif isinstance(v, type):
            self.found.append((label, v))
            self.cls(v)
        elif isinstance(v, types.FunctionType | types.MethodType | staticmethod | classmethod):
            self.found.append((label, getattr(v, "__func__", v)))
            self.function(v)
        elif isinstance(v, nn.Module | nnx.Module):
            self.cls(type(v))
        elif (fields := _fields(v)) is not None:
            self.found.append((label, typed(fields)))


def outside_values(*roots: Any) -> tuple[tuple[str, Hashable], ...]:
    """What the user code reachable from ``roots`` (functions, classes, modules) reads from
    outside its arguments, as ``(where, value)`` pairs for a program's key."""
    walk = _Walk()
    for root in roots:
        if isinstance(root, type):
            walk.cls(root)
        elif isinstance(root, nn.Module | nnx.Module):
            walk.cls(type(root))
        elif isinstance(root, functools.partial):
            walk.function(root.func)
            for i, arg in enumerate((*root.args, *root.keywords.values())):
                walk.value(f"argument {i}", arg, "a functools.partial")
        elif isinstance(root, types.MethodType | types.FunctionType):
            if isinstance(root, types.MethodType):
                walk.attributes(root.__self__)
            walk.function(root)
        elif callable(root):  # an object with __call__: its code, and what it holds (self.w)
            walk.attributes(root)
            walk.cls(type(root))
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
        if len(self.last) >= _MAX_FIELDS:
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
