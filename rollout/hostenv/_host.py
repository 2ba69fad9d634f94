"""Host environments (gymnasium, EnvPool) stepped from inside a jitted, member-sharded program.

``HostEnv`` describes an environment (id, backend, ``make`` kwargs, spaces); ``HostEnv.bind``
places the envs of an n-member ensemble on worker processes and returns ``HostEnvs``, whose
``reset`` and ``step`` take and return member-major arrays ``[n, num_envs, ...]`` inside ``jit``:

    jit(update)
      └─ shard_map over the ensemble mesh: one call per device, on that device's members only
           └─ host_call -> the WorkerGroup of that device -> its worker processes

``host_call`` (``rollout._host_call``) is ``io_callback`` without its per-call wrapping of every
argument into a JAX array, which cost more than a MuJoCo step (see that module). On CPU devices
with worker processes, a step is first an XLA FFI call (``_fast``, C++) that makes the plain step
without entering Python; ``host_call`` runs, under a ``lax.cond`` on the handler's status, only
where it did not finish (a restart, an env error, a dead or slow worker). The handler cut the
learner process's CPU per step from about 455 to about 45 us (CartPole, 2 devices).

Why the steps can be neither reordered, dropped nor duplicated:

1. ``host_call`` carries ``io_callback``'s own IO effect and lowers to the same custom call
   marked side-effecting; the FFI call is made with ``has_side_effect=True``, which gives it
   JAX's FFI effect and the same marking. So neither JAX nor XLA removes either as dead code,
   merges it with another or runs it twice (a ``pure_callback`` may be elided or recomputed).
2. Their order comes from data: step k+1's call takes step k's returned ``HostState`` (and
   actions computed from step k's observations), so it cannot start before step k returned;
   the ``host_call`` of a step takes its FFI call's status.
3. Verified, not assumed: ``HostState`` carries a session id and a step counter that both the
   handler and the callback check against the group's own (a replayed or skipped step is an
   error), and every worker checks the sequence number of each request against its own count.

No ordered effect is used: JAX chains ordered effects through a per-thread runtime token,
and a callback that raised (an env error) leaves that token failed, so every later program with
an ordered effect in the process would fail too. The data dependence already orders the steps.

The env state itself stays in the workers; the device carries only ``HostState``: the session id,
the step counter and the last observation (used when the envs restart, see ``HostEnvs.step``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import secrets
import threading
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ensemble._warn import warn_user
from rollout._devices import available_cores
from rollout._host_call import host_call
from rollout._relay import finish_dispatched, remember
from rollout.envs._core import Box, Discrete, MultiDiscrete, Space
from rollout.hostenv import _fast
from rollout.hostenv._fast import C_SESSION, C_T
from rollout.hostenv._group import HostEnvError, InProcessGroup, WorkerGroup

_TERM, _TRUNC, _RESTART, _GOES_ON = 1, 2, 4, 8  # the bits of a step's flags


class HostState(NamedTuple):
    """What the device holds of host envs: ``[n, num_envs]`` ids and counters, the last obs."""

    session: jax.Array  # uint32: which reset of the workers this state belongs to
    t: jax.Array  # int32: steps taken since that reset (checked on every step)
    obs: jax.Array  # [n, num_envs, *obs_shape], the env's dtype: the last observation


def _space(space: Any, what: str, env_name: str) -> Space:
    """A gymnasium Box / Discrete / MultiDiscrete as a ``rollout.envs`` space."""
    import gymnasium

    if isinstance(space, gymnasium.spaces.Discrete) and what == "action":
        if int(space.start) != 0:
            raise ValueError(f"{env_name}: Discrete action spaces must start at 0, got {space}")
        return Discrete(int(space.n))
    if isinstance(space, gymnasium.spaces.MultiDiscrete) and what == "action":
        if np.ndim(space.nvec) != 1:  # (a start is shifted away before: make_gymnasium)
            raise ValueError(
                f"{env_name}: MultiDiscrete action spaces must have a vector nvec (one policy "
                f"head per element), got nvec {np.asarray(space.nvec).tolist()}; flatten it "
                "in the env"
            )
        return MultiDiscrete(tuple(int(n) for n in space.nvec))
    if isinstance(space, gymnasium.spaces.Box):
        if what == "action" and not np.issubdtype(np.dtype(space.dtype), np.floating):
            # The policy's Gaussian samples floats; rounding them would be a different policy.
            raise ValueError(
                f"{env_name}: action space {space} has integer actions, which a Gaussian policy "
                "does not produce; use a Discrete action space, or a float Box that the env "
                "rounds itself."
            )
        low = np.asarray(space.low, np.float64).ravel()
        high = np.asarray(space.high, np.float64).ravel()
        if what == "action":
            low, high = _float32_inside(low, high)
        # uint8 observations (pixels) travel as uint8, a quarter of float32's bytes; anything
        # else as float32, the networks' input type.
        uint8 = what == "observation" and np.dtype(space.dtype) == np.uint8
        return Box(tuple(space.shape), tuple(low), tuple(high), jnp.uint8 if uint8 else jnp.float32)
    raise ValueError(
        f"{env_name}: {what} space {space} is not supported (observations: a Box, or for "
        "gymnasium ids any space gymnasium can flatten; actions: a Box, a Discrete or a "
        "MultiDiscrete)."
    )


def _float32_inside(low: np.ndarray, high: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Action bounds as float32 values inside ``[low, high]``: the learner clips its float32
    actions to them, and a float64 bound such as -0.1 rounds to the float32 -0.10000000149,
    outside the env's box, so a clipped action failed the env's ``action_space.contains``."""
    low32, high32 = low.astype(np.float32), high.astype(np.float32)
    low32 = np.where(low32 < low, np.nextafter(low32, np.float32(np.inf)), low32)
    high32 = np.where(high32 > high, np.nextafter(high32, np.float32(-np.inf)), high32)
    return low32.astype(np.float64), high32.astype(np.float64)


