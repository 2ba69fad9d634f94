import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import ensemble


@pytest.mark.parametrize(
    ("n", "d", "mp", "shape"),
    [(8, 8, 1, (8, 1, 1)), (16, 8, 1, (8, 1, 1)), (4, 8, 1, (4, 2, 1)), (2, 8, 2, (2, 2, 2))],
)
def test_layout(n, d, mp, shape):
    assert ensemble.layout(n, d, mp) == shape


@pytest.mark.parametrize("n", [0, -1, 2.0, True])
def test_layout_rejects_bad_n(n):
    with pytest.raises(ValueError, match="positive integer"):
        ensemble.layout(n, 8)


def test_layout_impossible_names_choices():
    with pytest.raises(ValueError, match=r"n=3 .* D=8 .*\[1, 2, 4, 8\]"):
        ensemble.layout(3, 8)


def test_make_mesh_uses_given_devices():
    mesh = ensemble.make_mesh(2, devices=jax.devices()[:2])
    assert mesh.shape == {"ensemble": 2, "data": 1, "model": 1}
    assert set(mesh.devices.flat) == set(jax.devices()[:2])
    flat = jax.sharding.Mesh(np.array(jax.devices()), ("ensemble",))  # no 'data', 'model'
    with pytest.raises(ValueError, match=r"lack \['data', 'model'\]: .* ensemble.make_mesh"):
        ensemble.build(__import__("flax.linen").linen.Dense(2), 8, mesh=flat)
    # jax.make_mesh's default Explicit axes: refused at build with the fix, not deep in init.
    explicit = jax.make_mesh((8, 1, 1), ("ensemble", "data", "model"))
    with pytest.raises(ValueError, match=r"'data': 'Explicit'.*axis_types=\(jax.sharding.Axis"):
        ensemble.build(__import__("flax.linen").linen.Dense(2), 8, mesh=explicit)
    auto = jax.make_mesh((8, 1, 1), ("ensemble", "data", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)  # fmt: skip
    ens = ensemble.build(__import__("flax.linen").linen.Dense(2), 8, mesh=auto)
    assert ens.apply(ens.init(jax.random.key(0), np.ones((2, 3))), np.ones((2, 3))).shape == (
        8, 2, 2,
    )  # fmt: skip


def test_shard_members_places_each_member_on_its_device():
    mesh = ensemble.make_mesh(8)
    x = ensemble.shard_members(np.arange(8 * 3.0).reshape(8, 3), mesh, 8)
    for shard in x.addressable_shards:
        i = shard.index[0].start
        assert shard.data.shape == (1, 3)
        assert shard.device == mesh.devices.flat[i]
        np.testing.assert_array_equal(shard.data[0], np.arange(3.0) + 3 * i)


def test_member_sharding_maps_logical_rules():
    mesh = ensemble.make_mesh(2, model_parallel=2)
    s = ensemble.member_sharding(mesh, 3, ("in", "hidden"), (("hidden", "model"),))
    assert s.spec == P("ensemble", None, "model")


def test_partitioning_rejects_rules_onto_missing_axes():
    mesh = ensemble.make_mesh(8)
    with pytest.raises(ValueError, match="lacks"):
        with ensemble.partitioning(mesh, [("hidden", "tensor")]):
            pass


def test_unmapped_annotation_warns_only_when_a_split_is_dropped():
    import warnings

    import flax.linen as nn
    import jax.numpy as jnp

    init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("vocab", "hidden"))
    model = nn.Dense(8, kernel_init=init)
    x = jnp.ones((2, 4))
    # Every member has a whole device: nothing to split, so nothing is dropped.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ensemble.build(model, 8, rules=[("hidden", None)]).init(jax.random.key(0), x)
    # A member spans 2 devices: 'vocab' unmapped means those devices each hold it whole.
    with pytest.warns(UserWarning, match=r"\['vocab'\].*spans 2 devices") as seen:
        ensemble.build(model, 4, rules=[("hidden", None)]).init(jax.random.key(0), x)
    assert seen[0].filename == __file__  # the user's line, not the library's
    # 8 members on blocks of 2 devices (2 members per block): each spans its block's 2 devices.
    mesh = ensemble.sharding.make_mesh(4)
    with pytest.warns(UserWarning, match=r"\['vocab'\].*spans 2 devices"):
        ensemble.build(model, 8, mesh=mesh, rules=[("hidden", None)]).init(jax.random.key(0), x)


