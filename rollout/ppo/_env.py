"""The learner's view of environments: the spec read off an env, and its members' envs.

The learner talks to environments through one interface, ``MemberEnvs``: ``reset(keys)`` and
``step(state, action, keys)`` on member-major arrays ``[n, num_envs, ...]`` (the member axis
sharded on the mesh). :func:`member_envs` builds it from

- a functional env (``rollout.envs.Env``: CartPole, Pendulum, audio, gymnax, or your own):
  vmapped next to each member (``env_on='device'``) or run on CPU cores (``env_on='cpu'``);
- anything with ``bind(mesh, members, num_envs)`` returning such an object (``HostEnv``:
  gymnasium and EnvPool envs in CPU worker processes).
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import TYPE_CHECKING, Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from rollout._relay import finish_dispatched

if TYPE_CHECKING:
    from rollout.hostenv import HostEnvs


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """Observation shape and action space of one (unbatched) environment."""

    obs_shape: tuple[int, ...]
    discrete: bool
    action_dim: int  # number of actions (discrete; all groups') or action vector size
    action_low: Any = None
    action_high: Any = None
    obs_scale: float = 1.0  # images in [0, 255]: 1/255 (the network's input scaling)
    obs_dtype: Any = np.float32  # what the env returns: uint8 (pixels) or float32
    #: A MultiDiscrete action's ``nvec`` (one categorical each, an action ``[len]``); ``()``
    #: for a single Discrete or a Box.
    action_groups: tuple[int, ...] = ()
    #: The env's first discrete action, per group, where not 0 (a gymnasium ``Discrete(n,
    #: start=k)``: ``(k,)``); the policy picks indices from 0, the env gets index + start.
    action_start: tuple[int, ...] = ()

    @property
    def image(self) -> bool:
        return len(self.obs_shape) == 3


def normalize_obs(config: Any, spec: EnvSpec) -> bool:
    """Whether observations get running mean/std normalisation: ``config.normalize_obs``, or
    by default for continuous actions on vector observations (CleanRL), never for images."""
    if config.normalize_obs is not None:
        return bool(config.normalize_obs)
    return not spec.discrete and not spec.image


def obs_dtype(config: Any, spec: EnvSpec) -> Any:
    """The dtype the learner keeps observations in (its carry, rollout buffer and checkpoint):
    an env's uint8 images as they come, a quarter of float32's bytes (the network scales them
    to floats), unless they are normalised; everything else float32."""
    if spec.image and np.dtype(spec.obs_dtype) == np.uint8 and not normalize_obs(config, spec):
        return jnp.uint8
    return jnp.float32


def known_envs() -> tuple[str, ...]:
    """Env names that ``rollout.envs.make`` accepts, lower-cased, and the id prefixes
    (``'gymnasium:'``, ``'envpool:'``, ``'gymnax:'``, ``'brax:'``) of other libraries' envs."""
    from rollout import envs

    return tuple(name.lower() for name in envs.ENV_NAMES) + envs.ENV_PREFIXES


def make_env(name: str, kwargs: dict[str, Any] | None = None) -> Any:
    """The env for a config's ``env`` string and ``make_kwargs()`` (``rollout.envs.make``)."""
    from rollout import envs

    return envs.make(name, **(kwargs or {}))


def made_by_config(config: Any, env: Any) -> bool:
    """Whether ``config``'s env and kwargs make an env like ``env``: then a run's files (run.json,
    exports) name the env it trains on, and ``--resume`` and ``evaluate`` can make it again."""
    try:
        return _alike(make_env(config.env, config.make_kwargs()), env)
    except Exception:  # a name only the caller's env knows
        return False


def _alike(a: Any, b: Any) -> bool:
    """Of one type, with equal constructor fields (wrapped envs alike too): envs made alike.
    (Identity alone would tell apart two ``envs.make`` of the same id.)"""
    if a is b:
        return True
    if type(a) is not type(b) or not dataclasses.is_dataclass(a):
        return False
    for field in dataclasses.fields(a):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if not field.init:
            continue
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            if not _alike(x, y):
                return False
            continue
        try:
            if not bool(np.all(x == y)):
                return False
        except Exception:  # not comparable: not known to be alike
            return False
    return True


def env_family(name: str, kwargs: dict[str, Any] | None = None) -> str:
    """``'image'`` (discrete actions on image observations, CleanRL's Atari defaults),
    ``'discrete'`` or ``'continuous'``: which CleanRL defaults suit the env ``name``.

    Builds the env once (for host envs: one instance in this process), so an unknown id, a
    missing library or spaces the networks cannot take are a ``ValueError`` here, before
    anything is compiled. Whether worker processes can make it is the learner's to check: an
    env registered in ``__main__`` may still train on envs in this process.
    """
    from rollout.envs import HOST_PREFIXES

    kwargs = dict(kwargs or {})
    if str(name).partition(":")[0] + ":" in HOST_PREFIXES:
        kwargs.setdefault("workers_per_device", 0)  # its spaces only, read in this process
    env = make_env(name, kwargs)
    if not spec_of(env).discrete:  # (raises for spaces the PPO networks do not support)
        return "continuous"
    return "image" if len(env.observation_space.shape) == 3 else "discrete"