@dataclasses.dataclass(frozen=True, eq=False)
class HostEnv:
    """An environment that runs in CPU worker processes: a gymnasium id or an EnvPool task.

    Make one with ``rollout.envs.make('gymnasium:HalfCheetah-v5', **make_kwargs)`` (or
    ``'envpool:...'``); the learner binds it to its members. The spaces are read once from one
    env built here in the calling process (which also checks the id and kwargs early).

    Attributes:
      backend: ``'gymnasium'`` or ``'envpool'``.
      env_id: the id (gymnasium: any registered id, including ``'module:EnvId-v0'``, which
        imports ``module`` first, in every worker too).
      kwargs: keyword arguments of ``gymnasium.make`` / ``envpool.make``.
      workers_per_device: worker processes per device's members; 0 steps the envs in this
        process instead, from the callback thread of each device (no process hop per step; see
        ``InProcessGroup``; EnvPool pools then run cores / devices C++ threads per device).
        Default: the CPU cores divided by the devices (at least 1). Seeding does not depend on
        it: each env's seed comes from the learner's key for that env (EnvPool: consecutive
        seeds from the first env's key, see ``HostEnvs.reset``).
      timeout: seconds one step or reset may take before it is an error (default: no limit;
        a dead worker is an error within 0.2 s regardless).

    EnvPool's Atari ``reward_clip`` and ``episodic_life`` shape the training signal only: the
    step's ``info["score"]`` is the raw reward and ``info["episode_goes_on"]`` marks a lost life
    that ends a training episode but not the game, so the learner's metrics report games.
    """

    backend: str
    env_id: str
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    workers_per_device: int | None = None
    timeout: float | None = None
    observation_space: Box = dataclasses.field(init=False)
    action_space: Space = dataclasses.field(init=False)
    max_episode_steps: int | None = dataclasses.field(init=False)
    #: A discrete action space's first action(s), where not 0: ``gymnasium.spaces.Discrete(n,
    #: start=k)`` -> ``(k,)``, a MultiDiscrete's ``start`` per element; ``()`` otherwise. The
    #: policy picks indices from 0 (``action_space``); the workers add this before stepping.
    action_start: tuple[int, ...] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        if self.backend not in ("gymnasium", "envpool"):
            raise ValueError(f"backend must be 'gymnasium' or 'envpool', got {self.backend!r}")
        _check_layer_kwargs(self.name, self.workers_per_device, self.timeout)
        obs_space, act_space, limit, start = _probe(self.backend, self.env_id, dict(self.kwargs))
        if not _in_process(self):
            _check_picklable(self.name, dict(self.kwargs))
            if self.backend == "gymnasium":
                _check_registered_outside_main(self.env_id)
        set_ = lambda k, v: object.__setattr__(self, k, v)
        set_("observation_space", _space(obs_space, "observation", self.name))
        set_("action_space", _space(act_space, "action", self.name))
        set_("max_episode_steps", limit)
        set_("action_start", start)

    @property
    def clips_rewards(self) -> bool:
        """EnvPool Atari's ``reward_clip``: the learner trains on the raw reward's sign."""
        if self.backend != "envpool" or not self.kwargs.get("reward_clip", False):
            return False
        from envpool.registration import registry

        from rollout.hostenv._worker import ATARI

        return registry.specs[self.env_id][0] == ATARI

    @property
    def name(self) -> str:
        return f"{self.backend}:{self.env_id}"

    @property
    def unwrapped(self) -> HostEnv:
        return self

    def bind(self, mesh: Mesh, members: int, num_envs: int) -> HostEnvs:
        """The envs of ``members`` agents (``num_envs`` each) on ``mesh``'s devices' workers."""
        return HostEnvs(self, mesh, members, num_envs)


def _check_layer_kwargs(name: str, workers: Any, timeout: Any) -> None:
    """The host layer's own make kwargs, refused here in one line: they arrive from
    ``--env-kwargs`` JSON as anything, and a bad one would fail later, deep in the worker
    group (a traceback for ``"timeout": "60"``, an error at every reset for a negative one)."""
    if workers is not None and (
        isinstance(workers, bool) or not isinstance(workers, numbers.Integral) or workers < 0
    ):
        raise ValueError(
            f"{name}: workers_per_device must be an int >= 0 (0: the envs step in this "
            f"process), got {workers!r}"
        )
    if timeout is not None and (
        isinstance(timeout, bool)
        or not isinstance(timeout, numbers.Real)
        or not 0 < float(timeout) < math.inf
    ):
        raise ValueError(
            f"{name}: timeout must be a number of seconds > 0 (or None: no limit), got {timeout!r}"
        )


#: EnvPool ``make`` arguments the host layer sets itself.
ENVPOOL_POOL_KWARGS = (
    "num_envs", "batch_size", "seed", "env_seed", "env_type", "gym_reset_return_info"
)  # fmt: skip

#: EnvPool ``make`` arguments its spec takes but only its pool checks (some by aborting the
#: process), each with the least value it accepts.
_ENVPOOL_INT_KWARGS = {"num_threads": 0, "thread_affinity_offset": -1, "max_episode_steps": 1}
_INT32_MAX = 2**31 - 1  # EnvPool's ints are C++ int32 (2**31 - 1 its own "no time limit")