def test_nnx_unmapped_annotation_is_replicated_like_linen():
    """NNX annotations (``nnx.with_partitioning``) go through the same rules: a name no rule
    maps is replicated, with the same warning where a member spans several devices."""
    import warnings

    from flax import nnx

    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("vocab", "hidden"))
    factory = lambda rngs: nnx.Linear(4, 8, kernel_init=init, rngs=rngs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ens = ensemble.build(factory, 8, rules=[("hidden", None)], rngs=0)
    kernel = ens.members.kernel[...]
    assert {s.data.shape for s in kernel.addressable_shards} == {(1, 4, 8)}
    with pytest.warns(UserWarning, match=r"\['vocab'\].*spans 2 devices") as seen:
        ens = ensemble.build(factory, 4, rules=[("hidden", None)], rngs=0)
    assert seen[0].filename == __file__
    kernel = ens.members.kernel[...]
    assert {s.data.shape for s in kernel.addressable_shards} == {(1, 4, 8)}  # whole per device
    keys = jax.random.split(jax.random.key(0), 4)
    for i in (0, 3):  # the plain factory with member i's key
        with nnx.use_eager_sharding(False):
            plain = factory(nnx.Rngs(default=keys[i]))
        np.testing.assert_array_equal(ens.member(i).kernel[...], plain.kernel[...])


def test_api_mistakes_are_named_where_they_are_made():
    """Each used to fail later and deeper: a string-format error, a 'shape (4,), got shape
    (4,)' contradiction, JAX's "'numpy.int64' object has no attribute 'platform'" at init, an
    unpacking error, a NumPy error on a traced (loss, aux)."""
    import flax.linen as nn
    import optax

    import rollout

    mesh = ensemble.make_mesh(4)
    with pytest.raises(ValueError, match="must be a positive integer, got '4'"):
        ensemble.train_step(lambda p, x: 0.0, optax.sgd(0.1), n="4", mesh=mesh)
    for n in ("4", 0):
        with pytest.raises(ValueError, match="must be a positive integer"):
            ensemble.per_member(optax.sgd(0.1), n)
    with pytest.raises(TypeError, match=r"must list jax\.Device objects, got 0"):
        ensemble.build(nn.Dense(2), 2, devices=[0, 1])
    assert ensemble.build(nn.Dense(2), 1, devices=jax.devices()[0]).mesh.size == 1
    for rules in ("hidden", [("a", None, 1)]):
        with pytest.raises(ValueError, match=r"rules must be \(logical name, mesh axis or None\)"):
            ensemble.build(nn.Dense(2), 2, rules=rules)
    with pytest.raises(TypeError, match="on_cpu needs a function"):
        rollout.on_cpu(5)
    ens = ensemble.build(nn.Dense(1), 4)
    params = ens.init(0, jnp.ones((2, 3)))["params"]
    loss = lambda p, x: (jnp.sum(nn.Dense(1).apply({"params": p}, x)), 1.0)
    step = ensemble.train_step(loss, optax.sgd(0.1), n=4, mesh=ens.mesh)
    with pytest.raises(ValueError, match=r"returned a tuple;.*has_aux=True"):
        step(params, step.init(params), jnp.ones((2, 3)))


def test_ensemble_calls_run_under_a_mesh_the_callers_code_set():
    """An ensemble call needs no context, and works inside one the caller set for its own code:
    another ensemble's partitioning, a jax.set_mesh of a mesh of other (Explicit) axes, or a
    jit traced under one. JAX refuses a shard_map or a key of one mesh under another."""
    import contextlib

    import flax.linen as nn
    import optax
    from flax import nnx

    x = jnp.arange(12.0).reshape(4, 3) / 10
    lin = ensemble.build(nn.Dense(2), 8)
    other = ensemble.build(nn.Dense(2), 2, model_parallel=2)
    user_mesh = jax.make_mesh((8,), ("batch",))  # Explicit axes

    def run():
        params = lin.init(jax.random.key(0), x)["params"]
        step = lin.train_step(lambda p, x: jnp.mean(nn.Dense(2).apply({"params": p}, x) ** 2),
                              optax.sgd(0.1))  # fmt: skip
        p, s, loss = step(params, step.init(params), x)
        p, s, losses = step.scan(p, s, jnp.stack([x, x]))
        ens = ensemble.build(lambda rngs: nnx.Linear(3, 2, rngs=rngs), 8, rngs=1)
        nnx_step = ens.train_step(lambda m, x: jnp.mean(m(x) ** 2), optax.sgd(0.1))
        nnx_loss = nnx_step(ens, nnx_step.init(), x)
        outs = (lin.apply({"params": p}, x), loss, losses, ens(x), nnx_loss)
        return [np.asarray(o) for o in outs]

    want = run()
    contexts = {
        "another ensemble's": lambda: ensemble.sharding.partitioning(other.mesh, other.rules),
        "the user's": lambda: jax.set_mesh(user_mesh),
    }
    for name, context in contexts.items():
        with context():
            got = run()
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-6, err_msg=name)
    # An ensemble on a subset of the devices under a mesh of all of them: its jit's trace
    # could not switch to a mesh of another size ("use_abstract_mesh cannot change the size").
    half = ensemble.build(nn.Dense(2), 4, devices=jax.devices()[:4])
    half_nnx = ensemble.build(
        lambda rngs: nnx.Linear(3, 2, rngs=rngs), 4, devices=jax.devices()[:4]
    )
    key = jax.random.key(0)  # (one made under an 8-device jax.set_mesh is committed to all 8)
    half_params = half.init(key, x)
    want = [np.asarray(half.apply(half_params, x)), np.asarray(half_nnx(x))]
    for context in contexts.values():
        with context():
            again = half.init(key, x)
            got = [half.apply(half_params, x), half_nnx(x)]
        np.testing.assert_array_equal(again["params"]["kernel"], half_params["params"]["kernel"])
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-6)
    with ensemble.sharding.partitioning(other.mesh, other.rules):  # a jit traced under it
        with pytest.raises(ValueError, match=r"inside a jit \(or another JAX transformation\) "
                           "traced under a mesh of 8"):  # fmt: skip
            jax.jit(lambda v, x: half.apply(v, x))(half_params, x)
    params = lin.init(jax.random.key(0), x)
    with ensemble.sharding.partitioning(other.mesh, other.rules):  # traced under it
        traced = jax.jit(lambda v, x: lin.apply(v, x) * 2)(params, x)
    with contextlib.nullcontext():
        np.testing.assert_allclose(traced, 2 * lin.apply(params, x), rtol=1e-6)


