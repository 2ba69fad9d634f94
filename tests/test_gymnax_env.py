"""gymnax envs on the functional env API, and the learner on a user's own env object."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollout import envs
from rollout.envs import Box, Discrete, Env

gymnax = pytest.importorskip("gymnax")


def _both(env, genv, params, keys, actions):
    """Steps the adapter and gymnax from the same state at every step (gymnax's trajectory)."""
    obs0, gstate = jax.vmap(genv.reset, in_axes=(0, None))(keys[0], params)
    _, oobs0 = jax.vmap(env.reset)(keys[0])

    def step(gstate, xs):
        k, a = xs
        g = jax.vmap(genv.step, in_axes=(0, 0, 0, None))(k, gstate, a, params)
        zeros = jnp.zeros(a.shape, jnp.float32)
        ours_state = envs.AutoResetState(gstate, zeros, zeros.astype(jnp.int32))
        o = jax.vmap(env.step)(ours_state, a, k)
        theirs = (g[0], g[2], g[3], g[4], g[5]["final_observation"])
        mine = (o[1], o[2], o[3], o[4], o[5]["final_obs"])
        return g[1], (mine, theirs)

    return (oobs0, obs0), jax.lax.scan(step, gstate, (keys[1:], actions))[1]


# How the adapter presents gymnax's observations: as they are, a Discrete one one-hot, a board
# that is neither a vector nor an image flattened.
_AS_IS = lambda o: o
_OBS = {
    "FrozenLake-misc": lambda o: jax.nn.one_hot(o, 16),
    "Catch-bsuite": lambda o: o.reshape(*o.shape[:-2], 50),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "name, T",
    [("CartPole-v1", 120), ("Acrobot-v1", 520), ("FrozenLake-misc", 120), ("Catch-bsuite", 30)],
)
def test_adapter_equals_gymnax_called_directly(name, T):
    B = 4
    env = envs.make(f"gymnax:{name}")  # the adapter in AutoReset
    genv, params = gymnax.make(name)
    keys = jax.random.split(jax.random.key(0), (T + 1, B))
    actions = jax.random.randint(jax.random.key(1), (T, B), 0, env.action_space.num_actions)
    (mine0, theirs0), (mine, theirs) = jax.jit(_both, static_argnums=(0, 1))(
        env, genv, params, keys, actions
    )
    as_ours = _OBS.get(name, _AS_IS)
    np.testing.assert_array_equal(mine0, as_ours(theirs0))
    theirs = (as_ours(theirs[0]), *theirs[1:4], as_ours(theirs[4]))
    # Same arithmetic, fused differently by XLA: float32 rounding-level differences only.
    for what, a, b in zip(("obs", "reward", "term", "trunc", "final_obs"), mine, theirs):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5, err_msg=what)
    term, trunc = np.asarray(mine[2]), np.asarray(mine[3])
    assert term.any() if name != "Acrobot-v1" else trunc.any()  # episodes really ended
    raw = genv.observation_space(params)
    assert env.observation_space.shape == np.shape(as_ours(np.zeros(raw.shape, raw.dtype)))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["Reacher-misc", "PointRobot-misc", "Swimmer-misc"])
def test_envs_whose_spaces_gymnax_builds_with_jnp_step_inside_jit(name):
    # Their action bounds are jnp arrays: read inside the jitted step they were tracers, and
    # the adapter failed (TracerArrayConversionError) before any training.
    B, T = 3, 20
    env = envs.make(f"gymnax:{name}")
    genv, params = gymnax.make(name)
    space = env.action_space
    low, high = np.asarray(space.low), np.asarray(space.high)
    actions = jax.random.uniform(jax.random.key(1), (T, B, *space.shape), minval=low, maxval=high)
    keys = jax.random.split(jax.random.key(0), (T + 1, B))
    _, (mine, theirs) = jax.jit(_both, static_argnums=(0, 1))(env, genv, params, keys, actions)
    for what, a, b in zip(("obs", "reward", "term", "trunc"), mine, theirs):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5, err_msg=what)


