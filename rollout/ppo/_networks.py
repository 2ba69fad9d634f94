"""The actor-critic: two 64-64 tanh MLPs with orthogonal init (CleanRL / PureJaxRL), plus the
categorical and diagonal-Gaussian policy maths written out (no distribution library needed)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

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
        dense = lambda w, scale: nn.Dense(w, kernel_init=orthogonal(scale), bias_init=zeros)
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


def orthogonal(scale: float = 1.0) -> nn.initializers.Initializer:
    """``nn.initializers.orthogonal`` without LAPACK: QR by Gram-Schmidt in plain jnp ops.

    Same matrices as flax's (QR of a Gaussian matrix, signs fixed so diag(R) > 0) up to float
    rounding. Why: jax's QR is a LAPACK custom call, and a sharded init that runs it on
    several CPU devices at once with more than one member per device was seen to hang here
    (jax 0.10.2, 2 CPU devices, OpenBLAS); plain jnp ops do not.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> w = orthogonal()(jax.random.key(0), (8, 4))
      >>> bool(jnp.allclose(w.T @ w, jnp.eye(4), atol=1e-5))
      True
    """

    def init(key: jax.Array, shape: Sequence[int], dtype: Any = jnp.float32) -> jax.Array:
        n_rows, n_cols = math.prod(shape) // shape[-1], shape[-1]
        tall = (n_cols, n_rows) if n_rows < n_cols else (n_rows, n_cols)
        q = _gram_schmidt(jax.random.normal(key, tall, jnp.float32))
        if n_rows < n_cols:
            q = q.T
        return (scale * q.reshape(shape)).astype(dtype)

    return init


def _gram_schmidt(a: jax.Array) -> jax.Array:
    """Q of the thin QR of a tall matrix, diag(R) > 0 (classical Gram-Schmidt, twice)."""
    _, k = a.shape

    def column(j, q):
        v = a[:, j]
        for _ in range(2):  # re-orthogonalise once: CGS2 is as accurate as Householder here
            v = v - q @ (q.T @ v)  # columns >= j of q are still zero
        return q.at[:, j].set(v / jnp.linalg.norm(v))

    return jax.lax.fori_loop(0, k, column, jnp.zeros_like(a))


_LOG_2PI = float(np.log(2 * np.pi))


def noise(key: jax.Array, shape: tuple[int, ...], discrete: bool, action_dim: int) -> jax.Array:
    """The randomness of ``shape`` action draws: Gumbel per logit, or N(0, 1) per dimension.

    Drawn for a whole rollout at once: on CPU every ``jax.random`` call in a loop body is a
    small loop of its own, run once per step.
    """
    draw = jax.random.gumbel if discrete else jax.random.normal
    return draw(key, (*shape, action_dim), jnp.float32)


def sample(pi, noise: jax.Array, discrete: bool) -> jax.Array:
    """One action per row from :func:`noise`: the Gumbel-max of the logits (what
    ``jax.random.categorical`` computes), or mean + std * N(0, 1).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> logits = jnp.log(jnp.array([[0.2, 0.8]]))
      >>> key = jax.random.key(0)
      >>> a = sample(logits, noise(key, (1,), True, 2), True)
      >>> bool(a == jax.random.categorical(key, logits))
      True
    """
    if discrete:
        return jnp.argmax(pi + noise, axis=-1)
    mean, log_std = pi
    return mean + jnp.exp(log_std) * noise


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
