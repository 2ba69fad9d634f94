"""The parent side of the host-env workers: one ``WorkerGroup`` per device's members.

A group owns a few worker processes (``_worker.py``) that hold the environment instances of the
members on one device, split into contiguous row ranges. A step's actions and results travel
through arrays in memory the group and its workers share (``_worker.SharedArrays``); the socket
carries only a short message per worker and step. Every request goes to all of the group's
workers at once and the group waits for all answers, checking every 0.2 s that each worker is
still alive: a worker that raised, died or (with ``timeout``) stalled becomes a ``HostEnvError``
naming the env, the worker, its pid and the members whose envs it held, never a hang.

Workers are started with ``subprocess`` (a fresh interpreter, like ``rollout._pool``): forking a
process that runs JAX is unsafe, and ``multiprocessing``'s spawn would re-run the user's
``__main__``. They exit on ``close()``, at interpreter exit (``atexit``), and on their own when
the parent dies (their socket closes).
"""

from __future__ import annotations

import atexit
import os
import secrets
import subprocess
import sys
import time
import weakref
from collections.abc import Sequence
from typing import Any

import jax  # noqa: F401  (before this module registers _close_all: see there)
import numpy as np

from rollout._relay import finish_dispatched
from rollout._spawn import STOPPED_LIMIT_S, exit_text, note_stopped, reap, spawn
from rollout.hostenv import _fast
from rollout.hostenv._fast import Control
from rollout.hostenv._worker import (
    CLOSE,
    ERR,
    INIT,
    RESET,
    STEP,
    STEP_FIELDS,
    SharedArrays,
    Wire,
    step_spec,
)

_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_worker.py")
WORKER_NAME = "hostenv-worker"  # a forked worker's process name (its cmdline is the template's)
_POLL_S = 0.2  # how often a waiting caller checks that every worker is still alive
_live: weakref.WeakSet[WorkerGroup] = weakref.WeakSet()


class _GiveUp(Exception):
    """Ends the wait for an answer that has begun: its worker died or the deadline passed."""


class HostEnvError(RuntimeError):
    """A host env worker failed: its env raised (type, message and traceback quoted), the worker
    died (exit code or signal), or it did not answer within the timeout."""


def _exit_text(code: int | None) -> str:
    return exit_text(code, running="did not answer")


class _Worker:
    def __init__(self, index: int, rows: range, env: dict[str, str], poll: float, start: tuple):
        self.index, self.rows = index, rows
        self.proc, sock = spawn(_WORKER, env, WORKER_NAME, *start)
        self.wire = Wire(sock, timeout=poll)

    @property
    def pid(self) -> int:
        return self.proc.pid