def test_gymnax_spaces_and_bad_names():
    env = envs.make("gymnax:Pendulum-v1")
    assert isinstance(env.action_space, Box) and env.action_space.high == (2.0,)
    assert env.max_episode_steps == 200
    assert isinstance(envs.make("gymnax:Acrobot-v1").action_space, Discrete)
    with pytest.raises(ValueError, match=r"unknown gymnax env 'Nope-v0'; registered: "):
        envs.make("gymnax:Nope-v0")
    # A kwarg the constructor does not take: one line naming the id and the params fields.
    with pytest.raises(ValueError, match=r"gymnax:Pendulum-v1: .*'nope'.*params \(dt, g, "):
        envs.make("gymnax:Pendulum-v1", nope=1)


@pytest.mark.timeout(120)
def test_gymnax_params_fields_are_make_kwargs():
    """gymnax keeps its time limit and constants in EnvParams, which gymnax.make does not take
    (CartPole.__init__ refused max_steps_in_episode): a kwarg naming a field sets it."""
    B, T, limit = 3, 40, 15
    env = envs.make("gymnax:CartPole-v1", max_steps_in_episode=limit, gravity=12.0)
    assert env.max_episode_steps == limit
    genv, params = gymnax.make("CartPole-v1")
    params = params.replace(max_steps_in_episode=limit, gravity=12.0)
    keys = jax.random.split(jax.random.key(0), (T + 1, B))
    actions = jax.random.randint(jax.random.key(1), (T, B), 0, 2)
    _, (mine, theirs) = jax.jit(_both, static_argnums=(0, 1))(env, genv, params, keys, actions)
    for what, a, b in zip(("obs", "reward", "term", "trunc"), mine, theirs):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5, err_msg=what)
    assert np.asarray(mine[3]).any()  # episodes cut at the new limit


@pytest.mark.parametrize(
    "kwargs, message",
    [
        # gymnax took it: every episode ended after one step, and the run trained on that.
        ({"max_steps_in_episode": -5}, "an episode needs at least one step"),
        ({"max_steps_in_episode": 2.5}, "give a whole number (the default is 500)"),
        ({"gravity": "high"}, "give a finite number (the default is 9.8)"),
        ({"gravity": float("nan")}, "give a finite number"),
        # Past int32: a NumPy int64 wrapped (episodes of one step), a Python int overflowed
        # at the first step with an error that did not name the kwarg.
        ({"max_steps_in_episode": np.int64(2**31)}, "in [-2147483648, 2147483647]"),
        ({"max_steps_in_episode": 2**40}, "in [-2147483648, 2147483647]"),
        ({"gravity": 1e39}, "give a number in [-3.40282e+38, 3.40282e+38]"),  # (was inf)
    ],
)
def test_gymnax_params_fields_take_values_the_env_can_run_with(kwargs, message):
    with pytest.raises(
        ValueError, match=re.escape(f"gymnax:CartPole-v1: env kwarg {next(iter(kwargs))}")
    ) as e:
        envs.make("gymnax:CartPole-v1", **kwargs)
    assert message in str(e.value)
    assert envs.make("gymnax:CartPole-v1", gravity=9).max_episode_steps == 500  # ints are floats
    for steps in (np.int64(7), jnp.asarray(7), 7.0):  # NumPy and JAX scalars are numbers
        assert envs.make("gymnax:CartPole-v1", max_steps_in_episode=steps).max_episode_steps == 7


@pytest.mark.parametrize(
    "env_id, name, value, as_gymnax",
    [
        ("BernoulliBandit-misc", "max_steps_in_episode", 6, 6.0),  # a float field, JSON's 6
        ("SpaceInvaders-MinAtar", "shot_cool_down", 5.0, 5),  # an int field, given 5.0
    ],
)
@pytest.mark.timeout(120)
def test_a_params_field_given_as_another_kind_of_number_steps_as_its_own_kind(
    env_id, name, value, as_gymnax
):
    """``--env-kwargs '{"max_steps_in_episode": 6}'`` for a float field passed the check and
    failed inside the env's step ("lax.select requires arguments to have the same dtypes")."""
    B, T = 2, 8
    env = envs.make(f"gymnax:{env_id}", **{name: value})
    genv, params = gymnax.make(env_id)
    params = params.replace(**{name: as_gymnax})
    keys = jax.random.split(jax.random.key(0), (T + 1, B))
    n = env.action_space.num_actions
    actions = jax.random.randint(jax.random.key(1), (T, B), 0, n)
    _, (mine, theirs) = jax.jit(_both, static_argnums=(0, 1))(env, genv, params, keys, actions)
    for what, a, b in zip(("obs", "reward", "term", "trunc"), mine, theirs):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=what)


