"""Values a model or a function reads from outside its arguments, as part of a program's key.

A compiled program keeps what its Python code read while it was traced: a temperature that a
``method=`` function closes over, a module-level constant read in ``__call__``, a field of a
global config. ``model.apply`` reads them anew on every call; an ensemble's call compiled once
and kept the first values without a word after they changed. So what such code reads is part
of the program's key, and a changed value compiles anew, once per value; the first such compile
warns, naming the value and how to pass it instead.

What is read is found from the bytecode of the user's code reachable from the call (the model's
classes, the ``method=`` function, the loss, what they name): the globals it loads and the
chains it reads of them (``cfg.beta``, ``myproj.config.BETA``, ``SETTINGS['model']['scale']``),
its closure cells and defaults, the ``self.x`` its classes' methods and properties read, their
class attributes. Of an object, only what the code reads of it; of a container, mapping,
dataclass or namespace read whole, all it holds. Numbers, strings and enum members by value,
NumPy arrays up to ``_CONTENT_ARRAY`` elements by content, larger ones, JAX arrays and
containers past a size by identity, functions and classes by identity (then their code too).
What the code writes itself (``global TRACES; TRACES += 1``, ``STATS['n'] += 1``,
``self.traces += 1``, ``SEEN.append(x)``) is a counter or a cache, not an input. A walk visits
at most ``_BUDGET`` values, breadth first; the code of installed packages and the standard
library is not walked (what the user's code reads of their objects is), and a value whose
reading raises is keyed by identity.
"""

from __future__ import annotations

import argparse
import collections
import collections.abc
import dataclasses
import dis
import enum
import functools
import hashlib
import inspect
import os
import sys
import types
import weakref
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
_MAX_DEPTH = 8  # containers within containers
_FUNCTION_DEPTH = 100  # functions calling functions (a deeper chain is walked this far)
_BUDGET = 2048  # values one walk visits: past it, what is left is keyed by identity
_CONTENT_ARRAY = 1 << 16  # NumPy arrays up to this many elements are keyed by content
_MODULE_FIELDS = frozenset({"name", "parent", "scope"})  # a linen module's own
_MISSING = object()
_FUNCTIONS = types.FunctionType | types.MethodType | functools.partial | staticmethod | classmethod
Only = dict  # what the code reads of a value: {attribute or key: the paths read beyond it}
_GLOBAL_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})
_FIRST_LOADS = frozenset({"LOAD_FAST", "LOAD_DEREF"})
_ATTRIBUTE_LOADS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})
_STORES = frozenset({"STORE_GLOBAL", "DELETE_GLOBAL", "STORE_DEREF", "DELETE_DEREF"})
_WRITES = frozenset({"STORE_SUBSCR", "DELETE_SUBSCR", "STORE_ATTR", "DELETE_ATTR"})
# Methods that change a list, dict or set in place: what the code calls them on is its own.
_MUTATORS = frozenset(
    {"append", "extend", "insert", "pop", "remove", "clear", "update", "setdefault", "add",
     "discard", "popitem", "sort", "reverse", "appendleft", "extendleft", "popleft"}
)  # fmt: skip


@functools.lru_cache(maxsize=1024)
def _installed(top: str) -> bool:
    """Whether the top-level module ``top`` is a library's: the JAX stack, the standard
    library, or any installed package (in site-packages; a project installed in editable mode,
    or a script, a notebook's ``__main__``, is the user's)."""
    if top in _LIBRARIES or top in sys.builtin_module_names:
        return True
    module = sys.modules.get(top)
    where = getattr(module, "__file__", None) or next(iter(getattr(module, "__path__", [])), "")
    parts = os.path.normpath(str(where)).split(os.sep)
    return "site-packages" in parts or "dist-packages" in parts


