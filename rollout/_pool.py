"""The out-of-process executor: single-device JAX worker processes fed through shared memory.

Why processes: a ``pure_callback`` that calls back into JAX deadlocks when the calling program spans
several CPU devices (``tests/test_on_cpu.py`` shows it). Worker processes have their own JAX
runtime, so the callback only copies NumPy arrays and waits on sockets: safe from any caller.

Why ``subprocess`` and not ``multiprocessing``'s spawn context: spawn re-imports the user's
``__main__`` in every worker (a script without an ``if __name__ == "__main__"`` guard would run
again, and JAX would be imported before the worker could pin it to one device and one thread). A
``python _worker.py`` with a prepared environment does neither, and neither does a fork of a
template process started that way (``rollout/_template.py``, how workers start on Linux).
"""

from __future__ import annotations

import atexit
import itertools
import os
import subprocess
import threading
import time
import weakref
from collections.abc import Sequence
from multiprocessing import shared_memory
from multiprocessing.connection import Connection, wait

import numpy as np

from rollout._devices import with_thread_flag
from rollout._spawn import STOPPED_LIMIT_S, exit_text, note_stopped, reap, spawn

_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_worker.py")
WORKER_NAME = "on_cpu-worker"  # a forked worker's process name (its cmdline is the template's)
_ALIGN = 64
_POLL_S = 0.2  # how often a waiting caller checks that every worker is still alive

_live_pools: weakref.WeakSet[ProcessPool] = weakref.WeakSet()


class WorkerError(RuntimeError):
    """A worker failed: it raised (type and message quoted), died (exit code) or timed out.

    Raised as is by eager calls of an ``on_cpu`` function. From inside a jitted program JAX wraps
    it in a ``jax.errors.JaxRuntimeError``; :func:`rollout.worker_errors` turns that back into this
    exception.

    Example:
      >>> import jax, jax.numpy as jnp, rollout
      >>> def forever(x):  # a loop that never ends, stopped by the timeout
      ...     return jax.lax.while_loop(lambda v: v[0] > -1.0, lambda v: v + 1.0, x)
      >>> f = rollout.on_cpu(forever, workers=1, timeout=0.2)
      >>> try:
      ...     f(jnp.zeros(2))
      ... except rollout.WorkerError as e:  # any worker failure; the next call restarts them
      ...     print(type(e).__name__)
      WorkerTimeout
      >>> f.close()
    """


class WorkerTimeout(WorkerError, TimeoutError):
    """A call ran over its ``timeout=``, counted from the start of execution (not compile).

    Example:
      >>> import rollout  # caught as a worker failure or as any timeout
      >>> issubclass(rollout.WorkerTimeout, rollout.WorkerError), issubclass(
      ...     rollout.WorkerTimeout, TimeoutError)
      (True, True)
    """


def _worker_env(x64: bool) -> dict[str, str]:
    env = dict(os.environ)
    # Drop any device-count flag meant for the parent, then pin one device and one thread.
    env["XLA_FLAGS"] = with_thread_flag(
        env.get("XLA_FLAGS", ""), drop=("--xla_force_host_platform_device_count",)
    )
    env["JAX_PLATFORMS"] = "cpu"  # never grab the accelerator from a worker
    env["JAX_NUM_CPU_DEVICES"] = "1"
    env["JAX_ENABLE_X64"] = "1" if x64 else "0"  # dtypes must match the exported program
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = "1"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def _describe_exit(code: int | None) -> str:
    return exit_text(code, running="is still running")


class _Worker:
    def __init__(self, index: int, env: dict[str, str], startup_timeout: float):
        self.index = index
        self.proc, sock = spawn(_WORKER, env, WORKER_NAME, ("numpy", "jax"), startup_timeout)
        self.conn = Connection(sock.detach())
        self.programs: set = set()  # program keys this worker holds compiled
        self.drops: set = set()  # keys to tell it to forget with its next message

    @property
    def pid(self) -> int:
        return self.proc.pid

    def dead_message(self) -> str | None:
        code = self.proc.poll()
        if code is None:
            return None
        return f"on_cpu worker {self.index} (pid {self.pid}) {_describe_exit(code)}"

    def death(self) -> str:
        """Message for a worker whose socket closed: it is exiting, wait briefly for its code."""
        try:
            self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
        return self.dead_message() or f"on_cpu worker {self.index} closed its socket"