class WorkerGroup:
    """Worker processes holding ``sum(counts)`` env instances: ``counts[i]`` in worker ``i``.

    Args:
      backend: ``'gymnasium'`` or ``'envpool'``.
      env_id: the id given to ``gymnasium.make`` / ``envpool.make``.
      kwargs: keyword arguments for it.
      counts: env instances per worker.
      obs_shape, obs_dtype: one env's observation (uint8 pixels travel as uint8).
      action_shape, action_dtype: one env's action (actions are cast to ``action_dtype``).
      label: how errors name this group (e.g. ``'device group 3 (members 6-7)'``).
      timeout: seconds a request may take before it is an error (None: no limit; a dead worker
        is detected within 0.2 s regardless).
      startup_timeout: seconds the workers may take to import the env library and build envs.
    """

    def __init__(
        self,
        backend: str,
        env_id: str,
        kwargs: dict[str, Any],
        counts: Sequence[int],
        label: str,
        obs_shape: tuple[int, ...],
        obs_dtype: Any,
        action_shape: tuple[int, ...],
        action_dtype: Any,
        timeout: float | None = None,
        startup_timeout: float = 120.0,
    ):
        self.backend, self.env_id, self.kwargs = backend, env_id, dict(kwargs)
        self.counts = [int(c) for c in counts]
        self.spec = step_spec(
            sum(self.counts), tuple(obs_shape), obs_dtype, tuple(action_shape), action_dtype
        )
        self._shared: SharedArrays | None = None
        self.label, self.timeout, self.startup_timeout = label, timeout, startup_timeout
        # The group's state, shared with the FFI step where there is one (``_fast``); also the
        # lock that keeps requests one at a time.
        self.control = self.lock = Control()
        self._workers: list[_Worker] = []
        self._owner = os.getpid()
        self.failed: str | None = None  # why the group stopped, for later calls
        _live.add(self)

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self._workers]

    @property
    def running(self) -> bool:
        return bool(self._workers)

    @property
    def _poll(self) -> float:
        """Seconds between checks on waiting workers: 0.2, or the timeout where it is shorter."""
        return _POLL_S if self.timeout is None else max(1e-3, min(_POLL_S, self.timeout))

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")  # one core per worker (MuJoCo, NumPy BLAS)
        self._owner = os.getpid()
        self.control[_fast.C_SEQ] = self.control[_fast.C_PENDING] = 0
        starts = np.cumsum([0, *self.counts])
        # Forked workers share one import of the env library (EnvPool's takes 3 s).
        start = (("numpy", self.backend), self.startup_timeout)
        path = os.path.join(_shared_dir(), f"rollout-hostenv-{os.getpid()}-{secrets.token_hex(8)}")
        self._shared = SharedArrays(path, self.spec, create=True)
        try:
            for i in range(len(self.counts)):
                rows = range(starts[i], starts[i + 1])
                self._workers.append(_Worker(i, rows, env, self._poll, start))
            init = (list(sys.path), self.backend, self.env_id, self.kwargs)
            for w in self._workers:
                shared = (path, self.spec, w.rows.start, w.rows.stop)
                self._send(w, INIT, 0, (*init, len(w.rows), shared))
            self._collect(self._workers, self.startup_timeout, "start")
        except HostEnvError:
            raise  # the group is closed already
        except BaseException:
            self.close()  # e.g. kwargs that cannot be pickled: no half-started group is left
            raise
        finally:
            os.unlink(path)  # mapped by every live worker now: the file is no longer needed
        self.failed = None
        self._arm()

    def _arm(self) -> None:
        """Lets the FFI step use this group: its sockets and shared arrays' addresses."""
        c, shared = self.control, self._shared
        if len(self._workers) > _fast.MAX_WORKERS or shared is None:
            return
        c[_fast.C_OWNER], c[_fast.C_NWORKERS] = os.getpid(), len(self._workers)
        # The handler waits as long as a Python wait would before it hands the step to Python,
        # and never past the step's timeout.
        wait = self._poll if self.timeout is None else min(self._poll, self.timeout)
        c[_fast.C_ROWS], c[_fast.C_WAIT_NS] = sum(self.counts), round(wait * 1e9)
        for i, w in enumerate(self._workers):
            c[_fast.C_FDS + i] = w.wire.sock.fileno()
        fields = {"action": _fast.C_ACTION, "obs": _fast.C_OBS, "reward": _fast.C_REWARD,
                  "terminated": _fast.C_TERM, "truncated": _fast.C_TRUNC,
                  "final_obs": _fast.C_FINAL}  # fmt: skip
        for name, field in fields.items():
            c[field] = shared[name].ctypes.data
        c[_fast.C_ACTION_BYTES] = shared["action"].nbytes
        c[_fast.C_OBS_BYTES] = shared["obs"].nbytes
        c[_fast.C_ARMED] = 1

    def close(self) -> None:
        """Stops the workers (they are restarted by the next ``start``)."""
        self.control[_fast.C_ARMED] = self.control[_fast.C_PENDING] = 0
        workers, self._workers = self._workers, []
        if not workers or os.getpid() != self._owner:
            return  # nothing running, or a forked child: the workers belong to the parent
        for w in workers:
            self._send(w, CLOSE)
        reap(w.proc for w in workers)
        for w in workers:
            w.wire.close()
        if self._shared is not None:
            self._shared.close()
            self._shared = None

    # ------------------------------------------------------------------ requests

    def reset(self, seeds: np.ndarray) -> np.ndarray:
        """Resets every env with its own seed; returns the stacked first observations."""
        return self._request(RESET, seeds)

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, ...]:
        """Steps every env; returns ``(obs, reward, terminated, truncated, final_obs)``."""
        self._check()
        self._shared["action"][...] = actions  # type: ignore[index]
        self._request(STEP, None)
        return self._results()

    def finish_step(self) -> tuple[np.ndarray, ...]:
        """Finishes a step the FFI handler sent but did not see answered: collects the answers
        the workers in ``C_PENDING`` still owe (the deadline counts from the step's start)."""
        self._check()
        mask = self.control[_fast.C_PENDING]
        pending = [w for w in self._workers if mask >> w.index & 1]
        since, seq = self.control[_fast.C_START_NS] / 1e9, self.control[_fast.C_SEQ] - 1
        self._collect(pending, self.timeout, "step", since=since, seq=seq)
        self.control[_fast.C_PENDING] = 0  # answered: the compiled step may send again
        return self._results()

    def _results(self) -> tuple[np.ndarray, ...]:
        return tuple(self._shared[name].copy() for name in STEP_FIELDS)  # type: ignore[index]

    def _check(self) -> None:
        if self.failed is not None:
            raise HostEnvError(f"host env workers were stopped after an error: {self.failed}")
        if not self._workers:
            raise HostEnvError(f"host env {self.env_id!r}, {self.label}: workers not started")

    def _request(self, kind: int, rows: np.ndarray | None) -> Any:
        self._check()
        seq = self.control[_fast.C_SEQ]
        self.control[_fast.C_SEQ] = seq + 1
        what = "reset" if kind == RESET else "step"
        try:
            for w in self._workers:
                part = None if rows is None else rows[w.rows.start : w.rows.stop]
                self._send(w, kind, seq, part)
        except BaseException as e:  # some were sent: their answers must not reach another
            self.stop(f"a {what} was interrupted ({type(e).__name__}) while it was sent")
            raise
        answers = self._collect(self._workers, self.timeout, what, seq=seq)
        if rows is None:
            return None
        return np.concatenate([answers[w.index] for w in self._workers])

    @staticmethod
    def _send(w: _Worker, kind: int, seq: int = 0, payload: Any = None) -> None:
        try:
            w.wire.send(kind, seq, payload)
        except (OSError, ValueError):
            pass  # a dead worker is reported by _collect, with its exit code

    def _where(self, w: _Worker) -> str:
        return (
            f"host env {self.backend}:{self.env_id}, {self.label}, worker {w.index} "
            f"(pid {w.pid}, envs {w.rows.start}-{w.rows.stop - 1} of the group)"
        )

    def _collect(
        self,
        workers: list[_Worker],
        timeout: float | None,
        what: str,
        since: float | None = None,
        seq: int | None = None,
    ) -> dict[int, Any]:
        """Every worker's answer to a request (``what``: 'start', 'reset' or 'step'), in order;
        ``since``: when the request was sent (``time.monotonic()``; default now); ``seq``: its
        sequence number, which each answer must carry.

        An exception that ends the wait early (a ``KeyboardInterrupt`` in a ``recv``) stops
        the group: the answers still owed would otherwise be read by the next request as its
        own, and a retried step would step the envs twice.

        Each ``recv`` waits at most 0.2 s; then every worker still owing an answer is checked
        for life (a dead worker's socket usually closes at once, but not if a process it
        started still holds it) and for the deadline, also while an answer that has begun is
        read. The first failure ends the wait; closing the group then stops the others.
        """
        start = time.monotonic() if since is None else since
        deadline = None if timeout is None else start + timeout
        answers: dict[int, Any] = {}
        errors: list[str] = []
        pending = list(workers)
        try:
            self._gather(pending, start, deadline, what, seq, answers, errors)
        except BaseException as e:
            if pending and not errors:
                why = f"a {what} was interrupted ({type(e).__name__}) before every answer"
                self.stop(why, pending)
            raise
        if errors:  # the envs' states are now unknown: the learner must start over
            self.stop(errors[0].split("\n")[0], owing=[])  # (the stuck ones are killed)
            raise HostEnvError("\n".join(errors))
        return answers

    def stop(self, why: str, owing: list[_Worker] | None = None) -> None:
        """Stops the group after a request was cut short (``why``), killing the workers that
        may still be in it (``owing``; default all): their envs' states are lost with it, and
        their answers must reach no later request. The next session starts it again."""
        self.failed = why
        for w in self._workers if owing is None else owing:
            w.proc.kill()
        self.close()

    def _gather(self, pending, start, deadline, what, seq, answers, errors) -> None:
        """``_collect``'s loop: takes answers from ``pending`` into ``answers`` until none is
        owed or the first failure is in ``errors``."""
        halted: dict[int, float] = {}  # worker index -> since when it has been seen stopped

        def waiting() -> None:  # between the pieces of an answer that has begun
            self._sweep(pending, start, deadline, what, errors, halted, part_way=pending[0])
            if errors:
                raise _GiveUp

        while pending and not errors:
            w = pending[0]
            try:
                msg = w.wire.recv(waiting)
            except _GiveUp:
                break
            except (EOFError, OSError):
                pending.pop(0)
                errors.append(f"{self._where(w)} {self._exit(w)}")
                continue
            if msg is None:
                self._sweep(pending, start, deadline, what, errors, halted)
                continue
            kind, got, payload = msg
            if kind != ERR and deadline is not None and time.monotonic() > deadline:
                self._sweep(pending, start, deadline, what, errors, halted)  # too late
                continue
            pending.pop(0)
            if kind == ERR:
                name, text, tb = payload
                where = f"{self._where(w)} raised {name}: {text}"
                errors.append(f"{where}\n--- worker traceback ---\n{tb}")
            elif seq is not None and got != seq:
                errors.append(
                    f"{self._where(w)} answered request {got} where request {seq} was due (a "
                    "step was duplicated, dropped or reordered)"
                )
            else:
                answers[w.index] = payload

    def _sweep(
        self,
        pending: list[_Worker],
        start: float,
        deadline: float | None,
        what: str,
        errors: list[str],
        halted: dict[int, float],
        part_way: _Worker | None = None,
    ) -> None:
        """Moves the dead among ``pending`` to ``errors``, and all of them once past
        ``deadline``, or without one, a worker stopped (SIGSTOP) for over ``STOPPED_LIMIT_S``,
        which would never answer; ``halted``: since when each was seen stopped; ``part_way``:
        the worker whose answer had begun."""
        for w in list(pending):
            if w.proc.poll() is not None:
                pending.remove(w)
                errors.append(f"{self._where(w)} {self._exit(w)}")
        now = time.monotonic()
        if deadline is not None and pending and now > deadline:
            verb = "start" if what == "start" else f"answer a {what}"
            names = ", ".join(f"worker {w.index} (pid {w.pid})" for w in pending)
            late = f"{names} did not {verb} within {deadline - start:g} s"
            if part_way in pending:
                late += f" (worker {part_way.index} stopped part-way through its answer)"
        elif deadline is None and (frozen := _frozen(pending, halted, now)):
            late = (
                f"worker {frozen.index} (pid {frozen.pid}) stayed stopped (SIGSTOP or SIGTSTP) "
                f"for over {STOPPED_LIMIT_S:g} s while it owed an answer to a {what}, so it could "
                "not answer (a SIGCONT within that time lets the run go on)"
            )
        else:
            return
        errors.append(f"host env {self.backend}:{self.env_id}, {self.label}: {late}")
        for w in pending:
            w.proc.kill()  # stuck (or stopped): closing would wait for them in vain

    @staticmethod
    def _exit(w: _Worker) -> str:
        try:
            w.proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            pass
        return _exit_text(w.proc.poll())


