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
CPU devices (shared/FIELD-NOTES.md), so ``'auto'`` only picks ``'inprocess'`` for callers on an
accelerator, and an explicit ``'inprocess'`` from a multi-device CPU caller is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import pickle
import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from rollout._pool import ProcessPool, WorkerError, default_workers, shared_pool
from rollout._pool import _shared as _shared_pools

__all__ = ["OnCpu", "WorkerError", "on_cpu"]

Executor = Literal["auto", "inprocess", "process"]
_EXECUTORS = ("auto", "inprocess", "process")
_tokens = itertools.count()


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


def _caller(leaves: Sequence[Any]) -> tuple[str, int, Any]:
    """Platform and device count of the calling program, plus an Auto mesh spanning several devices.

    Read at trace time from the ambient abstract mesh (``shard_map``, ``jax.set_mesh``) and from
    the shardings that JAX attaches to every input's type (``jax.typeof(x).sharding.mesh``).
    Unknown parts default to ``jax.default_backend()`` and one device.
    """
    devices, platform, auto_mesh = 1, None, None
    n, plat, manual = _mesh_info(jax.sharding.get_abstract_mesh())
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
    if manual:
        auto_mesh = None  # inside shard_map the callback already runs once per device
    return platform or jax.default_backend(), devices, auto_mesh


# ---------------------------------------------------------------------------------------------
# Flattening: batched leaves (batch axis moved to 0) first, then shared leaves.


def _leaf_axes(spec: Any, arg: Any) -> list[int | None]:
    if spec is None or isinstance(spec, int):
        return [spec] * len(jax.tree.leaves(arg))
    out: list[int | None] = []
    jax.tree.map(
        lambda ax, sub: out.extend([ax] * len(jax.tree.leaves(sub))),
        spec,
        arg,
        is_leaf=lambda x: x is None,
    )
    return out


def _is_key(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _edge_pad(a: np.ndarray, rows: int) -> np.ndarray:
    # Repeat the last row rather than pad with zeros: a zero row can be a NaN for fn.
    if a.shape[0] == rows:
        return a
    return np.concatenate([a, np.repeat(a[-1:], rows - a.shape[0], axis=0)])


# ---------------------------------------------------------------------------------------------
# Executors


class _InProcess:
    """``jit(shard_map(fn))`` over W CPU devices of this process (the seed's pmap fix)."""

    def __init__(self, workers: int):
        self.num_workers = workers
        self._lock = threading.Lock()
        self._compiled: dict[Any, Callable] = {}
        self._stuck: str | None = None

    def run(self, flat_fn, key, nb, batched, shared, chunk, guard_s: float | None = None):
        """Run on the CPU devices. ``guard_s``: for CPU callers, the seconds after which a call
        that has not finished is taken for the callback deadlock and raised as an error (the
        stuck thread is abandoned; this executor refuses further calls)."""
        if self._stuck is not None:
            raise RuntimeError(self._stuck)
        if guard_s is None:
            return self._run(flat_fn, key, nb, batched, shared, chunk)
        box: dict[str, Any] = {}

        def target():
            try:
                box["outs"] = self._run(flat_fn, key, nb, batched, shared, chunk)
            except BaseException as e:
                box["error"] = e

        thread = threading.Thread(target=target, name="on_cpu-inprocess", daemon=True)
        thread.start()
        thread.join(guard_s)
        if thread.is_alive():
            self._stuck = (
                f"on_cpu(executor='inprocess') did not finish within {guard_s:g} s: most likely "
                "the deadlock of a callback into JAX from a program on several CPU devices. Use "
                "executor='process' (or 'auto'); pass timeout= if the work is really that long."
            )
            raise RuntimeError(self._stuck)
        if "error" in box:
            raise box["error"]
        return box["outs"]

    def _run(self, flat_fn, key, nb, batched, shared, chunk):
        active = batched[0].shape[0] // chunk
        with self._lock:
            if (key, active) not in self._compiled:
                mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:active]), ("w",))
                specs = (P("w"),) * nb + (P(),) * len(shared)
                fn = jax.shard_map(
                    flat_fn, mesh=mesh, in_specs=specs, out_specs=P("w"), check_vma=False
                )
                shardings = [NamedSharding(mesh, s) for s in specs]
                self._compiled[key, active] = (jax.jit(fn), shardings)
            fn, shardings = self._compiled[key, active]
            args = [jax.device_put(a, s) for a, s in zip([*batched, *shared], shardings)]
            return [np.asarray(o) for o in fn(*args)]

    def close(self) -> None:
        self._compiled.clear()


