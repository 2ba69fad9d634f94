"""The functional environment API: spaces, the `Env` base class and the auto-reset wrapper.

An environment is a frozen (hashable) dataclass whose fields are its static configuration. Its
methods are pure functions of arrays, so they can be jitted, vmapped, scanned, exported with
`jax.export`, or run on CPU cores through `rollout.on_cpu`:

- `reset(key, params=None) -> (state, obs)`
- `step(state, action, key, params=None) -> (state, obs, reward, terminated, truncated, info)`

`state` is a pytree (a NamedTuple) that carries the step counter `t` used for truncation.
`params` is the env's *array* input that may change every step (the audio env's synthesiser
weights); environments without such input (CartPole, Pendulum) ignore it. `None` means
`env.default_params()`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
PRNGKey = jax.Array
PyTree = Any
Info = dict[str, Array]
StepResult = tuple[PyTree, Array, Array, Array, Array, Info]


# --------------------------------------------------------------------------------------------
# Spaces
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Discrete:
    """Discrete actions `0 .. num_actions - 1`, one int32 scalar per env.

    Example:
      >>> import jax
      >>> space = Discrete(3)
      >>> a = space.sample(jax.random.key(0))
      >>> a.shape, a.dtype, 0 <= int(a) < space.n
      ((), dtype('int32'), True)
    """

    num_actions: int
    shape: tuple[int, ...] = ()
    dtype: Any = jnp.int32

    def __post_init__(self) -> None:
        n = self.num_actions
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"Discrete: num_actions must be a positive int, got {n!r}.")

    @property
    def n(self) -> int:
        """Alias of `num_actions` (gymnasium's name)."""
        return self.num_actions

    def sample(self, key: PRNGKey) -> Array:
        """A uniformly random action."""
        return jax.random.randint(key, self.shape, 0, self.num_actions, dtype=self.dtype)


@dataclasses.dataclass(frozen=True)
class MultiDiscrete:
    """Several discrete choices per step: element ``j`` of an action is in ``0 .. nvec[j] - 1``
    (gymnasium's ``MultiDiscrete`` with a vector ``nvec``); one int32 vector ``[len(nvec)]``
    per env. The PPO policy picks each element from its own categorical distribution.

    Example:
      >>> import jax
      >>> space = MultiDiscrete((3, 2))
      >>> a = space.sample(jax.random.key(0))
      >>> a.shape, a.dtype, bool((a >= 0).all() and (a < space.nvec_array()).all())
      ((2,), dtype('int32'), True)
    """

    nvec: tuple[int, ...]
    dtype: Any = jnp.int32

    def __post_init__(self) -> None:
        nvec = self.nvec
        ints = isinstance(nvec, (tuple, list)) and all(
            isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 1 for n in nvec
        )
        if not ints or not nvec:
            raise ValueError(
                f"MultiDiscrete: nvec must be a non-empty tuple of positive ints, got {nvec!r}."
            )
        object.__setattr__(self, "nvec", tuple(int(n) for n in nvec))

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.nvec),)

    def nvec_array(self) -> np.ndarray:
        """`nvec` as an int32 array."""
        return np.asarray(self.nvec, np.int32)

    def sample(self, key: PRNGKey) -> Array:
        """A uniformly random action (each element uniform over its choices)."""
        u = jax.random.uniform(key, self.shape)
        return jnp.minimum(jnp.floor(u * self.nvec_array()), self.nvec_array() - 1).astype(
            self.dtype
        )