def _frozen(pending: list[_Worker], halted: dict[int, float], now: float) -> _Worker | None:
    """The first of ``pending`` stopped for over ``STOPPED_LIMIT_S`` (``halted``: since when
    each is seen stopped, updated here)."""
    note_stopped({w.index: w.pid for w in pending}, halted, now)
    return next((w for w in pending if now - halted.get(w.index, now) > STOPPED_LIMIT_S), None)


def _shared_dir() -> str:
    """Where the shared arrays' file goes: RAM-backed ``/dev/shm`` where there is one."""
    import tempfile

    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()


@atexit.register
def _close_all() -> None:
    """At exit: lets the programs already dispatched make their steps first (registered after
    JAX's own exit handlers, so this runs before them), then closes every group under its lock:
    closing under a running step would have it restart the envs, or read closed arrays."""
    if not _live:
        return
    finish_dispatched()
    for group in list(_live):
        try:
            with group.lock:
                group.close()
        except Exception:
            pass


class InProcessGroup:
    """The envs of one device's members in this process, stepped by the callback thread itself.

    ``workers_per_device=0``: no process hop per step, but the envs share this process's
    interpreter, so pure-Python envs of different devices take turns on the GIL, and an env
    that crashes the interpreter takes the learner with it. EnvPool pools step on ``threads``
    C++ threads of their own in all (unless ``make`` kwargs set ``num_threads``). Same
    interface and error messages as ``WorkerGroup``.
    """

    def __init__(
        self,
        backend: str,
        env_id: str,
        kwargs: dict[str, Any],
        rows: int,
        label: str,
        obs_shape: tuple[int, ...],
        obs_dtype: Any,
        action_shape: tuple[int, ...],
        action_dtype: Any,
        threads: int = 1,
    ):
        self.backend, self.env_id, self.kwargs = backend, env_id, dict(kwargs)
        self.rows, self.label, self.threads = rows, label, threads
        self.spec = step_spec(rows, tuple(obs_shape), obs_dtype, tuple(action_shape), action_dtype)
        self.control = self.lock = Control()  # never armed: the FFI step is for workers only
        self._envs: Any = None
        self.failed: str | None = None

    pids: list[int] = []  # noqa: RUF012  (no processes, ever)

    @property
    def running(self) -> bool:
        return self._envs is not None

    def start(self) -> None:
        from rollout.hostenv._worker import _BACKENDS

        self.failed = None  # a new session: the envs are made again (a restart after an error)
        self._envs = self._call(
            lambda: _BACKENDS[self.backend](self.env_id, self.kwargs, self.rows, self.threads)
        )

    def close(self) -> None:
        envs, self._envs = self._envs, None
        if envs is not None:
            envs.close()

    def stop(self, why: str, owing: Any = None) -> None:
        """As ``WorkerGroup.stop``: after a step cut short (``why``) the envs' states are
        unknown, so they go, and the next session makes them again."""
        self.failed = why
        try:
            self.close()
        except Exception:
            self._envs = None  # (their own close failed: they are dropped all the same)

    def reset(self, seeds: np.ndarray) -> np.ndarray:
        return self._call(lambda: self._envs.reset(seeds))

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, ...]:
        out = tuple(np.empty(shape, dtype) for _, shape, dtype in self.spec[1:])
        self._call(lambda: self._envs.step(actions, out))
        return out

    def _call(self, fn: Any) -> Any:
        import traceback

        if self.failed is not None:
            raise HostEnvError(f"host envs were stopped after an error: {self.failed}")
        try:
            return fn()
        except Exception as e:
            where = f"host env {self.backend}:{self.env_id}, {self.label}, in process {os.getpid()}"
            self.failed = f"{where} raised {type(e).__name__}: {e}"
            tb = traceback.format_exc()
            try:  # as a worker's envs close when it stops: an env's own processes end too
                self.close()
            except Exception:
                self._envs = None  # the env's error is the one to report
            raise HostEnvError(f"{self.failed}\n--- env traceback ---\n{tb}") from e