class MemberEnvs(Protocol):
    """All members' envs at once; every array is ``[members, num_envs, ...]``."""

    def reset(self, keys: jax.Array) -> tuple[Any, jax.Array]: ...

    def step(self, state: Any, action: jax.Array, keys: jax.Array) -> tuple: ...

    @property
    def pids(self) -> list[int]:
        """The processes stepping the envs (``[]`` where they step in this one, or closed)."""
        ...

    def close(self) -> None: ...


class FunctionalEnvs:
    """A functional env for every member: vmapped on the members' devices, or on CPU cores."""

    def __init__(self, env: Any, members: int, num_envs: int, on: str = "device"):
        from ensemble import MEMBER_AXIS

        self.env, self.on, self._cpu = env, on, None
        per_member = functools.partial(jax.vmap, spmd_axis_name=MEMBER_AXIS)
        self._reset = per_member(jax.vmap(env.reset))
        step = jax.vmap(env.step)  # one member's num_envs envs
        if on == "device":
            self._step = per_member(step)
            return
        from rollout import on_cpu

        cpu_step = self._cpu = on_cpu(step, in_axes=0)
        n, e = members, num_envs

        def on_host(env_state, action, keys):
            # Members x envs become one batch of rows for the CPU workers (split over cores).
            flat = lambda x: x.reshape(n * e, *x.shape[2:])
            out = cpu_step(*jax.tree_util.tree_map(flat, (env_state, action, keys)))
            return jax.tree_util.tree_map(lambda x: x.reshape(n, e, *x.shape[1:]), out)

        self._step = on_host

    def reset(self, keys: jax.Array) -> tuple[Any, jax.Array]:
        return self._reset(keys)

    def step(self, state: Any, action: jax.Array, keys: jax.Array) -> tuple:
        return self._step(state, action, keys)

    @property
    def pids(self) -> list[int]:
        """The ``rollout.on_cpu`` worker processes of ``on="cpu"`` (``[]`` on device)."""
        return [] if self._cpu is None else self._cpu.pids

    def close(self) -> None:
        if self._cpu is not None:
            finish_dispatched()
            self._cpu.close()


def member_envs(env: Any, config: Any, mesh: Any) -> FunctionalEnvs | HostEnvs:
    """``env``'s instances for ``config.members`` members x ``config.num_envs`` on ``mesh``.

    Host envs (with ``bind``) always step in their worker processes; ``config.env_on`` only
    chooses where functional envs run.
    """
    if hasattr(env, "bind"):
        return env.bind(mesh, config.members, config.num_envs)
    return FunctionalEnvs(env, config.members, config.num_envs, config.env_on)


def spec_of(env: Any) -> EnvSpec:
    """Reads the observation and action spaces off a ``rollout.envs`` environment."""
    from rollout.envs import Box, Discrete, MultiDiscrete

    obs_space = env.observation_space
    name = env_name(env)
    if not isinstance(obs_space, Box):
        raise ValueError(
            f"{name}: observation space {type(obs_space).__module__}."
            f"{type(obs_space).__qualname__} is not supported: use a flat rollout.envs.Box "
            "(flatten dict or tuple observations into one vector in the env)."
        )
    obs_shape = tuple(obs_space.shape)
    if 0 in obs_shape:
        raise ValueError(
            f"{name}: observations of shape {obs_shape} hold no values, so the policy would "
            "see nothing; give the env an observation of at least one value."
        )
    if len(obs_shape) not in (1, 3) or (len(obs_shape) == 3 and not _image_fits(obs_shape)):
        raise ValueError(
            f"{name}: observations of shape {obs_shape} are not supported: the PPO networks "
            "take vectors [D] (an MLP) or images [H, W, C] / [C, H, W] of at least 3x3 (a "
            "conv net); reshape them in the env."
        )
    pixels = len(obs_shape) == 3 and set(obs_space.low) == {0.0} and set(obs_space.high) == {255.0}
    scale = 1.0 / 255.0 if pixels else 1.0
    uint8 = np.dtype(getattr(obs_space, "dtype", np.float32)) == np.uint8
    dtype = np.uint8 if uint8 else np.float32
    space = env.action_space
    start = tuple(getattr(env, "action_start", ()))  # host envs' (rollout.envs spaces have none)
    if isinstance(space, Discrete):
        if tuple(space.shape) != ():
            raise ValueError(
                f"{name}: discrete actions of shape {tuple(space.shape)} are not supported: the "
                "policy picks one action per env; use Discrete(n) (shape ())."
            )
        n = int(space.num_actions)
        return EnvSpec(obs_shape, True, n, None, None, scale, dtype, action_start=start)
    if isinstance(space, MultiDiscrete):
        nvec = tuple(space.nvec)
        return EnvSpec(obs_shape, True, sum(nvec), None, None, scale, dtype, nvec, start)
    if not isinstance(space, Box):
        raise ValueError(
            f"{name}: action space {type(space).__module__}.{type(space).__qualname__} is not "
            "supported: use rollout.envs.Discrete, MultiDiscrete or Box."
        )
    if tuple(space.shape) != (int(np.prod(space.shape)),):
        raise ValueError(
            f"{name}: continuous actions of shape {tuple(space.shape)} are not supported: the "
            "policy outputs a flat vector [D]; flatten the action box in the env."
        )
    if not np.prod(space.shape):
        raise ValueError(f"{name}: a continuous action box of shape {tuple(space.shape)} has no "
                         "action to choose; give it at least one dimension.")  # fmt: skip
    # Per dimension: an infinite bound clips nothing on its side, the finite ones still clip.
    low, high = space.low_array(), space.high_array()
    low = None if np.all(low == -np.inf) else low
    high = None if np.all(high == np.inf) else high
    return EnvSpec(obs_shape, False, int(np.prod(space.shape)), low, high, scale, dtype)


