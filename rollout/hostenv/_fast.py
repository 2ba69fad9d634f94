"""The host-env step without Python, where it can be built: an XLA FFI handler (``_fast.cc``).

Each host-env step through ``host_call`` costs the learner process about 180 us of CPU per
device: JAX's callback machinery, our Python, and the devices' callback threads taking turns
on the interpreter lock. On a machine whose cores also step the envs, that time is the envs'.
``_fast.cc`` makes the plain step (actions into shared memory, one 16-byte message to each
worker and one back, results out of shared memory) on XLA's own thread without entering
Python, and hands anything else to the Python step (``HostEnvs._host_step``), which stays the
reference: a restart, an error, a dead or slow worker.

It is compiled at first use with the C++ compiler (``$CXX``, else ``c++``) against the FFI
headers that ship with jaxlib, and cached under ``$XDG_CACHE_HOME/sharded-ensembles`` (default
``~/.cache``). Without a compiler, or with ``ROLLOUT_HOSTENV_FFI=0``, every step goes through
Python: the same results, slower (``why_not()`` says why).

A group's state (live session, step due, request sequence number, worker sockets, shared
array addresses) is a block of int64s, ``Control``, that both sides read and write under the
block's own lock; its layout is the ``C_*`` constants here and ``enum Ctl`` in ``_fast.cc``.
Blocks are never freed, and a compiled program names its group by a slot number, not an
address, so a program outliving its envs finds an unarmed block and falls back to Python.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

# The block's fields, as enum Ctl in _fast.cc.
(C_LOCK, C_ARMED, C_OWNER, C_SESSION, C_T, C_SEQ, C_PENDING, C_FAST_STEPS, C_NWORKERS,
 C_WAIT_NS, C_START_NS, C_ACTION, C_ACTION_BYTES, C_OBS, C_OBS_BYTES, C_REWARD, C_TERM,
 C_TRUNC, C_FINAL, C_ROWS) = range(20)  # fmt: skip
C_FDS, MAX_WORKERS, SLOTS = 32, 63, 1 << 16
OK, NOT_SENT, PENDING = 0, 1, 2  # the handler's status
PYTHON_HOLDS = 2  # the block's lock word while Python holds it (1: the handler)

_SOURCE = Path(__file__).with_name("_fast.cc")
_TARGET = "rollout_hostenv_step"
_state: dict[str, Any] = {}
_load_lock = threading.Lock()
_blocks: list[np.ndarray] = []  # every Control's block, kept for the life of the process


def library() -> ctypes.CDLL | None:
    """The built handler, registered with XLA (built and loaded once); None where it cannot be
    (``why_not()`` says why)."""
    with _load_lock:
        if "lib" not in _state:
            _state["lib"], _state["why"], _state["fix"] = _load()
        return _state["lib"]


def why_not() -> str | None:
    """Why the steps go through Python (None: they don't)."""
    library()
    return _state["why"]


def how_to_fix() -> str:
    """What would let the step be built, for the reason :func:`why_not` gives."""
    library()
    return _state["fix"]


class _CannotBuild(RuntimeError):
    """The library cannot be built here; ``fix`` says what would let it."""

    def __init__(self, why: str, fix: str) -> None:
        super().__init__(why)
        self.fix = fix


DISABLED = "ROLLOUT_HOSTENV_FFI=0"


def _load() -> tuple[ctypes.CDLL | None, str | None, str]:
    if os.environ.get("ROLLOUT_HOSTENV_FFI", "1") == "0":
        return None, DISABLED, ""
    try:
        lib = ctypes.CDLL(str(_build()))
    except _CannotBuild as e:
        return None, str(e), e.fix
    except OSError as e:  # the cache: not writable, or a library there this user cannot read
        fix = f"set $XDG_CACHE_HOME to a folder this user can write and read (not {_cache()})"
        return None, str(e), fix
    lib.hostenv_register.argtypes = [ctypes.c_int64, ctypes.c_void_p]
    lib.hostenv_lock.argtypes = lib.hostenv_unlock.argtypes = [ctypes.c_void_p]
    lib.hostenv_trylock.argtypes = [ctypes.c_void_p]
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.HostenvStep), platform="cpu")
    return lib, None, ""


def _cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "sharded-ensembles")


