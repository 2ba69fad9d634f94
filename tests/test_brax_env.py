"""Brax envs on the functional env API: the adapter against Brax called directly, and the learner
training ``brax:`` ids (the optional ``[brax]`` extra; skipped where it is not installed)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollout import envs

pytest.importorskip("brax")
from brax import envs as brax_envs

# The spring backend compiles fastest of Brax's three; the adapter passes it through.
KW = dict(backend="spring")


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not actively being maintained.*")
        yield


@pytest.mark.timeout(180)
def test_adapter_equals_brax_called_directly_and_splits_the_time_limit():
    T, B, limit = 40, 3, 7
    env = envs.make("brax:inverted_pendulum", auto_reset=False, episode_length=limit, **KW)
    benv = brax_envs.get_environment("inverted_pendulum", **KW)
    keys = jax.random.split(jax.random.key(0), B)
    actions = jax.random.uniform(jax.random.key(1), (T, B, 1), minval=-1.0, maxval=1.0)

    @jax.jit
    def both(keys, actions):
        state, obs0 = jax.vmap(env.reset)(keys)
        bstate = jax.vmap(benv.reset)(keys)

        def step(carry, a):
            state, bstate = carry
            state, obs, reward, term, trunc, _ = jax.vmap(env.step)(state, a, keys)
            bstate = jax.vmap(benv.step)(bstate, a)
            return (state, bstate), (obs, reward, term, trunc, bstate.obs, bstate.reward,
                                     bstate.done)  # fmt: skip

        return obs0, bstate.obs, jax.lax.scan(step, (state, bstate), actions)[1]

    obs0, bobs0, (obs, reward, term, trunc, bobs, breward, bdone) = both(keys, actions)
    np.testing.assert_array_equal(obs0, bobs0)
    np.testing.assert_allclose(obs, bobs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(reward, breward, rtol=1e-6)
    np.testing.assert_array_equal(term, np.asarray(bdone) > 0)  # Brax's done is termination
    # The limit is the adapter's own: truncated exactly at step `limit` unless already done.
    t = np.arange(1, T + 1)[:, None]
    np.testing.assert_array_equal(trunc, (t >= limit) & ~np.asarray(term))
    assert np.asarray(term).any() and np.asarray(trunc).any()  # both ways of ending happened
    assert env.observation_space.shape == (benv.observation_size,)
    assert env.action_space.shape == (benv.action_size,) and env.max_episode_steps == limit


def test_the_spaces_come_from_a_trace_not_an_eager_reset():
    """Brax's own ``observation_size`` runs ``reset`` op by op (11 s for the generalized
    backend); the adapter only traces it, once."""
    env = envs.make("brax:inverted_pendulum", **KW)
    with jax.transfer_guard("disallow"):  # an eager reset moves its constants to the device
        assert env.observation_space.shape == (4,) and env.action_space.shape == (1,)


def test_bad_brax_ids_and_kwargs_are_one_line():
    with pytest.raises(ValueError, match=r"unknown brax env 'nope'; registered: .*ant"):
        envs.make("brax:nope")
    # Not cut to an int: 2.9 would end every episode after 2 steps, 0.5 be refused as "got 0".
    for bad in (0, 0.5, 2.9, True, "100"):
        with pytest.raises(ValueError, match=r"episode_length must be a positive int, got"):
            envs.make("brax:ant", episode_length=bad)


@pytest.mark.timeout(240)
def test_learner_trains_a_brax_id_per_member():
    from rollout.ppo import Learner, PPOConfig

    cfg = PPOConfig.for_env(
        "brax:inverted_pendulum", members=2, num_envs=2, num_steps=16, num_minibatches=2,
        update_epochs=1, total_steps=64, updates_per_call=2,
    )  # fmt: skip
    assert cfg.learning_rate == 3e-4  # continuous actions: CleanRL's ppo_continuous_action
    env = envs.make("brax:inverted_pendulum", episode_length=20, **KW)
    learner = Learner(cfg, env=env, devices=jax.devices()[:2])
    state = learner.init()
    # Each member resets its own envs: the members' first observations (the learner's, not a
    # reset of keys split here) differ.
    obs = np.asarray(state.members.obs)
    assert obs.shape == (2, 2, 4) and not np.allclose(obs[0], obs[1])
    state, metrics = learner.update(state, 2)
    returns, episodes = np.asarray(metrics["returns"]), np.asarray(metrics["episodes"])
    assert returns.shape == (2, 2) and episodes.sum() > 0
    assert np.isfinite(returns[episodes > 0]).all()
    assert jnp.isfinite(jnp.asarray(metrics["policy_loss"])).all()