def _theirs(obj: Any) -> bool:
    """A library's function, class or module (its globals are the library's, not the
    user's). A function's globals say where its code is (functools.wraps copies
    ``__module__``)."""
    if isinstance(obj, types.ModuleType):
        module = obj.__name__
    else:
        found = getattr(obj, "__globals__", None)
        if isinstance(found, dict) and not isinstance(found.get("__name__"), str):
            return False  # code made by exec(source, namespace): the user's
        module = found.get("__name__") if isinstance(found, dict) else None
        module = module or getattr(obj, "__module__", None)
    if not isinstance(module, str) or module == "__main__":
        return not isinstance(module, str) and not isinstance(obj, type)  # no module: a builtin
    return _installed(module.split(".")[0])


class _Identity:
    """A key for an object by identity that never matches a later object at the same address
    (a freed array's): it holds a weak reference where the object takes one."""

    __slots__ = ("address", "ref")

    def __init__(self, obj: Any) -> None:
        self.address = id(obj)
        try:
            self.ref: Any = weakref.ref(obj)
        except TypeError:  # (a list, a dict: their identity and length only)
            self.ref = None

    def __hash__(self) -> int:
        return self.address

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Identity) or other.address != self.address:
            return False
        return self.ref is None or (self.ref() is not None and self.ref() is other.ref())


def _scalar(v: Any) -> bool:
    return v is None or (
        isinstance(v, bool | int | float | complex | str | bytes | np.generic | enum.Enum)
        and not isinstance(v, np.void)  # (a structured record: a container)
    )


def _get(obj: Any, name: str, default: Any = None) -> Any:
    """``getattr`` that takes any error for absence: a user's ``__getattr__`` may raise
    KeyError (an attribute dict) or anything else."""
    try:
        return getattr(obj, name, default)
    except Exception:
        return default


def _has(cls: type, name: Any) -> bool:
    """Whether a class (not an instance: no ``__getattr__`` runs) defines ``name``."""
    return isinstance(name, str) and any(name in vars(k) for k in cls.__mro__)


class _Reads(NamedTuple):
    loads: tuple[str, ...]  # globals loaded
    chains: tuple[tuple[Any, ...], ...]  # read of globals: cfg.beta, CFG['model'] as ('model',)
    stores: frozenset[str]  # globals and cells the code assigns or writes into
    own: frozenset[str]  # attributes read of the first argument: ``self.scale``
    bare: frozenset[str]  # globals used as they are (passed on, iterated), not only read into


def _statement(code: types.CodeType) -> Any:
    """The code's instructions, one statement (line) at a time."""
    line: list[dis.Instruction] = []
    for ins in dis.get_instructions(code):
        if ins.starts_line is not None and line:
            yield line
            line = []
        line.append(ins)
    if line:
        yield line


def _step_back(line: list[dis.Instruction], i: int) -> tuple[Any, int] | None:
    """The chain element ``line[i]`` reads (an attribute, or a constant subscript as a
    1-tuple) and the index before it; None where no chain goes on."""
    if 0 <= i < len(line) and line[i].opname in _ATTRIBUTE_LOADS:
        return line[i].argval, i - 1
    if i >= 1 and line[i].opname == "BINARY_SUBSCR" and line[i - 1].opname == "LOAD_CONST":
        return (line[i - 1].argval,), i - 2
    return None


def _goes_on(line: list[dis.Instruction], i: int) -> bool:
    """Whether the chain at ``line[i]`` goes on with the next element (``.a`` or ``['k']``)."""
    if i + 1 < len(line) and line[i + 1].opname in _ATTRIBUTE_LOADS:
        return True
    return (
        i + 2 < len(line)
        and line[i + 1].opname == "LOAD_CONST"
        and line[i + 2].opname == "BINARY_SUBSCR"
    )


def _root(line: list[dis.Instruction], i: int) -> tuple[bool, tuple[Any, ...]]:
    """The load chain ending at ``line[i]`` (``('G', 'a')`` for ``G.a``, ``('self', 'x')``,
    ``('G', ('k',))`` for ``G['k']``), and whether it starts at a global."""
    chain = []
    while (step := _step_back(line, i)) is not None:
        chain.append(step[0])
        i = step[1]
    if i < 0 or line[i].opname not in _GLOBAL_LOADS | _FIRST_LOADS:
        return False, ()
    return line[i].opname in _GLOBAL_LOADS, (line[i].argval, *reversed(chain))


