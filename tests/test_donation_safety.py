"""Reusing donated arrays, or passing them also as a batch argument of the same step, is a
Python error naming the argument, never a crash; bad devices too.

On several CPU devices jaxlib can crash the whole process (SIGSEGV) when a jitted program is
called on a buffer already donated; the checks run in a subprocess so a regression fails this
test instead of killing the test session.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import pytest
from subprocess_env import clean_env

import ensemble

SCRIPT = textwrap.dedent(
    """
    import jax
    jax.config.update("jax_num_cpu_devices", 2)
    import jax.numpy as jnp, flax.linen as nn, optax, ensemble

    model = nn.Dense(1)
    ens = ensemble.build(model, 2)
    x = jnp.ones((4, 3))
    variables = ens.init(jax.random.key(0), x)
    step = ens.train_step(lambda p, x: jnp.mean(model.apply({"params": p}, x) ** 2), optax.sgd(0.1))
    params = variables["params"]
    opt_state = step.init(params)
    new_params, opt_state, _ = step(params, opt_state, x)
    # The same arrays as donated state and as a batch argument of one call (an L2 anchor).
    l2 = lambda p, x, a: sum(jnp.sum((u - v) ** 2) for u, v in zip(jax.tree.leaves(p),
                                                                    jax.tree.leaves(a)))
    anchored = ens.train_step(l2, optax.sgd(0.1), per_member_batch=(False, True))
    anchored_state = anchored.init(new_params)
    from flax import nnx
    nens = ensemble.build(lambda r: nnx.Linear(3, 1, rngs=r), 2, rngs=0)
    nstep = nens.train_step(lambda m, x, w: jnp.sum((m.kernel[...] - w) ** 2), optax.sgd(0.1),
                            per_member_batch=(False, True))
    nopt = nstep.init()
    tied = ens.train_step(lambda p, x: jnp.sum(p["a"] * p["b"]), optax.sgd(0.1))
    w = new_params["kernel"] + 1.0
    tied_params = {"a": w, "b": w}
    for call in (
        lambda: ens.apply(variables, x),
        lambda: step(params, opt_state, x),
        lambda: anchored(new_params, anchored_state, x, new_params),
        lambda: nstep(nens, nopt, x, nens.members.kernel[...]),
        # An anchor kept from before the first step, which donated it.
        lambda: anchored(new_params, anchored_state, x, params),
        # Tied weights: one array twice in the donated params.
        lambda: tied(tied_params, tied.init(tied_params), x),
        # A member taken out of donated variables.
        lambda: ensemble.member(variables, 1),
    ):
        try:
            call()
        except ValueError as e:
            print("ValueError:", e)
    print("apply with the returned params:", ens.apply({"params": new_params}, x).shape)
    """
)


@pytest.mark.timeout(120)
def test_donated_arrays_reused_raise_a_clear_error():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=110, env=clean_env()
    )
    assert out.returncode == 0, out.stderr[-2000:]
    errors = [line for line in out.stdout.splitlines() if line.startswith("ValueError")]
    assert len(errors) == 7, out.stdout
    assert "variables leaf ['params']" in errors[0] and "donated" in errors[0]
    assert "params['bias']" in errors[1] or "params['kernel']" in errors[1]
    assert "batch argument 1['bias'] is also one of the params / opt_state arrays" in errors[2]
    assert "batch argument 1 is also one of the ensemble / optimizer state arrays" in errors[3]
    assert "batch argument 1['bias'] was donated to an earlier call" in errors[4]
    assert "['params']['b'] is the same array as ['params']['a'] (both donated)" in errors[5]
    assert "member() input ['params']" in errors[6] and "was donated" in errors[6]
    assert "apply with the returned params: (2, 4, 1)" in out.stdout


def test_arrays_committed_to_other_devices_are_refused_in_one_line():
    """JAX's own error for a committed array on other devices names no fix; every entry point
    refuses it first, naming the argument, its devices and the ensemble's."""
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    ens = ensemble.build(nn.Dense(2), 8)
    x = jnp.ones((4, 3))
    v = ens.init(jax.random.key(0), x)
    on_5 = jax.device_put(x, jax.devices()[5])  # e.g. computed from ens.member(v, 5)
    want = r"is committed to device\(s\) 5, but this ensemble runs on devices 0\.\.7; pass it"
    with pytest.raises(ValueError, match=r"input 0 " + want):
        ens.apply(v, on_5)
    with pytest.raises(ValueError, match=r"variables\['params'\]\['bias'\] is committed"):
        ens.apply(jax.device_put(v, jax.devices()[0]), x)
    loss = lambda p, x: jnp.mean(ens.model.apply({"params": p}, x) ** 2)
    step = ens.train_step(loss, optax.sgd(0.1))
    params = v["params"]
    with pytest.raises(ValueError, match=r"batch argument 0 " + want):
        step(params, step.init(params), on_5)
    gathered = jax.device_put(params, jax.devices()[0])
    with pytest.raises(ValueError, match=r"params\['bias'\] is committed to device\(s\) 0,"):
        step(gathered, step.init(params), x)
    # Accepted: host arrays, uncommitted ones, and arrays already on the ensemble's devices.
    assert ens.apply(v, np.ones((4, 3), np.float32)).shape == (8, 4, 2)
    moved = jax.device_put(on_5, jax.sharding.NamedSharding(ens.mesh, jax.sharding.PartitionSpec()))
    assert ens.apply(v, moved).shape == (8, 4, 2)  # the fix the message gives
    nens = ensemble.build(lambda r: nnx.Linear(3, 2, rngs=r), 8, rngs=0)
    with pytest.raises(ValueError, match=r"input 0 " + want):
        nens(on_5)
    nstep = nens.train_step(lambda m, x: jnp.mean(m(x) ** 2), optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"batch argument 0 " + want):
        nstep(nens, nstep.init(), on_5)
    assert nens(x).shape == (8, 4, 2)


