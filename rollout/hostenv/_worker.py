"""One host-env worker process: a few environment instances stepped on request.

Started by ``rollout.hostenv._group`` as ``python _worker.py FD`` (a fresh interpreter, never a
fork: the parent holds a JAX runtime). It imports neither JAX nor ``rollout``: only NumPy and the
env library, so it starts in well under a second and uses one core.

Protocol over the socket ``FD`` (pickled tuples through ``multiprocessing.connection``):

- ``("init", sys_path, backend, env_id, kwargs, num_envs)`` -> ``("ready", pid)`` or an error.
- ``("reset", seq, seeds)`` -> ``("ok", seq, obs)``: each env reset with its own seed.
- ``("step", seq, actions)`` -> ``("ok", seq, (obs, reward, terminated, truncated, final_obs))``;
  an env whose episode ended is reset at once (same-step autoreset, no seed: its generator goes
  on) and ``final_obs`` holds the observation the step really reached.
- ``("close",)`` -> exit.

Every request carries a sequence number ``seq`` that the worker checks against its own count
(``_Sequence``): a request that was duplicated, dropped or reordered on its way here is an error,
never a silently wrong trajectory. Errors come back as ``("err", seq, type, message, traceback)``.
The worker exits when its socket closes (the parent exited or was killed).
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

import numpy as np


class _Gymnasium:
    """``num_envs`` instances of ``gymnasium.make(env_id, **kwargs)``."""

    def __init__(self, env_id: str, kwargs: dict, num_envs: int):
        import gymnasium

        self.envs = [gymnasium.make(env_id, **kwargs) for _ in range(num_envs)]
        self.discrete = isinstance(self.envs[0].action_space, gymnasium.spaces.Discrete)

    def reset(self, seeds: np.ndarray) -> np.ndarray:
        return np.stack([env.reset(seed=int(s))[0] for env, s in zip(self.envs, seeds)])

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, ...]:
        n = len(self.envs)
        obs, final = [None] * n, [None] * n
        reward = np.zeros(n, np.float64)
        term, trunc = np.zeros(n, bool), np.zeros(n, bool)
        for i, env in enumerate(self.envs):
            action = int(actions[i]) if self.discrete else actions[i]
            o, r, te, tr, _ = env.step(action)
            final[i], reward[i], term[i], trunc[i] = o, r, te, tr
            obs[i] = env.reset()[0] if (te or tr) else o
        return np.stack(obs), reward, term, trunc, np.stack(final)

    def close(self) -> None:
        for env in self.envs:
            env.close()


class _EnvPool:
    """One EnvPool pool of ``num_envs`` envs (its own C++ threads), stepped synchronously.

    EnvPool resets a finished env on the *next* step; resetting the finished ones right away
    (``reset(env_id)``) gives the same-step autoreset of the gymnasium backend, and the done step
    itself already returns the true final observation.
    """

    def __init__(self, task: str, kwargs: dict, num_envs: int):
        import envpool  # noqa: F401  (fail at start, not at the first reset)

        self.kwargs = dict(kwargs)
        self.task = task
        self.num_envs = num_envs
        self.pool: Any = None
        self.ids = np.arange(num_envs, dtype=np.int32)

    def reset(self, seeds: np.ndarray) -> np.ndarray:
        import envpool

        # EnvPool seeds a pool, not an env: env i gets seed + i. A pool per reset keeps every
        # reset reproducible from its first seed.
        if self.pool is not None:
            self.pool.close()
        kw = dict(num_threads=1, **self.kwargs)
        # EnvPool takes int32 seeds, and env i of the pool gets seed + i.
        seed = int(seeds[0]) % (2**31 - self.num_envs)
        self.pool = envpool.make(
            self.task, env_type="gymnasium", num_envs=self.num_envs, seed=seed, **kw
        )
        obs, info = self.pool.reset()
        return np.asarray(obs)[np.argsort(info["env_id"])]

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, ...]:
        out = self.pool.step(np.asarray(actions), self.ids)
        order = np.argsort(out[4]["env_id"])  # rows in env order, whatever order they came in
        obs, reward, term, trunc = (np.asarray(x)[order] for x in out[:4])
        final = obs.copy()
        done = np.flatnonzero(np.logical_or(term, trunc))
        if done.size:
            fresh, info = self.pool.reset(done.astype(np.int32))
            obs[np.asarray(info["env_id"])] = np.asarray(fresh)
        return obs, reward.astype(np.float64), term.astype(bool), trunc.astype(bool), final

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


_BACKENDS = {"gymnasium": _Gymnasium, "envpool": _EnvPool}


class _Sequence:
    """The worker's own request count; a request out of sequence is refused."""

    def __init__(self) -> None:
        self.next = 0

    def check(self, seq: int) -> None:
        if seq != self.next:
            raise RuntimeError(
                f"request {seq} arrived where request {self.next} was due: a host-env step was "
                "duplicated, dropped or reordered"
            )
        self.next += 1


def _serve(conn: Any, backend: Any) -> None:
    seq = _Sequence()
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the parent went away
        if msg[0] == "close":
            return
        kind, n = msg[0], msg[1]
        try:
            seq.check(n)
            result = backend.reset(msg[2]) if kind == "reset" else backend.step(msg[2])
        except BaseException as e:
            conn.send(("err", n, type(e).__name__, str(e), traceback.format_exc()))
            continue
        conn.send(("ok", n, result))


def main(fd: int) -> None:
    from multiprocessing.connection import Connection

    conn = Connection(fd)
    try:
        _, sys_path, kind, env_id, kwargs, num_envs = conn.recv()
    except (EOFError, OSError):
        return
    # The parent's import path, so `module:EnvId` ids and user packages import here too.
    sys.path[:0] = [p for p in sys_path if p not in sys.path]
    try:
        backend = _BACKENDS[kind](env_id, kwargs, num_envs)
    except BaseException as e:
        conn.send(("err", -1, type(e).__name__, str(e), traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))
    try:
        _serve(conn, backend)
    finally:
        try:
            backend.close()
        except Exception:
            pass


if __name__ == "__main__":
    # Drop this file's directory from the path: the worker must not shadow user modules.
    sys.path.pop(0)
    main(int(sys.argv[1]))