class ProcessPool:
    """W worker processes, each running exported programs on one CPU device.

    Thread-safe: a call holds the pool's lock for its whole duration (``shard_map`` calls the
    callback once per device, possibly from several threads at once), and spreads its own rows over
    all workers, so serialising calls loses no cores.

    Failures: a worker that died while idle is replaced at the next call; one that dies during a
    call, or a call that exceeds its timeout, is detected within ``_POLL_S`` (0.2 s) and raised as
    :class:`WorkerError` / :class:`WorkerTimeout` after all workers are killed (they restart on
    the next call). Workers keep the programs their wrappers still cache (see :meth:`forget`).
    """

    def __init__(self, workers: int, *, startup_timeout: float = 300.0):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.num_workers = workers
        self.startup_timeout = startup_timeout
        self._lock = threading.Lock()
        self._drop_lock = threading.Lock()
        self._workers: list[_Worker] = []
        self._owner = os.getpid()
        self._x64: bool | None = None
        self._shm: shared_memory.SharedMemory | None = None
        self._ids = itertools.count()
        _live_pools.add(self)

    # ------------------------------------------------------------------ lifecycle
    @property
    def pids(self) -> list[int]:
        """Process ids of the running workers (empty before the first call and after close;
        while workers start, those started so far)."""
        return [w.pid for w in self._workers if w is not None]

    def _spawn(self, indices: Sequence[int]) -> None:
        """Start workers at these indices (replacing what is there) and wait until they are up.
        A start cut short (Ctrl-C, a worker that failed) stops the pool: the next call starts it
        afresh rather than finding half of it."""
        try:
            self._start(indices)
        except BaseException:
            self._shutdown(kill=True)
            raise

    def _start(self, indices: Sequence[int]) -> None:
        env = _worker_env(bool(self._x64))
        fresh = []
        for i in indices:
            fresh.append(_Worker(i, env, self.startup_timeout))
            self._workers[i] = fresh[-1]  # at once, so that an interrupted start stops it
        deadline = time.monotonic() + self.startup_timeout
        pending = {w.conn: w for w in fresh}
        while pending:
            for conn in wait(list(pending), timeout=_POLL_S):
                w = pending.pop(conn)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    raise WorkerError(
                        f"on_cpu worker {w.index} failed to start: {w.death()} "
                        "(its stderr is above)"
                    ) from None
                assert msg[0] == "ready", msg
            for w in pending.values():
                if (dead := w.dead_message()) is not None:
                    raise WorkerError(f"{dead} while starting (its stderr is above)")
            if time.monotonic() > deadline:
                raise WorkerError(
                    f"on_cpu workers did not start within {self.startup_timeout:.0f} s; "
                    "is the machine overloaded? Pass fewer workers."
                )

    def _ensure_workers(self) -> None:
        """Start the pool, restart it for a changed x64 setting, replace workers that died idle."""
        import jax

        x64 = bool(jax.config.jax_enable_x64)
        if self._workers and (x64 != self._x64 or os.getpid() != self._owner):
            self._shutdown()  # dtypes of the exported programs follow x64: workers must match
        if not self._workers:
            self._x64, self._owner = x64, os.getpid()
            self._workers = [None] * self.num_workers  # type: ignore[list-item]
            self._spawn(range(self.num_workers))
            return
        dead = [w for w in self._workers if w.proc.poll() is not None]
        for w in dead:
            w.conn.close()
        if dead:
            self._spawn([w.index for w in dead])

    def _shutdown(self, kill: bool = False) -> None:
        """Stop all workers: politely (``close`` message, 5 s grace), or at once with ``kill``,
        for workers that are busy with a call nobody waits for any more."""
        workers, self._workers = [w for w in self._workers if w is not None], []
        if workers and os.getpid() != self._owner:
            self._shm = None  # a forked child: the workers and the block belong to the parent
            return
        for w in workers:
            try:
                if kill:
                    w.proc.kill()
                else:
                    w.conn.send(("close",))
            except (OSError, ValueError):
                pass
        reap(w.proc for w in workers)
        for w in workers:
            w.conn.close()
        if self._shm is not None:
            self._shm.close()
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass
            self._shm = None

    def close(self) -> None:
        """Stop the workers and free the shared memory. The pool restarts on its next call."""
        with self._lock:
            self._shutdown()

    def forget(self, keys: Sequence[object]) -> None:
        """Let the workers drop these programs (a wrapper evicted them from its cache); they are
        told with their next call, and get the program again if the key comes back."""
        with self._drop_lock:
            for w in self._workers:
                if w is not None:
                    w.drops.update(keys)

    # ------------------------------------------------------------------ one call
    def _buffer(self, size: int) -> shared_memory.SharedMemory:
        if self._shm is None or self._shm.size < size:
            if self._shm is not None:
                # Workers this call leaves idle would keep the old block mapped (its memory
                # held after the unlink) until a later call names another block.
                for w in self._workers:
                    try:
                        w.conn.send(("detach",))
                    except OSError:
                        pass  # a dead worker is reported by the call that uses it
                self._shm.close()
                self._shm.unlink()
            # Grow geometrically so that slowly growing batches do not reallocate every call.
            self._shm = shared_memory.SharedMemory(create=True, size=max(size, 1 << 16) * 3 // 2)
        return self._shm

    def run(
        self,
        key: object,
        program: bytes,
        batched: Sequence[np.ndarray],
        shared: Sequence[np.ndarray],
        outs: Sequence[tuple[tuple[int, ...], np.dtype]],
        chunk: int,
        timeout: float | None = None,
    ) -> list[np.ndarray]:
        """Run the program on ``len(batched[0]) / chunk`` workers, ``chunk`` rows each.

        ``batched`` leaves are already padded to a multiple of ``chunk``; ``shared`` leaves go
        whole to every worker; ``outs`` are the per-row (shape, dtype) of the outputs. Returns
        outputs with all (padded) rows. ``timeout``: seconds each worker may execute, counted
        from when it starts executing (after loading and compiling the program).
        """
        rows = batched[0].shape[0]
        active = rows // chunk
        if active > self.num_workers or active * chunk != rows:
            raise ValueError(f"{rows} rows do not split into <= {self.num_workers} x {chunk}")
        with self._lock:
            self._ensure_workers()
            arrays = [*batched, *shared]
            out_full = [((rows, *shape), np.dtype(dt)) for shape, dt in outs]
            layout, size = _layout([(a.shape, a.dtype) for a in arrays] + out_full)
            shm = self._buffer(size)
            for a, off in zip(arrays, layout, strict=False):
                np.ndarray(a.shape, a.dtype, buffer=shm.buf, offset=off)[...] = a
            call_id = next(self._ids)
            pending = {}
            for i in range(active):
                w = self._workers[i]
                ins = _slices(arrays, layout, len(batched), i, chunk)
                outs_i = _slices_out(out_full, layout[len(arrays) :], i, chunk)
                with self._drop_lock:
                    drops, w.drops = list(w.drops & w.programs), set()
                w.programs.difference_update(drops)
                send = None if key in w.programs else program
                msg = ("run", call_id, shm.name, shm.size, key, send, ins, outs_i, drops)
                try:
                    w.conn.send(msg)
                except OSError:
                    pass  # a dead worker is reported below with its exit code
                w.programs.add(key)
                pending[w.conn] = w
            try:
                self._collect(pending, key, timeout, call_id)
            except BaseException:
                # Interrupted (Ctrl-C in an eager call) with workers still computing into
                # this block: their late outputs would land on the next call's arrays there.
                if pending:
                    self._shutdown(kill=True)  # the next call starts new workers
                raise
            na = len(arrays)
            return [
                np.array(np.ndarray(shape, dt, buffer=shm.buf, offset=layout[na + j]))
                for j, (shape, dt) in enumerate(out_full)
            ]

    def _collect(self, pending: dict, key: object, timeout: float | None, call_id: int) -> None:
        """Wait for every worker's answer; raise what failed (killing the pool if one died, ran
        out of time or stayed stopped, since its peers would otherwise keep computing a dropped
        result).

        Answers to an earlier call are skipped (a worker that answered an interrupted call's
        "start" only). ``pending`` keeps the workers that have not answered: an interrupted
        call's caller stops them, as their outputs would overwrite the next call's."""
        errors: list[str] = []
        broken: type[WorkerError] | None = None
        started: dict = {}  # conn -> when its worker started executing
        halted: dict = {}  # conn -> since when its worker has been seen stopped
        while pending:
            ready = wait(list(pending), timeout=_POLL_S)
            for conn in ready:
                w = pending[conn]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    pending.pop(conn)
                    errors.append(w.death())
                    broken = broken or WorkerError
                    continue
                if msg[1] != call_id:  # a late answer to an interrupted earlier call
                    continue
                if msg[0] == "start":
                    started[conn] = time.monotonic()
                    continue
                pending.pop(conn)
                if msg[0] == "err":
                    _, _, tname, text, tb = msg
                    w.programs.discard(key)  # the worker dropped it too: resend next time
                    errors.append(
                        f"on_cpu worker {w.index} (pid {w.pid}) raised {tname}: {text}\n"
                        f"--- worker traceback ---\n{tb}"
                    )
            for conn, w in list(pending.items()):
                if (dead := w.dead_message()) is not None:
                    pending.pop(conn)
                    errors.append(dead)
                    broken = broken or WorkerError
            if not ready:  # quiet for _POLL_S: look for stopped workers (off the fast path)
                note_stopped({c: w.pid for c, w in pending.items()}, halted, time.monotonic())
            overdue = _overdue(pending, started, halted, timeout)
            if overdue is not None:
                errors.append(overdue[1])
                broken = overdue[0]
            if broken is not None:
                break  # the call cannot complete: do not wait for the other workers
        if broken is not None:
            self._shutdown(kill=True)
        if errors:
            raise (broken or WorkerError)("; ".join(errors))


def _overdue(
    pending: dict, started: dict, halted: dict, timeout: float | None
) -> tuple[type[WorkerError], str] | None:
    """The error for a worker past ``timeout`` of executing, or stopped for longer than
    ``timeout`` (``STOPPED_LIMIT_S`` without one); None while every worker is within its time."""
    now = time.monotonic()
    for conn, w in pending.items():
        if timeout is not None and conn in started and now - started[conn] > timeout:
            return WorkerTimeout, (
                f"on_cpu worker {w.index} (pid {w.pid}) did not finish within "
                f"timeout={timeout:g} s of starting to execute; the workers were stopped and "
                "restart on the next call"
            )
        limit = STOPPED_LIMIT_S if timeout is None else timeout
        if conn in halted and now - halted[conn] > limit:
            what = f"timeout={timeout:g} s" if timeout is not None else f"{limit:g} s"
            return (WorkerTimeout if timeout is not None else WorkerError), (
                f"on_cpu worker {w.index} (pid {w.pid}) stayed stopped (SIGSTOP or SIGTSTP) for "
                f"over {what} during a call, so it could not answer; the workers were killed and "
                "restart on the next call (a SIGCONT within that time lets the call go on)"
            )
    return None


def _layout(items: Sequence[tuple[tuple[int, ...], np.dtype]]) -> tuple[list[int], int]:
    """64-byte aligned offsets of arrays laid out one after another, and the total size."""
    offset, layout = 0, []
    for shape, dt in items:
        layout.append(offset)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        offset += -(-max(nbytes, 1) // _ALIGN) * _ALIGN
    return layout, offset


def _slices(arrays, layout, nb, i, chunk) -> list[tuple[int, tuple[int, ...], str]]:
    """Worker ``i``'s inputs: its ``chunk`` rows of the batched arrays, all of the shared ones.
    Dtypes travel by name: ``dtype.str`` of bfloat16 is the anonymous ``'<V2'``."""
    ins = []
    for j, a in enumerate(arrays):
        row = a[0].nbytes if j < nb else 0
        shape = (chunk, *a.shape[1:]) if j < nb else a.shape
        ins.append((layout[j] + i * chunk * row, shape, a.dtype.name))
    return ins


def _slices_out(out_full, layout, i, chunk) -> list[tuple[int, tuple[int, ...], str]]:
    outs = []
    for j, (shape, dt) in enumerate(out_full):
        row = int(np.prod(shape[1:], dtype=np.int64)) * dt.itemsize
        outs.append((layout[j] + i * chunk * row, (chunk, *shape[1:]), dt.name))
    return outs


_shared: dict[int, ProcessPool] = {}
_shared_lock = threading.Lock()


def shared_pool(workers: int) -> ProcessPool:
    """The process-wide pool with this many workers: every ``on_cpu`` wrapper with the same worker
    count shares it, so wrapping several functions (an env's reset and step) costs no extra
    processes. Programs are cached per wrapper inside the workers."""
    with _shared_lock:
        if workers not in _shared:
            _shared[workers] = ProcessPool(workers)
        return _shared[workers]


@atexit.register
def _close_all() -> None:
    for pool in list(_live_pools):
        try:
            # A call still running in another thread (a daemon thread at exit) holds the lock
            # and may never return: kill its workers then, rather than wait for it.
            if pool._lock.acquire(timeout=1.0):
                try:
                    pool._shutdown()
                finally:
                    pool._lock.release()
            else:
                pool._shutdown(kill=True)
        except Exception:
            pass
