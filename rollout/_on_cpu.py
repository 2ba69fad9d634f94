"""``on_cpu``: run a row-independent JAX function on all CPU cores from inside jitted/sharded code.

How the pieces fit::

    caller (jit / shard_map / vmap / scan, on GPU, TPU or CPU devices)
      └─ jax.pure_callback(host, ...)            inputs: gradients stopped, keys as raw data
           └─ host(): fold vmapped axes into the batch, pad rows to W x chunk
                ├─ 'inprocess': jit(shard_map(fn)) over W CPU devices of this process
                └─ 'process':   W worker processes (rollout/_worker.py), one CPU device and one
                                thread each, inputs/outputs in one shared-memory block, fn shipped
                                once per chunk signature as a pickled jax.export.Exported

A callback that runs JAX on CPU devices hangs forever when the calling program itself spans several
CPU devices (``tests/test_on_cpu.py`` shows it), so ``'auto'`` only picks ``'inprocess'`` for
callers on an accelerator, and an explicit ``'inprocess'`` from a multi-device CPU caller is
refused. Eager calls (concrete inputs) run the host side directly, without a callback.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
import math
import numbers
import pickle
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from ensemble._outside import OutsideValues
from ensemble._warn import warn_user
from rollout._devices import available_cores
from rollout._host_call import (
    drop_padding,
    equal_ranks,
    narrow_sub_byte,
    pad_results,
    restore_sub_byte,
    widen_sub_byte,
)
from rollout._pool import ProcessPool, WorkerError, WorkerTimeout, shared_pool
from rollout._pool import _shared as _shared_pools
from rollout._relay import remember

__all__ = ["OnCpu", "WorkerError", "WorkerTimeout", "on_cpu"]

Executor = Literal["auto", "inprocess", "process"]
_EXECUTORS = ("auto", "inprocess", "process")
_tokens = itertools.count()
DEFAULT_CACHE_SIZE = 32  # compiled batch shapes kept per wrapper (caller and each worker)
CHECKPOINT_NAME = "on_cpu"  # the outputs' name for jax.checkpoint policies (see on_cpu)


# ---------------------------------------------------------------------------------------------
# Where does the caller run?


def _mesh_info(mesh: Any) -> tuple[int, str | None, bool]:
    """(devices, platform, has manual axes) of a mesh; for an empty one: (1, None, False)."""
    if mesh is None or getattr(mesh, "empty", True) or mesh.size == 0:
        return 1, None, False
    platform = None
    dev = getattr(mesh, "abstract_device", None)
    if dev is not None:
        platform = dev.platform
    elif getattr(mesh, "devices", None) is not None:
        platform = np.asarray(mesh.devices).flat[0].platform
    manual = any(t == AxisType.Manual for t in getattr(mesh, "axis_types", ()))
    return mesh.size, platform, manual


def _refuse_partly_manual(mesh: Any) -> None:
    """One line instead of JAX's lowering error: a callback needs every mesh axis manual."""
    types = dict(zip(getattr(mesh, "axis_names", ()), getattr(mesh, "axis_types", ())))
    manual = [a for a, t in types.items() if t == AxisType.Manual]
    if manual and len(manual) < len(types):
        rest = [a for a in types if a not in manual]
        # Not NotImplementedError: callers that retry on it (a fallback from vmap) would
        # only trace fn again.
        raise ValueError(
            f"on_cpu(fn) cannot run inside a partly manual shard_map (manual axes {manual}, "
            f"automatic {rest}), such as an ensemble member: jax {jax.__version__} compiles a "
            "host callback only where every mesh axis is manual. Call it outside the member "
            "(in the jitted step, on the ensemble's stacked outputs), or inside a jax.shard_map "
            "whose axis_names cover every axis of the mesh."
        )


def _caller(leaves: Sequence[Any]) -> tuple[str, int, Any]:
    """Platform and device count of the calling program, plus an Auto mesh spanning several devices.

    Read at trace time from the ambient abstract mesh (``shard_map``, ``jax.set_mesh``) and from
    the shardings that JAX attaches to every input's type (``jax.typeof(x).sharding.mesh``).
    Unknown parts default to ``jax.default_backend()`` and one device.
    """
    devices, platform, auto_mesh = 1, None, None
    ambient = jax.sharding.get_abstract_mesh()
    n, plat, manual = _mesh_info(ambient)
    devices, platform = max(devices, n), platform or plat
    for leaf in leaves:
        sharding = getattr(jax.typeof(leaf), "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        n, plat, man = _mesh_info(mesh)
        devices, platform, manual = max(devices, n), platform or plat, manual or man
        if n > 1 and not man:
            auto_mesh = auto_mesh or mesh
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
            devs = leaf.sharding.device_set
            devices = max(devices, len(devs))
            platform = platform or next(iter(devs)).platform
    if auto_mesh is None and _mesh_info(ambient)[0] > 1:  # jax.set_mesh: the program spans it
        auto_mesh = ambient
    if manual:
        auto_mesh = None  # inside shard_map the callback already runs once per device
    return platform or jax.default_backend(), devices, auto_mesh


# ---------------------------------------------------------------------------------------------
# Flattening: batched leaves (batch axis moved to 0) first, then shared leaves.


def _leaf_axes(i: int, spec: Any, arg: Any) -> list[Any]:
    """The in_axes entry of every leaf of positional argument ``i`` (``spec`` a pytree prefix)."""
    if spec is None or isinstance(spec, int):
        return [spec] * len(jax.tree.leaves(arg))
    out: list[Any] = []
    try:
        jax.tree.map(
            lambda ax, sub: out.extend([ax] * len(jax.tree.leaves(sub))),
            spec,
            arg,
            is_leaf=lambda x: x is None,
        )
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"on_cpu(fn): in_axes[{i}] = {spec!r} is not a prefix of argument {i}'s structure "
            f"({jax.tree.structure(arg)}): {e}"
        ) from None
    return out


def _normalise_axis(ax: Any, path: str, leaf: Any) -> int | None:
    """A leaf's batch axis as a non-negative int (like jax.vmap, -1 is the last axis) or None."""
    if ax is None:
        return None
    if isinstance(ax, bool) or not isinstance(ax, numbers.Integral):
        raise ValueError(
            f"on_cpu(fn): in_axes for {path} is {ax!r}; each entry must be an int (the batch "
            "axis) or None (the argument goes whole to every worker)"
        )
    ndim, shape = leaf.ndim, tuple(leaf.shape)
    if ndim == 0:
        raise ValueError(
            f"on_cpu(fn): {path} is a scalar but has in_axes={ax}; give it in_axes=None"
        )
    if not -ndim <= ax < ndim:
        raise ValueError(
            f"on_cpu(fn): in_axes={ax} is out of range for {path} of shape {shape} "
            f"({ndim}-D): the batch axis must be in [{-ndim}, {ndim - 1}]; use in_axes=None "
            "for an argument that goes whole to every worker"
        )
    return int(ax) % ndim