def _image_fits(obs_shape: tuple[int, ...]) -> bool:
    from rollout.ppo._networks import image_layout

    try:
        image_layout(obs_shape)  # the conv nets' own reading of H, W and channels
    except ValueError:
        return False
    return True


_FINAL_KEYS = ("final_obs", "final_observation")


def final_obs(info: dict) -> jax.Array:
    """The true last observation of an episode that just ended (auto-reset put a new one in
    obs); every env the learner takes has it (``check_functional_env``, host envs' own)."""
    return next(info[key] for key in _FINAL_KEYS if key in info)


def env_name(env: Any) -> str:
    """An env's ``name``, or its class's where it kept ``Env``'s default ("env" names none)."""
    name = getattr(env, "name", None)
    if isinstance(name, str) and name and name != "env":
        return name
    from rollout.envs import AutoReset

    while isinstance(env, AutoReset):  # the env it wraps
        env = env.env
    return type(env).__name__


def check_functional_env(env: Any, spec: EnvSpec) -> None:
    """Traces one env's ``reset`` and ``step`` abstractly (``jax.eval_shape``: nothing runs or
    compiles), so a user env's mistake is one ``ValueError`` naming it here, not a shape error
    inside the jitted update, and an env that never restarts its episodes (a bare env, not in
    ``AutoReset``) cannot train silently on what comes after their end.

    Refused: ``reset`` / ``step`` not returning ``(state, obs)`` / ``(state, obs, reward,
    terminated, truncated, info)``, observations that are not one array of the observation
    space's shape, a reward that is not an array, non-scalar rewards or flags, an ``info`` that
    is not a dict or lacks ``final_obs``, and an env object whose attributes change while its
    ``reset`` and ``step`` are traced (Python state: the compiled step would never see it)."""
    from rollout.envs import AutoReset

    name = env_name(env)
    # The wrapped env first: AutoReset's own tracing would fail on its mistakes less clearly.
    inner = env.env if isinstance(env, AutoReset) else env
    obs, next_obs, *flags, info = _trace_one_step(inner, name)
    for what, got in (("reset", obs), ("step", next_obs)):
        if tuple(got.shape) != spec.obs_shape:
            raise ValueError(
                f"{name}: {what} returns observations of shape {tuple(got.shape)}, but its "
                f"observation_space has shape {spec.obs_shape}."
            )
    for what, got in zip(("reward", "terminated", "truncated"), flags):
        if tuple(got.shape) != ():
            raise ValueError(
                f"{name}: step returns {what} of shape {tuple(got.shape)}; reward, terminated "
                "and truncated are scalars (one env: the learner vmaps it)."
            )
    # Traced again (the first trace let lazy caches settle): an attribute that changes now
    # changes at every call, state the compiled step would read once, at trace time.
    before = _attributes(env)
    info = _trace_one_step(env, name)[-1]
    _refuse_python_state(name, before)
    if not any(k in info for k in _FINAL_KEYS):
        raise ValueError(
            f"{name}: step's info has no 'final_obs', so nothing restarts finished episodes: "
            "wrap the env in rollout.envs.AutoReset (an env that restarts its own episodes "
            "must put the observation each step reached, before its reset, in "
            "info['final_obs'])."
        )