def _written(line: list[dis.Instruction], first: set[str]) -> set[str]:
    """What a statement writes into: ``G`` for ``G['n'] += 1`` or ``G.x = 0``, ``self.x`` for
    ``self.x += 1`` or ``self.cache[k] = v`` (a counter, a cache: the code's own, no input)."""
    written = set()
    for k, ins in enumerate(line):
        if ins.opname in _ATTRIBUTE_LOADS and ins.argval in _MUTATORS:  # TRACES.append(...)
            is_global, target = _root(line, k - 1)
            if target and target[0] in first and len(target) > 1:
                written.add(f"self.{target[1]}")
            elif target:
                written.add(target[0])  # a global's, a closure cell's
            continue
        if ins.opname not in _WRITES:
            continue
        augmented = k > 0 and line[k - 1].opname == "SWAP"  # G['n'] += 1: G loaded first
        at = 0 if augmented else k - (2 if "SUBSCR" in ins.opname else 1)
        is_global, target = _root(line, at)
        if target and ins.opname.endswith("ATTR"):
            target = (*target, ins.argval)
        if is_global:
            written.add(target[0])
        elif target and target[0] in first and len(target) > 1:
            written.add(f"self.{target[1]}")
    return written


@functools.lru_cache(maxsize=4096)
def _reads(code: types.CodeType) -> _Reads:
    """What a function's code reads from outside, from its bytecode (nested code, such as
    comprehensions and inner functions, included): so ``self.out`` is no read of a global
    ``out``. A global, cell or ``self`` attribute that the code assigns or writes into is left
    out. Once per code object."""
    loads, chains, stores, own, bare = [], [], set(), set(), set()
    first = {code.co_varnames[0], "self"} if code.co_argcount else {"self"}
    for line in _statement(code):
        stores |= _written(line, first)
        for i, ins in enumerate(line):
            if ins.opname in _GLOBAL_LOADS:
                loads.append(ins.argval)
                if not _goes_on(line, i):
                    bare.add(ins.argval)
            elif ins.opname in _STORES:
                stores.add(ins.argval)
            elif _step_back(line, i) is not None:
                is_global, chain = _root(line, i)
                if not is_global and chain and chain[0] in first and len(chain) == 2:
                    if isinstance(chain[1], str):
                        own.add(chain[1])
                elif is_global and not _goes_on(line, i):
                    chains.append(chain)  # the whole chain, read at its last element
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            nested = _reads(const)
            loads, chains = loads + list(nested.loads), chains + list(nested.chains)
            stores, own, bare = stores | nested.stores, own | nested.own, bare | nested.bare
    return _Reads(
        tuple(n for n in dict.fromkeys(loads) if n not in stores),
        tuple(c for c in dict.fromkeys(chains) if c[0] not in stores),
        frozenset(stores),
        frozenset(a for a in own if f"self.{a}" not in stores),
        frozenset(bare),
    )


def _stamp(c: type) -> tuple:
    """What a class holds, by identity: a method replaced on the class is another stamp (the
    caches below keep the old objects alive, so their addresses are not reused meanwhile)."""
    return tuple(tuple(map(id, vars(k).values())) for k in c.__mro__)


def _per_class(fn: Any) -> Any:
    """``fn(c, *args, stamp)`` cached per class, its ``args`` and :func:`_stamp`, called as
    ``fn(c, *args)``; a class its metaclass made unhashable is not cached."""
    cached = functools.lru_cache(maxsize=1024)(fn)

    @functools.wraps(fn)
    def call(c: type, *args: Any) -> Any:
        try:
            return cached(c, *args, _stamp(c))
        except TypeError:
            return fn(c, *args, ())

    return call