def test_duplicate_devices_are_refused():
    d0 = jax.devices()[0]
    with pytest.raises(ValueError, match="more than once"):
        ensemble.build(nn.Dense(1), 2, devices=[d0, d0])


def test_another_ensembles_params_on_the_same_devices_in_another_order_are_one_line():
    """Same devices, another order (an ensemble built with devices=jax.devices()[::-1]): jit
    cannot mix the two device assignments, and its error names no fix. The fix the message
    gives for member-major state keeps the members split (not replicated on every device)."""
    import jax.numpy as jnp
    import optax

    x = jnp.ones((4, 3))
    theirs = ensemble.build(nn.Dense(2), 8, devices=jax.devices()[::-1])
    ours = ensemble.build(nn.Dense(2), 8)
    v = theirs.init(jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"variables\['params'\]\['bias'\] is on this ensemble's"):
        ours.apply(v, x)
    loss = lambda p, x: jnp.mean(ours.model.apply({"params": p}, x) ** 2)
    step = ours.train_step(loss, optax.adam(1e-3))
    with pytest.raises(ValueError, match=r"in another order .*shard_members\(x, ens\.mesh"):
        step(v["params"], step.init(ours.init(jax.random.key(0), x)["params"]), x)
    params = ensemble.sharding.shard_members(v["params"], ours.mesh, ours.n)  # the fix
    params, _, _ = step(params, step.init(params), x)
    ensemble.debug.assert_no_replicated_members(params, ours.n)
    # Per-member keys there: a typed key has no NumPy form, so np.asarray is not offered.
    keys = jax.device_put(jax.random.split(jax.random.key(0), 8), theirs.mesh.devices.flat[0])
    keyed = ours.train_step(lambda p, x, k: loss(p, x), optax.adam(1e-3), per_member_batch=True)
    with pytest.raises(ValueError, match=r"batch argument 1 is committed .*; move it there \("):
        keyed(params, keyed.init(params), jnp.ones((8, 4, 3)), keys)


def test_replicated_params_come_out_of_the_step_split_over_the_members():
    """Params replicated on the ensemble's mesh (jax.device_put(x, NamedSharding(mesh, P())))
    used to stay replicated step after step: every device held all n members."""
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding, PartitionSpec

    x = jnp.ones((4, 3))
    ens = ensemble.build(nn.Dense(2), 8)
    params = ens.init(jax.random.key(0), x)["params"]
    loss = lambda p, x: jnp.mean(ens.model.apply({"params": p}, x) ** 2)
    step = ens.train_step(loss, optax.adam(1e-3), donate=False)
    want, _, _ = step(params, step.init(params), x)
    copied = jax.device_put(params, NamedSharding(ens.mesh, PartitionSpec()))
    state = step.init(copied)
    ensemble.debug.assert_no_replicated_members(state, ens.n)
    got, state, _ = step(copied, state, x)
    ensemble.debug.assert_no_replicated_members((got, state), ens.n)
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, want
    )


def test_the_inputs_of_a_donated_step_that_failed_are_named_gone_with_what_to_do():
    """A step that failed while it ran (a host callback's error inside it: an on_cpu worker's)
    consumed its donated inputs; the next call's refusal said 'use the arrays that step
    returned', and a failed step returned none."""
    script = textwrap.dedent(
        """
        import jax
        jax.config.update("jax_num_cpu_devices", 2)
        import jax.numpy as jnp, numpy as np, flax.linen as nn, optax, ensemble

        def fail(x):
            raise RuntimeError("a worker failed")

        model = nn.Dense(1)
        ens = ensemble.build(model, 2)
        x = jnp.ones((4, 3))
        params = ens.init(jax.random.key(0), x)["params"]
        shape = jax.ShapeDtypeStruct((), jnp.float32)
        P = jax.sharding.PartitionSpec
        host = jax.shard_map(lambda v: jax.pure_callback(fail, shape, v), in_specs=P(),
                             out_specs=P(), axis_names={"data", "model"}, check_vma=False)
        loss = lambda p, x: jnp.mean(model.apply({"params": p}, x) ** 2) + host(x.sum())
        step = ens.train_step(loss, optax.sgd(0.1))
        opt_state = step.init(params)
        try:
            jax.block_until_ready(step(params, opt_state, x))
        except Exception as e:
            print("failed:", type(e).__name__)
        try:
            step(params, opt_state, x)
        except ValueError as e:
            print("next:", e)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], env=clean_env(), capture_output=True,
                         text=True, timeout=240)  # fmt: skip
    assert "failed: JaxRuntimeError" in out.stdout, out.stderr[-3000:]
    assert "a step that failed while it ran consumed its donated inputs too: keep a copy, " \
            "make the step with donate=False, or restore a checkpoint" in out.stdout  # fmt: skip
