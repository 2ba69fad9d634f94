"""train_step: donation, placement kept, per-member optimizer state and hyperparameters."""

import math
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ensemble

D = 8
RULES = [("hidden", "model"), ("features", None)]


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("features", "hidden"))
        h = nn.tanh(nn.Dense(8, kernel_init=init)(x))
        h = nn.with_logical_constraint(h, ("batch", "hidden"))
        return nn.Dense(1)(h)


MODEL = MLP()


def mse(params, x, y):
    return jnp.mean((MODEL.apply({"params": params}, x) - y) ** 2)


def setup(n, x, **build_kwargs):
    ens = ensemble.build(MODEL, n, rules=RULES, **build_kwargs)
    return ens, ens.init(jax.random.key(0), x)["params"]


def specs(tree):
    return [leaf.sharding.spec for leaf in jax.tree_util.tree_leaves(tree)]


@pytest.mark.parametrize(("n", "mp"), [(D, 1), (2 * D, 1), (D // 4, 2)])
def test_step_trains_in_place_and_donates(n, mp):
    x = jax.random.normal(jax.random.key(1), (8, 3))
    y = jnp.sin(x[:, :1])
    ens, params = setup(n, x, model_parallel=mp)
    step = ensemble.train_step(mse, optax.adam(1e-2), n=n, mesh=ens.mesh, rules=ens.rules)
    opt_state = step.init(params)
    # Adam moments sit where their parameters sit (split on 'model' too); counts on the members.
    mu = opt_state[0].mu
    assert specs(mu) == specs(params)
    assert opt_state[0].count.shape == (n,)
    assert opt_state[0].count.sharding.spec == P("ensemble")

    param_specs = specs(params)
    compiled = step.lower(params, opt_state, x, y).compile()
    assert compiled.memory_analysis().alias_size_in_bytes > 0
    # A member split over 2 devices ('model') shares its own work; nothing crosses members.
    assert ensemble.debug.collectives(compiled, across_members=True) == {}
    old_params, old_state = params, opt_state
    params, opt_state, losses = step(params, opt_state, x, y)
    assert all(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves((old_params, old_state)))
    assert losses.shape == (n,) and losses.sharding.spec == P("ensemble")
    assert specs(params) == param_specs
    first = np.asarray(losses)
    for _ in range(20):
        params, opt_state, losses = step(params, opt_state, x, y)
    assert np.all(np.asarray(losses) < first)
    assert len(step._cache) == 1


def test_member_step_equals_plain_optax():
    n = D
    xs = jax.random.normal(jax.random.key(1), (n, 4, 3))
    ys = jax.random.normal(jax.random.key(2), (n, 4, 1))
    ens, params = setup(n, xs[0])
    tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2))
    step = ensemble.train_step(
        mse, tx, n=n, mesh=ens.mesh, rules=ens.rules, per_member_batch=True, donate=False
    )
    opt_state = step.init(params)
    new_params, _, losses = step(params, opt_state, xs, ys)
    # The global norm is each member's own: no collective at all (a member per device).
    assert ensemble.debug.collectives(step.lower(params, opt_state, xs, ys)) == {}

    @jax.jit
    def plain_step(p, x, y):
        loss, grads = jax.value_and_grad(mse)(p, x, y)
        updates, _ = tx.update(grads, tx.init(p), p)
        return loss, optax.apply_updates(p, updates)

    for i in (0, 5):
        loss, ref = plain_step(ensemble.member(params, i), xs[i], ys[i])
        np.testing.assert_allclose(losses[i], loss, rtol=1e-5)
        jax.tree_util.tree_map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
            ensemble.member(new_params, i),
            ref,
        )


