"""LinenEnsemble and build(): placement read off addressable shards, numbers vs the plain model."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import ensemble
import ensemble._nnx
from ensemble._mesh import MEMBER_AXIS

D = 8
RULES = [("hidden", "model"), ("features", None)]


class MLP(nn.Module):
    """Annotated kernel, unannotated biases (a reported bug: those stayed replicated)."""

    hidden: int = 16
    out: int = 3

    @nn.compact
    def __call__(self, x):
        init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("features", "hidden"))
        h = nn.relu(nn.Dense(self.hidden, kernel_init=init)(x))
        h = nn.with_logical_constraint(h, ("batch", "hidden"))
        return nn.Dense(self.out)(h)


class DropBN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.Dense(8)(x)
        h = nn.Dropout(0.5, deterministic=not train)(h)
        h = nn.BatchNorm(use_running_average=not train, momentum=0.5)(h)
        return nn.Dense(2)(h)


def members_on(mesh, device, n):
    """Members the mesh puts on ``device``: its position on the ensemble axis, n/E each."""
    pos = np.argwhere(mesh.devices == device)[0]
    per = n // mesh.shape[MEMBER_AXIS]
    return range(pos[0] * per, (pos[0] + 1) * per)


def assert_placed(tree, mesh, n):
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        assert leaf.shape[0] == n, jax.tree_util.keystr(path)
        assert len(leaf.addressable_shards) == mesh.devices.size
        for shard in leaf.addressable_shards:
            got = range(*shard.index[0].indices(n))
            assert got == members_on(mesh, shard.device, n), (
                f"{jax.tree_util.keystr(path)} on {shard.device}: members {got}"
            )


@pytest.mark.parametrize("n", [D, 2 * D, D // 2])
def test_every_leaf_placed_and_member_equals_plain_model(n):
    ens = ensemble.build(MLP(), n, rules=RULES)
    x = jax.random.normal(jax.random.key(1), (4, 5))
    variables = ens.init(jax.random.key(0), x)
    assert set(variables) == {"params"}
    assert not any(isinstance(v, nn.Partitioned) for v in jax.tree_util.tree_leaves(variables))
    assert_placed(variables, ens.mesh, n)  # unannotated biases included
    y = ens.apply(variables, x)
    assert y.shape == (n, 4, 3)
    assert_placed(y, ens.mesh, n)
    plain_apply = jax.jit(MLP().apply)
    for i in (0, n // 2 + 1, n - 1):
        ref = plain_apply(ens.member(variables, i), x)
        np.testing.assert_allclose(y[i], ref, rtol=1e-5, atol=1e-6)
    # Member i's init is the plain init with split(key, n)[i].
    plain = nn.unbox(MLP().init(jax.random.split(jax.random.key(0), n)[3], x))
    for a, b in zip(jax.tree_util.tree_leaves(plain), jax.tree_util.tree_leaves(variables)):
        np.testing.assert_array_equal(a, b[3])


def test_shared_rngs_takes_stream_names_and_warns_of_a_misspelled_one():
    x = jnp.ones((6, 4))
    with pytest.raises(TypeError, match=r"shared_rngs= takes the names .* got True"):
        ensemble.build(DropBN(), D, shared_rngs=True)
    ens = ensemble.build(DropBN(), D, shared_rngs=("dropuot", "params"))  # misspelled
    variables = ens.init(jax.random.key(0), x)
    rngs = {"dropout": jax.random.key(1)}
    with pytest.warns(
        UserWarning, match=r"shared_rngs names 'dropuot', and this call's rngs have 'dropout'"
    ) as seen:
        y = ens.apply(variables, x, train=True, rngs=rngs, mutable=["batch_stats"])[0]
    assert seen[0].filename == __file__  # points at the user's line
    assert not np.allclose(y[0], y[1])  # the stream it meant stays split, as the warning says
    with pytest.warns(UserWarning, match=r"'dropuot', and this call's rngs have 'dropout'") as seen:
        ensemble.build(DropBN(), D, shared_rngs=("dropuot",)).init(
            {"params": jax.random.key(0), "dropout": jax.random.key(1)}, x
        )
    assert seen[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # right names, used by some calls only: no warning
        for shared in (("dropout", "params"), ("dropout", "noise")):
            ens = ensemble.build(DropBN(), D, shared_rngs=shared)
            y = ens.apply(variables, x, train=True, rngs=rngs, mutable=["batch_stats"])[0]
            np.testing.assert_allclose(y[0], y[1], rtol=1e-6)
            ens.apply(variables, x)


def test_dropout_and_batchnorm_per_member():
    n = D
    # Same params for every member (params stream shared), so outputs differ only by dropout.
    ens = ensemble.build(DropBN(), n, shared_rngs=("params",))
    x = jax.random.normal(jax.random.key(1), (6, 4))
    variables = ens.init(jax.random.key(0), x)
    assert set(variables) == {"params", "batch_stats"}
    assert_placed(variables, ens.mesh, n)
    np.testing.assert_array_equal(
        variables["params"]["Dense_0"]["kernel"][0], variables["params"]["Dense_0"]["kernel"][1]
    )

    eval_y = ens.apply(variables, x)
    np.testing.assert_allclose(eval_y[0], eval_y[5], rtol=1e-6)

    key = jax.random.key(7)
    y, updates = ens.apply(variables, x, train=True, rngs={"dropout": key}, mutable=["batch_stats"])
    assert y.shape == (n, 6, 2)
    assert not np.allclose(y[0], y[1]), "dropout masks must differ per member"
    assert_placed(updates, ens.mesh, n)
    mean = updates["batch_stats"]["BatchNorm_0"]["mean"]
    assert not np.allclose(mean, variables["batch_stats"]["BatchNorm_0"]["mean"])
    for i in (0, 5):
        ref, ref_upd = DropBN().apply(
            ens.member(variables, i),
            x,
            train=True,
            rngs={"dropout": jax.random.split(key, n)[i]},
            mutable=["batch_stats"],
        )
        np.testing.assert_allclose(y[i], ref, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(
            mean[i], ref_upd["batch_stats"]["BatchNorm_0"]["mean"], rtol=1e-5, atol=1e-6
        )


def test_per_member_inputs_and_shape_errors():
    n = D
    ens = ensemble.build(MLP(), n, in_axes=0, rules=RULES)
    xs = jax.random.normal(jax.random.key(1), (n, 3, 5))
    variables = ens.init(jax.random.key(0), xs)
    y = ens.apply(variables, xs)
    for i in (0, 7):
        np.testing.assert_allclose(
            y[i], MLP().apply(ens.member(variables, i), xs[i]), rtol=1e-5, atol=1e-6
        )
    with pytest.raises(
        ValueError, match=r"input 0 \(per-member\) has shape \(4, 3, 5\); it needs a leading"
    ):
        ens.apply(variables, xs[:4])
    with pytest.raises(ValueError, match="leading member axis of size n=8"):
        ens.apply(ens.member(variables, 0), xs)
    with pytest.raises(TypeError, match="rngs= must be a dict"):
        ens.apply(variables, xs, rngs=jax.random.key(0))
    with pytest.raises(IndexError, match="out of range"):
        ens.member(variables, n)
    for not_an_index in (1.0, True):  # a bool is an int to Python, not a member to anyone
        with pytest.raises(TypeError, match="member index must be an int"):
            ens.member(variables, not_an_index)
    with pytest.raises(ValueError, match="in_axes must be None"):
        ensemble.build(MLP(), n, in_axes=1)
    # Its train step takes per-member batches too: member i's loss is on slice i of host data
    # (no layout to check), not on all n slices broadcast through the loss.
    ys = np.random.default_rng(0).normal(size=(n, 3, 1))
    loss = lambda p, x, y: jnp.mean((MLP().apply({"params": p}, x) - y) ** 2)
    step = ens.train_step(loss, optax.sgd(0.1))
    params = variables["params"]
    want = [loss(ens.member(variables, i)["params"], xs[i], ys[i]) for i in (0, 7)]
    _, _, losses = step(params, step.init(params), np.asarray(xs), ys)
    np.testing.assert_allclose(np.asarray(losses)[[0, 7]], want, rtol=1e-5)
    with pytest.raises(ValueError, match=r"in_axes=\(0, None\) .* pass per_member_batch="):
        ensemble.build(MLP(), n, in_axes=(0, None)).train_step(loss, optax.sgd(0.1))


def test_model_parallel_rules_split_member_weights():
    n = D // 4  # each member spans 4 devices: data 2 x model 2
    ens = ensemble.build(MLP(hidden=16), n, model_parallel=2, rules=RULES)
    assert dict(ens.mesh.shape) == {"ensemble": 2, "data": 2, "model": 2}
    x = jax.random.normal(jax.random.key(1), (4, 5))
    variables = ens.init(jax.random.key(0), x)
    kernel = variables["params"]["Dense_0"]["kernel"]
    assert {s.data.shape for s in kernel.addressable_shards} == {(1, 5, 8)}
    bias = variables["params"]["Dense_1"]["bias"]  # unannotated: member axis only
    assert {s.data.shape for s in bias.addressable_shards} == {(1, 3)}
    y = ens.apply(variables, x)
    for i in range(n):
        np.testing.assert_allclose(
            y[i], MLP().apply(ens.member(variables, i), x), rtol=1e-5, atol=1e-6
        )


class MeshAnnotated(nn.Module):
    """``nn.with_partitioning`` names mesh axes directly (no logical rules)."""

    @nn.compact
    def __call__(self, x):
        init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
        return nn.Dense(4, kernel_init=init)(x)


def test_mesh_axis_annotations_are_kept():
    ens = ensemble.build(MeshAnnotated(), D // 2, model_parallel=2)
    x = jnp.ones((2, 3))
    variables = ens.init(jax.random.key(0), x)
    kernel = variables["params"]["Dense_0"]["kernel"]
    assert kernel.sharding.spec == P(MEMBER_AXIS, None, "model")
    assert {s.data.shape for s in kernel.addressable_shards} == {(1, 3, 2)}
    assert_placed(variables, ens.mesh, D // 2)


class Hidden(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4)(x)
        return nn.with_logical_constraint(h, ("batch", None))


def test_logical_constraint_inside_member_is_not_a_no_op():
    # n = D/2: a member spans 2 devices on 'data'; the model's 'batch' constraint must split the
    # batch there even with the default input hint turned off.
    ens = ensemble.build(Hidden(), D // 2, data_parallel=False)
    x = jnp.ones((6, 3))
    variables = ens.init(jax.random.key(0), x)
    y = ens.apply(variables, x)
    assert y.sharding.spec[:2] == (MEMBER_AXIS, "data")
    assert {s.data.shape for s in y.addressable_shards} == {(1, 3, 4)}
    # Also when the user wraps apply in their own jit (jax.set_mesh is refused inside a trace).
    y = jax.jit(ens.apply)(variables, x)
    assert {s.data.shape for s in y.addressable_shards} == {(1, 3, 4)}


def test_a_batch_that_does_not_split_over_a_members_data_devices_warns():
    """Such a batch is computed whole on each of the member's devices: the numbers are right,
    the data parallelism silently gone (8x the work per device for a member on 8)."""
    ens = ensemble.build(MLP(), D // 2, rules=RULES)  # a member spans 2 'data' devices
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        variables = ens.init(jax.random.key(0), jnp.ones((4, 5)))
    x = jax.random.normal(jax.random.key(1), (3, 5))
    with pytest.warns(UserWarning, match=r"3 rows does not split evenly over the 2 'data'") as w:
        y = ens.apply(variables, x)
    assert w[0].filename == __file__
    np.testing.assert_allclose(y[1], MLP().apply(ens.member(variables, 1), x), rtol=1e-5)

    # Beside a member's own inputs that do split (legacy keys [2], statistics of 16 features),
    # the batch's rows that do not are still said.
    def loss(p, key, stats, x):
        return jnp.mean(MLP().apply(p, x) ** 2) + 0 * jax.random.uniform(key) + 0 * stats.sum()

    step = ens.train_step(loss, optax.sgd(0.1), per_member_batch=(True, True, False), donate=False)
    keys = jax.random.split(jax.random.PRNGKey(0), D // 2)
    with pytest.warns(UserWarning, match=r"3 rows does not split evenly over the 2 'data'"):
        step(variables, step.init(variables), keys, jnp.ones((D // 2, 16)), x)

    # ... and inputs that are no batch beside a batch that splits are no reason to warn: an L2
    # anchor (a copy of the params, kernels [5, ...]), a dataset a scan's steps index into.
    def anchored(p, anchor, x):
        far = sum(jnp.sum((a - b) ** 2) for a, b in zip(*map(jax.tree.leaves, (p, anchor))))
        return jnp.mean(MLP().apply(p, x) ** 2) + 0.1 * far

    step = ens.train_step(anchored, optax.sgd(0.1), per_member_batch=(True, False), donate=False)
    indexed = lambda p, i, data: jnp.mean(MLP().apply(p, data[i]) ** 2)
    scan = ens.train_step(indexed, optax.sgd(0.1), per_member_batch=(True, False), donate=False)
    anchor = jax.tree.map(jnp.copy, variables)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(variables, step.init(variables), anchor, jnp.ones((4, 5)))
        idx = jnp.zeros((3, D // 2, 4), jnp.int32)  # 3 steps of 4 rows per member
        scan.scan(variables, scan.init(variables), idx, jnp.ones((1001, 5)), stacked=(True, False))
        # A member's own state passed alone (SpectralNorm's [1, 5] u): one row cannot split.
        u_loss = lambda p, u: loss(p, keys[0], u, x)
        alone = ens.train_step(u_loss, optax.sgd(0.1), per_member_batch=True, donate=False)
        alone(variables, alone.init(variables), jnp.ones((D // 2, 1, 5)))


def test_init_holds_only_a_devices_share():
    x = jnp.ones((2, 64))
    model = MLP(hidden=512, out=64)
    ens = ensemble.build(model, D, rules=RULES)
    variables = ens.init(jax.random.key(0), x)
    total = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(variables))
    stats = ens.lower_init(jax.random.key(0), x).compile().memory_analysis()
    assert stats.output_size_in_bytes == pytest.approx(total / D, rel=0.02)
    # The whole init program (outputs + scratch such as random bits) shrinks with D: the same
    # ensemble initialised on one device needs D times as much per device.
    one = ensemble.build(model, D, rules=RULES, devices=jax.devices()[:1])
    stats_one = one.lower_init(jax.random.key(0), x).compile().memory_analysis()
    peak = stats.output_size_in_bytes + stats.temp_size_in_bytes
    peak_one = stats_one.output_size_in_bytes + stats_one.temp_size_in_bytes
    assert stats_one.output_size_in_bytes == pytest.approx(total, rel=0.02)
    assert peak <= 1.05 * peak_one / D
    shardings = ens.init_shardings(jax.random.key(0), x)
    assert jax.tree_util.tree_leaves(shardings)[0].spec[0] == MEMBER_AXIS
    # Shape structs instead of arrays (a model too big to make its input): the same program.
    # They were taken for static Python values and handed to the model (a TypeError in Flax).
    spec = jax.ShapeDtypeStruct(x.shape, x.dtype)
    same = ens.lower_init(jax.random.key(0), spec).compile().memory_analysis()
    assert same.output_size_in_bytes == stats.output_size_in_bytes
    assert ens.init_shardings(jax.random.key(0), spec) == shardings


def test_apply_compiles_once_per_static_config():
    ens = ensemble.build(DropBN(), D)
    x = jnp.ones((2, 4))
    variables = ens.init(jax.random.key(0), x)
    for seed in range(3):
        ens.apply(
            variables,
            x + seed,
            train=True,
            rngs={"dropout": jax.random.key(seed)},
            mutable=["batch_stats"],
        )
    ens.apply(variables, x)
    apply_programs = [v for k, v in ens._cache.items() if k[0] == "apply"]
    assert len(apply_programs) == 2
    assert all(p._cache_size() == 1 for p in apply_programs)


class Scaled(nn.Module):
    @nn.compact
    def __call__(self, x, k=1):
        k = k[0] if isinstance(k, tuple) else k
        return nn.Dense(2)(x) * 0 + jnp.full((), k)  # k's Python type sets the dtype


def test_static_values_equal_in_python_but_of_other_types_compile_apart():
    """1, 1.0 and True are equal (and hash alike) in Python; each makes its own program."""
    ens = ensemble.build(Scaled(), D)
    x = jnp.ones((2, 4))
    variables = ens.init(0, x)
    for k in (True, 1, 1.0, (1,), (1.0,)):
        got = ens.apply(variables, x, k=k)
        want = Scaled().apply(ens.member(variables, 0), x, k=k)
        assert got.dtype == want.dtype, k
    nnx_ens = ensemble.build(lambda rngs: ScaledNNX(rngs), D, rngs=0)
    for k in (1.0, 1, True):
        assert nnx_ens(x, k).dtype == nnx_ens.member(0)(x, k).dtype, k
    # 0.0 and -0.0 are equal too, yet x / -0.0 is -inf: the second reused the first's program.
    divided = ensemble.build(Divided(), D)
    v = divided.init(0, x)
    for s in (0.0, -0.0):
        want = Divided().apply(divided.member(v, 0), x, s=s)
        np.testing.assert_array_equal(divided.apply(v, x, s=s)[0], want)


class Divided(nn.Module):
    @nn.compact
    def __call__(self, x, s=1.0):
        return nn.Dense(2)(x) / s


class ScaledNNX(nnx.Module):
    def __init__(self, rngs):
        self.l = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x, k=1):
        return self.l(x) * 0 + jnp.full((), k)


class Configured(nn.Module):
    """Python values where model.apply keeps them Python: positional, in a dict, beside arrays."""

    @nn.compact
    def __call__(self, x, train, mode, cfg):
        h = nn.BatchNorm(use_running_average=not train, momentum=0.5)(nn.Dense(3)(x))
        h = h * (2.0 if mode == "double" else 1.0) * cfg["scale"]
        return h + 1.0 if cfg["shift"] else h


def test_python_values_stay_python_values_positional_keyword_and_nested():
    """``train`` (``if train:``), a mode string and a dict mixing a Python bool with an array
    reach the module as model.apply gives them; each member equals the plain model."""
    model, x = Configured(), jnp.arange(12.0).reshape(4, 3)
    cfg = {"scale": jnp.float32(0.5), "shift": True}
    ens = ensemble.build(model, D)
    variables = ens.init(jax.random.key(0), x, False, "double", cfg=cfg)
    out, updates = ens.apply(variables, x, True, "double", cfg=cfg, mutable=["batch_stats"])
    nnx_ens = ensemble.build(lambda rngs: ConfiguredNNX(rngs), D, rngs=0)
    nnx_out = nnx_ens(x, True, "double", cfg=cfg)
    for i in range(D):
        ref, ref_updates = model.apply(
            ens.member(variables, i), x, True, "double", cfg=cfg, mutable=["batch_stats"]
        )
        np.testing.assert_allclose(out[i], ref, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(
            updates["batch_stats"]["BatchNorm_0"]["mean"][i],
            ref_updates["batch_stats"]["BatchNorm_0"]["mean"],
            rtol=1e-6,
        )
        nnx_ref = nnx_ens.member(i)(x, True, "double", cfg=cfg)
        np.testing.assert_allclose(nnx_out[i], nnx_ref, rtol=1e-6)
    plain = ens.apply(variables, x, False, "single", cfg={"scale": 1.0, "shift": False})
    np.testing.assert_allclose(plain[0], model.apply(
        ens.member(variables, 0), x, False, "single", cfg={"scale": 1.0, "shift": False}
    ), rtol=1e-6)  # fmt: skip
    with pytest.raises(TypeError, match=r"input 2\['mode'\] = \{1\} is neither an array"):
        ens.apply(variables, x, False, {"mode": {1}}, cfg=cfg)
    with pytest.raises(TypeError, match=r"keyword input \['cfg'\]\['shift'\] = \{1\} is"):
        ens.apply(variables, x, True, "double", cfg={"scale": 1.0, "shift": {1}})


class ConfiguredNNX(nnx.Module):
    def __init__(self, rngs):
        self.l = nnx.Linear(3, 3, rngs=rngs)

    def __call__(self, x, train, mode, cfg):
        h = self.l(x) * (2.0 if mode == "double" else 1.0) * cfg["scale"]
        return h + 1.0 if cfg["shift"] and train else h


@pytest.mark.parametrize(
    "rng",
    [jax.random.key(0), jax.random.PRNGKey(0), 0, {"params": jax.random.key(0), "dropout": 1}],
)
def test_rng_forms(rng):
    ens = ensemble.build(nn.Dense(2), D)
    v = ens.init(rng, jnp.ones((1, 3)))
    ref = ens.init(jax.random.key(0), jnp.ones((1, 3)))
    np.testing.assert_array_equal(v["params"]["kernel"], ref["params"]["kernel"])


def test_a_legacy_key_of_the_rbg_generator_is_a_key():
    """Under ``jax_default_prng_impl='rbg'`` a ``PRNGKey`` has 4 words, not threefry's 2: it
    was refused, the message naming the very key passed."""
    model = nn.Sequential([nn.Dense(3), nn.Dropout(0.5, deterministic=False)])
    x = jnp.ones((2, 3))
    with jax.default_prng_impl("rbg"):
        key = jax.random.PRNGKey(0)
        assert key.shape == (4,)
        ens = ensemble.build(model, D)
        v = ens.init(key, x)
        ref = ens.init(jax.random.key(0), x)
        np.testing.assert_array_equal(v["params"]["layers_0"]["kernel"],
                                      ref["params"]["layers_0"]["kernel"])  # fmt: skip
        out = ens.apply(v, x, rngs={"dropout": jax.random.PRNGKey(1)})
        want = ens.apply(v, x, rngs={"dropout": jax.random.key(1)})
        np.testing.assert_array_equal(out, want)


def test_user_mesh_on_a_subset_of_devices():
    mesh = ensemble.make_mesh(4, devices=jax.devices()[:2])
    ens = ensemble.build(nn.Dense(2), 4, mesh=mesh)
    v = ens.init(jax.random.key(0), jnp.ones((1, 3)))
    assert {s.device for s in v["params"]["kernel"].addressable_shards} == set(jax.devices()[:2])
    assert_placed(v, mesh, 4)
    with pytest.raises(ValueError, match="n=3 members cannot be split"):
        ensemble.build(nn.Dense(2), 3, mesh=mesh)


def test_build_errors():
    with pytest.raises(TypeError, match=r"instantiate it: ensemble.build\(Dense\(...\), n\)"):
        ensemble.build(nn.Dense, D)
    with pytest.raises(TypeError, match="pass a factory"):
        ensemble.build(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), D)
    with pytest.raises(TypeError, match=r"linen nn\.Module instance or an NNX factory"):
        ensemble.build(42, D)
    with pytest.raises(TypeError, match="neither a linen"):
        ensemble.build(dict, D)
    for bad in (0, -2):
        with pytest.raises(ValueError, match="positive integer"):
            ensemble.build(nn.Dense(2), bad)
    with pytest.raises(ValueError, match=r"n=3 members on D=8"):
        ensemble.build(nn.Dense(2), 3)


def test_build_dispatches_nnx_factories(monkeypatch):
    calls = []

    def fake_build_nnx(model, n, **kwargs):
        calls.append((model, n, kwargs))
        return "nnx-ensemble"

    monkeypatch.setattr(ensemble._nnx, "build_nnx", fake_build_nnx, raising=False)
    factory = lambda rngs: nnx.Linear(2, 3, rngs=rngs)
    assert ensemble.build(factory, D, in_axes=0, extra=1) == "nnx-ensemble"
    assert ensemble.build(nnx.Linear, D, in_features=2, out_features=3) == "nnx-ensemble"
    model, n, kwargs = calls[0]
    assert model is factory and n == D
    assert kwargs == dict(
        mesh=None, devices=None, model_parallel=1, rules=None, in_axes=0, axis_name=None, extra=1
    )


def test_variables_work_in_plain_jit_and_grad():
    ens = ensemble.build(MLP(), D, rules=RULES)
    x = jnp.ones((2, 5))
    variables = ens.init(jax.random.key(0), x)
    # No context needed by the user's own code (Auto mesh axes).
    doubled = jax.jit(lambda v: jax.tree_util.tree_map(lambda a: 2 * a, v))(variables)
    assert_placed(doubled, ens.mesh, D)
    grads = jax.grad(lambda p: ens.apply({"params": p}, x).sum())(variables["params"])
    assert_placed(grads, ens.mesh, D)


class TwoInputs(nn.Module):
    @nn.compact
    def __call__(self, x, bias):
        return nn.Dense(2)(x) + bias


def test_mixed_in_axes_per_argument():
    ens = ensemble.build(TwoInputs(), D, in_axes=(0, None))
    xs = jax.random.normal(jax.random.key(1), (D, 3, 4))
    bias = jnp.arange(2.0)
    variables = ens.init(jax.random.key(0), xs, bias)
    y = ens.apply(variables, xs, bias)
    np.testing.assert_allclose(
        y[4], TwoInputs().apply(ens.member(variables, 4), xs[4], bias), rtol=1e-5, atol=1e-6
    )
    with pytest.raises(ValueError, match=r"one axis \(None or 0\) per positional input"):
        ens.apply(variables, xs)
