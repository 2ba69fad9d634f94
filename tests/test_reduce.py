"""Reductions over the member axis against NumPy references, on member-sharded arrays."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ensemble

N = 8


@pytest.fixture(scope="module")
def logits():
    mesh = ensemble.make_mesh(N)
    x = np.random.default_rng(0).normal(size=(N, 5, 4)).astype(np.float32)
    return np.asarray(x), ensemble.shard_members(x, mesh, N)


def test_mean_and_variance(logits):
    ref, y = logits
    np.testing.assert_allclose(ensemble.mean(y), ref.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ensemble.variance(y), ref.var(0), rtol=1e-5)
    np.testing.assert_allclose(ensemble.variance(y, ddof=1), ref.var(0, ddof=1), rtol=1e-5)
    jitted = jax.jit(ensemble.mean)(y)
    np.testing.assert_allclose(jitted, ref.mean(0), rtol=1e-5, atol=1e-6)
    traced = jax.jit(lambda y, d: ensemble.variance(y, ddof=d))(y, 1)  # as jnp.var takes it
    np.testing.assert_allclose(traced, ref.var(0, ddof=1), rtol=1e-5)


def test_log_mean_exp_matches_numpy_and_is_stable(logits):
    _, y = logits
    log_probs = jax.nn.log_softmax(y, axis=-1)
    expected = np.log(np.mean(np.exp(np.asarray(log_probs, np.float64)), axis=0))
    np.testing.assert_allclose(ensemble.log_mean_exp(log_probs), expected, rtol=1e-5)
    tiny = jnp.array([[-1000.0, -2000.0], [-1001.0, -2000.0]])
    out = ensemble.log_mean_exp(tiny)
    np.testing.assert_allclose(out, [-1000.0 + np.log((1 + np.exp(-1.0)) / 2), -2000.0], rtol=1e-6)
    assert np.all(np.isfinite(out))
    # float16 holds no log(65536), nor a sum of 70000 ones: computed wider, returned as given.
    many = ensemble.log_mean_exp(jnp.full((70000, 2), -1.0, jnp.float16))
    assert many.dtype == jnp.float16 and many.tolist() == [-1.0, -1.0]
    # Integer log-probabilities come back as floats (cast back to int32, -1.38 was -1).
    ints = ensemble.log_mean_exp(jnp.array([[-1, -3], [-2, -3]]))
    assert ints.dtype == jnp.float32
    np.testing.assert_allclose(ints, [np.log((np.exp(-1) + np.exp(-2)) / 2), -3.0], rtol=1e-6)


def test_disagreement_is_fraction_disagreeing_with_mean_probability_argmax(logits):
    ref, y = logits
    probs = np.exp(ref) / np.exp(ref).sum(-1, keepdims=True)
    ensemble_top = probs.mean(0).argmax(-1)
    expected = (ref.argmax(-1) != ensemble_top[None]).mean(0)
    np.testing.assert_allclose(ensemble.disagreement(y), expected)
    agree = jnp.broadcast_to(jnp.array([0.0, 5.0, 1.0]), (N, 2, 3))
    np.testing.assert_array_equal(ensemble.disagreement(agree), [0.0, 0.0])


def test_disagreement_of_bfloat16_logits_follows_the_definition():
    # bfloat16 mean probabilities tie (argmax: the first) where the definition's differ.
    x = np.random.default_rng(0).normal(size=(N, 2000, 10)).astype(jnp.bfloat16)
    ref = np.asarray(x, np.float64)
    probs = np.exp(ref) / np.exp(ref).sum(-1, keepdims=True)
    expected = (ref.argmax(-1) != probs.mean(0).argmax(-1)[None]).mean(0)
    np.testing.assert_array_equal(ensemble.disagreement(jnp.asarray(x)), expected)


def test_disagreement_of_infinite_and_nan_logits():
    """softmax([0, inf]) is NaN in JAX, and argmax of a NaN row is class 0: a member certain of
    class 1 was read as voting for class 0 (1/3 instead of 2/3 below), and a diverged member's
    NaN logits as a vote for class 0 instead of a NaN result."""
    inf, nan = np.inf, np.nan
    certain = jnp.array([[[0.0, inf]], [[1.0, 0.0]], [[1.0, 0.0]]])
    p = np.array([[0.0, 1.0], *[np.exp([1.0, 0.0]) / np.exp([1.0, 0.0]).sum()] * 2])
    expected = np.mean(p.argmax(-1) != p.mean(0).argmax())  # 2/3: the mean's top class is 1
    np.testing.assert_allclose(ensemble.disagreement(certain), [expected], rtol=1e-6)
    tied = jnp.array([[[inf, inf, 0.0]], [[0.0, 0.0, 3.0]]])  # (.5, .5, 0) and ~(.05, .05, .9)
    np.testing.assert_allclose(ensemble.disagreement(tied), [0.5])
    for dead in ([nan, nan], [nan, 1.0], [-inf, -inf], [inf, nan]):  # no probabilities
        y = jnp.array([[dead, [0.0, 1.0]], [[0.0, 1.0]] * 2])  # examples: [dead, fine]
        np.testing.assert_array_equal(ensemble.disagreement(y), [nan, 0.0])


def test_member_slices_trees_and_defers_to_ensembles():
    tree = {"params": {"w": jnp.arange(12.0).reshape(4, 3), "b": jnp.arange(4.0)}}
    m = ensemble.member(tree, 2)
    np.testing.assert_array_equal(m["params"]["w"], [6.0, 7.0, 8.0])
    assert float(m["params"]["b"]) == 2.0
    np.testing.assert_array_equal(ensemble.member(tree, -1)["params"]["b"], 3.0)

    class Fake:
        def member(self, i):
            return ("member", i)

    assert ensemble.member(Fake(), 3) == ("member", 3)


def test_errors():
    with pytest.raises(ValueError, match="member axis first"):
        ensemble.mean(jnp.float32(1.0))
    with pytest.raises(ValueError, match=r"logits \[n, ..., classes\]"):
        ensemble.disagreement(jnp.ones(3))
    with pytest.raises(IndexError, match="out of range for n=4"):
        ensemble.member({"w": jnp.ones((4, 2))}, 4)
    with pytest.raises(ValueError, match="share a leading member axis"):
        ensemble.member({"w": jnp.ones((4, 2)), "b": jnp.ones((3,))}, 0)
    with pytest.raises(TypeError, match="must be an int"):
        ensemble.member({"w": jnp.ones((4, 2))}, 1.0)


@pytest.mark.parametrize("name", ["mean", "variance", "log_mean_exp", "disagreement"])
def test_each_reduction_is_one_compiled_program(name, caplog):
    """Called eagerly, the reductions ran op by op: 11-15 small compiles at each new shape and
    a 10x slower call than under jit."""
    import logging

    fn = getattr(ensemble, name)
    y = ensemble.shard_members(np.ones((N, 3, 7, 5), np.float32), ensemble.make_mesh(N), N)
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        jax.block_until_ready(fn(y))
    compiled = [r for r in caplog.records if "Finished XLA compilation" in r.getMessage()]
    assert len(compiled) <= 1, [r.getMessage() for r in compiled]