def _batch_size(paths: list[str], leaves: list[Any], axes: list[int | None]) -> int:
    """The batch size every mapped leaf agrees on; else an error naming each leaf and its size."""
    mapped = [(p, x, ax) for p, x, ax in zip(paths, leaves, axes) if ax is not None]
    if not mapped:
        raise ValueError("on_cpu(fn) needs at least one batched argument (in_axes=0)")
    sizes = {int(x.shape[ax]) for _, x, ax in mapped}
    if len(sizes) != 1:
        desc = "; ".join(
            f"{p} has {x.shape[ax]} (axis {ax} of shape {tuple(x.shape)})" for p, x, ax in mapped
        )
        raise ValueError(
            f"on_cpu(fn): the mapped arguments disagree on the batch size: {desc}. An argument "
            "that every row shares (e.g. parameters) needs in_axes=None, e.g. "
            "on_cpu(fn, in_axes=(None, 0))"
        )
    return sizes.pop()


def _is_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)  # fn may return Python scalars: refused by their shape
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def _edge_pad(a: np.ndarray, rows: int) -> np.ndarray:
    # Repeat the last row rather than pad with zeros: a zero row can be a NaN for fn.
    if a.shape[0] == rows:
        return a
    return np.concatenate([a, np.repeat(a[-1:], rows - a.shape[0], axis=0)])


class _LRU:
    """A dict of at most ``size`` entries; the least recently used goes first, to ``on_evict``."""

    def __init__(self, size: int, on_evict: Callable[[list[Any]], None] | None = None):
        self.size = size
        self.on_evict = on_evict
        self._d: collections.OrderedDict = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._d)

    def keys(self) -> list[Any]:
        return list(self._d)

    def get(self, key: Any) -> Any:
        if key in self._d:
            self._d.move_to_end(key)
            return self._d[key]
        return None

    def put(self, key: Any, value: Any) -> None:
        self._d[key] = value
        self._d.move_to_end(key)
        evicted = []
        while len(self._d) > self.size:
            evicted.append(self._d.popitem(last=False)[0])
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)

    def clear(self) -> None:
        evicted, self._d = list(self._d), collections.OrderedDict()
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)


# ---------------------------------------------------------------------------------------------
# Executors


def _no_mesh() -> Any:
    """Outside any trace, no ambient mesh (the caller's ``jax.set_mesh``): ``fn``'s program
    runs on the executor's own CPU devices, whatever mesh the caller uses."""
    try:
        return jax.set_mesh(None)
    except ValueError:  # inside a trace: set_mesh is refused there
        return contextlib.nullcontext()


def _with_timeout(work: Callable[[], Any], timeout: float, message: str) -> Any:
    """``work()`` in a thread, raising :class:`WorkerTimeout` if it takes over ``timeout`` s
    (the exception's ``late`` attribute is the thread).

    The late thread is abandoned (Python cannot stop it, nor XLA its execution): later calls on
    the same CPU devices queue behind that execution, and exiting the interpreter while it runs
    makes XLA abort the process.
    """
    box: dict[str, Any] = {}

    def target():
        try:
            box["out"] = work()
        except BaseException as e:
            box["error"] = e

    thread = threading.Thread(target=target, name="on_cpu-inprocess", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        error = WorkerTimeout(message)
        error.late = thread
        raise error
    if "error" in box:
        raise box["error"]
    return box["out"]


# Executions abandoned at a timeout, by any wrapper: XLA queues later programs on this process's
# CPU devices behind them, so every in-process call with a timeout waits for them first.
_abandoned: list[threading.Thread] = []
_abandoned_lock = threading.Lock()


def _wait_for_abandoned(timeout: float) -> bool:
    """Waits up to ``timeout`` s in all for every abandoned execution; True when none runs."""
    deadline = time.monotonic() + timeout
    with _abandoned_lock:
        pending = list(_abandoned)
    for thread in pending:
        thread.join(max(0.0, deadline - time.monotonic()))
    with _abandoned_lock:
        _abandoned[:] = [t for t in _abandoned if t.is_alive()]
        return not any(t.is_alive() for t in pending)


class _InProcess:
    """``jit(shard_map(fn))`` over W CPU devices of this process."""

    def __init__(self, workers: int, cache_size: int = DEFAULT_CACHE_SIZE):
        self.num_workers = workers
        self._lock = threading.Lock()
        self._compiled = _LRU(cache_size)

    def run(self, flat_fn, key, nb, batched, shared, chunk, weak, timeout=None, message=""):
        """Run on the CPU devices. ``timeout``: seconds the execution may take (compiling is not
        counted, nor waiting up to ``timeout`` for an execution abandoned at an earlier
        timeout, by this wrapper or another), else :class:`WorkerTimeout` with ``message``; the late
        execution is abandoned and later calls still run."""
        compiled, shardings = self._compile(flat_fn, key, nb, batched, shared, chunk, weak)
        args = [jax.device_put(a, s) for a, s in zip([*batched, *shared], shardings)]

        def work():
            return [np.asarray(o) for o in compiled(*args)]

        if timeout is None:
            return work()
        # This call would queue behind an abandoned execution: its own clock starts after.
        if not _wait_for_abandoned(timeout):
            raise WorkerTimeout(
                "on_cpu(executor='inprocess'): an execution abandoned at an earlier timeout "
                f"still held the CPU devices after another {timeout:g} s; this call did not start"
            )
        try:
            return _with_timeout(work, timeout, message)
        except WorkerTimeout as e:
            with _abandoned_lock:
                _abandoned.append(e.late)
            raise

    def _compile(self, flat_fn, key, nb, batched, shared, chunk, weak):
        active = batched[0].shape[0] // chunk
        with self._lock:
            entry = self._compiled.get((key, active))
            if entry is None:
                mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:active]), ("w",))
                specs = (P("w"),) * nb + (P(),) * len(shared)
                fn = jax.shard_map(
                    flat_fn, mesh=mesh, in_specs=specs, out_specs=P("w"), check_vma=False
                )
                shardings = [NamedSharding(mesh, s) for s in specs]
                avals = [
                    jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s, weak_type=w)
                    for a, s, w in zip([*batched, *shared], shardings, weak)
                ]
                with _no_mesh():
                    entry = (jax.jit(fn).lower(*avals).compile(), shardings)
                self._compiled.put((key, active), entry)
            return entry

    def close(self) -> None:
        self._compiled.clear()


# ---------------------------------------------------------------------------------------------
# Coalescing: shard_map calls the callback once per device, all at once (one thread per device).
# Run separately, each call would give every worker 1/D of a chunk, and a sequential rollout's time
# hardly depends on its rows; merged, the workers get full chunks.

_COALESCE_S = 0.05  # longest wait for the other devices' calls of the same step
_COALESCE_MIN_S = 0.001  # shortest (see _Coalescer._timeout)
_INPROCESS_GUARD_S = 300.0  # in-process calls from CPU callers: longer is taken for the deadlock
_DEADLOCK_HINT = (
    ": most likely the deadlock of a callback into JAX from a program on several CPU devices. Use "
    "executor='process' (or 'auto'); pass timeout= if the work is really that long."
)


