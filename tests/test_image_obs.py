"""Image observations: the conv actor-critic is chosen from the observation shape, members of
it compute the same whatever the devices, exports reproduce it outside the trainer, and PPO
learns from pixels."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollout import envs
from rollout.ppo import Learner, PPOConfig, evaluate, export
from rollout.ppo import _env as envlib
from rollout.ppo import _networks as nets

ROOT = Path(__file__).resolve().parents[1]
MINATAR = "gymnax:Breakout-MinAtar"


@dataclasses.dataclass(frozen=True)
class Spot(envs.Env):
    """A one-step bandit on pixels: a bright square in the left or right half of a
    ``[C, H, W]`` frame in [0, 255]; the action naming that half earns 1."""

    shape: tuple[int, int, int] = (2, 36, 36)
    name = "spot"
    max_episode_steps = 1

    @property
    def observation_space(self) -> envs.Box:
        return envs.Box.uniform(self.shape, 0.0, 255.0)

    @property
    def action_space(self) -> envs.Discrete:
        return envs.Discrete(2)

    def _frame(self, side: jax.Array, key: jax.Array) -> jax.Array:
        c, h, w = self.shape
        noise = jax.random.uniform(key, self.shape, maxval=60.0)
        col = jnp.arange(w)[None, :]  # (explicit ranks: also under rank promotion "raise")
        lit = jnp.where(side == 0, col < w // 2, col >= w // 2) & (jnp.arange(h)[:, None] > 8)
        return jnp.where(lit[None] & (jnp.arange(c)[:, None, None] == 0), 255.0, noise)

    def reset(self, key, params=None):
        k_side, k_frame = jax.random.split(key)
        side = jax.random.bernoulli(k_side).astype(jnp.int32)
        return side, self._frame(side, k_frame)

    def step(self, state, action, key, params=None):
        reward = (action == state).astype(jnp.float32)
        _, obs = self.reset(key)
        return state, obs, reward, jnp.bool_(True), jnp.bool_(False), {}


def _spot_config(**overrides) -> PPOConfig:
    base = dict(
        env="spot", members=4, num_envs=8, num_steps=16, total_steps=8 * 16 * 2,
        num_minibatches=2, update_epochs=2, updates_per_call=1, clip_coef=0.1,
    )  # fmt: skip
    return PPOConfig(**{**base, **overrides})


def _space(shape, low, high):
    return type("E", (), dict(
        name="mine", observation_space=envs.Box.uniform(shape, low, high),
        action_space=envs.Discrete(3)))()  # fmt: skip


def test_the_network_follows_the_observation_shape():
    spec = envlib.spec_of(_space((4, 84, 84), 0, 255))
    assert spec.image and spec.obs_scale == pytest.approx(1 / 255)
    net = nets.make_network(spec, (64, 64))
    assert (net.torso, net.channels_first) == ("nature", True)
    spec = envlib.spec_of(envs.make(MINATAR))
    assert (spec.obs_shape, spec.obs_scale) == ((10, 10, 4), 1.0)  # MinAtar: 0/1 channels
    net = nets.make_network(spec, (64, 64))
    assert (net.torso, net.channels_first) == ("minatar", False)
    assert isinstance(nets.make_network(envlib.spec_of(envs.make("cartpole")), (8,)),
                      nets.ActorCritic)  # fmt: skip
    for shape in [(84, 84), (2, 2, 3), (1, 4, 4, 3), (3, 2, 3), (1, 2, 40)]:
        with pytest.raises(ValueError, match=r"mine: observations of shape .* vectors \[D\]"):
            envlib.spec_of(_space(shape, 0, 1))
    # Nothing to see (an IndexError inside JAX after the run started): refused up front.
    for shape in [(0,), (0, 4, 4)]:
        with pytest.raises(ValueError, match=r"mine: observations of shape .* hold no values"):
            envlib.spec_of(_space(shape, 0, 1))
    # Discrete actions on images: CleanRL's Atari defaults, and no running normalisation.
    cfg = PPOConfig.for_env(MINATAR)
    assert (cfg.num_envs, cfg.clip_coef, cfg.total_steps) == (8, 0.1, 10_000_000)
    assert not envlib.normalize_obs(cfg, spec)
    assert envlib.normalize_obs(dataclasses.replace(cfg, normalize_obs=True), spec)


def test_continuous_actions_on_images_export_their_log_std():
    from rollout.ppo._env import EnvSpec

    spec = EnvSpec((12, 12, 3), False, 2, np.full(2, -1.0), np.full(2, 1.0), 1 / 255)
    net = nets.make_network(spec, (64, 64))
    obs = np.random.default_rng(1).integers(0, 256, (4, 12, 12, 3)).astype(np.float32)
    params = net.init(jax.random.key(0), obs)["params"]
    params = {**params, "log_std": params["log_std"] - 0.5}
    (mean, log_std), value = net.apply({"params": params}, obs)
    assert mean.shape == log_std.shape == (4, 2) and value.shape == (4,)
    network = export.network_meta(PPOConfig(env="mine"), spec)
    flat = export._flatten(jax.device_get(params))
    export._check_layout(flat, network)  # log_std is part of the documented layout
    meta = {"network": network, "obs_norm": {"enabled": False}, "action": {"low": [-1.0] * 2,
            "high": [1.0] * 2}}  # fmt: skip
    member = export.ExportedMember(meta, {k: jnp.asarray(v) for k, v in flat.items()}, 0.0, 1.0)
    np.testing.assert_allclose(member.head(obs), mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(member.act(obs), np.clip(mean, -1, 1), rtol=1e-5, atol=1e-6)


def _trained(env, cfg, devices):
    """A learner after one update, and its members' parameters from before it."""
    learner = Learner(cfg, devices=jax.devices()[:devices], env=env)
    state = learner.init()
    start = jax.device_get(state.members.params)  # the update donates the state
    state, _ = learner.update(state, 1)
    return learner, state, start


