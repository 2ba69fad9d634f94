"""The out-of-process executor: single-device JAX worker processes fed through shared memory.

Why processes: a ``pure_callback`` that calls back into JAX deadlocks when the calling program spans
several CPU devices (see ``shared/FIELD-NOTES.md``). Worker processes have their own JAX runtime, so
the callback only copies NumPy arrays and waits on sockets: safe from any caller.

Why ``subprocess`` and not ``multiprocessing``'s spawn context: spawn re-imports the user's
``__main__`` in every worker (a script without an ``if __name__ == "__main__"`` guard would run
again, and JAX would be imported before the worker could pin it to one device and one thread). A
fresh ``python _worker.py`` with a prepared environment does neither.
"""

from __future__ import annotations

import atexit
import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from multiprocessing import shared_memory
from multiprocessing.connection import Connection, wait

import numpy as np

_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_worker.py")
_ALIGN = 64
_POLL_S = 0.2  # how often a waiting caller checks that every worker is still alive

_live_pools: weakref.WeakSet[ProcessPool] = weakref.WeakSet()


class WorkerError(RuntimeError):
    """A worker process failed: it raised (type and message quoted) or it died (exit code)."""


def default_workers() -> int:
    """CPU cores this process may use (``os.sched_getaffinity`` where available)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return max(1, os.cpu_count() or 1)


def _worker_env(x64: bool) -> dict[str, str]:
    env = dict(os.environ)
    # Drop any device-count flag meant for the parent, then pin one device and one thread.
    flags = [
        f
        for f in env.get("XLA_FLAGS", "").split()
        if not f.startswith(
            (
                "--xla_force_host_platform_device_count",
                "--xla_cpu_multi_thread_eigen",
                "intra_op_parallelism_threads",
            )
        )
    ]
    flags += ["--xla_cpu_multi_thread_eigen=false", "intra_op_parallelism_threads=1"]
    env["XLA_FLAGS"] = " ".join(flags)
    env["JAX_PLATFORMS"] = "cpu"  # never grab the accelerator from a worker
    env["JAX_NUM_CPU_DEVICES"] = "1"
    env["JAX_ENABLE_X64"] = "1" if x64 else "0"  # dtypes must match the exported program
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = "1"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            return f"exited with code {code}"
    return f"exited with code {code}"


class _Worker:
    def __init__(self, index: int, env: dict[str, str]):
        parent_sock, child_sock = socket.socketpair()
        self.index = index
        self.proc = subprocess.Popen(
            [sys.executable, "-u", _WORKER, str(child_sock.fileno())],
            env=env,
            pass_fds=(child_sock.fileno(),),
            stdin=subprocess.DEVNULL,
        )
        child_sock.close()
        self.conn = Connection(parent_sock.detach())
        self.programs: set = set()  # program keys this worker has compiled

    @property
    def pid(self) -> int:
        return self.proc.pid

    def dead_message(self) -> str | None:
        code = self.proc.poll()
        if code is None:
            return None
        return f"on_cpu worker {self.index} (pid {self.pid}) {_describe_exit(code)}"


class ProcessPool:
    """W worker processes, each running exported programs on one CPU device.

    Thread-safe: a call holds the pool's lock for its whole duration (``shard_map`` calls the
    callback once per device, possibly from several threads at once), and spreads its own rows over
    all workers, so serialising calls loses no cores.
    """

    def __init__(self, workers: int, *, startup_timeout: float = 300.0):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.num_workers = workers
        self.startup_timeout = startup_timeout
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self._owner = os.getpid()
        self._shm: shared_memory.SharedMemory | None = None
        self._ids = itertools.count()
        _live_pools.add(self)

    # ------------------------------------------------------------------ lifecycle
    @property
    def pids(self) -> list[int]:
        """Process ids of the running workers (empty before the first call and after close)."""
        return [w.pid for w in self._workers]

    def _start(self) -> None:
        import jax

        env = _worker_env(bool(jax.config.jax_enable_x64))
        self._owner = os.getpid()
        self._workers = [_Worker(i, env) for i in range(self.num_workers)]
        deadline = time.monotonic() + self.startup_timeout
        pending = {w.conn: w for w in self._workers}
        while pending:
            for conn in wait(list(pending), timeout=_POLL_S):
                w = pending.pop(conn)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    self._shutdown()
                    raise WorkerError(
                        f"on_cpu worker {w.index} failed to start: {w.dead_message() or 'closed'}"
                        " (its stderr is above)"
                    ) from None
                assert msg[0] == "ready", msg
            for w in pending.values():
                if (dead := w.dead_message()) is not None:
                    self._shutdown()
                    raise WorkerError(f"{dead} while starting (its stderr is above)")
            if time.monotonic() > deadline:
                self._shutdown()
                raise WorkerError(
                    f"on_cpu workers did not start within {self.startup_timeout:.0f} s; "
                    "is the machine overloaded? Pass fewer workers."
                )

    def _shutdown(self) -> None:
        workers, self._workers = self._workers, []
        if workers and os.getpid() != self._owner:
            return  # a forked child: the workers belong to the parent, leave them alone
        for w in workers:
            try:
                w.conn.send(("close",))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 5.0
        for w in workers:
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
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

    # ------------------------------------------------------------------ one call
    def _buffer(self, size: int) -> shared_memory.SharedMemory:
        if self._shm is None or self._shm.size < size:
            if self._shm is not None:
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
        outputs with all (padded) rows.
        """
        rows = batched[0].shape[0]
        active = rows // chunk
        if active > self.num_workers or active * chunk != rows:
            raise ValueError(f"{rows} rows do not split into <= {self.num_workers} x {chunk}")
        with self._lock:
            if not self._workers:
                self._start()
            # Layout: batched inputs, shared inputs, outputs, each 64-byte aligned.
            offset = 0
            layout = []
            arrays = [*batched, *shared]
            out_full = [((rows, *shape), np.dtype(dt)) for shape, dt in outs]
            for shape, dt in [(a.shape, a.dtype) for a in arrays] + out_full:
                layout.append(offset)
                nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
                offset += -(-max(nbytes, 1) // _ALIGN) * _ALIGN
            shm = self._buffer(offset)
            for a, off in zip(arrays, layout, strict=False):
                np.ndarray(a.shape, a.dtype, buffer=shm.buf, offset=off)[...] = a
            nb, na = len(batched), len(arrays)
            call_id = next(self._ids)
            pending = {}
            for i in range(active):
                w = self._workers[i]
                ins = []
                for j, a in enumerate(arrays):
                    row = a[0].nbytes if j < nb else 0
                    shape = (chunk, *a.shape[1:]) if j < nb else a.shape
                    ins.append((layout[j] + i * chunk * row, shape, a.dtype.str))
                outs_i = []
                for j, (shape, dt) in enumerate(out_full):
                    row = int(np.prod(shape[1:], dtype=np.int64)) * dt.itemsize
                    outs_i.append((layout[na + j] + i * chunk * row, (chunk, *shape[1:]), dt.str))
                send = None if key in w.programs else program
                try:
                    w.conn.send(("run", call_id, shm.name, shm.size, key, send, ins, outs_i))
                except OSError:
                    pass  # a dead worker is reported below with its exit code
                w.programs.add(key)
                pending[w.conn] = w
            self._collect(pending, key, timeout)
            results = [
                np.array(np.ndarray(shape, dt, buffer=shm.buf, offset=layout[na + j]))
                for j, (shape, dt) in enumerate(out_full)
            ]
            return results

    def _collect(self, pending: dict, key: object, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        errors = []
        while pending:
            for conn in wait(list(pending), timeout=_POLL_S):
                w = pending.pop(conn)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    try:
                        w.proc.wait(timeout=5.0)
                    except subprocess.TimeoutExpired:
                        pass
                    errors.append(w.dead_message() or f"on_cpu worker {w.index} closed its socket")
                    continue
                if msg[0] == "err":
                    _, _, tname, text, tb = msg
                    w.programs.discard(key)  # resend the program next time, it may not have loaded
                    errors.append(
                        f"on_cpu worker {w.index} (pid {w.pid}) raised {tname}: {text}\n"
                        f"--- worker traceback ---\n{tb}"
                    )
            for conn, w in list(pending.items()):
                if (dead := w.dead_message()) is not None:
                    pending.pop(conn)
                    errors.append(dead)
            if deadline is not None and pending and time.monotonic() > deadline:
                errors.append(f"on_cpu workers did not answer within {timeout} s")
                break
        if errors:
            crashed = any("raised" not in e for e in errors)
            if crashed:
                # A dead or stuck worker leaves the pool unusable: restart it on the next call.
                self._shutdown()
            raise WorkerError("; ".join(errors))


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
            pool.close()
        except Exception:
            pass