class _Request:
    def __init__(self, sig: Any, b: list[np.ndarray], s: list[np.ndarray], origin: Any = None):
        self.sig, self.b, self.s = sig, b, s
        self.origin = origin  # the traced call (one per call site of one program) it came from
        self.outs: list[np.ndarray] | None = None
        self.error: BaseException | None = None
        self.done = False

    def joins(self, other: _Request) -> bool:
        """Same program, same per-row shapes, same shared arguments (values included)."""
        return (
            self.sig == other.sig
            and all(
                x.shape[1:] == y.shape[1:] and x.dtype == y.dtype for x, y in zip(self.b, other.b)
            )
            and all(
                x is y or (x.shape == y.shape and x.dtype == y.dtype and _same_bits(x, y))
                for x, y in zip(self.s, other.s)
            )
        )


def _same_bits(x: np.ndarray, y: np.ndarray) -> bool:
    """Bit for bit: -0.0 is not 0.0 to a function that divides by it (np.array_equal says
    they are equal)."""
    as_bytes = lambda a: np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    return np.array_equal(as_bytes(x), as_bytes(y))


class _Coalescer:
    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._queue: list[_Request] = []
        self._leader = threading.Lock()
        self._leftover = False  # the last merge left requests of the same burst behind
        self._gathered_s: float | None = None  # how long whole bursts took to arrive (mean)

    def _timeout(self) -> float:
        """How long a leader waits for the rest of its burst: 4x the time whole bursts were
        seen to take (a running mean), within [_COALESCE_MIN_S, _COALESCE_S]. A CPU runtime
        with more devices than threads runs only some device programs at a time, so most
        bursts never complete and each wait ran to its timeout: a fixed 50 ms made a rollout
        on 4 simulated devices over 2 cores 11x slower than on 2, the CPU idle. A wait that
        runs out halves the next one (down to the floor), so bursts that never complete at
        all stop costing their timeout too."""
        if self._gathered_s is None:
            return _COALESCE_S
        return min(_COALESCE_S, max(_COALESCE_MIN_S, 4 * self._gathered_s))

    def _fail_queued(self, req: _Request, error: BaseException) -> list[_Request]:
        """After a worker failure, the queued calls of the same call site of the same program
        (the other devices of the step, whose shared values differ) fail with it: each would
        start a new pool and wait out its own timeout (8 members: 8x ``timeout``), for a step
        that fails anyway. Calls from other programs, threads or eager calls still run."""
        if not isinstance(error, WorkerError) or req.origin is None:
            return []
        with self._cv:
            failed = [r for r in self._queue if r.origin is req.origin]
            self._queue = [r for r in self._queue if r.origin is not req.origin]
        for r in failed:
            r.done = True
        return failed

    def submit(self, req: _Request, expected: int, run: Callable) -> list[np.ndarray]:
        with self._cv:
            self._queue.append(req)
            self._cv.notify_all()
        with self._leader:  # one merged call at a time; later arrivals queue for the next one
            if not req.done:
                with self._cv:
                    if expected > 1 and not self._leftover:
                        # Wait for the burst: every device's call of this step (or a timeout).
                        start, timeout = time.monotonic(), self._timeout()
                        if self._cv.wait_for(lambda: len(self._queue) >= expected, timeout):
                            took = time.monotonic() - start
                            mean = took if self._gathered_s is None else self._gathered_s
                            self._gathered_s = 0.9 * mean + 0.1 * took
                        else:  # (the timeout is 4x _gathered_s: half of it next time)
                            self._gathered_s = timeout / 8
                    group = [r for r in self._queue if r.joins(req)]
                    self._queue = [r for r in self._queue if not r.joins(req)]
                    # Calls that could not join (other shared values) arrived with this burst:
                    # their leaders should not wait for a burst again.
                    self._leftover = bool(self._queue)
                try:
                    rows = [r.b[0].shape[0] for r in group]
                    merged = [np.concatenate(xs) for xs in zip(*(r.b for r in group))]
                    outs = run(merged if len(group) > 1 else req.b, req.s)
                    ends = np.cumsum(rows)
                    for r, end, n in zip(group, ends, rows):
                        r.outs = [o[end - n : end] for o in outs]
                except BaseException as e:
                    for r in group + self._fail_queued(req, e):
                        r.error = e
                for r in group:
                    r.done = True
        if req.error is not None:
            raise req.error
        assert req.outs is not None
        return req.outs


# ---------------------------------------------------------------------------------------------
# The wrapper