@pytest.mark.parametrize("n", [D, D // 2])
def test_params_holding_tuples_train_like_plain_optax(n):
    """A tuple of parameters (``{'layers': (w1, w2)}``) was taken for a shape when the state's
    shardings were matched to the params: step.init failed in jit with a ShapeDtypeStruct."""
    mesh = ensemble.make_mesh(n, model_parallel=D // n)
    params = {"layers": (jnp.arange(n * 3.0).reshape(n, 3), jnp.ones((n, 2)))}
    params = ensemble.shard_members(params, mesh, n)
    loss = lambda p, x: jnp.sum(jnp.sin(p["layers"][0] * x)) + jnp.sum(p["layers"][1] ** 2)
    step = ensemble.train_step(loss, optax.adam(0.1), n=n, mesh=mesh, donate=False)
    opt_state = step.init(params)
    mu = opt_state[0].mu["layers"]
    assert [m.sharding for m in mu] == [p.sharding for p in params["layers"]]
    new, _, losses = step(params, opt_state, jnp.ones(3))
    tx = optax.adam(0.1)
    for i in (0, n - 1):
        p = ensemble.member(params, i)
        value, grads = jax.value_and_grad(loss)(p, jnp.ones(3))
        ref = optax.apply_updates(p, tx.update(grads, tx.init(p), p)[0])
        np.testing.assert_allclose(losses[i], value, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(ensemble.member(new, i)), jax.tree.leaves(ref)):
            np.testing.assert_allclose(a, b, rtol=1e-6)


def test_huge_gradient_on_one_member_leaves_the_others_alone():
    n = D
    xs = jax.random.normal(jax.random.key(1), (n, 4, 3))
    ys = jax.random.normal(jax.random.key(2), (n, 4, 1))
    ys_huge = ys.at[0].multiply(1e6)
    ens, params = setup(n, xs[0])
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))
    step = ensemble.train_step(
        mse, tx, n=n, mesh=ens.mesh, rules=ens.rules, per_member_batch=True, donate=False
    )
    opt_state = step.init(params)
    calm, _, _ = step(params, opt_state, xs, ys)
    stormy, _, _ = step(params, opt_state, xs, ys_huge)
    for a, b in zip(*map(jax.tree_util.tree_leaves, (calm, stormy))):
        np.testing.assert_array_equal(a[1:], b[1:])
        assert not np.allclose(a[0], b[0])
    # Member 0's update was clipped to norm 1 (times lr 0.1) on its own.
    delta = jax.tree_util.tree_map(lambda a, p: a[0] - p[0], stormy, params)
    assert float(optax.tree.norm(delta)) == pytest.approx(0.1, rel=1e-4)


def test_per_member_learning_rates():
    n = D
    x = jax.random.normal(jax.random.key(1), (4, 3))
    y = jnp.ones((4, 1))
    ens, params = setup(n, x, shared_rngs=("params",))  # identical members
    lrs = [0.0, 0.1, 0.2, 0.1, 0.1, 0.1, 0.1, 0.1]
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    step = ensemble.train_step(
        mse,
        tx,
        n=n,
        mesh=ens.mesh,
        rules=ens.rules,
        hyperparams={"learning_rate": lrs},
        donate=False,
    )
    opt_state = step.init(params)
    lr_state = opt_state.hyperparams["learning_rate"]
    assert lr_state.sharding.spec == P("ensemble")
    np.testing.assert_allclose(lr_state, lrs)
    new, _, _ = step(params, opt_state, x, y)
    delta = jax.tree_util.tree_map(lambda a, b: np.asarray(a - b), new, params)
    for d in jax.tree_util.tree_leaves(delta):
        np.testing.assert_array_equal(d[0], 0.0)
        # a - b loses the last bits of a parameter of size ~1: compare to 1e-6.
        np.testing.assert_allclose(d[2], 2 * d[1], atol=1e-6)
        np.testing.assert_allclose(d[3], d[1], atol=1e-6)
        assert np.abs(d[1]).max() > 1e-3


def test_per_member_init_puts_each_members_state_on_its_devices():
    """ensemble.per_member used alone: optax's zeros depend on no input, so its state landed on
    device 0 (all members' Adam moments) or, under a mesh, on every device."""
    n, mesh = D, ensemble.make_mesh(D)
    params = ensemble.shard_members({"w": jnp.ones((n, 100)), "b": jnp.ones((n,))}, mesh, n)
    tx = ensemble.per_member(optax.inject_hyperparams(optax.adam)(1e-3), n,
                             learning_rate=np.linspace(1e-4, 1e-3, n))  # fmt: skip
    with ensemble.sharding.partitioning(mesh):
        under_mesh = jax.jit(tx.init)(params)
    for state in (tx.init(params), under_mesh):
        ensemble.debug.assert_member_placement(state, mesh)
        ensemble.debug.assert_no_replicated_members(state, n)
        per_device = {d: 0 for d in mesh.devices.flat}
        for leaf in jax.tree.leaves(state):
            for shard in leaf.addressable_shards:
                per_device[shard.device] += shard.data.nbytes
        assert len(set(per_device.values())) == 1  # an eighth each: no device holds them all
        np.testing.assert_allclose(state.hyperparams["learning_rate"], np.linspace(1e-4, 1e-3, n))


def test_per_member_values_holding_a_traced_one_are_taken_inside_a_jit():
    # A list with a traced value: the values, made NumPy to be tied to no caller's mesh, failed
    # with TracerArrayConversionError.
    params, grads = {"w": jnp.ones((2, 3))}, {"w": jnp.full((2, 3), 0.5)}

    def sgd_step(lr0):
        tx = ensemble.per_member(optax.inject_hyperparams(optax.sgd)(1.0), 2,
                                 learning_rate=[lr0, 0.2])  # fmt: skip
        updates, _ = tx.update(grads, tx.init(params), params)
        return optax.apply_updates(params, updates)["w"]

    np.testing.assert_allclose(jax.jit(sgd_step)(0.1), [[0.95] * 3, [0.9] * 3], rtol=1e-6)


def test_per_member_init_gives_each_moment_its_own_parameters_split():
    """Two square kernels split over 'model' on different axes (a transformer's d x d
    projections): moments found by shape took the first kernel's split for both, and each
    step then moved them over the member's devices (all-to-all, all-gather)."""
    mesh, n = ensemble.make_mesh(D // 2, model_parallel=2), D // 2
    spec = {"fc1": P("ensemble", None, "model"), "fc2": P("ensemble", "model", None)}
    params = {k: jax.device_put(jnp.ones((n, 8, 8)), NamedSharding(mesh, s))
              for k, s in spec.items()}  # fmt: skip
    for tx in (optax.adam(1e-3), optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))):
        state = ensemble.per_member(tx, n).init(params)
        moments = [s for s in jax.tree.leaves(state) if np.shape(s) == (n, 8, 8)]
        for fc1, fc2 in zip(*[iter(moments)] * 2):  # each moment tree (mu, nu): fc1, fc2
            assert (fc1.sharding.spec, fc2.sharding.spec) == (spec["fc1"], spec["fc2"])


class BNNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.Dense(5)(x)  # statistics of 5: they do not split over 2 'data' devices
        h = nn.Dropout(0.5, deterministic=not train)(h)
        h = nn.BatchNorm(use_running_average=not train, momentum=0.5)(h)
        return nn.Dense(1)(h)


@pytest.mark.parametrize("n", [D, D // 2])
def test_batchnorm_and_dropout_flow_through_aux(n):
    """Also with a member on 2 'data' devices: the batch splits over them, the statistics
    passed beside it (5 features) need not, and that is no reason to warn."""
    x = jax.random.normal(jax.random.key(1), (6, 3))
    y = jnp.ones((6, 1))
    net = BNNet()
    ens = ensemble.build(net, n)
    variables = ens.init(jax.random.key(0), x)
    params, batch_stats = variables["params"], variables["batch_stats"]

    def loss_fn(p, stats, key, x, y):
        out, upd = net.apply(
            {"params": p, "batch_stats": stats},
            x,
            train=True,
            rngs={"dropout": key},
            mutable=["batch_stats"],
        )
        return jnp.mean((out - y) ** 2), upd["batch_stats"]

    step = ensemble.train_step(
        loss_fn,
        optax.sgd(0.1),
        n=n,
        mesh=ens.mesh,
        has_aux=True,
        per_member_batch=(True, True, False, False),
        donate=False,
    )
    keys = jax.random.split(jax.random.key(3), n)
    opt_state = step.init(params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new_params, _, losses, new_stats = step(params, opt_state, batch_stats, keys, x, y)
    assert specs(new_stats) == specs(batch_stats)
    ref_loss, ref_stats = loss_fn(
        ensemble.member(params, 2), ensemble.member(batch_stats, 2), keys[2], x, y
    )
    np.testing.assert_allclose(losses[2], ref_loss, rtol=1e-5)
    np.testing.assert_allclose(
        new_stats["BatchNorm_0"]["mean"][2], ref_stats["BatchNorm_0"]["mean"], rtol=1e-5
    )
    assert not np.allclose(losses[0], losses[1])  # different members, different dropout
    out = ens.apply({"params": new_params, "batch_stats": new_stats}, x)
    assert out.shape == (n, 6, 1)


def test_scan_carries_batchnorm_statistics_from_step_to_step():
    """``carry=`` passes each step's aux (the new batch_stats) to the next step: equal to K
    calls that do the same. Without it every step started from the statistics passed in."""
    n, K = D, 4
    xs = jax.random.normal(jax.random.key(1), (K, 6, 3))
    ys = jnp.ones((K, 6, 1))
    net = BNNet()
    ens = ensemble.build(net, n)
    variables = ens.init(jax.random.key(0), xs[0])

    def loss_fn(p, stats, key, x, y):
        out, upd = net.apply({"params": p, "batch_stats": stats}, x, train=True,
                             rngs={"dropout": key}, mutable=["batch_stats"])  # fmt: skip
        return jnp.mean((out - y) ** 2), upd["batch_stats"]

    step = ens.train_step(loss_fn, optax.adam(1e-2), has_aux=True,
                          per_member_batch=(True, True, False, False), donate=False)  # fmt: skip
    keys = jnp.stack([jax.random.split(jax.random.key(t), n) for t in range(K)])
    params, stats = variables["params"], variables["batch_stats"]
    opt_state, want_losses = step.init(params), []
    for t in range(K):
        params, opt_state, losses, stats = step(params, opt_state, stats, keys[t], xs[t], ys[t])
        want_losses.append(losses)
    start = (variables["params"], step.init(variables["params"]), variables["batch_stats"])
    got_params, _, got_losses, got_stats = step.scan(*start, keys, xs, ys, carry=0)
    np.testing.assert_allclose(got_losses, jnp.stack(want_losses, 1), rtol=1e-6)
    for want, got in zip(
        jax.tree.leaves((params, stats)), jax.tree.leaves((got_params, got_stats))
    ):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert specs(got_stats) == specs(variables["batch_stats"])
    lowered = step.lower(*start, keys, xs, ys, carry=0)  # the same program, for memory checks
    assert len(jax.tree.leaves(lowered.out_info)) == len(
        jax.tree.leaves(step.scan(*start, keys, xs, ys, carry=0))
    )
    stacked_stats = jax.tree.map(lambda a: jnp.stack([a] * K), variables["batch_stats"])
    with pytest.raises(
        ValueError,
        match=r"scan\(carry=0\): batch argument 0 is the first step's state, passed once",
    ):
        step.scan(start[0], start[1], stacked_stats, keys, xs, ys, carry=0)
    with pytest.raises(ValueError, match=r"carry=2: batch argument 2 is shared"):
        step.scan(*start, keys, xs, ys, carry=2)
    with pytest.raises(ValueError, match=r"carry=4 names the batch argument .* in \[0, 4\)"):
        step.scan(*start, keys, xs, ys, carry=4)
    per = (True, True, False, False)
    odd_loss = lambda p, s, k, x, y: (loss_fn(p, s, k, x, y)[0], jnp.zeros(2))
    odd = ens.train_step(odd_loss, optax.sgd(0.1), has_aux=True, per_member_batch=per)
    with pytest.raises(
        ValueError, match=r"scan\(carry=0\): each step's aux replaces batch argument 0"
    ):
        odd.scan(start[0], odd.init(start[0]), start[2], keys, xs, ys, carry=0)
    plain_loss = lambda p, s, k, x, y: loss_fn(p, s, k, x, y)[0]
    plain = ens.train_step(plain_loss, optax.sgd(0.1), per_member_batch=per)
    with pytest.raises(ValueError, match=r"carry= needs a loss that returns \(loss, new state\)"):
        plain.scan(start[0], plain.init(start[0]), start[2], keys, xs, ys, carry=0)


def test_train_step_errors():
    n = D
    x = jnp.ones((4, 3))
    ens, params = setup(n, x)
    with pytest.raises(TypeError, match="GradientTransformation for ONE member"):
        ensemble.train_step(mse, "adam", n=n, mesh=ens.mesh)
    with pytest.raises(ValueError, match="cannot be split"):
        ensemble.train_step(mse, optax.sgd(0.1), n=3, mesh=ens.mesh)
    step = ensemble.train_step(mse, optax.sgd(0.1), n=n, mesh=ens.mesh, per_member_batch=True)
    opt_state = step.init(params)
    with pytest.raises(ValueError, match=r"batch argument 0 \(per-member\) has shape \(4, 3\)"):
        step(params, opt_state, x, jnp.ones((n, 4, 1)))
    with pytest.raises(ValueError, match=r"params leaf .* leading member axis of size n=8"):
        step.init(ensemble.member(params, 0))
    twice = ensemble.per_member(optax.adam(1e-3), n)  # train_step makes it per-member again
    twice_step = ensemble.train_step(mse, twice, n=n, mesh=ens.mesh)
    with pytest.raises(ValueError, match=r"the optimizer may be per-member twice: give"):
        twice_step.init(params)
    mixed = ensemble.train_step(
        mse, optax.sgd(0.1), n=n, mesh=ens.mesh, per_member_batch=(True, False)
    )
    with pytest.raises(ValueError, match="one flag per batch argument"):
        mixed(params, opt_state, x)
    vector = ensemble.train_step(
        lambda p, x: MODEL.apply({"params": p}, x)[:, 0],
        optax.sgd(0.1),
        n=n,
        mesh=ens.mesh,
        rules=ens.rules,
    )
    with pytest.raises(ValueError, match="scalar loss per member"):
        vector(params, opt_state, x)
    _per_member_hyperparams_errors(ens, params)


def _per_member_hyperparams_errors(ens, params):
    """train_step's ``hyperparams=`` given for what the optimizer cannot take per member."""
    n = ens.n
    with pytest.raises(ValueError, match="learning_rate"):
        ensemble.train_step(
            mse,
            optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
            n=n,
            mesh=ens.mesh,
            hyperparams={"learning_rate": [0.1, 0.2]},
        )
    # Names tx does not inject, and schedules (whose state a number would overwrite).
    for hp, match in [
        (0.1, r"given for \['lr'\], which tx does not inject .*\['learning_rate'\]"),
        (optax.constant_schedule(0.1), r"\['lr'\]"),
    ]:
        tx = optax.inject_hyperparams(optax.sgd)(learning_rate=hp)
        step = ensemble.train_step(mse, tx, n=n, mesh=ens.mesh, hyperparams={"lr": [0.1] * n})
        with pytest.raises(ValueError, match=match):
            step.init(params)
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=optax.constant_schedule(0.1))
    step = ensemble.train_step(
        mse, tx, n=n, mesh=ens.mesh, hyperparams={"learning_rate": [0.1] * n}
    )
    with pytest.raises(ValueError, match=r"\['learning_rate'\] of tx are schedules"):
        step.init(params)
    # Injected in two branches: which one the values are for is unclear (optax's own error
    # dumped the whole state).
    inject = optax.inject_hyperparams
    tx = optax.multi_transform(
        {"a": inject(optax.sgd)(1e-2), "b": inject(optax.adam)(1e-2)},
        lambda p: {
            k: jax.tree.map(lambda _, k=k: "a" if k == "Dense_0" else "b", v) for k, v in p.items()
        },
    )
    step = ensemble.train_step(
        mse, tx, n=n, mesh=ens.mesh, hyperparams={"learning_rate": [0.1] * n}
    )
    with pytest.raises(
        ValueError, match=r"\['learning_rate'\] are ambiguous: tx injects each in 2"
    ):
        step.init(params)


def test_another_optimizers_state_or_swapped_arguments_are_one_type_error():
    """Both failed deep in optax (AttributeError: 'TraceState' object has no attribute 'mu') or
    in jax.grad (of an int32 count), naming neither argument."""
    x = jnp.ones((4, 3))
    ens, params = setup(D, x)
    adam = ensemble.train_step(mse, optax.adam(1e-3), n=D, mesh=ens.mesh)
    momentum = ensemble.train_step(mse, optax.sgd(0.1, momentum=0.9), n=D, mesh=ens.mesh)
    fix = r"pass step.init\(params\) of this same step, as step\(params, opt_state, \*batch\)"
    with pytest.raises(TypeError, match=r"^opt_state is not this step's optimizer state .*" + fix):
        adam(params, momentum.init(params), x, jnp.zeros((4, 1)))
    with pytest.raises(TypeError, match=fix):
        adam(adam.init(params), params, x, jnp.zeros((4, 1)))
    losses = adam(params, adam.init(params), x, jnp.zeros((4, 1)))[2]  # the right order trains
    assert losses.shape == (D,)


def test_step_peak_per_device_falls_with_devices():
    x = jnp.ones((4, 64))
    y = jnp.zeros((4, 1))

    class Wide(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(1)(nn.tanh(nn.Dense(512)(x)))

    def loss_fn(p, x, y):
        return jnp.mean((Wide().apply({"params": p}, x) - y) ** 2)

    def peak(devices):
        ens = ensemble.build(Wide(), D, devices=devices)
        params = ens.init(jax.random.key(0), x)["params"]
        step = ensemble.train_step(loss_fn, optax.adam(1e-3), n=D, mesh=ens.mesh)
        m = step.lower(params, step.init(params), x, y).compile().memory_analysis()
        assert m.alias_size_in_bytes > 0
        return (
            m.argument_size_in_bytes
            + m.output_size_in_bytes
            + m.temp_size_in_bytes
            - m.alias_size_in_bytes
        )

    assert peak(jax.devices()) <= 1.05 * peak(jax.devices()[:1]) / D


def test_per_member_data_marked_shared_is_refused():
    """Targets stacked one per member, on the member axis, passed as a shared batch: ``mse``
    broadcasts them, so without the check every member would silently fit all n targets."""
    n = D
    x = jnp.ones((4, 3))
    ens, params = setup(n, x)
    ys = ensemble.sharding.shard_members(jnp.ones((n, 4, 1)), ens.mesh, n)
    step = ensemble.train_step(mse, optax.sgd(0.1), n=n, mesh=ens.mesh)
    with pytest.raises(
        ValueError,
        match=r"batch argument 1 is shared by all members, but it has a leading axis of n=8 "
        r"split over the 'ensemble' devices.*per_member_batch=True",
    ):
        step(params, step.init(params), x, ys)
    xs = ensemble.sharding.shard_members(jnp.ones((n, 4, 3)), ens.mesh, n)
    with pytest.raises(ValueError, match=r"input 0 is shared .* in_axes=0"):
        ens.apply({"params": params}, xs)
    with pytest.raises(ValueError, match=r"keyword input 'inputs' is shared .* positional"):
        ens.apply({"params": params}, inputs=xs)
    # Marked per-member, the same targets are accepted.
    per_member = ensemble.train_step(
        mse, optax.sgd(0.1), n=n, mesh=ens.mesh, per_member_batch=(False, True)
    )
    per_member(params, per_member.init(params), x, ys)


def test_multisteps_accumulates_per_member_like_plain_optax():
    """``optax.MultiSteps`` (a wrapper object, not a GradientTransformation) is taken as its
    ``gradient_transformation()``; each member accumulates its own gradients."""
    n, k = D, 3
    x = jax.random.normal(jax.random.key(1), (4, 3))
    xs = jax.random.normal(jax.random.key(2), (n, 4, 3))
    ens, params = setup(n, x)
    make = lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=k)
    host = jax.device_get(params)
    tx = make().gradient_transformation()
    grad = jax.jit(jax.grad(mse))
    refs = []
    for i in range(n):
        p = jax.tree.map(lambda a, i=i: a[i], host)
        s = tx.init(p)
        for _ in range(k + 1):
            u, s = tx.update(grad(p, xs[i], 0.0), s, p)
            p = optax.apply_updates(p, u)
        refs.append(p)
    step = ensemble.train_step(
        mse, make(), n=n, mesh=ens.mesh, rules=ens.rules, per_member_batch=(True, False)
    )
    opt_state = step.init(params)
    for t in range(k + 1):
        before = jax.device_get(params)
        params, opt_state, _ = step(params, opt_state, xs, 0.0)
        moved = jax.tree.map(lambda a, b: not np.allclose(a, b), before, jax.device_get(params))
        assert all(jax.tree.leaves(moved)) == (t == k - 1)  # one update every k steps
    for i, p in enumerate(refs):
        got = jax.tree.map(lambda a, i=i: np.asarray(a)[i], params)
        jax.tree.map(lambda g, e: np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6), got, p)


@pytest.mark.parametrize(
    "make",
    [
        # value=: lr x 0.1 once a member's loss stops improving (each member its own plateau)
        lambda: optax.chain(
            optax.sgd(0.3), optax.contrib.reduce_on_plateau(patience=1, cooldown=0, factor=0.1)
        ),
        lambda: optax.polyak_sgd(max_learning_rate=0.5),  # value=
        lambda: optax.lbfgs(),  # value=, grad=, value_fn= (line search calls the loss again)
        # Takes grad_fn= alone and refuses the others: called as a plain loop calls it.
        lambda: optax.contrib.sam(optax.sgd(0.1), optax.sgd(0.05), sync_period=2),
    ],
    ids=["reduce_on_plateau", "polyak_sgd", "lbfgs", "sam"],
)
def test_optimizers_reading_the_loss_get_each_members_own(make):
    n, steps = D, 4
    xs = jax.random.normal(jax.random.key(1), (n, 4, 3))
    ys = jax.random.normal(jax.random.key(2), (n, 4, 1)) * jnp.arange(1, n + 1)[:, None, None]
    ens, params = setup(n, xs[0])
    tx = make()
    host = jax.device_get(params)

    @jax.jit
    def plain_step(p, s, x, y):
        loss, grads = jax.value_and_grad(mse)(p, x, y)
        kw = dict(value=loss, grad=grads, value_fn=lambda q: mse(q, x, y))
        if isinstance(s, optax.contrib.SAMState):
            kw = {}
        updates, s = tx.update(grads, s, p, **kw)
        return optax.apply_updates(p, updates), s, loss

    step = ensemble.train_step(
        mse, make(), n=n, mesh=ens.mesh, rules=ens.rules, per_member_batch=True
    )
    opt_state = step.init(params)
    # Each member's own loss: read by its own optimizer, never summed over the others.
    lowered = step.lower(params, opt_state, xs, ys)
    assert ensemble.debug.collectives(lowered, across_members=True) == {}
    losses = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, xs, ys)
        losses.append(np.asarray(loss))
    for i in range(n):
        p = jax.tree.map(lambda a, i=i: a[i], host)
        s = tx.init(p)
        for t in range(steps):
            p, s, loss = plain_step(p, s, xs[i], ys[i])
            np.testing.assert_allclose(losses[t][i], loss, rtol=2e-5, atol=1e-6)
        got = jax.tree.map(lambda a, i=i: np.asarray(a)[i], params)
        jax.tree.map(lambda g, e: np.testing.assert_allclose(g, e, rtol=2e-5, atol=1e-6), got, p)


