"""One host-env worker process: a few environment instances stepped on request.

Started by ``rollout.hostenv._group`` (``serve(FD)``: a fork of a template process,
``rollout/_template.py``, or a fresh ``python _worker.py FD``; never a fork of the parent, which
holds a JAX runtime). It imports nothing from ``rollout`` and uses one core.

Protocol over the socket ``FD`` (``Wire``: a 16-byte header of kind, payload size and sequence
number, then the payload pickled, if any):

- ``INIT (sys_path, backend, env_id, kwargs, num_envs, shared)`` -> ``READY pid`` or an error.
  ``shared`` = ``(path, spec, lo, hi)``: the group's ``SharedArrays`` file, of which this worker
  owns rows ``lo:hi``.
- ``RESET seq seeds`` -> ``OK seq obs``: each env reset with its own seed.
- ``STEP seq`` -> ``OK seq``, headers alone: steps every env with the actions in the shared
  ``action`` rows and writes ``obs, reward, terminated, truncated, final_obs`` into its rows of
  the shared arrays; an env whose episode ended is reset at once (same-step autoreset, no seed:
  its generator goes on) and ``final_obs`` holds the observation the step really reached. The
  step's arrays never go through the socket, and nothing is pickled: a step costs one 16-byte
  message each way (``multiprocessing.connection``'s pickled messages and its ``wait``
  doubled the CPU time of the round trip, which on a 2-core machine is taken from the envs).
- ``CLOSE`` -> exit.

Every request carries a sequence number ``seq`` that the worker checks against its own count
(``_Sequence``): a request that was duplicated, dropped or reordered on its way here is an error,
never a silently wrong trajectory. Errors come back as ``ERR seq (type, message, traceback)``.
The worker exits when its socket closes (the parent exited or was killed).
"""

from __future__ import annotations

import gc
import itertools
import mmap
import os
import pickle
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

#: What one step writes, in ``SharedArrays`` and in the tuple ``backend.step`` returns.
STEP_FIELDS = ("obs", "reward", "terminated", "truncated", "final_obs")
#: The bits of a step's ``terminated``: the episode ended, and (only with it) the game goes on
#: (EnvPool's ``episodic_life``: a lost life ends a training episode, not the game the metrics
#: count).
TERMINATED, GOES_ON = 1, 2

INIT, READY, RESET, STEP, OK, ERR, CLOSE = range(1, 8)  # message kinds
_HEADER = struct.Struct("<BxxxIq")  # kind, payload bytes, sequence number


class Wire:
    """One end of the socket between a group and a worker: framed messages (see the module
    docstring). ``timeout``: seconds ``recv`` waits for a message to begin (None: forever); it is
    fixed once, so no call changes the socket's mode."""

    def __init__(self, sock: socket.socket, timeout: float | None = None):
        self.sock = sock
        sock.settimeout(timeout)

    def send(self, kind: int, seq: int = 0, payload: Any = None) -> None:
        data = b"" if payload is None else pickle.dumps(payload, pickle.HIGHEST_PROTOCOL)
        self.sock.sendall(_HEADER.pack(kind, len(data), seq) + data)

    def recv(self, waiting: Callable[[], None] | None = None) -> tuple[int, int, Any] | None:
        """``(kind, seq, payload)``; None if no message began within the timeout. Raises
        ``EOFError`` when the other end has closed (its process ended). Once a message has
        begun, its rest is awaited, calling ``waiting()`` at every timeout (it raises to give
        up: its sender died or stopped part-way)."""
        try:
            head = self.sock.recv(_HEADER.size)
        except TimeoutError:
            return None
        if not head:
            raise EOFError("the socket closed")
        if len(head) < _HEADER.size:
            head += self._exactly(_HEADER.size - len(head), waiting)
        kind, size, seq = _HEADER.unpack(head)
        return kind, seq, pickle.loads(self._exactly(size, waiting)) if size else None

    def _exactly(self, n: int, waiting: Callable[[], None] | None) -> bytes:
        buf, got = bytearray(n), 0
        view = memoryview(buf)
        while got < n:
            try:
                k = self.sock.recv_into(view[got:])
            except TimeoutError:
                if waiting is not None:
                    waiting()
                continue
            if not k:
                raise EOFError("the socket closed in the middle of a message")
            got += k
        return bytes(buf)

    def close(self) -> None:
        self.sock.close()


