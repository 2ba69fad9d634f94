"""``debug.collectives(..., across_members=True)``: which collectives group devices of different
members, read from the device groups of every HLO form XLA writes, checked against programs
whose data movement is known (a member's own reduction, a reduction over all members, a shift
across members and one within a member)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ensemble
from ensemble._collectives import _groups
from ensemble.debug import collectives


@pytest.mark.parametrize(
    "text, groups",
    [
        ("replica_groups={{0,1},{2,3}}, to_apply", [[0, 1], [2, 3]]),
        ("replica_groups=[2,2]<=[4], to_apply", [[0, 1], [2, 3]]),
        ("replica_groups=[2,2]<=[2,2]T(1,0), to_apply", [[0, 2], [1, 3]]),
        ("replica_groups=mesh['a'=2,'b'=2] {'b'}, use_global", [[0, 1], [2, 3]]),
        ("replica_groups=mesh['a'=2,'b'=2] {'a'}, use_global", [[0, 2], [1, 3]]),
        ("replica_groups=mesh['a'=2,'b'=2] {'b'}", [[0, 1], [2, 3]]),  # last on its line
        # The mesh's devices in another order (a mesh listing 'data' before 'ensemble').
        (
            "replica_groups=mesh['a'=3,'b'=2], device_ids=([2,3]T(1,0)) {'b'}, use_global",
            [[0, 3], [1, 4], [2, 5]],
        ),
        ("source_target_pairs={{0,2},{2,0}}, metadata", [[0, 2], [2, 0]]),
        # No groups, or a form this reader does not know: all devices, which crosses members.
        ("replica_groups={}, to_apply", [[0, 1, 2, 3]]),
        ("replica_groups=<some new form>, to_apply", [[0, 1, 2, 3]]),
        ("replica_groups=[2,4]<=[8], to_apply", [[0, 1, 2, 3]]),  # not this program's devices
    ],
)
def test_device_groups_are_read_from_every_form(text, groups):
    n = sum(len(g) for g in groups)
    assert _groups(f"  %x = f32[{n}] all-reduce(%y), {text}", max(4, n)) == groups


@pytest.mark.parametrize(
    "op", ["ragged-all-to-all", "collective-broadcast", "all-gather-start", "all-to-all"]
)
def test_every_collective_kind_is_counted(op):
    """XLA:CPU compiles neither a ragged all-to-all nor a collective broadcast; a GPU does."""
    from ensemble._collectives import _OP

    found = _OP.search(f"  %x = f32[8] {op}(%y), replica_groups={{{{0,1}}}}")
    assert found is not None and op.startswith(found.group(1))


def _on_members(shape, spec):
    mesh = ensemble.make_mesh(4, devices=jax.devices()[:8])  # members x 2 'data' devices
    assert dict(mesh.shape) == {"ensemble": 4, "data": 2, "model": 1}
    return jax.device_put(jnp.ones(shape), NamedSharding(mesh, spec))


@pytest.mark.parametrize(
    "fn, within, across",
    [
        (lambda x: x.sum(axis=1), {"all-reduce": 1}, {}),  # each member's own rows
        # Over all members: within each member, then across (only the second crosses).
        (lambda x: x.sum(), {"all-reduce": 2}, {"all-reduce": 1}),
        (lambda x: jnp.roll(x, 1, axis=1), {"collective-permute": 1}, {}),  # within a member
        (lambda x: jnp.roll(x, 1, axis=0), {"collective-permute": 1}, {"collective-permute": 1}),
    ],
    ids=["member-sum", "global-sum", "shift-within", "shift-across"],
)
def test_collectives_across_members_are_those_that_move_data_between_members(fn, within, across):
    x = _on_members((4, 8), P("ensemble", "data"))
    compiled = jax.jit(fn).lower(x).compile()
    assert collectives(compiled) == within
    assert collectives(compiled, across_members=True) == across


def test_an_all_to_all_within_each_member_does_not_cross():
    """A member's block moved from one split over its 2 'model' devices to another: an
    all-to-all among the member's own devices, whose replica_groups end its HLO line (it was
    read as one group of all devices, so as crossing members)."""
    mesh = ensemble.make_mesh(4, model_parallel=2, devices=jax.devices()[:8])
    x = jax.device_put(jnp.ones((4, 8, 16)), NamedSharding(mesh, P("ensemble", None, "model")))
    out = NamedSharding(mesh, P("ensemble", "model", None))
    compiled = jax.jit(lambda x: x * 1, out_shardings=out).lower(x).compile()
    assert collectives(compiled) == {"all-to-all": 1}
    assert collectives(compiled, across_members=True) == {}


@pytest.mark.parametrize("names", [("data", "ensemble", "model"), ("model", "data", "ensemble")])
def test_a_mesh_with_its_axes_in_another_order_is_read_the_same(names):
    """A user's mesh may list 'data' first; XLA then names the devices in the mesh's order."""
    devices = np.array(jax.devices()[:8]).reshape([{"ensemble": 4, "data": 2, "model": 1}[a]
                                                    for a in names])  # fmt: skip
    mesh = jax.sharding.Mesh(devices, names, axis_types=(jax.sharding.AxisType.Auto,) * 3)
    x = jax.device_put(jnp.ones((4, 8)), NamedSharding(mesh, P("ensemble", "data")))
    own, every = (jax.jit(f).lower(x) for f in (lambda a: a.sum(axis=1), lambda a: a.sum()))
    assert collectives(own) == {"all-reduce": 1}
    assert collectives(own, across_members=True) == {}
    assert collectives(every, across_members=True) == {"all-reduce": 1}


def test_across_members_needs_an_ensemble_mesh():
    compiled = jax.jit(lambda x: x * 2).lower(np.ones(4)).compile()
    assert collectives(compiled) == {}
    with pytest.raises(ValueError, match="one ensemble mesh"):
        collectives(compiled, across_members=True)
    with pytest.raises(TypeError, match=r"lowered or compiled program, got PjitFunction"):
        collectives(jax.jit(lambda x: x * 2))  # not yet lowered: no program to read
