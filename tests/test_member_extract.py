"""Taking member i out of linen variables keeps it on member i's device(s): no copy elsewhere."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ensemble
from ensemble._mesh import MEMBER_AXIS

D = 8


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.tanh(nn.Dense(16)(x))
        return nn.Dense(3)(x)


def _owners(mesh, n, i):
    """The devices that hold member i on ``mesh``."""
    axis = mesh.axis_names.index(MEMBER_AXIS)
    owner = i // (n // mesh.shape[MEMBER_AXIS])
    return set(np.take(mesh.devices, owner, axis=axis).flat)


def _check_member(got, variables, i, owners):
    for a, full in zip(jax.tree.leaves(got), jax.tree.leaves(variables), strict=True):
        assert a.sharding.device_set == owners
        assert {s.device for s in a.addressable_shards} <= owners
        np.testing.assert_array_equal(np.asarray(a), np.asarray(full)[i])


@pytest.mark.parametrize("n", [16, 8, 4], ids=["2-per-device", "1-per-device", "2-devices-each"])
def test_linen_member_stays_on_its_devices(n):
    ens = ensemble.build(MLP(), n)
    x = jnp.ones((2, 5))
    variables = ens.init(jax.random.key(0), x)
    y = ens.apply(variables, x)
    for i in (0, n // 2 + 1, n - 1):
        owners = _owners(ens.mesh, n, i)
        assert len(owners) == max(1, D // n)
        got = ens.member(variables, i)
        _check_member(got, variables, i, owners)
        # The extracted member is a plain model's variables and reproduces row i.
        np.testing.assert_allclose(ens.model.apply(got, x), y[i], rtol=1e-5, atol=1e-6)
        _check_member(ensemble.member(variables, i), variables, i, owners)
    # Negative indices count from the end, as with a[i].
    _check_member(ens.member(variables, -1), variables, n - 1, _owners(ens.mesh, n, n - 1))


def test_member_of_a_plain_tree_infers_the_mesh_from_the_sharding():
    n = 16
    mesh = ensemble.make_mesh(n)
    tree = {"w": jnp.arange(n * 6.0).reshape(n, 2, 3), "b": jnp.arange(n * 1.0)}
    placed = ensemble.shard_members(tree, mesh, n)
    for i in (3, 12):
        _check_member(ensemble.member(placed, i), placed, i, _owners(mesh, n, i))


def test_member_of_an_unsharded_tree_is_the_slice():
    tree = {"w": jnp.arange(12).reshape(4, 3)}
    np.testing.assert_array_equal(ensemble.member(tree, 2)["w"], jnp.array([6, 7, 8]))
    np.testing.assert_array_equal(ensemble.member({"w": np.ones((3, 2))}, 1)["w"], np.ones(2))


def test_taking_every_member_compiles_once_per_device_not_per_leaf():
    from ensemble._mesh import _rows

    n = 16
    mesh = ensemble.make_mesh(n)
    shapes = [(n, 3), (n, 2, 5), (n, 7), (n,), (n, 4, 4), (n, 1)]
    tree = ensemble.shard_members([jnp.ones(s) for s in shapes], mesh, n)
    before = _rows._cache_size()
    for i in range(n):
        _check_member(ensemble.member(tree, i), tree, i, _owners(mesh, n, i))
    assert _rows._cache_size() - before <= D  # one program per device for all six leaves


@pytest.mark.parametrize("n", [8, 4, 1])
def test_member_inside_the_partitioning_context(n):
    """``partitioning(ens.mesh)`` sets the mesh for the user's own code; taking a member there
    failed in jit with 'incompatible devices' (a one-device cut under the whole mesh)."""
    from flax import nnx

    ens = ensemble.build(MLP(), n)
    x = jnp.ones((2, 5))
    variables = ens.init(jax.random.key(0), x)
    nnx_ens = ensemble.build(lambda rngs: nnx.Linear(5, 3, rngs=rngs), n)
    with ensemble.sharding.partitioning(ens.mesh):
        got = ens.member(variables, n - 1)
        plain = nnx_ens.member(n - 1)
    np.testing.assert_array_equal(plain(x), nnx_ens(x)[n - 1])  # (on its devices, not the mesh)
    _check_member(got, variables, n - 1, _owners(ens.mesh, n, n - 1))


def test_member_inside_a_jit_or_vmap_that_closes_over_the_variables():
    """Closed over, the arrays are concrete under the trace: the cut per device raised
    ``set_mesh can only be used outside of jax.jit`` (under vmap too), naming nothing."""
    from flax import nnx

    model, x = MLP(), jnp.ones((2, 5))
    ens = ensemble.build(model, D)
    variables = ens.init(jax.random.key(0), x)
    want = model.apply(ens.member(variables, 3), x)
    np.testing.assert_allclose(jax.jit(lambda x: model.apply(ens.member(variables, 3), x))(x), want)
    one = jax.vmap(lambda x: model.apply(ensemble.member(variables, 3), x))(x[None])[0]
    np.testing.assert_allclose(one, want)
    nnx_ens = ensemble.build(lambda rngs: nnx.Linear(5, 3, rngs=rngs), D, rngs=nnx.Rngs(0))
    alone = nnx_ens.member(3)(x)
    np.testing.assert_allclose(jax.jit(lambda x: nnx_ens.member(3)(x))(x), alone)
