"""The placement assertions pass on correctly placed trees and fail, informatively, otherwise."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ensemble


def _tree(n: int) -> dict:
    dense = {"kernel": jnp.ones((n, 5, 3)), "bias": jnp.zeros((n, 3))}
    return {"dense": dense, "step": jnp.ones(n)}


@pytest.mark.parametrize("n", [8, 16, 4, 2, 1])
def test_correct_placement_passes(n):
    """n == D, n a multiple of D, and members spanning D/n devices."""
    mesh = ensemble.make_mesh(n)
    tree = ensemble.shard_members(_tree(n), mesh, n)
    ensemble.assert_member_axis(tree, n)
    ensemble.assert_member_placement(tree, mesh)
    ensemble.assert_member_placement(tree, mesh, n)
    ensemble.assert_no_replicated_members(tree, n)


def test_member_spanning_devices_with_model_parallel_leaf_passes():
    """Member i split over its devices on another axis still counts as placed on them."""
    mesh = ensemble.make_mesh(2, model_parallel=2)  # (2, 2, 2): 4 devices per member
    w = jax.device_put(jnp.ones((2, 4, 8)), NamedSharding(mesh, P("ensemble", None, "model")))
    ensemble.assert_member_placement({"w": w}, mesh)
    ensemble.assert_no_replicated_members({"w": w}, 2)


def test_subset_of_devices_passes():
    mesh = ensemble.make_mesh(4, devices=jax.devices()[4:])
    tree = ensemble.shard_members(_tree(4), mesh, 4)
    ensemble.assert_member_placement(tree, mesh)
    ensemble.assert_no_replicated_members(tree, 4, mesh)


def test_replicated_leaf_fails_naming_leaf_and_sharding():
    n = 8
    mesh = ensemble.make_mesh(n)
    tree = ensemble.shard_members(_tree(n), mesh, n)
    tree["dense"]["bias"] = jax.device_put(jnp.zeros((n, 3)), NamedSharding(mesh, P()))
    with pytest.raises(AssertionError, match=r"(?s)\['dense'\]\['bias'\]: shape \(8, 3\).*P\(\)"):
        ensemble.assert_no_replicated_members(tree, n)
    with pytest.raises(AssertionError, match=r"member 0 should be on \{cpu:0\} but lives on"):
        ensemble.assert_member_placement(tree, mesh)


def test_members_split_over_another_mesh_axis_fail():
    """P('data') on a mesh of ensemble 4 x data 2: each member on 4 devices (twice the memory
    of P('ensemble')); no device held all members, so the check passed."""
    n = 4
    mesh = ensemble.make_mesh(n)
    assert dict(mesh.shape) == {"ensemble": 4, "data": 2, "model": 1}
    wrong = jax.device_put(jnp.zeros((n, 1000)), NamedSharding(mesh, P("data")))
    for kw in ({}, {"mesh": mesh}):
        with pytest.raises(AssertionError, match=r"hold more than the 1 member\(s\) each"):
            ensemble.assert_no_replicated_members({"w": wrong}, n, **kw)
    right = ensemble.shard_members(jnp.zeros((n, 1000)), mesh, n)
    ensemble.assert_no_replicated_members({"w": right}, n, mesh)
    two_each = ensemble.shard_members(jnp.zeros((2 * n, 3)), mesh, 2 * n)
    ensemble.assert_no_replicated_members({"w": two_each}, 2 * n, mesh)  # 2 per block: fine


def test_leaf_on_one_device_fails():
    """The eager-init pitfall: the whole ensemble on device 0."""
    n = 8
    leaf = jax.device_put(jnp.zeros((n, 3)), jax.devices()[0])
    with pytest.raises(AssertionError, match=r"all 8 members held whole by \{cpu:0\}"):
        ensemble.assert_no_replicated_members({"w": leaf}, n)
    with pytest.raises(
        AssertionError,
        match=r"member 1 should be on \{cpu:1\} but lives on \{cpu:0\}",
    ):
        ensemble.assert_member_placement({"w": leaf}, ensemble.make_mesh(n))


def test_single_device_ensemble_is_not_replication():
    mesh = ensemble.make_mesh(4, devices=jax.devices()[:1])
    tree = ensemble.shard_members(_tree(4), mesh, 4)
    ensemble.assert_no_replicated_members(tree, 4, mesh)
    # Without mesh=, the mesh the leaves' shardings name says the same.
    ensemble.assert_no_replicated_members(tree, 4)
    # ... leaf by leaf: a one-device ensemble beside a replicated leaf does not excuse it.
    replicated = jax.device_put(jnp.zeros((4, 3)), NamedSharding(ensemble.make_mesh(4), P()))
    with pytest.raises(AssertionError, match=r"\['z'\]: shape \(4, 3\)"):
        ensemble.assert_no_replicated_members({**tree, "z": replicated}, 4)
    ensemble.assert_member_placement(tree, mesh)


def test_permuted_devices_fail():
    n = 8
    mesh = ensemble.make_mesh(n)
    tree = ensemble.shard_members(_tree(n), mesh, n)
    permuted = Mesh(mesh.devices[::-1], mesh.axis_names, axis_types=mesh.axis_types)
    with pytest.raises(
        AssertionError,
        match=r"\['dense'\]\['kernel'\].*member 0 should be on \{cpu:7\} but lives on \{cpu:0\}",
    ):
        ensemble.assert_member_placement(tree, permuted)
    # Still split, so not "replicated": the two checks answer different questions.
    ensemble.assert_no_replicated_members(tree, n)


def test_members_spanning_devices_on_wrong_devices_fail():
    mesh = ensemble.make_mesh(4)  # member i on devices 2i, 2i+1
    x = ensemble.shard_members(jnp.ones((4, 3)), mesh, 4)
    other = ensemble.make_mesh(4, devices=[jax.devices()[i] for i in (0, 2, 1, 3, 4, 5, 6, 7)])
    with pytest.raises(
        AssertionError,
        match=r"member 0 should be on \{cpu:0, cpu:2\} but lives on \{cpu:0, cpu:1\}",
    ):
        ensemble.assert_member_placement(x, other)


def test_missing_member_axis_fails_naming_leaf_and_shape():
    tree = {"w": jnp.ones((8, 2)), "scale": jnp.ones((3,)), "t": jnp.float32(0)}
    with pytest.raises(
        AssertionError,
        match=r"(?s)2 leaves without.*\['scale'\]: shape \(3,\).*\['t'\]: shape \(\)",
    ):
        ensemble.assert_member_axis(tree, 8)
    with pytest.raises(AssertionError, match=r"\['scale'\]: 3 members cannot be split"):
        ensemble.assert_member_placement({"scale": jnp.ones((3,))}, ensemble.make_mesh(8))


def test_host_array_is_not_placed():
    with pytest.raises(AssertionError, match=r"\['w'\]: a host ndarray"):
        ensemble.assert_member_placement({"w": np.ones((8, 2))}, ensemble.make_mesh(8))


def test_member_axis_works_under_jit_and_on_shapes():
    ensemble.assert_member_axis(jax.ShapeDtypeStruct((8, 2), jnp.float32), 8)

    @jax.jit
    def f(x):
        ensemble.assert_member_axis(x, 8)
        return x

    f(jnp.ones((8, 2)))
    with pytest.raises(AssertionError):
        f(jnp.ones((7, 2)))


def test_placement_under_jit_says_to_call_outside():
    mesh = ensemble.make_mesh(8)
    with pytest.raises(TypeError, match="outside jit"):
        jax.jit(lambda x: ensemble.assert_member_placement(x, mesh) or x)(jnp.ones((8, 2)))


def test_chex_conventions():
    with pytest.raises(AssertionError, match=r"(?s)\[Chex\].*custom note"):
        ensemble.assert_member_axis({"w": jnp.ones(3)}, 8, custom_message="custom note")
    chex.disable_asserts()
    try:
        ensemble.assert_member_axis({"w": jnp.ones(3)}, 8)
    finally:
        chex.enable_asserts()


def test_nnx_module_and_state():
    from flax import nnx

    class Box(nnx.Module):
        def __init__(self, w):
            self.w = nnx.Param(w)

    mesh = ensemble.make_mesh(8)
    good = Box(ensemble.shard_members(jnp.ones((8, 2)), mesh, 8))
    ensemble.assert_member_placement(good, mesh)
    ensemble.assert_no_replicated_members(nnx.state(good), 8)
    # The NNX pitfall: metadata could say 'ensemble', the array is replicated.
    bad = Box(jax.device_put(jnp.ones((8, 2)), NamedSharding(mesh, P())))
    with pytest.raises(AssertionError, match=r"w.*P\(\)"):
        ensemble.assert_no_replicated_members(bad, 8)


def test_linen_build_state_passes_and_naive_route_bias_fails():
    """ensemble.build shards unannotated biases; the reported logical route leaves them P()."""
    import flax.linen as nn
    import optax

    model = nn.Dense(
        4, kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("in", "out"))
    )
    x = jnp.ones((2, 3))
    ens = ensemble.build(model, 8, rules=[("in", None), ("out", None)])
    params = ens.init(jax.random.key(0), x)["params"]
    step = ensemble.train_step(
        lambda p, x: jnp.sum(model.apply({"params": p}, x)), optax.adam(0.1), n=8, mesh=ens.mesh
    )
    state = (params, step.init(params))
    ensemble.assert_member_axis(state, 8)
    ensemble.assert_member_placement(state, ens.mesh)
    ensemble.assert_no_replicated_members(state, 8, ens.mesh)

    # The reported way: nn.vmap + metadata_params, shardings from the logical annotations.
    vmapped = nn.vmap(
        nn.Dense,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        in_axes=None,
        axis_size=8,
        metadata_params={nn.PARTITION_NAME: "ensemble"},
    )(4, kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("in", "out")))
    boxed = jax.eval_shape(vmapped.init, jax.random.PRNGKey(0), x)
    rules = (("ensemble", "ensemble"), ("in", None), ("out", None))
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), ens.mesh, rules)
    seed = jax.jit(lambda k: nn.meta.unbox(vmapped.init(k, x)), out_shardings=shardings)(
        jax.random.PRNGKey(0)
    )["params"]
    ensemble.assert_no_replicated_members(seed["kernel"], 8)  # annotated: sharded
    with pytest.raises(AssertionError, match=r"(?s)1 leaf .*\['bias'\]: shape \(8, 4\).*P\(\)"):
        ensemble.assert_no_replicated_members(seed, 8)


def test_nnx_metadata_is_not_placement():
    """nnx.vmap's transform_metadata says 'ensemble'; the arrays stay replicated: caught."""
    from flax import nnx

    mesh = ensemble.make_mesh(8)

    @nnx.split_rngs(splits=8)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "ensemble"})
    def create(rngs):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, None))
        return nnx.Linear(3, 2, kernel_init=init, rngs=rngs)

    with jax.set_mesh(mesh):
        model = create(nnx.Rngs(0))
    claim = r"\['kernel'\] \(metadata says out_sharding=\('ensemble', None, None\)\)"
    with pytest.raises(AssertionError, match=rf"(?s){claim}: .*P\(\).*all 8 members held whole"):
        ensemble.assert_no_replicated_members(model, 8)
    with pytest.raises(AssertionError, match=r"\['bias'\]: .*member 0 should be on \{cpu:0\}"):
        ensemble.assert_member_placement(model, mesh)