class OnCpu:
    """The callable returned by :func:`on_cpu`: call it like ``fn``; ``close()`` stops workers.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from rollout import on_cpu
      >>> with on_cpu(lambda x: x * 2, workers=1) as f:  # leaving the block stops the worker
      ...     y = jax.jit(f)(jnp.arange(4.0))
      ...     started = len(f.pids)
      >>> y.tolist(), started, f.pids
      ([0.0, 2.0, 4.0, 6.0], 1, [])
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        in_axes: Any,
        executor: Executor,
        workers: int | None,
        timeout: float | None,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ):
        if executor not in _EXECUTORS:
            raise ValueError(f"executor must be one of {_EXECUTORS}, got {executor!r}")
        if workers is not None and (not _is_int(workers) or workers < 1):
            raise ValueError(f"workers must be a positive int or None, got {workers!r}")
        most = MAX_WORKERS_PER_CORE * available_cores()
        if workers is not None and workers > most:
            # Each worker is a process with its own JAX runtime (about 200 MB); the work is
            # CPU-bound, so more workers than cores only share them.
            raise ValueError(
                f"workers={workers} is more than {MAX_WORKERS_PER_CORE} per CPU core "
                f"({available_cores()} cores); give at most {most}, or None (one per core)."
            )
        if not _is_int(cache_size) or cache_size < 1:
            raise ValueError(f"cache_size must be a positive int, got {cache_size!r}")
        self.fn = fn
        self.in_axes = in_axes
        self.executor = executor
        self.workers = workers
        self.timeout = _check_timeout(timeout)
        self.cache_size = cache_size
        self.last_executor: str | None = None  # what the latest trace picked: for tests and logs
        self._pool: ProcessPool | None = None
        self._inprocess: _InProcess | None = None
        # Exported programs per chunk signature; evicted ones are dropped by the workers too.
        self._pools: list[ProcessPool] = []
        self._exports = _LRU(cache_size, on_evict=functools.partial(_forget, self._pools))
        weakref.finalize(self, self._exports.clear)  # a dropped wrapper frees worker memory
        self._lock = threading.Lock()
        self._token = next(_tokens)  # names this wrapper's programs inside shared workers
        # Argument structures by equality (as jax.jit keys them), each named by a number that is
        # never reused: a structure's text can stay the same while its static part changes (a
        # new lambda at a freed lambda's address, a field left out of a dataclass's repr).
        self._structures = _LRU(cache_size)
        self._structures_lock = threading.Lock()  # traces may run in several threads
        self._specs = _LRU(cache_size)  # fn's output specs per input signature
        self._reads = OutsideValues(f"on_cpu({_fn_name(fn)})")
        self._coalescer = _Coalescer()
        functools.update_wrapper(self, fn, updated=())

    # -------------------------------------------------------------- public helpers
    @property
    def pids(self) -> list[int]:
        """Worker process ids of the process executor (empty when it is not running)."""
        return self._pool.pids if self._pool is not None else []

    def close(self) -> None:
        """Stop the worker processes and drop compiled programs; a later call starts them again.

        Wrappers with the same worker count share one pool of processes, so this also stops the
        workers of those wrappers (their next call restarts the pool).
        """
        with self._lock:
            # The shared pool this wrapper uses (or would use), even if another wrapper started it.
            pool = self._pool or _shared_pools.get(self.workers or available_cores())
            self._exports.clear()
            self._specs.clear()
            if pool is not None:
                pool.close()
            if self._inprocess is not None:
                self._inprocess.close()

    def __enter__(self) -> OnCpu:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------- executor choice
    def _choose(self, platform: str, devices: int, eager: bool, sub_byte: list[str]) -> str:
        n_cpu = len(jax.devices("cpu"))
        if self.executor == "process":
            return "process"
        if self.executor == "inprocess":
            if sub_byte:
                raise TypeError(
                    f"on_cpu(executor='inprocess') cannot take {', '.join(sub_byte)} arrays: "
                    "XLA refuses sub-byte layouts when calling its compiled program; use "
                    "executor='process' (or 'auto', which picks it for them)."
                )
            if platform == "cpu" and devices > 1 and not eager:
                raise RuntimeError(
                    f"on_cpu(executor='inprocess') would deadlock: the calling program runs on "
                    f"{devices} CPU devices, and a callback that runs JAX on CPU devices from such "
                    "a program hangs forever. Use executor='process' (or 'auto', which picks it "
                    "for CPU callers), or call from a program on one device or on an accelerator."
                )
            if self.workers is not None and self.workers > n_cpu:
                raise ValueError(
                    f"on_cpu(executor='inprocess', workers={self.workers}) needs {self.workers} "
                    f"CPU devices, this process has {n_cpu}. Call "
                    f"rollout.configure_cpu_devices({self.workers}) before JAX starts, or use "
                    "executor='process'."
                )
            return "inprocess"
        # auto: in-process only for accelerator callers and only if it gets several cores.
        want = self.workers or available_cores()
        if platform != "cpu" and n_cpu >= min(want, 2) and not sub_byte:
            return "inprocess"
        return "process"

    def _executor(self, kind: str):
        with self._lock:
            if kind == "process":
                if self._pool is None:
                    self._pool = shared_pool(self.workers or available_cores())
                    self._pools.append(self._pool)
                return self._pool
            if self._inprocess is None:
                n = self.workers or len(jax.devices("cpu"))
                self._inprocess = _InProcess(min(n, len(jax.devices("cpu"))), self.cache_size)
            return self._inprocess

    def _exported(self, flat_fn, key, specs) -> bytes | None:
        """fn's program for the workers, exported once per key. None where it could only be
        exported for the caller's mesh (traced under ``jax.set_mesh``, which cannot be unset
        while tracing): not for the workers, which have one device each; the callback exports
        it again when it runs, on a thread with no mesh."""
        with self._lock:
            program = self._exports.get(key)
            if program is None:
                try:
                    with _no_mesh():
                        exp = jax.export.export(jax.jit(flat_fn), platforms=["cpu"])(*specs)
                except NotImplementedError as e:
                    if "host_callbacks" not in str(e):
                        raise
                    raise ValueError(
                        "on_cpu(fn): fn makes a host callback (jax.debug.print, a pure_callback "
                        "or io_callback, a nested on_cpu), which the 'process' executor cannot "
                        "ship to its workers; take it out of fn, or use executor='inprocess'."
                    ) from None
                if exp.nr_devices != 1:
                    return None
                # Exported.serialize() needs the optional 'flatbuffers' package; the dataclass
                # pickles as well (StableHLO bytecode plus tree and aval metadata, no user code)
                # once its local VJP closure, which workers never use, is dropped.
                program = pickle.dumps(dataclasses.replace(exp, _get_vjp=None))
                self._exports.put(key, program)
            return program

    # -------------------------------------------------------------- the call
    def _flatten(self, args: tuple) -> tuple[list[Any], Any, list[int | None], int, list[bool]]:
        """Leaves of ``args`` as arrays, their tree, validated batch axes, the batch size, and
        which leaves are weakly typed (Python scalars: ``2 * int8`` stays int8)."""
        in_axes = self.in_axes
        if in_axes is None or isinstance(in_axes, int):
            in_axes = (in_axes,) * len(args)
        if not isinstance(in_axes, (tuple, list)):
            raise ValueError(
                f"on_cpu(fn): in_axes must be an int, None, or a tuple/list with one entry per "
                f"positional argument, got {in_axes!r}"
            )
        if len(in_axes) != len(args):
            raise ValueError(
                f"in_axes has {len(in_axes)} entries but fn got {len(args)} positional arguments"
            )
        specs = [ax for i, sa in enumerate(zip(in_axes, args)) for ax in _leaf_axes(i, *sa)]
        with_paths, treedef = jax.tree_util.tree_flatten_with_path(args)
        paths = ["args" + jax.tree_util.keystr(p) for p, _ in with_paths]
        leaves = [_as_leaf(x) for _, x in with_paths]
        weak = [_is_weak(x) for _, x in with_paths]
        axes = [_normalise_axis(ax, p, x) for ax, p, x in zip(specs, paths, leaves)]
        return leaves, treedef, axes, _batch_size(paths, leaves, axes), weak

    def __call__(self, *args: Any) -> Any:
        """``fn(*args)``, its batched rows split over the CPU workers; the same outputs as ``fn``.

        Traced inputs (inside ``jit``, ``vmap``, ``scan``, ``shard_map``) go through a host
        callback; concrete ones run the host side directly, so errors arrive unwrapped.
        """
        try:
            return self._call(*args)
        except (ValueError, TypeError, RuntimeError) as e:
            _name_fn(e, self.fn)
            raise

    def _call(self, *args: Any) -> Any:
        if not args:
            raise TypeError("on_cpu(fn): call with at least one positional argument")
        leaves, treedef, axes, n, weak = self._flatten(args)
        keys = [jax.random.key_impl(x) if _is_key(x) else None for x in leaves]
        raw = [jax.random.key_data(x) if k is not None else x for x, k in zip(leaves, keys)]
        _warn_batch_dependent_keys(keys, raw, axes)
        b_idx = [i for i, ax in enumerate(axes) if ax is not None]
        s_idx = [i for i, ax in enumerate(axes) if ax is None]
        # Concrete inputs: run the host side directly (NumPy only: an eager jnp op compiles a
        # program per new shape), so errors reach the caller unwrapped and no callback is
        # compiled per call.
        eager = not any(isinstance(x, jax.core.Tracer) for x in leaves)
        if not eager:
            _refuse_partly_manual(jax.sharding.get_abstract_mesh())
        xp = np if eager else jnp
        batched = [xp.moveaxis(raw[i], axes[i], 0) for i in b_idx]
        shared = [raw[i] for i in s_idx]
        out_info: dict[str, Any] = {}
        flat_fn = _flat_fn(self.fn, treedef, axes, keys, b_idx + s_idx, out_info)
        weak_in = tuple(weak[i] for i in b_idx + s_idx)
        specs = [
            jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=w)
            for x, w in zip((*batched, *shared), weak_in)
        ]
        sig = self._signature(treedef, axes, keys, weak_in)
        out_specs = self._output_specs(flat_fn, specs, n, sig, out_info, eager)
        platform, devices, auto_mesh = _caller(leaves)
        sub_byte = sorted({str(x.dtype) for x in specs if jax.dtypes.itemsize_bits(x.dtype) < 8})
        kind = self._choose(platform, devices, eager, sub_byte)
        self.last_executor = kind
        call = self._prepare(kind, flat_fn, len(batched), specs, out_specs, platform, eager)
        call.sig, call.weak = sig, weak_in
        if kind == "process" and not eager:
            # Exported now, at trace time (and cached for a run in one chunk): what the workers
            # cannot run, a host callback inside fn, is refused here, not inside the callback.
            self._exported(
                flat_fn, (call.sig, tuple((x.shape, str(x.dtype)) for x in specs)), specs
            )
        if eager:
            outs = [jax.device_put(o) for o in call.run(*batched, *shared)]
        elif auto_mesh is not None:
            outs = _per_shard(call, auto_mesh, batched, shared, n)
        else:
            call.expected = _manual_devices()
            outs = call.callback(*batched, *shared)
        outs = [
            jax.random.wrap_key_data(o, impl=k) if k is not None else o
            for o, k in zip(outs, out_info["keys"])
        ]
        return jax.tree.unflatten(out_info["tree"], outs)

    def _signature(self, treedef, axes, keys, weak_in) -> tuple:
        """What keys fn's output specs and programs, besides the input shapes and dtypes."""
        # The program depends on the weak types and on the settings JAX lowers it under (x64: a
        # float64 input means float32 without it): a call under other settings must not reuse
        # another's program, as jax.jit's own cache does not.
        # What fn reads from outside its arguments (a global, a closure, self.w) is in the key
        # too, as a number (keys travel to the workers): a program keeps what fn read when it
        # was traced, so a new value compiles anew.
        structure = self._structure_id(treedef)
        read = self._structure_id(("read from outside", self._reads(self.fn)))
        return (self._token, structure, tuple(axes), tuple(map(str, keys)), weak_in,
                _lowering_settings(), read)  # fmt: skip

    def _output_specs(self, flat_fn, specs, n, sig, out_info, eager) -> Any:
        """fn's output specs, traced once per input signature (keyed as its programs are, the
        values fn reads from outside its arguments included): later eager calls do not trace fn
        again. A traced call (once per trace of the caller's
        jit) traces fn afresh: it may close over that jit's tracers, which are refused then."""
        if not eager:
            return _output_specs(flat_fn, specs, n)
        key = (sig, tuple((x.shape, str(x.dtype)) for x in specs))
        with self._structures_lock:
            known = self._specs.get(key)
        if known is None:
            known = (_output_specs(flat_fn, specs, n), dict(out_info))  # out_info: filled now
            with self._structures_lock:
                self._specs.put(key, known)
        out_info.update(known[1])
        return known[0]

    def _structure_id(self, treedef: Any) -> int:
        """A number for this argument structure: the same for equal structures while cached."""
        with self._structures_lock:
            try:
                known = self._structures.get(treedef)
            except (TypeError, ValueError):  # unhashable or uncomparable static data
                return next(_tokens)  # never reused: compiled again on each call, correctly
            if known is None:
                known = next(_tokens)
                self._structures.put(treedef, known)
            return known

    def _prepare(self, kind, flat_fn, nb, specs, out_specs, platform, eager) -> _Call:
        timeout, message = self.timeout, ""
        if kind == "inprocess":
            if platform == "cpu" and not eager and timeout is None:
                # A CPU caller that looked single-device at trace time may not be: guard it.
                timeout = _INPROCESS_GUARD_S
                message = f"on_cpu(executor='inprocess') did not finish within {timeout:g} s"
                message += _DEADLOCK_HINT
            elif platform == "cpu" and not eager:  # the user's own timeout: either may be it
                message = (
                    f"on_cpu(executor='inprocess') did not finish within timeout={timeout:g} s: "
                    "the work took longer (raise timeout=), or a callback into JAX from a "
                    "program on several CPU devices deadlocked (use executor='process' or 'auto')"
                )
            elif timeout is not None:
                message = (
                    f"on_cpu(executor='inprocess') did not finish within timeout={timeout:g} s "
                    "of starting to execute; the late execution was abandoned: it keeps the CPU "
                    "devices busy until it finishes, later calls run after it"
                )
        return _Call(
            owner=self,
            flat_fn=flat_fn,
            kind=kind,
            executor=self._executor(kind),
            nb=nb,
            in_ndims=[x.ndim for x in specs],
            row_outs=[(o.shape[1:], o.dtype) for o in out_specs],
            timeout=timeout,
            timeout_message=message,
        )


