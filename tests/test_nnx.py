"""NNX ensembles: placement read off addressable shards, behaviour of members, training, errors."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax_events import count_compiles

import ensemble
from ensemble import NNXEnsemble, nnx_optimizer, nnx_train_step
from ensemble._nnx import build_nnx, lower_build_nnx

D = 8  # conftest.py


class MLP(nnx.Module):
    """Unannotated params, BatchNorm and Dropout: every kind of state a member can hold."""

    def __init__(self, din: int, dh: int, dout: int, *, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(din, dh, rngs=rngs)
        self.bn = nnx.BatchNorm(dh, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.l2 = nnx.Linear(dh, dout, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(self.bn(nnx.relu(self.l1(x)))))


class Annotated(nnx.Module):
    """A kernel whose hidden axis is tensor-parallel through the rule ('hidden', 'model')."""

    def __init__(self, *, rngs: nnx.Rngs):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "hidden"))
        self.l1 = nnx.Linear(3, 16, kernel_init=init, rngs=rngs)
        self.l2 = nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


def mlp(rngs):
    return MLP(3, 8, 2, rngs=rngs)


def linear(rngs):
    return nnx.Linear(3, 1, rngs=rngs)


def mse(m, x, y):
    return ((m(x) - y) ** 2).mean()


@nnx.jit
def forward(ens, x):
    return ens(x)


def assert_on_member_axis(tree, mesh, n):
    """Every leaf: leading n, each shard holds exactly its own members on the devices the mesh
    assigns to them (read off addressable_shards, not metadata)."""
    e = mesh.shape["ensemble"]
    per_shard = n // e
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    assert leaves
    for path, leaf in leaves:
        name = jax.tree_util.keystr(path)
        assert leaf.shape[0] == n, name
        for shard in leaf.addressable_shards:
            rows = range(n)[shard.index[0]]
            assert len(rows) == per_shard, f"{name}: shard on {shard.device} holds rows {rows}"
            owner = rows[0] // per_shard
            assert shard.device in set(mesh.devices[owner].flat), (name, shard.device, owner)
            assert shard.data.shape[0] == per_shard, name


@functools.cache
def built(n):
    """One MLP ensemble per n for the whole file: building (a compile) is the slow part."""
    return ensemble.build(mlp, n, rngs=0)


@pytest.fixture
def ens8():
    ens = built(D)
    yield ens
    ens.train()
    ens.in_axes = None


# -- placement ------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [D, 2 * D, D // 2])
def test_contract_placement(n):
    ens = built(n)
    assert isinstance(ens, NNXEnsemble) and ens.n == n
    y = ens(jnp.ones((4, 3)))  # eager, as in the contract
    assert y.shape == (n, 4, 2)
    assert_on_member_axis([y], ens.mesh, n)
    assert_on_member_axis(nnx.state(ens), ens.mesh, n)
    # Params, batch stats and the dropout rng key/count all hold their member axis.
    kinds = {type(v).__name__ for v in jax.tree.leaves(nnx.state(ens), is_leaf=_is_var)}
    assert {"Param", "BatchStat", "RngKey", "RngCount"} <= kinds
    # Per-device bytes are the share: n members over the mesh's member axis.
    total = sum(x.nbytes for x in jax.tree.leaves(nnx.state(ens)))
    per_device = _bytes_per_device(nnx.state(ens))
    assert max(per_device.values()) == total // ens.mesh.shape["ensemble"]


def _is_var(x):
    return isinstance(x, nnx.Variable)


def _bytes_per_device(tree):
    out = {}
    for leaf in jax.tree.leaves(tree):
        for s in leaf.addressable_shards:
            out[s.device] = out.get(s.device, 0) + s.data.nbytes
    return out


def test_init_memory_is_per_device_share():
    """Compiled memory of the creation: each device materialises only its own members."""
    kwargs = dict(in_features=128, out_features=128)
    one = lower_build_nnx(nnx.Linear, D, devices=jax.devices()[:1], **kwargs)
    one = one.compile().memory_analysis()
    spread = lower_build_nnx(nnx.Linear, D, **kwargs).compile().memory_analysis()
    total = D * (128 * 128 + 128) * 4
    assert total <= one.output_size_in_bytes < 1.01 * total
    assert spread.output_size_in_bytes <= 1.01 * total / D
    peak = spread.argument_size_in_bytes + spread.output_size_in_bytes + spread.temp_size_in_bytes
    assert peak < total / 2, "no device may ever hold the whole ensemble during init"


def test_model_parallel_through_rules():
    ens = build_nnx(Annotated, 4, model_parallel=2, rules=[("hidden", "model")], rngs=1)
    assert dict(ens.mesh.shape) == {"ensemble": 4, "data": 1, "model": 2}
    kernel = ens.members.l1.kernel[...]
    assert kernel.sharding.spec == jax.P("ensemble", None, "model")
    assert {s.data.shape for s in kernel.addressable_shards} == {(1, 3, 8)}
    assert_on_member_axis(nnx.state(ens), ens.mesh, 4)
    x = jnp.ones((2, 3))
    member = ens.member(2)
    kernel = member.l1.kernel[...]
    assert kernel.devices() == set(ens.mesh.devices[2].flat)
    assert {s.data.shape for s in kernel.addressable_shards} == {(3, 8)}
    assert member.l1.kernel.get_metadata()["out_sharding"] == (None, "hidden")
    np.testing.assert_allclose(forward(ens, x)[2], member(x), rtol=1e-5, atol=1e-6)


def test_data_parallel_inside_member():
    ens = build_nnx(linear, D // 2, rngs=2)
    y = forward(ens, jnp.ones((6, 3)))
    # Each member spans 2 devices ('data'): its batch is split over them, not duplicated.
    assert {s.data.shape for s in y.addressable_shards} == {(1, 3, 1)}
    assert y.sharding.spec[:2] == ("ensemble", "data")
    ens.data_parallel = False
    y = forward(ens, jnp.ones((6, 3)))
    assert {s.data.shape for s in y.addressable_shards} == {(1, 6, 1)}


def test_user_mesh_and_rngs_forms():
    devices = jax.devices()[:4]
    a = build_nnx(linear, 4, devices=devices, rngs=jax.random.key(3))
    assert set(a.mesh.devices.flat) == set(devices)
    # An nnx.Rngs gives one key per stream (advancing it, like any other use of the Rngs).
    rngs = nnx.Rngs(params=3)
    b = build_nnx(linear, 4, mesh=a.mesh, rngs=rngs)
    c = build_nnx(nnx.Linear, 4, mesh=a.mesh, rngs={"params": 3}, in_features=3, out_features=1)
    assert int(rngs.params.count[...]) == 1
    assert not np.array_equal(b.members.kernel[...], c.members.kernel[...])
    kernels = np.asarray(a.members.kernel[...])
    assert len({k.tobytes() for k in kernels}) == 4, "members must differ"


# -- behaviour ------------------------------------------------------------------------------------


def test_member_i_equals_row_i(ens8):
    ens8.eval()
    x = jax.random.normal(jax.random.key(0), (5, 3))
    y = forward(ens8, x)
    for i in (0, 5, D - 1):
        member = ens8.member(i)
        assert type(member) is MLP
        assert member.l1.kernel[...].shape == (3, 8)
        # Taken from the shards that hold it: member i stays on device i, nowhere else.
        for leaf in jax.tree.leaves(nnx.state(member)):
            assert leaf.devices() == {jax.devices()[i]}
        np.testing.assert_allclose(member(x), y[i], rtol=1e-5, atol=1e-6)
    # The same pytree as the factory's own module (its Variables' metadata differed: a
    # jax.tree.map of the two states failed, and the graphdefs were unequal).
    plain = mlp(nnx.Rngs(0))
    plain.eval()  # as the ensemble is
    assert nnx.graphdef(member) == nnx.graphdef(plain)
    assert jax.tree.structure(nnx.state(member)) == jax.tree.structure(nnx.state(plain))
    jax.tree.map(lambda a, b: a.shape == b.shape, nnx.state(member), nnx.state(plain))


def test_dropout_masks_differ_per_member_and_eval_is_deterministic():
    class Drop(nnx.Module):
        def __init__(self, rngs):
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x, *, scale=1.0):
            return self.drop(x) * scale

    ens = build_nnx(Drop, D)
    x = jnp.ones((32,))
    member = ens.member(3)
    masks = forward(ens, x)
    assert len({np.asarray(m).tobytes() for m in masks}) == D
    # A member copy carries that member's rng state: same mask as row i of the ensemble.
    np.testing.assert_array_equal(member(x), masks[3])
    # Eager calls (compiled once, static kwargs) write the advanced rng counts back too.
    eager = ens(x, scale=2.0)
    assert not np.array_equal(eager, 2 * masks), "rng counts must advance"
    assert not np.array_equal(ens(x, scale=2.0), eager)
    assert int(ens.members.drop.rngs.count[...][0]) == 3
    ens.eval()
    np.testing.assert_array_equal(ens(x), jnp.ones((D, 32)))


def test_a_train_step_gives_each_member_its_own_keys_of_an_rngs_argument():
    """step(ens, opt, x, nnx.Rngs(dropout=1)): member i draws from split(stream(), n)[i], as in
    a call of the ensemble, and equals the plain member trained alone with that key."""

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin, self.drop = nnx.Linear(3, 16, rngs=rngs), nnx.Dropout(0.5)

        def __call__(self, x, rngs=None):
            return self.drop(self.lin(x), rngs=rngs)

    n = 4
    ens = build_nnx(Net, n, devices=jax.devices()[:n])
    ens.train()
    plain = [ens.member(i) for i in range(n)]
    loss = lambda m, x, rngs: jnp.mean(m(x, rngs=rngs) ** 2)
    step = ens.train_step(loss, optax.sgd(0.1))
    opt, x = step.init(), jax.random.normal(jax.random.key(2), (8, 3))
    losses = step(ens, opt, x, nnx.Rngs(dropout=1))
    keys = jax.random.split(nnx.Rngs(dropout=1).dropout(), n)  # what a call would give
    for i, member in enumerate(plain):
        want, grads = nnx.value_and_grad(loss)(member, x, nnx.Rngs(dropout=keys[i]))
        np.testing.assert_allclose(losses[i], want, rtol=1e-6)
        kernel = member.lin.kernel[...] - 0.1 * grads.lin.kernel[...]
        np.testing.assert_allclose(ens.members.lin.kernel[...][i], kernel, rtol=1e-5, atol=1e-6)
    assert len({float(v) for v in losses}) == n  # each member its own mask
    with pytest.raises(TypeError, match=r"step\.scan takes no nnx\.Rngs"):
        step.scan(ens, opt, x[None], nnx.Rngs(dropout=1), stacked=(True, False))


def test_batchnorm_updates_stats_per_member(ens8):
    ens = ens8
    ens.in_axes = 0
    x = jax.random.normal(jax.random.key(1), (D, 16, 3)) * jnp.arange(1, D + 1)[:, None, None]
    before = np.asarray(ens.members.bn.mean[...])
    forward(ens, x)
    after = ens.members.bn.mean[...]
    assert after.shape == (D, 8) and after.sharding.spec[0] == "ensemble"
    assert not np.allclose(before, after)
    assert len({np.asarray(r).tobytes() for r in after}) == D
    ens.eval()
    forward(ens, x)
    np.testing.assert_array_equal(ens.members.bn.mean[...], after)


def test_value_and_grad_and_per_member_inputs(ens8):
    x = jax.random.normal(jax.random.key(2), (D, 4, 3))

    @nnx.jit
    def loss_and_grads(ens, x):
        return nnx.value_and_grad(lambda e: (e(x) ** 2).sum())(ens)

    ens8.in_axes = 0
    loss, grads = loss_and_grads(ens8, x)
    assert loss.shape == ()
    assert_on_member_axis(grads, ens8.mesh, D)


def test_an_ensemble_that_only_reads_its_state_works_inside_jax_transforms(ens8):
    """Like a plain NNX module: closed over by ``jax.jit`` or ``jax.grad`` (eval mode, so the
    call changes no Variable), the ensemble computes each member's own function."""
    ens8.eval()
    x = jax.random.normal(jax.random.key(3), (4, 3))
    jitted = np.asarray(jax.jit(lambda x: ens8(x))(x))
    grad = np.asarray(jax.grad(lambda x: jnp.sum(ens8(x) ** 2))(x))
    want_grad = np.zeros_like(grad)
    for i in range(D):
        member = ens8.member(i)
        np.testing.assert_allclose(jitted[i], member(x), rtol=1e-5, atol=1e-6)
        want_grad += np.asarray(jax.grad(lambda x, m=member: jnp.sum(m(x) ** 2))(x))
    np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-5)


