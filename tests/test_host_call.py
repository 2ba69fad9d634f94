"""``host_call``: same results as ``io_callback``; kept, ordered, never merged or repeated."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from rollout import _host_call
from rollout._host_call import host_call


def test_fast_path_is_active_on_the_pinned_jax():
    # The fallback is correct but slow; on the JAX range pyproject.toml pins, the fast path must
    # be the one in use, or the host-env speed figures in the README are not what users get.
    assert _host_call.FAST


def _counter():
    calls = []

    def fn(x):
        calls.append(np.array(x))
        return (x * 2 + len(calls),)

    return fn, calls


def test_matches_io_callback_inside_scan_and_runs_once_per_step():
    fn, calls = _counter()
    fn_ref, calls_ref = _counter()

    def run(call):
        def body(c, _):
            (y,) = call(c)
            return y, y.sum()

        return jax.jit(lambda x: jax.lax.scan(body, x, None, length=5))(jnp.arange(3.0))

    ours = run(lambda c: host_call(fn, [c], c))
    ref = run(lambda c: io_callback(fn_ref, [jax.ShapeDtypeStruct(c.shape, c.dtype)], c))
    jax.tree.map(np.testing.assert_array_equal, ours, ref)
    assert len(calls) == len(calls_ref) == 5
    for a, b in zip(calls, calls_ref):
        np.testing.assert_array_equal(a, b)


def test_kept_when_results_unused_and_not_merged():
    fn, calls = _counter()

    @jax.jit
    def f(x):
        host_call(fn, [x], x)  # result dropped: still an effect, must run
        a = host_call(fn, [x], x)[0]
        b = host_call(fn, [x], x)[0]  # same inputs: must not be merged with the previous one
        return a, b

    a, b = jax.block_until_ready(f(jnp.ones(2)))  # dispatch is asynchronous
    assert len(calls) == 3
    assert float(a[0]) == 4.0 and float(b[0]) == 5.0


def test_per_device_calls_inside_shard_map_see_only_their_shard():
    devices = np.array(jax.devices()[:4])
    mesh = Mesh(devices, ("ensemble",))
    seen = {}

    def fn(g, x):
        seen[int(g)] = np.array(x)
        return (x + 100 * g,)

    def per_device(x):
        g = jax.lax.axis_index("ensemble")
        return host_call(fn, [x], g, x)[0]

    x = jax.device_put(jnp.arange(8.0).reshape(4, 2), NamedSharding(mesh, P("ensemble")))
    out = jax.jit(
        jax.shard_map(per_device, mesh=mesh, in_specs=P("ensemble"), out_specs=P("ensemble"))
    )(x)
    jax.block_until_ready(out)  # dispatch is asynchronous: the devices' calls may still run
    assert sorted(seen) == [0, 1, 2, 3]
    for g in range(4):
        np.testing.assert_array_equal(seen[g], [[2 * g, 2 * g + 1]])
    np.testing.assert_array_equal(out, np.arange(8.0).reshape(4, 2) + 100 * np.arange(4)[:, None])
    assert [s.device for s in out.addressable_shards] == list(devices)


def test_wrong_result_shape_is_an_error_not_a_wrong_number():
    with pytest.raises(Exception, match="shape"):
        jax.jit(lambda x: host_call(lambda a: (a[:1],), [x], x))(jnp.ones(3)).block_until_ready()


def test_eager_call_runs_fn():
    (y,) = host_call(lambda a: (a + 1,), [jnp.zeros(2)], jnp.zeros(2))
    np.testing.assert_array_equal(y, [1.0, 1.0])


def test_not_differentiable_nor_vmappable():
    with pytest.raises(NotImplementedError, match="host_call"):
        jax.grad(lambda x: host_call(lambda a: (a,), [x], x)[0])(1.0)
    with pytest.raises(NotImplementedError, match="host_call"):
        jax.vmap(lambda x: host_call(lambda a: (a,), [x], x)[0])(jnp.ones(3))


def _callback_result_ranks(lowered) -> list[list[int]]:
    """The ranks of each host callback's results in a lowered program."""
    ranks = []
    for line in lowered.as_text().splitlines():
        if "stablehlo.custom_call" in line and "callback" in line:
            results = line.rsplit("->", 1)[1]
            ranks.append([t.count("x") for t in re.findall(r"tensor<([^>]*)>", results)])
    return ranks


def test_results_of_different_ranks_reach_the_program_in_one_rank():
    """A TPU's lowering of a callback inside shard_map gives every result the first result's
    sharding, so each must have the same rank (``equal_ranks``); the caller sees its own."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("ensemble",))

    def fn(x):
        return x * 2, x.sum(-1) > 3, np.int32(x.size)

    types = [jax.ShapeDtypeStruct((1, 2), jnp.float32), jax.ShapeDtypeStruct((1,), jnp.bool_),
             jax.ShapeDtypeStruct((), jnp.int32)]  # fmt: skip
    per_device = lambda x: tuple(o[None] for o in host_call(fn, types, x))
    step = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("ensemble"),
                                 out_specs=P("ensemble")))  # fmt: skip
    x = jax.device_put(jnp.arange(8.0).reshape(4, 2), NamedSharding(mesh, P("ensemble")))
    assert _callback_result_ranks(step.lower(x)) == [[2, 2, 2]]
    doubled, big, size = step(x)
    assert (doubled.shape, big.shape, size.shape) == ((4, 1, 2), (4, 1), (4,))
    np.testing.assert_array_equal(doubled[:, 0], np.arange(8.0).reshape(4, 2) * 2)
    np.testing.assert_array_equal(big[:, 0], [False, True, True, True])
    np.testing.assert_array_equal(size, [2, 2, 2, 2])