def _check_envpool_ints(env_id: str, kwargs: dict[str, Any]) -> None:
    for key, least in _ENVPOOL_INT_KWARGS.items():
        value = kwargs.get(key, least)
        if (
            isinstance(value, bool)
            or not isinstance(value, numbers.Integral)
            or not least <= value <= _INT32_MAX
        ):
            raise ValueError(
                f"envpool:{env_id}: {key} must be an int in [{least}, {_INT32_MAX}], got {value!r}."
            )


def _probe(backend: str, env_id: str, kwargs: dict[str, Any]) -> tuple[Any, Any, int | None, tuple]:
    """Observation space, action space, time limit and discrete actions' start
    (:func:`~rollout.hostenv._worker.action_start`) of one env built in this process."""
    if backend == "envpool":
        try:
            import envpool
        except ImportError:
            raise ValueError(
                "envpool: ids need the optional EnvPool package: pip install 'sharded-ensembles"
                "[envpool]' (EnvPool has wheels for Linux x86-64 only)."
            ) from None
        if env_id not in envpool.list_all_envs():
            raise ValueError(f"unknown EnvPool task {env_id!r}; see envpool.list_all_envs().")
        reserved = sorted(set(kwargs) & set(ENVPOOL_POOL_KWARGS))
        if reserved:
            raise ValueError(
                f"envpool:{env_id}: make kwargs may not set {', '.join(reserved)}: the learner "
                "makes the pools (num_envs from the config, seeds from its keys, every env "
                "stepped each step)."
            )
        _check_envpool_ints(env_id, kwargs)
        try:
            spec = envpool.make_spec(env_id, **kwargs)
        except (AssertionError, KeyError, TypeError, ValueError) as e:
            why = (str(e).splitlines() or [""])[0]  # EnvPool's own messages run to many lines
            raise ValueError(
                f"envpool cannot make {env_id!r} with {kwargs}: {type(e).__name__}: {why}"
            ) from None
        limit = getattr(spec.config, "max_episode_steps", None)
        return spec.observation_space, spec.action_space, limit, ()  # (_space: a start is refused)
    try:
        import gymnasium
    except ImportError:
        raise ValueError(
            "gymnasium: ids need the gymnasium package: pip install 'sharded-ensembles[mujoco]' "
            "(gymnasium with MuJoCo), or pip install gymnasium."
        ) from None

    from rollout.hostenv._worker import action_start

    del gymnasium  # imported above only to say how to install it
    env = make_gymnasium_or_explain(env_id, **kwargs)
    limit = env.spec.max_episode_steps if env.spec is not None else None
    start = action_start(env)
    try:
        env.close()
    except Exception as e:
        why = (str(e).splitlines() or [""])[0]
        raise ValueError(
            f"gymnasium:{env_id}: env.close() raised {type(e).__name__}: {why} (the learner "
            "makes one env here to read its spaces, then closes it; so do its workers at the "
            "end): fix the env's close()."
        ) from e
    return env.observation_space, env.action_space, limit, start


def make_gymnasium_or_explain(env_id: str, **kwargs: Any) -> Any:
    """One gymnasium env; an id gymnasium cannot make (unknown, or its module not importable
    here) is one ``ValueError`` line, not gymnasium's traceback."""
    import gymnasium

    from rollout.hostenv._worker import make_gymnasium

    _import_env_module(env_id)
    try:
        return make_gymnasium(env_id, **kwargs)
    except (gymnasium.error.Error, ImportError) as e:  # (an env moved to another package)
        raise ValueError(f"gymnasium cannot make {env_id!r}: {e}") from None
    except SystemExit as e:  # the run would end with the env's code, without a word
        raise ValueError(
            f"gymnasium cannot make {env_id!r} with {kwargs}: it raised SystemExit({e.code!r}) "
            "(a sys.exit in the env's code)"
        ) from None
    except (AssertionError, TypeError, ValueError) as e:
        # What gymnasium.make or the env's constructor refuse in the kwargs (gymnasium asserts
        # max_episode_steps > 0; a bare AssertionError named neither the env nor the kwargs).
        if str(e).startswith(f"gymnasium:{env_id}:"):
            raise  # make_gymnasium's own message, already naming the env
        why = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(
            f"gymnasium cannot make {env_id!r} with {kwargs}: {type(e).__name__}: {why}"
        ) from None


def _import_env_module(env_id: str) -> None:
    """Imports the module of a ``'module:EnvId-v0'`` id here first. Gymnasium would let an
    error inside the user's module through as itself (a bare ``NameError`` naming neither the
    module nor the id) and fail on a malformed id (``':X-v0'``, ``'a:b:X-v0'``) with Python's
    "Empty module name" or an unpacking error."""
    import importlib

    if ":" not in env_id:
        return
    module, _, name = env_id.partition(":")
    if not module.strip() or not name.strip() or ":" in name:
        raise ValueError(
            f"gymnasium cannot make {env_id!r}: an id with a module is 'module:EnvId-v0' (e.g. "
            "'my_package.envs:MyEnv-v0'), one module, then the id it registers."
        )
    try:
        importlib.import_module(module)
    except (Exception, SystemExit) as e:  # (a sys.exit in it: the run ended without a word)
        missing = getattr(e, "name", None) if isinstance(e, ModuleNotFoundError) else None
        if missing is not None and (module + ".").startswith(missing + "."):
            return  # the module itself is missing: gymnasium's own message says so
        why = (str(e).splitlines() or [""])[0]
        raise ValueError(
            f"gymnasium cannot make {env_id!r}: importing {module!r} raised "
            f"{type(e).__name__}: {why}"
        ) from None


