"""``gymnax`` environments on the project's functional env API (``rollout.envs._core.Env``).

gymnax envs are already pure JAX; the adapter only reorders their signatures:

- gymnax ``reset(key, params) -> (obs, state)``      -> ours ``reset(key, params) -> (state, obs)``
- gymnax ``step_env(key, state, action, params)``    -> ours ``step(state, action, key, params)``
  returning ``(state, obs, reward, terminated, truncated, info)``, with ``truncated`` from
  gymnax's own ``is_truncated`` (its time limit), and no auto-reset: ``rollout.envs.make`` wraps
  the adapter in ``AutoReset``, which splits the step key exactly as gymnax's ``step`` does, so
  the wrapped env reproduces gymnax's auto-resetting ``step`` bit for bit.

``params`` is gymnax's ``EnvParams`` (``None``: the env's defaults), so a learner can change
physics per call like any other ``params`` input. Observations are gymnax's own, except that a
``Discrete`` one comes one-hot and a ``Box`` that is neither a vector nor an image ``[H, W, C]``
(bsuite's ``(10, 5)`` Catch board) comes flattened, as gymnasium's ``FlattenObservation`` does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rollout.envs._core import Box, Discrete, Env, Space, valid_discrete_action


def _gymnax():
    try:
        import gymnax
    except ImportError:
        raise ValueError(
            "gymnax: ids need the optional gymnax package: pip install 'sharded-ensembles[gymnax]'"
        ) from None
    return gymnax


def _space(space: Any, what: str, name: str) -> Space:
    kind = type(space).__name__
    if kind == "Discrete" and what == "action":
        return Discrete(int(space.n))
    if kind == "Box":
        shape = tuple(space.shape)
        low = np.broadcast_to(np.asarray(space.low, np.float64), shape).ravel()
        high = np.broadcast_to(np.asarray(space.high, np.float64), shape).ravel()
        return Box(shape, tuple(low), tuple(high))
    if kind == "Discrete" and what == "observation":
        return Box((int(space.n),), (0.0,) * int(space.n), (1.0,) * int(space.n))
    raise ValueError(
        f"gymnax:{name}: {what} space {space} is not supported (observations: a Box or a "
        "Discrete; actions: a Box or a Discrete)"
    )


def _flat_space(space: Box) -> Box:
    """A Box that is neither a vector nor an image ``[H, W, C]``, as one vector (gymnasium's
    ``FlattenObservation`` does the same): bsuite's ``(10, 5)`` Catch board, say."""
    if len(space.shape) in (1, 3):
        return space
    size = int(np.prod(space.shape))
    return Box((size,), tuple(space.low), tuple(space.high), space.dtype)


def _check_array_param(where: str, value: Any, default: Any) -> jax.Array:
    """An array field (Acrobot's ``available_torque``) as an array of the default's shape and
    dtype: a JSON list stayed a list, and the env's step failed on indexing it with a tracer."""
    try:
        given = np.asarray(value)
    except Exception:
        given = None
    ok = given is not None and given.dtype.kind in "biuf" and given.shape == np.shape(default)
    if not ok or not np.isfinite(given).all():
        raise ValueError(
            f"{where}: give {np.size(default)} finite numbers, shaped {list(np.shape(default))} "
            f"(the default is {np.asarray(default).tolist()})."
        )
    return jnp.asarray(given, jax.dtypes.canonicalize_dtype(np.asarray(default).dtype))


def _check_param(env_id: str, name: str, value: Any, default: Any) -> Any:
    """A value for a field of gymnax's ``EnvParams`` that the env can run with: a finite
    number of the default's kind (gymnax takes any value silently: a negative
    ``max_steps_in_episode`` ended every episode after one step), returned as that kind:
    JSON's ``200`` for a float field (or ``5.0`` for an int one) failed deep in the env's
    step on mixed dtypes ("lax.select requires arguments to have the same dtypes")."""
    where = f"gymnax:{env_id}: env kwarg {name}={value!r}"
    kind = np.asarray(default).dtype.kind
    if kind not in "biuf":
        return value  # a structure: gymnax's to judge
    if np.ndim(default):
        return _check_array_param(where, value, default)
    try:  # Python, NumPy or JAX scalars alike
        given = np.asarray(value) if np.ndim(value) == 0 else None
    except Exception:
        given = None
    got = given.dtype.kind if given is not None else "?"
    if kind == "b":
        if got != "b":
            raise ValueError(f"{where}: give true or false (the default is {default}).")
        return value
    if got not in "iuf" or not np.isfinite(given):
        raise ValueError(f"{where}: give a finite number (the default is {default}).")
    if kind in "iu" and given != int(given):
        raise ValueError(f"{where}: give a whole number (the default is {default}).")
    # As JAX holds it (int32, float32 without x64): a larger int wraps, a larger float is inf.
    held = jax.dtypes.canonicalize_dtype(np.asarray(default).dtype)
    as_python = int if kind in "iu" else float  # compared as Python numbers: no cast warning
    info = np.iinfo(held) if kind in "iu" else np.finfo(held)
    low, high = as_python(info.min), as_python(info.max)
    if not low <= as_python(given) <= high:
        span = f"[{low}, {high}]" if kind in "iu" else f"[{low:g}, {high:g}]"
        raise ValueError(
            f"{where}: give a {'whole ' if kind in 'iu' else ''}number in {span} (the field's "
            f"{held} range; the default is {default})."
        )
    if name == "max_steps_in_episode" and given < 1:
        raise ValueError(f"{where}: an episode needs at least one step.")
    if isinstance(default, (int, float)):  # a Python number, as gymnax's defaults mostly are
        return as_python(given)
    return jnp.asarray(given, held)


