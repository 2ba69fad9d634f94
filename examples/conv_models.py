"""Conv nets as users write them, for ensembles: a small CNN, ResNet-18 and the NNX tutorial CNN.

Used by ``tests/test_conv_memory.py`` and ``benchmarks/memory.py`` to check that a conv net's
donated train step shrinks per device as devices are added, with no collective between members.

- :class:`CNN`: two 3x3 convs with average pooling, two dense layers (linen).
- :class:`ResNet18`: the ResNet-18 layout (stages of 2 basic blocks, 64-128-256-512 filters at
  ``width=64``) with BatchNorm, written the way Flax's ImageNet example writes ResNets, including
  ``BatchNorm(axis_name=...)`` for data-parallel statistics when ``axis_name`` is given.
- :class:`NNXCNN`: the CNN of Flax's NNX MNIST tutorial (two convs, pooling, two linears).

Each comes with a one-member loss ``loss(params_or_module, ...)`` to hand to
``ensemble.train_step`` / ``ens.train_step``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx


class CNN(nn.Module):
    """Two 3x3 convs with pooling, then two dense layers."""

    classes: int = 10

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.avg_pool(nn.relu(nn.Conv(32, (3, 3))(x)), (2, 2), (2, 2))
        x = nn.avg_pool(nn.relu(nn.Conv(64, (3, 3))(x)), (2, 2), (2, 2))
        x = nn.relu(nn.Dense(256)(x.reshape(x.shape[0], -1)))
        return nn.Dense(self.classes)(x)


class ResNetBlock(nn.Module):
    filters: int
    strides: tuple[int, int] = (1, 1)
    axis_name: str | None = None

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        norm = functools.partial(
            nn.BatchNorm, use_running_average=not train, momentum=0.9, axis_name=self.axis_name
        )
        y = nn.Conv(self.filters, (3, 3), self.strides, use_bias=False)(x)
        y = nn.relu(norm()(y))
        y = nn.Conv(self.filters, (3, 3), use_bias=False)(y)
        y = norm(scale_init=nn.initializers.zeros)(y)
        if x.shape != y.shape:
            x = norm()(nn.Conv(self.filters, (1, 1), self.strides, use_bias=False)(x))
        return nn.relu(x + y)


class ResNet18(nn.Module):
    """ResNet-18: a 7x7 stem (3x3 for small images), four stages of two basic blocks."""

    classes: int = 10
    width: int = 64
    stages: Sequence[int] = (2, 2, 2, 2)
    small_images: bool = True
    axis_name: str | None = None

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        stem = (3, 3) if self.small_images else (7, 7)
        x = nn.Conv(self.width, stem, (1, 1) if self.small_images else (2, 2), use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9, axis_name=self.axis_name)(x)
        x = nn.relu(x)
        for i, blocks in enumerate(self.stages):
            for j in range(blocks):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                x = ResNetBlock(self.width * 2**i, strides, self.axis_name)(x, train)
        return nn.Dense(self.classes)(jnp.mean(x, axis=(1, 2)))


class NNXCNN(nnx.Module):
    """The CNN of Flax's NNX MNIST tutorial."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
        self.avg_pool = functools.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(3136, 256, rngs=rngs)
        self.linear2 = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.avg_pool(nnx.relu(self.conv1(x)))
        x = self.avg_pool(nnx.relu(self.conv2(x)))
        x = x.reshape(x.shape[0], -1)
        return self.linear2(nnx.relu(self.linear1(x)))


def cnn_loss(model: nn.Module) -> Any:
    """One member's cross-entropy for a linen model without batch statistics."""

    def loss(params: Any, x: jax.Array, labels: jax.Array) -> jax.Array:
        logits = model.apply({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    return loss


def resnet_loss(model: nn.Module) -> Any:
    """One member's cross-entropy in train mode; the new batch statistics come back as aux."""

    def loss(params: Any, batch_stats: Any, x: jax.Array, labels: jax.Array) -> Any:
        logits, updates = model.apply(
            {"params": params, "batch_stats": batch_stats}, x, train=True, mutable=["batch_stats"]
        )
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return ce, updates["batch_stats"]

    return loss


def nnx_cnn_loss(model: NNXCNN, x: jax.Array, labels: jax.Array) -> jax.Array:
    logits = model(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
