"""Tensor parallelism inside a member: Flax's own resolution of the rules, same numbers.

A member spanning 2 devices on the ``'model'`` axis has each parameter split exactly as Flax
splits the plain model with the same rules (``nn.get_partition_spec`` +
``nn.logical_to_mesh_axes``), the member axis in front; this includes annotations with fewer
names than the kernel has axes (attention kernels annotated ``('embed', 'kv')`` on 3-D kernels,
as Flax's lm1b example does). Outputs equal the same ensemble with ``model_parallel=1``.
"""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
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


class _GroupedConv(nn.Module):
    """A grouped conv (2 groups of 4 outputs) whose kernel axis ``split`` is named 'conv'."""

    split: int | None

    @nn.compact
    def __call__(self, x):
        names = tuple("conv" if i == self.split else None for i in range(4))
        conv = nn.Conv(8, (3, 3), feature_group_count=2, use_bias=False, kernel_init=_init(names))
        return jnp.mean(conv(x) ** 2)


def _nnx_grouped_conv(split):
    from flax import nnx

    names = tuple("conv" if i == split else None for i in range(4))
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), names)
    return lambda rngs: nnx.Conv(
        8, 8, (3, 3), feature_group_count=2, use_bias=False, kernel_init=init, rngs=rngs
    )


def test_a_grouped_conv_split_across_its_groups_is_refused_before_xla_aborts():
    """Kernel features split over 4 'model' devices with 2 groups put a group on 2 devices:
    compiling the gradient aborted the process in XLA's partitioner (exit 134, a CHECK in its
    convolution handler). Refused in one line, for linen and NNX, the step and its lower();
    over 2 devices (a group per device), or unsplit, it compiles and trains."""
    import optax

    x = jnp.ones((2, 6, 6, 8))
    rules = [("conv", "model")]
    for split, what in ((3, "output"), (2, "input")):
        said = rf"grouped convolution \(feature_group_count=2\) whose {what} features are split"
        ens = ensemble.build(_GroupedConv(split), 2, model_parallel=4, rules=rules)
        params = ens.init(jax.random.key(0), x)["params"]
        loss = lambda p, x, s=split: _GroupedConv(s).apply({"params": p}, x)
        for fn in (loss, jax.jit(loss)):  # followed into the user's own jit too
            step = ens.train_step(fn, optax.sgd(0.1))
            with pytest.raises(
                ValueError, match=r"params\['Conv_0'\]\['kernel'\] is the kernel of a " + said
            ):
                step.lower(params, step.init(params), x)
        nnx_ens = ensemble.build(_nnx_grouped_conv(split), 2, model_parallel=4, rules=rules)
        nnx_step = nnx_ens.train_step(lambda m, x: jnp.mean(m(x) ** 2), optax.sgd(0.1))
        with pytest.raises(ValueError, match=said + r".*Give a model_parallel that divides 2"):
            nnx_step(nnx_ens, nnx_step.init(), x)
    for n, model_parallel, split in ((4, 2, 3), (2, 4, None)):  # a group per device; unsplit
        ens = ensemble.build(_GroupedConv(split), n, model_parallel=model_parallel, rules=rules)
        params = ens.init(jax.random.key(0), x)["params"]
        step = ens.train_step(lambda p, x, s=split: _GroupedConv(s).apply({"params": p}, x),
                              optax.sgd(0.1))  # fmt: skip
        _, _, losses = step(params, step.init(params), x)
        assert np.isfinite(np.asarray(losses)).all()


def test_a_grouped_conv_in_members_over_data_and_model_devices_is_refused_and_calls_warn():
    """2 members on 8 devices with model_parallel=2 span 2 'data' x 2 'model' devices each:
    XLA gave a grouped conv's kernel gradient 2 times the plain model's (an SGD step moved the
    kernel twice as far, no error; jax.jit of the plain conv on such a mesh does the same),
    whether the kernel is split or not. Refused for linen and NNX; a plain conv trains there."""
    import optax
    from flax import nnx

    x = jnp.ones((2, 6, 6, 8))
    said = r"each member spans 2 'data' x 2 'model' devices, where XLA computes a grouped"
    for split in (3, None):
        ens = ensemble.build(_GroupedConv(split), 2, model_parallel=2, rules=[("conv", "model")])
        params = ens.init(jax.random.key(0), x)["params"]
        loss = lambda p, x, s=split: _GroupedConv(s).apply({"params": p}, x)
        step = ens.train_step(loss, optax.sgd(0.1))
        with pytest.raises(ValueError, match=said + r".*model_parallel=1, or model_parallel=4"):
            step(params, step.init(params), x)
        nnx_ens = ensemble.build(_nnx_grouped_conv(split), 2, model_parallel=2)
        nnx_step = nnx_ens.train_step(lambda m, x: jnp.mean(m(x) ** 2), optax.sgd(0.1))
        with pytest.raises(ValueError, match=said):
            nnx_step(nnx_ens, nnx_step.init(), x)
    # A loss taking an nnx.Rngs (noise on the inputs): traced too (it was not checked at all).
    noisy = lambda m, x, rngs: jnp.mean(m(x + 0.1 * jax.random.normal(rngs.noise(), x.shape)) ** 2)
    nnx_step = nnx_ens.train_step(noisy, optax.sgd(0.1))
    with pytest.raises(ValueError, match=said):
        nnx_step(nnx_ens, nnx_step.init(), x, nnx.Rngs(noise=1))
    # The user's own gradient through a call is as wrong (x2, checked against the plain conv):
    # the call warns; its outputs are right.
    grouped = ensemble.build(nn.Conv(8, (3, 3), feature_group_count=2), 2, model_parallel=2)
    variables = grouped.init(jax.random.key(0), x)
    with pytest.warns(UserWarning, match=r"computes its kernel's gradient 2 times too large"):
        grads = jax.grad(lambda v: jnp.sum(grouped.apply(v, x) ** 2))(variables)
    member = jax.tree.map(lambda a: np.asarray(a)[0], variables)
    plain_grads = jax.grad(lambda v: jnp.sum(grouped.model.apply(v, x) ** 2))(member)
    # Failing here means XLA got it right at last: lift both refusals and the warning.
    np.testing.assert_allclose(np.asarray(grads["params"]["kernel"])[0],
                               2 * plain_grads["params"]["kernel"], rtol=1e-4)  # fmt: skip
    plain = ensemble.build(nn.Conv(8, (3, 3)), 2, model_parallel=2)
    params = plain.init(jax.random.key(0), x)["params"]
    step = plain.train_step(lambda p, x: jnp.mean(plain.model.apply({"params": p}, x) ** 2),
                            optax.sgd(0.1))  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a plain conv: no warning
        assert np.isfinite(np.asarray(step(params, step.init(params), x)[2])).all()