def _in_process(env: HostEnv) -> bool:
    """Whether the envs step in this process (``workers_per_device=0``)."""
    return env.workers_per_device == 0


def _check_picklable(name: str, kwargs: dict[str, Any]) -> None:
    """The make kwargs travel to the worker processes pickled: refuse, by name, one that cannot."""
    import pickle

    for key, value in kwargs.items():
        try:
            pickle.dumps(value)
        except Exception as e:
            raise ValueError(
                f"{name}: make kwarg {key}={value!r} cannot be sent to the env worker processes "
                f"({type(e).__name__}: {e}); pass something picklable (a module-level function, "
                "not a lambda or local function), or step the envs in this process with "
                "workers_per_device=0."
            ) from None


def _check_registered_outside_main(env_id: str) -> None:
    """Refuses, before anything starts, an id whose env class lives in the running script's
    ``__main__``: the worker processes never run that script, so they cannot make it (they
    would fail at the first reset, inside the compiled update)."""
    import gymnasium

    spec = gymnasium.envs.registration.registry.get(env_id.partition(":")[2] or env_id)
    entry = getattr(spec, "entry_point", None)
    where = entry.partition(":")[0] if isinstance(entry, str) else getattr(entry, "__module__", "")
    if where == "__main__":
        raise ValueError(
            f"gymnasium:{env_id}: its env is defined in the script being run (__main__), which "
            "the env worker processes do not run: move the env and its gymnasium.register into "
            "a module and give the id as 'gymnasium:<module>:<id>', or step the envs in this "
            "process with workers_per_device=0."
        )