@dataclasses.dataclass(frozen=True)
class Box:
    """A float box of `shape`; `low`/`high` are per-element tuples (flattened), may be inf.

    Example:
      >>> import jax
      >>> box = Box((2,), low=(-1.0, 0.0), high=(1.0, float("inf")))
      >>> x = box.sample(jax.random.key(0))  # element 1: 0 + Exponential(1), as gymnasium
      >>> x.shape, bool(((x >= box.low_array()) & (x <= box.high_array())).all())
      ((2,), True)
    """

    shape: tuple[int, ...]
    low: tuple[float, ...]
    high: tuple[float, ...]
    dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        size = math.prod(self.shape)
        for name in ("low", "high"):
            value = np.broadcast_to(np.asarray(getattr(self, name), np.float64), (size,))
            object.__setattr__(self, name, tuple(float(v) for v in value))
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        # Caught here: clipping to an inverted box sends `high` whatever the policy chose.
        bad = [i for i, (lo, hi) in enumerate(zip(self.low, self.high)) if not lo <= hi]
        if bad:
            i = bad[0]
            raise ValueError(
                f"Box bounds must have low <= high (and no NaN) in every element; element {i} "
                f"(of {len(bad)} such) has low={self.low[i]}, high={self.high[i]}"
            )

    @staticmethod
    def uniform(shape: tuple[int, ...], low: float, high: float) -> Box:
        """A box with the same bounds on every element."""
        size = math.prod(shape)
        return Box(tuple(shape), (float(low),) * size, (float(high),) * size)

    def low_array(self) -> np.ndarray:
        """`low` as a float32 array of `shape`."""
        return np.asarray(self.low, np.float32).reshape(self.shape)

    def high_array(self) -> np.ndarray:
        """`high` as a float32 array of `shape`."""
        return np.asarray(self.high, np.float32).reshape(self.shape)

    def sample(self, key: PRNGKey) -> Array:
        """In the box, per element as gymnasium's ``Box.sample``: uniform in [low, high] where
        both are finite, ``low + Exponential(1)`` / ``high - Exponential(1)`` where only one
        is, standard normal where neither is. Drawn in float32 and cast to `dtype`, so a
        low-precision box's effective bounds are `low` and `high` rounded to `dtype`, as
        gymnasium stores them.

        Example:
          >>> import jax
          >>> box = Box((2,), (10.0, float("-inf")), (float("inf"), -5.0))
          >>> x = box.sample(jax.random.key(0))
          >>> bool(x[0] >= 10.0 and x[1] <= -5.0)
          True
        """
        low, high = self.low_array(), self.high_array()
        has_low, has_high = np.isfinite(low), np.isfinite(high)
        k_uniform, k_exp, k_normal = jax.random.split(key, 3)
        # Drawn in float32, then cast: float16's high - low overflows for wide boxes.
        f32 = jnp.float32
        uniform = jax.random.uniform(
            k_uniform, self.shape, f32, np.where(has_low, low, 0.0), np.where(has_high, high, 1.0)
        )
        tail = jax.random.exponential(k_exp, self.shape, f32)
        one_sided = np.where(has_low, low, high) + np.where(has_low, 1.0, -1.0) * tail
        normal = jax.random.normal(k_normal, self.shape, f32)
        x = jnp.where(has_low | has_high, one_sided, normal)
        return jnp.where(has_low & has_high, uniform, x).astype(self.dtype)


Space = Discrete | MultiDiscrete | Box


# --------------------------------------------------------------------------------------------
# Env base class
# --------------------------------------------------------------------------------------------


class Env:
    """Base class of the functional environments (subclasses are frozen dataclasses).

    Subclasses define `observation_space`, `action_space`, `max_episode_steps`, `reset` and
    `step`; `default_params` when they take array inputs.

    Example:
      >>> import dataclasses, jax, jax.numpy as jnp
      >>> @dataclasses.dataclass(frozen=True)
      ... class Countdown(Env):  # reward 1 a step; terminates after `steps` steps
      ...     steps: int = 3
      ...     max_episode_steps: int = 100
      ...     observation_space = Box.uniform((1,), 0.0, 100.0)
      ...     action_space = Discrete(1)
      ...     def reset(self, key, params=None):
      ...         return jnp.int32(0), jnp.full(1, float(self.steps))
      ...     def step(self, t, action, key, params=None):
      ...         t = t + 1
      ...         obs = jnp.full(1, self.steps - t, jnp.float32)
      ...         return t, obs, jnp.float32(1), t >= self.steps, t >= self.max_episode_steps, {}
      >>> env = Countdown()
      >>> state, obs = env.reset(jax.random.key(0))
      >>> state, obs, reward, terminated, truncated, info = env.step(state, 0, jax.random.key(1))
      >>> obs.tolist(), bool(terminated)
      ([2.0], False)
    """

    name: str = "env"

    @property
    def observation_space(self) -> Box:
        """The space of one observation (a `Box`)."""
        raise NotImplementedError

    @property
    def action_space(self) -> Space:
        """The space of one action: a `Discrete`, a `MultiDiscrete` or a `Box`."""
        raise NotImplementedError

    @property
    def unwrapped(self) -> Env:
        """The innermost env (itself, for an unwrapped env)."""
        return self

    def default_params(self) -> PyTree:
        """The array inputs used when `params=None` (None for envs without any)."""
        return None

    def reset(self, key: PRNGKey, params: PyTree = None) -> tuple[PyTree, Array]:
        """A new episode: `(state, obs)`, drawn with `key`; `params` as for `step`."""
        raise NotImplementedError

    def step(self, state: PyTree, action: Array, key: PRNGKey, params: PyTree = None) -> StepResult:
        """One step: `(state, obs, reward, terminated, truncated, info)`, a pure function.

        `params` are the env's array inputs (`None`: `default_params()`); `info` is a dict of
        arrays with the same keys at every step.
        """
        raise NotImplementedError


def valid_discrete_action(action: Array, n: int, env: str) -> Array:
    """Whether ``action`` is one of ``0 .. n-1``; a concrete action that is not is a ValueError.

    Under ``jit`` an env cannot raise, so its ``step`` should turn an invalid action's results
    into NaN (visible in every return and loss) rather than into a plausible number.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from rollout.envs import valid_discrete_action
      >>> jax.jit(lambda a: valid_discrete_action(a, 2, "MyEnv"))(jnp.array([0, 1, 2])).tolist()
      [True, True, False]
      >>> valid_discrete_action(3, 2, "MyEnv")
      Traceback (most recent call last):
      ...
      ValueError: MyEnv takes an integer action in [0, 2), not 3
    """
    a = jnp.asarray(action)
    valid = (a >= 0) & (a < n)
    if jnp.issubdtype(a.dtype, jnp.floating):
        valid = valid & (a == jnp.floor(a))
    if not isinstance(valid, jax.core.Tracer) and not bool(jnp.all(valid)):
        raise ValueError(f"{env} takes an integer action in [0, {n}), not {action}")
    return valid


