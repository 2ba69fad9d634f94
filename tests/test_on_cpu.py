"""rollout.on_cpu: same results as fn under jit, sharded jit, shard_map, vmap, scan; never a hang.

Runs on the 8 simulated CPU devices of conftest.py, i.e. the caller is a multi-device *CPU* program:
exactly the case in which the naive pure_callback + pmap pattern deadlocks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from subprocess_env import workers_of

from rollout import on_cpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
W = 2  # worker processes: small, the test machine has 2 cores


def synth(params, x):
    """A small GRU-like recurrence per row: params {w, u}, x[B, T] -> audio[B, T]."""

    def step(h, xt):
        z = jax.nn.sigmoid(params["u"] * h + xt)
        h = (1 - z) * h + z * jnp.tanh(params["w"] * h + xt)
        return h, h

    return jax.lax.scan(step, jnp.zeros(x.shape[0], x.dtype), x.T)[1].T


def fresh(seed, *shape):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def params_for(seed):
    a, b = np.random.default_rng(seed).normal(size=2).astype(np.float32)
    return {"w": jnp.float32(a), "u": jnp.float32(b)}


def close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def mesh8():
    return jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))


@pytest.fixture(scope="module")
def rollout_fn():
    f = on_cpu(synth, in_axes=(None, 0), workers=W)  # executor='auto'
    yield f
    f.close()
    assert workers_of(os.getpid(), "on_cpu") == []


# ------------------------------------------------------------------------------ equality


@pytest.mark.timeout(120)
@pytest.mark.parametrize("batch", [1, 5, 16])
def test_jit_matches_fn_and_params_change(rollout_fn, batch):
    step = jax.jit(rollout_fn)
    for call in range(2):  # new parameters and inputs every call, same compiled program
        p, x = params_for(batch * 10 + call), fresh(batch * 10 + call, batch, 24)
        close(step(p, x), synth(p, x))
    assert rollout_fn.last_executor == "process"  # auto on a CPU caller
    assert len(rollout_fn.pids) == W


@pytest.mark.timeout(120)
def test_jit_on_inputs_sharded_over_8_devices(rollout_fn):
    mesh = mesh8()
    x = jax.device_put(fresh(1, 21 * 8, 24), NamedSharding(mesh, P("d")))
    p = jax.device_put(params_for(1), NamedSharding(mesh, P()))
    y = jax.jit(lambda p, x: rollout_fn(p, x * 2.0) + 1.0)(p, x)
    close(y, synth(p, x * 2.0) + 1.0)
    assert rollout_fn.last_executor == "process"
    assert len(y.sharding.device_set) == 8
    # A batch that does not divide by the 8 devices is padded and stripped.
    x = jax.device_put(fresh(2, 13, 24), NamedSharding(mesh, P()))
    close(jax.jit(rollout_fn)(p, x), synth(p, x))
    # The same on a mesh with Explicit axes (jax.make_mesh's default), inside `jax.set_mesh`
    # and outside it (arrays placed on such a mesh, no context entered).
    emesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    for context in (jax.set_mesh(emesh), contextlib.nullcontext()):
        with context:
            for rows, spec in ((16, P("d")), (13, P())):
                x = jax.device_put(fresh(rows, rows, 24), NamedSharding(emesh, spec))
                got = jax.jit(rollout_fn)(params_for(rows), x)
                close(got, synth(params_for(rows), np.asarray(x)))  # reference: unsharded
    # Explicit types: rows split over some axes of a 2-D mesh, a count that is not a multiple
    # of the mesh (padding them used to slice a sharded axis); the outputs are replicated
    # whatever the batch size, so the caller's code type-checks alike for 12, 13 and 16 rows.
    emesh2 = jax.make_mesh((4, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    for rows, spec in ((12, P("a")), (13, P(None, ("a", "b"))), (16, P(None, ("a", "b")))):
        x = jax.device_put(fresh(rows, rows, 24), NamedSharding(emesh2, spec))
        got = jax.jit(lambda p, v: rollout_fn(p, v) + v)(params_for(rows), x)
        close(got, synth(params_for(rows), np.asarray(x)) + np.asarray(x))
        assert jax.typeof(jax.jit(rollout_fn)(params_for(rows), x)).sharding.spec == P(None, None)
    # An empty batch gives empty outputs without bothering the workers.
    assert jax.jit(rollout_fn)(p, jnp.zeros((0, 24))).shape == (0, 24)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_calls_inside_the_callers_set_mesh(rollout_fn, axis_type):
    """Under ``jax.set_mesh``: fn's program is still one worker device's (it used to be
    exported for the mesh's 8 devices, which every worker refused); eager calls too, for both
    executors, and the call after leaving the mesh."""
    mesh = jax.make_mesh((8,), ("d",), axis_types=(getattr(jax.sharding.AxisType, axis_type),))
    p, x = params_for(3), fresh(3, 16, 24)
    with on_cpu(synth, in_axes=(None, 0), workers=W, executor="inprocess") as inprocess:
        with jax.set_mesh(mesh):
            close(rollout_fn(p, np.asarray(x)), synth(p, x))  # eager: the process executor
            close(inprocess(p, np.asarray(x)), synth(p, x))
            sharded = jax.device_put(x, NamedSharding(mesh, P("d")))
            close(jax.jit(rollout_fn)(p, sharded), synth(p, x))
            close(jax.jit(rollout_fn)(p, np.asarray(x)), synth(p, x))  # placed by the mesh
            if axis_type == "Auto":  # concrete inputs while tracing: a host call, refused
                with on_cpu(synth, in_axes=(None, 0), workers=W) as fresh_fn:  # none exported
                    with pytest.raises(RuntimeError, match="concrete inputs while tracing under"):
                        jax.jit(lambda y: y + fresh_fn(p, np.asarray(x)))(sharded)
        close(rollout_fn(p, np.asarray(x)), synth(p, x))


@pytest.mark.timeout(120)
def test_vmap_over_a_sharded_member_axis(rollout_fn):
    """``jax.vmap`` over members sharded on the mesh: on Auto axes each member's rows equal fn's;
    on Explicit axes (``jax.make_mesh``'s default) the vmapped axis already uses the mesh axis
    that on_cpu splits rows over, which JAX refused in its own words (a DuplicateSpecError from
    inside on_cpu, or a shard_map error): now one ValueError that says what to do instead."""
    x = np.stack([fresh(m, 3, 24) for m in range(8)])  # 8 members x 3 rows
    p = params_for(4)
    want = np.stack([synth(p, x[m]) for m in range(8)])
    for kind in ("Auto", "Explicit"):
        mesh = jax.make_mesh((8,), ("m",), axis_types=(getattr(jax.sharding.AxisType, kind),))
        with jax.set_mesh(mesh):
            xs = jax.device_put(x, NamedSharding(mesh, P("m")))
            vmapped = jax.jit(jax.vmap(rollout_fn, in_axes=(None, 0)))
            if kind == "Auto":
                close(vmapped(p, xs), want)
                continue
            refusal = r"^on_cpu\(synth\): cannot split the rows over the mesh axes \('m',\), which"
            with pytest.raises(ValueError, match=refusal + " are Explicit .* fold that axis into"):
                vmapped(p, xs)
            folded = jax.jit(lambda p, v: rollout_fn(p, v.reshape(24, 24)).reshape(8, 3, 24))
            close(folded(p, xs), want)  # the workaround the message gives


@pytest.mark.timeout(120)
def test_shard_map_over_8_devices_then_psum(rollout_fn, monkeypatch):
    import rollout._on_cpu as impl
    import rollout._pool as pool

    # The 8 per-device calls of one step are merged into one pool call (full chunks per worker).
    # A generous wait makes the merge deterministic here (whatever the wait learnt before).
    monkeypatch.setattr(impl, "_COALESCE_S", 10.0)
    monkeypatch.setattr(impl, "_COALESCE_MIN_S", 10.0)
    rows: list[int] = []
    run = pool.ProcessPool.run
    monkeypatch.setattr(
        pool.ProcessPool,
        "run",
        lambda self, k, p, b, *a: rows.append(len(b[0])) or run(self, k, p, b, *a),
    )
    mesh = mesh8()
    x = jax.device_put(fresh(3, 8 * 3, 24), NamedSharding(mesh, P("d")))
    p = params_for(3)

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(P(), P("d")), out_specs=(P("d"), P()))
    def step(p, x):
        y = rollout_fn(p, x)  # called once per device, on that device's 3 rows
        return y, jax.lax.psum(y.sum(), "d")

    y, total = step(p, x)
    close(y, synth(p, x))
    assert rows == [24]
    np.testing.assert_allclose(float(total), float(synth(p, x).sum()), rtol=1e-4)
    assert rollout_fn.last_executor == "process"


def test_the_merge_wait_shrinks_to_what_whole_bursts_take():
    """A leader waits for every device's call of a step, at most 50 ms; once whole bursts were
    seen to arrive, 4x the time they took (at least 1 ms). With more devices than CPU threads
    most bursts never complete, and a fixed 50 ms made each step wait it out: a PPO rollout on
    4 simulated devices over 2 cores ran 11x slower than on 2."""
    import rollout._on_cpu as impl

    c = impl._Coalescer()
    assert c._timeout() == impl._COALESCE_S
    run = lambda b, s: [b[0] * 2]

    def burst(threaded):
        reqs = [impl._Request("sig", [np.ones((2, 1))], []) for _ in range(2)]
        if not threaded:  # the other call is already queued: a whole burst, however busy the host
            with c._cv:
                c._queue.append(reqs[1])
            c.submit(reqs[0], 2, run)
            return reqs
        threads = [threading.Thread(target=c.submit, args=(r, 2, run)) for r in reqs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
        return reqs

    # Threads that arrive together merge; how long they took depends on the host's load.
    assert all(r.outs[0].tolist() == [[2.0], [2.0]] for r in burst(threaded=True))
    for _ in range(40):
        assert all(r.outs[0].tolist() == [[2.0], [2.0]] for r in burst(threaded=False))
    assert impl._COALESCE_MIN_S <= c._timeout() < impl._COALESCE_S
    lone = impl._Request("sig", [np.ones((3, 1))], [])  # its burst's other call never comes
    assert c.submit(lone, 2, run)[0].tolist() == [[2.0]] * 3
    # Bursts that never complete at all: each wait that runs out halves the next one.
    never = impl._Coalescer()
    waits = []
    for _ in range(8):
        waits.append(never._timeout())
        never.submit(impl._Request("sig", [np.ones((1, 1))], []), 2, run)
    assert waits[0] == impl._COALESCE_S and waits[-1] == impl._COALESCE_MIN_S
    assert all(b == max(a / 2, impl._COALESCE_MIN_S) for a, b in itertools.pairwise(waits)), waits


@pytest.mark.timeout(120)
def test_vmap_folds_into_batch(rollout_fn, monkeypatch):
    import rollout._pool as pool

    rows: list[int] = []
    run = pool.ProcessPool.run
    monkeypatch.setattr(
        pool.ProcessPool,
        "run",
        lambda self, k, p, b, *a: rows.append(len(b[0])) or run(self, k, p, b, *a),
    )
    x = fresh(4, 3, 5, 24)
    p = params_for(4)
    close(jax.jit(jax.vmap(rollout_fn, in_axes=(None, 0)))(p, x), jax.vmap(synth, (None, 0))(p, x))
    assert rows == [16]  # 3 vmapped x 5 rows in one call, padded to 2 workers x 8
    # Parameters vmapped too: each vmapped element keeps its own parameters.
    ps = {"w": jnp.arange(3.0) / 3, "u": -jnp.arange(3.0) / 4}
    close(jax.jit(jax.vmap(rollout_fn))(ps, x), jax.vmap(synth)(ps, x))


@pytest.mark.timeout(120)
def test_scan_with_parameters_in_the_carry(rollout_fn):
    xs = fresh(5, 4, 6, 24)

    def body(f):
        def step(p, x):
            y = f(p, x)
            return {"w": p["w"] * 0.9 + y.mean(), "u": p["u"]}, y

        return step

    p0 = params_for(5)
    _, ys = jax.jit(lambda p, xs: jax.lax.scan(body(rollout_fn), p, xs))(p0, xs)
    _, ref = jax.lax.scan(body(synth), p0, xs)
    close(ys, ref)


@pytest.mark.timeout(120)
def test_pytrees_in_axes_and_keys(rollout_fn):
    def fn(cfg, batch, keys):
        noise = jax.vmap(lambda k: jax.random.normal(k, (3,)))(keys)
        out = batch["a"].T * cfg["scale"] + noise  # batch["a"] has the batch on axis 1
        split = jax.vmap(lambda k: jax.random.split(k)[0])(keys)
        return {"y": out, "n": batch["n"] + 1, "k": split}

    # Same worker count as the fixture: the two wrappers share one pool (closed by the fixture).
    f = on_cpu(fn, in_axes=(None, {"a": 1, "n": 0}, 0), workers=W)
    cfg = {"scale": jnp.float32(2.0)}
    batch = {"a": fresh(6, 3, 7), "n": jnp.arange(7, dtype=jnp.int32)}
    keys = jax.random.split(jax.random.key(0), 7)
    got, want = jax.jit(f)(cfg, batch, keys), fn(cfg, batch, keys)
    close(got["y"], want["y"])
    assert got["n"].dtype == jnp.int32 and (got["n"] == want["n"]).all()
    assert jax.dtypes.issubdtype(got["k"].dtype, jax.dtypes.prng_key)
    assert (jax.random.key_data(got["k"]) == jax.random.key_data(want["k"])).all()


@dataclasses.dataclass(frozen=True)
class _Physics:  # static config whose repr leaves out the value that matters
    name: str
    gain: float = dataclasses.field(repr=False)


@struct.dataclass
class _State:
    x: jax.Array
    physics: _Physics = struct.field(pytree_node=False)


@pytest.mark.timeout(120)
def test_eager_calls_trace_fn_once_per_signature():
    """Eager calls traced fn again for its output shapes on every call (150-300x a jitted call)."""
    traces = []

    def fn(x):
        traces.append(x.shape)  # a Python side effect: runs once per trace
        return jnp.cumsum(x, axis=1)

    f = on_cpu(fn, workers=W, executor="process")
    try:
        x = np.arange(40, dtype=np.float32).reshape(8, 5)
        close(f(x), np.cumsum(x, axis=1))
        first = len(traces)  # its output shapes and the workers' program
        for _ in range(3):
            close(f(x), np.cumsum(x, axis=1))
        assert len(traces) == first, traces
        with jax.numpy_rank_promotion("raise"):  # other settings: traced again, as programs are
            close(f(x), np.cumsum(x, axis=1))
        assert len(traces) > first
        traced = len(traces)
        close(f(x[:6]), np.cumsum(x[:6], axis=1))  # a new batch size: traced again
        assert len(traces) > traced
    finally:
        f.close()


@pytest.mark.timeout(120)
def test_static_parts_of_arguments_are_compared_by_equality_as_jit_does():
    # Keyed on the structure's text, a changed static part that prints the same (a repr=False
    # field; a new lambda at a freed one's address) silently reused the first program.
    by_gain = lambda s: s.x * s.physics.gain
    f = on_cpu(by_gain, workers=W)
    g = on_cpu(lambda p, x: p(x), in_axes=(None, 0), workers=W)
    try:
        x = jnp.arange(4.0)
        for gain in (2.0, 3.0):
            s = _State(x, _Physics("p", gain))
            close(f(s), by_gain(s))
            close(jax.jit(f)(s), by_gain(s))
        for k in range(3):
            p = jax.tree_util.Partial(lambda x, k=k: x + k)
            close(g(p, x), x + k)
    finally:
        f.close()
        g.close()


@pytest.mark.timeout(120)
def test_per_device_shared_arguments_differing_only_in_the_sign_of_zero_stay_apart(monkeypatch):
    import rollout._on_cpu as impl

    monkeypatch.setattr(impl, "_COALESCE_S", 10.0)  # every device's call in one merge attempt
    monkeypatch.setattr(impl, "_COALESCE_MIN_S", 10.0)
    divide = lambda w, x: x / w
    f = on_cpu(divide, in_axes=(None, 0), workers=W)
    try:
        w, x = jnp.array([0.0, -0.0] * 4), jnp.ones((8, 1))
        specs = dict(mesh=mesh8(), in_specs=(P("d"), P("d")), out_specs=P("d"))
        got = jax.jit(jax.shard_map(lambda w, x: f(w[0], x), **specs))(w, x)
        np.testing.assert_array_equal(np.asarray(got).ravel(), [np.inf, -np.inf] * 4)
    finally:
        f.close()


@pytest.mark.timeout(120)
def test_a_call_inside_a_partly_manual_shard_map_is_one_line():
    f = on_cpu(jnp.tanh, workers=W)
    try:
        mesh = jax.make_mesh((4, 2), ("m", "d"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
        member = lambda x: f(x[0])[None]
        specs = dict(mesh=mesh, in_specs=P("m"), out_specs=P("m"))
        with pytest.raises(ValueError, match=r"partly manual shard_map \(manual axes \['m'\]"):
            jax.jit(jax.shard_map(member, axis_names={"m"}, **specs))(jnp.ones((4, 3)))
        got = jax.jit(jax.shard_map(member, **specs))(jnp.ones((4, 3)))
        close(got, jnp.tanh(jnp.ones((4, 3))))
    finally:
        f.close()


@pytest.mark.timeout(180)
def test_threefry_draws_do_not_depend_on_workers_and_rbg_keys_warn():
    def fn(keys):
        return jax.vmap(lambda k: jax.random.normal(k, (2,)))(keys)

    keys = jax.random.split(jax.random.key(0), 7)
    results = []
    for workers in (1, 3):
        with on_cpu(fn, workers=workers) as f, warnings.catch_warnings():
            warnings.simplefilter("error")  # threefry: no warning
            results.append(np.asarray(jax.jit(f)(keys)))
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_array_equal(results[0], fn(keys))

    f = on_cpu(fn, workers=W)
    with pytest.warns(RuntimeWarning, match="'rbg' keys draw bits that depend on the batch") as w:
        jax.eval_shape(f, jax.random.split(jax.random.key(0, impl="rbg"), 7))
    assert w[0].filename == __file__  # the user's line
    raw = jnp.zeros((7, 4), jnp.uint32)  # raw key data under an rbg-family default
    with jax.default_prng_impl("unsafe_rbg"), pytest.warns(RuntimeWarning, match="'unsafe_rbg'"):
        jax.eval_shape(on_cpu(lambda k: k + 1, workers=W), raw)


@pytest.mark.timeout(60)
def test_concurrent_calls_from_threads(rollout_fn):
    step = jax.jit(rollout_fn)
    p = params_for(7)
    xs = [fresh(70 + i, 9, 24) for i in range(4)]
    step(p, xs[0]).block_until_ready()
    results: dict[int, jax.Array] = {}
    threads = [
        threading.Thread(target=lambda i=i: results.__setitem__(i, step(p, xs[i])))
        for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for i in range(4):
        close(results[i], synth(p, xs[i]))


@pytest.mark.timeout(60)
def test_zero_gradient(rollout_fn):
    p, x = params_for(8), fresh(8, 4, 24)

    def loss(p, x, scale):
        return jnp.mean(rollout_fn(p, x) * scale) + scale**2

    gp, gx, gs = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(p, x, jnp.float32(3.0))
    assert float(gp["w"]) == 0.0 and float(gp["u"]) == 0.0 and not np.any(gx)
    np.testing.assert_allclose(gs, jnp.mean(synth(p, x)) + 6.0, rtol=1e-5)


@pytest.mark.timeout(90)
def test_remat_runs_the_cpu_work_again_unless_the_policy_saves_its_named_outputs(monkeypatch):
    """jax.checkpoint recomputes the forward pass in the backward one, a callback included; a
    heavy CPU rollout then ran twice per call, which nothing said or let a policy prevent."""
    from rollout import _on_cpu

    runs = []
    run_rows = _on_cpu._Call.run_rows
    monkeypatch.setattr(_on_cpu._Call, "run_rows", lambda *a: runs.append(1) or run_rows(*a))
    f = on_cpu(lambda a: a * 2 + 1, executor="process", workers=W)
    step = lambda c: f(c) * c  # f's output is a constant to grad, but its value is needed
    saved = jax.checkpoint_policies.save_only_these_names("on_cpu")
    x, grads = jnp.arange(6.0).reshape(3, 2) / 10, []
    bodies = [(step, 3), (jax.checkpoint(step), 6), (jax.checkpoint(step, policy=saved), 3)]
    for body, want in bodies:
        loss = lambda x, body=body: jax.lax.scan(lambda c, _: (body(c), None), x, None, 3)[0].sum()
        runs.clear()
        grads.append(jax.jit(jax.grad(loss))(x))
        assert len(runs) == want  # one batch per scan step, or two
    f.close()
    c, d = np.asarray(x), np.ones(x.shape)
    for _ in range(3):
        d, c = d * (2 * c + 1), (2 * c + 1) * c
    for g in grads:
        np.testing.assert_allclose(g, d, rtol=1e-6)


@pytest.mark.timeout(90)
def test_gradient_through_a_psum_of_results_inside_shard_map():
    """Inside shard_map each device's results are its own rows: a gradient through their psum
    (a value baseline against returns, say) sums them once, as with any per-device value; typed
    as equal on every device, it came out 8x device 0's share."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
    x = jax.random.normal(jax.random.key(0), (2 * mesh.size, 3))
    returns = lambda x: jnp.sin(3 * x)
    f = on_cpu(returns, executor="process", workers=W)

    def grad_of(ret):
        loss = lambda b, x: jax.lax.psum(jnp.sum((ret(x) - b) ** 2), "d")
        grad = jax.shard_map(jax.grad(loss), mesh=mesh, in_specs=(P(), P("d")), out_specs=P())
        return float(jax.jit(grad)(jnp.float32(0.1), x))

    want = float(jax.grad(lambda b: jnp.sum((returns(x) - b) ** 2))(jnp.float32(0.1)))
    np.testing.assert_allclose(grad_of(lambda x: jax.lax.stop_gradient(returns(x))), want, 1e-5)
    np.testing.assert_allclose(grad_of(f), want, rtol=1e-5)


# ------------------------------------------------------------------------------ errors


@pytest.mark.timeout(60)
def test_a_python_int_too_large_for_int32_is_refused_as_jax_numpy_does():
    f = on_cpu(lambda x, s: x + s, in_axes=(0, None), workers=W)
    x = jnp.arange(3.0)
    for big in (2**31, 2**40):
        with pytest.raises(OverflowError):
            x + big  # jax.numpy itself
        with pytest.raises(OverflowError, match=f"Python int {big} too large to convert to int32"):
            f(x, big)
        with pytest.raises(OverflowError, match="too large"):
            jax.jit(lambda x, big=big: f(x, big))(x)
    np.testing.assert_array_equal(f(x, 2**31 - 1), x + (2**31 - 1))  # the largest that fits


@pytest.mark.timeout(60)
def test_errors_in_fn_surface_at_trace_time(rollout_fn):
    def bad(x):
        raise ValueError("bad rollout config")

    with pytest.raises(ValueError, match="bad rollout config"):
        jax.jit(on_cpu(bad, workers=W))(jnp.ones((4, 2)))

    def pooled(x):
        return x.mean(0)

    # Named: with several wrappers in one step, "on_cpu(fn)" did not say which one failed.
    with pytest.raises(ValueError, match=r"^on_cpu\(.*pooled\): .*one result per row"):
        jax.jit(on_cpu(pooled, workers=W))(jnp.ones((4, 2)))
    with pytest.raises(ValueError, match="batch size"):
        on_cpu(lambda a, b: a + b, workers=W)(jnp.ones((4, 2)), jnp.ones((3, 2)))
    with pytest.raises(ValueError, match="output leaf 1 has shape"):  # a Python scalar
        on_cpu(lambda x: (x, 3.0), workers=W)(np.ones((4, 2), np.float32))
    with pytest.raises(TypeError, match="output leaf 1 is a str; fn must return arrays"):
        on_cpu(lambda x: (x, "done"), workers=W)(np.ones((4, 2), np.float32))
    for executor in ("process", "inprocess"):  # a closed-over tracer: the jit's parameter
        with pytest.raises(TypeError, match="fn closes over a value traced by the enclosing"):
            jax.jit(lambda w, x, e=executor: on_cpu(lambda x: x * w, executor=e, workers=W)(x))(
                2.0, jnp.ones((4, 3))
            )
        with pytest.raises(TypeError, match="fn closes over a value traced by the enclosing"):
            _closed_over_tracer_after_an_eager_call(executor)


def _closed_over_tracer_after_an_eager_call(executor: str) -> None:
    """An eager call of the same signature cached fn's output specs first: the cached trace
    skipped the check (a stale value, or a bare pytree error, came back)."""
    box = {"w": jnp.float32(2.0)}
    warm = on_cpu(lambda x: x * box["w"], executor=executor, workers=W)
    warm(np.ones((4, 3), np.float32))

    def closing(x, w):
        box["w"] = w
        return warm(x)

    try:
        jax.jit(closing)(np.ones((4, 3), np.float32), jnp.float32(5.0))
    finally:
        warm.close()


@pytest.mark.timeout(90)
def test_worker_side_exception_names_its_type(rollout_fn, monkeypatch):
    # A program the workers cannot load: the caller gets the worker's exception type and message.
    monkeypatch.setattr(type(rollout_fn), "_exported", lambda self, *a: b"not a program")
    with pytest.raises(Exception, match=r"raised UnpicklingError"):
        jax.jit(rollout_fn)(params_for(9), fresh(9, 31, 24)).block_until_ready()
    monkeypatch.undo()
    p, x = params_for(9), fresh(9, 31, 24)
    close(jax.jit(rollout_fn)(p, x), synth(p, x))  # workers survived and still work


@pytest.mark.timeout(120)
def test_worker_killed_while_idle_is_replaced():
    f = on_cpu(synth, in_axes=(None, 0), workers=W, executor="process")
    step = jax.jit(f)
    try:
        p, x = params_for(10), fresh(10, 6, 24)
        close(step(p, x), synth(p, x))
        survivor, victim = f.pids
        os.kill(victim, signal.SIGKILL)
        time.sleep(0.2)
        close(step(p, x), synth(p, x))  # the dead worker is replaced, the other one kept
        assert f.pids[0] == survivor and f.pids[1] != victim and len(f.pids) == W
        started = set(f.pids)
    finally:
        f.close()
    assert f.pids == [] and not started & set(workers_of(os.getpid(), "on_cpu"))


@pytest.mark.timeout(120)
def test_pids_read_while_workers_start():
    """A monitor thread reading ``pids`` during the first call saw the pool's empty slots
    (AttributeError on None) instead of the workers started so far."""
    f = on_cpu(lambda x: x * 2, workers=W, executor="process")
    seen, errors, done = [], [], threading.Event()

    def poll():
        while not done.is_set():
            try:
                seen.append(list(f.pids))
            except Exception as e:  # the failure under test
                errors.append(repr(e))
                return

    monitor = threading.Thread(target=poll)
    monitor.start()
    try:
        np.testing.assert_array_equal(f(jnp.ones((4,))), 2.0)
    finally:
        done.set()
        monitor.join()
        f.close()
    assert errors == []
    assert seen and all(all(isinstance(pid, int) for pid in pids) for pids in seen)


# ------------------------------------------------------------------------------ executors


@pytest.mark.timeout(60)
def test_inprocess_from_one_device_caller():
    f = on_cpu(synth, in_axes=(None, 0), executor="inprocess", workers=W)
    p, x = params_for(11), fresh(11, 7, 24)
    close(jax.jit(f)(p, x), synth(p, x))
    assert f.last_executor == "inprocess" and f.pids == []


@pytest.mark.timeout(60)
def test_inprocess_refused_for_multi_device_cpu_caller():
    f = on_cpu(synth, in_axes=(None, 0), executor="inprocess", workers=W)
    mesh = mesh8()
    x = jax.device_put(fresh(12, 16, 24), NamedSharding(mesh, P("d")))
    with pytest.raises(RuntimeError, match=r"would deadlock.*executor='process'"):
        jax.jit(f)(params_for(12), x)
    sm = jax.shard_map(f, mesh=mesh, in_specs=(P(), P("d")), out_specs=P("d"))
    with pytest.raises(RuntimeError, match="would deadlock"):
        jax.jit(sm)(params_for(12), x)


NAIVE = """
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_num_cpu_devices", 8)
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
pm = jax.pmap(lambda a: a * 3.0, backend="cpu")
def cb(a):
    a = np.asarray(a)  # callbacks get CPU jax.Arrays in this version
    return np.asarray(pm(a.reshape(8, -1))).reshape(a.shape)
@jax.jit
@jax.shard_map(mesh=mesh, in_specs=P("d"), out_specs=P("d"))
def step(x):
    return jax.pure_callback(cb, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
print("start", flush=True)
print(step(jax.device_put(jnp.ones(64), NamedSharding(mesh, P("d")))).sum(), flush=True)
print("done", flush=True)
"""


@pytest.mark.timeout(60)
def test_naive_pattern_hangs_in_a_subprocess():
    """The naive pure_callback + pmap from an 8-device CPU shard_map never returns (killed)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", NAIVE], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        # The clock starts at "start" (after JAX's import): 8 s is many times what compiling
        # and running the 64-element step takes when it does not hang.
        first = proc.stdout.readline()
        assert first.strip() == "start", first
        out, _ = proc.communicate(timeout=8)
        hung = False
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        hung = True
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert hung and "done" not in out, (
        f"no hang (rc {proc.returncode}): the deadlock is fixed in JAX"
    )


UNDETECTED = """
import jax, jax.numpy as jnp
jax.config.update("jax_num_cpu_devices", 8)
from jax.sharding import NamedSharding, PartitionSpec as P
from rollout import on_cpu
mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
f = on_cpu(lambda a: a * 3.0, executor="inprocess", workers=2, timeout=2)
x = jax.device_put(jnp.ones(64), NamedSharding(mesh, P("d")))
# f's only input sits on one device: nothing at trace time shows the 8-device program.
print(jax.jit(lambda x, c: x.sum() + f(c).sum())(x, jnp.ones((4, 2))), flush=True)
"""


@pytest.mark.timeout(60)
def test_undetected_inprocess_deadlock_is_reported():
    """An explicit 'inprocess' that trace time cannot refuse: the guard names the deadlock."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-c", UNDETECTED], stderr=subprocess.PIPE, text=True, env=env
    )
    seen, deadline = "", time.monotonic() + 40
    try:
        while time.monotonic() < deadline and "did not finish within timeout=2 s" not in seen:
            line = proc.stderr.readline()
            if not line:
                break
            seen += line
    finally:
        proc.kill()
        proc.wait()
    # (its timeout= is its own: the work may just be longer, or it deadlocked)
    said = "did not finish within timeout=2 s: the work took longer (raise timeout=), or a "
    assert said + "callback into JAX from a program on several CPU devices deadlocked" in seen, (
        seen[-3000:]
    )