def test_shard_members_keeps_a_split_inside_members_and_places_boxes_by_their_names():
    """Re-placing tensor-parallel params gathered each member whole onto every one of its
    devices (4x the bytes here); a boxed leaf's names went unused."""
    import flax.linen as nn

    init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("input", "hidden"))
    rules = [("input", None), ("hidden", "model")]
    ens = ensemble.build(nn.Dense(64, kernel_init=init), 2, model_parallel=4, rules=rules)
    params = ens.init(jax.random.key(0), jnp.ones((4, 8)))["params"]
    kernel = params["kernel"]
    assert kernel.sharding.spec == P("ensemble", None, "model")
    again = ensemble.sharding.shard_members(params, ens.mesh, ens.n)
    assert again["kernel"] is kernel  # already placed: not copied, still split
    host = nn.LogicallyPartitioned(np.asarray(kernel), ("input", "hidden"))
    boxed = ensemble.sharding.shard_members({"kernel": host}, ens.mesh, ens.n, ens.rules)
    placed = boxed["kernel"].unbox(apply_constraint=False)
    assert placed.sharding.spec == P("ensemble", None, "model")
    assert {s.data.shape for s in placed.addressable_shards} == {(1, 8, 16)}
    np.testing.assert_array_equal(placed, kernel)
    with pytest.raises(ValueError, match="n=3 members cannot be split"):
        ensemble.sharding.shard_members(np.ones((3, 2)), ensemble.sharding.make_mesh(4), 3)


