"""What the learner needs to know about a ``rollout.envs`` environment, read off the env once."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """Observation shape and action space of one (unbatched) environment."""

    obs_shape: tuple[int, ...]
    discrete: bool
    action_dim: int  # number of actions (discrete) or action vector size (continuous)
    action_low: Any = None
    action_high: Any = None


def known_envs() -> tuple[str, ...]:
    """Env names that ``rollout.envs.make`` accepts, lower-cased."""
    from rollout import envs

    return tuple(name.lower() for name in envs.ENV_NAMES)


def make_env(name: str) -> Any:
    from rollout import envs

    return envs.make(name)


def spec_of(env: Any) -> EnvSpec:
    """Reads the observation and action spaces off a ``rollout.envs`` environment."""
    from rollout.envs import Discrete

    obs_shape = tuple(env.observation_space.shape)
    space = env.action_space
    if isinstance(space, Discrete):
        return EnvSpec(obs_shape, True, int(space.num_actions))
    if tuple(space.shape) != (int(np.prod(space.shape)),):
        raise ValueError(f"only flat continuous action boxes are supported, got {space.shape}")
    low, high = space.low_array(), space.high_array()
    # Infinite bounds: no clipping on that side.
    low = None if not np.all(np.isfinite(low)) else low
    high = None if not np.all(np.isfinite(high)) else high
    return EnvSpec(obs_shape, False, int(np.prod(space.shape)), low, high)


def final_obs(info: dict, obs: jax.Array) -> jax.Array:
    """The true last observation of an episode that just ended (auto-reset put a new one in obs)."""
    for key in ("final_obs", "final_observation"):
        if key in info:
            return info[key]
    return obs  # env without the key: bootstrapping on truncation then uses the reset obs


def to_env_action(action: jax.Array, spec: EnvSpec) -> jax.Array:
    """Clip continuous actions into the box (the log-prob stays that of the unclipped sample)."""
    if spec.discrete:
        return action.astype(jnp.int32)
    if spec.action_low is not None and spec.action_high is not None:
        return jnp.clip(action, spec.action_low, spec.action_high)
    return action