@pytest.mark.timeout(120)
def test_an_array_params_field_takes_a_json_list_and_refuses_another_shape():
    """Acrobot's ``available_torque`` from ``--env-kwargs`` is a JSON list: it stayed a list,
    and the step failed ("__index__() was called on traced array")."""
    torque = [-2.0, 0.0, 2.0]
    env = envs.make("gymnax:Acrobot-v1", available_torque=torque)
    genv, params = gymnax.make("Acrobot-v1")
    params = params.replace(available_torque=jnp.asarray(torque))
    keys = jax.random.split(jax.random.key(0), (9, 2))
    actions = jax.random.randint(jax.random.key(1), (8, 2), 0, 3)
    _, (mine, theirs) = jax.jit(_both, static_argnums=(0, 1))(env, genv, params, keys, actions)
    for what, a, b in zip(("obs", "reward", "term", "trunc"), mine, theirs):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6, err_msg=what)
    for bad in ([1.0, 2.0], "x", [1.0, float("nan"), 0.0]):
        with pytest.raises(ValueError, match=r"available_torque=.*give 3 finite numbers, shaped"):
            envs.make("gymnax:Acrobot-v1", available_torque=bad)


def test_gymnax_observations_come_in_their_spaces_dtype():
    """FourRooms-misc gives int32 positions for a float32 box: as float32, an action outside
    the space then gives NaN observations as for every other env."""
    env = envs.make("gymnax:FourRooms-misc", auto_reset=False)
    state, obs = env.reset(jax.random.key(0))
    assert obs.dtype == env.observation_space.dtype == jnp.float32
    step = jax.jit(jax.vmap(env.step, in_axes=(None, 0, None)))
    _, obs, _, _, _, _ = step(state, jnp.array([9, 1], jnp.int32), jax.random.key(1))
    assert obs.dtype == jnp.float32 and np.isnan(np.asarray(obs)[0]).all()
    assert np.isfinite(np.asarray(obs)[1]).all()


def test_gymnax_action_outside_the_discrete_space_is_an_error_or_nan():
    # gymnax indexes a torque table with the action, and JAX clamps an index out of range, so
    # without the check action 7 would silently act as action 2.
    env = envs.make("gymnax:Acrobot-v1", auto_reset=False)
    state, _ = env.reset(jax.random.key(0))
    with pytest.raises(ValueError, match=r"gymnax:Acrobot-v1 takes an integer action in \[0, 3\)"):
        env.step(state, 7, jax.random.key(1))
    step = jax.jit(jax.vmap(env.step, in_axes=(None, 0, None)))
    _, obs, reward, _, _, _ = step(state, jnp.array([7, 2], jnp.int32), jax.random.key(1))
    assert np.isnan(np.asarray(reward)[0]) and np.isnan(np.asarray(obs)[0]).all()
    assert np.isfinite(np.asarray(reward)[1]) and np.isfinite(np.asarray(obs)[1]).all()


# ---------------------------------------------------------------------- a user's own env


class DriftState(NamedTuple):
    x: jax.Array
    t: jax.Array


@dataclasses.dataclass(frozen=True)
class Drift(Env):
    """A user env on the functional API: push x towards 0; ends when |x| > 2 or after 20 steps."""

    name: str = "drift"
    max_episode_steps: int = 20

    @property
    def observation_space(self) -> Box:
        return Box.uniform((2,), -np.inf, np.inf)

    @property
    def action_space(self) -> Discrete:
        return Discrete(2)

    def reset(self, key, params=None):
        x = jax.random.uniform(key, (), minval=-1.0, maxval=1.0)
        return DriftState(x, jnp.int32(0)), jnp.stack([x, 0.0])

    def step(self, state, action, key, params=None):
        x = state.x + 0.3 * (2 * action - 1) + 0.1 * jax.random.normal(key)
        t = state.t + 1
        obs = jnp.stack([x, t / self.max_episode_steps])
        term, trunc = jnp.abs(x) > 2.0, t >= self.max_episode_steps
        return DriftState(x, t), obs, -jnp.abs(x), term, trunc & ~term, {}