def test_lookahead_params_are_refused_with_what_to_do():
    x = jnp.ones((4, 3))
    ens, params = setup(D, x)
    tx = optax.lookahead(optax.sgd(0.1), sync_period=2, slow_step_size=0.5)
    step = ensemble.train_step(mse, tx, n=D, mesh=ens.mesh, rules=ens.rules)
    both = optax.LookaheadParams.init_synced(jax.tree.map(jnp.copy, params))
    with pytest.raises(ValueError, match=r"optax.LookaheadParams: this step differentiates"):
        step(both, step.init(both), x, 0.0)


def test_per_member_hyperparameters_keep_optaxs_dtype_under_x64():
    """Plain inject_hyperparams keeps a float64 learning rate under x64; so do per-member ones
    (they were cast to float32: 0.1/3 became 0.0333333351)."""
    with jax.enable_x64(True):
        tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1 / 3)
        params = {"w": jnp.ones((4, 3), jnp.float64)}
        state = ensemble.per_member(tx, 4, learning_rate=[0.1 / 3] * 4).init(params)
        lr = optax.tree_utils.tree_get(state, "learning_rate")
        assert lr.dtype == jnp.float64 and float(lr[0]) == 0.1 / 3
    state = ensemble.per_member(tx, 4, learning_rate=[0.1 / 3] * 4).init({"w": jnp.ones((4, 3))})
    assert optax.tree_utils.tree_get(state, "learning_rate").dtype == jnp.float32