# ---------------------------------------------------------------------------------------------
# Coalescing: shard_map calls the callback once per device, all at once (one thread per device).
# Run separately, each call would give every worker 1/D of a chunk, and a sequential rollout's time
# hardly depends on its rows; merged, the workers get full chunks.

_COALESCE_S = 0.05  # longest wait for the other devices' calls of the same step
_INPROCESS_GUARD_S = 300.0  # in-process calls from CPU callers: longer is taken for the deadlock


class _Request:
    def __init__(self, sig: Any, b: list[np.ndarray], s: list[np.ndarray]):
        self.sig, self.b, self.s = sig, b, s
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
                x is y or (x.shape == y.shape and np.array_equal(x, y))
                for x, y in zip(self.s, other.s)
            )
        )


class _Coalescer:
    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._queue: list[_Request] = []
        self._leader = threading.Lock()
        self._leftover = False  # the last merge left requests of the same burst behind

    def submit(self, req: _Request, expected: int, run: Callable) -> list[np.ndarray]:
        with self._cv:
            self._queue.append(req)
            self._cv.notify_all()
        with self._leader:  # one merged call at a time; later arrivals queue for the next one
            if not req.done:
                with self._cv:
                    if expected > 1 and not self._leftover:
                        # Wait for the burst: every device's call of this step (or a timeout).
                        self._cv.wait_for(lambda: len(self._queue) >= expected, timeout=_COALESCE_S)
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
                    for r in group:
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
    """The callable returned by :func:`on_cpu`: call it like ``fn``; ``close()`` stops workers."""

    def __init__(
        self,
        fn: Callable[..., Any],
        in_axes: Any,
        executor: Executor,
        workers: int | None,
        timeout: float | None,
    ):
        if executor not in _EXECUTORS:
            raise ValueError(f"executor must be one of {_EXECUTORS}, got {executor!r}")
        if workers is not None and workers < 1:
            raise ValueError(f"workers must be a positive int or None, got {workers!r}")
        self.fn = fn
        self.in_axes = in_axes
        self.executor = executor
        self.workers = workers
        self.timeout = timeout
        self.last_executor: str | None = None  # what the latest trace picked: for tests and logs
        self._pool: ProcessPool | None = None
        self._inprocess: _InProcess | None = None
        self._exports: dict[Any, bytes] = {}
        self._lock = threading.Lock()
        self._token = next(_tokens)  # names this wrapper's programs inside shared workers
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
            pool = self._pool or _shared_pools.get(self.workers or default_workers())
            if pool is not None:
                pool.close()
            if self._inprocess is not None:
                self._inprocess.close()

    def __enter__(self) -> OnCpu:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------- executor choice
    def _choose(self, platform: str, devices: int) -> str:
        n_cpu = len(jax.devices("cpu"))
        if self.executor == "process":
            return "process"
        if self.executor == "inprocess":
            if platform == "cpu" and devices > 1:
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
        want = self.workers or default_workers()
        if platform != "cpu" and n_cpu >= min(want, 2):
            return "inprocess"
        return "process"

    def _executor(self, kind: str):
        with self._lock:
            if kind == "process":
                if self._pool is None:
                    self._pool = shared_pool(self.workers or default_workers())
                return self._pool
            if self._inprocess is None:
                n = self.workers or len(jax.devices("cpu"))
                self._inprocess = _InProcess(min(n, len(jax.devices("cpu"))))
            return self._inprocess

    def _exported(self, flat_fn, key, specs) -> bytes:
        with self._lock:
            if key not in self._exports:
                exp = jax.export.export(jax.jit(flat_fn), platforms=["cpu"])(*specs)
                # Exported.serialize() needs the optional 'flatbuffers' package; the dataclass
                # pickles as well (StableHLO bytecode plus tree and aval metadata, no user code)
                # once its local VJP closure, which workers never use, is dropped.
                self._exports[key] = pickle.dumps(dataclasses.replace(exp, _get_vjp=None))
            return self._exports[key]

    # -------------------------------------------------------------- the call
    def __call__(self, *args: Any) -> Any:
        if not args:
            raise TypeError("on_cpu(fn): call with at least one positional argument")
        in_axes = self.in_axes
        if in_axes is None or isinstance(in_axes, int):
            in_axes = (in_axes,) * len(args)
        in_axes = tuple(in_axes)
        if len(in_axes) != len(args):
            raise ValueError(
                f"in_axes has {len(in_axes)} entries but fn got {len(args)} positional arguments"
            )
        axes = [ax for spec, arg in zip(in_axes, args) for ax in _leaf_axes(spec, arg)]
        leaves, treedef = jax.tree.flatten(args)
        leaves = [x if isinstance(x, jax.Array) else jnp.asarray(x) for x in leaves]
        keys = [jax.random.key_impl(x) if _is_key(x) else None for x in leaves]
        raw = [jax.random.key_data(x) if k is not None else x for x, k in zip(leaves, keys)]
        b_idx = [i for i, ax in enumerate(axes) if ax is not None]
        s_idx = [i for i, ax in enumerate(axes) if ax is None]
        if not b_idx:
            raise ValueError("on_cpu(fn) needs at least one batched argument (in_axes=0)")
        batched = []
        for i in b_idx:
            if leaves[i].ndim == 0:
                raise ValueError(f"batched argument leaf {i} is a scalar; give it in_axes=None")
            batched.append(jnp.moveaxis(raw[i], axes[i] % leaves[i].ndim, 0))
        rows = {int(b.shape[0]) for b in batched}
        if len(rows) != 1:
            raise ValueError(f"batched arguments disagree on the batch size: {sorted(rows)}")
        (n,) = rows
        shared = [raw[i] for i in s_idx]
        nb = len(batched)
        fn = self.fn
        out_info: dict[str, Any] = {}

        def flat_fn(*xs):
            """fn on flat arrays: batched leaves (batch axis 0) then shared ones; keys as data."""
            vals: list[Any] = [None] * len(leaves)
            for i, x in zip(b_idx + s_idx, xs):
                if axes[i] is not None:
                    x = jnp.moveaxis(x, 0, axes[i] % leaves[i].ndim)
                vals[i] = x if keys[i] is None else jax.random.wrap_key_data(x, impl=keys[i])
            out = fn(*jax.tree.unflatten(treedef, vals))
            outs, out_info["tree"] = jax.tree.flatten(out)
            out_info["keys"] = [jax.random.key_impl(o) if _is_key(o) else None for o in outs]
            return [jax.random.key_data(o) if _is_key(o) else o for o in outs]

        specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (*batched, *shared)]
        out_specs = jax.eval_shape(flat_fn, *specs)  # also raises fn's own errors, here
        out_tree, out_keys = out_info["tree"], out_info["keys"]
        for j, o in enumerate(out_specs):
            if o.ndim == 0 or o.shape[0] != n:
                raise ValueError(
                    f"on_cpu(fn): output leaf {j} has shape {o.shape}, expected the batch ({n}) "
                    "first; fn must return one result per row (row-independent, batch axis 0)"
                )

        platform, devices, auto_mesh = _caller(leaves)
        # How many calls of the callback one execution makes at once: one per device in a
        # shard_map (the user's, or ours for inputs sharded over an Auto/Explicit mesh).
        ambient = jax.sharding.get_abstract_mesh()
        sizes, types = getattr(ambient, "axis_sizes", ()), getattr(ambient, "axis_types", ())
        expected = math.prod(size for size, t in zip(sizes, types) if t == AxisType.Manual)
        if auto_mesh is not None:
            expected = auto_mesh.size
        kind = self._choose(platform, devices)
        self.last_executor = kind
        executor = self._executor(kind)
        workers = executor.num_workers
        in_ndims = [x.ndim for x in (*batched, *shared)]
        # Programs are cached per structure and chunk shapes; constants that fn closes over are
        # frozen into the first export, which is why changing values must be arguments.
        sig = (self._token, str(treedef), tuple(axes), tuple(map(str, keys)))
        row_outs = [(o.shape[1:], o.dtype) for o in out_specs]

        def run_rows(b: list[np.ndarray], s: list[np.ndarray]) -> list[np.ndarray]:
            rows = b[0].shape[0]
            if rows == 0:
                return [np.zeros((0, *shape), dt) for shape, dt in row_outs]
            active = min(workers, rows)
            chunk = -(-rows // active)
            active = -(-rows // chunk)
            b = [_edge_pad(x, active * chunk) for x in b]
            chunk_specs = [jax.ShapeDtypeStruct((chunk, *x.shape[1:]), x.dtype) for x in b] + [
                jax.ShapeDtypeStruct(x.shape, x.dtype) for x in s
            ]
            key = (sig, tuple((x.shape, str(x.dtype)) for x in chunk_specs))
            if kind == "process":
                program = self._exported(flat_fn, key, chunk_specs)
                outs = executor.run(key, program, b, s, row_outs, chunk, self.timeout)
            else:
                # A CPU caller that looked single-device at trace time may not be: guard it.
                guard = (self.timeout or _INPROCESS_GUARD_S) if platform == "cpu" else None
                outs = executor.run(flat_fn, key, nb, b, s, chunk, guard)
            return [o[:rows] for o in outs]

        def host(*flat: Any) -> list[np.ndarray]:
            flat = [np.asarray(x) for x in flat]
            # Under jax.vmap (vmap_method='expand_dims') every input gains leading axes: fold them
            # into the batch, so one vmapped call still fans out over all workers.
            lead_shapes = [x.shape[: x.ndim - d] for x, d in zip(flat, in_ndims)]
            lead = np.broadcast_shapes(*lead_shapes)
            if not lead:
                req = _Request(sig, flat[:nb], flat[nb:])
                return self._coalescer.submit(req, expected, run_rows)
            k, m = len(lead), math.prod(lead)
            b = [np.broadcast_to(x, lead + x.shape[k:]) for x in flat[:nb]]
            b_rows = b[0].shape[k]
            s = flat[nb:]
            if all(math.prod(x.shape[:k]) == 1 for x in s):
                b = [x.reshape(m * b_rows, *x.shape[k + 1 :]) for x in b]
                s = [x.reshape(x.shape[k:]) for x in s]
                outs = self._coalescer.submit(_Request(sig, b, s), expected, run_rows)
                return [o.reshape(*lead, b_rows, *o.shape[1:]) for o in outs]
            # Shared arguments differ along the vmapped axes: one call per vmapped element.
            s = [np.broadcast_to(x, lead + x.shape[k:]) for x in s]
            b = [x.reshape(m, *x.shape[k:]) for x in b]
            s = [x.reshape(m, *x.shape[k:]) for x in s]
            parts = [run_rows([x[i] for x in b], [x[i] for x in s]) for i in range(m)]
            return [np.stack(p).reshape(*lead, *p[0].shape) for p in zip(*parts)]

        def call(*xs):
            xs = [jax.lax.stop_gradient(x) for x in xs]  # zero gradient, by design (see on_cpu)
            result = [jax.ShapeDtypeStruct((xs[0].shape[0], *shape), dt) for shape, dt in row_outs]
            outs = jax.pure_callback(host, result, *xs, vmap_method="expand_dims")
            vma = frozenset().union(*(getattr(jax.typeof(x), "vma", frozenset()) for x in xs))
            if vma:  # inside shard_map: each device got its own rows, so results vary too
                outs = [jax.lax.pcast(o, tuple(sorted(vma)), to="varying") for o in outs]
            return outs

        if auto_mesh is not None:
            # jit over inputs sharded on several devices: a bare callback would be placed on one
            # device (and its output sharding breaks later ops), so call it once per shard.
            names = tuple(auto_mesh.axis_names)
            padded = -(-n // auto_mesh.size) * auto_mesh.size
            bb = [
                jnp.concatenate([x, jnp.repeat(x[-1:], padded - n, axis=0)]) if padded > n else x
                for x in batched
            ]
            specs = (P(names),) * nb + (P(),) * len(shared)
            args_ = [*bb, *shared]
            explicit = any(t == AxisType.Explicit for t in auto_mesh.axis_types)
            if explicit:
                # Explicit axes: shard_map wants inputs that already carry its in_specs.
                args_ = [jax.reshard(x, s) for x, s in zip(args_, specs)]
            outs = jax.shard_map(
                call,
                mesh=auto_mesh,
                in_specs=specs,
                out_specs=P(names),
                check_vma=False,
            )(*args_)
            if explicit and padded > n:  # explicit sharding cannot slice 13 rows out of 8 shards
                outs = [jax.reshard(o, P()) for o in outs]
            outs = [o[:n] for o in outs]
        else:
            outs = call(*batched, *shared)
        outs = [
            jax.random.wrap_key_data(o, impl=k) if k is not None else o
            for o, k in zip(outs, out_keys)
        ]
        return jax.tree.unflatten(out_tree, outs)


def on_cpu(
    fn: Callable[..., Any],
    in_axes: int | Sequence[Any] | None = 0,
    *,
    executor: Executor = "auto",
    workers: int | None = None,
    timeout: float | None = None,
) -> OnCpu:
    """Run ``fn`` on all CPU cores, callable from inside ``jit``, ``shard_map``, ``vmap``, ``scan``.

    ``fn`` takes and returns pytrees of arrays and must be **row-independent**: row ``i`` of every
    output depends only on row ``i`` of the batched inputs (and on the shared ones). The batch is
    split over ``workers`` CPU workers (padded by repeating the last row to a multiple of the
    chunk size, padding stripped), each runs ``fn`` on its chunk, and the results come back in
    order. Outputs carry the batch on axis 0. Output shapes and dtypes come from ``jax.eval_shape``,
    so errors in ``fn`` (shape mismatches, a ``raise``) surface at trace time in the caller.

    Args:
      fn: the function, e.g. a GRU audio synthesiser ``(params, x[B, T, 1]) -> audio[B, T]``.
      in_axes: like ``jax.vmap``: per positional argument (or pytree prefix), the batch axis
        (an int) or ``None`` for arguments that go whole to every worker, e.g. the rollout
        model's parameters, which may change every call (they are arguments, not constants).
      executor: ``'process'``: a pool of worker processes (one CPU device and one thread each)
        fed through shared memory; safe from any caller. ``'inprocess'``: ``jit(shard_map(fn))``
        over this process's CPU devices (see :func:`rollout.configure_cpu_devices`); no process
        hop, but it deadlocks when the caller itself spans several CPU devices, so it is refused
        there with a ``RuntimeError``. The caller's devices are read at trace time from the
        shardings of the inputs and from the ambient mesh; a multi-device CPU program whose
        inputs to ``fn`` all sit on one device is not detected. For CPU callers an in-process
        call that takes longer than ``timeout`` (default 300 s) is then reported as that
        deadlock (a ``RuntimeError`` and a log line), but the program's other devices may stay
        blocked in a collective, so on CPU-only hosts prefer ``'auto'``.
        ``'auto'`` (default): ``'inprocess'`` when the caller runs on an accelerator and this
        process has several CPU devices, else ``'process'``.
      workers: how many CPU workers (default: the CPU cores this process may use for
        ``'process'``; the CPU devices for ``'inprocess'``).
      timeout: seconds a call may wait for its workers (default: no limit for the process
        executor, where a dead worker is detected within 0.2 s anyway; 300 s for in-process
        calls from CPU callers, see above).

    Returns:
      An :class:`OnCpu` callable with ``fn``'s signature. Worker processes start on the first
      call and stop at ``close()`` (or ``with on_cpu(...) as f:``) and at interpreter exit.
      Wrappers with the same worker count share one pool of processes.

    Gradients: none flow through ``on_cpu`` — inputs are wrapped in ``lax.stop_gradient``, so
    differentiating a loss that uses its outputs treats them as constants (zero gradient with
    respect to ``fn``'s inputs), exactly as the rollout-then-train pattern wants.

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
    return OnCpu(fn, in_axes, executor, workers, timeout)
