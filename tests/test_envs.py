"""rollout.envs: parity with gymnasium, auto-reset, batching, the audio env, make()."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util

import gymnasium as gym
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollout import envs

KEY = jax.random.key(0)

# Parity tolerances. gymnasium keeps its state in float64 and returns float32 observations; our
# ports compute in float32. "lockstep" copies our state into gymnasium before every step (the
# float32 values are exact in float64), so only one step of rounding separates the two;
# "free" runs both from the same initial state without resyncing, where rounding accumulates.
LOCKSTEP = dict(rtol=1e-5, atol=1e-6)
FREE = dict(rtol=1e-4, atol=1e-5)
FREE_STEPS = 40


def _cartpole_to_gym(state: envs.CartPoleState) -> np.ndarray:
    return np.array([state.x, state.x_dot, state.theta, state.theta_dot], np.float64)


def _pendulum_to_gym(state: envs.PendulumState) -> np.ndarray:
    return np.array([state.theta, state.theta_dot], np.float64)


def _state_from_gym(cls, values) -> tuple:
    return cls(*[jnp.float32(v) for v in values], jnp.int32(0))


def _balance(state: np.ndarray) -> int:
    """A linear controller that keeps CartPole up for 500 steps (reaches the time limit)."""
    x, x_dot, theta, theta_dot = state
    return int(10.0 * theta + theta_dot + 0.1 * x + 0.5 * x_dot > 0)


@functools.cache
def _jit_step(env: envs.Env):
    """One compiled step per env config, shared by every test."""
    return jax.jit(env.step)


def _run_parity(env, gym_id, state_cls, to_gym, policy, seed, lockstep, max_steps=600):
    """Steps `env` and gymnasium side by side; compares everything; returns steps and flags."""
    genv = gym.make(gym_id)
    gobs, _ = genv.reset(seed=seed)
    state = _state_from_gym(state_cls, genv.unwrapped.state)
    np.testing.assert_allclose(np.asarray(env.observation(state)), gobs, **LOCKSTEP)
    step = _jit_step(env)
    rng = np.random.default_rng(seed)
    tol = LOCKSTEP if lockstep else FREE
    for i in range(max_steps):
        if lockstep:
            genv.unwrapped.state = to_gym(state)
        action = policy(to_gym(state), rng, i)
        gobs, greward, gterm, gtrunc, _ = genv.step(action)
        state, obs, reward, term, trunc, _ = step(state, jnp.asarray(action), KEY)
        assert obs.dtype == jnp.float32 and obs.shape == gobs.shape
        np.testing.assert_allclose(np.asarray(obs), gobs, **tol, err_msg=f"step {i}")
        np.testing.assert_allclose(float(reward), greward, **tol, err_msg=f"step {i}")
        assert (bool(term), bool(trunc)) == (gterm, gtrunc), f"step {i}"
        assert int(state.t) == i + 1
        if gterm or gtrunc or (not lockstep and i + 1 >= FREE_STEPS):
            return i + 1, gterm, gtrunc
    raise AssertionError("episode did not end")


# ------------------------------------------------------------------------------------------
# CartPole
# ------------------------------------------------------------------------------------------

CARTPOLE_POLICIES = {
    "random": lambda s, rng, i: int(rng.integers(2)),
    "left": lambda s, rng, i: 0,
    "right": lambda s, rng, i: 1,
    "alternate": lambda s, rng, i: i % 2,
}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("policy", sorted(CARTPOLE_POLICIES))
def test_cartpole_matches_gymnasium_until_termination(seed, policy):
    env = envs.CartPole()
    for lockstep in (False, True):
        steps, term, trunc = _run_parity(
            env,
            "CartPole-v1",
            envs.CartPoleState,
            _cartpole_to_gym,
            CARTPOLE_POLICIES[policy],
            seed,
            lockstep,
        )
        if lockstep or steps < FREE_STEPS:
            assert term and not trunc


@pytest.mark.parametrize("seed", [0, 1])
def test_cartpole_matches_gymnasium_through_truncation_at_500(seed):
    # Mostly a balancing controller, with 10% random pushes.
    def policy(s, rng, i):
        return int(rng.integers(2)) if rng.random() < 0.1 else _balance(s)

    steps, term, trunc = _run_parity(
        envs.CartPole(), "CartPole-v1", envs.CartPoleState, _cartpole_to_gym, policy, seed, True
    )
    assert (steps, term, trunc) == (500, False, True)


def test_cartpole_terminates_at_the_cart_threshold_like_gymnasium():
    env = envs.CartPole()
    genv = gym.make("CartPole-v1")
    for x, x_dot in [(2.39, 1.0), (-2.39, -1.0), (2.39, -1.0)]:
        genv.reset(seed=0)
        start = np.array([x, x_dot, 0.0, 0.0], np.float32).astype(np.float64)
        genv.unwrapped.state = start
        _, _, gterm, _, _ = genv.step(1)
        state = _state_from_gym(envs.CartPoleState, start)
        _, _, _, term, _, _ = env.step(state, jnp.int32(1), KEY)
        assert bool(term) == gterm


def test_cartpole_reset_distribution_and_spaces():
    env = envs.CartPole()
    states, obs = jax.vmap(env.reset)(jax.random.split(KEY, 2000))
    obs = np.asarray(obs)
    assert obs.dtype == np.float32 and obs.shape == (2000, 4)
    assert obs.min() >= -0.05 and obs.max() <= 0.05
    assert obs.min(0).max() < -0.045 and obs.max(0).min() > 0.045  # covers the whole range
    assert np.all(np.asarray(states.t) == 0)
    assert env.action_space == envs.Discrete(2) and env.action_space.num_actions == 2
    gspace = gym.make("CartPole-v1").observation_space
    assert env.observation_space.shape == gspace.shape
    np.testing.assert_array_equal(env.observation_space.high_array(), gspace.high)
    assert env.max_episode_steps == 500


def test_cartpole_sutton_barto_reward():
    env = envs.CartPole(sutton_barto_reward=True)
    genv = gym.make("CartPole-v1", sutton_barto_reward=True)
    genv.reset(seed=3)
    state = _state_from_gym(envs.CartPoleState, genv.unwrapped.state)
    while True:
        _, greward, gterm, _, _ = genv.step(1)
        state, _, reward, term, _, _ = env.step(state, jnp.int32(1), KEY)
        assert float(reward) == greward and bool(term) == gterm
        if gterm:
            break


@pytest.mark.parametrize("name", ["cartpole", "audio"])
def test_an_action_outside_the_discrete_space_is_an_error_or_nan_never_a_number(name):
    kwargs = {"light": True} if name == "audio" else {}
    env = envs.make(name, auto_reset=False, **kwargs)
    n = env.action_space.n
    state, _ = env.reset(KEY)
    for bad in (n, -1, 0.5):
        with pytest.raises(ValueError, match=rf"takes an integer action in \[0, {n}\), not "):
            env.step(state, bad, KEY)
    step = jax.jit(jax.vmap(env.step, in_axes=(None, 0, None)))
    actions = jnp.array([n, -1, *range(n)], jnp.int32)
    _, obs, reward, _, _, _ = step(state, actions, KEY)
    bad_rows = np.arange(len(actions)) < 2
    assert np.isnan(np.asarray(reward)[bad_rows]).all()
    assert np.isnan(np.asarray(obs)[bad_rows]).any(axis=1).all()
    assert np.isfinite(np.asarray(reward)[~bad_rows]).all()
    assert np.isfinite(np.asarray(obs)[~bad_rows]).all()


# ------------------------------------------------------------------------------------------
# Pendulum
# ------------------------------------------------------------------------------------------

PENDULUM_POLICIES = {
    "random": lambda s, rng, i: rng.uniform(-2.0, 2.0, (1,)).astype(np.float32),
    "clipped": lambda s, rng, i: rng.uniform(-10.0, 10.0, (1,)).astype(np.float32),
    "max": lambda s, rng, i: np.array([2.0], np.float32),
    "min": lambda s, rng, i: np.array([-2.5], np.float32),  # clipped to -2
    "zero": lambda s, rng, i: np.zeros((1,), np.float32),
}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("policy", sorted(PENDULUM_POLICIES))
def test_pendulum_matches_gymnasium_through_truncation_at_200(seed, policy):
    env = envs.Pendulum()
    steps, term, trunc = _run_parity(
        env, "Pendulum-v1", envs.PendulumState, _pendulum_to_gym, PENDULUM_POLICIES[policy],
        seed, lockstep=True,
    )  # fmt: skip
    assert (steps, term, trunc) == (200, False, True)
    steps, _, _ = _run_parity(
        env, "Pendulum-v1", envs.PendulumState, _pendulum_to_gym, PENDULUM_POLICIES[policy],
        seed, lockstep=False,
    )  # fmt: skip
    assert steps == FREE_STEPS


def test_pendulum_speed_clip_and_angle_normalisation():
    env = envs.Pendulum()
    genv = gym.make("Pendulum-v1")
    genv.reset(seed=0)
    for theta, theta_dot in [(3.1, 7.99), (-3.1, -7.99), (13.0, 0.5), (-20.0, -3.0)]:
        start = np.array([theta, theta_dot], np.float32).astype(np.float64)
        genv.unwrapped.state = start
        gobs, greward, _, _, _ = genv.step(np.array([2.0], np.float32))
        state = _state_from_gym(envs.PendulumState, start)
        _, obs, reward, _, _, _ = env.step(state, jnp.array([2.0]), KEY)
        np.testing.assert_allclose(np.asarray(obs), gobs, **LOCKSTEP)
        np.testing.assert_allclose(float(reward), greward, **LOCKSTEP)
    # a scalar action works too
    state = _state_from_gym(envs.PendulumState, [0.5, 0.1])
    a = env.step(state, jnp.float32(1.0), KEY)[1]
    b = env.step(state, jnp.array([1.0]), KEY)[1]
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_pendulum_reset_distribution_and_spaces():
    env = envs.Pendulum()
    states, obs = jax.vmap(env.reset)(jax.random.split(KEY, 2000))
    theta, theta_dot = np.asarray(states.theta), np.asarray(states.theta_dot)
    assert np.abs(theta).max() <= np.float32(np.pi) and np.abs(theta).max() > 3.0
    assert np.abs(theta_dot).max() <= 1.0 and np.abs(theta_dot).max() > 0.99
    assert np.asarray(obs).shape == (2000, 3) and obs.dtype == jnp.float32
    space = env.action_space
    assert isinstance(space, envs.Box) and space.shape == (1,)
    assert space.low == (-2.0,) and space.high == (2.0,)
    assert env.max_episode_steps == 200


# ------------------------------------------------------------------------------------------
# Auto-reset and batching
# ------------------------------------------------------------------------------------------


def test_auto_reset_keeps_the_true_final_observation():
    env = envs.make("cartpole")
    bare = env.unwrapped
    assert isinstance(env, envs.AutoReset) and isinstance(bare, envs.CartPole)
    state, obs = env.reset(KEY)
    step = jax.jit(env.step)
    key = jax.random.key(1)
    for i in range(1, 100):
        key, k = jax.random.split(key)
        expected = bare.step(state.env_state, jnp.int32(1), k)
        state, obs, _, term, _, info = step(state, jnp.int32(1), k)
        final_obs = np.asarray(info["final_obs"])
        np.testing.assert_allclose(final_obs, np.asarray(expected[1]), **LOCKSTEP)
        assert int(info["episode_length"]) == i and float(info["episode_return"]) == i
        assert bool(info["done"]) == bool(term) == bool(expected[3])
        if bool(info["done"]):
            break
    else:
        raise AssertionError("pushing right always should terminate")
    # the returned state/obs are a fresh episode: the reset with the second half of the key
    reset_state, reset_obs = bare.reset(jax.random.split(k)[1])
    np.testing.assert_allclose(np.asarray(obs), np.asarray(reset_obs), **LOCKSTEP)
    np.testing.assert_allclose(np.asarray(state.env_state.x), np.asarray(reset_state.x), **LOCKSTEP)
    assert int(state.env_state.t) == 0 and int(state.episode_length) == 0
    assert float(state.episode_return) == 0.0
    assert not np.allclose(np.asarray(info["final_obs"]), np.asarray(obs))


def test_vmap_64_envs_under_jit_with_truncation():
    env = envs.make("pendulum")
    n, steps = 64, 450

    @jax.jit
    def run(key):
        state, _ = jax.vmap(env.reset)(jax.random.split(key, n))

        def body(state, key):
            k_act, k_step = jax.random.split(key)
            actions = jax.random.uniform(k_act, (n, 1), minval=-2.0, maxval=2.0)
            state, obs, reward, term, trunc, info = jax.vmap(env.step)(
                state, actions, jax.random.split(k_step, n)
            )
            return state, (obs, reward, term, trunc, info)

        return jax.lax.scan(body, state, jax.random.split(key, steps))

    state, (obs, reward, term, _, info) = run(KEY)
    assert obs.shape == (steps, n, 3) and reward.shape == (steps, n)
    done = np.asarray(info["done"])
    # every env truncates exactly at 200 and 400, never terminates
    assert not np.asarray(term).any()
    assert set(np.nonzero(done)[0].tolist()) == {199, 399} and done[[199, 399]].all()
    assert np.all(np.asarray(info["episode_length"])[done] == 200)
    np.testing.assert_allclose(
        np.asarray(info["episode_return"])[199],
        np.asarray(reward)[:200].sum(0),
        rtol=1e-5,
    )
    assert np.all(np.asarray(state.env_state.t) == steps - 400)


def test_vmap_cartpole_episode_statistics():
    env = envs.make("CartPole-v1")
    n, steps = 64, 300
    keys = jax.random.split(KEY, n)
    state, _ = jax.vmap(env.reset)(keys)

    def body(state, key):
        k_act, k_step = jax.random.split(key)
        actions = jax.random.randint(k_act, (n,), 0, 2)
        state, _, _, _, _, info = jax.vmap(env.step)(state, actions, jax.random.split(k_step, n))
        return state, (info["done"], info["episode_return"], info["episode_length"])

    run = jax.jit(lambda s: jax.lax.scan(body, s, jax.random.split(KEY, steps)))
    _, (done, ret, length) = run(state)
    done, ret, length = np.asarray(done), np.asarray(ret), np.asarray(length)
    assert done.sum() > 200  # random play ends episodes after about 20 steps
    np.testing.assert_array_equal(ret[done], length[done].astype(np.float32))
    assert 8 < ret[done].mean() < 40


# ------------------------------------------------------------------------------------------
# make()
# ------------------------------------------------------------------------------------------


def test_make_names_and_errors():
    assert isinstance(envs.make("CartPole-v1", auto_reset=False), envs.CartPole)
    assert isinstance(envs.make("pendulum", auto_reset=False), envs.Pendulum)
    assert envs.make("Pendulum-v1", g=9.81).unwrapped.g == 9.81
    assert envs.make("cartpole", max_episode_steps=7).max_episode_steps == 7
    with pytest.raises(ValueError, match=r"unknown env 'MountainCar-v0'.*cartpole.*Pendulum-v1"):
        envs.make("MountainCar-v0")
    with pytest.raises(TypeError):
        envs.make("cartpole", not_a_field=1)
    for limit in (0, -5, 2.5):  # every step would be truncated (or the limit never reached)
        with pytest.raises(ValueError, match="max_episode_steps must be a positive int"):
            envs.make("pendulum", max_episode_steps=limit)
    # envs are hashable static config: usable as a static jit argument
    assert hash(envs.make("cartpole")) == hash(envs.make("cartpole"))


def test_a_box_with_low_above_high_or_nan_bounds_is_refused():
    # Accepted before: the learner clipped every action to `high`, whatever the policy chose.
    with pytest.raises(ValueError, match=r"low <= high .* element 1 \(of 1 such\) has low=5.0"):
        envs.Box((2,), (0.0, 5.0), (1.0, 0.0))
    with pytest.raises(ValueError, match=r"element 0 .* low=nan"):
        envs.Box((1,), (float("nan"),), (1.0,))
    box = envs.Box((2,), (-float("inf"), 3.0), (float("inf"), 3.0))  # unbounded, or one point
    assert box.low == (-float("inf"), 3.0)


# ------------------------------------------------------------------------------------------
# The audio env (GRU synthesiser whose weights are a per-step input)
# ------------------------------------------------------------------------------------------


def test_synthesize_is_a_flax_gru_cell_run_sample_by_sample():
    import flax.linen as nn

    hidden = 8
    params = envs.init_synth_params(jax.random.key(3), hidden)
    params = params._replace(
        b=jax.random.normal(jax.random.key(4), (3 * hidden,)),
        b_hn=jax.random.normal(jax.random.key(5), (hidden,)),
    )
    h0 = jax.random.normal(jax.random.key(6), (hidden,)) * 0.1
    x = jax.random.normal(jax.random.key(7), (12,))
    h_last, audio = envs.synthesize(params, h0, x)

    sl = [slice(i * hidden, (i + 1) * hidden) for i in range(3)]
    flax_params = {
        name: {"kernel": params.w_in[None, s], "bias": params.b[s]}
        for name, s in zip(("ir", "iz", "in"), sl)
    }
    flax_params |= {
        "hr": {"kernel": params.w_h[:, sl[0]]},
        "hz": {"kernel": params.w_h[:, sl[1]]},
        "hn": {"kernel": params.w_h[:, sl[2]], "bias": params.b_hn},
    }
    apply = jax.jit(nn.GRUCell(hidden).apply)
    h, expected = h0, []
    for xt in x:
        h, _ = apply({"params": flax_params}, h, xt[None])
        expected.append(np.tanh(np.asarray(h) @ np.asarray(params.w_out) + float(params.b_out)))
    np.testing.assert_allclose(np.asarray(audio), np.array(expected), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(h_last), np.asarray(h), rtol=1e-5, atol=1e-6)


def test_audio_spaces_and_default_shapes():
    env = envs.make("audio", auto_reset=False)
    assert isinstance(env, envs.AudioSynth) and env.samples_per_step >= 256
    assert env.observation_space.shape == (env.samples_per_step + 1,)
    assert env.action_space == envs.Discrete(3)
    # shapes of the default (heavy) configuration, without compiling it
    state, obs = jax.eval_shape(env.reset, KEY)
    out = jax.eval_shape(env.step, state, jnp.int32(0), KEY, env.default_params())
    assert obs.shape == out[1].shape == (env.samples_per_step + 1,)
    assert out[0].h.shape == (env.hidden_size,)
    cont = envs.make("audio", light=True, discrete=False, auto_reset=False)
    assert cont.action_space == envs.Box.uniform((1,), -1.0, 1.0)
    assert cont.hidden_size == 8 and cont.samples_per_step == 32


def test_audio_is_deterministic_and_depends_on_the_synth_params():
    env = envs.AudioSynth.light()
    p0 = envs.init_synth_params(jax.random.key(0), env.hidden_size)
    p1 = envs.init_synth_params(jax.random.key(1), env.hidden_size)
    step = _jit_step(env)
    state, obs0 = env.reset(KEY, p0)
    _, obs_reset_p1 = env.reset(KEY, p1)
    np.testing.assert_array_equal(np.asarray(obs0), np.asarray(obs_reset_p1))  # silence
    a = step(state, jnp.int32(2), KEY, p0)
    b = step(state, jnp.int32(2), KEY, p0)
    c = step(state, jnp.int32(2), KEY, p1)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert a[1].shape == (env.samples_per_step + 1,) and a[1].dtype == jnp.float32
    assert np.abs(np.asarray(a[1][:-1])).max() > 1e-3  # not silent
    assert not np.allclose(np.asarray(a[1][:-1]), np.asarray(c[1][:-1]))
    assert float(a[2]) != float(c[2])
    assert float(a[1][-1]) == float(state.target)  # the target rides along in the obs
    # params=None means default_params()
    d = step(state, jnp.int32(2), KEY)
    e = step(state, jnp.int32(2), KEY, env.default_params())
    np.testing.assert_allclose(np.asarray(d[1]), np.asarray(e[1]), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="hidden_size=8"):
        env.step(state, jnp.int32(2), KEY, envs.init_synth_params(KEY, 4))


def test_audio_actions_steer_the_level_toward_the_target():
    env = envs.make("audio", light=True)
    params = env.default_params()
    n = 32
    keys = jax.random.split(KEY, n)

    def episode(policy):
        state, _ = jax.vmap(env.reset, in_axes=(0, None))(keys, params)

        def body(carry, key):
            state, level = carry
            actions = policy(level, state.env_state.target)
            state, _, reward, _, _, info = jax.vmap(env.step, in_axes=(0, 0, 0, None))(
                state, actions, jax.random.split(key, n), params
            )
            return (state, info["level"]), (reward, info["done"])

        init = (state, jnp.zeros(n))
        steps = env.max_episode_steps
        _, (reward, done) = jax.lax.scan(body, init, jax.random.split(KEY, steps))
        return reward, done

    follow, oppose = jax.jit(
        lambda: (
            episode(lambda lvl, tgt: jnp.where(lvl < tgt, 2, 0)),
            episode(lambda lvl, tgt: jnp.where(lvl < tgt, 0, 2)),
        )
    )()
    assert float(follow[0][-4:].mean()) > float(oppose[0][-4:].mean()) + 0.05
    assert np.asarray(follow[1])[-1].all() and not np.asarray(follow[1])[:-1].any()


def test_audio_step_exports_with_jax_export():
    from jax import export

    env = envs.AudioSynth.light()
    n = 4
    keys = jax.random.split(jax.random.PRNGKey(0), n)  # raw uint32 keys
    params = env.default_params()
    state, _ = jax.vmap(env.reset, in_axes=(0, None))(keys, params)
    actions = jnp.array([0, 1, 2, 1], jnp.int32)
    batched = jax.jit(jax.vmap(env.step, in_axes=(0, 0, 0, None)))
    exported = export.export(batched)(state, actions, keys, params)
    try:
        exported = export.deserialize(exported.serialize())
    except ImportError:  # serialization needs the optional flatbuffers package
        pass
    got = exported.call(state, actions, keys, params)
    want = batched(state, actions, keys, params)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------------------------
# The same envs on CPU cores through rollout.on_cpu
# ------------------------------------------------------------------------------------------


def _assert_trees_close(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape and x.dtype == y.dtype
        if x.dtype == np.bool_ or np.issubdtype(x.dtype, np.integer):
            np.testing.assert_array_equal(x, y)
        else:
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def on_cpu():
    """`rollout.on_cpu` with 2 workers; the (shared) worker pool stops after this module."""
    from rollout import on_cpu as make

    wrappers = []

    def wrap(fn, in_axes):
        wrappers.append(make(fn, in_axes=in_axes, workers=2))
        return wrappers[-1]

    yield wrap
    for w in wrappers:
        w.close()


@pytest.mark.timeout(180)
def test_cartpole_rollout_through_on_cpu_equals_vmapped_step(on_cpu):
    env = envs.make("cartpole")
    n, steps = 13, 30  # 13 envs: not a multiple of the 2 workers; 30 steps: episodes end
    state, _ = jax.vmap(env.reset)(jax.random.split(KEY, n))
    keys = jax.random.split(jax.random.key(1), (steps, n))
    actions = jax.random.randint(jax.random.key(2), (steps, n), 0, 2)

    def rollout(step_fn):
        def body(state, xs):
            action, key = xs
            state, *out = step_fn(state, action, key)
            return state, out

        return jax.jit(lambda s: jax.lax.scan(body, s, (actions, keys)))(state)

    want = rollout(jax.vmap(env.step))
    # on_cpu takes the batched function and splits its rows over the CPU workers
    got = rollout(on_cpu(jax.vmap(env.step), in_axes=0))
    _assert_trees_close(got, want)
    assert np.asarray(want[1][-1]["done"]).any()  # auto-reset happened on the way


@pytest.mark.timeout(180)
def test_audio_step_through_on_cpu_with_shared_synth_params(on_cpu):
    env = envs.make("audio", light=True)
    n = 5
    keys = jax.random.split(KEY, n)
    p0 = env.default_params()
    p1 = envs.init_synth_params(jax.random.key(9), env.unwrapped.hidden_size)
    state, _ = jax.vmap(env.reset, in_axes=(0, None))(keys, p0)
    actions = jnp.array([0, 1, 2, 2, 0], jnp.int32)
    batched = jax.vmap(env.step, in_axes=(0, 0, 0, None))
    direct = jax.jit(batched)
    step_on_cpu = jax.jit(on_cpu(batched, in_axes=(0, 0, 0, None)))
    for params in (p0, p1):  # new synth weights on every call, no recompile needed
        _assert_trees_close(
            step_on_cpu(state, actions, keys, params), direct(state, actions, keys, params)
        )


def test_box_sample_stays_in_the_box_like_gymnasium():
    """Infinite bounds were replaced by -1 / +1 whatever the other bound: low 10 and high inf
    sampled exactly 10, high -5 and low -inf exactly -1 (outside the box)."""
    from rollout import envs

    inf = float("inf")
    box = envs.Box((4,), (10.0, -inf, -inf, -1.0), (inf, -5.0, inf, 1.0))
    x = np.asarray(jax.vmap(box.sample)(jax.random.split(jax.random.key(0), 4000)))
    assert (x[:, 0] >= 10).all() and (x[:, 1] <= -5).all() and (np.abs(x[:, 3]) <= 1).all()
    # gymnasium's laws: low + Exponential(1), high - Exponential(1), N(0, 1), U(-1, 1).
    np.testing.assert_allclose(x.mean(0), [11.0, -6.0, 0.0, 0.0], atol=0.06)
    np.testing.assert_allclose(x.std(0), [1.0, 1.0, 1.0, 2 / np.sqrt(12)], atol=0.06)
    for dtype in (jnp.float16, jnp.bfloat16):  # its dtype, and no inf from a wide box
        wide = envs.Box((2,), (-65000.0, 10.0), (65000.0, inf), dtype)
        x = jax.vmap(wide.sample)(jax.random.split(jax.random.key(1), 500))
        assert x.dtype == dtype and np.isfinite(np.asarray(x, np.float32)).all()


# ------------------------------------------------------------------------------------------
# Your own env: the learner's check of the functional API
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Walk(envs.Env):
    """A user env: a position on a line, reward -|x|, a time limit of 5 steps."""

    mistake: str = ""
    name: str = "walk"
    max_episode_steps: int = 5
    observation_space = envs.Box.uniform((2,), -10.0, 10.0)
    action_space = envs.Discrete(2)

    def reset(self, key, params=None):
        return (jnp.float32(0), jnp.int32(0)), self._obs(jnp.float32(0), jnp.int32(0))

    def _obs(self, x, t):
        obs = jnp.stack([x, t.astype(jnp.float32)])
        return {"dict": {"x": obs}, "tuple": (obs,)}.get(self.mistake, obs)

    def step(self, state, action, key, params=None):
        x, t = state[0] + 2.0 * action - 1.0, state[1] + 1
        out = ((x, t), self._obs(x, t), -jnp.abs(x), x > 3, t >= 5, {})
        if self.mistake == "float-reward":
            out = (*out[:2], -1.0, *out[3:])
        return {"5-tuple": out[:5], "info-none": (*out[:5], None)}.get(self.mistake, out)


class _Counting:
    """Not a frozen dataclass: Python state on the env, changed in step (at trace time only)."""

    name, max_episode_steps = "counting", 5
    observation_space, action_space = _Walk.observation_space, _Walk.action_space

    def __init__(self, mutate="counter"):
        self.inner, self.mutate, self.steps, self.seen, self.table = _Walk(), mutate, 0, [], None

    def default_params(self):
        return None

    def reset(self, key, params=None):
        return self.inner.reset(key)

    def step(self, state, action, key, params=None):
        if self.table is None:  # a cache filled on the first trace: no state, accepted
            self.table = np.arange(3.0)
        if self.mutate == "counter":
            self.steps += 1
        if self.mutate == "list":
            self.seen.append(action)
        return self.inner.step(state, action, key)


def _learner(env):
    from rollout.ppo import Learner, PPOConfig

    cfg = PPOConfig(env="walk", members=2, total_steps=64, num_envs=2, num_steps=16)
    return Learner(cfg, devices=jax.devices()[:2], env=env)


@pytest.mark.parametrize(
    "env, message",
    [
        (envs.AutoReset(_Walk("dict")), "reset returns observations of type dict: observations "
         r"must be one array \(flatten dict or tuple observations into one vector\)"),
        (envs.AutoReset(_Walk("tuple")), "reset returns observations of type tuple"),
        (envs.AutoReset(_Walk("5-tuple")), r"step returns 5 values \(gym's API: no state first\);"
         r" step\(state, action, key, params=None\) must return \(state, obs, reward, "
         r"terminated, truncated, info\)"),
        (_Walk("5-tuple"), "step returns 5 values"),  # not "no 'final_obs' ... AutoReset"
        (envs.AutoReset(_Walk("info-none")), r"step returns info of type NoneType: info must be "
         "a dict of arrays"),
        (envs.AutoReset(_Walk("float-reward")), r"step returns reward of type float: reward must"
         r" be an array \(jnp.float32\(r\)\)"),
        (envs.AutoReset(_Counting()), r"counting: _Counting.steps changed while reset and step "
         "were traced; .* keep it in the state that reset returns"),
        (envs.AutoReset(_Counting("list")), "_Counting.seen changed while"),
        (_Counting(), "_Counting.steps changed while"),
    ],
    ids=["dict-obs", "tuple-obs", "5-tuple", "bare-5-tuple", "info-none", "float-reward",
         "python-counter", "list-appended", "bare-python-counter"],
)  # fmt: skip
def test_a_user_env_breaking_the_functional_api_is_one_value_error_naming_it(env, message):
    """Each of these failed deep in the check or in AutoReset (AttributeError, TypeError, the
    unpacking of 5 values), was taken for a missing final_obs, or trained silently on values
    read at trace time."""
    with pytest.raises(ValueError, match=message) as caught:
        _learner(env)
    assert str(caught.value).startswith(env.name + ": ") and "\n" not in str(caught.value)


def test_an_observation_space_that_is_not_a_box_is_one_value_error_naming_the_env():
    @dataclasses.dataclass(frozen=True)
    class DictSpace(_Walk):
        observation_space = gym.spaces.Dict({"x": gym.spaces.Box(-1, 1, (2,))})

    with pytest.raises(ValueError, match=r"^walk: observation space gymnasium.spaces.dict.Dict "
                       r"is not supported: use a flat rollout.envs.Box \(flatten"):  # fmt: skip
        _learner(envs.AutoReset(DictSpace()))


def test_the_projects_envs_and_adapters_pass_the_python_state_check():
    """What the check reads (every object an env holds) must not refuse a pure env: the
    project's own envs, the gymnax and brax adapters, a cache filled on the first trace."""
    from rollout.ppo._env import check_functional_env, spec_of

    made = [envs.make(name) for name in ("cartpole", "pendulum", "audio")]
    adapters = {"gymnax:CartPole-v1": {}, "brax:inverted_pendulum": {"backend": "spring"}}
    for env_id, kwargs in adapters.items():
        if importlib.util.find_spec(env_id.partition(":")[0]):
            made.append(envs.make(env_id, **kwargs))
    for env in [*made, envs.AutoReset(_Counting(mutate=""))]:
        check_functional_env(env, spec_of(env))