# ------------------------------------------------------------------------------ lifecycle


@pytest.mark.timeout(90)
def test_workers_stop_at_interpreter_exit():
    script = textwrap.dedent(
        """
        import jax, jax.numpy as jnp, numpy as np
        jax.config.update("jax_num_cpu_devices", 4)
        from rollout import on_cpu
        f = on_cpu(lambda x: x * 2, workers=2)
        print(float(jax.jit(f)(jnp.ones((5, 3))).sum() + f(np.ones((5, 3), np.float32)).sum()))
        print(*f.pids, flush=True)
        """
    )  # no close(): the exit handler closes the workers and unlinks their shared memory
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=80, env=env
    )
    assert res.returncode == 0, res.stderr[-2000:]
    total, pids = res.stdout.strip().splitlines()
    assert float(total) == 60.0
    assert "leaked" not in res.stderr and "Exception ignored" not in res.stderr, res.stderr
    time.sleep(0.5)
    for pid in map(int, pids.split()):
        assert not os.path.exists(f"/proc/{pid}"), f"worker {pid} outlived its parent"


@pytest.mark.timeout(120)
def test_rollout_train_step_with_nnx_jit_and_shard_map(rollout_fn):
    """The motivating train step: nnx.jit + nnx.shard_map, an nnx.RNN rollout model whose weights
    change every step (an argument), the rollout on CPU workers, a model trained on its output."""
    import optax
    from flax import nnx

    mesh = mesh8()
    graphdef, rnn_state = nnx.split(
        nnx.RNN(nnx.GRUCell(in_features=1, hidden_features=4, rngs=nnx.Rngs(0)))
    )

    def run_rnn(state, x):  # x[B, T, 1] -> h[B, T, 4]
        return nnx.merge(graphdef, state)(x)

    rnn_cpu = on_cpu(run_rnn, in_axes=(None, 0), workers=W)  # shares the fixture's pool
    model = nnx.Linear(4, 1, rngs=nnx.Rngs(1))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    @nnx.shard_map(mesh=mesh, in_specs=(P(), P(), P(), P("d"), P("d")), out_specs=(P(), P("d")))
    def train_step(model, optimizer, rnn_state, x, y):
        def loss_fn(model):
            h = rnn_cpu(rnn_state, x * x)
            return jnp.mean((model(h) - y) ** 2), h

        (loss, h), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        loss, grads = jax.lax.pmean((loss, grads), "d")
        optimizer.update(model, grads)
        return loss, h

    for step in range(2):
        rnn_state = jax.tree.map(
            lambda a: a * 1.1 if jnp.issubdtype(a.dtype, jnp.floating) else a, rnn_state
        )
        x = jax.device_put(fresh(40 + step, 16, 10, 1), NamedSharding(mesh, P("d")))
        loss, h = train_step(model, optimizer, rnn_state, x, x + 0.1)
        close(h, run_rnn(rnn_state, np.asarray(x) ** 2))
        assert np.isfinite(float(loss))
    assert rnn_cpu.last_executor == "process"