_STEP = "step(state, action, key, params=None) must return (state, obs, reward, terminated, "
_STEP += "truncated, info)"
_RESET = "reset(key, params=None) must return (state, obs)"


def _trace_one_step(env: Any, name: str) -> tuple:
    """``(obs, next_obs, reward, terminated, truncated, info)`` of one env, as shapes; a
    ``reset`` or ``step`` not returning what the functional API says is one ``ValueError``."""
    problems: list[str] = []

    def checked(fn: Any, n: int, *args: Any) -> Any:
        out = fn(*args)
        problem = _contract_problem(out, n)
        problems.extend([problem] if problem else [])
        return None if problem else out  # (what it returned may not even be JAX types)

    key = jax.eval_shape(lambda: jax.random.key(0))  # a shape: nothing placed on a device
    reset = jax.eval_shape(functools.partial(checked, env.reset, 2), key)
    if problems:
        raise ValueError(f"{name}: reset returns {problems[0]}; {_RESET}.")
    state, obs = reset
    action = jax.eval_shape(env.action_space.sample, key)
    stepped = jax.eval_shape(functools.partial(checked, env.step, 6), state, action, key)
    if problems:
        raise ValueError(f"{name}: step returns {problems[0]}; {_STEP}.")
    return (obs, *stepped[1:])


def _contract_problem(out: Any, n: int) -> str | None:
    """What is wrong with a traced ``reset`` (``n=2``) or ``step`` (``n=6``) return, if any."""
    if not isinstance(out, (tuple, list)) or len(out) != n:
        got = (f"{len(out)} values" if isinstance(out, (tuple, list))
               else "one array" if hasattr(out, "shape") else type(out).__name__)  # fmt: skip
        gym = n == 6 and isinstance(out, (tuple, list)) and len(out) in (4, 5)
        return got + (" (gym's API: no state first)" if gym else "")
    if not _is_array(out[1]):
        return (f"observations of type {type(out[1]).__name__}: observations must be one array "
                "(flatten dict or tuple observations into one vector)")  # fmt: skip
    if n == 6 and not _is_array(out[2]):
        return f"reward of type {type(out[2]).__name__}: reward must be an array (jnp.float32(r))"
    if n == 6 and not isinstance(out[5], dict):
        return f"info of type {type(out[5]).__name__}: info must be a dict of arrays ({{}} if none)"
    return None


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _attributes(env: Any, limit: int = 64) -> dict[int, tuple[Any, dict[str, tuple]]]:
    """The instance attributes of ``env`` and of the objects it holds (wrapped envs, an
    adapter's library env; up to ``limit`` objects): ``id -> (object, {name: (value, size)})``,
    with the size of a list, dict or set (they change in place)."""
    todo, out = [env], {}
    while todo and len(out) < limit:
        obj = todo.pop(0)
        if id(obj) in out or not _holds_state(obj):
            continue
        out[id(obj)] = (obj, _values(obj))
        todo.extend(vars(obj).values())
    return out


def _values(obj: Any) -> dict[str, tuple]:
    sized = (list, dict, set)
    return {k: (v, len(v) if isinstance(v, sized) else None) for k, v in vars(obj).items()}


def _holds_state(obj: Any) -> bool:
    skip = (type, types.ModuleType, types.FunctionType, types.MethodType, jax.Array, np.ndarray)
    return hasattr(obj, "__dict__") and not isinstance(obj, skip)


def _refuse_python_state(name: str, before: dict[int, tuple[Any, dict[str, tuple]]]) -> None:
    """An attribute rebound, resized or added since ``before`` is refused, naming it."""
    changed = []
    for obj, old in before.values():
        for key, (value, size) in _values(obj).items():
            if key not in old or old[key][0] is not value or old[key][1] != size:
                changed.append(f"{type(obj).__name__}.{key}")
    if changed:
        raise ValueError(
            f"{name}: {', '.join(changed)} changed while reset and step were traced; the "
            "learner compiles them once, so Python state kept on the env is read at trace "
            "time only: keep it in the state that reset returns and step takes and returns "
            "(a pure JAX env, like a frozen dataclass)."
        )


def to_env_action(action: jax.Array, spec: EnvSpec) -> jax.Array:
    """Clip continuous actions into the box (the log-prob stays that of the unclipped sample)."""
    if spec.discrete:
        return action.astype(jnp.int32)
    # None: unbounded on that side. Broadcast explicitly (jax_numpy_rank_promotion='raise').
    low, high = (None if b is None else jnp.broadcast_to(b, action.shape)
                 for b in (spec.action_low, spec.action_high))  # fmt: skip
    return jnp.clip(action, low, high)