def _member(tree, i):
    return jax.tree.map(lambda x: np.asarray(x)[i], tree)  # a plain host slice: a reference


@pytest.mark.timeout(300)
@pytest.mark.parametrize("which", ["nature", "minatar"])
def test_conv_members_train_alike_on_any_devices_and_export_exactly(which, tmp_path):
    """4 devices run each member's plain update; 1 device batches the 4 members (a grouped
    conv, or one member after another where JAX cannot batch it). The export recomputes the
    network with its own convs, outside flax. Then PPO learns from pixels (Nature CNN)."""
    if which == "nature":
        env = envs.AutoReset(Spot())
        # 8 steps of 8 envs an update: the bandit learns in as many updates as with 16 steps
        # (4 minibatch steps an update either way), at half the cost of each update.
        cfg = _spot_config(learning_rate=1e-3, num_steps=8, total_steps=8 * 8 * UPDATES)
    else:
        env = envs.make(MINATAR)
        cfg = _spot_config(env=MINATAR, num_envs=4, num_steps=8, total_steps=4 * 8 * 2)
    learner, state, start = _trained(env, cfg, 4)
    assert isinstance(learner.network, nets.ImageActorCritic) and learner.network.torso == which
    ref = jax.device_get(state.members.params)
    leaves = jax.tree.leaves(ref)
    assert not np.allclose(leaves[0][0], leaves[0][1])  # members differ
    # Adam divides by the gradient's own scale, so last-bit differences of near-zero gradients
    # (another summation order) become a fraction of one step (lr) in the few weights that
    # have them (seen: one output channel, up to 0.15 lr); a wrong or mixed-up member's
    # gradient would move most weights by whole steps.
    lr = cfg.learning_rate
    start = jax.tree.leaves(start)
    assert max(np.abs(a - b).max() for a, b in zip(leaves, start)) > lr / 2  # it did train
    _, batched, _ = _trained(env, cfg, 1)
    got = jax.tree.leaves(jax.device_get(batched.members.params))
    diff = np.concatenate([np.abs(b - a).ravel() for a, b in zip(leaves, got)])
    assert diff.max() < 0.3 * lr and (diff > 1e-6).mean() < 0.01, (diff.max(), (diff > 1e-6).mean())

    paths = export.export_members(learner, state, tmp_path)
    rng = np.random.default_rng(0)
    high = 256 if which == "nature" else 2
    obs = rng.integers(0, high, (3, 5, *learner.spec.obs_shape)).astype(np.float32)
    heads = []
    for i, path in enumerate(paths):
        member = export.read_member(path)
        want, _ = learner.network.apply({"params": _member(ref, i)}, obs)
        np.testing.assert_allclose(member.head(obs), want, rtol=1e-5, atol=1e-6)
        heads.append(np.asarray(member.head(obs)))
        assert member.act(obs).shape == (3, 5)
    assert not np.allclose(heads[0], heads[1])
    meta = json.loads((paths[0] / "member.json").read_text())
    assert meta["version"] == export.VERSION == 4 and meta["network"]["kind"] == "ImageActorCritic"
    convs, dense = nets.TORSOS[which]
    assert meta["network"]["convs"] == [list(c) for c in convs]
    assert meta["network"]["dense"] == dense
    assert meta["network"]["channels_first"] == (which == "nature")
    assert meta["network"]["obs_scale"] == pytest.approx(learner.spec.obs_scale)
    if which == "nature":
        _learns_the_bandit(learner, state)
    learner.close()