# --------------------------------------------------------------------------------------------
# Auto-reset with episode statistics
# --------------------------------------------------------------------------------------------


class AutoResetState(NamedTuple):
    """State of `AutoReset`: the inner env's state and the running episode statistics.

    Example:
      >>> import jax
      >>> from rollout.envs import make
      >>> state, obs = make("cartpole").reset(jax.random.key(0))
      >>> int(state.env_state.t), float(state.episode_return), int(state.episode_length)
      (0, 0.0, 0)
    """

    env_state: PyTree
    episode_return: Array  # float32: sum of rewards of the current episode so far
    episode_length: Array  # int32: steps of the current episode so far


@dataclasses.dataclass(frozen=True)
class AutoReset(Env):
    """Resets the wrapped env when an episode ends; reports the true final obs and statistics.

    `step` returns, when `terminated | truncated`, the state and observation of a fresh episode
    (reset with a key split from the step's key), and in `info`:

    - `final_obs`: the observation the step actually reached, before any reset (equals `obs`
      where not done). Use it to bootstrap values on truncation.
    - `done`: `terminated | truncated`.
    - `episode_return`, `episode_length`: return and length of the current episode up to and
      including this step; where `done` they are the finished episode's totals. A learner's mean
      return is `sum(where(done, episode_return, 0)) / max(sum(done), 1)`.
    - every key of the wrapped env's own `info` (from the true, pre-reset step).

    All shapes are static; the reset is computed every step and selected with `jnp.where`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from rollout.envs import Pendulum
      >>> env = AutoReset(Pendulum(max_episode_steps=2))
      >>> state, obs = env.reset(jax.random.key(0))
      >>> step = jax.jit(env.step)
      >>> for key in jax.random.split(jax.random.key(1), 2):
      ...     state, obs, reward, terminated, truncated, info = step(state, jnp.zeros(1), key)
      >>> bool(info["done"]), int(info["episode_length"]), int(state.episode_length)  # restarted
      (True, 2, 0)
    """

    env: Env

    @property
    def name(self) -> str:  # type: ignore[override]
        """The wrapped env's name."""
        return self.env.name

    @property
    def observation_space(self) -> Box:
        """The wrapped env's observation space."""
        return self.env.observation_space

    @property
    def action_space(self) -> Space:
        """The wrapped env's action space."""
        return self.env.action_space

    @property
    def max_episode_steps(self) -> int:
        """The wrapped env's time limit (steps before truncation)."""
        return self.env.max_episode_steps  # type: ignore[attr-defined]

    @property
    def unwrapped(self) -> Env:
        """The innermost env, below this and any other wrapper (its fields, `default_params`)."""
        return self.env.unwrapped

    def default_params(self) -> PyTree:
        """The wrapped env's `default_params()`; `None` for an env without one (no array
        inputs: the functional API does not require it)."""
        own = getattr(self.env, "default_params", None)
        return None if own is None else own()

    def reset(self, key: PRNGKey, params: PyTree = None) -> tuple[AutoResetState, Array]:
        """The wrapped env's reset, with the episode statistics at zero."""
        env_state, obs = self.env.reset(key, params)
        return AutoResetState(env_state, jnp.float32(0.0), jnp.int32(0)), obs

    def step(
        self, state: AutoResetState, action: Array, key: PRNGKey, params: PyTree = None
    ) -> StepResult:
        """The wrapped env's step, restarting a finished episode in the same call.

        Where `terminated | truncated`, the returned state and `obs` are a fresh episode's; `info`
        adds `final_obs`, `done`, `episode_return` and `episode_length` (see the class).
        """
        if params is None:
            params = self.default_params()
        step_key, reset_key = jax.random.split(key)
        env_state, obs, reward, terminated, truncated, info = self.env.step(
            state.env_state, action, step_key, params
        )
        done = jnp.logical_or(terminated, truncated)
        episode_return = state.episode_return + reward.astype(jnp.float32)
        episode_length = state.episode_length + 1
        reset_state, reset_obs = self.env.reset(reset_key, params)
        pick = lambda fresh, cont: jnp.where(done, fresh, cont)
        new_state = AutoResetState(
            jax.tree.map(pick, reset_state, env_state),
            jnp.where(done, 0.0, episode_return).astype(jnp.float32),
            jnp.where(done, 0, episode_length).astype(jnp.int32),
        )
        info = dict(info)
        info.update(
            final_obs=obs,
            done=done,
            episode_return=episode_return,
            episode_length=episode_length,
        )
        return new_state, pick(reset_obs, obs), reward, terminated, truncated, info