def test_rules_onto_a_missing_axis_or_the_member_axis_are_refused_in_one_line():
    """build used to give JAX's 'Resource axis: mp of P(None, 'mp') is not found in mesh' (or,
    onto 'ensemble', a message about Auto axes and reshard) at the first call."""
    import flax.linen as nn
    from flax import nnx

    init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("input", "hidden"))
    nnx_init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("input", "hidden"))
    x = jnp.ones((4, 3))
    cases = (([("hidden", "mp")], r"onto mesh axes \['mp'\] that mesh"),
             ([("hidden", "ensemble")], r"\['hidden'\] onto the 'ensemble' axis"))  # fmt: skip
    for rules, match in cases:
        with pytest.raises(ValueError, match=match):
            ens = ensemble.build(nn.Dense(8, kernel_init=init), 2, model_parallel=2, rules=rules)
            ens.init(jax.random.key(0), x)
        with pytest.raises(ValueError, match=match):
            ensemble.build(lambda rngs: nnx.Linear(3, 8, kernel_init=nnx_init, rngs=rngs), 2,
                           model_parallel=2, rules=rules)  # fmt: skip
    mesh = ensemble.sharding.make_mesh(2, model_parallel=2)
    with ensemble.sharding.partitioning(mesh, [("members", "ensemble")]):
        pass  # outside members, your own member-major arrays may go on it
    with pytest.raises(TypeError, match=r"needs a jax\.sharding\.Mesh"):
        ensemble.sharding.partitioning(None).__enter__()


def test_an_input_split_on_an_explicit_mesh_of_the_users_is_one_line():
    """jax.make_mesh's axes are Explicit: a batch split on such a mesh of the user's failed in
    shard_map with a bare KeyError naming the user's axis."""
    import flax.linen as nn
    from jax.sharding import NamedSharding

    user = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    x = jax.device_put(jnp.ones((8, 3)), NamedSharding(user, P("d")))
    ens = ensemble.build(nn.Dense(2), 4)
    variables = ens.init(jax.random.key(0), jnp.ones((8, 3)))
    with pytest.raises(ValueError, match=r"input 0 is split on a mesh with Explicit axes .*'d'"):
        ens.apply(variables, x)
    fixed = jax.device_put(x, NamedSharding(ens.mesh, P()))  # the fix the message gives
    np.testing.assert_allclose(ens.apply(variables, fixed), ens.apply(variables, np.asarray(x)))
    replicated = jax.device_put(x, NamedSharding(user, P()))  # nothing split on it: accepted
    assert ens.apply(variables, replicated).shape == (4, 8, 2)
    # Traced in the caller's own jit: the same refusal, with the fix that works there.
    with pytest.raises(ValueError, match=r"input 0 is split .*jax\.sharding\.reshard\(x, "):
        jax.jit(lambda x: ens.apply(variables, x))(x)
    in_jit = jax.jit(
        lambda x: ens.apply(variables, jax.sharding.reshard(x, NamedSharding(user, P())))
    )(x)
    np.testing.assert_allclose(in_jit, ens.apply(variables, np.asarray(x)))
    # Split over an Explicit axis the ensemble's mesh has too (a data-parallel 'data' mesh):
    # JAX takes it, eagerly and in jit.
    data = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    rows = jax.device_put(jnp.arange(48.0).reshape(16, 3), NamedSharding(data, P("data")))
    want = ens.apply(variables, np.asarray(rows))
    np.testing.assert_allclose(ens.apply(variables, rows), want, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(ens.apply)(variables, rows), want, rtol=1e-6)