@_per_class
def _members(c: type, stamp: tuple) -> list[tuple[str, Any]]:
    """A user's class's own attributes (not those of a library's classes it extends), without
    the dunders a dataclass or a metaclass made; descriptors Flax wraps unwrapped."""
    found = []
    fields = {f.name for f in dataclasses.fields(c)} if dataclasses.is_dataclass(c) else set()
    for k in c.__mro__:
        if not _theirs(k):
            for name, attr in list(vars(k).items())[:_MAX_ITEMS]:
                attr = _get(attr, "wrapped", attr)
                if name.startswith("_") and not (callable(attr) or isinstance(attr, property)):
                    continue  # a private cache, or what Flax keeps on a module's class
                if (
                    name.startswith("__") and name != "__call__"
                ) or name in _MODULE_FIELDS | fields:
                    continue  # (dunders a dataclass or a metaclass made)
                found.append((f"{k.__qualname__}.{name}", attr))
    return found


def _code_of(attr: Any) -> Any:
    """The function behind a method, property, staticmethod or decorated function."""
    f = _get(attr, "fget") or _get(attr, "__func__", attr)
    return inspect.unwrap(f) if callable(f) else f


def _content(a: np.ndarray) -> Hashable:
    """A NumPy array by content: its bytes when small, else a 128-bit digest of them (a
    256 KB float32 array: about 0.2 ms). An array read anew each call (an ``np.load``'s
    ``npz['mean']``, a DataFrame's ``.values``) is then the same key while it holds the same."""
    if isinstance(a, np.ma.MaskedArray):  # its mask too
        return _content(np.ma.getdata(a)), _content(np.ma.getmaskarray(a))
    if a.dtype.hasobject:  # (object fields: their references, the other fields' bytes)
        data: Any = a.tobytes()
    else:
        data = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    if a.size <= 1024 or a.dtype.hasobject:
        return a.shape, str(a.dtype), bytes(data)
    return a.shape, str(a.dtype), hashlib.blake2b(data, digest_size=16).digest()


def _key(obj: Any) -> Hashable:
    """``obj`` itself where it is hashable (a function, a class), else its identity."""
    try:
        hash(obj)
    except Exception:
        return _Identity(obj)
    return obj


def _held(v: Any) -> dict[Any, Any] | None:
    """What a value holds: a container's items, a dataclass's fields (a linen module's too), a
    namespace's or a user object's attributes, slots included (not a library's objects)."""
    if isinstance(v, dict):
        return v
    if isinstance(v, collections.abc.Mapping):  # a UserDict, a MappingProxyType
        return dict(v.items()) if len(v) <= _MAX_ITEMS else {}
    if isinstance(v, list | tuple | set | frozenset):
        return dict(enumerate(v)) if len(v) <= _MAX_ITEMS else {}
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        names = (f.name for f in dataclasses.fields(v) if f.name not in ("parent", "name"))
        return {k: _get(v, k) for k in names}
    if not isinstance(v, argparse.Namespace | types.SimpleNamespace) and _theirs(type(v)):
        return None
    found = _get(v, "__dict__")
    held = dict(found) if isinstance(found, dict) else {}
    for k in type(v).__mro__:
        for slot in _get(k, "__slots__", ()) or ():
            if isinstance(slot, str) and (x := _get(v, slot, _MISSING)) is not _MISSING:
                held[slot] = x
    return held


def _paths(paths: Any) -> Only | None:
    """``{first element: the rest of each path}`` of read paths, None where one reads the
    value whole (an empty path). An element is an attribute's name, or a subscript's key as a
    1-tuple (``G['k']``: ``('k',)``)."""
    if not paths or any(len(p) == 0 for p in paths):
        return None
    grouped: Only = {}
    for p in paths:
        grouped.setdefault(p[0], []).append(p[1:])
    return grouped


