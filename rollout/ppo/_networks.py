"""The actor-critics, plus the categorical and diagonal-Gaussian policy maths written out (no
distribution library needed).

- Vector observations: two 64-64 tanh MLPs with orthogonal init (CleanRL / PureJaxRL).
- Image observations ``[H, W, C]`` or ``[C, H, W]``: a shared ReLU conv torso, then the actor and
  critic heads (CleanRL's ``ppo_atari``). The torso is the Nature DQN CNN (Mnih et al. 2015) for
  images of at least 36x36, else MinAtar's one-conv network (Young & Tian 2019).

:func:`make_network` picks the one that fits an env's observations.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

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
    #: The critic shares no layer with the actor, so a rollout runs :meth:`policy` alone and
    #: the learner computes V for the whole trajectory afterwards, in one batched call: the
    #: same numbers, and half the small per-step programs.
    critic_apart: ClassVar[bool] = True

    def setup(self) -> None:
        zeros = nn.initializers.zeros
        dense = lambda w, scale: nn.Dense(w, kernel_init=orthogonal(scale), bias_init=zeros)
        self.actor = [dense(w, math.sqrt(2.0)) for w in self.hidden]
        # Small policy-head init keeps the first policy near uniform / near zero mean (CleanRL).
        self.actor_out = dense(self.action_dim, 0.01)
        self.critic = [dense(w, math.sqrt(2.0)) for w in self.hidden]
        self.critic_out = dense(1, 1.0)
        if not self.discrete:
            self.log_std = self.param("log_std", zeros, (self.action_dim,), jnp.float32)

    def __call__(self, obs: jax.Array):
        """Actor and critic together: ``(policy(obs), value(obs))``."""
        return self.policy(obs), self.value(obs)

    def policy(self, obs: jax.Array):
        """The actor alone: ``logits``, or ``(mean, log_std)``."""
        x = obs
        for layer in self.actor:
            x = nn.tanh(layer(x))
        return _policy_head(self.actor_out(x), self.discrete, getattr(self, "log_std", None))

    def value(self, obs: jax.Array) -> jax.Array:
        """The critic alone (cheaper when only V is needed, e.g. to bootstrap a truncation)."""
        x = obs
        for layer in self.critic:
            x = nn.tanh(layer(x))
        return self.critic_out(x)[..., 0]


#: Image torsos: ``(convs, dense)`` with one ``(features, kernel size, stride)`` per VALID conv.
TORSOS: dict[str, tuple[tuple[tuple[int, int, int], ...], int]] = {
    "nature": (((32, 8, 4), (64, 4, 2), (64, 3, 1)), 512),
    "minatar": (((16, 3, 1),), 128),
}


def image_layout(obs_shape: Sequence[int]) -> tuple[str, bool]:
    """``(torso, channels_first)`` for an image observation shape.

    Channels are the smaller end axis: ``(4, 84, 84)`` (EnvPool's stacked Atari frames) is
    channels-first, ``(210, 160, 3)`` and ``(10, 10, 4)`` (MinAtar) are channels-last. Images of
    at least 36x36 get the Nature CNN, smaller ones MinAtar's.

    Example:
      >>> image_layout((4, 84, 84)), image_layout((10, 10, 4))
      (('nature', True), ('minatar', False))
    """
    shape = tuple(int(s) for s in obs_shape)
    if len(shape) != 3:
        raise ValueError(f"an image observation is [H, W, C] or [C, H, W], got shape {shape}")
    channels_first = shape[0] < shape[-1]
    height, width = shape[1:] if channels_first else shape[:2]
    if min(height, width) < 3:
        raise ValueError(f"images need at least 3x3 pixels, got {height}x{width} in {shape}")
    return ("nature" if min(height, width) >= 36 else "minatar"), channels_first


class ImageActorCritic(nn.Module):
    """A shared conv torso (:data:`TORSOS`), ReLU throughout, then the actor and critic heads.

    Observations ``[..., *obs_shape]`` (float, or uint8 pixels as the env gives them) are cast
    to float32 and multiplied by ``obs_scale`` (1/255 for pixels), made channels-last, passed
    through the VALID convs, flattened in ``(H, W, C)`` order and through one dense layer.
    Outputs as :class:`ActorCritic`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> net = ImageActorCritic(action_dim=3, torso="minatar")
      >>> variables = net.init(jax.random.key(0), jnp.zeros((1, 10, 10, 4)))
      >>> logits, value = net.apply(variables, jnp.zeros((2, 5, 10, 10, 4)))
      >>> logits.shape, value.shape
      ((2, 5, 3), (2, 5))
    """

    action_dim: int
    discrete: bool = True
    torso: str = "nature"
    channels_first: bool = False
    obs_scale: float = 1.0
    #: Actor and critic share the torso: a rollout computes both heads at once.
    critic_apart: ClassVar[bool] = False

    def setup(self) -> None:
        zeros, relu_gain = nn.initializers.zeros, math.sqrt(2.0)
        convs, dense = TORSOS[self.torso]
        self.convs = [
            nn.Conv(f, (k, k), (s, s), padding="VALID", kernel_init=orthogonal(relu_gain),
                    bias_init=zeros)
            for f, k, s in convs
        ]  # fmt: skip
        self.dense = nn.Dense(dense, kernel_init=orthogonal(relu_gain), bias_init=zeros)
        self.actor_out = nn.Dense(self.action_dim, kernel_init=orthogonal(0.01), bias_init=zeros)
        self.critic_out = nn.Dense(1, kernel_init=orthogonal(1.0), bias_init=zeros)
        if not self.discrete:
            self.log_std = self.param("log_std", zeros, (self.action_dim,), jnp.float32)

    def features(self, obs: jax.Array) -> jax.Array:
        lead = obs.shape[:-3]
        x = obs.reshape(-1, *obs.shape[-3:]).astype(jnp.float32) * self.obs_scale
        if self.channels_first:
            x = jnp.transpose(x, (0, 2, 3, 1))
        for conv in self.convs:
            x = nn.relu(conv(x))
        x = nn.relu(self.dense(x.reshape(x.shape[0], -1)))
        return x.reshape(*lead, x.shape[-1])

    def __call__(self, obs: jax.Array):
        x = self.features(obs)
        log_std = getattr(self, "log_std", None)
        return _policy_head(self.actor_out(x), self.discrete, log_std), self.critic_out(x)[..., 0]

    def policy(self, obs: jax.Array):
        return self(obs)[0]

    def value(self, obs: jax.Array) -> jax.Array:
        return self.critic_out(self.features(obs))[..., 0]


def _policy_head(head: jax.Array, discrete: bool, log_std: jax.Array | None):
    """``logits``, or ``(mean, log_std)`` with the state-independent ``log_std`` broadcast."""
    return head if discrete else (head, jnp.broadcast_to(log_std, head.shape))


def make_network(spec: Any, hidden: Sequence[int]) -> nn.Module:
    """The actor-critic for an env's ``EnvSpec``: MLPs of widths ``hidden`` for vector
    observations, :class:`ImageActorCritic` for images (``hidden`` is then unused)."""
    if len(spec.obs_shape) == 1:
        return ActorCritic(action_dim=spec.action_dim, discrete=spec.discrete, hidden=hidden)
    torso, channels_first = image_layout(spec.obs_shape)
    return ImageActorCritic(
        action_dim=spec.action_dim,
        discrete=spec.discrete,
        torso=torso,
        channels_first=channels_first,
        obs_scale=spec.obs_scale,
    )


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


def _gram_schmidt(a: jax.Array, block: int = 64) -> jax.Array:
    """Q of the thin QR of a tall matrix, diag(R) > 0.

    Up to ``block`` columns: classical Gram-Schmidt, twice per column (CGS2). Wider: block
    CGS with re-orthogonalisation (BCGS2): each block of columns is projected out of the
    finished blocks and made orthonormal by CGS2, both twice. Blocks turn most of the work into
    matrix products: column by column, a 3136 x 512 kernel (the Nature CNN's dense layer) would
    stream the whole matrix 2k times (5.9 s here, against 0.6 s in blocks).
    """
    n, k = a.shape
    if k <= block:
        return _cgs2(a)  # one loop: the MLPs' kernels compile as fast as ever

    def add_block(q, start, width):
        v = jax.lax.dynamic_slice(a, (0, start), (n, width))
        for _ in range(2):  # project out the finished blocks (q's other columns are still
            v = _cgs2(v - q @ (q.T @ v))  # zero), then orthonormalise; twice (BCGS2)
        return jax.lax.dynamic_update_slice(q, v, (0, start))

    full = k // block  # one compiled loop body for the full blocks, then the rest
    q = jax.lax.fori_loop(0, full, lambda b, q: add_block(q, b * block, block), jnp.zeros_like(a))
    return add_block(q, full * block, k - full * block) if k % block else q


def _cgs2(a: jax.Array) -> jax.Array:
    """Q of a thin QR by classical Gram-Schmidt, twice per column (as accurate as Householder
    here); diag(R) > 0."""

    def column(j, q):
        v = a[:, j]
        for _ in range(2):
            v = v - q @ (q.T @ v)  # columns >= j of q are still zero
        return q.at[:, j].set(v / jnp.linalg.norm(v))

    return jax.lax.fori_loop(0, a.shape[1], column, jnp.zeros_like(a))


_LOG_2PI = float(np.log(2 * np.pi))


def noise(key: jax.Array, shape: tuple[int, ...], discrete: bool, action_dim: int) -> jax.Array:
    """The randomness of ``shape`` action draws: Gumbel per logit, or N(0, 1) per dimension.

    Drawn for a whole rollout at once: on CPU every ``jax.random`` call in a loop body is a
    small loop of its own, run once per step.
    """
    draw = jax.random.gumbel if discrete else jax.random.normal
    return draw(key, (*shape, action_dim), jnp.float32)


def sample(pi, noise: jax.Array, discrete: bool, groups: tuple[int, ...] = ()) -> jax.Array:
    """One action per row from :func:`noise`: the Gumbel-max of the logits (what
    ``jax.random.categorical`` computes), or mean + std * N(0, 1).

    ``groups`` (a ``MultiDiscrete``'s ``nvec``): the logits are that many categoricals side by
    side, and the action is one index per categorical, ``[..., len(groups)]``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> logits = jnp.log(jnp.array([[0.2, 0.8]]))
      >>> key = jax.random.key(0)
      >>> a = sample(logits, noise(key, (1,), True, 2), True)
      >>> bool(a == jax.random.categorical(key, logits))
      True
    """
    if discrete:
        return argmax_action(pi + noise, groups)
    mean, log_std = pi
    return mean + jnp.exp(log_std) * noise


def log_prob(pi, action: jax.Array, discrete: bool, groups: tuple[int, ...] = ()) -> jax.Array:
    """The log-probability of ``action`` (see :func:`sample` for ``groups``: the sum over the
    independent categoricals)."""
    if discrete and groups:
        parts = split_groups(pi, groups)
        return sum(_categorical_log_prob(p, action[..., j]) for j, p in enumerate(parts))
    if discrete:
        return _categorical_log_prob(pi, action)
    mean, log_std = pi
    z = (action - mean) * jnp.exp(-log_std)
    return jnp.sum(-0.5 * z * z - log_std - 0.5 * _LOG_2PI, axis=-1)


def entropy(pi, discrete: bool, groups: tuple[int, ...] = ()) -> jax.Array:
    """The policy's entropy (see :func:`sample` for ``groups``: the sum over them)."""
    if discrete:
        return sum(_categorical_entropy(p) for p in split_groups(pi, groups))
    _, log_std = pi
    return jnp.sum(log_std + 0.5 + 0.5 * _LOG_2PI, axis=-1)


def argmax_action(scores: jax.Array, groups: tuple[int, ...] = ()) -> jax.Array:
    """The int32 action that maximises ``scores`` (logits or probabilities): one index, or one
    per group of ``groups`` (a MultiDiscrete's ``nvec``), ``[..., len(groups)]``.

    Example:
      >>> import jax.numpy as jnp
      >>> argmax_action(jnp.array([0.1, 0.7, 0.2, 0.6, 0.4]), (3, 2)).tolist()
      [1, 0]
    """
    if not groups:
        return jnp.argmax(scores, axis=-1).astype(jnp.int32)
    return jnp.stack([jnp.argmax(x, axis=-1) for x in split_groups(scores, groups)], -1).astype(
        jnp.int32
    )


def split_groups(pi: jax.Array, groups: tuple[int, ...]) -> list[jax.Array]:
    """The logits of each categorical: ``groups`` sizes along the last axis (``()``: one)."""
    return jnp.split(pi, np.cumsum(groups)[:-1].tolist(), axis=-1) if groups else [pi]


def _categorical_log_prob(logits: jax.Array, action: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logp, action[..., None].astype(jnp.int32), axis=-1)[..., 0]


def _categorical_entropy(logits: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)