def test_a_split_dimension_the_model_axis_does_not_divide_is_one_line_naming_it():
    """JAX's IndivisibleError named neither the parameter nor the rule to change."""
    import flax.linen as nn
    from flax import nnx

    import ensemble

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), (None, "hidden"))
            return nn.Dense(6, kernel_init=init)(nn.Dense(64, kernel_init=init)(x))

    said = (
        r"of shape \({}, 6\) per member: its axis 1 \(6\) is split over mesh axis model \(4 "
        r"devices\), which does not divide it; make it a multiple of 4, or map its logical"
    )
    ens = ensemble.build(Net(), 2, model_parallel=4, rules=[("hidden", "model")])
    first = r"^\['params'\]\['Dense_0'\]\['kernel'\] "
    with pytest.raises(ValueError, match=first + said.format(64)):
        ens.init(jax.random.key(0), jnp.ones((8, 12)))
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "hidden"))
    with pytest.raises(ValueError, match=r"^\['kernel'\] " + said.format(12)):
        ensemble.build(lambda rngs: nnx.Linear(12, 6, kernel_init=init, rngs=rngs), 2,
                       model_parallel=4, rules=[("hidden", "model")])  # fmt: skip
    # Mesh axes named in the annotation: rules are not read, so the fix is in the names.
    meshed = nn.Dense(6, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(),
                                                          (None, "model")))  # fmt: skip
    ens = ensemble.build(meshed, 2, model_parallel=4)
    with pytest.raises(ValueError, match=r"make it a multiple of 4, or write None for that axis "
                       r"in its nn.with_partitioning names\.$"):  # fmt: skip
        ens.init(jax.random.key(0), jnp.ones((8, 3)))
    # The member axis inside a member: JAX's DuplicateSpecError before.
    inner = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "ensemble"))
    said = r"^\['kernel'\] of shape \(12, 8\) per member: its axis 1 is split over 'ensemble', the"
    with pytest.raises(ValueError, match=said + " axis the members are already split over"):
        ensemble.build(lambda rngs: nnx.Linear(12, 8, kernel_init=inner, rngs=rngs), 2)


def test_a_model_parallel_that_is_not_an_int_or_an_annotation_naming_no_axis_is_one_line():
    """model_parallel=2.0 / '2' / True were Python's TypeErrors from inside make_mesh; an
    nn.with_partitioning name the mesh lacks was JAX's 'Resource axis' error, with no fix."""
    for bad in (2.0, "2", True):
        with pytest.raises(ValueError, match=r"model_parallel \(devices per member's 'model' "
                           rf"axis\) must be a positive integer, got {bad!r}"):  # fmt: skip
            ensemble.build(nn.Dense(4), 4, model_parallel=bad)
    init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "tp"))
    ens = ensemble.build(nn.Dense(8, kernel_init=init), 2, model_parallel=2)
    with pytest.raises(ValueError, match=r"annotation P\(None, 'tp'\) names mesh axis 'tp', "
                       r"which the ensemble's mesh \('ensemble', 'data', 'model'\) lacks: name "
                       r"'data' or 'model' there, or None"):  # fmt: skip
        ens.init(jax.random.key(0), jnp.ones((2, 4)))


def test_model_parallel_with_nothing_split_over_model_warns():
    """Each member's parameters were copied whole onto all its model devices, silently."""
    import flax.linen as nn
    from flax import nnx

    import ensemble

    said = r"each member spans 4 devices of the 'model' axis, but no parameter is split over it"
    ens = ensemble.build(nn.Dense(4), 2, model_parallel=4)
    with pytest.warns(UserWarning, match=said):
        variables = ens.init(jax.random.key(0), jnp.ones((2, 3)))
    assert {s.data.shape for s in variables["params"]["kernel"].addressable_shards} == {(1, 3, 4)}
    with pytest.warns(UserWarning, match=said):
        ensemble.build(lambda rngs: nnx.Linear(3, 4, rngs=rngs), 2, model_parallel=4)
    ruled = ensemble.build(nn.Dense(4, kernel_init=nn.with_logical_partitioning(
        nn.initializers.lecun_normal(), (None, "hidden"))), 2, model_parallel=4,
        rules=[("hidden", "model")])  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ruled.init(jax.random.key(0), jnp.ones((2, 3)))