# -- optimizer and training ------------------------------------------------------------------------


def test_optimizer_state_placement(ens8):
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
    opt = nnx_optimizer(ens8, tx, learning_rate=np.linspace(1e-3, 1e-2, D))
    state = nnx.state(opt)
    member_shaped = [x for x in jax.tree.leaves(state) if x.ndim >= 1]
    assert_on_member_axis(member_shaped, ens8.mesh, D)
    lr = opt.opt_state.hyperparams["learning_rate"][...]
    assert lr.shape == (D,) and lr.sharding.spec[0] == "ensemble"
    # Only the global step counter is not member-shaped.
    assert [x.shape for x in jax.tree.leaves(state) if x.ndim == 0] == [()]


class Unmapped(nnx.Module):
    """A kernel annotated ('embed', 'hidden'), where no rule maps 'embed'."""

    def __init__(self, *, rngs: nnx.Rngs):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "hidden"))
        self.l1 = nnx.Linear(3, 8, kernel_init=init, rngs=rngs)

    def __call__(self, x):
        return self.l1(x)


@pytest.mark.parametrize("layout", [dict(n=D), dict(n=4, model_parallel=2)])
def test_optimizer_of_a_model_with_an_annotation_no_rule_maps_trains_like_plain_optax(layout):
    """An unmapped logical name is replicated with a warning (README); the optimizer used to
    refuse it (Flax resolved the raw name against the mesh)."""
    import warnings

    n = layout.pop("n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unmapped-name warning, where a member spans 2
        ens = build_nnx(Unmapped, n, rules=[("hidden", "model")], rngs=3, **layout)
    plain = [ens.member(i) for i in range(n)]
    tx = optax.adam(0.1)
    opt = nnx_optimizer(ens, tx)
    mu = opt.opt_state[0].mu["l1"]["kernel"][...]
    mp = layout.get("model_parallel", 1)
    assert {s.data.shape for s in mu.addressable_shards} == {(1, 3, 8 // mp)}  # 'hidden' split
    x = jax.random.normal(jax.random.key(1), (4, 3))
    for _ in range(2):
        nnx_train_step(mse)(ens, opt, x, jnp.ones((4, 8)))
    for i, m in enumerate(plain):
        m = jax.device_put(m, jax.devices()[0])  # hypothetical plain run on one device
        state = tx.init(nnx.state(m, nnx.Param))
        for _ in range(2):
            grads = nnx.grad(mse)(m, x, jnp.ones((4, 8)))
            updates, state = tx.update(grads, state)
            nnx.update(m, optax.apply_updates(nnx.state(m, nnx.Param), updates))
        np.testing.assert_allclose(
            ens.members.l1.kernel[...][i], m.l1.kernel[...], rtol=1e-5, atol=1e-6
        )


@pytest.mark.parametrize(
    "tx",
    [optax.adafactor(0.05, min_dim_size_to_factor=2), optax.lbfgs(0.05, 5, linesearch=None)],
    ids=["adafactor", "lbfgs"],
)
def test_optimizer_state_not_shaped_like_its_parameter_keeps_the_member_axis_only(tx):
    """Flax gives every optimizer-state Variable its parameter's names, whatever its shape:
    Adafactor's factored moments (fewer axes) were refused, and L-BFGS's history of 5 updates
    ([n, 5, *shape]) got 'hidden' on its history axis, which 2 devices cannot split."""
    ens = build_nnx(Annotated, 4, model_parallel=2, rules=[("hidden", "model")], rngs=2)
    plain = [ens.member(i) for i in range(4)]
    opt = nnx_optimizer(ens, tx)
    kernel = ens.members.l1.kernel[...]
    for leaf in jax.tree.leaves(nnx.state(opt, nnx.OptState)):
        if leaf.shape == kernel.shape:  # shaped like the kernel: split like it
            assert leaf.sharding.spec == kernel.sharding.spec, leaf.shape
        elif leaf.ndim:  # the member axis only: each member's two devices hold it whole
            assert tuple(leaf.sharding.spec)[1:] in ((), (None,) * (leaf.ndim - 1)), leaf.shape
    x = jax.random.normal(jax.random.key(1), (4, 3))
    for _ in range(3):
        nnx_train_step(mse)(ens, opt, x, jnp.ones((4, 2)))
    for i, m in enumerate(plain):
        m = jax.device_put(m, jax.devices()[0])  # plain Flax and optax on one device
        with nnx.use_eager_sharding(False):
            reference = nnx.Optimizer(m, tx, wrt=nnx.Param)
            for _ in range(3):
                reference.update(m, nnx.grad(mse)(m, x, jnp.ones((4, 2))))
        np.testing.assert_allclose(
            ens.members.l1.kernel[...][i], m.l1.kernel[...], rtol=1e-5, atol=1e-6
        )


def test_train_step_lowers_loss_and_donates():
    ens = build_nnx(linear, D, rngs=4)
    opt = nnx_optimizer(ens, optax.sgd(0.1, momentum=0.5))
    step = nnx_train_step(mse)
    x = jax.random.normal(jax.random.key(5), (16, 3))
    y = x @ jnp.array([[1.0], [-2.0], [0.5]])
    old = ens.members.kernel[...]
    first = step(ens, opt, x, y)
    assert first.shape == (D,) and first.sharding.spec[0] == "ensemble"
    assert old.is_deleted(), "donated params must be consumed by the step"
    for _ in range(30):
        last = step(ens, opt, x, y)
    assert bool(jnp.all(last < 0.1 * first)), (first, last)
    assert_on_member_axis(nnx.state(ens), ens.mesh, D)
    assert_on_member_axis([x for x in jax.tree.leaves(nnx.state(opt)) if x.ndim], ens.mesh, D)
    memory = step.lower(ens, opt, x, y).compile().memory_analysis()
    # Every state buffer is aliased to its update; only the (undonated) batch is not.
    assert memory.alias_size_in_bytes > 0
    assert memory.alias_size_in_bytes == memory.argument_size_in_bytes - x.nbytes - y.nbytes
    keep = nnx_train_step(mse, donate=False)
    kept = ens.members.kernel[...]
    keep(ens, opt, x, y)
    assert not kept.is_deleted()
    # A state taken before a donating step, put back: the fix is NNX's, not the linen step's.
    before = nnx.to_pure_dict(nnx.state(ens))  # the arrays themselves, no copy
    step(ens, opt, x, y)
    state = nnx.state(ens)
    nnx.replace_by_pure_dict(state, before)
    nnx.update(ens, state)
    with pytest.raises(ValueError, match=r"was donated .*in place .*keep a copy") as info:
        step(ens, opt, x, y)
    assert "params, opt_state" not in str(info.value)
    # A clone taken before a donating step: every way of using it says so (a call and member()
    # gave XLA's bare "Array has been deleted").
    ens = build_nnx(linear, D, rngs=2)
    opt = nnx_optimizer(ens, optax.sgd(0.1))
    clone = nnx.clone(ens)
    step(ens, opt, x, y)
    for use in (lambda: clone(x), lambda: clone.member(0), lambda: clone.map(mse, x, y)):
        with pytest.raises(ValueError, match=r"was donated .*in place .*keep a copy"):
            use()


@pytest.mark.parametrize("n", [D, 2 * D])
def test_scan_equals_the_step_called_once_per_batch(n):
    """K steps in one call, per-member targets [K, n, ...]: the numbers of K calls, losses
    [n, K], the state donated and left on the member axis."""
    k = 4
    xs = jax.random.normal(jax.random.key(5), (k, 6, 3))
    ys = jax.random.normal(jax.random.key(6), (k, n, 6, 1))
    ens = build_nnx(linear, n, rngs=4)
    opt = nnx_optimizer(ens, optax.adam(0.1))
    step = nnx_train_step(mse, per_member_batch=(False, True))
    ref = nnx_train_step(mse, per_member_batch=(False, True), donate=False)  # clones share
    want_ens, want_opt = nnx.clone(ens), nnx.clone(opt)
    want = [ref(want_ens, want_opt, xs[i], ys[i]) for i in range(k)]
    old = ens.members.kernel[...]
    losses = step.scan(ens, opt, xs, ys)
    assert old.is_deleted()
    assert losses.shape == (n, k) and losses.sharding.spec[0] == "ensemble"
    np.testing.assert_allclose(losses, np.stack(want, axis=1), rtol=1e-5, atol=1e-7)
    for got, ref in zip(jax.tree.leaves(nnx.state((ens, opt))),
                        jax.tree.leaves(nnx.state((want_ens, want_opt)))):  # fmt: skip
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-7)
    assert_on_member_axis(nnx.state(ens), ens.mesh, n)
    memory = step.lower(ens, opt, xs, ys, stacked=True).compile().memory_analysis()
    # Per device: every state buffer aliased; not the batches (xs whole, ys one slice of D).
    batches = xs.nbytes + ys.nbytes // ens.mesh.devices.size
    assert memory.alias_size_in_bytes == memory.argument_size_in_bytes - batches
    with pytest.raises(ValueError, match=rf"batch argument 1 has shape \(3, {n}, 6, 1\); scan"):
        step.scan(ens, opt, xs, ys[:3])
    # A single step's placement checks, on the stacked arrays (their rows carry no placement).
    shared = nnx_train_step(mse, per_member_batch=False)
    ys = jax.device_put(ys, NamedSharding(ens.mesh, P(None, "ensemble")))
    with pytest.raises(ValueError, match=rf"batch argument 1 is shared .* an axis 1 of n={n}"):
        shared.scan(ens, opt, xs, ys)
    with pytest.raises(ValueError, match=r"batch argument 0 is committed to device\(s\) 1,"):
        step.scan(ens, opt, jax.device_put(xs, jax.devices()[1]), ys)


def test_per_member_clip_and_batches_are_independent():
    """A huge gradient on member 0 must not change the other members' (clipped) updates."""
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))
    x = jax.random.normal(jax.random.key(6), (8, 3))  # shared inputs, per-member targets
    y = jnp.zeros((D, 8, 1))
    ens = build_nnx(linear, D, rngs=7)
    opt = nnx_optimizer(ens, tx)
    step = nnx_train_step(mse, per_member_batch=(False, True), donate=False)
    results = []
    for scale in (1.0, 1e6):
        e, o = nnx.clone(ens), nnx.clone(opt)
        step(e, o, x, y.at[0].set(scale))
        results.append(np.asarray(e.members.kernel[...]))
    np.testing.assert_array_equal(results[0][1:], results[1][1:])
    assert not np.allclose(results[0][0], results[1][0])


