"""Tensor parallelism inside a member: Flax's own resolution of the rules, same numbers.

A member spanning 2 devices on the ``'model'`` axis has each parameter split exactly as Flax
splits the plain model with the same rules (``nn.get_partition_spec`` +
``nn.logical_to_mesh_axes``), the member axis in front; this includes annotations with fewer
names than the kernel has axes (attention kernels annotated ``('embed', 'kv')`` on 3-D kernels,
as Flax's lm1b example does). Outputs equal the same ensemble with ``model_parallel=1``.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import ensemble

RULES = [("embed", None), ("kv", "model"), ("mlp", "model"), ("vocab", None)]


def _init(names):
    return nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)


class Block(nn.Module):
    """An lm1b-style block: attention with 2-name annotations on 3-D kernels, then an MLP."""

    @nn.compact
    def __call__(self, x):
        x = nn.Embed(13, 8, embedding_init=_init(("vocab", "embed")))(x)
        h = nn.MultiHeadDotProductAttention(
            num_heads=4, qkv_features=16, kernel_init=_init(("embed", "kv"))
        )(x)
        h = nn.Dense(32, kernel_init=_init(("embed", "mlp")))(x + h)
        return nn.Dense(8, kernel_init=_init(("mlp", "embed")))(nn.relu(h))


def _flax_specs(model, x, rules):
    abstract = jax.eval_shape(model.init, jax.random.key(0), x)
    specs = nn.get_partition_spec(abstract)
    return jax.tree.map(
        lambda s: P(*nn.logical_to_mesh_axes(tuple(s), rules)),
        specs["params"],
        is_leaf=lambda s: isinstance(s, P),
    )


def _padded(spec, ndim):
    spec = tuple(spec)
    return spec + (None,) * (ndim - len(spec))


def test_member_split_equals_flax_resolution_and_outputs_match():
    x = jnp.array([[1, 2, 3, 4], [5, 6, 7, 12]])
    model = Block()
    tp = ensemble.build(model, 4, model_parallel=2, rules=RULES)
    params = tp.init(jax.random.key(0), x)["params"]
    merged = tp.rules
    expected = _flax_specs(model, x, merged)
    split_somewhere = 0
    for (path, leaf), spec in zip(
        jax.tree_util.tree_leaves_with_path(params),
        jax.tree.leaves(expected, is_leaf=lambda s: isinstance(s, P)),
        strict=True,
    ):
        want = ("ensemble", *_padded(spec, leaf.ndim - 1))
        assert _padded(leaf.sharding.spec, leaf.ndim) == want, jax.tree_util.keystr(path)
        # Placement, not metadata: a leaf split on 'model' holds half of it per device.
        shapes = {s.data.shape for s in leaf.addressable_shards}
        if "model" in want:
            split_somewhere += 1
            axis = want.index("model")
            half = list(leaf.shape)
            half[0], half[axis] = 1, leaf.shape[axis] // 2
            assert shapes == {tuple(half)}, jax.tree_util.keystr(path)
    assert split_somewhere >= 5  # q, k, v, out and both MLP kernels

    whole = ensemble.build(model, 4, rules=RULES)
    v_whole = whole.init(jax.random.key(0), x)
    np.testing.assert_allclose(
        tp.apply({"params": params}, x), whole.apply(v_whole, x), rtol=1e-5, atol=1e-6
    )
    # The split member's two devices exchange its own activations, never another member's.
    lowered = jax.jit(tp.apply).lower({"params": params}, x)
    assert ensemble.debug.collectives(lowered) != {}
    assert ensemble.debug.collectives(lowered, across_members=True) == {}


def test_masked_optimizer_moments_are_split_like_their_parameters():
    """optax.masked / multi_transform leave MaskedNode placeholders in the state, which the
    moments' sharding used to fail on, silently falling back to the member axis only: each of
    a member's devices then held its moments whole (the step's peak as without parallelism)."""
    import optax

    x = jnp.array([[1, 2, 3, 4], [5, 6, 7, 12]])
    model = Block()
    tp = ensemble.build(model, 4, model_parallel=2, rules=RULES)
    params = tp.init(jax.random.key(0), x)["params"]
    kernels = lambda p: jax.tree.map(lambda a: a.ndim >= 2, p)  # one member's params
    labels = lambda p: jax.tree.map(lambda a: "adam" if a.ndim >= 2 else "sgd", p)
    loss = lambda p, x: jnp.mean(model.apply({"params": p}, x) ** 2)
    for tx in (
        optax.masked(optax.adam(1e-3), kernels),
        optax.multi_transform({"adam": optax.adam(1e-3), "sgd": optax.sgd(1e-2)}, labels),
    ):
        step = tp.train_step(loss, tx, donate=False)
        state = step.init(params)
        moments = optax.tree_utils.tree_get_all_with_path(state, "mu")
        assert moments
        pairs = [  # (moment spec, its parameter's spec); masked-out parameters have none
            (m.sharding.spec, p.sharding.spec)
            for _, mu in moments
            for p, m in zip(jax.tree.leaves(params), jax.tree.leaves(mu, is_leaf=_masked))
            if not _masked(m)
        ]
        assert all(m == p for m, p in pairs), pairs
        assert sum("model" in m for m, _ in pairs) == 6  # the kernels split on 'model'
        new, _, _ = step(params, state, x)
        for p, q in zip(jax.tree.leaves(new), jax.tree.leaves(params), strict=True):
            assert p.sharding.spec == q.sharding.spec


def _masked(x):
    import optax

    return isinstance(x, optax.MaskedNode)