def _element(v: Any, e: Any) -> Any:
    """What ``v.e`` (``e`` a name) or ``v[k]`` (``e == (k,)``) reads, as the code reads it;
    _MISSING where it reads nothing the walk can see."""
    key = e[0] if isinstance(e, tuple) else e
    if isinstance(v, list | tuple):
        return v[key] if isinstance(key, int) and -len(v) <= key < len(v) else _MISSING
    if isinstance(v, collections.abc.Mapping):  # (an attribute dict's cfg.beta too)
        if _in(v, key):
            return v[key]
        attributes = _get(v, "__dict__")  # a dict subclass's own attribute (S.scale)
        if isinstance(e, str) and isinstance(attributes, dict) and e in attributes:
            return attributes[e]
        return _MISSING if isinstance(e, tuple) else _dynamic(v, e)
    if isinstance(e, tuple):
        return _MISSING
    held = _held(v)
    return held[e] if held is not None and e in held else _dynamic(v, e)


def _label(name: str, e: Any) -> str:
    return f"{name}[{e[0]!r}]" if isinstance(e, tuple) else f"{name}.{e}"


def _in(mapping: Any, key: Any) -> bool:
    try:
        return key in mapping
    except Exception:  # (an unhashable key)
        return False


def _dynamic(v: Any, name: str) -> Any:
    """An attribute that only ``__getattr__`` makes (a ConfigDict's field), else _MISSING (a
    method or property: its code is walked instead)."""
    if _has(type(v), name) or not _has(type(v), "__getattr__"):
        return _MISSING
    try:
        return getattr(v, name)
    except Exception:
        return _MISSING


@_per_class
def _used(c: type, names: frozenset | None, stamp: tuple) -> frozenset[str]:
    """The ``self.x`` an instance's code uses: what the methods and properties named in
    ``names`` (all of them: None) read of ``self``, and what the ones they call read."""
    members = {q.rsplit(".", 1)[-1]: _code_of(a) for q, a in _members(c)}
    todo, done, read = set(members if names is None else names), set(), set()
    while todo:
        name = todo.pop()
        done.add(name)
        f = members.get(name)
        if isinstance(f, types.FunctionType):
            own = _reads(f.__code__).own
            read |= own
            todo |= (own & members.keys()) - done
    return frozenset(read | (names or frozenset()))