@dataclasses.dataclass(frozen=True, eq=False)
class GymnaxEnv(Env):
    """A gymnax environment (``gymnax.make(env_id, **kwargs)``) as a ``rollout.envs.Env``.

    ``kwargs`` naming a field of the env's ``EnvParams`` (``max_steps_in_episode``, a
    physical constant) set that field of its default params; the rest go to ``gymnax.make``.
    """

    env_id: str
    kwargs: tuple[tuple[str, Any], ...] = ()
    _env: Any = dataclasses.field(init=False, repr=False)
    _params: Any = dataclasses.field(init=False, repr=False)
    _one_hot: int = dataclasses.field(init=False, repr=False)  # n of a Discrete observation
    _spaces: tuple[Box, Space] = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        gymnax = _gymnax()
        if self.env_id not in gymnax.registered_envs:
            raise ValueError(
                f"unknown gymnax env {self.env_id!r}; registered: "
                f"{', '.join(gymnax.registered_envs)}"
            )
        env, params = self._make(gymnax)
        object.__setattr__(self, "_env", env)
        object.__setattr__(self, "_params", params)
        raw = env.observation_space(params)
        object.__setattr__(self, "_one_hot", int(raw.n) if type(raw).__name__ == "Discrete" else 0)
        # Read once here, not while traced: gymnax builds some spaces with jnp, whose arrays
        # are tracers inside a jitted step (Reacher-misc's action bounds).
        with jax.ensure_compile_time_eval():
            obs_space = _space(env.observation_space(params), "observation", self.env_id)
            action_space = _space(env.action_space(params), "action", self.env_id)
        object.__setattr__(self, "_spaces", (_flat_space(obs_space), action_space))

    def _make(self, gymnax: Any) -> tuple[Any, Any]:
        """``gymnax.make`` with the kwargs it takes, the default params with the others."""
        kwargs, fields = dict(self.kwargs), set()
        try:
            env = gymnax.make(self.env_id)[0]
            fields = {f.name for f in dataclasses.fields(env.default_params)}
            env, params = gymnax.make(
                self.env_id, **{k: v for k, v in kwargs.items() if k not in fields}
            )
        except OSError as e:  # MNISTBandit-bsuite downloads its data
            raise ValueError(
                f"gymnax cannot make {self.env_id!r}: {type(e).__name__}: {e} (it loads data "
                "from the network)"
            ) from None
        except TypeError as e:  # a kwarg its constructor does not take
            raise ValueError(
                f"gymnax:{self.env_id}: {e}; kwargs go to gymnax.make, or set a field of its "
                f"params ({', '.join(sorted(fields))})."
            ) from None
        given = {
            k: _check_param(self.env_id, k, v, getattr(params, k))
            for k, v in kwargs.items()
            if k in fields
        }
        return env, params.replace(**given)

    def _obs(self, obs: jax.Array) -> jax.Array:
        """gymnax's observation as :attr:`observation_space` describes it: a Discrete one
        one-hot, a Box that is neither a vector nor an image flattened (as gymnasium does)."""
        if self._one_hot:
            return jax.nn.one_hot(obs, self._one_hot, dtype=jnp.float32)
        shape, dtype = self._spaces[0].shape, self._spaces[0].dtype
        # In the space's dtype: FourRooms-misc gives int32 positions in a float32 box.
        return (obs if obs.shape == shape else obs.reshape(shape)).astype(dtype)

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"gymnax:{self.env_id}"

    @property
    def gymnax_env(self) -> Any:
        """The wrapped gymnax environment."""
        return self._env

    @property
    def observation_space(self) -> Box:
        return self._spaces[0]

    @property
    def action_space(self) -> Space:
        return self._spaces[1]

    @property
    def max_episode_steps(self) -> int:
        return int(self._params.max_steps_in_episode)

    def default_params(self) -> Any:
        return self._params

    def reset(self, key: jax.Array, params: Any = None) -> tuple[Any, jax.Array]:
        params = self._params if params is None else params
        obs, state = self._env.reset_env(key, params)
        return state, self._obs(obs)

    def step(self, state: Any, action: jax.Array, key: jax.Array, params: Any = None) -> tuple:
        params = self._params if params is None else params
        obs, state, reward, terminated, info = self._env.step_env(key, state, action, params)
        truncated = self._env.is_truncated(state, params)
        reward = jnp.asarray(reward, jnp.float32)
        obs = self._obs(obs)
        space = self.action_space
        if isinstance(space, Discrete):  # gymnax indexes with the action, and JAX clamps indices
            valid = valid_discrete_action(action, space.n, self.name)
            reward = jnp.where(valid, reward, jnp.nan)
            if jnp.issubdtype(obs.dtype, jnp.floating):
                obs = jnp.where(valid, obs, jnp.nan)
        return state, obs, reward, jnp.asarray(terminated), jnp.asarray(truncated), dict(info)
