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

    def setup(self) -> None:
        zeros = nn.initializers.zeros
        dense = lambda w, scale: nn.Dense(
            w, kernel_init=nn.initializers.orthogonal(scale), bias_init=zeros
        )
        self.actor = [dense(w, math.sqrt(2.0)) for w in self.hidden]
        # Small policy-head init keeps the first policy near uniform / near zero mean (CleanRL).
        self.actor_out = dense(self.action_dim, 0.01)
        self.critic = [dense(w, math.sqrt(2.0)) for w in self.hidden]
        self.critic_out = dense(1, 1.0)
        if not self.discrete:
            self.log_std = self.param("log_std", zeros, (self.action_dim,))

    def __call__(self, obs: jax.Array):
        x = obs
        for layer in self.actor:
            x = nn.tanh(layer(x))
        head = self.actor_out(x)
        value = self.value(obs)
        if self.discrete:
            return head, value
        return (head, jnp.broadcast_to(self.log_std, head.shape)), value

    def value(self, obs: jax.Array) -> jax.Array:
        """The critic alone (cheaper when only V is needed, e.g. to bootstrap a truncation)."""
        x = obs
        for layer in self.critic:
            x = nn.tanh(layer(x))
        return self.critic_out(x)[..., 0]


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
