"""What a new user tries that the other tests do not: each case a defect found that way, each
member checked against the plain model run one member at a time."""

import dataclasses
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import ensemble

D = 8  # conftest.py


class DictInputNNX(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l = nnx.Linear(3, 4, rngs=rngs)

    def __call__(self, inp):
        return self.l(inp["x"]) * inp["scale"]


class DictInput(nn.Module):
    @nn.compact
    def __call__(self, inp):
        return nn.Dense(4)(inp["x"]) * inp["scale"]


@pytest.mark.timeout(60)
def test_a_python_value_in_a_per_member_input_is_refused_not_broadcast():
    """in_axes=0 and a dict {'x': [n, ...] array, 'scale': 2.0}: NNX gave every member the
    whole [n, ...] array (outputs [n, n, ...], a loss reducing them a silent wrong number);
    a Python value cannot be split per member, so both adapters refuse it and say where."""
    x = jax.random.normal(jax.random.key(1), (D, 5, 3))
    nnx_ens = ensemble.build(DictInputNNX, D, rngs=0, in_axes=0)
    linen_ens = ensemble.build(DictInput(), D, in_axes=0)
    match = r"input 0 \(per-member\)\['scale'\] = 2.0 is a Python value"
    with pytest.raises(ValueError, match=match):
        nnx_ens({"x": x, "scale": 2.0})
    with pytest.raises(ValueError, match=match):
        nnx_ens.map(lambda m, inp: m(inp), {"x": x, "scale": 2.0})
    with pytest.raises(ValueError, match=match):
        linen_ens.init(0, {"x": x, "scale": 2.0})
    with pytest.raises(ValueError, match=r"input 1 \(per-member\) = True is a Python value"):
        nnx_ens(x, True)
    # Arrays only (the scale per member too), each member gets its own slice: the plain model.
    scale = jnp.arange(D, dtype=jnp.float32)
    out = nnx_ens({"x": x, "scale": scale})
    variables = linen_ens.init(0, {"x": x, "scale": scale})
    linen_out = linen_ens.apply(variables, {"x": x, "scale": scale})
    assert out.shape == linen_out.shape == (D, 5, 4)
    for i in range(D):
        inp = {"x": x[i], "scale": scale[i]}
        np.testing.assert_allclose(out[i], nnx_ens.member(i)(inp), rtol=1e-5, atol=1e-6)
        ref = linen_ens.model.apply(linen_ens.member(variables, i), inp)
        np.testing.assert_allclose(linen_out[i], ref, rtol=1e-5, atol=1e-6)
    # Shared (in_axes=None), a Python value beside arrays still reaches every member as is.
    shared = ensemble.build(DictInputNNX, D, rngs=0)
    out = shared({"x": x[0], "scale": 2.0})
    np.testing.assert_allclose(out[3], shared.member(3)({"x": x[0], "scale": 2.0}), rtol=1e-5)


@pytest.mark.timeout(60)
def test_an_nnx_rngs_passed_positionally_to_a_per_member_ensemble_splits_per_member():
    class Drop(nnx.Module):
        def __init__(self, rngs):
            self.l = nnx.Linear(3, 16, rngs=rngs)
            self.drop = nnx.Dropout(0.5)

        def __call__(self, x, rngs=None):
            return self.drop(self.l(x), rngs=rngs)

    ens = ensemble.build(Drop, D, in_axes=0)
    x = jax.random.normal(jax.random.key(0), (D, 2, 3))
    out = ens(x, nnx.Rngs(dropout=5))
    keys = jax.random.split(nnx.Rngs(dropout=5)["dropout"](), D)
    for i in range(D):
        ref = ens.member(i)(x[i], rngs=nnx.Rngs(dropout=keys[i]))
        np.testing.assert_allclose(out[i], ref, rtol=1e-5, atol=1e-6)


class Printing(nn.Module):
    @nn.compact
    def __call__(self, x):
        y = nn.Dense(2)(x)
        jax.debug.print("sum {s}", s=y.sum())
        return y


class PrintingNNX(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l = nnx.Linear(3, 2, rngs=rngs)

    def __call__(self, x):
        y = self.l(x)
        jax.debug.callback(lambda a: None, y)
        return y


@pytest.mark.timeout(60)
def test_a_debug_print_inside_a_member_is_named_with_what_to_do():
    """jax 0.10.2 cannot lower jax.debug.print / callback in a member's partly manual
    shard_map (a bare TypeError from lax.axis_index); every entry point says what it is."""
    match = r"jax.debug.print / jax.debug.callback inside an ensemble member.*ens.member"
    x = jnp.ones((1, 3))
    ens = ensemble.build(Printing(), D)
    with pytest.raises(TypeError, match=match):
        ens.init(0, x)
    variables = {"params": {"Dense_0": ensemble.build(nn.Dense(2), D).init(0, x)["params"]}}
    with pytest.raises(TypeError, match=match):
        ens.apply(variables, x)
    step = ens.train_step(lambda p, x: ens.model.apply({"params": p}, x).mean(), optax.sgd(0.1))
    with pytest.raises(TypeError, match=match):
        step(variables["params"], step.init(variables["params"]), x)
    nnx_ens = ensemble.build(PrintingNNX, D)
    with pytest.raises(TypeError, match=match):
        nnx_ens(x)
    with pytest.raises(TypeError, match=match):
        nnx_ens.map(lambda m, x: m(x), x)
    nnx_step = nnx_ens.train_step(lambda m, x: m(x).mean(), optax.sgd(0.1))
    with pytest.raises(TypeError, match=match):
        nnx_step(nnx_ens, nnx_step.init(), x)


class HostCallback(nn.Module):
    @nn.compact
    def __call__(self, x):
        y = nn.Dense(2)(x)
        return jax.pure_callback(np.tanh, jax.ShapeDtypeStruct(y.shape, y.dtype), y,
                                 vmap_method="sequential")  # fmt: skip


class HostCallbackNNX(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l = nnx.Linear(3, 2, rngs=rngs)

    def __call__(self, x):
        from jax.experimental import io_callback

        y = self.l(x)
        return io_callback(np.tanh, jax.ShapeDtypeStruct(y.shape, y.dtype), y)


@pytest.mark.timeout(60)
def test_a_host_callback_inside_a_member_is_named_with_what_to_do():
    """JAX compiles host callbacks only where every mesh axis is manual: inside a member it
    raised 'callbacks are only supported in spmd computations when all mesh axes are
    partitioned manually', naming neither the ensemble nor a way out."""
    match = r"pure_callback / io_callback inside an ensemble member .* stacked outputs"
    x = jnp.ones((1, 3))
    variables = {"params": {"Dense_0": ensemble.build(nn.Dense(2), D).init(0, x)["params"]}}
    with pytest.raises(NotImplementedError, match=match):
        ensemble.build(HostCallback(), D).apply(variables, x)
    with pytest.raises(NotImplementedError, match=match):
        ensemble.build(HostCallbackNNX, D)(x)


def linear(rngs: nnx.Rngs) -> nnx.Module:
    return nnx.Linear(3, 2, rngs=rngs)


@pytest.mark.timeout(60)
def test_an_optimizer_of_an_ensemble_of_another_n_is_named():
    """It failed inside optax, naming the value= argument the step passes itself."""
    ens, other = ensemble.build(linear, D, rngs=0), ensemble.build(linear, 2 * D, rngs=0)
    step = ens.train_step(lambda m, x: m(x).mean(), optax.adam(0.1))
    with pytest.raises(ValueError, match=r"opt_state.*n=16. The optimizer was made for another"):
        step(other, step.init(), jnp.ones((1, 3)))
    sgd = ens.train_step(lambda m, x: m(x).mean(), optax.sgd(0.1))  # no state to read n off
    with pytest.raises(ValueError, match=r"this\s+optimizer was made for n=8 members"):
        sgd(other, sgd.init(), jnp.ones((1, 3)))


@pytest.mark.timeout(60)
def test_a_factory_that_ignores_its_rngs_warns_that_the_members_are_copies():
    """lambda rngs: nnx.Linear(3, 2, rngs=nnx.Rngs(0)) made n identical members silently."""
    with pytest.warns(UserWarning, match="all 8 members are the same model") as seen:
        ens = ensemble.build(lambda rngs: nnx.Linear(3, 2, rngs=nnx.Rngs(0)), D)
    assert seen[0].filename == __file__  # the user's line
    kernel = np.asarray(ens.members.kernel[...])
    np.testing.assert_array_equal(kernel[0], kernel[1])  # what the warning says

    class ReadsKey(nnx.Module):  # reads the key without drawing: members differ, no warning
        def __init__(self, rngs: nnx.Rngs):
            self.w = nnx.Param(jax.random.normal(rngs.params.key[...], (3,)))

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ensemble.build(linear, D)
        ensemble.build(
            lambda rngs: nnx.Linear(3, 2, kernel_init=nnx.initializers.zeros, rngs=rngs), D
        )
        ensemble.build(lambda rngs: nnx.BatchNorm(3, rngs=rngs), D)
        ensemble.build(ReadsKey, D)


class Encoder(nn.Module):
    def setup(self):
        self.enc = nn.Dense(3)

    def encode(self, x):
        return self.enc(x) * 2.0

    def __call__(self, x):
        return self.enc(x)


@pytest.mark.timeout(60)
def test_a_lambda_method_per_call_warns_and_compiled_programs_do_not_pile_up():
    """ens.apply(v, x, method=lambda m, x: m.encode(x)) in a loop compiled (and kept) one
    program per call: host memory grew without end. Now at most cache.size are kept (the
    dropped ones are freed) and a warning says why each call compiles."""
    import gc
    import weakref

    ens = ensemble.build(Encoder(), D)
    x = jnp.ones((2, 3))
    variables = ens.init(0, x)
    ens._cache.size = 3
    with pytest.warns(UserWarning, match="new function object|compiled its 4th") as record:
        outs = [ens.apply(variables, x, method=lambda m, x: m.encode(x)) for _ in range(6)]
    assert len([w for w in record if "new function object" in str(w.message)]) == 1  # once
    assert len([w for w in record if "compiled its 4th program" in str(w.message)]) == 1
    assert {w.filename for w in record} == {__file__}  # the user's line
    assert len(ens._cache) == 3
    first = weakref.ref(next(iter(ens._cache.values())))
    for _ in range(3):
        ens.apply(variables, x, method=lambda m, x: m.encode(x))
    gc.collect()
    assert first() is None  # dropped from the cache and freed
    ref = ens.model.apply(ens.member(variables, 5), x, method=Encoder.encode)
    for out in outs:
        np.testing.assert_allclose(out[5], ref, rtol=1e-6)


class Scaled(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l = nnx.Linear(3, 2, rngs=rngs)

    def __call__(self, x, scale=1.0):
        return self.l(x) * scale


@pytest.mark.timeout(60)
def test_a_python_number_new_every_call_keeps_a_bounded_number_of_nnx_programs(monkeypatch):
    """ens(x, scale=float(t)) compiled one program per value and kept them all (host memory
    grew ~1.7 MB a call, calls slowed down); now the least recently used are dropped, with
    one warning saying to pass the number as an array."""
    from ensemble import _nnx

    monkeypatch.setattr(_nnx, "_PROGRAMS_KEPT", 3)
    ens = ensemble.build(Scaled, D)
    x = jnp.ones((2, 3))
    with pytest.warns(UserWarning, match="compiled its 4th program") as record:
        outs = [ens(x, scale=float(t)) for t in range(6)]
    assert len(record) == 1 and len(_nnx._PROGRAMS[ens]) == 3
    assert record[0].filename == __file__
    ref = ens.member(2)(x)
    for t, out in enumerate(outs):
        np.testing.assert_allclose(out[2], ref * t, rtol=1e-6)
    np.testing.assert_allclose(ens(x, scale=0.0)[2], 0.0)  # dropped, compiled again: same
    # Kept per ensemble: other ensembles' programs neither count nor push these out.
    others = [ensemble.build(Scaled, D) for _ in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for other in others:
            other(x, scale=1.0)


class _TupleCarry(nnx.Module):
    def __init__(self, rngs):
        self.l = nnx.Linear(2, 2, rngs=rngs)
        self.carry = nnx.Cache((jnp.zeros(2), jnp.zeros(2)))  # an LSTM-style (h, c)

    def __call__(self, x):
        h, c = self.carry.get_value()
        y = self.l(x) + h
        self.carry.set_value((y, c + 1))
        return y


def test_a_variable_holding_a_tuple_of_arrays_is_refused_at_build():
    # Every call crashed on an assert; under python -O the changes went to other Variables
    # (the counter's increment into l.bias). One array per Variable is what members need.
    with pytest.raises(TypeError, match=r"tuple of arrays in the Cache 'carry'.*nnx.Cache\(h\)"):
        ensemble.build(_TupleCarry, 4, rngs=0)


def test_a_plain_nnx_optimizer_is_refused_by_the_train_step():
    # Its tx saw every member at once: clip_by_global_norm clipped each member by the norm over
    # all of them, silently (member 0 off by 0.024 after one step against the plain model).
    ens = ensemble.build(lambda rngs: nnx.Linear(3, 2, rngs=rngs), 4, rngs=0)
    tx = optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(1.0))
    step = ens.train_step(lambda m, x: jnp.mean(m(x) ** 2), tx)
    x = jnp.ones((5, 3))
    with pytest.raises(ValueError, match=r"not made with ensemble.nnx_optimizer"):
        step(ens, nnx.Optimizer(ens, tx, wrt=nnx.Param), x)
    step(ens, step.init(), x)  # the optimizer the step makes is per member


class LogNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.log(nn.Dense(1)(x))  # NaN for the members whose output is negative


def test_op_by_op_runs_say_members_run_compiled():
    """Under jax.disable_jit(), and when jax_debug_nans re-runs a call op by op to find a NaN,
    every ensemble call failed with shard_map's 'out_specs ... must refer to an axis marked as
    manual' (a real NaN hid behind it)."""
    ens = ensemble.build(LogNet(), D)
    x = jnp.ones((4, 3))
    variables = ens.init(jax.random.key(0), x)
    assert np.isnan(np.asarray(ens.apply(variables, x))).any()  # some members make a NaN
    nnx_ens = ensemble.build(linear, D)
    with jax.disable_jit():
        for call in (lambda: ens.apply(variables, x), lambda: nnx_ens(x)):
            with pytest.raises(RuntimeError, match=r"^ensemble calls run compiled only .*"):
                call()
    with jax.debug_nans(True):
        with pytest.raises(FloatingPointError, match=r"output holds a NaN or an inf\. .*"):
            ens.apply(variables, x)
        assert nnx_ens(x).shape == (D, 4, 2)  # calls without a NaN run as before


@dataclasses.dataclass(frozen=True)
class Cfg:
    scale: float


class Scales(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l = nnx.Linear(2, 2, rngs=rngs)

    def __call__(self, x, cfg, eps):
        return self.l(x), jnp.arange(3) * cfg.scale, 1.0 / jnp.asarray(eps)


def test_static_values_equal_in_python_but_not_to_the_model_compile_apart():
    """A numpy or bfloat16 -0.0 (equal to 0.0) and a frozen dataclass of 1 vs 1.0 reused the
    program compiled for the other: 1 / eps was inf for -0.0, arange * scale int32 for 1.0."""
    import ml_dtypes

    ens = ensemble.build(Scales, D)
    plain = ens.member(0)
    x = jnp.ones((1, 2))
    for cfg, eps in [(Cfg(1), np.float32(0.0)), (Cfg(1.0), np.float32(-0.0)),
                     (Cfg(1.0), ml_dtypes.bfloat16(-0.0)), (Cfg(1.0), ml_dtypes.bfloat16(0.0)),
                     (Cfg(-0.0), float("nan"))]:  # fmt: skip
        _, scaled, inv = ens(x, cfg, eps)
        _, want_scaled, want_inv = plain(x, cfg, eps)
        assert scaled.dtype == want_scaled.dtype, (cfg, eps)
        np.testing.assert_array_equal(scaled[0], want_scaled)
        np.testing.assert_array_equal(inv[0], want_inv)


def test_an_nnx_rngs_inside_a_container_input_is_refused_in_one_line():
    """It reached the module as the library's internal key holder: 'rngs must be a Rngs'."""
    ens = ensemble.build(linear, D)
    with pytest.raises(TypeError, match=r"^an nnx.Rngs inside a container input .* own"):
        ens(jnp.ones((2, 3)), {"rngs": nnx.Rngs(dropout=1)})


def test_a_python_flag_passed_to_a_train_step_says_to_close_over_it():
    """The train steps trace their batch arguments (as jax.jit does); a mode string failed in
    JAX's argument parsing and an ``if train:`` in a TracerBoolConversionError naming the
    library's internals, neither saying what to do."""
    import functools

    import flax.linen as nn
    import optax
    from flax import nnx

    model = nn.Dense(2)
    ens = ensemble.build(model, 4)
    x = jnp.ones((3, 5))
    params = ens.init(jax.random.key(0), x)["params"]

    def loss_fn(p, x, train):
        out = model.apply({"params": p}, x)
        return jnp.mean((out if train else 2 * out) ** 2)

    step = ens.train_step(loss_fn, optax.sgd(0.1), donate=False)
    state = step.init(params)
    for flag, match in ((False, "a Python bool is among the batch arguments: if the loss branches"),
                        ("eval", r"batch argument 1 = 'eval' is a string")):  # fmt: skip
        with pytest.raises(TypeError, match=match):
            step(params, state, x, flag)
    with pytest.raises(TypeError, match=r"batch argument 1 = 'eval' is a string"):
        ensemble.compiled_memory(step, params, state, x, "eval")
    closed = ens.train_step(functools.partial(loss_fn, train=False), optax.sgd(0.1))
    assert closed(params, closed.init(params), x)[2].shape == (4,)  # the way out works
    nnx_ens = ensemble.build(lambda rngs: nnx.Linear(5, 2, rngs=rngs), 4)
    nnx_step = nnx_ens.train_step(lambda m, x, mode: jnp.mean(m(x) ** 2), optax.sgd(0.1))
    with pytest.raises(TypeError, match=r"batch argument 1 = 'eval' is a string"):
        nnx_step(nnx_ens, nnx_step.init(), x, "eval")