@pytest.mark.timeout(120)
def test_learner_takes_a_user_env_object():
    from rollout.ppo import Learner, PPOConfig

    n, e = 2, 4
    cfg = PPOConfig(env="drift", members=n, total_steps=256, num_envs=e, num_steps=32)
    env = envs.AutoReset(Drift())
    learner = Learner(cfg, devices=jax.devices()[:2], env=env)
    state = learner.init()
    # The first observations are the user env's resets, with the learner's documented keys.
    _, k_members = jax.random.split(jax.random.key(cfg.seed))
    for m, key in enumerate(jax.random.split(k_members, n)):
        _, k_env = jax.random.split(key)
        _, obs = jax.vmap(env.reset)(jax.random.split(k_env, e))
        np.testing.assert_allclose(np.asarray(state.members.obs[m]), np.asarray(obs), atol=1e-6)
    state, metrics = learner.update(state, 2)
    assert np.asarray(metrics["episodes"]).sum() > 0
    assert np.isfinite(np.asarray(metrics["policy_loss"])).all()
    # Unknown names are still refused when no env object is given.
    with pytest.raises(ValueError, match=r"unknown env 'drift'"):
        Learner(cfg, devices=jax.devices()[:2])


@dataclasses.dataclass(frozen=True)
class _Mistaken(Drift):
    """Drift with one of the mistakes a user env can make."""

    mistake: str = ""

    def step(self, state, action, key, params=None):
        state, obs, reward, term, trunc, info = super().step(state, action, key, params)
        if self.mistake == "obs":
            obs = jnp.concatenate([obs, obs])
        if self.mistake == "reward":
            reward = reward[None]
        return state, obs, reward, term, trunc, info


@pytest.mark.parametrize(
    "env, message",
    [
        (Drift(), r"drift: step's info has no 'final_obs'.* wrap the env in rollout.envs.AutoR"),
        (envs.AutoReset(_Mistaken(mistake="obs")), r"step returns observations of shape \(4,\), "
         r"but its observation_space has shape \(2,\)"),
        (envs.AutoReset(_Mistaken(mistake="reward")), r"step returns reward of shape \(1,\); "
         "reward, terminated and truncated are scalars"),
    ],
    ids=["bare-env", "obs-shape", "reward-shape"],
)  # fmt: skip
def test_user_env_mistakes_are_one_clear_error_before_anything_compiles(env, message):
    """A bare env (never restarting its episodes) would otherwise train on whatever follows an
    episode's end; wrong shapes would fail deep inside the jitted update."""
    from rollout.ppo import Learner, PPOConfig

    cfg = PPOConfig(env="drift", members=2, total_steps=256, num_envs=4, num_steps=32)
    with pytest.raises(ValueError, match=message):
        Learner(cfg, devices=jax.devices()[:2], env=env)


@pytest.mark.timeout(300)
def test_cli_trains_a_gymnax_id(tmp_path, capsys):
    """The CLI (its ``main``, as ``python -m rollout.ppo`` runs it) trains a gymnax id. Called
    in this process: the run is not about a process (no signal, exit or cleanup is checked),
    and a fresh interpreter only added its start and imports; JAX has started here with more
    than the 2 devices the run asks for, so the CLI leaves JAX's configuration as it is."""
    from rollout.ppo._cli import main

    out = tmp_path / "run"
    argv = [
        "--env", "gymnax:Acrobot-v1", "--members", "2", "--total-steps", "256",
        "--num-envs", "2", "--num-steps", "64", "--out", str(out), "--no-progress",
    ]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err[-3000:]
    assert " devices=2xcpu " in capsys.readouterr().err  # a member per device, as in a process
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["env_steps"] for r in rows] == [128, 256]
    assert all(len(r["returns"]) == 2 for r in rows)