_UNDER_OTHER_MESHES = """
import jax, jax.numpy as jnp, numpy as np, flax.linen as nn, optax
from flax import nnx
import ensemble

jax.config.update("jax_num_cpu_devices", 8)


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dropout(0.5, deterministic=False)(nn.Dense(3)(x))


class Drop(nnx.Module):
    def __init__(self, rngs):
        self.lin, self.drop = nnx.Linear(5, 3, rngs=rngs), nnx.Dropout(0.5)

    def __call__(self, x, rngs=None):
        return self.drop(self.lin(x), rngs=rngs)


x = jnp.arange(20.0).reshape(4, 5) / 10
d = jax.devices()
four = ensemble.build(nn.Dense(3), 4)  # ensemble 4 x data 2
part = ensemble.sharding.partitioning
explicit = (jax.sharding.AxisType.Explicit,)
cases = {  # each a mesh the caller set, and an ensemble of the same device count under it
    "same devices, other shape": (four.mesh, part, 2, d),  # ensemble 2 x data 4: aborted
    "other devices": (ensemble.build(nn.Dense(3), 4, devices=d[:4]).mesh, part, 4, d[4:]),
    "devices reversed": (jax.make_mesh((8,), ("x",), devices=d[::-1]), jax.set_mesh, 8, d),
    "Explicit axes": (jax.make_mesh((8,), ("x",), axis_types=explicit), jax.set_mesh, 8, d),
}


def run(lin, nx, n, devices):  # keys, seeds and per-member values made under the context
    v = lin.init(0, x)
    on_one = jax.device_put(jax.random.key(2), devices[-1])
    outs = [np.asarray(v["params"]["Dense_0"]["kernel"]), lin.apply(v, x, rngs={"dropout": 2}),
            lin.apply(v, x, rngs={"dropout": jax.random.key(2)}), nx(x),
            ensemble.mean(lin.apply(v, x, rngs={"dropout": on_one}))]  # fmt: skip
    lr = jnp.linspace(0.1, 0.2, n)
    step = lin.train_step(lambda p, x: jnp.mean(Net().apply({"params": p}, x, rngs={
        "dropout": jax.random.key(1)}) ** 2), optax.inject_hyperparams(optax.adam)(0.1),
        hyperparams={"learning_rate": lr})  # fmt: skip
    nnx_step = nx.train_step(lambda m, x: jnp.mean(m(x) ** 2), optax.adam(0.1))
    outs += [*step(v["params"], step.init(v["params"]), x), nnx_step(nx, nnx_step.init(), x)]
    drop = ensemble.build(Drop, n, devices=devices, rngs=jax.random.key(4))
    drop_step = drop.train_step(lambda m, x, r: jnp.mean(m(x, rngs=r) ** 2), optax.adam(0.1))
    outs += [drop(x, rngs=nnx.Rngs(3)), drop_step(drop, drop_step.init(), x, nnx.Rngs(5))]
    outs += [ensemble.build(Drop, n, devices=devices, rngs=nnx.Rngs(6)).members.lin.kernel[...]]
    return outs, lin.init_shardings(0, x)


for name, (mesh, context, n, devices) in cases.items():
    make_nnx = lambda: ensemble.build(lambda rngs: nnx.Linear(5, 3, rngs=rngs), n,
                                      devices=devices)  # fmt: skip
    lin = ensemble.build(Net(), n, devices=devices)
    want, shardings = run(lin, make_nnx(), n, devices)
    before = jax.sharding.get_abstract_mesh()
    with context(mesh):  # keys made in here (given, or from an int) carry this mesh
        got, under = run(lin, make_nnx(), n, devices)
        assert jax.sharding.get_abstract_mesh() == mesh.abstract_mesh, name
    assert jax.sharding.get_abstract_mesh() == before
    assert under == shardings, name
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)
print("ok")
"""


def test_ensemble_calls_under_a_mesh_of_the_same_size_but_other_shape_or_devices():
    """Under a caller's mesh of the same device count, linen init/apply and NNX calls stayed
    in it: another shape aborted the process in the partitioner (a manual sub-axis), other
    devices or their order were JAX's 'incompatible devices' error, as were a linen seed or
    key made under it; step.init and an NNX optimizer failed under an Explicit mesh."""
    import subprocess
    import sys

    from subprocess_env import clean_env

    done = subprocess.run([sys.executable, "-c", _UNDER_OTHER_MESHES], env=clean_env(),
                          capture_output=True, text=True, timeout=240)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
