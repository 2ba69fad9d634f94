"""The actor-critic: two 64-64 tanh MLPs with orthogonal init (CleanRL / PureJaxRL), plus the
categorical and diagonal-Gaussian policy maths written out (no distribution library needed)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


class ActorCritic(nn.Module):
    """Separate actor and critic MLPs.

    Discrete: returns ``(logits[..., A], value[...])``. Continuous: returns
    ``((mean[..., A], log_std[..., A]), value[...])`` with a state-independent ``log_std``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> net = ActorCritic(action_dim=2, discrete=True)
      >>> variables = net.init(jax.random.key(0), jnp.zeros((5, 4)))
      >>> logits, value = net.apply(variables, jnp.zeros((5, 4)))
      >>> logits.shape, value.shape
      ((5, 2), (5,))
    """

    action_dim: int
    discrete: bool = True
    hidden: Sequence[int] = (64, 64)

    @nn.compact
    def __call__(self, obs: jax.Array):
        hidden_init = nn.initializers.orthogonal(math.sqrt(2.0))
        zeros = nn.initializers.zeros

        def mlp(x, prefix):
            for i, width in enumerate(self.hidden):
                dense = nn.Dense(
                    width, kernel_init=hidden_init, bias_init=zeros, name=f"{prefix}{i}"
                )
                x = nn.tanh(dense(x))
            return x

        # Small policy-head init keeps the first policy near uniform / near zero mean (CleanRL).
        head = nn.Dense(
            self.action_dim,
            kernel_init=nn.initializers.orthogonal(0.01),
            bias_init=zeros,
            name="actor_out",
        )(mlp(obs, "actor"))
        value = nn.Dense(
            1, kernel_init=nn.initializers.orthogonal(1.0), bias_init=zeros, name="critic_out"
        )(mlp(obs, "critic"))[..., 0]
        if self.discrete:
            return head, value
        log_std = self.param("log_std", zeros, (self.action_dim,))
        return (head, jnp.broadcast_to(log_std, head.shape)), value


_LOG_2PI = float(np.log(2 * np.pi))


def sample(pi, key: jax.Array, discrete: bool) -> jax.Array:
    """One action per row: categorical over logits, or mean + std * N(0, 1)."""
    if discrete:
        return jax.random.categorical(key, pi, axis=-1)
    mean, log_std = pi
    return mean + jnp.exp(log_std) * jax.random.normal(key, mean.shape, mean.dtype)


def log_prob(pi, action: jax.Array, discrete: bool) -> jax.Array:
    if discrete:
        logp = jax.nn.log_softmax(pi, axis=-1)
        return jnp.take_along_axis(logp, action[..., None].astype(jnp.int32), axis=-1)[..., 0]
    mean, log_std = pi
    z = (action - mean) * jnp.exp(-log_std)
    return jnp.sum(-0.5 * z * z - log_std - 0.5 * _LOG_2PI, axis=-1)


def entropy(pi, discrete: bool) -> jax.Array:
    if discrete:
        logp = jax.nn.log_softmax(pi, axis=-1)
        return -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    _, log_std = pi
    return jnp.sum(log_std + 0.5 + 0.5 * _LOG_2PI, axis=-1)