class _Walk:
    """Collects ``(where, value)`` for what user code reachable from the roots reads."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.found: list[tuple[str, str, Hashable]] = []  # (name, read by, value)
        self.left = _BUDGET
        self.depth = 0
        self.pending: collections.deque = collections.deque()  # containers still to open

    def _first(self, obj: Any) -> bool:
        if id(obj) in self.seen or _theirs(obj):
            return False
        self.seen.add(id(obj))
        return True

    def function(self, f: Any) -> None:
        if isinstance(f, types.MethodType):  # what its code uses of self: not all it holds
            only = {n: [()] for n in _used(type(f.__self__), frozenset({f.__func__.__name__}))}
            self.value("self", f.__self__, f.__func__.__qualname__, only=only)
        if isinstance(f, functools.partial):
            for i, arg in enumerate((*f.args, *f.keywords.values())):
                self.value(f"argument {i}", arg, "a functools.partial")
            f = f.func
        f = _code_of(f)  # Flax wraps module methods: the code within
        if not isinstance(f, types.FunctionType) or not self._first(f):
            return
        if self.depth >= _FUNCTION_DEPTH:
            return
        self.depth += 1
        try:
            self._read_by(f)
        finally:
            self.depth -= 1

    def _read_by(self, f: types.FunctionType) -> None:
        where, reads = f.__qualname__, _reads(f.__code__)
        for name in reads.loads:
            if name not in f.__globals__:
                continue
            v, paths = f.__globals__[name], [c[1:] for c in reads.chains if c[0] == name]
            if isinstance(v, types.ModuleType):
                for path in paths:
                    self.module_path(name, v, path, where)
            else:  # an object read as cfg.beta or CFG['beta']: what the code reads of it
                self.value(name, v, where, only=None if name in reads.bare else _paths(paths))
        defaults = (*(f.__defaults__ or ()), *(f.__kwdefaults__ or {}).values())
        for i, default in enumerate(defaults):
            self.value(f"default {i}", default, where)
        for name, cell in zip(f.__code__.co_freevars, f.__closure__ or (), strict=True):
            if name not in reads.stores:
                try:
                    self.value(name, cell.cell_contents, where)
                except ValueError:  # a cell not yet filled
                    continue

    def module_path(self, name: str, v: Any, path: tuple[str, ...], where: str) -> None:
        """``myproj.config.BETA`` read of a user's module: the value at the path's end."""
        for i, attr in enumerate(path):
            if not isinstance(v, types.ModuleType) or _theirs(v) or not isinstance(attr, str):
                return
            try:  # (a module's own __getattr__ may raise anything: the code reads it too)
                v = getattr(v, attr)
            except Exception:
                return
            name = f"{name}.{attr}"
            if not isinstance(v, types.ModuleType):
                return self.value(name, v, where, only=_paths([path[i + 1 :]]))

    def cls(self, c: type) -> None:
        """A user's class: its methods' code, and its class attributes (``scale = 1.0``)."""
        if not self._first(c) or self.depth >= _FUNCTION_DEPTH:
            return
        self.depth += 1  # (classes naming classes: as deep as functions calling functions)
        try:
            for qualname, attr in _members(c):
                f = _code_of(attr)
                v = f if isinstance(f, types.FunctionType) else attr
                self.value(qualname, v, c.__qualname__)
        finally:
            self.depth -= 1

    def value(
        self, name: str, v: Any, where: str, depth: int = 0, only: Only | None = None
    ) -> None:
        """``only``: what the code reads of it (:func:`_paths`; None: all it holds). A value
        the walk cannot read (its attribute access raises) is keyed by identity."""
        try:
            self._value(name, v, where, depth, only)
        except Exception:
            self.found.append((name, where, _Identity(v)))

    def _value(self, name: str, v: Any, where: str, depth: int, only: Only | None) -> None:
        if isinstance(v, types.ModuleType | jax.core.Tracer):
            return  # a module's globals are its own; a traced value is the caller's trace's
        self.left -= 1
        if self.left < 0:
            self.found.append((name, where, _Identity(v)))
        elif _scalar(v):
            self.found.append((name, where, _key(typed(v))))
        elif isinstance(v, np.ndarray) and v.size <= _CONTENT_ARRAY:  # (mutable in place)
            self.found.append((name, where, _content(v)))
        elif isinstance(v, jax.Array | np.ndarray):
            self.found.append((name, where, (_Identity(v), np.shape(v), str(v.dtype))))
        elif isinstance(v, type):
            self.found.append((name, where, _key(v)))
            self.cls(v)
        elif isinstance(v, _FUNCTIONS):
            self.found.append((name, where, _key(_code_of(v))))
            self.function(v)
        elif callable(v) and isinstance(_get(v, "__wrapped__"), _FUNCTIONS):
            self.found.append((name, where, _key(v)))  # jax.custom_jvp, jax.jit, a decorator's
            self.function(v.__wrapped__)
        else:
            self.instance(name, v, where, depth, only)

    def instance(self, name: str, v: Any, where: str, depth: int, only: Only | None) -> None:
        """A module, a user's object, a config or a container: its code and what it holds."""
        mine = isinstance(v, nn.Module | nnx.Module) or not _theirs(type(v))
        if mine and not isinstance(v, dict | list | tuple | set | frozenset):
            self.cls(type(v))  # its code (methods, properties), and of it what they read
            if only is not None:  # (what the methods and properties it names read: whole)
                only = {n: [()] for n in _used(type(v), frozenset(only))} | only
            elif isinstance(v, nn.Module | nnx.Module) or callable(v):
                only = {n: [()] for n in _used(type(v), None)}
        elif not mine and _held(v) is None:  # an installed package's object: its code is not
            self.found.append((name, where, _Identity(v)))  # walked; what the code reads of
            for e, rest in (only or {}).items():  # it is (MLC.model.beta)
                if isinstance(e, str):
                    x = _get(v, e, _MISSING)
                elif isinstance(v, collections.abc.Mapping) and _in(v, e[0]):
                    x = v[e[0]]
                else:  # (a DataFrame's df['a']: the frame is keyed, by identity)
                    continue
                if x is not _MISSING and not callable(x):
                    self.value(_label(name, e), x, where, depth + 1, _paths(rest))
            return
        # Containers are opened breadth first: a big table read first does not use up the
        # budget before cfg.beta, read after it, is seen.
        self.pending.append((name, v, where, depth, only))

    def fields(self, name: str, v: Any, where: str, depth: int, only: Only | None) -> None:
        """What a config, a container, a module's fields or a user object holds: all of it,
        or what the code reads of it (``only``)."""
        if depth >= _MAX_DEPTH or id(v) in self.seen:
            return
        self.seen.add(id(v))
        if isinstance(v, dict | list | tuple | collections.abc.Mapping) and any(
            _has(type(v), e) for e in only or ()
        ):
            only = None  # CFG.get('beta'), CFG.items(): what it holds is read
        elif not isinstance(v, list | tuple | collections.abc.Mapping) and any(
            isinstance(e, tuple) for e in only or ()
        ):
            only = None  # TABLE['k'] of a user's class: its __getitem__ reads what it holds
        if only is None:
            held = _held(v)
            if held is None:
                return
            items = [
                (f"{name}.{k}" if isinstance(k, str) else f"{name}[{k!r}]", x, None)
                for k, x in held.items()
                if not (isinstance(k, str) and k.startswith("__"))
            ]
        else:
            items = [(_label(name, e), _element(v, e), _paths(rest)) for e, rest in only.items()]
            items = [item for item in items if item[1] is not _MISSING]
        if len(items) > min(_MAX_ITEMS, self.left) or (
            only is None and isinstance(v, list | tuple | collections.abc.Mapping) and not items
        ):  # (a long list or mapping: by identity)
            self.found.append((name, where, (_Identity(v), len(items))))
            return
        for label, x, inner in items:
            self.value(label, x, where, depth + 1, inner)