def _default_workers(groups: int) -> int:
    return max(1, available_cores() // groups)


class HostEnvs:
    """The envs of an n-member ensemble, ``num_envs`` per member, in CPU worker processes.

    The members on one device (a group of the mesh's ``'ensemble'`` axis) have their own
    ``WorkerGroup``: ``workers_per_device`` processes that hold that group's envs, so each
    device's members step their own envs on their own workers, and all groups step at once
    (with ``workers_per_device=0``, an ``InProcessGroup`` instead).
    ``reset`` and ``step`` are traceable (use them inside ``jit``, with the mesh's shardings);
    ``close()`` stops the workers. The mesh's axes are used as Auto ones (``jax.make_mesh``
    makes Explicit ones), so the envs take keys and actions uncommitted or placed on this mesh;
    call them outside a ``jax.set_mesh`` of an Explicit mesh, whose typed arrays do not mix
    with Auto ones.

    When a member spans several devices (fewer members than devices), only the first device of
    its group calls the workers; the others receive the result through a ``psum``.
    """

    def __init__(self, env: HostEnv, mesh: Mesh, members: int, num_envs: int):
        # Auto axes (jax.make_mesh makes Explicit ones): the step's shard_map then places keys
        # and actions on the member axis itself, where Explicit axes refused any other layout
        # with JAX's bare in_specs error.
        auto = (jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
        mesh = Mesh(mesh.devices, mesh.axis_names, axis_types=auto)
        self.env, self.mesh, self.members, self.num_envs = env, mesh, members, num_envs
        shape = dict(mesh.shape)
        self.num_groups = shape["ensemble"]
        self.replicas = int(np.prod([s for a, s in shape.items() if a != "ensemble"]))
        self.per_group = members // self.num_groups
        rows = self.per_group * num_envs
        discrete = isinstance(env.action_space, (Discrete, MultiDiscrete))
        shapes = dict(
            obs_shape=tuple(env.observation_space.shape),
            obs_dtype=self._obs_dtype,
            action_shape=tuple(env.action_space.shape),
            action_dtype=np.int32 if discrete else np.float32,
        )
        self._action_shape, self._action_dtype = shapes["action_shape"], shapes["action_dtype"]
        # The compiled step (``_fast``) serves worker processes on CPU devices, where it is built.
        on_cpu = all(d.platform == "cpu" for d in mesh.devices.flat)
        compiled = on_cpu and _fast.library() is not None
        self.groups = self._make_groups(rows, shapes, _in_process(env))
        self._init_sessions()
        self._slot = self._register_compiled_step(on_cpu, compiled)

    def _register_compiled_step(self, on_cpu: bool, compiled: bool) -> int | None:
        """The first slot of this ensemble's groups in the compiled step, or None: the Python
        step serves them (a warning says why, where the compiled step should have)."""
        if not (on_cpu and all(isinstance(group, WorkerGroup) for group in self.groups)):
            return None  # accelerators, or envs in this process: the Python step by design
        workers = max(len(group.counts) for group in self.groups)
        fits = workers <= _fast.MAX_WORKERS
        slot = _fast.register([g.control for g in self.groups]) if compiled and fits else None
        why = _fast.why_not()
        if slot is None and why != _fast.DISABLED:
            if why:
                fix = _fast.how_to_fix()
            elif not fits:
                why = f"{workers} workers per device; it serves at most {_fast.MAX_WORKERS}"
                fix = "set fewer workers_per_device"
            else:
                why = f"this process has bound the {_fast.SLOTS} device groups it can serve"
                fix = "use fewer HostEnvs"
            warn_user(
                f"host env {self.env.name}: every step goes through Python, about 400 us of the "
                f"learner's CPU per step slower ({why}); {fix} for the compiled step, or set "
                "ROLLOUT_HOSTENV_FFI=0 to silence this.",
                RuntimeWarning,
            )
        return slot

    def _make_groups(self, rows: int, shapes: dict, in_process: bool) -> list[Any]:
        env = self.env
        what = (env.backend, env.env_id, dict(env.kwargs))
        cores = min(rows, _default_workers(self.num_groups))
        if in_process:  # stepped by the callback threads
            return [
                InProcessGroup(*what, rows, self._label(g), **shapes, threads=cores)
                for g in range(self.num_groups)
            ]
        k = min(rows, env.workers_per_device or cores)
        counts = [len(c) for c in np.array_split(np.arange(rows), k)]
        return [
            WorkerGroup(*what, counts, self._label(g), **shapes, timeout=env.timeout)
            for g in range(self.num_groups)
        ]

    def _init_sessions(self) -> None:
        for group in self.groups:
            group.control[C_SESSION], group.control[C_T] = -1, 0  # no session yet
        self.restarts = 0  # times a group restarted its envs mid-run (resume, or after close)
        self._warned = threading.Event()
        # Groups whose envs another group's error left ahead of the state a retry brings:
        # group -> that error. Such a group restarts rather than calling the step replayed
        # (until it restarts: its own step of the failed program may come after the error).
        self._behind: dict[int, str] = {}
        self._kept: dict[int, BaseException] = {}  # per group: see _shared_by_leader

    def _label(self, g: int) -> str:
        a, b = g * self.per_group, (g + 1) * self.per_group - 1
        return f"device group {g} (members {a if a == b else f'{a}-{b}'})"

    @property
    def pids(self) -> list[int]:
        """Process ids of all running workers."""
        return [pid for group in self.groups for pid in group.pids]

    @property
    def fast_steps(self) -> int:
        """Group steps made by the compiled FFI step, without entering Python (0 where it is
        not in use: envs in this process, non-CPU devices, no C++ compiler)."""
        return sum(group.control.fast_steps for group in self.groups)

    def close(self) -> None:
        """Stops every worker, once the programs already dispatched have made their steps. A
        later ``step`` restarts the envs (see ``step``)."""
        finish_dispatched()
        for group in self.groups:
            with group.lock:
                group.close()

    # ------------------------------------------------------------------ traced side

    def seeds(self, keys: jax.Array, start: jax.Array | None = None) -> jax.Array:
        """The uint32 seeds the envs get from ``keys`` ``[..., n, num_envs]`` (typed PRNG keys or
        raw key data) at a reset or a restart, as ``reset`` and ``step`` derive them.

        In a loop of steps, derive them once beforehand and pass each step's row as
        ``step(..., seeds=row)``: inside the loop the derivation would run at every step, and
        EnvPool's seeds read member 0's key (``reset``), which on a sharded ensemble is a
        collective across the member axis, one per step. ``start`` (EnvPool; keys of ``keys``'
        leading shape, ``[...]``, the same on every device): the pool's first seed drawn from it
        instead, with no collective at all (a device whose envs failed then leaves none of the
        others waiting for it in a collective: the learner passes its run's own).

        Example:
          >>> import jax
          >>> from rollout import envs
          >>> mesh = jax.make_mesh((1,), ("ensemble",), devices=jax.devices()[:1])
          >>> host = envs.make("gymnasium:CartPole-v1").bind(mesh, members=2, num_envs=3)
          >>> keys = jax.random.split(jax.random.key(0), (5, 2, 3))  # 5 steps of keys
          >>> seeds = host.seeds(keys)
          >>> seeds.shape, seeds.dtype
          ((5, 2, 3), dtype('uint32'))
          >>> bool((seeds[4] == host.seeds(keys[4])).all())  # a row is that step's seeds
          True
          >>> host.close()
        """
        keys = _typed(keys)
        if keys.shape[-2:] != (self.members, self.num_envs):
            raise ValueError(
                f"host env {self.env.name}: keys of shape {keys.shape}; {self.members} members x "
                f"{self.num_envs} envs take [..., {self.members}, {self.num_envs}]"
            )
        seeds = _bits(keys)
        if self.env.backend == "envpool":
            # EnvPool seeds a pool, not an env (env i of a pool seeded s gets s + i, an int32):
            # consecutive seeds over all members' envs make any worker's rows one pool, seeded
            # as one pool of all the envs would be, whichever devices and workers hold them.
            n, e = self.members, self.num_envs
            base = seeds[..., :1, :1] if start is None else _bits(_typed(start))[..., None, None]
            first = base % jnp.uint32(2**31 - n * e)
            seeds = first + jnp.arange(n * e, dtype=jnp.uint32).reshape(n, e)
        return seeds

    def _sharded(self, host: Any, types: tuple, *args: jax.Array, fast: bool = False) -> tuple:
        """``host(group, leader, *local_args)`` once per device, on that device's members;
        ``fast``: the FFI step first (``_fast``), ``host`` only where it did not finish."""
        replicated = self.replicas > 1
        # A member's copies are along every other axis of the mesh ('data', 'model', and any
        # the user's mesh adds): the first device of each group steps the envs, once.
        others = tuple(a for a in self.mesh.axis_names if a != "ensemble")

        def per_device(*local):
            g = jax.lax.axis_index("ensemble")
            lead = jnp.bool_(True)
            for axis in others if replicated else ():
                lead &= jax.lax.axis_index(axis) == 0
            local_types = tuple(
                jax.ShapeDtypeStruct((self.per_group, *t.shape[1:]), t.dtype) for t in types
            )
            if not replicated:
                if fast:
                    return self._fast_step(host, local_types, g, lead, *local)
                return host_call(_recording(host), local_types, g, lead, *local)
            return self._shared_by_leader(host, local_types, others, g, lead, local, fast)

        return jax.shard_map(
            per_device,
            mesh=self.mesh,
            in_specs=P("ensemble"),
            out_specs=P("ensemble"),
            check_vma=False,
        )(*args)

    def _shared_by_leader(self, host, types, others, g, lead, local, fast) -> tuple:
        """A member on several devices: its first device (the leader) steps the envs and a
        ``psum`` shares the results with the others. An error of the leader's is kept, not
        raised, until every device of the group has its flag from that ``psum``, and then
        raised on each of them at once: raised at once on the leader, its replicas waited for
        it in the ``psum`` until XLA aborted the process."""
        keep = self._keeping_error(host, types, 1 if fast else 0)
        flagged = (*types, jax.ShapeDtypeStruct((), jnp.int32))  # + 1 where the leader failed
        if fast:
            outs = self._fast_step(keep, flagged, g, lead, *local)
        else:
            outs = host_call(keep, flagged, g, lead, *local)
        share = lambda x: jax.lax.psum(
            jnp.where(lead, x.astype(jnp.int32) if x.dtype in (jnp.bool_, jnp.uint8) else x, 0),
            others,
        )
        *outs, failed = (share(x).astype(x.dtype) for x in outs)
        (settled,) = host_call(_recording(self._host_settle), [failed], g, failed)
        session = outs[0] + settled.astype(outs[0].dtype)  # after the settle: it may raise
        return (session, *outs[1:])

    def _keeping_error(self, host: Any, types: tuple, g_at: int) -> Any:
        """``host`` with a flag of 0 added to its results; where it raises, zeros and a flag of
        1, the error kept for :meth:`_host_settle` (``args[g_at]``: the group's index)."""
        host = _recording(host)

        def call(*args: Any) -> tuple[np.ndarray, ...]:
            try:
                return (*host(*args), np.int32(0))
            except BaseException as e:  # an interrupt too: raised again, on every device
                self._kept[int(args[g_at])] = e
                return (*(np.zeros(t.shape, t.dtype) for t in types), np.int32(1))

        return call

    def _host_settle(self, g: Any, failed: Any) -> tuple[np.ndarray]:
        """Every device of group ``g``: raises the error its leader kept in this step."""
        if int(failed):
            raise self._kept[int(g)]
        return (np.int32(0),)

    def _fast_step(self, host: Any, types: tuple, g: jax.Array, lead: jax.Array, *local) -> tuple:
        """The FFI step, then ``host`` (given its status first) where it did not finish;
        ``types`` may end with the flag of :meth:`_keeping_error` (0 where the FFI step
        finished)."""
        session, t, _, action, _ = local
        flag = len(types) > 5
        step_types = types[:5]
        status, *outs = _fast.step(
            self._slot, step_types, g.astype(jnp.int32), lead, session, t, action
        )

        def python(status, g, lead, *local):
            fn = host if flag else _recording(host)
            return host_call(fn, types, status, g, lead, *local)

        done = (*outs, jnp.int32(0)) if flag else tuple(outs)
        finished = lambda status, g, lead, *local: done
        return tuple(jax.lax.cond(status == _fast.OK, finished, python, status, g, lead, *local))

    def _types(self, *specs: tuple[tuple[int, ...], Any]) -> tuple:
        n, e = self.members, self.num_envs
        return tuple(jax.ShapeDtypeStruct((n, e, *shape), dt) for shape, dt in specs)

    def reset(self, keys: jax.Array) -> tuple[HostState, jax.Array]:
        """Resets all envs (``keys``: ``[n, num_envs]``): env j of member m with a uint32 seed
        drawn from ``keys[m, j]``. EnvPool seeds a pool, not an env (env i of a pool seeded s
        gets s + i), so there env j of member m gets s + m * num_envs + j, s the seed of
        ``keys[0, 0]`` modulo 2**31 - n * num_envs: the same seeds whatever the devices and
        workers, and each worker's envs one pool."""
        obs_shape = self.env.observation_space.shape
        types = self._types(((), jnp.uint32), (obs_shape, self._obs_dtype))
        session, obs = self._sharded(self._host_reset, types, self.seeds(keys))
        t = jnp.zeros((self.members, self.num_envs), jnp.int32)
        return HostState(session, t, obs), obs

    def step(
        self,
        state: HostState,
        action: jax.Array,
        keys: jax.Array | None = None,
        *,
        seeds: jax.Array | None = None,
    ) -> tuple:
        """One step of every env: ``(state, obs, reward, terminated, truncated, info)``.

        ``info``: ``final_obs`` (the observation the step reached, before an autoreset),
        ``done``, ``restarted`` (true where this step was the restart described next, not a
        step of the env), ``score`` (the raw reward; ``reward`` is its sign under EnvPool's
        ``reward_clip``) and ``episode_goes_on`` (a life lost under EnvPool's
        ``episodic_life``: the episode ended, the game did not). ``keys`` seed the envs only
        if they must restart: when ``state`` is not the envs' live session (a restored
        checkpoint, a state from before ``close()``, one older than the envs' latest reset, or
        one of a layout with more device groups), or is a retry of a step that another device
        group's env error stopped.
        Host env states cannot be saved or rewound, so then the episodes running in ``state``
        end at this step, reported as truncated with reward 0 and ``final_obs`` = their last
        observation (the learner bootstraps them like a time limit), and the envs restart from
        reset, seeded by ``keys`` as ``reset`` seeds them. ``seeds``, instead of ``keys``:
        those seeds, derived beforehand by :meth:`seeds` (once for a whole loop of steps).
        """
        action, seeds = self._step_inputs(action, keys, seeds)
        obs_shape = self.env.observation_space.shape
        # As few arrays as will do: each one of a callback's costs about 2 us of the main
        # process's time per call, on the cores the envs step on. The counter advances here.
        types = self._types(
            ((), jnp.uint32),
            (obs_shape, self._obs_dtype),
            ((), jnp.float32),
            ((), jnp.uint8),
            (obs_shape, self._obs_dtype),
        )
        # As the handler and the callbacks read them, whatever a restored checkpoint made them.
        session, t = state.session.astype(jnp.uint32), state.t.astype(jnp.int32)
        args = (session, t, state.obs.astype(self._obs_dtype), action, seeds)
        if self._slot is None:
            outs = self._sharded(self._host_step, types, *args)
        else:
            outs = self._sharded(self._host_finish, types, *args, fast=True)
        session, obs, reward, flags, final = outs
        term, trunc, restarted, goes_on = (
            (flags & bit) != 0 for bit in (_TERM, _TRUNC, _RESTART, _GOES_ON)
        )
        info = {"final_obs": final, "done": term | trunc, "restarted": restarted,
                "score": reward, "episode_goes_on": goes_on}  # fmt: skip
        if self.env.clips_rewards:  # as EnvPool would; the raw reward stays the score
            reward = jnp.sign(reward)
        return HostState(session, t + 1, obs), obs, reward, term, trunc, info

    def _step_inputs(self, action: Any, keys: Any, seeds: Any) -> tuple[jax.Array, jax.Array]:
        """``step``'s actions (as the workers read them) and seeds, refused where they would be
        broadcast or truncated into the envs' rows."""
        if (keys is None) == (seeds is None):
            raise TypeError(f"host env {self.env.name}: step takes keys or seeds, exactly one")
        if seeds is None:
            seeds = self.seeds(keys)
        elif tuple(seeds.shape) != (self.members, self.num_envs) or seeds.dtype != jnp.uint32:
            raise ValueError(
                f"host env {self.env.name}: seeds must be uint32 [{self.members}, "
                f"{self.num_envs}] (from seeds(keys)), got {seeds.dtype} {tuple(seeds.shape)}"
            )
        want = (self.members, self.num_envs, *self._action_shape)
        if tuple(action.shape) != want:  # NumPy would broadcast some shapes into the envs' rows
            raise ValueError(
                f"host env {self.env.name}: actions have shape {tuple(action.shape)}; "
                f"{self.members} members x {self.num_envs} envs take {want}"
            )
        action = jnp.asarray(action)
        if self._action_dtype == np.int32 and not jnp.issubdtype(action.dtype, jnp.integer):
            # The int32 cast would truncate 1.7 to 1: a wrong action taken without a word.
            raise TypeError(
                f"host env {self.env.name}: a discrete action space takes integer actions, not "
                f"{action.dtype}; cast them yourself (e.g. jnp.round(a).astype(jnp.int32))"
            )
        return action.astype(self._action_dtype), seeds

    # ------------------------------------------------------------------ host side

    def _host_reset(self, g: Any, lead: Any, seeds: np.ndarray) -> tuple[np.ndarray, ...]:
        m, e = seeds.shape
        if not lead:
            return np.zeros((m, e), np.uint32), np.zeros((m, e, *self._obs_shape), self._obs_dtype)
        g = int(g)
        group = self.groups[g]
        with group.lock:
            session, obs = self._new_session(g, seeds)
        return np.full((m, e), session, np.uint32), obs

    def _new_session(self, g: int, seeds: np.ndarray) -> tuple[int, np.ndarray]:
        group = self.groups[g]
        _drop_unfinished(group)
        if not group.running:
            group.start()
        obs = group.reset(seeds.reshape(-1))
        session = secrets.randbits(32)
        group.control[C_SESSION], group.control[C_T] = session, 0
        self._behind.pop(g, None)  # a new session: no longer ahead of anything
        return session, self._unflat(obs, self._obs_dtype)

    @property
    def _obs_shape(self) -> tuple[int, ...]:
        return tuple(self.env.observation_space.shape)

    @property
    def _obs_dtype(self) -> np.dtype:
        return np.dtype(self.env.observation_space.dtype)

    def _unflat(self, x: np.ndarray, dtype: Any) -> np.ndarray:
        return np.asarray(x, dtype).reshape(self.per_group, self.num_envs, *x.shape[1:])

    def _host_finish(self, status, g, lead, session, t, obs, action, seeds) -> tuple:
        """Where the FFI step stopped (``status``): finishes the step it sent, or makes the
        whole step in Python."""
        group = self.groups[int(g)]
        with group.lock:
            # PENDING: the step went out. If the group was closed since (``close()`` from
            # another thread) its answers are gone, and the Python step restarts the envs.
            if int(status) == _fast.PENDING and _live(group, session):
                new_obs, reward, term, trunc, final = self._failing(int(g), group.finish_step)
                return self._step_results(session, new_obs, reward, term, trunc, final)
            return self._step_locked(int(g), session, t, obs, action, seeds)

    def _step_results(self, session, obs, reward, term, trunc, final) -> tuple[np.ndarray, ...]:
        m, e = session.shape
        # terminated: _worker.TERMINATED | GOES_ON bits
        flags = (term & 1) * _TERM | (term & 2 != 0) * _GOES_ON | trunc * _TRUNC
        shape = (m, e, *self._obs_shape)
        return (session, obs.reshape(shape), reward.astype(np.float32).reshape(m, e),
                flags.astype(np.uint8).reshape(m, e), final.reshape(shape))  # fmt: skip

    def _host_step(self, g, lead, session, t, obs, action, seeds) -> tuple[np.ndarray, ...]:
        """``(session, obs, reward, flags, final_obs)`` of one step of group ``g``'s envs;
        ``flags``: ``_TERM | _TRUNC | _RESTART`` bits."""
        m, e = session.shape
        if not lead:
            o, od = self._obs_shape, self._obs_dtype
            return (np.zeros((m, e), np.uint32), np.zeros((m, e, *o), od),
                    np.zeros((m, e), np.float32), np.zeros((m, e), np.uint8),
                    np.zeros((m, e, *o), od))  # fmt: skip
        with self.groups[int(g)].lock:
            return self._step_locked(int(g), session, t, obs, action, seeds)

    def _step_locked(self, g: int, session, t, obs, action, seeds) -> tuple[np.ndarray, ...]:
        """``_host_step`` of the leader, under its group's lock."""
        group = self.groups[g]
        step = _one(t, "step counter")
        due = group.control[C_T]
        _drop_unfinished(group)
        if _live(group, session) and not (g in self._behind and _int32(due) != step):
            if _int32(due) != step:  # the device's int32 counter wraps after 2**31 steps
                raise HostEnvError(
                    f"host env {self.env.name}, {group.label}: step {step} arrived where "
                    f"step {_int32(due)} was due (a step was duplicated, dropped or reordered; "
                    "or a call retried after an interrupt that came once its step was made: the "
                    "envs cannot step back, and close() on them restarts them at the next step)"
                )
            m, e = session.shape
            outs = self._failing(g, lambda: group.step(action.reshape(m * e, *action.shape[2:])))
            return self._step_results(session, *outs)
        # Not the live session: a restored checkpoint, a state from before close(), or an
        # older state of this run. The envs cannot go back to it: restart them.
        return self._restart(g, t, obs, seeds)

    def _failing(self, g: int, step: Any) -> Any:
        """``step()`` of group ``g``, then its step counter advanced. If anything raises in
        between (an env error, or an interrupt, which may come even once the answers are in)
        the group stops, so that a retry restarts its envs rather than step them twice; and
        the other groups' envs have gone on without this one's: each of them restarts at a
        retry with an older state, instead of refusing it."""
        group = self.groups[g]
        try:
            outs = step()
            group.control[C_T] += 1
            return outs
        except BaseException as e:
            if group.failed is None and group.running:
                group.stop(f"a step was cut short ({type(e).__name__}) before it was counted")
            if group.failed is not None:
                failed = f"{group.label} had stopped after an error: {group.failed}"
                for h in range(self.num_groups):
                    if h != g:
                        self._behind.setdefault(h, failed)
            raise

    def _restart(self, g, t, obs, seeds) -> tuple[np.ndarray, ...]:
        m, e = t.shape
        failed = self.groups[g].failed
        behind = self._behind.pop(g, None)
        if failed is not None:
            why = f"{self.groups[g].label} had stopped after an error: {failed}"
        else:
            why = behind or "resumed from a checkpoint, or stepped after close()"
        if failed is not None or behind is not None or not self._warned.is_set():
            self._warned.set()  # every failure, else once
            warn_user(
                f"host env {self.env.name}: restarting the envs from reset ({why}); the "
                "episodes that were running end here as truncated with reward 0.",
                RuntimeWarning,
            )
        self.restarts += 1
        new_session, new_obs = self._new_session(g, seeds)
        self.groups[g].control[C_T] = int(_one(t, "step counter")) + 1
        return (np.full((m, e), new_session, np.uint32), new_obs, np.zeros((m, e), np.float32),
                np.full((m, e), _TRUNC | _RESTART, np.uint8),
                np.asarray(obs, self._obs_dtype))  # fmt: skip


def _recording(host: Any) -> Any:
    """``host``, recording the ``HostEnvError`` it raises so that ``rollout.worker_errors``
    can raise it again as itself (JAX passes on only its text)."""

    def call(*args: Any) -> tuple[np.ndarray, ...]:
        try:
            return host(*args)
        except HostEnvError as e:
            remember(e)
            raise

    return call


def _int32(x: int) -> int:
    """``x`` as the device's int32 step counter holds it (wrapped)."""
    return (x + 2**31) % 2**32 - 2**31


def _same(x: np.ndarray) -> bool:
    return bool((x == x.flat[0]).all())


def _typed(keys: jax.Array) -> jax.Array:
    typed = jnp.issubdtype(keys.dtype, jax.dtypes.prng_key)
    return keys if typed else jax.random.wrap_key_data(keys)


def _bits(keys: jax.Array) -> jax.Array:
    """A uint32 drawn from each key, vmapped axis by axis (a reshape would move members)."""
    bits = lambda k: jax.random.bits(k, (), jnp.uint32)
    for _ in range(keys.ndim):
        bits = jax.vmap(bits)
    return bits(keys)


def _drop_unfinished(group: Any) -> None:
    """Stops a group whose last step the compiled handler handed to Python and Python never
    took up (an interrupt came between): its workers still owe that step's answers, which
    must reach no later request. The caller then starts it afresh."""
    if group.running and group.control[_fast.C_PENDING]:
        group.stop("a step was cut short (an interrupt) before its answers were read")


def _live(group: Any, session: np.ndarray) -> bool:
    """Whether ``session`` is the group's live session. Several sessions in one group are a
    state from a layout of more device groups (a run resumed on fewer devices): not live."""
    return group.running and _same(session) and int(session.flat[0]) == group.control[C_SESSION]


def _one(x: np.ndarray, what: str) -> int:
    first = x.flat[0]
    if not _same(x):
        raise HostEnvError(f"host env state has mixed {what}s {np.unique(x)[:4]}: it was altered")
    return int(first)
