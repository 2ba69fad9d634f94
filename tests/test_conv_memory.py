"""A conv net's donated train step shrinks per device, with nothing crossing members.

For a small CNN, a ResNet (ResNet-18's stem, stages and BatchNorm in train mode with batch
statistics through aux, one basic block per stage to halve the compile; ``benchmarks/memory.py``
measures the full ResNet-18) and the NNX tutorial CNN, 8 members: the compiled step's
per-device peak on 8 devices is at most 1.05x the 1-device peak / 8, and its HLO has no
collective at all (every member has a whole device, so any collective would move one member's
data to another member's device).
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import ensemble
from ensemble.debug import collectives

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import conv_models

N = 8
GOAL = 1.05


def _linen_step(model, loss, x, labels, devices, with_stats):
    ens = ensemble.build(model, N, devices=devices)
    variables = ens.init(jax.random.key(0), x)
    params = variables["params"]
    if with_stats:
        step = ens.train_step(
            loss, optax.adam(1e-3), has_aux=True, per_member_batch=(True, False, False)
        )
        return step.lower(params, step.init(params), variables["batch_stats"], x, labels)
    step = ens.train_step(loss, optax.adam(1e-3))
    return step.lower(params, step.init(params), x, labels)


def _cnn(devices):
    model = conv_models.CNN()
    x, labels = jnp.ones((8, 28, 28, 1)), jnp.zeros((8,), jnp.int32)
    return _linen_step(model, conv_models.cnn_loss(model), x, labels, devices, False)


def _resnet(devices):
    model = conv_models.ResNet18(width=8, stages=(1, 1, 1, 1))
    x, labels = jnp.ones((4, 16, 16, 3)), jnp.zeros((4,), jnp.int32)
    return _linen_step(model, conv_models.resnet_loss(model), x, labels, devices, True)


def _nnx_cnn(devices):
    ens = ensemble.build(lambda rngs: conv_models.NNXCNN(rngs=rngs), N, devices=devices)
    step = ens.train_step(conv_models.nnx_cnn_loss, optax.adam(1e-3))
    x, labels = jnp.ones((8, 28, 28, 1)), jnp.zeros((8,), jnp.int32)
    return step.lower(ens, step.init(), x, labels)


@pytest.mark.parametrize("lower", [_cnn, _resnet, _nnx_cnn], ids=["cnn", "resnet", "nnx_cnn"])
def test_conv_step_peak_falls_as_one_over_devices(lower):
    one = lower(jax.devices()[:1]).compile()
    many = lower(jax.devices()).compile()
    peak_one = ensemble.compiled_memory(one).peak
    peak_many = ensemble.compiled_memory(many).peak
    assert ensemble.compiled_memory(many).alias > 0  # donated
    assert collectives(many) == {}
    assert peak_many <= GOAL * peak_one / len(jax.devices()), (peak_many, peak_one)


def test_pmap_style_batchnorm_statistics_are_over_the_members_batch():
    """ResNet written for pmap (``BatchNorm(axis_name='batch')``) trains; its batch statistics
    equal the plain model's over the member's whole batch, also when a member spans 2 devices."""
    model = conv_models.ResNet18(width=4, stages=(1, 1), axis_name="batch")
    plain = conv_models.ResNet18(width=4, stages=(1, 1))
    x = jax.random.normal(jax.random.key(1), (4, 8, 8, 3))
    labels = jnp.arange(4) % 10
    plain_stats = jax.jit(lambda v: plain.apply(v, x, train=True, mutable=["batch_stats"])[1])
    for n in (4, 8):
        ens = ensemble.build(model, n, axis_name="batch")
        variables = ens.init(jax.random.key(0), x, train=False)
        _, updates = ens.apply(variables, x, train=True, mutable=["batch_stats"])
        for i in (0, n - 1):
            expected = plain_stats(ens.member(variables, i))
            got = jax.tree.map(lambda a, i=i: a[i], updates)
            jax.tree.map(
                lambda g, e: np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6), got, expected
            )
        step = ens.train_step(
            conv_models.resnet_loss(model),
            optax.sgd(0.1),
            has_aux=True,
            per_member_batch=(True, False, False),
        )
        params = variables["params"]
        lowered = step.lower(params, step.init(params), variables["batch_stats"], x, labels)
        _, _, losses, stats = step(params, step.init(params), variables["batch_stats"], x, labels)
        assert losses.shape == (n,) and bool(jnp.all(jnp.isfinite(losses)))
        # On 2 devices a member's statistics and gradients are summed over its own two only.
        assert collectives(lowered, across_members=True) == {}
        assert (collectives(lowered) != {}) == (n < len(jax.devices()))
        assert jax.tree.structure(stats) == jax.tree.structure(variables["batch_stats"])


def test_nnx_module_call_with_call_time_rngs_and_dropout():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(3, 16, rngs=rngs)
            self.drop = nnx.Dropout(0.5)

        def __call__(self, x, rngs=None):
            return self.drop(self.l1(x), rngs=rngs)

    ens = ensemble.build(Net, N)
    x = jnp.ones((2, 3))
    a = ens(x, rngs=nnx.Rngs(0))
    b = ens(x, rngs=nnx.Rngs(0))
    assert jnp.array_equal(a, b)  # same seed, same masks
    masks = (a == 0).reshape(N, -1)
    assert len({tuple(m.tolist()) for m in masks}) > 1  # each member its own stream
    ens.eval()  # no rngs needed once deterministic
    np.testing.assert_allclose(ens(x)[3], ens.member(3)(x), rtol=1e-6)