def outside_values(*roots: Any) -> tuple[tuple[str, str, Hashable], ...]:
    """What the user code reachable from ``roots`` (functions, classes, modules, callable
    objects) reads from outside its arguments, as ``(name, read by, value)`` for a program's
    key."""
    walk = _Walk()
    for root in roots:
        if isinstance(root, type | _FUNCTIONS):
            walk.value("fn", root, "the call")
        elif root is not None and not isinstance(root, str):  # a module, a callable object
            walk.value("self", root, type(root).__qualname__)
    while walk.pending:
        name, v, where, depth, only = walk.pending.popleft()
        try:
            walk.fields(name, v, where, depth, only)
        except Exception:  # (as in _Walk.value)
            walk.found.append((name, where, _Identity(v)))
    return tuple(walk.found)


class OutsideValues:
    """Keys programs by :func:`outside_values` and warns, once, when one changed: each new
    value compiles a program of its own."""

    def __init__(self, call: str) -> None:
        self.call = call
        self.last: dict[tuple[int, ...], tuple[tuple[str, str, Hashable], ...]] = {}
        self.warned = False

    def __call__(self, *roots: Any) -> tuple[tuple[str, str, Hashable], ...]:
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
        changed = [f"{name!r} (read by {where})" for name, where, v in values
                   if (name, where, v) not in before]  # fmt: skip
        if changed:
            self.warned = True
            warn_user(
                f"{self.call} compiled anew: {changed[0]} changed since its last call. A "
                "compiled program keeps what its code read from outside its arguments, so "
                "each new value compiles once; pass a value that changes between calls as an "
                "argument (an array is traced and compiles once).",
            )
        return values