def _output_specs(flat_fn: Callable, specs: list, n: int) -> Any:
    """``fn``'s outputs, traced (so its own errors surface here, in the caller), each with the
    batch of ``n`` rows first."""
    try:
        jaxpr, out_specs = jax.make_jaxpr(flat_fn, return_shape=True)(*specs)
    except jax.errors.TracerArrayConversionError as e:
        raise TypeError(
            "on_cpu(fn): fn must be written with jax.numpy (it is traced, then run as a "
            "compiled JAX program in the workers); it converted a traced value to a NumPy "
            "array (np.tanh(x), np.asarray(x), ...): use jnp instead of np there."
        ) from e
    if any(isinstance(c, jax.core.Tracer) for c in jaxpr.consts):
        raise TypeError(
            "on_cpu(fn): fn closes over a value traced by the enclosing jit (a parameter, say); "
            "its program runs apart from that trace, so pass the value as an argument of fn "
            "(in_axes None for one shared by all rows)."
        )
    for j, o in enumerate(out_specs):
        if o.ndim == 0 or o.shape[0] != n:
            raise ValueError(
                f"on_cpu(fn): output leaf {j} has shape {o.shape}, expected the batch ({n}) "
                "first; fn must return one result per row (row-independent, batch axis 0)"
            )
    return out_specs


def _as_leaf(x: Any) -> Any:
    """JAX arrays (and tracers) as they are; anything else as a NumPy array of the dtype JAX
    would give it (float64 -> float32 without x64), without compiling a conversion program."""
    if isinstance(x, jax.Array):
        return x
    if type(x) is int:  # a Python int: refused where it does not fit, as jax.numpy does
        dtype = jax.dtypes.canonicalize_dtype(np.int64)
        if not np.iinfo(dtype).min <= x <= np.iinfo(dtype).max:
            raise OverflowError(f"Python int {x} too large to convert to {dtype.name}")
        return np.asarray(x, dtype)
    a = np.asarray(x)
    return a.astype(jax.dtypes.canonicalize_dtype(a.dtype), copy=False)


def _is_weak(x: Any) -> bool:
    """Weakly typed as JAX sees it: a Python scalar, or an array JAX marked weak."""
    if isinstance(x, (int, float, complex)) and not isinstance(x, (bool, np.generic)):
        return True
    return isinstance(x, jax.Array) and bool(getattr(jax.typeof(x), "weak_type", False))


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