def test_an_assertion_that_checked_nothing_fails():
    """n = the device count instead of the member count (16 members on 8 devices), an empty
    tree, or donated arrays: the assertions say so instead of passing having checked nothing."""
    mesh = ensemble.make_mesh(16)
    replicated = jax.device_put(jnp.zeros((16, 4)), NamedSharding(mesh, P()))
    for check in (
        lambda t, n: ensemble.assert_no_replicated_members(t, n),
        lambda t, n: ensemble.assert_member_placement(t, mesh, n),
    ):
        with pytest.raises(AssertionError, match=r"no leaf .* n=8 \(leading sizes: \[16\]\)"):
            check({"w": replicated}, 8)
        with pytest.raises(AssertionError, match=r"leading sizes: none, the tree has no arrays"):
            check({}, 8)
        with pytest.raises(AssertionError, match=r"leading sizes: none, the tree has only scal"):
            check({"s": jnp.float32(1)}, 8)
    with pytest.raises(AssertionError, match="the tree has no leaves"):
        ensemble.assert_member_placement({}, mesh)
    sharded = ensemble.shard_members(jnp.zeros((16, 4)), mesh, 16)
    jax.jit(lambda x: x + 1, donate_argnums=0)(sharded)
    for check in (
        lambda: ensemble.assert_no_replicated_members({"w": sharded}, 16),
        lambda: ensemble.assert_member_placement({"w": sharded}, mesh, 16),
    ):
        with pytest.raises(AssertionError, match=r"\['w'\]: donated to an earlier step"):
            check()
