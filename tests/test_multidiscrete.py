"""MultiDiscrete actions: one categorical head per element. The policy's maths against numpy,
a one-element MultiDiscrete training exactly as the Discrete it equals, a functional env of
three elements learning, and exported members acting per element."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollout import envs
from rollout.ppo import Learner, PPOConfig, export, train
from rollout.ppo import _networks as nets

GROUPS = (3, 2, 4)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_policy_maths_equal_numpy_per_element():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, sum(GROUPS))).astype(np.float32) * 2
    noise = nets.noise(jax.random.key(1), (5,), True, sum(GROUPS))
    action = np.asarray(nets.sample(jnp.asarray(logits), noise, True, GROUPS))
    cuts = np.cumsum(GROUPS)[:-1]
    parts, gumbels = np.split(logits, cuts, -1), np.split(np.asarray(noise), cuts, -1)
    assert action.shape == (5, 3)
    want = np.stack([np.argmax(p + g, -1) for p, g in zip(parts, gumbels)], -1)
    np.testing.assert_array_equal(action, want)
    logp = sum(_log_softmax(p)[np.arange(5), action[:, j]] for j, p in enumerate(parts))
    got = nets.log_prob(jnp.asarray(logits), jnp.asarray(action), True, GROUPS)
    np.testing.assert_allclose(got, logp, rtol=1e-5)
    ent = sum(-(np.exp(_log_softmax(p)) * _log_softmax(p)).sum(-1) for p in parts)
    np.testing.assert_allclose(nets.entropy(jnp.asarray(logits), True, GROUPS), ent, rtol=1e-5)


def test_samples_follow_each_elements_softmax():
    logits = jnp.log(jnp.array([0.2, 0.5, 0.3, 0.9, 0.1, 0.1, 0.2, 0.3, 0.4]))
    draws = 40_000
    noise = nets.noise(jax.random.key(0), (draws,), True, 9)
    action = np.asarray(nets.sample(jnp.broadcast_to(logits, (draws, 9)), noise, True, GROUPS))
    want = ([0.2, 0.5, 0.3], [0.9, 0.1], [0.1, 0.2, 0.3, 0.4])
    for j, probs in enumerate(want):
        freq = np.bincount(action[:, j], minlength=len(probs)) / draws
        np.testing.assert_allclose(freq, probs, atol=0.01)


def test_space_checks_and_samples():
    with pytest.raises(ValueError, match="nvec must be a non-empty tuple of positive ints"):
        envs.MultiDiscrete((3, 0))
    with pytest.raises(ValueError, match="nvec must be"):
        envs.MultiDiscrete(())
    space = envs.MultiDiscrete(GROUPS)
    a = jax.vmap(space.sample)(jax.random.split(jax.random.key(0), 2000))
    assert a.shape == (2000, 3) and a.dtype == jnp.int32
    assert (np.asarray(a).min(0) == 0).all() and (
        np.asarray(a).max(0) == np.array(GROUPS) - 1
    ).all()


@dataclasses.dataclass(frozen=True)
class Match(envs.Env):
    """Shows targets, one-hot per element; the reward is the number of elements matched."""

    nvec: tuple[int, ...] = GROUPS
    single: bool = False  # the same env with a Discrete action space (one element only)
    max_episode_steps: int = 8
    name: str = "match"

    @property
    def observation_space(self) -> envs.Box:
        return envs.Box.uniform((sum(self.nvec),), 0.0, 1.0)

    @property
    def action_space(self) -> envs.Space:
        return envs.Discrete(self.nvec[0]) if self.single else envs.MultiDiscrete(self.nvec)

    def _targets(self, key):
        target = envs.MultiDiscrete(self.nvec).sample(key)
        obs = jnp.concatenate([jax.nn.one_hot(t, n) for t, n in zip(target, self.nvec)])
        return target, obs

    def reset(self, key, params=None):
        target, obs = self._targets(key)
        return (jnp.int32(0), target), obs

    def step(self, state, action, key, params=None):
        t, target = state
        action = action[None] if self.single else action
        reward = jnp.sum(action == target).astype(jnp.float32)
        target, obs = self._targets(key)
        t = t + 1
        return (t, target), obs, reward, jnp.bool_(False), t >= self.max_episode_steps, {}


def _train(env: envs.Env, steps: int):
    cfg = PPOConfig.for_env("cartpole", members=2, total_steps=steps, num_envs=4, num_steps=32)
    learner = Learner(cfg, env=envs.AutoReset(env), devices=jax.devices()[:2])
    state, rows = train(cfg, learner=learner, progress=False)
    return learner, state, rows


@pytest.mark.timeout(120)
def test_one_element_trains_exactly_as_the_discrete_space_it_equals():
    _, _, multi = _train(Match(nvec=(4,)), 1024)
    _, _, single = _train(Match(nvec=(4,), single=True), 1024)
    for a, b in zip(multi, single):
        assert a["returns"] == b["returns"]
        assert a["entropy"] == b["entropy"] and a["policy_loss"] == b["policy_loss"]


@pytest.mark.timeout(180)
def test_three_elements_learn_and_export_acts_per_element(tmp_path):
    learner, state, rows = _train(Match(), 12_288)
    random_play = 8 * sum(1 / n for n in GROUPS)  # 8.67: each element right 1/n of the time
    start, end = np.mean(rows[0]["returns"]), np.mean([r["returns"] for r in rows[-3:]])
    assert abs(start - random_play) < 1.5 and end > random_play + 2.5, (start, end)
    paths = export.export_members(learner, state, tmp_path)
    meta = json.loads((paths[0] / "member.json").read_text())
    assert meta["network"]["action_groups"] == list(GROUPS) and meta["version"] == 4
    member = export.read_member(paths[0])
    obs = np.asarray(
        jax.vmap(lambda k: Match()._targets(k)[1])(jax.random.split(jax.random.key(3), 6))
    )
    params = jax.device_get(export.member_arrays(state, 0)[0])
    logits, _ = learner.network.apply({"params": params}, jnp.asarray(obs))
    want = np.stack([np.argmax(p, -1) for p in nets.split_groups(np.asarray(logits), GROUPS)], -1)
    np.testing.assert_array_equal(member.act(obs), want)
    assert member.act(obs).shape == (6, 3) and meta["action"]["start"] == [0, 0, 0]
    meta["network"]["action_groups"] = [3, 2, 3]  # no longer adds up to action_dim 9
    (paths[0] / "member.json").write_text(json.dumps(meta))
    with pytest.raises(export.NotAnExport, match=r"'network.action_groups' adds up to 8"):
        export.read_member(paths[0])