# ------------------------------------------------------------------------------ the example


@pytest.mark.timeout(150)
def test_cpu_rollout_example_runs_and_refuses_bad_flags():
    """examples/cpu_rollout.py (in the README) stays runnable: a sharded train step whose loss
    renders audio with a GRU in the CPU workers; a mistaken flag is one line and exit 2."""
    from subprocess_env import clean_env

    script = os.path.join(ROOT, "examples", "cpu_rollout.py")

    def run(*args):
        cmd = [sys.executable, script, *args]
        return subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=120)

    proc = run("--steps", "3", "--batch", "8", "--samples", "64", "--hidden", "8", "--workers", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "executor=process" in proc.stdout  # a CPU-only host: worker processes, no deadlock
    losses = [float(line.split()[-1]) for line in proc.stdout.splitlines() if line[:5] == "step "]
    assert len(losses) == 3 and np.isfinite(losses).all(), proc.stdout
    assert "this process + 2 workers" in proc.stdout
    bad = run("--batch", "3")
    assert bad.returncode == 2
    last = bad.stderr.strip().splitlines()[-1]
    assert re.match(r"error: --batch 3 must be a multiple of the \d+ devices", last)
    bad = run("--executor", "inprocess")  # the CPU devices here: it would deadlock
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-2000:]
    assert "--executor inprocess cannot serve a step over" in bad.stderr