def test_an_ensemble_built_for_per_member_inputs_trains_on_per_member_batches():
    """Host data (no layout to check) with a leading axis of n: member i trains on slice i,
    not on all n slices broadcast through its loss."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(D, 4, 3)), rng.normal(size=(D, 4, 1))
    ens = build_nnx(linear, D, rngs=3, in_axes=0)
    members = [ens.member(i) for i in range(D)]
    shared = nnx_train_step(mse, per_member_batch=False, donate=False)  # said: all slices
    all_slices = shared(nnx.clone(ens), nnx_optimizer(ens, optax.sgd(0.1)), x, y)
    step = ens.train_step(mse, optax.sgd(0.1))  # per_member_batch from in_axes=0
    losses = step(ens, step.init(), x, y)
    for i, member in enumerate(members):
        np.testing.assert_allclose(losses[i], mse(member, x[i], y[i]), rtol=1e-5)
        np.testing.assert_allclose(all_slices[i], mse(member, x, y), rtol=1e-5)
    ens.in_axes = (0, None)
    with pytest.raises(ValueError, match=r"in_axes=\(0, None\) .* pass per_member_batch="):
        nnx_train_step(mse)(ens, nnx_optimizer(ens, optax.sgd(0.1)), x, y)


@pytest.mark.parametrize("kind", ["reduce_on_plateau", "sam"])
def test_optimizers_reading_the_loss_get_each_members_own(kind):
    """optax's ``value=`` (reduce_on_plateau): the step passes member i's loss; a transform
    that refuses it (sam, which takes grad_fn= alone) is called as a plain loop calls it."""
    rng = np.random.default_rng(1)
    x, y = (
        rng.normal(size=(D, 4, 3)),
        rng.normal(size=(D, 4, 1)) * np.arange(1, D + 1)[:, None, None],
    )
    make = lambda: optax.chain(
        optax.sgd(0.3), optax.contrib.reduce_on_plateau(patience=1, cooldown=0, factor=0.1)
    )
    if kind == "sam":
        make = lambda: optax.contrib.sam(optax.sgd(0.1), optax.sgd(0.05), sync_period=2)
    ens = build_nnx(linear, D, rngs=3, in_axes=0)
    members = [ens.member(i) for i in range(D)]
    step = ens.train_step(mse, make())
    opt = step.init()
    losses = [np.asarray(step(ens, opt, x, y)) for _ in range(4)]
    for i, member in enumerate(members):
        ref = nnx.Optimizer(member, make(), wrt=nnx.Param)
        for t in range(4):
            loss, grads = nnx.value_and_grad(mse)(member, x[i], y[i])
            ref.update(member, grads, **({} if kind == "sam" else {"value": loss}))
            np.testing.assert_allclose(losses[t][i], loss, rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(
            ens.member(i).kernel[...], member.kernel[...], rtol=2e-5, atol=1e-6
        )


def test_train_step_wrt_trains_the_lora_weights_only():
    """``ens.train_step(..., wrt=nnx.LoRAParam)``: ``step.init()``'s optimizer trains those
    Variables alone, as ``nnx_optimizer(ens, tx, wrt=...)`` does (``wrt`` used to be a
    TypeError naming nnx_train_step)."""
    make = lambda rngs: nnx.LoRALinear(3, 2, lora_rank=2, rngs=rngs)
    ens = build_nnx(make, D, rngs=3)
    x, y = jnp.ones((4, 3)), jnp.ones((4, 2))
    base = np.asarray(ens.members.kernel[...])
    member = ens.member(2)
    step = ens.train_step(mse, optax.sgd(0.1), wrt=nnx.LoRAParam)
    step(ens, step.init(), x, y)
    np.testing.assert_array_equal(ens.members.kernel[...], base)  # the frozen weights
    ref = nnx.Optimizer(member, optax.sgd(0.1), wrt=nnx.LoRAParam)
    ref.update(member, nnx.grad(mse, argnums=nnx.DiffState(0, nnx.LoRAParam))(member, x, y))
    plain = build_nnx(linear, D, rngs=3)  # no LoRA weights: nothing to train, said so
    with pytest.raises(
        ValueError,
        match=r"wrt=.*LoRAParam.* selects none of the ensemble's Variables \(it has Param\)",
    ):
        plain.train_step(mse, optax.sgd(0.1), wrt=nnx.LoRAParam).init()
    got = ens.member(2).lora.lora_b[...]
    assert np.abs(np.asarray(got)).max() > 0  # (lora_b starts at zero: it did train)
    np.testing.assert_allclose(got, member.lora.lora_b[...], rtol=1e-5, atol=1e-7)


def test_a_line_search_needing_value_fn_is_named_with_what_works():
    ens = build_nnx(linear, D, rngs=3)
    x, y = jnp.ones((4, 3)), jnp.zeros((4, 1))
    step = ens.train_step(mse, optax.lbfgs())
    with pytest.raises(TypeError, match=r"needs arguments this step does not pass .* 'grad' and"):
        step(ens, step.init(), x, y)
    step = ens.train_step(mse, optax.lbfgs(linesearch=None))  # what the message offers
    assert np.isfinite(np.asarray(step(ens, step.init(), x, y))).all()


def test_per_member_learning_rates():
    ens = build_nnx(linear, D, rngs=8)
    lrs = np.arange(D, dtype=np.float32) * 0.01  # member 0 does not move
    opt = nnx_optimizer(
        ens, optax.inject_hyperparams(optax.sgd)(learning_rate=0.0), learning_rate=lrs
    )
    step = nnx_train_step(mse, has_aux=False)
    x, y = jnp.ones((4, 3)), jnp.ones((4, 1))
    before = np.asarray(ens.members.kernel[...])
    grads = np.asarray(nnx.grad(lambda e: e.map(mse, x, y).sum())(ens).members.kernel[...])
    step(ens, opt, x, y)
    delta = before - np.asarray(ens.members.kernel[...])
    np.testing.assert_allclose(delta, lrs[:, None, None] * grads, rtol=1e-4, atol=1e-7)
    assert np.all(delta[0] == 0)


def test_train_step_with_aux_and_dropout_batchnorm(ens8):
    opt = nnx_optimizer(ens8, optax.sgd(0.01))

    def loss_fn(m, x):
        out = m(x)
        return (out**2).mean(), out.mean()

    step = nnx_train_step(loss_fn, has_aux=True, per_member_batch=True)
    stats = np.asarray(ens8.members.bn.mean[...])  # a copy: the step donates the old buffer
    x = jax.random.normal(jax.random.key(9), (D, 8, 3))
    losses, aux = step(ens8, opt, x)
    assert losses.shape == (D,) and aux.shape == (D,)
    new_stats = np.asarray(ens8.members.bn.mean[...])
    assert len({r.tobytes() for r in new_stats - stats}) == D, "each member saw its own batch"
    assert int(opt.step[...]) == 1
    with pytest.raises(ValueError, match="leading member axis of size n=8"):
        step(ens8, opt, x[:3])


# -- errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, -2, 1.5])
def test_bad_n(n):
    with pytest.raises(ValueError, match="positive integer"):
        build_nnx(linear, n)


def test_impossible_n_for_devices():
    with pytest.raises(ValueError, match=r"n=3 members on D=8.*divisor of D"):
        build_nnx(linear, 3)


def test_factory_errors():
    with pytest.raises(TypeError, match=r"must return an nnx\.Module"):
        build_nnx(lambda rngs: jnp.ones(3), D)
    with pytest.raises(TypeError, match=r"instance.*factory"):
        build_nnx(nnx.Linear(3, 1, rngs=nnx.Rngs(0)), D)
    with pytest.raises(TypeError, match="callable"):
        build_nnx("Linear", D)
    with pytest.raises(TypeError, match=r"called with one argument, the member's nnx\.Rngs"):
        build_nnx(lambda: nnx.Linear(3, 1, rngs=nnx.Rngs(0)), D)
    with pytest.raises(TypeError, match=r"only accepted with an nnx\.Module subclass"):
        build_nnx(linear, D, in_features=3)
    with pytest.raises(TypeError, match="must be one key"):
        build_nnx(linear, D, rngs="seed")
    with pytest.raises(ValueError, match="in_axes"):
        build_nnx(linear, D, in_axes=1)
    # Callables that are not factories use the rngs as data: said in one line, not Rngs' errors.
    for not_a_factory in (jnp.tanh, lambda x: x * 2):
        with pytest.raises(TypeError, match=r"build called the model as an NNX factory"):
            ensemble.build(not_a_factory, D)

    def model_with_a_bug(rngs):
        raise TypeError("Linear() got an unexpected keyword argument 'width'")

    with pytest.raises(TypeError, match=r"^Linear\(\) got an unexpected keyword argument"):
        build_nnx(model_with_a_bug, D)  # the model's own error, as it is


class Sows(nnx.Module):
    def __init__(self, rngs):
        self.l = nnx.Linear(3, 2, rngs=rngs)

    def __call__(self, x):
        h = self.l(x)
        self.sow(nnx.Intermediate, "h", h)
        return h.sum(-1)


class Counts(nnx.Module):
    def __init__(self, rngs):
        self.l = nnx.Linear(3, 2, rngs=rngs)
        self.calls = 0

    def __call__(self, x):
        self.calls += 1  # a Python attribute: the ensemble could not keep it
        return self.l(x)


class RawArray(nnx.Module):
    def __init__(self, rngs):
        self.proj = jax.random.normal(rngs.params(), (3, 3))  # not in an nnx.Variable
        self.l = nnx.Linear(3, 2, rngs=rngs)

    def __call__(self, x):
        return self.l(x @ self.proj)


def test_a_call_that_changes_the_modules_structure_is_refused_not_dropped():
    x = jnp.ones((2, 3))
    ens = build_nnx(Sows, D, rngs=0)
    with pytest.warns(DeprecationWarning, match="outside of 'nnx.capture"):  # Flax's own
        with pytest.raises(ValueError, match=r"created the Variable\(s\) h;.*nnx\.capture"):
            ens(x)
    # The way the message gives: capture the sown values inside the call (Flax's own API).
    out, sown = ens.map(lambda m, x: nnx.capture(m, nnx.Intermediate)(x), x)
    plain_out, plain_sown = nnx.capture(ens.member(3), nnx.Intermediate)(x)
    np.testing.assert_allclose(out[3], plain_out, rtol=1e-6)
    # The same tree as the plain model's (its Variables' metadata too), member axis apart.
    assert len(jax.tree.leaves(sown)) == 1
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a[3], b, rtol=1e-6), sown, plain_sown)
    with pytest.raises(ValueError, match="Python attribute"):
        build_nnx(Counts, D, rngs=0)(x)
    with pytest.raises(TypeError, match=r"at 'proj' \(attribute 'proj' of a RawArray\)"):
        build_nnx(RawArray, D, rngs=0)
    weight_norm = lambda r: nnx.WeightNorm(nnx.Linear(6, 4, rngs=r), rngs=r)
    with pytest.raises(TypeError, match=r"\(attribute 'scales' of a WeightNorm\)"):
        build_nnx(weight_norm, D, rngs=0)


def test_bad_inputs(ens8):
    ens8.in_axes = 0
    with pytest.raises(ValueError, match="leading member axis of size n=8"):
        ens8(jnp.ones((4, 3)))
    ens8.in_axes = (None, 0)
    with pytest.raises(ValueError, match="one axis"):
        ens8(jnp.ones((4, 3)))
    with pytest.raises(IndexError, match=r"\[0, 8\)"):
        ens8.member(8)
    with pytest.raises(TypeError, match="member index must be an int"):
        ens8.member(1.0)
    with pytest.raises(TypeError, match="NNXEnsemble"):
        nnx_optimizer(nnx.Linear(3, 1, rngs=nnx.Rngs(0)), optax.sgd(0.1))


class _Scaled(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(5, D, rngs=rngs)

    def __call__(self, x, *, scale):
        return self.linear(x) * scale


def test_keyword_inputs_are_shared_whatever_in_axes():
    """A keyword array is shared by all members, as documented (and as in linen), also for an
    ensemble built with ``in_axes=0`` and an array whose leading axis happens to be n."""
    xs = jax.random.normal(jax.random.key(1), (D, 3, 5))
    scale = jnp.arange(1.0, D + 1.0)  # one factor per output feature: shape (n,), by chance
    for in_axes in (0, (0,)):
        ens = ensemble.build(_Scaled, D, in_axes=in_axes, rngs=0)
        out = np.asarray(ens(xs, scale=scale))
        for i in range(D):
            want = np.asarray(ens.member(i)(xs[i], scale=scale))
            np.testing.assert_allclose(out[i], want, rtol=1e-6, atol=1e-6)


def test_per_member_data_marked_shared_is_refused(ens8):
    xs = ensemble.sharding.shard_members(jnp.ones((D, 4, 3)), ens8.mesh, D)
    with pytest.raises(ValueError, match=r"input 0 is shared .* in_axes=0"):
        ens8(xs)
    with pytest.raises(ValueError, match=r"keyword input 'x' is shared .* positional"):
        ens8(x=xs)
    step = ens8.train_step(lambda m, x: jnp.mean(m(x) ** 2), optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"batch argument 0 is shared .* per_member_batch=True"):
        step(ens8, step.init(), xs)
    ens8.in_axes = 0
    assert ens8(xs).shape[0] == D


def test_one_member_per_device_steps_like_the_plain_model():
    """As for linen (tests/test_train.py): with one member per device the gradient is not
    vmapped over an axis of 1, so the compiled step moves no more data (copies, transposes)
    than the plain model's own donated step."""

    class Wide(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.a = nnx.Linear(8, 256, rngs=rngs)
            self.b = nnx.Linear(256, 256, rngs=rngs)
            self.c = nnx.Linear(256, 3, rngs=rngs)

        def __call__(self, x):
            return self.c(nnx.relu(self.b(nnx.relu(self.a(x)))))

    from test_train import _layout_moves as moves

    x, y = jnp.ones((16, 8)), jnp.ones((16, 3))
    tx = optax.adam(1e-3)
    graphdef, plain = nnx.split(Wide(nnx.Rngs(0)), nnx.Param)

    def plain_step(p, s, x, y):
        grads = jax.grad(lambda p: mse(nnx.merge(graphdef, p), x, y))(p)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    want = moves(
        jax.jit(plain_step, donate_argnums=(0, 1)).lower(plain, tx.init(plain), x, y).compile()
    )
    ens = build_nnx(Wide, D, rngs=0)
    step = nnx_train_step(mse)
    got = moves(step.lower(ens, nnx_optimizer(ens, tx), x, y).compile())
    assert got <= want, (got, want)


def test_a_scans_dataset_passed_once_is_not_split_as_a_batch():
    """A member on 2 'data' devices: the dataset the steps index into (stacked=False) is no
    batch of rows; it was constrained onto 'data', with a warning that 1001 rows do not split."""
    import warnings

    ens = build_nnx(linear, D // 2, rngs=0)
    step = ens.train_step(
        lambda m, i, data: jnp.mean(m(data[i]) ** 2),
        optax.sgd(0.1),
        per_member_batch=(True, False),
        donate=False,
    )  # clones share arrays
    opt = step.init()
    idx = jax.random.randint(jax.random.key(0), (3, D // 2, 4), 0, 1001)
    data = jax.random.normal(jax.random.key(1), (1001, 3))
    want_ens, want_opt = nnx.clone(ens), nnx.clone(opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        losses = step.scan(ens, opt, idx, data, stacked=(True, False))
    want = [step(want_ens, want_opt, idx[k], data) for k in range(3)]
    np.testing.assert_allclose(losses, np.stack(want, axis=1), rtol=1e-5, atol=1e-7)


def test_wrt_filters_see_a_members_own_paths_as_on_the_plain_model():
    """A filter on path positions, written for the plain model (``path[0] == 'head'``), selects
    the same Variables of each member; the optimizer used to read it on the ensemble's paths
    (``('members', 'head', ...)``), select nothing, and fail in vmap on an empty State."""

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.body = nnx.Linear(3, 4, rngs=rngs)
            self.head = nnx.Linear(4, 1, rngs=rngs)

        def __call__(self, x):
            return self.head(nnx.relu(self.body(x)))

    only_head = lambda path, v: isinstance(v, nnx.Param) and path[0] == "head"
    ens = build_nnx(Net, D, rngs=3)
    x, y = jnp.arange(12.0).reshape(4, 3) / 10, jnp.ones((4, 1))
    body = np.asarray(ens.members.body.kernel[...])
    member = ens.member(1)
    step = ens.train_step(mse, optax.sgd(0.1), wrt=only_head)
    step(ens, step.init(), x, y)
    np.testing.assert_array_equal(ens.members.body.kernel[...], body)  # not selected
    ref = nnx.Optimizer(member, optax.sgd(0.1), wrt=only_head)
    ref.update(member, nnx.grad(mse, argnums=nnx.DiffState(0, only_head))(member, x, y))
    got = ens.member(1).head.kernel[...]
    np.testing.assert_allclose(got, member.head.kernel[...], rtol=1e-5, atol=1e-7)
    assert not np.allclose(got, build_nnx(Net, D, rngs=3).member(1).head.kernel[...])
    again = ensemble.nnx_optimizer(ens, optax.adam(0.1), wrt=step.init().wrt)  # opt.wrt back
    assert jax.tree.structure(nnx.state(again, nnx.Param)) == jax.tree.structure(
        nnx.state(step.init(), nnx.Param)
    )
    on_ensemble_paths = lambda path, v: len(path) > 1 and path[1] == "head"
    with pytest.raises(ValueError, match=r"member's own paths, as on the plain model"):
        ensemble.nnx_optimizer(ens, optax.sgd(0.1), wrt=on_ensemble_paths)


def test_a_module_with_list_attributes_trains_like_the_plain_model():
    """nnx.Conv keeps ``strides=[1, 1]`` and ``padding=[(1, 1), (1, 1)]`` as lists, so the
    graphdef cannot be hashed: the step (jitted with the graphdefs static) refused it in a dump of
    the whole graphdef, while ``ens(x)`` and a plain ``nnx.jit`` step worked."""

    def conv(rngs):
        return nnx.Conv(2, 3, kernel_size=[3, 3], strides=[1, 1], padding=[(1, 1), (1, 1)],
                        rngs=rngs)  # fmt: skip

    n, tx = 4, optax.sgd(0.1)
    x = jax.random.normal(jax.random.key(1), (2, 5, 5, 2))
    loss = lambda m, x: jnp.mean(m(x) ** 2)
    ens = build_nnx(conv, n, rngs=0)
    plain = [ens.member(i) for i in range(n)]  # each member's initial state, as a plain module
    step = ens.train_step(loss, tx)
    opt = step.init()
    got = [step(ens, opt, x), step.scan(ens, opt, x[None])[:, 0]]
    assert step.lower(ens, opt, x) is not None
    for i, module in enumerate(plain):
        module = jax.device_put(module, jax.devices()[0])
        graphdef, params = nnx.split(module, nnx.Param)
        state = tx.init(params)
        for k in range(2):
            member_loss = lambda p, g=graphdef: loss(nnx.merge(g, p), x)
            value, grads = jax.value_and_grad(member_loss)(params)
            updates, state = tx.update(grads, state, params)
            params = optax.apply_updates(params, updates)
            np.testing.assert_allclose(got[k][i], value, rtol=1e-5)


def test_building_under_a_trace_is_one_value_error_with_the_restore_route(tmp_path):
    """``nnx.eval_shape(lambda: ensemble.build(...))``, Flax's usual restore target, failed in
    JAX's words ("`set_mesh` can only be used outside of `jax.jit`"); the route it names works."""
    factory = lambda rngs: nnx.Linear(3, 2, rngs=rngs)
    refusal = r"^ensemble: partitioning\(...\), and making an NNX ensemble or its optimizer .*"
    with pytest.raises(ValueError, match=refusal + r"cannot run inside a traced function .* nnx"):
        nnx.eval_shape(lambda: build_nnx(factory, D))
    step = build_nnx(factory, D).train_step(lambda m, x: jnp.mean(m(x) ** 2), optax.sgd(0.1))
    with pytest.raises(ValueError, match=refusal + r"step.init\(\)"):  # an optimizer's target
        nnx.eval_shape(step.init)
    saved = build_nnx(factory, D, rngs=1)
    path = ensemble.distributed.save_checkpoint(tmp_path / "c", nnx.state(saved))
    ens = build_nnx(factory, D, rngs=2)
    nnx.update(ens, ensemble.distributed.restore_checkpoint(path, nnx.state(ens)))
    np.testing.assert_array_equal(ens.members.kernel[...], saved.members.kernel[...])
    assert ens.members.kernel[...].sharding == saved.members.kernel[...].sharding


def test_scan_refuses_an_rngs_argument_first():
    """scan checked the stacked axis first, so an nnx.Rngs got advice to mark it
    stacked=False, and only then the refusal that says what to pass instead."""
    ens = build_nnx(linear, D, rngs=0)
    step = ens.train_step(lambda m, rngs, x: jnp.mean(m(x) ** 2), optax.sgd(0.1))
    fix = r"^step.scan takes no nnx.Rngs .* jax.random.split\(key, \(K, n\)\)"
    for stacked in (True, (False, True)):
        with pytest.raises(TypeError, match=fix):
            step.scan(ens, step.init(), nnx.Rngs(0), jnp.ones((2, 4, 3)), stacked=stacked)


def test_an_annotation_naming_a_mesh_axis_splits_as_plain_flax_nnx_does():
    """Flax NNX reads a name no rule maps as a mesh axis (its docs' ``(None, 'model')``): the
    ensemble mapped it through the rules alone, to None, so with model_parallel=4 every device of
    a member held the whole kernel (only a warning about an unmapped 'logical axis')."""
    init = nnx.initializers.lecun_normal()

    def factory(rngs):
        return nnx.Linear(12, 64, kernel_init=nnx.with_partitioning(init, (None, "model")),
                          rngs=rngs)  # fmt: skip

    mesh = jax.make_mesh((4,), ("model",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:4])  # fmt: skip
    with jax.set_mesh(mesh):
        assert factory(nnx.Rngs(0)).kernel[...].sharding.spec == P(None, "model")  # plain NNX
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing unmapped to warn about
        ens = build_nnx(factory, 2, model_parallel=4, rngs=0)
    kernel = ens.members.kernel[...]
    assert kernel.sharding.spec == P("ensemble", None, "model")
    assert {s.data.shape for s in kernel.addressable_shards} == {(1, 12, 16)}
    x = jnp.ones((3, 12))
    for i in range(2):  # the numbers are the plain member's
        np.testing.assert_allclose(ens(x)[i], ens.member(i)(x), rtol=1e-6)
    member = ens.member(1)  # on its own 4 devices still
    holders = {s.device for s in kernel.addressable_shards if s.index[0] == slice(1, 2, None)}
    assert member.kernel[...].sharding.device_set == holders and len(holders) == 4
    assert member.kernel[...].sharding.spec == P(None, "model")


def test_the_step_keeps_the_state_where_it_is_and_compiles_once():
    """With members split over 'model', the step's outputs were placed by the compiler's choice
    (a bias split over 'model' like the kernel before it, an optimizer moment too), so the state
    moved on every call, and each call met new input shardings and compiled the step again."""
    mesh = jax.make_mesh((4, 1, 2), ("ensemble", "data", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)  # fmt: skip

    def make(rngs):
        split = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
        return nnx.Sequential(nnx.Linear(4, 8, kernel_init=split, rngs=rngs),
                              nnx.Linear(8, 1, rngs=rngs))  # fmt: skip

    ens = build_nnx(make, 4, mesh=mesh)
    step = ens.train_step(lambda m, x: jnp.mean(m(x) ** 2), optax.adam(1e-3))
    opt = step.init()
    placed = lambda: [a.sharding for a in jax.tree.leaves((nnx.state(ens), nnx.state(opt)))]
    before, x = placed(), jnp.ones((16, 4))
    step(ens, opt, x)
    step.scan(ens, opt, x[None])
    with count_compiles() as compiles:
        for _ in range(3):
            step(ens, opt, x)
            step.scan(ens, opt, x[None])
    assert placed() == before
    assert compiles == []
    # State put back from the host (weights from an .npz) or replicated: the step puts it
    # where the ensemble places it, the kernel's 'model' split included (the member axis
    # alone kept the kernel whole on both of a member's devices from then on).
    host = lambda tree: jax.tree.map(np.asarray, tree)
    replicated = lambda tree: jax.device_put(tree, NamedSharding(ens.mesh, P()))
    for put_back in (host, replicated):
        nnx.update(ens, put_back(nnx.state(ens)))
        nnx.update(opt, put_back(nnx.state(opt)))
        step(ens, opt, x)
        assert [s.spec for s in placed()] == [s.spec for s in before]


def test_one_step_serves_two_ensembles_on_other_devices_with_host_state():
    """The step kept where the state goes by shapes and shardings; host arrays have none, so
    a second ensemble on other devices got the first one's placement (JAX refused the call:
    "incompatible devices")."""
    devices = jax.devices()
    loss = lambda m, x: jnp.mean(m(x) ** 2)
    step = nnx_train_step(loss)
    x = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
    host = lambda tree: jax.tree.map(np.asarray, tree)
    for rngs, on in ((0, devices[:4]), (1, devices[4:])):
        ens = ensemble.build(lambda rngs: nnx.Linear(3, 2, rngs=rngs), 4, rngs=rngs, devices=on)
        opt = nnx_optimizer(ens, optax.sgd(0.1))
        plain = nnx.clone(ens.member(0))
        nnx.update(ens, host(nnx.state(ens)))
        nnx.update(opt, host(nnx.state(opt)))
        losses = step(ens, opt, x)
        got = {d for a in jax.tree.leaves(nnx.state(ens)) for d in a.sharding.device_set}
        assert got == set(on)
        want, grads = nnx.value_and_grad(loss)(plain, x)
        nnx.Optimizer(plain, optax.sgd(0.1), wrt=nnx.Param).update(plain, grads)
        np.testing.assert_allclose(float(losses[0]), float(want), rtol=1e-6)
        np.testing.assert_allclose(ens.member(0).kernel[...], plain.kernel[...], rtol=1e-6)


def test_a_call_writes_back_only_what_it_changed_where_it_was():
    """Through nnx.jit every Variable came back from an eager call: each call copied all the
    parameters, and the compiler placed the copies (a bias kept whole on a member's devices
    came back split over 'model'; train-mode statistics moved too, and the next call compiled
    again)."""
    mesh = jax.make_mesh((4, 1, 2), ("ensemble", "data", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)  # fmt: skip
    split = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(4, 8, kernel_init=split, rngs=rngs)
            self.bn = nnx.BatchNorm(8, rngs=rngs)
            self.l2 = nnx.Linear(8, 2, rngs=rngs)

        def __call__(self, x):
            return self.l2(nnx.remat(lambda m, h: m(h))(self.bn, self.l1(x)))

    ens = build_nnx(Net, 4, mesh=mesh)
    x = jnp.linspace(-1.0, 1.0, 24).reshape(6, 4)
    leaves = lambda kind: jax.tree.leaves(nnx.state(ens, kind))
    params, specs = leaves(nnx.Param), [a.sharding for a in jax.tree.leaves(nnx.state(ens))]
    plain = [nnx.clone(ens.member(i)) for i in range(4)]
    for call in range(3):
        with count_compiles() as compiles:
            out = ens(x)
        assert call == 0 or compiles == []
        for i, m in enumerate(plain):  # train mode: statistics updated, as in the plain model
            np.testing.assert_allclose(out[i], m(x), rtol=1e-5, atol=1e-6)
        now = jax.tree.leaves(nnx.state(ens))
        moved = [
            i
            for i, (s, a) in enumerate(zip(specs, now))
            if not s.is_equivalent_to(a.sharding, a.ndim)
        ]
        assert moved == []
    assert all(a is b for a, b in zip(leaves(nnx.Param)[2:], params[2:]))  # l1, l2: not copied
    np.testing.assert_allclose(ens.member(1).bn.mean[...], plain[1].bn.mean[...], rtol=1e-5)


def test_ensembles_whose_attributes_are_equal_but_not_alike_get_their_own_programs():
    """Programs were kept by graphdef, whose == says 1, 1.0 and True (and 0.0, -0.0) are the
    same: an ensemble got the output dtype (or sign) of one built before it."""

    class Fill(nnx.Module):
        def __init__(self, fill, rngs):
            self.fill = fill
            self.l = nnx.Linear(3, 2, rngs=rngs)

        def __call__(self, x):
            return jnp.full((2,), self.fill), self.l(x) / self.fill

    x = jnp.ones((1, 3))
    for fill in (1, 1.0, True, 0.0, -0.0):
        ens = ensemble.build(functools.partial(Fill, fill), 2)
        full, y = ens(x)
        want_full, want_y = ens.member(0)(x)
        assert full.dtype == want_full.dtype, fill
        np.testing.assert_array_equal(y[0], want_y)  # -0.0: the other infinity's sign


def test_an_attribute_changed_to_one_that_prints_the_same_gets_its_own_program():
    """``bfloat16(1) == 1`` and both print as ``1``: after the attribute was changed, the
    ensemble's call and its train step ran the program traced with the old one (the old
    rounding of ``scale / 3``), silently."""
    import ml_dtypes

    class Scaled(nnx.Module):
        def __init__(self, rngs):
            self.scale = 1
            self.l = nnx.Linear(3, 1, rngs=rngs)

        def __call__(self, x):
            return self.l(x) * (self.scale / 3)

    def loss_fn(m, x):
        return jnp.mean(m(x) ** 2)

    x = jnp.linspace(0.5, 1.5, 24).reshape(8, 3)
    ens = ensemble.build(Scaled, 2)
    step = ens.train_step(loss_fn, optax.sgd(0.0))  # parameters stay: losses comparable
    opt = step.init()
    for scale in (1, ml_dtypes.bfloat16(1), 1.0, np.float16(1), 1):
        ens.members.scale = scale
        plain = [ens.member(i) for i in range(2)]
        for m in plain:
            m.scale = scale
        want = np.stack([m(x) for m in plain])
        # (bfloat16's scale / 3 differs from float32's by 4e-3 relative)
        np.testing.assert_allclose(ens(x), want, rtol=1e-6, err_msg=repr(type(scale)))
        want_loss = np.float32([loss_fn(m, x) for m in plain])
        got = step(ens, opt, x)
        np.testing.assert_allclose(got, want_loss, rtol=1e-6, err_msg=repr(type(scale)))


def test_state_moved_off_the_ensembles_devices_is_one_line_with_its_fix():
    """State committed to one device (a device_put of nnx.state, as one does for a single
    model) was JAX's "incompatible devices" error naming a leaf of an internal function."""
    from ensemble.sharding import shard_members

    ens = ensemble.build(lambda rngs: nnx.Linear(3, 2, rngs=rngs), 4)
    x = jnp.ones((2, 3))
    want = ens(x)
    step = ens.train_step(lambda m, x: jnp.mean(m(x) ** 2), optax.sgd(0.0))
    opt = step.init()
    nnx.update(ens, jax.device_put(nnx.state(ens), jax.devices()[0]))
    said = r"nnx.state\(ens\)\['members'\]\['bias'\].value is committed to device\(s\) 0, but"
    with pytest.raises(ValueError, match=said + r".* \(ensemble.sharding.shard_members\(x, "):
        ens(x)
    with pytest.raises(ValueError, match=said):
        step(ens, opt, x)
    nnx.update(ens, shard_members(nnx.state(ens), ens.mesh, ens.n))  # the fix it names
    np.testing.assert_array_equal(ens(x), want)
    nnx.update(opt, jax.device_put(nnx.state(opt), jax.devices()[1]))
    said = r"nnx.state\(optimizer\)\['step'\].value is committed to device\(s\) 1, .* "
    with pytest.raises(ValueError, match=said + r"\(jax.device_put\(x, jax.sharding.NamedSharding"):
        step(ens, opt, x)


def test_a_call_that_changes_a_variables_shape_writes_it_back():
    """Pinned where the old value was, a cache set to a scalar was a with_sharding_constraint
    error of JAX's (ens.map and the plain module take it)."""

    class Last(nnx.Module):
        def __init__(self, rngs):
            self.l = nnx.Linear(3, 2, rngs=rngs)
            self.last = nnx.Cache(jnp.zeros((3, 2)))

        def __call__(self, x):
            y = self.l(x)
            self.last.set_value(y.mean())
            return y

    ens = ensemble.build(Last, 4)
    x = jnp.linspace(0.0, 1.0, 6).reshape(2, 3)
    y = ens(x)
    assert ens.members.last.get_value().shape == (4,)
    np.testing.assert_allclose(ens.members.last.get_value(), y.mean(axis=(1, 2)), rtol=1e-6)


class _Backbone(nnx.Module):
    def __init__(self, rngs):
        self.backbone = nnx.Linear(3, 4, rngs=rngs)
        self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.head(jax.nn.relu(self.backbone(x)))


def _by_path(path, _):
    return "frozen" if path[0] == "backbone" else "train"


def _plain_tree_labels():  # a label tree made on the plain model, as its optimizer takes it
    plain = _Backbone(nnx.Rngs(0))
    return nnx.map_state(_by_path, nnx.state(plain, nnx.Param))


_FREEZING = [
    lambda: optax.multi_transform(
        {"frozen": optax.set_to_zero(), "train": optax.adam(1e-2)},
        lambda params: nnx.map_state(_by_path, params),
    ),
    lambda: optax.multi_transform(
        {"frozen": optax.set_to_zero(), "train": optax.adam(1e-2)}, _plain_tree_labels()
    ),
]


@pytest.mark.parametrize(
    "make_tx",
    [
        *_FREEZING,
        lambda: optax.masked(
            optax.sgd(0.1), lambda p: nnx.map_state(lambda path, _: path[0] == "head", p)
        ),
        lambda: optax.adamw(
            1e-2, weight_decay=0.5, mask=lambda p: nnx.map_state(lambda q, _: q[-1] == "kernel", p)
        ),
    ],
    ids=["multi_transform-fn", "multi_transform-tree", "masked", "adamw-mask"],
)
def test_optax_label_and_mask_functions_see_a_members_own_paths(make_tx):
    """A label function written for the plain model (``path[0] == 'backbone'``) saw the
    ensemble's ``('members', 'backbone', ...)``: every parameter went to the other transform,
    and the frozen backbone trained, silently (a label tree made on the plain model failed in
    optax). Each member now equals the plain model under a plain ``nnx.Optimizer``."""
    n = 4
    ens = ensemble.build(_Backbone, n, rngs=1)
    x = jax.random.normal(jax.random.key(2), (6, 3))
    loss = lambda m, x: jnp.mean((m(x) - 1.0) ** 2)
    plains = [ens.member(i) for i in range(n)]
    step = ens.train_step(loss, make_tx())
    opt = step.init()
    for _ in range(3):
        step(ens, opt, x)
    for i, plain in enumerate(plains):
        plain_opt = nnx.Optimizer(plain, make_tx(), wrt=nnx.Param)
        for _ in range(3):
            plain_opt.update(plain, nnx.grad(loss)(plain, x))
        want, got = nnx.state(plain, nnx.Param), nnx.state(ens.member(i), nnx.Param)
        for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    if make_tx in _FREEZING:  # and the frozen backbone did not move at all
        before = nnx.state(ensemble.build(_Backbone, n, rngs=1).members.backbone)
        assert jax.tree.all(jax.tree.map(np.array_equal, before, nnx.state(ens.members.backbone)))


def test_a_cache_made_after_build_is_named_with_the_fix_not_blamed_on_the_input():
    """``ens.members.init_cache(...)`` after build (as on a plain decode model) makes Variables
    without the member axis: the call said "per-member input 0[0] has shape ()", a fix of the
    user's input, which was fine. It names the Variable and says to make the cache in the
    factory, for a call and for a train step."""
    make = lambda rngs: nnx.MultiHeadAttention(
        num_heads=2, in_features=8, qkv_features=8, decode=True, rngs=rngs
    )
    ens = ensemble.build(make, 4)
    step = ens.train_step(lambda m, x: jnp.mean(m(x) ** 2), optax.sgd(0.1))
    opt = step.init()
    ens.members.init_cache((2, 5, 8))
    fix = r"\['cache_index'\].* has shape \(\); .* make it in the factory \(e.g. call init_cache"
    with pytest.raises(ValueError, match=fix):
        ens(jnp.ones((2, 1, 8)))
    with pytest.raises(ValueError, match=fix):
        step(ens, opt, jnp.ones((2, 1, 8)))
