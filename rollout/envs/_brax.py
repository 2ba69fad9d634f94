"""Brax environments on the project's functional env API (``rollout.envs._core.Env``).

Brax envs are pure JAX (``reset(rng) -> State``, ``step(State, action) -> State``, where
``State`` holds ``obs``, ``reward`` and ``done``); the adapter only adds what the API needs:

- a step key (ignored: Brax's dynamics are deterministic) and ``params`` (none);
- the time limit: Brax leaves it to its ``EpisodeWrapper``, which reports a time limit as
  ``done`` with ``info['truncation']``; here the adapter counts the steps itself, so
  ``terminated`` is Brax's own ``done`` and ``truncated`` is the limit (``episode_length``,
  default 1000 as in Brax's training wrappers), kept apart for the value bootstrap;
- no auto-reset: ``rollout.envs.make`` wraps the adapter in ``AutoReset``.

Actions are ``Box(-1, 1)`` of ``action_size``, as Brax's training code assumes.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from rollout.envs._core import Box, Env

#: Brax's own default episode length (``brax.envs.create``, its training wrappers).
EPISODE_LENGTH = 1000


def _brax_envs() -> Any:
    try:
        from brax import envs
    except ImportError:
        raise ValueError(
            "brax: ids need the optional Brax package: pip install 'sharded-ensembles[brax]'"
        ) from None
    return envs


class BraxState(NamedTuple):
    """Brax's own ``State`` and the steps taken in this episode (for the time limit)."""

    brax: Any
    t: jax.Array


@dataclasses.dataclass(frozen=True, eq=False)
class BraxEnv(Env):
    """A Brax environment (``brax.envs.get_environment(env_id, **kwargs)``) as a
    ``rollout.envs.Env``; ``kwargs`` may include ``backend`` ('generalized', 'spring',
    'positional') and ``episode_length`` (this adapter's time limit)."""

    env_id: str
    kwargs: tuple[tuple[str, Any], ...] = ()
    _env: Any = dataclasses.field(init=False, repr=False)
    _limit: int = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        envs = _brax_envs()
        kwargs = dict(self.kwargs)
        limit = kwargs.pop("episode_length", EPISODE_LENGTH)
        if isinstance(limit, bool) or not isinstance(limit, numbers.Integral) or limit < 1:
            raise ValueError(
                f"brax:{self.env_id}: episode_length must be a positive int, got {limit!r}."
            )
        limit = int(limit)
        known = sorted(envs._envs) if hasattr(envs, "_envs") else None
        if known is not None and self.env_id not in known:
            raise ValueError(f"unknown brax env {self.env_id!r}; registered: {', '.join(known)}")
        object.__setattr__(self, "_env", envs.get_environment(self.env_id, **kwargs))
        object.__setattr__(self, "_limit", limit)

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"brax:{self.env_id}"

    @property
    def brax_env(self) -> Any:
        """The wrapped Brax environment."""
        return self._env

    @functools.cached_property
    def observation_space(self) -> Box:
        # Brax's own ``observation_size`` runs ``reset`` eagerly, op by op (11 s for the
        # generalized backend's inverted pendulum); its shape alone needs only a trace.
        obs = jax.eval_shape(self._env.reset, jax.ShapeDtypeStruct((2,), jnp.uint32)).obs
        if not isinstance(obs, jax.ShapeDtypeStruct) or len(obs.shape) != 1:
            raise ValueError(f"brax:{self.env_id}: observations must be one vector, got {obs}")
        size = obs.shape[0]
        return Box((size,), (-float("inf"),) * size, (float("inf"),) * size)

    @property
    def action_space(self) -> Box:
        size = int(self._env.action_size)
        return Box((size,), (-1.0,) * size, (1.0,) * size)

    @property
    def max_episode_steps(self) -> int:
        return self._limit

    def reset(self, key: jax.Array, params: Any = None) -> tuple[BraxState, jax.Array]:
        state = self._env.reset(key)
        return BraxState(state, jnp.zeros((), jnp.int32)), state.obs

    def step(
        self, state: BraxState, action: jax.Array, key: jax.Array, params: Any = None
    ) -> tuple:
        inner = self._env.step(state.brax, action)
        t = state.t + 1
        terminated = inner.done > 0
        truncated = (t >= self._limit) & ~terminated
        reward = jnp.asarray(inner.reward, jnp.float32)
        return BraxState(inner, t), inner.obs, reward, terminated, truncated, {}
