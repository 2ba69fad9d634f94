"""The library under the JAX options users turn on to catch their own mistakes: its own code
must not trip them. (``jax_enable_x64``: ``test_ppo.py``; ``jax_debug_nans`` and
``jax.disable_jit``: ``test_newuser_ensemble.py``.)"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_image_obs import Spot

import ensemble
from rollout import envs
from rollout.ppo import Learner, PPOConfig, export

_BASE = dict(members=2, num_envs=2, num_steps=8, num_minibatches=2, update_epochs=1,
             total_steps=64, updates_per_call=1)  # fmt: skip


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "env, kw",
    [
        ("cartpole", {}),
        ("pendulum", {}),
        ("pendulum", {"env_on": "cpu"}),
        ("audio", {}),
        ("pendulum", {"members": 4, "pbt": True, "pbt_interval": 1, "pbt_fraction": 0.25}),
        ("spot", {"normalize_obs": True}),
    ],
    ids=["cartpole", "pendulum", "pendulum-cpu", "audio", "pendulum-pbt", "image"],
)
def test_ppo_under_rank_promotion_raise(env, kw, tmp_path):
    """``jax_numpy_rank_promotion='raise'`` refuses implicit rank broadcasting; the learner's
    observation normalisation, its action clip and the audio env relied on it."""
    if env == "spot":  # an env of the tests' own: 36x36 frames, the conv torso
        cfg, made = PPOConfig(env="spot", **{**_BASE, **kw}), envs.AutoReset(Spot())
    else:
        cfg, made = PPOConfig.for_env(env, **{**_BASE, **kw}), None
    with jax.numpy_rank_promotion("raise"):
        with Learner(cfg, devices=jax.devices()[:2], env=made) as learner:
            state = learner.init()
            state, metrics = learner.update(state, 2)
            assert np.isfinite(np.asarray(metrics["value_loss"])).all()
            (path,) = export.export_members(learner, state, tmp_path, members=[0])
            obs = jnp.zeros((3, *learner.spec.obs_shape))
            assert export.read_member(path).act(obs).shape[0] == 3


def test_ensemble_under_strict_options():
    """The README's ensemble flow under rank promotion 'raise' and strict dtype promotion."""
    import flax.linen as nn

    model = nn.Dense(2)
    with jax.numpy_rank_promotion("raise"), jax.numpy_dtype_promotion("strict"):
        ens = ensemble.build(model, 8)
        x = jnp.ones((4, 3))
        variables = ens.init(jax.random.key(0), x)
        loss = lambda p, x: jnp.mean(model.apply({"params": p}, x) ** 2)
        step = ens.train_step(loss, optax.sgd(0.1))
        params = variables["params"]
        params, _, losses = step(params, step.init(params), x)
        assert losses.shape == (8,)
        out = ens.apply({"params": params}, x)
        for reduce in (ensemble.mean, ensemble.variance):
            assert reduce(out).shape == (4, 2)


@pytest.mark.timeout(300)
def test_a_run_checkpoints_exports_and_resumes_under_rank_promotion_raise(tmp_path):
    """The checkpoints' checksums broadcast implicitly: every run failed at its first save,
    and a healthy checkpoint read as unrestorable (export and --resume then advised
    --overwrite)."""
    from rollout.ppo import train

    cfg = PPOConfig.for_env("pendulum", **{**_BASE, "updates_per_call": 2})
    devices = jax.devices()[:2]
    with jax.numpy_rank_promotion("raise"):
        train(cfg, tmp_path / "run", progress=False, devices=devices)
        (path,) = export.export_run(tmp_path / "run", tmp_path / "export", members=[1])
        longer = PPOConfig.for_env("pendulum", **{**_BASE, "updates_per_call": 2,
                                                  "total_steps": 128})  # fmt: skip
        _, rows = train(longer, tmp_path / "run", resume=True, progress=False, devices=devices)
    assert [r["update"] for r in rows] == list(range(1, 9)) and path.name == "member_1"


