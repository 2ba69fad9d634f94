"""Differential layer zoo: every member of an ensemble computes exactly the plain model.

For each layer (linen and NNX), at n = D/2 (a member spans two devices), D (one per device) and
2D (two per device), on 8 simulated devices:

- ``ens.apply`` / ``ens(x)`` row i equals the plain model run on member i's variables;
- one donated train step's losses and updated parameters equal a plain per-member loop
  (``jax.value_and_grad`` of the same loss and the same SGD update, one member at a time);
- the compiled step holds no collective across members (``debug.collectives(...,
  across_members=True)``; a member on two devices may share its own work between them).

Convolutions over small maps are the cases the compiler's partitioner once got wrong when the
member axis was left to it (vmapped convs become grouped convs); they are here on purpose.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import ensemble

D = 8
NS = (D // 2, D, 2 * D)
LR = 0.1
TOL = dict(rtol=1e-5, atol=1e-6)
# bfloat16 layers: XLA:CPU computes bf16 in f32 and may skip a rounding to bf16 between ops
# (excess precision), differently in differently fused programs, so the step's gradients agree
# to bf16's precision (seen: 5e-5 after one step), not f32's. Members start 0.1-1 apart, so a
# member computed from another's variables still fails by orders of magnitude.
TOL_BF16 = dict(rtol=1e-2, atol=1e-3)


def _tol(name: str) -> dict:
    return TOL_BF16 if name.startswith("bf16") else TOL


# ---------------------------------------------------------------------------------- linen zoo


class SqueezeExcite(nn.Module):
    """Squeeze-and-excitation: global pool to a 1x1 map, 1x1 convs 4 -> 4 channels."""

    @nn.compact
    def __call__(self, x):
        s = jnp.mean(x, axis=(1, 2), keepdims=True)
        s = nn.relu(nn.Conv(4, (1, 1))(s))
        return x * nn.sigmoid(nn.Conv(4, (1, 1))(s))


class StridedToOne(nn.Module):
    """3x3 stride-2 conv down to a 1x1 map, then a 1x1 conv (32 -> 64 channels)."""

    @nn.compact
    def __call__(self, x):
        return nn.Conv(64, (1, 1))(nn.relu(nn.Conv(32, (3, 3), strides=2)(x)))


class Pooling(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Conv(4, (3, 3))(x)
        return nn.max_pool(x, (2, 2), (2, 2)) + nn.avg_pool(x, (2, 2), (2, 2))


class ScannedCell(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.RNN(nn.GRUCell(6))(x)


class Attention(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)(x)


class BatchNormNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        return nn.BatchNorm(use_running_average=not train)(nn.Dense(5)(x))


class DropoutNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.Dropout(0.5, deterministic=False)(nn.Dense(6)(x)))


class EmbedNet(nn.Module):
    @nn.compact
    def __call__(self, ids):
        return nn.Dense(2)(nn.Embed(11, 4)(ids))


class DenseBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.tanh(nn.Dense(6)(x)))


def conv(features, kernel, **kw):
    return nn.Conv(features, kernel, **kw)


def _img(h, c=4):
    return jax.random.normal(jax.random.key(7), (2, h, h, c))


# BatchNorm over a batch of 2 is ill-conditioned (gradients through a 2-sample variance); 8 rows.
BN_X = jax.random.normal(jax.random.key(8), (8, 4))


# name -> (module, input, apply kwargs, mutable collections, rng streams)
LINEN_ZOO = {
    "dense": (nn.Dense(3), jnp.ones((2, 5)), {}, False, ()),
    "conv1x1_on_1x1": (conv(8, (1, 1)), _img(1, 4), {}, False, ()),
    "conv1x1_on_2x2_32to64": (conv(64, (1, 1)), _img(2, 32), {}, False, ()),
    "conv3x3_on_2x2": (conv(4, (3, 3)), _img(2), {}, False, ()),
    "conv3x3_on_4x4": (conv(4, (3, 3)), _img(4), {}, False, ()),
    "strided_to_1x1": (StridedToOne(), _img(2), {}, False, ()),
    "grouped_conv": (conv(4, (3, 3), feature_group_count=2), _img(4), {}, False, ()),
    "depthwise_conv": (conv(4, (3, 3), feature_group_count=4), _img(4), {}, False, ()),
    "conv_transpose": (nn.ConvTranspose(3, (3, 3), strides=(2, 2)), _img(2), {}, False, ()),
    "batchnorm_train": (BatchNormNet(), BN_X, {"train": True}, ["batch_stats"], ()),
    "batchnorm_eval": (BatchNormNet(), BN_X, {"train": False}, False, ()),
    "layernorm": (nn.LayerNorm(), _img(2), {}, False, ()),
    "groupnorm": (nn.GroupNorm(num_groups=2), _img(2), {}, False, ()),
    "dropout": (DropoutNet(), jnp.ones((2, 5)), {}, False, ("dropout",)),
    "embed": (EmbedNet(), jnp.array([[1, 2, 10], [0, 3, 3]]), {}, False, ()),
    "attention": (Attention(), jax.random.normal(jax.random.key(3), (2, 3, 4)), {}, False, ()),
    "rnn_scanned": (ScannedCell(), jax.random.normal(jax.random.key(4), (2, 5, 3)), {}, False, ()),
    "squeeze_excite": (SqueezeExcite(), _img(2), {}, False, ()),
    "pooling": (Pooling(), _img(4), {}, False, ()),
    "remat": (nn.remat(DenseBlock)(), jnp.ones((2, 5)), {}, False, ()),
    "bf16_conv3x3_on_4x4": (conv(4, (3, 3), dtype=jnp.bfloat16), _img(4), {}, False, ()),
}


def _linen_loss(model, x, kw, mutable, streams):
    def loss_fn(params, rest, key):
        out = model.apply(
            {"params": params, **rest}, x, rngs=_rngs(streams, key), mutable=mutable, **kw
        )
        y = out[0] if mutable else out
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    return loss_fn


@functools.cache
def _linen_references(name):
    """The plain model's forward pass, loss and jitted value-and-grad: one of each per layer,
    shared by every n (the plain model does not change with n, only its variables do)."""
    model, x, kw, mutable, streams = LINEN_ZOO[name]
    plain = jax.jit(lambda v, k: model.apply(v, x, rngs=_rngs(streams, k), mutable=mutable, **kw))
    loss_fn = _linen_loss(model, x, kw, mutable, streams)
    return plain, loss_fn, jax.jit(jax.value_and_grad(loss_fn))


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("name", sorted(LINEN_ZOO))
def test_linen_member_equals_plain_model(name, n):
    model, x, kw, mutable, streams = LINEN_ZOO[name]
    tol = _tol(name)
    ens = ensemble.build(model, n)
    k_init, k_call = jax.random.key(0), jax.random.key(1)
    init_rngs = {"params": k_init, **{s: k_init for s in streams}}
    variables = ens.init(init_rngs, x, **kw)
    call_rngs = {s: k_call for s in streams} or None
    out = ens.apply(variables, x, rngs=call_rngs, mutable=mutable, **kw)
    member_keys = jax.random.split(k_call, n)

    plain, loss_fn, ref_step = _linen_references(name)
    refs = []
    # Members' rows sliced on the host: the reference never goes through the library.
    host, out = jax.device_get((variables, out))
    for i in range(n):
        v_i = jax.tree.map(lambda a, i=i: a[i], host)
        expected = plain(v_i, member_keys[i])
        got = jax.tree.map(lambda a, i=i: a[i], out)
        jax.tree.map(lambda g, e: np.testing.assert_allclose(g, e, **tol), got, expected)
        rest = {k: c for k, c in v_i.items() if k != "params"}
        loss, grads = ref_step(v_i["params"], rest, member_keys[i])
        grads = jax.device_get(grads)
        refs.append((loss, jax.tree.map(lambda p, g: p - np.float32(LR) * g, v_i["params"], grads)))

    params = variables["params"]
    rest = {k: c for k, c in variables.items() if k != "params"}
    step = ens.train_step(loss_fn, optax.sgd(LR), per_member_batch=True)
    _moves_nothing_between_members(step.lower(params, step.init(params), rest, member_keys))
    params, _, losses = step(params, step.init(params), rest, member_keys)
    params, losses = jax.device_get((params, losses))
    for i, (loss, new_params) in enumerate(refs):
        np.testing.assert_allclose(losses[i], loss, **tol)
        got = jax.tree.map(lambda a, i=i: a[i], params)
        jax.tree.map(lambda g, e: np.testing.assert_allclose(g, e, **tol), got, new_params)


def _moves_nothing_between_members(lowered):
    """The compiled step's collectives stay within members (a member on two devices may share
    its own work between them)."""
    assert ensemble.debug.collectives(lowered, across_members=True) == {}


def _rngs(streams, key):
    return {s: key for s in streams} or None


# ------------------------------------------------------------------------------------ NNX zoo


class NNXSqueezeExcite(nnx.Module):
    def __init__(self, rngs):
        self.c1 = nnx.Conv(4, 4, (1, 1), rngs=rngs)
        self.c2 = nnx.Conv(4, 4, (1, 1), rngs=rngs)

    def __call__(self, x):
        s = jnp.mean(x, axis=(1, 2), keepdims=True)
        return x * nnx.sigmoid(self.c2(nnx.relu(self.c1(s))))


class NNXBatchNorm(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 5, rngs=rngs)
        self.bn = nnx.BatchNorm(5, rngs=rngs)

    def __call__(self, x):
        return self.bn(self.dense(x))


class NNXDropout(nnx.Module):
    """Dropout as the Flax tutorials write it: rngs given at call time."""

    def __init__(self, rngs):
        self.l1 = nnx.Linear(5, 6, rngs=rngs)
        self.drop = nnx.Dropout(0.5)
        self.l2 = nnx.Linear(6, 3, rngs=rngs)

    def __call__(self, x, rngs=None):
        return self.l2(self.drop(self.l1(x), rngs=rngs))


class NNXPooling(nnx.Module):
    def __init__(self, rngs):
        self.conv = nnx.Conv(4, 4, (3, 3), rngs=rngs)

    def __call__(self, x):
        x = self.conv(x)
        return nnx.max_pool(x, (2, 2), (2, 2)) + nnx.avg_pool(x, (2, 2), (2, 2))


class NNXEmbed(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(11, 4, rngs=rngs)
        self.out = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, ids):
        return self.out(self.embed(ids))


class NNXRemat(nnx.Module):
    """A block recomputed in the backward pass (``nnx.remat``), as memory-bound models do."""

    def __init__(self, rngs):
        self.l1 = nnx.Linear(5, 6, rngs=rngs)
        self.l2 = nnx.Linear(6, 3, rngs=rngs)

    def __call__(self, x):
        return nnx.remat(lambda l1, l2, x: l2(jnp.tanh(l1(x))))(self.l1, self.l2, x)


def _nnx_rnn(rngs):
    return nnx.RNN(nnx.GRUCell(3, 6, rngs=rngs))


def _nnx_attention(rngs):
    return nnx.MultiHeadAttention(2, 4, qkv_features=8, decode=False, rngs=rngs)


# name -> (factory, input, train mode, call takes rngs)
NNX_ZOO = {
    "linear": (lambda r: nnx.Linear(5, 3, rngs=r), jnp.ones((2, 5)), False, False),
    "conv1x1_on_1x1": (lambda r: nnx.Conv(4, 8, (1, 1), rngs=r), _img(1), False, False),
    "conv1x1_on_2x2": (lambda r: nnx.Conv(32, 64, (1, 1), rngs=r), _img(2, 32), False, False),
    "conv3x3_on_4x4": (lambda r: nnx.Conv(4, 4, (3, 3), rngs=r), _img(4), False, False),
    "strided_conv": (lambda r: nnx.Conv(4, 8, (3, 3), strides=2, rngs=r), _img(2), False, False),
    "grouped_conv": (
        lambda r: nnx.Conv(4, 4, (3, 3), feature_group_count=2, rngs=r),
        _img(4),
        False,
        False,
    ),
    "conv_transpose": (
        lambda r: nnx.ConvTranspose(4, 3, (3, 3), strides=(2, 2), rngs=r),
        _img(2),
        False,
        False,
    ),
    "batchnorm_train": (NNXBatchNorm, BN_X, True, False),
    "batchnorm_eval": (NNXBatchNorm, BN_X, False, False),
    "layernorm": (lambda r: nnx.LayerNorm(4, rngs=r), _img(2), False, False),
    "groupnorm": (lambda r: nnx.GroupNorm(4, num_groups=2, rngs=r), _img(2), False, False),
    "dropout": (NNXDropout, jnp.ones((2, 5)), True, True),
    "embed": (NNXEmbed, jnp.array([[1, 2, 10], [0, 3, 3]]), False, False),
    "attention": (_nnx_attention, jax.random.normal(jax.random.key(3), (2, 3, 4)), False, False),
    "rnn_scanned": (_nnx_rnn, jax.random.normal(jax.random.key(4), (2, 5, 3)), False, False),
    "squeeze_excite": (NNXSqueezeExcite, _img(2), False, False),
    "pooling": (NNXPooling, _img(4), False, False),
    "remat": (NNXRemat, jnp.ones((2, 5)), False, False),
    "bf16_conv3x3_on_4x4": (
        lambda r: nnx.Conv(4, 4, (3, 3), dtype=jnp.bfloat16, rngs=r),
        _img(4),
        False,
        False,
    ),
}


def _nnx_loss(x, with_rngs):
    def loss_fn(module, key):
        y = module(x, rngs=nnx.Rngs(dropout=key)) if with_rngs else module(x)
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    return loss_fn


def _on_first_device(module):
    """A plain member moved to one device, so the reference compiles once for all members."""
    graphdef, state = nnx.split(module)
    return nnx.merge(graphdef, jax.device_put(state, jax.devices()[0]))


@functools.cache
def _nnx_references(name):
    """The loss, the plain member's jitted call and value-and-grad: one of each per layer."""
    _, x, _, with_rngs = NNX_ZOO[name]
    loss_fn = _nnx_loss(x, with_rngs)
    call = nnx.jit(lambda m, k: m(x, rngs=nnx.Rngs(dropout=k)) if with_rngs else m(x))
    return loss_fn, call, nnx.jit(nnx.value_and_grad(loss_fn))


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("name", sorted(NNX_ZOO))
def test_nnx_member_equals_plain_model(name, n):
    factory, x, train, with_rngs = NNX_ZOO[name]
    tol = _tol(name)
    ens = ensemble.build(factory, n, rngs=0)
    ens.train() if train else ens.eval()
    key = jax.random.key(1)
    # An nnx.Rngs given to the call: member i's stream is split(rngs.dropout(), n)[i].
    member_keys = jax.random.split(nnx.Rngs(dropout=key).dropout(), n)
    # Plain members first: the ensemble's call updates batch statistics in place.
    plain = [_on_first_device(ens.member(i)) for i in range(n)]
    out = np.asarray(ens(x, rngs=nnx.Rngs(dropout=key)) if with_rngs else ens(x))
    loss_fn, call, grad_fn = _nnx_references(name)
    for i, m in enumerate(plain):
        np.testing.assert_allclose(out[i], call(m, member_keys[i]), **tol)
    # The step: fresh plain members taken after the call, one SGD step each.
    refs = []
    for i in range(n):
        m = _on_first_device(ens.member(i))
        loss, grads = grad_fn(m, member_keys[i])
        new = jax.tree.map(lambda p, g: p - LR * g, nnx.state(m, nnx.Param), grads)
        refs.append((loss, new))
    step = ens.train_step(loss_fn, optax.sgd(LR), per_member_batch=True)
    _moves_nothing_between_members(step.lower(ens, step.init(), member_keys))
    losses = np.asarray(step(ens, step.init(), member_keys))
    for i, (loss, new) in enumerate(refs):
        np.testing.assert_allclose(losses[i], loss, **tol)
        got = nnx.state(ens.member(i), nnx.Param)
        jax.tree.map(lambda g, e: np.testing.assert_allclose(g, e, **tol), got, new)