UPDATES = 10


def _learns_the_bandit(learner, state):
    """Reward 1 for naming the lit half: chance is 0.5 per step."""
    returns = []
    for _ in range(UPDATES - 1):  # the same compiled one-update program each time
        state, metrics = learner.update(state, 1)
        returns.append(np.asarray(metrics["returns"])[:, -1])
    returns = np.stack(returns, axis=1)  # [members, updates]: mean reward per step
    assert (returns[:, :2].mean(axis=1) < 0.8).all(), returns  # near chance early on
    assert (returns[:, -3:].mean(axis=1) > 0.9).all(), returns


@pytest.mark.timeout(420)
def test_cli_trains_exports_and_evaluates_envpool_atari(tmp_path):
    pytest.importorskip("envpool")
    out = tmp_path / "run"
    kwargs = json.dumps({"img_height": 36, "img_width": 36, "max_episode_steps": 60})
    run = lambda *args: subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=400
    )
    train = run("-m", "rollout.ppo", "--env", "envpool:Pong-v5", "--env-kwargs", kwargs,
                "--members", "2", "--total-steps", "64", "--num-envs", "2", "--num-steps", "16",
                "--updates-per-call", "2", "--checkpoint-every", "2", "--no-progress",
                "--out", str(out))  # fmt: skip
    assert train.returncode == 0, train.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["env_steps"] == 64 and len(rows[-1]["returns"]) == 2
    exp = run("-m", "rollout.ppo.export", str(out))
    assert exp.returncode == 0, exp.stderr[-2000:]
    meta = json.loads((out / "export" / "member_0" / "member.json").read_text())
    assert meta["network"]["obs_shape"] == [4, 36, 36] and meta["network"]["channels_first"]
    members = [export.read_member(p) for p in export.member_dirs(out / "export")]
    result = evaluate.evaluate(members, episodes=2, seed=3)
    # Pong scores -1 per point lost, and 60 steps are too few to win or lose many points.
    assert set(result) == {"member_0", "member_1", "ensemble"}
    for returns in result.values():
        assert returns.shape == (2,) and (returns <= 1).all() and (returns >= -3).all()
    again = evaluate.envpool_returns(members[1].act, "envpool:Pong-v5", 2, 3, json.loads(kwargs))
    np.testing.assert_array_equal(again, result["member_1"])  # seeded: reproducible


@pytest.mark.timeout(120)
def test_evaluation_scores_whole_atari_games_with_raw_rewards():
    """A run trained with CleanRL's Atari signals (a lost life ends an episode, rewards clipped)
    is evaluated on whole games with raw rewards, played as in training: after a lost life
    EnvPool restarts play (no-ops, FIRE) as it does under episodic_life (EnvPool stepped
    directly, its own autoreset continuing the game)."""
    envpool = pytest.importorskip("envpool")
    kw = {"img_height": 36, "img_width": 36, "max_episode_steps": 3000, "episodic_life": True}
    mix = jnp.uint32(2654435761)  # random-looking moves or FIRE, a function of the frames
    policy = lambda obs: jnp.maximum((jnp.sum(obs, (1, 2, 3)).astype("uint32") * mix >> 28) % 4, 1)
    got = evaluate.envpool_returns(policy, "envpool:Breakout-v5", 8, 5, {**kw, "reward_clip": True})
    pool = envpool.make("Breakout-v5", env_type="gymnasium", num_envs=8, seed=5, **kw)
    obs, _ = pool.reset()
    want, live, first_life, first = np.zeros(8), np.ones(8, bool), np.ones(8, bool), np.zeros(8)
    ids = np.arange(8, dtype=np.int32)
    while live.any():
        final, reward, term, trunc, info = pool.step(np.asarray(policy(obs.astype(np.float32))))
        want += np.where(live, reward, 0.0)
        first += np.where(first_life, reward, 0.0)  # what an episode of one life scores
        live &= ~(info["terminated"].astype(bool) | trunc)
        first_life &= live & ~term
        obs, done = final, ids[term | trunc]
        if done.size:  # EnvPool's own autoreset (a lost life: the same game), as in training
            obs = obs.copy()
            obs[done] = pool.step(np.zeros(done.size, np.int32), done)[0]
    np.testing.assert_array_equal(got, want)
    assert (want > first).any()  # points after the first life count


def test_action_spaces_with_nothing_to_choose_are_refused():
    env = type("E", (), dict(name="mine", observation_space=envs.Box.uniform((3,), 0, 1),
                             action_space=envs.Box.uniform((0,), -1, 1)))()  # fmt: skip
    with pytest.raises(ValueError, match=r"mine: a continuous action box of shape \(0,\) has no"):
        envlib.spec_of(env)