@pytest.mark.timeout(300)
def test_a_checkpoint_with_64_bit_env_state_needs_x64_to_resume(tmp_path):
    """gymnax keeps its env state in float64 under jax_enable_x64; read without x64 it came
    back as float32 and was called damaged ('checksum mismatch'; start over)."""
    pytest.importorskip("gymnax")
    from rollout.ppo import _checkpoint, train

    env = "gymnax:MountainCarContinuous-v0"
    cfg = PPOConfig.for_env(env, **_BASE)
    devices = jax.devices()[:2]
    with jax.enable_x64(True):
        train(cfg, tmp_path / "run", progress=False, devices=devices)
    longer = PPOConfig.for_env(env, **{**_BASE, "total_steps": 96})
    saved = _checkpoint.checkpoints(tmp_path / "run")
    with pytest.raises(_checkpoint.ConfigChanged, match=r"holds 64-bit leaves .*x64 on too"):
        train(longer, tmp_path / "run", resume=True, progress=False, devices=devices)
    assert _checkpoint.checkpoints(tmp_path / "run") == saved  # none set aside as damaged
    with jax.enable_x64(True):
        _, rows = train(longer, tmp_path / "run", resume=True, progress=False, devices=devices)
    assert rows[-1]["update"] == 6


def test_a_checkpoint_from_before_the_generator_was_recorded_is_told_by_its_key_width():
    from ensemble._distributed import _path_names
    from rollout.ppo import _checkpoint

    like = {
        "rng": jax.ShapeDtypeStruct((3, 2), jnp.uint32),
        "w": jax.ShapeDtypeStruct((3, 2), jnp.float32),
    }
    path = jax.tree_util.tree_leaves_with_path(like)[0][0]
    name = _path_names(path)
    other = _checkpoint._other_key_width(None, like, {name: (3, 4)})
    assert other == {name: (3, 4)}  # rbg's 4 words where this process makes 2
    assert _checkpoint._other_key_width(None, like, {name: (3, 2)}) == {}
    assert "keys of 4 words" in str(_checkpoint._key_width_changed(Path("ckpt_1"), 4))


@pytest.mark.timeout(300)
def test_a_run_trains_and_resumes_under_the_rbg_generator_and_refuses_another(tmp_path):
    """``jax_default_prng_impl='rbg'`` (chosen on TPUs for speed) makes raw keys of 4 words, not
    threefry's 2: the learner's state shapes assumed 2, so no learner could start; a run
    resumed under the other generator is a config change, not a damaged checkpoint; an export
    needs no keys, so it reads under either."""
    from rollout.ppo import _checkpoint, train

    cfg = PPOConfig.for_env("cartpole", **_BASE)
    longer = PPOConfig.for_env("cartpole", **{**_BASE, "total_steps": 96})
    devices = jax.devices()[:2]
    with jax.default_prng_impl("rbg"):
        state, rows = train(cfg, tmp_path / "run", progress=False, devices=devices)
        assert state.members.rng.shape == (2, 4) and np.isfinite(rows[-1]["value_loss"]).all()
    saved = _checkpoint.checkpoints(tmp_path / "run")
    for other in ("threefry2x32", "unsafe_rbg"):  # unsafe_rbg's keys are 4 words too
        with (
            jax.default_prng_impl(other),
            pytest.raises(
                _checkpoint.ConfigChanged,
                match=f"jax_default_prng_impl rbg, and this process uses {other}",
            ),
        ):
            train(longer, tmp_path / "run", resume=True, progress=False, devices=devices)
    assert _checkpoint.checkpoints(tmp_path / "run") == saved  # none set aside as damaged
    (path,) = export.export_run(tmp_path / "run", tmp_path / "export", members=[1])
    assert export.read_member(path).act(jnp.zeros((3, 4))).shape == (3,)
    with jax.default_prng_impl("rbg"):
        _, rows = train(longer, tmp_path / "run", resume=True, progress=False, devices=devices)
    assert rows[-1]["update"] == 6


@pytest.mark.timeout(120)
@pytest.mark.parametrize("env", ["cartpole", "pendulum"])
def test_a_learner_is_built_and_updates_under_a_transfer_guard(env):
    """Building a Learner made keys on a device for its checks (shapes only): a global
    jax_transfer_guard='disallow' refused it. The seed's key in init() is the user's own
    transfer (as nnx.Rngs(seed) is); the update then runs with the guard on. (Calls of 2
    updates: the same programs as test_ppo_under_rank_promotion_raise's, compiled once.)"""
    cfg = PPOConfig.for_env(env, **_BASE)
    with jax.transfer_guard("disallow"):
        learner = Learner(cfg, devices=jax.devices()[:2])
    state = learner.init()
    state, _ = learner.update(state, 2)  # compiled here
    with jax.transfer_guard("disallow"):
        jax.block_until_ready(learner.update(state, 2))