@pytest.mark.timeout(150)
def test_cpu_rollout_example_stops_between_steps_on_ctrl_c():
    """Ctrl-C in the example's step loop: it ended by SIGABRT or SIGSEGV in 3 of 6 tries (the
    interpreter exited while XLA still ran the interrupted step); it stops after a step."""
    from subprocess_env import clean_env

    script = os.path.join(ROOT, "examples", "cpu_rollout.py")
    flags = ["--steps", "100000", "--batch", "8", "--samples", "64", "--hidden", "8"]
    cmd = [sys.executable, "-u", script, *flags, "--workers", "2"]
    proc = subprocess.Popen(cmd, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert b"first step" in proc.stdout.readline() + proc.stdout.readline()
        time.sleep(1.0)  # in the loop
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130, err.decode()[-3000:]
    assert re.search(rb"interrupted: stopped after step \d+\n$", err), err[-3000:]
    assert b"steps/s" in out


def _unlinked_blocks(pid: int) -> set[str]:
    """Shared-memory blocks a process still maps after they were unlinked."""
    with open(f"/proc/{pid}/maps") as f:
        return {line.split()[-2] for line in f if "psm_" in line and "(deleted)" in line}


@pytest.mark.timeout(120)
def test_workers_a_call_leaves_idle_let_go_of_a_replaced_block():
    """A call of one row that grows the shared block used worker 0 only; the others kept the
    old, unlinked block mapped (its memory held) until a later call used them, or close()."""
    f = on_cpu(lambda x: x + 1, workers=3, executor="process")
    try:
        np.testing.assert_array_equal(f(np.ones((3, 100_000), np.float32)), 2.0)
        np.testing.assert_array_equal(f(np.ones((1, 2_000_000), np.float32)), 2.0)
        deadline = time.monotonic() + 30
        while any(_unlinked_blocks(pid) for pid in f.pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [_unlinked_blocks(pid) for pid in f.pids] == [set()] * 3
        np.testing.assert_array_equal(f(np.ones((3, 100_000), np.float32)), 2.0)  # all reattach
    finally:
        f.close()