def step_spec(
    rows: int, obs_shape: tuple, obs_dtype: Any, action_shape: tuple, action_dtype: Any
) -> list:
    """The shared arrays of a group of ``rows`` envs: ``[(name, shape, dtype str), ...]``."""
    obs, obs_dtype = (rows, *obs_shape), np.dtype(obs_dtype).str
    return [
        ("action", (rows, *action_shape), np.dtype(action_dtype).str),
        ("obs", obs, obs_dtype),
        ("reward", (rows,), "<f8"),
        ("terminated", (rows,), "|u1"),  # TERMINATED, | GOES_ON where a life was lost
        ("truncated", (rows,), "|b1"),
        ("final_obs", obs, obs_dtype),
    ]


class SharedArrays:
    """Named NumPy arrays laid out in one memory-mapped file that parent and workers map.

    ``create=True`` makes the file (the parent); the workers open it by ``path``. The parent
    unlinks the file once every worker has mapped it, so nothing is left behind if any process
    dies later.
    """

    def __init__(self, path: str, spec: list, create: bool = False):
        offsets, size = [], 0
        for _, shape, dtype in spec:
            size = -(-size // 64) * 64  # every array 64-byte aligned
            offsets.append(size)
            size += int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        size = max(size, 1)
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.arrays = {
            name: np.ndarray(shape, np.dtype(dtype), self._map, offset)
            for (name, shape, dtype), offset in zip(spec, offsets)
        }

    def __getitem__(self, name: str) -> np.ndarray:
        return self.arrays[name]

    def close(self) -> None:
        self.arrays = {}
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with the process


def make_gymnasium(env_id: str, **kwargs: Any) -> Any:
    """``gymnasium.make(env_id, **kwargs)``, its observations made one flat vector where they
    are not a ``Box`` (``Discrete``: one-hot; ``Tuple``, ``Dict``, ``MultiDiscrete``,
    ``MultiBinary``: concatenated) by gymnasium's own ``FlattenObservation``, and a
    ``Discrete`` / ``MultiDiscrete`` action space with a ``start`` made one that starts at 0
    (see :func:`_actions_from_zero`).
    The learner, the workers and ``evaluate`` all make their envs here, so they see the same
    observations and take the same actions."""
    import gymnasium

    env = _actions_from_zero(gymnasium.make(env_id, **kwargs))
    if not isinstance(env.observation_space, gymnasium.spaces.Box):
        try:
            env = gymnasium.wrappers.FlattenObservation(env)
        except Exception as e:  # Text, Graph, Sequence, ...: no fixed-size vector
            env.close()
            raise ValueError(
                f"gymnasium:{env_id}: observation space {env.observation_space} cannot be "
                f"flattened into a vector ({type(e).__name__}: {e})"
            ) from None
    return env


def _actions_from_zero(env: Any) -> Any:
    """``env``, its ``Discrete(n, start=k)`` actions (k != 0) taken as ``Discrete(n)``, and a
    ``MultiDiscrete``'s the same per element: the policy's categorical heads pick indices
    0..n-1, and index i reaches the env as i + k. Without the shift a policy's 0 would be
    stepped as action 0, not the space's first action (or be outside the space, for k > 0).
    A MultiDiscrete's actions also reach it in its own dtype (int64 by default; the policy's
    are int32), in the workers and in ``evaluate`` alike. The wrapper keeps the shift as
    ``action_start`` (see :func:`action_start`), which an exported member adds back."""
    import gymnasium

    space = env.action_space
    if isinstance(space, gymnasium.spaces.Discrete) and int(space.start) != 0:
        start, n = int(space.start), int(space.n)
        shifted = gymnasium.wrappers.TransformAction(
            env, lambda a: int(a) + start, gymnasium.spaces.Discrete(n)
        )
        shifted.action_start = (start,)
        return shifted
    if isinstance(space, gymnasium.spaces.MultiDiscrete):
        start, dtype = space.start.copy(), space.dtype
        zero = gymnasium.spaces.MultiDiscrete(space.nvec, dtype=dtype)
        shifted = gymnasium.wrappers.TransformAction(
            env, lambda a: (np.asarray(a) + start).astype(dtype), zero
        )
        shifted.action_start = tuple(int(s) for s in np.ravel(start))
        return shifted
    return env


def action_start(env: Any) -> tuple[int, ...]:
    """The shift :func:`_actions_from_zero` put on ``env``'s discrete actions: the env's first
    action (per element of a MultiDiscrete); ``()`` where there is none (all start at 0)."""
    import gymnasium

    while isinstance(env, gymnasium.Wrapper):  # outside in; the env itself is never asked
        start = vars(env).get("action_start")
        if start is not None:
            return start if any(start) else ()
        env = env.env
    return ()


def _discrete_sizes(space: Any) -> int | np.ndarray | None:
    """A Discrete space's action count, a MultiDiscrete's ``nvec``, or None (not discrete)."""
    kind = type(space).__name__  # gymnasium's, or the gym spaces of an EnvPool wheel
    if kind == "Discrete":
        return int(space.n)
    if kind == "MultiDiscrete":
        return np.asarray(space.nvec)
    return None


def _check_discrete(actions: np.ndarray, n: int | np.ndarray | None) -> None:
    """Refuses actions outside a Discrete space of ``n`` actions, or per element outside a
    MultiDiscrete of ``nvec`` ``n`` (``None``: not discrete). Discrete actions reach the
    workers as int32 (``HostEnvs.step`` casts them)."""
    if n is None or not actions.size:
        return
    bad = np.flatnonzero((actions < 0) | (actions >= n))
    if not bad.size:
        return
    if np.ndim(n) == 0:
        raise ValueError(
            f"action {actions.flat[bad[0]]} of this worker's env {bad[0]} is outside the "
            f"Discrete action space of {n} actions (integers in [0, {n}))"
        )
    env, j = np.unravel_index(bad[0], actions.shape)
    raise ValueError(
        f"action {actions[env].tolist()} of this worker's env {env} is outside the "
        f"MultiDiscrete action space of nvec {np.asarray(n).tolist()} (element {j} must be in "
        f"[0, {n[j]}))"
    )


class _Gymnasium:
    """``num_envs`` instances of :func:`make_gymnasium` ``(env_id, **kwargs)``, stepped in turn
    (``threads`` is EnvPool's: a gymnasium env steps in the thread that calls it)."""

    def __init__(self, env_id: str, kwargs: dict, num_envs: int, threads: int = 1):
        import gymnasium

        try:
            self.envs = [make_gymnasium(env_id, **kwargs) for _ in range(num_envs)]
        except gymnasium.error.UnregisteredEnv as e:
            # The learner made this id before starting us, so only its registration is missing
            # here: it ran in a script's __main__, or in a module imported there but not here.
            raise ValueError(
                f"{env_id!r} is not registered in the env worker processes ({e}), only in the "
                "learner's: register it in a module and give the id as "
                "'gymnasium:<module>:<id>', which every worker imports"
            ) from None
        space = self.envs[0].action_space
        self.actions = _discrete_sizes(space)
        self.obs_shape = self.envs[0].observation_space.shape
        self.pixels = np.dtype(self.envs[0].observation_space.dtype) == np.uint8

    def reset(self, seeds: np.ndarray) -> np.ndarray:
        firsts = [_reset_obs(env, seed=int(s)) for env, s in zip(self.envs, seeds)]
        return np.stack([self._checked(obs, "reset") for obs in firsts])

    def step(self, actions: np.ndarray, out: tuple[np.ndarray, ...]) -> None:
        obs, reward, term, trunc, final = out
        _check_discrete(actions, self.actions)
        for i, env in enumerate(self.envs):
            # Each env its own writable action: in this process (workers_per_device=0) the
            # rows are the callback's read-only view, and an env that scales its action in
            # place failed there with NumPy's "output array is read-only" (not in a worker).
            action = int(actions[i]) if isinstance(self.actions, int) else np.array(actions[i])
            o, r, te, tr, _ = _five(env.step(action))
            te, tr = _flag(te, "terminated"), _flag(tr, "truncated")
            final[i], reward[i], term[i], trunc[i] = self._checked(o, "step"), _number(r), te, tr
            obs[i] = self._checked(_reset_obs(env), "reset") if (te or tr) else o

    def _checked(self, obs: Any, where: str) -> Any:
        """``obs``, refused where its shape is not the observation space's (NumPy would
        broadcast a (1,) into a (3,) row without a word), or where a uint8 space gets values
        outside 0-255 (NumPy would wrap 256 to 0) or with fractions (cut off)."""
        if np.shape(obs) != self.obs_shape:
            raise ValueError(
                f"{where} returned an observation of shape {np.shape(obs)}; the env's "
                f"observation space has shape {self.obs_shape}"
            )
        obs_array = np.asarray(obs)
        if self.pixels and obs_array.dtype != np.uint8 and obs_array.size:
            low, high = np.min(obs_array), np.max(obs_array)
            if not 0 <= low <= high <= 255:
                raise ValueError(
                    f"{where} returned observation values in [{low}, {high}]; the env's "
                    "observation space is uint8 (0-255), and they would wrap around"
                )
            if obs_array.dtype.kind == "f" and not np.array_equal(obs_array, np.rint(obs_array)):
                raise ValueError(
                    f"{where} returned observation values with fractions (dtype "
                    f"{obs_array.dtype}); the env's observation space is uint8 (whole numbers "
                    "0-255), which would cut them off: declare a float Box, or return uint8"
                )
        return obs

    def close(self) -> None:
        for env in self.envs:
            env.close()


def _reset_obs(env: Any, **kwargs: Any) -> Any:
    """The observation of ``env.reset()``, which gymnasium's API makes ``(obs, info)``."""
    out = env.reset(**kwargs)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise ValueError(
            f"reset returned a {type(out).__name__}, not (observation, info) as gymnasium's "
            "API has it (an env written for gym < 0.26 returns the observation alone)"
        )
    return out[0]


def _five(out: Any) -> tuple:
    """``env.step``'s result, refused by name where it is not gymnasium's 5-tuple: an env
    written for gym < 0.26 returns ``(obs, reward, done, info)``, which would otherwise fail
    as "not enough values to unpack", naming nothing."""
    if isinstance(out, tuple) and len(out) == 5:
        return out
    what = f"a {len(out)}-tuple" if isinstance(out, tuple) else f"a {type(out).__name__}"
    raise ValueError(
        f"step returned {what}, not gymnasium's (obs, reward, terminated, truncated, info) "
        "(gym < 0.26 returned (obs, reward, done, info))"
    )


def _flag(value: Any, name: str) -> bool:
    """``terminated`` / ``truncated`` as a bool; anything but a bool (or a 0 / 1) is refused:
    NumPy stores None as False (an episode that never ends) and the string 'no' as True."""
    if value is True or value is False:  # the usual case, first: this runs every env step
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    if isinstance(value, np.ndarray) and value.shape == () and value.dtype == bool:
        return bool(value)
    raise ValueError(f"step returned {name}={value!r} ({type(value).__name__}); {name} is a bool")


def _number(reward: Any) -> float:
    """One step's reward as a float; anything but one real number is refused (NumPy would
    take None as NaN and the string '1' as 1.0 without a word)."""
    if isinstance(reward, (bool, int, float, np.bool_, np.integer, np.floating)) or (
        isinstance(reward, np.ndarray) and reward.shape == () and reward.dtype.kind in "biuf"
    ):
        return float(reward)
    raise ValueError(
        f"step returned the reward {reward!r} ({type(reward).__name__}); a reward is one real "
        "number"
    )


#: EnvPool families whose ``max_episode_steps`` only truncates episodes (it changes no reward
#: or observation), so this layer can apply the limit itself.
ATARI = "envpool.atari"  # EnvPool's family of the Atari tasks
_ENVPOOL_OWN_LIMIT = (ATARI, "envpool.box2d", "envpool.classic_control", "envpool.mujoco.gym")


class _EnvPool:
    """``num_envs`` EnvPool envs, env ``j`` seeded with ``seeds[j]``, stepped synchronously.

    EnvPool seeds a pool, not an env (env ``i`` of a pool made with ``seed=s`` gets ``s + i``),
    so each run of consecutive seeds gets a pool of its own. The learner gives all envs
    consecutive seeds, so a worker's envs are one pool, seeded as they would be in one pool of
    all envs whichever workers and devices hold them. Several pools step at once, each on its
    own C++ threads (``threads`` in all unless the kwargs set ``num_threads``).

    EnvPool resets a finished env on the *next* step; resetting the finished ones right away
    gives the same-step autoreset of the gymnasium backend, and the done step itself already
    returns the true final observation. A terminated env is reset by EnvPool's own autoreset (an
    action sent to it), which after a lost life under ``episodic_life`` carries on the same
    game; a truncated one by ``reset``, a new game.

    Atari's ``reward_clip`` is not passed to EnvPool: the raw reward comes back, and the layer
    clips it on the device (``HostEnvs.step``), so the metrics can report the game's score.

    EnvPool reports a step that ends an episode on its time limit as truncated only, terminal
    or not. Gymnasium's ``TimeLimit`` reports both, and a terminal state must not be bootstrapped.
    For the families in ``_ENVPOOL_OWN_LIMIT`` the pools get one step more than the limit and
    the limit is applied here, from EnvPool's own ``elapsed_step`` (per game, over lives).
    """

    def __init__(self, task: str, kwargs: dict, num_envs: int, threads: int = 1):
        import envpool
        from envpool.registration import registry

        self.kwargs, self.task, self.num_envs, self.threads = dict(kwargs), task, num_envs, threads
        self.pools: list[tuple[Any, slice]] = []  # (pool, its rows)
        self.actions: int | np.ndarray | None = None  # see _discrete_sizes, once a pool exists
        self.limit: int | None = None  # the time limit applied here, if any
        family = registry.specs[task][0]
        # Atari's info says when a game is over (ViZDoom's episodic_life has no such key), and
        # its reward_clip is the reward's sign, which the layer applies on the device instead.
        self.lives = family == ATARI and bool(self.kwargs.get("episodic_life"))
        if family == ATARI:
            self.kwargs.pop("reward_clip", None)
        if family in _ENVPOOL_OWN_LIMIT:
            self.limit = int(envpool.make_spec(task, **self.kwargs).config.max_episode_steps)
            # One step more for the pool, within its int32 (2**31 - 1 is EnvPool's no limit).
            self.kwargs["max_episode_steps"] = min(self.limit + 1, 2**31 - 1)

    def reset(self, seeds: np.ndarray) -> np.ndarray:
        import envpool

        self.close()  # a pool per reset keeps every reset reproducible from its seeds
        seeds = np.asarray(seeds, np.int64)
        if seeds.shape != (self.num_envs,):
            raise ValueError(f"{self.num_envs} envs take {self.num_envs} seeds, got {seeds.shape}")
        if seeds.size and not (0 <= seeds.min() and seeds.max() < 2**31):
            raise ValueError("EnvPool seeds are int32: got seeds outside [0, 2**31)")
        cuts = [0, *(np.flatnonzero(np.diff(seeds) != 1) + 1), len(seeds)]
        runs = [slice(int(a), int(b)) for a, b in itertools.pairwise(cuts)]
        kw = {"num_threads": max(1, self.threads // len(runs)), **self.kwargs}
        obs = []
        for rows in runs:
            pool = envpool.make(self.task, env_type="gymnasium", num_envs=rows.stop - rows.start,
                                seed=int(seeds[rows.start]), **kw)  # fmt: skip
            self.pools.append((pool, rows))
            space = pool.action_space
            self.actions = _discrete_sizes(space)
            o, info = pool.reset()
            obs.append(np.asarray(o)[np.argsort(info["env_id"])])
        return np.concatenate(obs)

    def step(self, actions: np.ndarray, out: tuple[np.ndarray, ...]) -> None:
        _check_discrete(actions, self.actions)  # EnvPool itself takes any integer
        for pool, rows in self.pools:  # all pools step at once, each on its own threads
            pool.send(np.asarray(actions[rows]), np.arange(rows.stop - rows.start, dtype=np.int32))
        for pool, rows in self.pools:
            result = pool.recv(reset=False, return_info=True)
            order = np.argsort(result[4]["env_id"])  # rows in env order, whatever order they came
            for target, value in zip(out, result[:4]):
                target[rows] = np.asarray(value)[order]
            obs, _, term, trunc, final = (x[rows] for x in out)
            final[...] = obs
            if self.limit is not None:  # EnvPool's own limit is one step further
                trunc[...] = np.asarray(result[4]["elapsed_step"])[order] >= self.limit
            ended = term.astype(bool)
            self._restart(pool, obs, np.flatnonzero(ended & ~trunc), np.flatnonzero(trunc), actions)
            if self.lives:  # a life lost, the game not over (EnvPool's info: the game's end)
                game_over = np.asarray(result[4]["terminated"], bool)[order]
                term[...] = ended * TERMINATED | (ended & ~game_over & ~trunc) * GOES_ON

    @staticmethod
    def _restart(pool: Any, obs: np.ndarray, ended: np.ndarray, cut: np.ndarray, actions) -> None:
        """Writes the first observation of the next episode of the ended and the cut envs."""
        if ended.size:  # EnvPool's autoreset: ignores the action, rewards 0
            pool.send(np.zeros_like(actions[: ended.size]), ended.astype(np.int32))
            fresh, *_, info = pool.recv(reset=False, return_info=True)
            obs[np.asarray(info["env_id"])] = np.asarray(fresh)
        if cut.size:
            fresh, info = pool.reset(cut.astype(np.int32))
            obs[np.asarray(info["env_id"])] = np.asarray(fresh)

    def close(self) -> None:
        pools, self.pools = self.pools, []
        for pool, _ in pools:
            pool.close()


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


def _step(backend: Any, shared: SharedArrays, lo: int, hi: int) -> None:
    """One step of this worker's envs, actions read from and results written to ``shared``."""
    backend.step(shared["action"][lo:hi].copy(), tuple(shared[f][lo:hi] for f in STEP_FIELDS))


def _serve(wire: Wire, backend: Any, shared: SharedArrays, lo: int, hi: int) -> None:
    seq = _Sequence()
    while True:
        try:
            kind, n, payload = wire.recv()  # type: ignore[misc] # no timeout: never None
        except (EOFError, OSError):
            return  # the parent went away
        if kind == CLOSE:
            return
        try:
            seq.check(n)
            result = backend.reset(payload) if kind == RESET else _step(backend, shared, lo, hi)
        except BaseException as e:
            wire.send(ERR, n, (type(e).__name__, str(e), traceback.format_exc()))
            continue
        wire.send(OK, n, result)


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:  # an orphan is adopted by another process
        time.sleep(0.5)
    os._exit(1)  # the parent died (SIGKILL) during a step that may never end (a stuck env)


def main(fd: int) -> None:
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    # A program the env runs must not hold our socket open (a fork still does: the parent then
    # notices our death by watching the process).
    os.set_inheritable(fd, False)
    wire = Wire(socket.socket(fileno=fd))
    try:
        first, _, init = wire.recv()  # type: ignore[misc] # no timeout: never None
    except (EOFError, OSError):
        return
    if first != INIT:  # the parent failed while starting us: it is going away
        return
    sys_path, kind, env_id, kwargs, num_envs, (path, spec, lo, hi) = init
    # The parent's import path, so `module:EnvId` ids and user packages import here too.
    sys.path[:0] = [p for p in sys_path if p not in sys.path]
    try:
        shared = SharedArrays(path, spec)
        backend = _BACKENDS[kind](env_id, kwargs, num_envs)
    except BaseException as e:
        wire.send(ERR, -1, (type(e).__name__, str(e), traceback.format_exc()))
        return
    wire.send(READY, 0, os.getpid())
    try:
        _serve(wire, backend, shared, lo, hi)
    finally:
        try:
            backend.close()
        except Exception:
            pass


def serve(fd: int) -> None:
    """The worker's whole life, in a fresh interpreter or in a fork of a template process."""
    # Stop signals are the parent's to handle: it finishes its step, writes its checkpoint and
    # then closes us. A terminal's Ctrl-C, or a scheduler's SIGTERM, reaches every process of
    # the job, and a worker dying of it first would fail that step. We still end with the
    # parent (our socket closes, or, during a step, `_watch_parent` sees it gone) and on SIGKILL.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        main(fd)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the parent went away while we answered it: nothing left to tell


if __name__ == "__main__":
    # Drop this file's directory from the path: the worker must not shadow user modules.
    sys.path.pop(0)
    serve(int(sys.argv[1]))
    # The parent waits for our exit: skip the interpreter's final collections of the objects
    # JAX (or an env's package) made, 0.1-0.2 s of CPU that only frees memory the OS takes back.
    gc.freeze()