def test_env_names_in_messages_are_the_envs_own():
    """An env that kept Env's default name ("env") is named by its class, through AutoReset,
    and not by the type of a field of its own that happens to be called ``env``."""
    import dataclasses

    from rollout.envs import AutoReset, Env
    from rollout.ppo._env import env_name

    @dataclasses.dataclass(frozen=True)
    class HasEnvField(Env):
        env: str = "prod"

    assert env_name(HasEnvField()) == "HasEnvField"
    assert env_name(AutoReset(AutoReset(HasEnvField()))) == "HasEnvField"
    assert env_name(envs.make("cartpole")) == "CartPole-v1"


@dataclasses.dataclass(frozen=True)
class _NoParams:
    """A user env on the functional API alone: no `Env` base class, no `default_params`."""

    name: str = "no-params"
    max_episode_steps: int = 5
    observation_space = _Walk.observation_space
    action_space = _Walk.action_space

    def reset(self, key, params=None):
        return _Walk().reset(key)

    def step(self, state, action, key, params=None):
        return _Walk().step(state, action, key)


def test_a_user_env_without_default_params_is_accepted():
    """The README's API lists no `default_params`; AutoReset needed it (an AttributeError from
    inside its step, naming neither the env nor the fix). Without it, params are `None`."""
    env = envs.AutoReset(_NoParams())
    assert env.default_params() is None
    _learner(env)  # traces reset and step
    state, _ = env.reset(jax.random.key(0))
    for action in (1, 1, 1, 1):
        state, obs, _, term, _, info = env.step(state, jnp.int32(action), jax.random.key(1))
    assert bool(term) and bool(info["done"]) and float(info["final_obs"][0]) == 4.0
    assert float(info["episode_return"]) == -10.0 and obs.tolist() == [0.0, 0.0]
