"""Generalised advantage estimation (Schulman et al. 2016) as one reverse ``lax.scan``."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gae(
    rewards: jax.Array,
    values: jax.Array,
    dones: jax.Array,
    last_value: jax.Array,
    gamma: float | jax.Array,
    gae_lambda: float | jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Advantages and value targets for a time-major trajectory.

    ``rewards``, ``values``, ``dones`` have shape ``[T, ...]``; ``dones[t]`` says the episode ended
    with step t (the next observation belongs to a new episode, so nothing is bootstrapped across
    it). ``last_value`` (shape ``[...]``) is V of the observation after the last step.

    Returns ``(advantages, returns)`` with ``returns = advantages + values``.

    Example:
      >>> import jax.numpy as jnp
      >>> dones = jnp.array([0.0, 1.0, 0.0])
      >>> adv, ret = gae(jnp.ones(3), jnp.zeros(3), dones, jnp.array(0.0), 1.0, 1.0)
      >>> adv.tolist()
      [2.0, 1.0, 1.0]
    """
    dtype = jnp.result_type(rewards, values)
    not_done = 1.0 - dones.astype(dtype)

    def back(carry, x):
        next_adv, next_value = carry
        reward, value, live = x
        delta = reward + gamma * next_value * live - value
        adv = delta + gamma * gae_lambda * live * next_adv
        return (adv, value), adv

    init = (jnp.zeros_like(last_value, dtype), last_value.astype(dtype))
    _, advantages = jax.lax.scan(back, init, (rewards, values, not_done), reverse=True)
    return advantages, advantages + values