def _build() -> Path:
    """The compiled library in the cache, compiled first if it is not there (one process at a
    time: the others wait on a file lock, then load what it built)."""
    include = jax.ffi.include_dir()
    key = hashlib.sha256(_SOURCE.read_bytes())
    for header in sorted(Path(include, "xla", "ffi", "api").glob("*.h")):
        key.update(header.read_bytes())
    cache = _cache()
    target = cache / f"hostenv-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    compiler = shlex.split(os.environ.get("CXX") or "c++")  # may carry a launcher or flags
    if not compiler or shutil.which(compiler[0]) is None:
        why = f"no C++ compiler {compiler[:1]!r} on PATH to build {_SOURCE.name}"
        raise _CannotBuild(why, "install a C++ compiler (or set $CXX)")
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / "hostenv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        cmd = [*compiler, "-O2", "-std=c++17", "-shared", "-fPIC", f"-I{include}",
               str(_SOURCE), "-o", tmp]  # fmt: skip
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            os.unlink(tmp)
            why = f"building {_SOURCE.name} took over 300 s; gave up"
            raise _CannotBuild(why, "set $CXX to a faster C++ compiler") from None
        if done.returncode != 0:
            os.unlink(tmp)
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            why = f"building {_SOURCE.name} failed: {last}"
            raise _CannotBuild(why, "set $CXX to a C++17 compiler that builds it")
        os.chmod(tmp, 0o755)  # (mkstemp's 0o600: other users of a shared cache could not load it)
        os.replace(tmp, target)
    return target


class Control:
    """One group's block of state shared with the handler, and its lock (a context manager,
    as ``threading.Lock``): a thread lock among Python threads, then the block's own lock,
    which the handler takes too (ctypes lets go of the interpreter lock while it waits)."""

    def __init__(self) -> None:
        self.block = np.zeros(C_FDS + MAX_WORKERS, np.int64)
        _blocks.append(self.block)
        self._threads = threading.Lock()
        self._address = self.block.ctypes.data
        self._lib: ctypes.CDLL | None = None  # set once registered: only then is it shared

    def __enter__(self) -> Control:
        self._threads.acquire()
        try:
            if self._lib is not None:
                self._take_block()
        except BaseException:  # Ctrl-C while waiting: leave both locks as they were
            if self._lib is not None and self[C_LOCK] == PYTHON_HOLDS:
                self._lib.hostenv_unlock(self._address)
            self._threads.release()
            raise
        return self

    def _take_block(self) -> None:
        # The handler may hold the block for a whole slow step. Waiting inside the C library
        # could not be interrupted, and a Ctrl-C raised just after that wait would leave the
        # lock taken for good: wait here, in sleeps that Ctrl-C ends.
        pause = 0.0
        while not self._lib.hostenv_trylock(self._address):
            time.sleep(pause)
            pause = min(1e-3, 2 * pause or 2e-5)

    def __exit__(self, *exc: Any) -> None:
        if self._lib is not None:
            self._lib.hostenv_unlock(self._address)
        self._threads.release()

    def __getitem__(self, field: int) -> int:
        return int(self.block[field])

    def __setitem__(self, field: int, value: int) -> None:
        self.block[field] = value

    @property
    def fast_steps(self) -> int:
        """Steps the handler made without Python."""
        return self[C_FAST_STEPS]


_next_slot = [0]


def register(controls: list[Control]) -> int | None:
    """Registers consecutive slots for ``controls`` with the handler; the first slot, or None
    where there is no handler or the slots are used up (then Python steps them)."""
    lib = library()
    with _load_lock:
        base = _next_slot[0]
        if lib is None or base + len(controls) > SLOTS:
            return None
        _next_slot[0] += len(controls)
    for i, control in enumerate(controls):
        control._lib = lib
        lib.hostenv_register(base + i, control._address)
    return base


def step(slot: int, types: tuple, group: jax.Array, lead: jax.Array, *args: jax.Array) -> tuple:
    """``(status, session, obs, reward, flags, final_obs)`` of one device's step (traced, inside
    ``shard_map``); ``types``: the last five's shapes and dtypes."""
    status = jax.ShapeDtypeStruct((), np.int32)
    call = jax.ffi.ffi_call(_TARGET, (status, *types), has_side_effect=True)
    return call(group, lead, *args, slot=np.int64(slot))