#: Most ``on_cpu`` workers per CPU core (each is a process with a JAX runtime).
MAX_WORKERS_PER_CORE = 4


def _check_timeout(timeout: Any) -> float | None:
    if timeout is None:
        return None
    ok = isinstance(timeout, numbers.Real) and not isinstance(timeout, bool)
    if not ok or not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(
            f"on_cpu: timeout must be a positive, finite number of seconds or None, got {timeout!r}"
        )
    return float(timeout)


def _forget(pools: list[ProcessPool], keys: list[Any]) -> None:
    for pool in pools:
        pool.forget(keys)


def _manual_devices() -> int:
    """How many calls of the callback one execution makes at once: one per device of the
    ambient shard_map's manual axes."""
    ambient = jax.sharding.get_abstract_mesh()
    sizes, types = getattr(ambient, "axis_sizes", ()), getattr(ambient, "axis_types", ())
    return math.prod(size for size, t in zip(sizes, types) if t == AxisType.Manual)


def _flat_fn(fn, treedef, axes, keys, order, out_info) -> Callable:
    """fn on flat arrays: batched leaves (batch axis 0) then shared ones; keys as raw data.

    Fills ``out_info`` with the output tree and key impls when traced. Holds no tracers of the
    caller, since compiled callers keep it alive."""

    def flat_fn(*xs):
        vals: list[Any] = [None] * len(order)
        for i, x in zip(order, xs):
            if axes[i] is not None:
                x = jnp.moveaxis(x, 0, axes[i])
            vals[i] = x if keys[i] is None else jax.random.wrap_key_data(x, impl=keys[i])
        out = fn(*jax.tree.unflatten(treedef, vals))
        outs, out_info["tree"] = jax.tree.flatten(out)
        for j, o in enumerate(outs):
            if not isinstance(o, jax.Array | np.ndarray | numbers.Number):
                raise TypeError(
                    f"on_cpu(fn): output leaf {j} is a {type(o).__name__}; fn must return "
                    "arrays, one row per input row"
                )
        out_info["keys"] = [jax.random.key_impl(o) if _is_key(o) else None for o in outs]
        return [jax.random.key_data(o) if _is_key(o) else o for o in outs]

    return flat_fn