@pytest.mark.parametrize(("n", "mp"), [(D, 1), (2 * D, 1), (D // 4, 2)])
def test_scan_equals_the_step_called_once_per_batch(n, mp):
    """K steps in one call: the numbers of K calls, per-member and shared batches, aux
    member-major over the steps, donated, and nothing crossing members."""
    k = 5
    xs = jax.random.normal(jax.random.key(1), (k, 8, 3))  # shared: [K, batch, ...]
    ys = jnp.sin(xs[..., :1])
    scale = 1.0 + jax.random.uniform(jax.random.key(2), (k, n))  # per member: [K, n]

    def loss_fn(p, s, x, y):
        err = MODEL.apply({"params": p}, x) - y
        return s * jnp.mean(err**2), jnp.max(jnp.abs(err))

    ens, params = setup(n, xs[0], model_parallel=mp)
    step = ensemble.train_step(loss_fn, optax.adam(1e-2), n=n, mesh=ens.mesh, rules=ens.rules,
                               has_aux=True, per_member_batch=(True, False, False))  # fmt: skip
    want_p, want_s = params, step.init(params)
    want_losses, want_aux = [], []
    for i in range(k):
        want_p, want_s, loss, aux = step(want_p, want_s, scale[i], xs[i], ys[i])
        want_losses.append(loss)
        want_aux.append(aux)
    _, params = setup(n, xs[0], model_parallel=mp)
    opt_state = step.init(params)
    compiled = step.lower(params, opt_state, scale, xs, ys, stacked=True).compile()
    assert compiled.memory_analysis().alias_size_in_bytes > 0
    assert ensemble.debug.collectives(compiled, across_members=True) == {}
    old = jax.tree_util.tree_leaves((params, opt_state))
    param_specs = specs(params)
    params, opt_state, losses, aux = step.scan(params, opt_state, scale, xs, ys)
    assert all(leaf.is_deleted() for leaf in old)
    assert specs(params) == param_specs
    assert losses.shape == (n, k) and losses.sharding.spec[0] == "ensemble"
    np.testing.assert_allclose(losses, np.stack(want_losses, axis=1), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(aux, np.stack(want_aux, axis=1), rtol=1e-5, atol=1e-7)
    for got, want in zip(jax.tree_util.tree_leaves((params, opt_state)),
                         jax.tree_util.tree_leaves((want_p, want_s))):  # fmt: skip
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_scan_refuses_batches_that_are_not_stacked_alike():
    n = D
    x = jnp.ones((8, 3))
    ens, params = setup(n, x)
    step = ensemble.train_step(mse, optax.sgd(0.1), n=n, mesh=ens.mesh, rules=ens.rules,
                               donate=False)  # fmt: skip
    opt_state = step.init(params)
    alike = "scan takes every stacked batch argument"
    with pytest.raises(ValueError, match=r"batch argument 1 has shape \(4, 8, 1\); " + alike):
        step.scan(params, opt_state, jnp.ones((5, 8, 3)), jnp.ones((4, 8, 1)))
    with pytest.raises(ValueError, match=r"batch argument 0 has shape \(\); " + alike):
        step.scan(params, opt_state, jnp.float32(1.0), jnp.ones((4, 8, 1)))
    with pytest.raises(ValueError, match=r"same length \(0 from the first\), at least 1"):
        step.scan(params, opt_state, jnp.ones((0, 8, 3)), jnp.ones((0, 8, 1)))
    with pytest.raises(ValueError, match="scan needs at least one batch argument"):
        step.scan(params, opt_state)
    with pytest.raises(ValueError, match="scan needs at least one batch argument"):
        step.scan(params, opt_state, x, x[:, :1], stacked=False)
    with pytest.raises(ValueError, match=r"stacked=\(True,\) gives one flag per batch argument"):
        step.scan(params, opt_state, x, x[:, :1], stacked=(True,))
    # A per-member argument keeps the per-step check: [K, n, ...], not [n, K, ...].
    per = ensemble.train_step(mse, optax.sgd(0.1), n=n, mesh=ens.mesh, rules=ens.rules,
                              per_member_batch=(True, False), donate=False)  # fmt: skip
    with pytest.raises(ValueError, match=r"leading member axis of size n=8"):
        per.scan(params, opt_state, jnp.ones((n, 3, 8, 3)), jnp.ones((n, 8, 1)))
    # The placement checks of a single step hold for the stacked arrays too (their one-step
    # rows carry no placement): per-member data marked shared, and data on another device.
    ys = jax.device_put(jnp.ones((5, n, 8, 1)), NamedSharding(ens.mesh, P(None, "ensemble")))
    with pytest.raises(ValueError, match=r"batch argument 1 is shared .* an axis 1 of n=8 split"):
        step.scan(params, opt_state, jnp.ones((5, 8, 3)), ys)
    xs = jax.device_put(jnp.ones((5, 8, 3)), jax.devices()[1])
    with pytest.raises(ValueError, match=r"batch argument 0 is committed to device\(s\) 1,"):
        step.scan(params, opt_state, xs, jnp.ones((5, 8, 1)))


def test_scan_over_indices_into_a_dataset_passed_once():
    """The deep-ensemble pattern: per-member row indices stacked per step, the dataset itself
    the same at every step (stacked=False), passed once."""
    n, k = D, 6
    x = jax.random.normal(jax.random.key(1), (32, 3))
    y = jnp.sin(x[:, :1])
    idx = jax.random.randint(jax.random.key(2), (k, n, 8), 0, 32)

    def loss_fn(p, rows, x, y):
        return mse(p, x[rows], y[rows])

    ens, params = setup(n, x)
    step = ensemble.train_step(loss_fn, optax.adam(1e-2), n=n, mesh=ens.mesh, rules=ens.rules,
                               per_member_batch=(True, False, False), donate=False)  # fmt: skip
    want_p, want_s = params, step.init(params)
    want = []
    for i in range(k):
        want_p, want_s, loss = step(want_p, want_s, idx[i], x, y)
        want.append(loss)
    got_p, _, losses = step.scan(params, step.init(params), idx, x, y, stacked=(True, False, False))
    np.testing.assert_allclose(losses, np.stack(want, axis=1), rtol=1e-5, atol=1e-7)
    for got, ref in zip(jax.tree_util.tree_leaves(got_p), jax.tree_util.tree_leaves(want_p)):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-7)


def _layout_moves(compiled) -> int:
    """Copies and transposes of arrays of 256 elements or more anywhere in a compiled program
    (fusions included; the scalar counters' copies do not matter)."""
    dims = re.findall(r"= [a-z0-9]+\[([0-9,]*)\]\S* (?:copy|transpose)\(", compiled.as_text())
    return sum(math.prod(int(d) for d in ds.split(",") if d) >= 256 for ds in dims)


def test_one_member_per_device_steps_like_the_plain_model():
    """With one member per device the member's gradient is not vmapped over an axis of 1: a
    batched dot_general's gradient comes out [out, in], and XLA:CPU then read it transposed in
    every optimizer fusion (3x slower for 1024-unit layers). The compiled step moves no more
    data than the plain model's own donated step."""
    model = nn.Sequential([nn.Dense(256), nn.relu, nn.Dense(256), nn.relu, nn.Dense(3)])
    x, y = jnp.ones((16, 8)), jnp.ones((16, 3))

    def loss_fn(p, x, y):
        return jnp.mean((model.apply({"params": p}, x) - y) ** 2)

    tx = optax.adam(1e-3)
    plain = model.init(jax.random.key(0), x)["params"]

    def plain_step(p, s, x, y):
        grads = jax.grad(loss_fn)(p, x, y)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    want = _layout_moves(
        jax.jit(plain_step, donate_argnums=(0, 1)).lower(plain, tx.init(plain), x, y).compile()
    )
    ens = ensemble.build(model, D)
    params = ens.init(jax.random.key(0), x)["params"]
    step = ensemble.train_step(loss_fn, tx, n=D, mesh=ens.mesh)
    compiled = step.lower(params, step.init(params), x, y).compile()
    assert _layout_moves(compiled) <= want, (_layout_moves(compiled), want)