@dataclasses.dataclass(eq=False)
class _Call:
    """The run-time side of one traced call (a compiled caller keeps it for its callback)."""

    owner: OnCpu
    flat_fn: Callable
    kind: str
    executor: Any
    nb: int
    in_ndims: list[int]
    row_outs: list[tuple[tuple[int, ...], Any]]
    timeout: float | None
    timeout_message: str
    sig: Any = None
    weak: tuple[bool, ...] = ()  # per input (batched, then shared): weakly typed
    expected: int = 1  # callbacks one execution makes at once, merged by the coalescer

    def run_rows(self, b: list[np.ndarray], s: list[np.ndarray]) -> list[np.ndarray]:
        """Split rows over the workers (padding to W x chunk), run, strip the padding."""
        rows = b[0].shape[0]
        if rows == 0:
            return [np.zeros((0, *shape), dt) for shape, dt in self.row_outs]
        workers = self.executor.num_workers
        active = min(workers, rows)
        chunk = -(-rows // active)
        active = -(-rows // chunk)
        b = [_edge_pad(x, active * chunk) for x in b]
        shapes = [(chunk, *x.shape[1:]) for x in b] + [x.shape for x in s]
        weak = self.weak or (False,) * len(shapes)
        chunk_specs = [
            jax.ShapeDtypeStruct(shape, x.dtype, weak_type=w)
            for shape, x, w in zip(shapes, [*b, *s], weak)
        ]
        # Programs are cached per structure, chunk shapes and the values fn reads from outside
        # its arguments (see _signature).
        key = (self.sig, tuple((x.shape, str(x.dtype)) for x in chunk_specs))  # sig: settings
        if self.kind == "process":
            program = self.owner._exported(self.flat_fn, key, chunk_specs)
            if program is None:  # a host call while tracing under jax.set_mesh (no callback)
                raise RuntimeError(
                    "on_cpu(fn): called with concrete inputs while tracing under jax.set_mesh; "
                    "call it outside the mesh context, or on the traced values."
                )
            try:
                outs = self.executor.run(key, program, b, s, self.row_outs, chunk, self.timeout)
            except WorkerError as e:  # the pool serves every wrapper: say whose fn it ran
                e.args = (f"on_cpu({_fn_name(self.owner.fn)}): {e}", *e.args[1:])
                raise
        else:
            outs = self.executor.run(
                self.flat_fn, key, self.nb, b, s, chunk, weak, self.timeout, self.timeout_message
            )
        for j, (o, (shape, dt)) in enumerate(zip(outs, self.row_outs)):
            # fn's output shape or dtype depends on the batch size, or the chunk's program
            # predates this batch's trace and a closed-over value changed in between
            if o.shape[1:] != tuple(shape) or o.dtype != np.dtype(dt):
                raise ValueError(
                    f"on_cpu(fn): output leaf {j} has rows of {o.dtype} {o.shape[1:]} when fn "
                    f"runs on chunks of {chunk} rows, and {np.dtype(dt)} {tuple(shape)} on the "
                    "whole batch: fn must be row-independent (no output shape or dtype that "
                    "depends on the batch size), with the batch on axis 0 of every output; or "
                    "a value fn reads from outside its arguments that sets an output's shape "
                    "or dtype changed since the jit that calls it traced: pass it as an argument"
                )
        return [o[:rows] for o in outs]

    def run(self, *flat: Any) -> list[np.ndarray]:
        """The host side: NumPy inputs in, NumPy outputs out."""
        flat = [np.asarray(x) for x in flat]
        nb, submit = self.nb, self.owner._coalescer.submit
        # Under jax.vmap (vmap_method='expand_dims') every input gains leading axes: fold them
        # into the batch, so one vmapped call still fans out over all workers.
        lead_shapes = [x.shape[: x.ndim - d] for x, d in zip(flat, self.in_ndims)]
        lead = np.broadcast_shapes(*lead_shapes)
        if not lead:
            req = _Request(self.sig, flat[:nb], flat[nb:], self)
            return submit(req, self.expected, self.run_rows)
        k, m = len(lead), math.prod(lead)
        b = [np.broadcast_to(x, lead + x.shape[k:]) for x in flat[:nb]]
        b_rows = b[0].shape[k]
        s = flat[nb:]
        if all(math.prod(x.shape[:k]) == 1 for x in s):
            b = [x.reshape(m * b_rows, *x.shape[k + 1 :]) for x in b]
            s = [x.reshape(x.shape[k:]) for x in s]
            outs = submit(_Request(self.sig, b, s, self), self.expected, self.run_rows)
            return [o.reshape(*lead, b_rows, *o.shape[1:]) for o in outs]
        # Shared arguments differ along the vmapped axes: one call per vmapped element.
        s = [np.broadcast_to(x, lead + x.shape[k:]) for x in s]
        b = [x.reshape(m, *x.shape[k:]) for x in b]
        s = [x.reshape(m, *x.shape[k:]) for x in s]
        parts = [self.run_rows([x[i] for x in b], [x[i] for x in s]) for i in range(m)]
        return [np.stack(p).reshape(*lead, *p[0].shape) for p in zip(*parts)]

    def host(self, *flat: Any) -> list[np.ndarray]:
        """The pure_callback: records worker failures for :func:`worker_errors`."""
        try:
            return self.run(*flat)
        except WorkerError as e:
            remember(e)
            raise
        except (ValueError, TypeError, RuntimeError) as e:
            _name_fn(e, self.owner.fn)
            raise

    def callback(self, *xs: Any) -> list[Any]:
        xs = [jax.lax.stop_gradient(x) for x in xs]  # zero gradient, by design (see on_cpu)
        result = [jax.ShapeDtypeStruct((xs[0].shape[0], *shape), dt) for shape, dt in self.row_outs]
        result, pads = equal_ranks(result)  # for a TPU caller inside shard_map (see equal_ranks)
        wide, back = widen_sub_byte(xs)
        host = narrow_sub_byte(pad_results(self.host, pads), back)
        outs = drop_padding(jax.pure_callback(host, result, *wide, vmap_method="expand_dims"), pads)
        vma = frozenset().union(*(_varying_axes(x) for x in xs))
        if vma:  # inside shard_map: each device got its own rows, so results vary too
            outs = [jax.lax.pcast(o, tuple(sorted(vma)), to="varying") for o in outs]
        # Under jax.checkpoint the backward pass recomputes the forward one, the CPU work too,
        # unless the policy saves these (save_only_these_names(CHECKPOINT_NAME)).
        return [checkpoint_name(o, CHECKPOINT_NAME) for o in outs]


def _lowering_settings() -> tuple:
    """x64 as in effect, and every ``jax.config`` option as in effect (context managers too).

    Several change the program traced from the same function and inputs (threefry
    partitionable, the random seed offset, matmul precision, promotion rules, the PRNG); the
    others cost a compile only when they change. About 30 us a call."""
    x64 = jax.dtypes.canonicalize_dtype(np.float64) == np.float64
    values = jax.config.values
    return (x64, *(str(getattr(jax.config, name, values[name])) for name in sorted(values)))


def _warn_batch_dependent_keys(keys: list, raw: list, axes: list) -> None:
    """Warns when batched keys use an rbg-family generator.

    ``rbg`` and ``unsafe_rbg`` keys draw different bits for a row depending on the batch the row
    is vmapped in, so ``fn``'s results would depend on the worker count, the chunking and the
    callbacks merged into one call: threefry keys give every row the same bits in any batch.
    Raw key data (uint32, last axis 4) counts when JAX's default generator is rbg-family.
    """
    default = str(jax.config.jax_default_prng_impl)
    for k, x, ax in zip(keys, raw, axes):
        if ax is None:
            continue
        impl = str(k) if k is not None else None
        if impl is None and "rbg" in default and x.dtype == np.uint32 and x.shape[-1:] == (4,):
            impl = default
        if impl is not None and "rbg" in impl:
            warn_user(
                f"on_cpu(fn): batched {impl!r} keys draw bits that depend on the batch a row is "
                "vmapped in, so results will depend on the worker count and chunking; use "
                "threefry keys (jax.random.key's default) for results that do not",
                RuntimeWarning,
            )
            return


def _name_fn(e: BaseException, fn: Any) -> None:
    """Makes ``e``'s ``on_cpu(fn)`` name the function (with several wrappers in one step, the
    generic name did not say which one failed)."""
    head = "on_cpu(fn)"
    if e.args and isinstance(e.args[0], str) and e.args[0].startswith(head):
        e.args = (f"on_cpu({_fn_name(fn)})" + e.args[0][len(head) :], *e.args[1:])


def _fn_name(fn: Any) -> str:
    inner = getattr(fn, "func", fn)  # functools.partial
    return getattr(inner, "__qualname__", None) or type(inner).__name__


def _varying_axes(x: Any) -> frozenset:
    """The ``shard_map`` axes along which ``x`` differs between devices. A callback's result is
    typed as the same on every device, so without this a gradient through a ``psum`` of it is
    summed as if it were (8x one device's value on 8 devices). JAX 0.6-0.9 call it
    ``aval.vma``; 0.10 ``aval.manual_axis_type.varying``."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", frozenset())
    return frozenset(vma)


_EXPLICIT_VMAP = (
    "on_cpu(fn): cannot split the rows over the mesh axes {names}, which are Explicit ({error}). "
    "This happens under jax.vmap over an array sharded on one of them (the vmapped axis "
    "already uses it): fold that axis into on_cpu's batch instead (one call on x.reshape(-1, "
    "...), with in_axes for its arguments), call it inside jax.shard_map over that axis, or "
    "use a mesh with Auto axes (jax.make_mesh(..., axis_types=(AxisType.Auto,) * ndim))"
)


def _per_shard(call: _Call, mesh: Any, batched: list, shared: list, n: int) -> list[Any]:
    """jit over inputs sharded on several devices: a bare callback would be placed on one device
    (and its output sharding breaks later ops), so call it once per shard."""
    call.expected = mesh.size
    names = tuple(mesh.axis_names)
    padded = -(-n // mesh.size) * mesh.size
    explicit = any(t == AxisType.Explicit for t in mesh.axis_types)
    # NamedShardings, not bare specs: the caller need not be inside `jax.set_mesh`.
    place = functools.partial(NamedSharding, mesh)
    # Sub-byte values (int2, int4) move between devices byte-wide: XLA's CPU reshard of 2-bit
    # arrays gave wrong values, or corrupted the heap.
    (batched, back), (shared, back_shared) = widen_sub_byte(batched), widen_sub_byte(shared)
    back_out: list[Any] = []

    def body(*xs: Any) -> list[Any]:
        outs, back_out[:] = widen_sub_byte(call.callback(*restore_sub_byte(xs, back + back_shared)))
        return outs

    if explicit and padded > n:  # explicit types cannot pad rows sharded over some axes
        batched = [jax.reshard(x, place(P())) for x in batched]
    bb = [
        jnp.concatenate([x, jnp.repeat(x[-1:], padded - n, axis=0)]) if padded > n else x
        for x in batched
    ]
    specs = (P(names),) * len(batched) + (P(),) * len(shared)
    args = [*bb, *shared]
    split = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(names), check_vma=False)
    if not explicit:
        outs = split(*args)
    else:  # Explicit axes: shard_map wants inputs that already carry its in_specs
        try:
            outs = split(*[jax.reshard(x, place(s)) for x, s in zip(args, specs)])
        except Exception as e:
            error = " ".join(str(e).split())
            # JAX's words for an axis the vmapped one already uses (a DuplicateSpecError, or
            # shard_map's ValueError); other errors stay JAX's own
            if "duplicate entries" not in error and "marked as manual" not in error:
                raise
            raise ValueError(_EXPLICIT_VMAP.format(names=names, error=error)) from e
    if explicit:  # replicated whatever the batch size (13 rows cannot sit on 8 shards), so
        outs = [jax.reshard(o, place(P())) for o in outs]  # the caller's types never depend on it
    return [o[:n] for o in restore_sub_byte(outs, back_out)]


def on_cpu(
    fn: Callable[..., Any],
    in_axes: int | Sequence[Any] | None = 0,
    *,
    executor: Executor = "auto",
    workers: int | None = None,
    timeout: float | None = None,
    cache_size: int = DEFAULT_CACHE_SIZE,
) -> OnCpu:
    """Run ``fn`` on all CPU cores, callable from inside ``jit``, ``shard_map``, ``vmap``, ``scan``.

    ``fn`` takes and returns pytrees of arrays and must be **row-independent**: row ``i`` of every
    output depends only on row ``i`` of the batched inputs (and on the shared ones). The batch is
    split over ``workers`` CPU workers (padded by repeating the last row to a multiple of the
    chunk size, padding stripped), each runs ``fn`` on its chunk, and the results come back in
    order. Outputs carry the batch on axis 0. Output shapes and dtypes come from ``jax.eval_shape``,
    so errors in ``fn`` (shape mismatches, a ``raise``) surface at trace time in the caller.
    ``fn`` is a JAX function (``jax.numpy``, ``lax``): it is traced and compiled, not run as
    Python in the workers, so NumPy calls on its inputs are refused with a ``TypeError``, as is
    a value it closes over from the enclosing ``jit`` (pass that as an argument). Its program
    is one worker device's, also when the caller runs inside ``jax.set_mesh``. Over a mesh
    with Explicit axes the outputs are replicated (``P()``), whatever the batch size.

    Args:
      fn: the function, e.g. a GRU audio synthesiser ``(params, x[B, T, 1]) -> audio[B, T]``.
      in_axes: like ``jax.vmap``: per positional argument (or pytree prefix), the batch axis
        (an int in ``[-ndim, ndim)``, negative counting from the end) or ``None`` for arguments
        that go whole to every worker, e.g. the rollout model's parameters, which may change
        every call (they are arguments, not constants). Mapped arguments must agree on the batch
        size; a mismatch is a ``ValueError`` naming each argument and its size.
      executor: ``'process'``: a pool of worker processes (one CPU device and one thread each)
        fed through shared memory; safe from any caller. ``'inprocess'``: ``jit(shard_map(fn))``
        over this process's CPU devices (see :func:`rollout.configure_cpu_devices`); no process
        hop, but it deadlocks when the caller itself spans several CPU devices, so it is refused
        there with a ``RuntimeError``. The caller's devices are read at trace time from the
        shardings of the inputs and from the ambient mesh; a multi-device CPU program whose
        inputs to ``fn`` all sit on one device is not detected. For CPU callers an in-process
        call that takes longer than ``timeout`` (default 300 s) is then reported as that
        deadlock (a ``RuntimeError`` and a log line; with a ``timeout`` of yours, as that
        deadlock or work longer than it), but the program's other devices may stay
        blocked in a collective, and XLA then aborts the process (about 40 s later, its
        rendezvous limit), so on CPU-only hosts prefer ``'auto'``.
        ``'auto'`` (default): ``'inprocess'`` when the caller runs on an accelerator and this
        process has several CPU devices, else ``'process'``.
      workers: how many CPU workers (default: the CPU cores this process may use for
        ``'process'``; the CPU devices for ``'inprocess'``).
      timeout: seconds a call may execute, counted from when the workers start executing it
        (compiling a new batch shape is not counted), a positive finite number or ``None``.
        A call over it raises :class:`WorkerTimeout` within 1 s of it; the process executor
        kills its workers (they restart on the next call), the in-process one abandons the late
        execution: the next call (of any in-process wrapper) waits up to its own ``timeout`` for
        it to end before its clock starts (else a :class:`WorkerTimeout` saying it did not
        start), and an interpreter exiting while it still runs is aborted by XLA. The wrapper
        stays usable. Default: no limit, except 300 s for in-process calls from CPU callers
        (see above).
      cache_size: compiled programs (one per batch shape) kept per wrapper, in this process and
        in each worker; the least recently used is dropped beyond it (default 32).

    Returns:
      An :class:`OnCpu`, called with ``fn``'s positional arguments. Worker processes start on
      the first call and stop at ``close()`` (or ``with on_cpu(...) as f:``) and at interpreter
      exit.
      Wrappers with the same worker count share one pool of processes.

    Errors: a worker that raises, dies or runs over ``timeout`` raises :class:`WorkerError`
    (:class:`WorkerTimeout` for the timeout); a worker killed during a call is detected within
    1 s. Eager calls raise it directly; inside ``jit``/``shard_map`` JAX wraps it in a
    ``jax.errors.JaxRuntimeError``, which :func:`worker_errors` turns back into it (block on
    the result inside its ``with``: JAX dispatches asynchronously). A worker that
    died between calls is replaced at the next call.

    Gradients: none flow through ``on_cpu`` — inputs are wrapped in ``lax.stop_gradient``, so
    differentiating a loss that uses its outputs treats them as constants (zero gradient with
    respect to ``fn``'s inputs), exactly as the rollout-then-train pattern wants. Under
    ``jax.checkpoint`` (remat) the backward pass recomputes the forward one, and with it the
    CPU work, unless the policy saves the outputs: they are named ``'on_cpu'``, so
    ``jax.checkpoint(f, policy=jax.checkpoint_policies.save_only_these_names('on_cpu'))``
    runs it once.

    Values ``fn`` closes over (a global, ``self.w`` of a callable object) are frozen into its
    output shapes at the first call for each batch shape, and into the workers' compiled
    program at the first call for each chunk size; later changes to them are not seen, even by
    a newly traced ``jit`` (a new batch size whose chunks have an earlier batch's size runs that
    earlier program; where a change alters an output shape that is an error): pass whatever
    changes (parameters) as arguments.

    Random keys pass as typed keys or raw key data. With threefry keys (JAX's default) a row's
    draws do not depend on its batch, so results do not depend on ``workers``. ``rbg`` and
    ``unsafe_rbg`` keys draw bits that depend on the batch a row is vmapped in, so results then
    vary with the worker count and chunking: batched keys of those kinds give a ``RuntimeWarning``.

    Under ``jax.vmap`` the vmapped axes are folded into the batch (one callback, all workers).
    Inside ``jax.shard_map`` the callback runs once per device on that device's rows; a ``jit`` over
    inputs sharded on an Auto mesh is handled the same way. The first call per input signature
    exports and compiles ``fn`` (about a second); later calls only copy arrays.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from rollout import on_cpu
      >>> def synth(w, x):  # one sequential recurrence per row
      ...     def step(h, xt):
      ...         h = jnp.tanh(w * h + xt)
      ...         return h, h
      ...     return jax.lax.scan(step, jnp.zeros(x.shape[0]), x.T)[1].T
      >>> f = on_cpu(synth, in_axes=(None, 0), workers=2)
      >>> x = jnp.ones((5, 16))
      >>> y = jax.jit(f)(jnp.float32(0.5), x)
      >>> bool(jnp.allclose(y, synth(0.5, x), atol=1e-6))
      True
      >>> f.close()
    """
    if not callable(fn):
        raise TypeError(f"on_cpu needs a function (arrays -> arrays), got {fn!r}.")
    return OnCpu(fn, in_axes, executor, workers, timeout, cache_size)
