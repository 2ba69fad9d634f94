"""Ensemble PPO: GAE, config errors, placement of the train state, learning, resume, the CLI."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax_events import count_compiles
from subprocess_env import clean_env

import ensemble
from rollout import envs
from rollout.ppo import Learner, PPOConfig, gae, train

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------- GAE


def _gae_reference(rewards, values, dones, last_value, gamma, lam):
    """GAE by hand, one step at a time, as in the paper (dones[t]: the episode ended at step t)."""
    T = len(rewards)
    adv = np.zeros_like(rewards)
    next_adv = np.zeros_like(last_value)
    for t in reversed(range(T)):
        next_value = last_value if t == T - 1 else values[t + 1]
        live = 1.0 - dones[t]
        delta = rewards[t] + gamma * next_value * live - values[t]
        next_adv = delta + gamma * lam * live * next_adv
        adv[t] = next_adv
    return adv, adv + values


def test_gae_matches_hand_computed_reference():
    rng = np.random.default_rng(0)
    T, B = 9, 5
    rewards = rng.normal(size=(T, B)).astype(np.float32)
    values = rng.normal(size=(T, B)).astype(np.float32)
    dones = (rng.random((T, B)) < 0.3).astype(np.float32)
    dones[-1, 0] = 1.0  # an episode ending on the very last step: last_value must be ignored
    last_value = rng.normal(size=(B,)).astype(np.float32)
    adv, ret = jax.jit(gae, static_argnums=(4, 5))(rewards, values, dones, last_value, 0.99, 0.95)
    ref_adv, ref_ret = _gae_reference(rewards, values, dones, last_value, 0.99, 0.95)
    np.testing.assert_allclose(adv, ref_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret, ref_ret, rtol=1e-5, atol=1e-5)


def test_gae_small_case_by_hand():
    # Rewards 1, episode ends after step 1, gamma = lam = 1: advantages count the steps left.
    adv, ret = gae(
        np.ones(3, np.float32),
        np.zeros(3, np.float32),
        np.array([0.0, 1.0, 0.0], np.float32),
        np.float32(10.0),
        1.0,
        1.0,
    )
    np.testing.assert_allclose(adv, [2.0, 1.0, 11.0])
    np.testing.assert_allclose(ret, adv)


def test_orthogonal_init_matches_flax_without_lapack():
    import flax.linen as nn

    from rollout.ppo._networks import orthogonal

    # Conv kernels and the Nature CNN's 3136 x 512 dense kernel span several Gram-Schmidt blocks.
    # Jitted, as inits run inside a model's init (eager, every op would compile on its own).
    init, flax_init = (
        jax.jit(f(1.5), static_argnums=1) for f in (orthogonal, nn.initializers.orthogonal)
    )
    for shape in [(4, 64), (64, 64), (64, 2), (3, 64), (3, 3, 16, 16), (3136, 512), (512, 100)]:
        key = jax.random.key(sum(shape))
        mine = init(key, shape)
        np.testing.assert_allclose(mine, flax_init(key, shape), atol=2e-6)
        flat = np.asarray(mine).reshape(-1, shape[-1])
        gram = flat.T @ flat if flat.shape[0] >= flat.shape[1] else flat @ flat.T
        np.testing.assert_allclose(gram, 2.25 * np.eye(len(gram)), atol=3e-6)


# ---------------------------------------------------------------------- config errors


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(members=3), r"n=3 members on D=8 devices"),
        (dict(members=0), r"members must be a positive integer"),
        (dict(env="mountaincar"), r"unknown env 'mountaincar'; known envs: audio, cartpole, "),
        (dict(env="cartpol"), r"unknown env 'cartpol'; did you mean 'cartpole'\? known envs"),
        (dict(num_steps=0), r"num_steps must be a positive integer"),
        (dict(total_steps=-5), r"total_steps must be a positive integer"),
        (dict(total_steps=100), r"less than one update's batch"),
        (dict(num_minibatches=3), r"num_minibatches=3 must divide"),
        (dict(learning_rate=(1e-3, 2e-3)), r"learning_rate has 2 values but there are members=8"),
        (dict(env_on="gpu"), r"env_on must be 'device' or 'cpu'"),
        (dict(seed=2**32), r"seed must be an integer in \[0, 2\*\*32\), got 4294967296"),
        (dict(seed=-1), r"seed must be an integer in \[0, 2\*\*32\), got -1"),
    ],
)
def test_bad_config_fails_before_any_compile(overrides, match):
    overrides = {"members": 8, **overrides}
    cfg = PPOConfig.for_env(overrides.pop("env", "cartpole"), **overrides)
    with count_compiles() as compiles, pytest.raises(ValueError, match=match):
        Learner(cfg)
    assert compiles == []


def test_per_member_hyperparameters_and_aliases():
    cfg = PPOConfig.for_env("CartPole-v1", members=2, ent_coef=[0.0, 0.05])
    assert cfg.env == "cartpole"
    assert cfg.per_member("ent_coef") == (0.0, 0.05)
    assert cfg.per_member("clip_coef") == (0.2, 0.2)
    assert PPOConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


# ---------------------------------------------------------------------- placement


def _tiny(env: str, members: int, **kw) -> PPOConfig:
    base = dict(
        members=members,
        num_envs=2,
        num_steps=16,
        update_epochs=1,
        num_minibatches=2,
        total_steps=4 * 32,
        updates_per_call=2,
    )
    base.update(kw)
    return PPOConfig.for_env(env, **base)


def _assert_member_sharded(tree, mesh, n):
    """Every leaf: leading axis n, member axis on 'ensemble', each member's rows on its device."""
    ensemble.assert_member_axis(tree, n)
    ensemble.assert_member_placement(tree, mesh, n)
    ensemble.assert_no_replicated_members(tree, n, mesh)
    blocks = mesh.shape[ensemble.MEMBER_AXIS]
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        assert leaf.sharding.spec[0] == ensemble.MEMBER_AXIS, jax.tree_util.keystr(path)
        for shard in leaf.addressable_shards:
            rows = shard.index[0]
            chex.assert_shape(shard.data, (n // blocks, *leaf.shape[1:]))
            # The device that holds member block e is the mesh's device at ensemble index e.
            block = (rows.start or 0) // (n // blocks)
            assert shard.device in set(mesh.devices[block].flat), jax.tree_util.keystr(path)


# One member per device, and each member over two devices; two members per device in the
# resume test (compiles are slow).
@pytest.mark.parametrize("env, members, num_devices", [("pendulum", 8, 8), ("cartpole", 4, 8)])
def test_every_member_shaped_array_is_sharded_from_init_to_metrics(env, members, num_devices):
    # Per-member learning rates (no annealing, so the metric shows them unchanged).
    lrs = tuple(1e-3 / (i + 1) for i in range(members))
    cfg = _tiny(env, members, learning_rate=lrs, anneal_lr=False)
    learner = Learner(cfg, devices=jax.devices()[:num_devices])
    mesh, n = learner.mesh, members
    state = learner.init()
    shapes = learner.state_shapes()
    chex.assert_trees_all_equal_shapes_and_dtypes(state, shapes)
    _assert_member_sharded(state.members, mesh, n)
    ms = state.members
    obs_shape = learner.spec.obs_shape
    chex.assert_shape(ms.obs, (n, cfg.num_envs, *obs_shape))
    chex.assert_shape([ms.ep_return, ms.ep_length, ms.disc_return], (n, cfg.num_envs))
    chex.assert_shape([ms.obs_stats.mean, ms.obs_stats.var], (n, *obs_shape))
    chex.assert_shape([ms.last_return, ms.rng[:, 0], *ms.hparams.values()], (n,))
    for leaf in jax.tree_util.tree_leaves(ms.env_state):
        assert leaf.shape[:2] == (n, cfg.num_envs)
    assert state.update.shape == () and state.update.sharding.is_fully_replicated

    new_state, metrics = learner.update(state, 2)
    assert state.members.obs.is_deleted(), "the train state must be donated"
    _assert_member_sharded(new_state.members, mesh, n)
    same = jax.tree_util.tree_map(
        lambda x, s: x.sharding == s, new_state, learner.state_shardings()
    )
    assert all(jax.tree_util.tree_leaves(same)), "out_shardings must equal the in shardings"
    _assert_member_sharded(metrics, mesh, n)
    for name, m in metrics.items():
        chex.assert_shape(m, (n, 2), custom_message=name)
    assert int(new_state.update) == 2
    host = jax.device_get(metrics)
    assert np.all(np.isfinite(host["policy_loss"])) and np.all(np.isfinite(host["value_loss"]))
    if env == "pendulum":  # observation normalisation is on for continuous control
        assert np.all(np.asarray(new_state.members.obs_stats.count) > 1.0)
    # Members differ by seed: different params and different trajectories.
    w = np.asarray(new_state.members.params["actor_0"]["kernel"])
    assert not np.allclose(w[0], w[1])
    # Each member trains with its own learning rate (in its own optimizer state).
    np.testing.assert_allclose(host["learning_rate"][:, -1], lrs, rtol=1e-6)
    lr_state = jax.device_get(new_state.members.opt_state.hyperparams["learning_rate"])
    np.testing.assert_allclose(lr_state, lrs, rtol=1e-6)
    if env == "pendulum":
        _returns_are_those_of_each_updates_own_episodes(learner, new_state)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "env, env_on, num_devices",
    [
        ("pendulum", "device", 4),
        ("pendulum", "device", 8),  # each member on 2 devices
        ("cartpole", "cpu", 4),
        ("gymnasium:CartPole-v1", "device", 2),
        ("gymnasium:CartPole-v1", "device", 8),
        ("envpool:CartPole-v1", "device", 2),
    ],
)
def test_the_update_program_moves_nothing_between_members(env, env_on, num_devices):
    """Members share nothing, so the compiled update holds no collective across members: any
    would move one member's data to another's device, and one inside the rollout loop would
    also make every device wait for the others at every env step. A member on 2 devices
    shares its own work between them. EnvPool's pools of consecutive seeds start from a key of
    the run's and the update's, the same on every device: from member 0's key, an all-reduce
    left the other devices waiting for one whose envs failed until XLA aborted the process."""
    if env.startswith("envpool:"):
        pytest.importorskip("envpool")
    from rollout import envs

    cfg = _tiny(env, 4, env_on=env_on, num_steps=8, updates_per_call=1)
    made = envs.make(env) if ":" in env else None
    learner = Learner(cfg, devices=jax.devices()[:num_devices], env=made)
    try:
        compiled = learner.lower(learner.state_shapes()).compile()
    finally:
        learner.close()
    across = ensemble.debug.collectives(compiled, across_members=True)
    if made is not None and num_devices > cfg.members:
        # A member's second device gets its envs' results from the first (a psum): a member's
        # own collective, there but not across members.
        assert ensemble.debug.collectives(compiled) != {}
    assert across == {}, across


@pytest.mark.timeout(180)
@pytest.mark.parametrize("env", ["pendulum", "gymnasium:CartPole-v1"])
def test_the_update_programs_peak_per_device_falls_as_one_over_devices(env):
    """8 members on 1 and on 8 devices: the compiled update's per-device peak (arguments,
    outputs and temporaries, less what is donated) on 8 is at most 1.05x the 1-device peak / 8:
    each device holds its own member's state, rollout and gradients, and nothing else."""
    from rollout import envs

    peaks = {}
    for d in (1, 8):
        cfg = _tiny(env, 8, num_envs=4, num_steps=64, updates_per_call=1, total_steps=256)
        learner = Learner(
            cfg, devices=jax.devices()[:d], env=envs.make(env) if ":" in env else None
        )
        try:
            compiled = learner.lower(learner.state_shapes()).compile()
        finally:
            learner.close()
        peaks[d] = ensemble.compiled_memory(compiled).peak
    assert peaks[8] <= 1.05 * peaks[1] / 8, peaks


def _returns_are_those_of_each_updates_own_episodes(learner, state):
    """Pendulum's episodes are 200 steps: with 16 steps per update, updates 0-11 end none,
    update 12 ends every env's first (steps 192-207), update 13 none again. An update without
    a finished episode reports NaN, not an earlier update's return."""
    rows = []
    for _ in range(6):  # updates 2-13, with the program already compiled for 2
        state, metrics = learner.update(state, 2)
        rows.append(jax.device_get(metrics))
    get = lambda name: np.concatenate([r[name] for r in rows], axis=1)  # [n, updates 2-13]
    episodes, returns, lengths = get("episodes"), get("returns"), get("episode_length")
    want = np.zeros_like(episodes)
    want[:, 10] = learner.config.num_envs
    np.testing.assert_array_equal(episodes, want)
    assert np.isfinite(returns[:, 10]).all() and (returns[:, 10] < 0).all()
    np.testing.assert_array_equal(lengths[:, 10], 200.0)
    assert np.isnan(np.delete(returns, 10, axis=1)).all()
    assert np.isnan(np.delete(lengths, 10, axis=1)).all()
    assert np.isnan(np.asarray(state.members.last_return)).all()


# ---------------------------------------------------------------------- learning


def test_cartpole_return_rises_far_above_random():
    # Random CartPole play lasts ~22 steps. CleanRL defaults, 2 members, 60k steps each.
    cfg = PPOConfig.for_env("cartpole", members=2, total_steps=60_000, seed=1, updates_per_call=13)
    _, rows = train(cfg, progress=False, devices=jax.devices()[:2])
    late = np.array([r["returns"] for r in rows[-10:]], dtype=float)  # [10 updates, 2 members]
    assert np.isfinite(late).sum(axis=0).min() >= 5  # None (nan): no episode ended that update
    per_member = np.nanmean(late, axis=0)
    assert np.all(per_member > 100), per_member
    assert rows[-1]["env_steps"] == cfg.num_updates * cfg.batch_size


# ---------------------------------------------------------------------- resume


class _Stop(Exception):
    pass


def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path):
    # 4 members on 2 devices: two members per device.
    cfg = _tiny("cartpole", 4, total_steps=6 * 32, updates_per_call=2)
    learner = Learner(cfg, devices=jax.devices()[:2])
    full, full_rows = train(cfg, tmp_path / "full", progress=False, learner=learner)

    def stop_at_5(row):  # crash in the third call: checkpoints after calls 1, 2 exist
        if row["update"] == 5:
            raise _Stop

    run = tmp_path / "cut"
    with pytest.raises(_Stop):
        train(
            cfg,
            run,
            progress=False,
            checkpoint_every=1,
            learner=learner,
            on_update=stop_at_5,
        )
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 4
    resumed, _ = train(cfg, run, resume=True, progress=False, learner=learner)

    chex.assert_trees_all_equal(jax.device_get(resumed), jax.device_get(full))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    strip = lambda rs: [{k: v for k, v in r.items() if k != "env_steps_per_s"} for r in rs]
    assert strip(rows) == strip(full_rows)
    _assert_member_sharded(resumed.members, learner.mesh, 4)
    assert learner._init_program._cache_size() == 1  # (it compiled anew for every run)
    with jax.debug_nans(True), pytest.raises(RuntimeError, match=r"marks 'no episode finished"):
        learner.init()  # its NaN markers would be reported as NaNs

    other = _tiny("cartpole", 4, total_steps=6 * 32, updates_per_call=2, gamma=0.9)
    with pytest.raises(ValueError, match=r"another config \(gamma 0.99 -> 0.9\)"):
        train(other, run, resume=True, progress=False, devices=jax.devices()[:2])


# ---------------------------------------------------------------------- CLI


@pytest.mark.timeout(60)
def test_the_plots_leave_the_callers_matplotlib_backend_alone(tmp_path):
    """train() in a notebook draws its PNGs without switching the notebook's backend."""
    script = f"""
import matplotlib
matplotlib.use("svg")
from rollout.ppo._cli import plot_curves
from rollout.ppo._pbt import HPARAMS, plot_lineage
rows = [{{"env_steps": s, "returns": [1.0 * s, None], "pbt_parent": [0, 0],
          "hparams": {{h: [1e-3, 2e-3] for h in HPARAMS}}}} for s in (8, 16)]
plot_curves(rows, {str(tmp_path / "c.png")!r}, "t")
plot_lineage(rows, {str(tmp_path / "l.png")!r}, "t")
assert matplotlib.get_backend() == "svg", matplotlib.get_backend()
"""
    proc = subprocess.run([sys.executable, "-c", script], env=clean_env(), capture_output=True,
                          text=True, timeout=50)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name in ("c.png", "l.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("n", [8, 32])
def test_the_plots_key_every_member_inside_the_figure(tmp_path, monkeypatch, n):
    """pbt_lineage.png's legend, drawn inside the axes in 8 columns, was wider than the figure:
    members 6 and 7 were cut off. Up to 10 members a legend beside the axes names each; more
    share a colour scale with a colour bar (their legend outgrew the plot, colours repeating)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from rollout.ppo._cli import plot_curves
    from rollout.ppo._pbt import HPARAMS, plot_lineage

    saved = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: saved.append(fig))
    rows = [{"env_steps": s, "returns": [float(s)] * n, "pbt_parent": list(range(n)),
             "hparams": {h: [1e-3] * n for h in HPARAMS}} for s in (8, 16)]  # fmt: skip
    plot_curves(rows, tmp_path / "c.png", "t")
    plot_lineage(rows, tmp_path / "l.png", "t")
    for fig in saved:
        renderer = FigureCanvasAgg(fig).get_renderer()
        fig.draw(renderer)
        if n > 10:
            assert not fig.legends and any(ax.get_label() == "<colorbar>" for ax in fig.axes)
            continue
        (legend,) = fig.legends
        ends = [(t.get_text(), t.get_window_extent(renderer).p1) for t in legend.get_texts()]
        assert [text for text, end in ends if fig.bbox.contains(*end)] == [
            f"member {i}" for i in range(n)
        ]


def test_a_state_that_cannot_fit_in_memory_is_refused_before_anything_is_made(
    tmp_path, monkeypatch, capsys
):
    """--hidden 100000000 was killed by the OS for memory, with no word (exit 137)."""
    import rollout._devices
    from rollout.ppo import main
    from rollout.ppo._learner import StateTooLarge

    cfg = PPOConfig.for_env("cartpole", members=2, hidden=(1000, 1000))
    network = Learner(cfg, devices=jax.devices()[:2]).network  # actor and critic MLPs
    shapes = jax.eval_shape(network.init, jax.random.key(0), jnp.zeros((1, 4)))
    params = sum(leaf.size for leaf in jax.tree.leaves(shapes))
    assert params > 2 * 1000 * 1000
    need = 2 * 4 * 4 * params  # 2 members, 4 bytes, params + gradients + 2 Adam moments
    monkeypatch.setattr(rollout._devices, "available_memory", lambda: need)
    Learner(cfg, devices=jax.devices()[:2])  # exactly fits
    monkeypatch.setattr(rollout._devices, "available_memory", lambda: need - 1)
    with pytest.raises(StateTooLarge, match=r"hidden=\(1000, 1000\) needs at least 0.1 GB for 2"):
        Learner(cfg, devices=jax.devices()[:2])
    out = tmp_path / "run"
    argv = ["--hidden", "1000,1000", "--members", "2", "--out", str(out), "--no-progress"]
    assert main(argv) == 2
    assert (
        "more than the 0.1 GB of this host's free memory; give narrower" in capsys.readouterr().err
    )
    assert not (out / "run.json").exists()


def test_an_update_whose_activations_cannot_fit_is_refused_before_the_state_is_made(
    tmp_path, monkeypatch, capsys
):
    """--hidden 4000000 passed the state check (its parameters fit) and the update's
    activations got the process killed by the OS with no word (exit 137); 16777216 was a
    RESOURCE_EXHAUSTED traceback that left run.json and its lock behind (exit 1)."""
    import rollout._devices
    from rollout.ppo import main
    from rollout.ppo._learner import StateTooLarge

    cfg = PPOConfig.for_env("cartpole", members=2, hidden=(2048,))
    learner = Learner(cfg, devices=jax.devices()[:2])
    lowered = learner.lower(learner.state_shapes(), cfg.updates_per_call)
    peak = ensemble.compiled_memory(lowered).peak  # per device
    monkeypatch.setattr(rollout._devices, "available_memory", lambda: 2 * peak - 1)
    Learner(cfg, devices=jax.devices()[:2])  # the state alone fits
    out = tmp_path / "run"
    argv = ["--hidden", "2048", "--members", "2", "--out", str(out), "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(
        f"error: an update ({cfg.updates_per_call} per call) of 2 member(s) with hidden=(2048,) "
        "and 4 envs x 128 steps needs about"
    ), err
    assert not out.exists()
    # The Python API: refused at the first call of that many updates, the state kept.
    monkeypatch.setattr(rollout._devices, "available_memory", lambda: None)
    state = learner.init()
    monkeypatch.setattr(rollout._devices, "available_memory", lambda: 1000)
    with pytest.raises(StateTooLarge, match=r"give narrower hidden layers, fewer members"):
        learner.update(state, 2)
    monkeypatch.setattr(rollout._devices, "available_memory", lambda: None)
    learner.update(state, 2)  # not donated to the refused call


@pytest.mark.parametrize("env", ["cartpole", "gymnax:CartPole-v1"])
def test_the_cli_writes_the_contract_metrics_and_compiles_its_update_program_once(
    env, tmp_path, caplog
):
    """The memory check compiles the first call's program before the state exists; from
    unplaced shapes (or without a gymnax state's weak types), the call then compiled it again
    (2.3 s more for CartPole), as did a resumed run whose first call was smaller. The same
    runs write the metrics' contract: a row per update with every member's return, the
    learning curve and a checkpoint (one run checks both: each CLI run compiles a learner)."""
    import logging

    from rollout.ppo import main

    if env.startswith("gymnax:"):
        pytest.importorskip("gymnax")
    out = tmp_path / "run"
    argv = ["--env", env, "--members", "2", "--out", str(out), "--no-progress"]
    for steps, more in ((2048, []), (3072, ["--resume"])):  # the resumed run: 2 updates of 4
        caplog.clear()
        with jax.log_compiles(True), caplog.at_level(logging.WARNING):
            assert main([*argv, "--total-steps", str(steps), *more]) == 0
        compiled = [r.getMessage() for r in caplog.records]
        assert len([c for c in compiled if "compilation of jit(updates)" in c]) == 1, compiled
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        # 4 envs x 128 steps (the CLI's defaults) per update: a row each, none twice on resume.
        assert [r["env_steps"] for r in rows] == list(range(512, steps + 1, 512)), rows
        assert all(len(r["returns"]) == 2 for r in rows), "a return per member in every row"
        assert (out / "learning_curve.png").stat().st_size > 0, "no learning curve"
        assert any(p.name.startswith("ckpt_") for p in out.iterdir()), "no checkpoint"


def test_the_accelerator_memory_check_reads_a_device_of_this_process():
    """On accelerators the check reads one device's bytes_limit. It read the mesh's first
    device, which in a multi-process run is process 0's: every other process failed with
    JAX's 'MemoryStats is only supported for addressable PjRt devices'."""
    from types import SimpleNamespace

    from rollout.ppo._learner import StateTooLarge, _refuse_a_state_too_big

    class Chip:
        platform, device_kind = "tpu", "TPU test"

        def __init__(self, mine: bool):
            self.mine = mine

        def memory_stats(self):
            if not self.mine:
                raise RuntimeError("MemoryStats is only supported for addressable PjRt devices.")
            return {"bytes_limit": 1000}

    other, mine = Chip(False), Chip(True)
    mesh = SimpleNamespace(
        devices=np.array([other, mine]), local_devices=[mine], shape={"ensemble": 2}
    )
    learner = Learner(PPOConfig.for_env("cartpole", members=2), devices=jax.devices()[:2])
    with pytest.raises(StateTooLarge, match=r"more than the 0\.0 GB of the memory of one TPU test"):
        _refuse_a_state_too_big(learner.network, learner.spec, mesh, learner.config)


def test_a_misspelt_library_prefix_is_named_with_the_right_one():
    from rollout.ppo._env import known_envs

    with pytest.raises(ValueError, match=r"did you mean 'gymnasium:Ant-v5'\?"):
        PPOConfig(env="gymnasiun:Ant-v5").validate(known_envs=known_envs())


def test_cli_bad_config_is_a_clear_error_and_exit_code_2(tmp_path, capsys):
    from rollout.ppo import main

    new = tmp_path / "new" / "run"  # made for the checks: a refused command leaves none
    argv = ["--members", "3", "--devices", "2", "--out", str(new), "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--members 3 does not fit 2 devices:" in err
    assert "give --devices a divisor of 3 (1, 3: several" in err
    assert not (tmp_path / "new").exists()
    # A typo's member count: one line, not a MemoryError building 10^12 per-member values.
    assert main(["--members", "1000000000000", "--out", str(new), "--no-progress"]) == 2
    assert "members=1000000000000 is more than 1,048,576" in capsys.readouterr().err
    # Counts past int32 (the update counter, the epoch loop): one line before anything compiles,
    # where JAX's OverflowError named argument 'x2' after run.json was written.
    for flag, value in (("--total-steps", str(512 * 2**31)), ("--update-epochs", str(2**31))):
        assert main([flag, value, "--out", str(new), "--no-progress"]) == 2
        assert "2,147,483,648 is more than the 2,147,483,647" in capsys.readouterr().err
        assert not (tmp_path / "new").exists()
    from rollout.ppo._cli import UsageError, _check_fits

    for members, n_dev in ((8, 4), (2, 4), (4, 4)):
        _check_fits(members, n_dev, 1, on_cpu=False)
    with pytest.raises(UsageError, match="the 4 accelerators: use a multiple or a divisor of 4"):
        _check_fits(6, 4, 1, on_cpu=False)
    with pytest.raises(UsageError, match=r"\(2 per process\): give --devices 1 \(a process has 2;"):
        _check_fits(6, 4, 2, on_cpu=True)
    assert main(["--env", "acrobot", "--out", str(tmp_path), "--no-progress"]) == 2
    assert "unknown env 'acrobot'" in capsys.readouterr().err
    assert main(["--seed", "99999999999999999999", "--out", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: seed must be an integer in [0, 2**32), got 99999999999999999999."]
    argv = ["--env", "gymnasium:CartPole-v1", "--env-on", "cpu", "--out", str(tmp_path)]
    assert main(argv) == 2
    assert "runs in CPU worker processes whatever env_on says" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing written


# ---------------------------------------------------------------------- env on CPU cores


@pytest.mark.timeout(240)  # a callback from a sharded CPU step must never hang
def test_env_on_cpu_learns_exactly_like_env_on_device():
    results = []
    for env_on in ("device", "cpu"):
        cfg = _tiny("cartpole", 2, env_on=env_on)
        learner = Learner(cfg, devices=jax.devices()[:2])
        try:
            state, metrics = learner.update(learner.init(), 2)
            results.append(jax.device_get((state.members, metrics)))
        finally:
            learner.close()
    # Same RNG stream, same env maths: the CPU workers reproduce the on-device run.
    chex.assert_trees_all_close(results[0], results[1], rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(240)
def test_close_waits_for_a_dispatched_update_before_stopping_the_cpu_workers():
    """close() right after an update was dispatched returned with no workers; the update's env
    steps then started a new pool, left running until the interpreter exited."""
    import os
    import time

    from subprocess_env import workers_of

    before = set(workers_of(os.getpid(), "on_cpu"))  # other tests' pools in this process
    learner = Learner(_tiny("cartpole", 2, env_on="cpu"), devices=jax.devices()[:2])
    state, metrics = learner.update(learner.init(), 2)
    jax.block_until_ready(metrics)
    state, metrics = learner.update(state, 2)  # dispatched (compiled above), not waited for
    learner.close()
    jax.block_until_ready(metrics)
    time.sleep(1.0)  # a pool started by the late env steps would be up by now
    assert learner.envs.pids == []
    assert set(workers_of(os.getpid(), "on_cpu")) <= before


def test_close_after_the_latest_metrics_were_deleted_still_stops_the_workers():
    """wait_for_outputs read a deleted array's shards and raised, so close() never reached the
    envs, and the CPU workers ran on until the interpreter exited."""
    import os

    from subprocess_env import workers_of

    before = set(workers_of(os.getpid(), "on_cpu"))
    learner = Learner(_tiny("cartpole", 2, env_on="cpu"), devices=jax.devices()[:2])
    _, metrics = learner.update(learner.init(), 1)
    metrics["value_loss"].delete()
    learner.close()
    assert learner.envs.pids == [] and set(workers_of(os.getpid(), "on_cpu")) <= before


def test_a_debug_print_in_an_env_is_explained_with_how_to_run_the_env_alone():
    """JAX's own error was `axis_index() takes 1 positional argument but 2 were given`."""

    @dataclasses.dataclass(frozen=True)
    class Printing(envs.CartPole):
        def step(self, state, action, key, params=None):
            out = super().step(state, action, key, params)
            jax.debug.print("reward {r}", r=out[2])
            return out

    cfg = dataclasses.replace(_tiny("cartpole", 2), env="printing")
    learner = Learner(cfg, env=envs.AutoReset(Printing()), devices=jax.devices()[:2])
    with pytest.raises(TypeError, match=r"jax\.debug\.print .* step its env alone, "
                       r"jax\.jit\(env\.step\)"):  # fmt: skip
        learner.update(learner.init(), 1)
    # The memory check compiles the update first: its errors are the call's own, not
    # compiled_memory's advice to pass other arguments.
    learner = Learner(_tiny("cartpole", 2), devices=jax.devices()[:2])
    learner._compile_updates = lambda k: jax.jit(lambda state, length: jnp.zeros(3) + jnp.zeros(4))
    with pytest.raises(TypeError, match=r"^add got incompatible shapes"):
        learner.update(learner.init(), 1)


@pytest.mark.parametrize("env", ["pendulum", "cartpole"])
def test_values_batched_after_the_rollout_equal_values_computed_at_each_step(env, monkeypatch):
    """An MLP's critic is apart from its actor, so the rollout runs the actor alone and V comes
    in one call afterwards; the update must be the one that computes V at every step."""
    from rollout.ppo import _networks as nets

    results = []
    for apart in (True, False):
        with monkeypatch.context() as m:
            m.setattr(nets.ActorCritic, "critic_apart", apart)
            learner = Learner(_tiny(env, 2), devices=jax.devices()[:2])
            state, metrics = learner.update(learner.init(), 2)  # compiled under the patch
            results.append(jax.device_get((state.members, metrics)))
    chex.assert_trees_all_close(results[0], results[1], rtol=1e-5, atol=1e-6)


def test_updates_past_the_end_of_an_annealed_schedule_run_at_learning_rate_zero():
    cfg = _tiny("cartpole", 2, total_steps=2 * 32, learning_rate=(1e-3, 4e-3))  # 2 updates
    learner = Learner(cfg, devices=jax.devices()[:2])
    state, metrics = learner.update(learner.init(), 4)
    lr = np.asarray(metrics["learning_rate"])
    np.testing.assert_allclose(lr, [[1e-3, 5e-4, 0, 0], [4e-3, 2e-3, 0, 0]], rtol=1e-6)
    before = jax.device_get(state.members.params)
    state, _ = learner.update(state, 1)  # lr 0: the parameters stay (was gradient ascent)
    chex.assert_trees_all_equal(jax.device_get(state.members.params), before)


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(vf_coef=-1.0), "vf_coef must be finite and >= 0"),
        (dict(vf_coef=float("nan")), "vf_coef must be finite and >= 0"),
        (dict(max_grad_norm=float("nan")), "max_grad_norm must be finite and > 0"),
        (dict(max_grad_norm=float("inf")), "max_grad_norm must be finite and > 0"),
        (dict(anneal_lr="no"), "anneal_lr must be True or False"),  # "no" is truthy
        (dict(normalize_obs="yes"), "normalize_obs must be True or False"),
        (dict(hidden=(64.5,)), "hidden must be a non-empty tuple of positive ints"),
        (dict(hidden=64), "hidden must be a non-empty tuple of positive ints"),
        (dict(learning_rate="1e-3"), "learning_rate must be a number"),
        (dict(members=np.int64(2)), r"members is a NumPy int64 .*members=2"),
    ],
)
def test_config_fields_of_the_wrong_type_or_range_are_named(bad, message):
    """These were accepted: a NaN clip norm, annealing left on by anneal_lr='no', a width
    truncated from 64.5, a NumPy int that run.json cannot hold."""
    with pytest.raises((TypeError, ValueError), match=message):
        PPOConfig.for_env("cartpole", **bad).validate()


def test_float32s_largest_finite_value_is_accepted():
    # The float32 check compared against its maximum in float64: printed 3.4028235e38 (finite
    # in float32) was refused as not finite.
    big = float(np.float32(3.4028235e38))
    PPOConfig.for_env("cartpole", members=8, vf_coef=3.4028235e38, ent_coef=big).validate()


def test_metrics_count_games_with_raw_scores_where_an_env_says_so():
    """An env's ``info["score"]`` (the raw reward, where the training reward is clipped) and
    ``info["episode_goes_on"]`` (a lost life: the training episode ends, the game does not)
    make the metrics' episodes whole games with their scores: a game of 3 lives x 3 steps here,
    training reward 1 and score 10 a step."""
    import jax.numpy as jnp

    from rollout.ppo._learner import Act, Rollout, RunningStats

    learner = Learner(PPOConfig.for_env("cartpole", members=1, num_envs=2, num_steps=8))
    zeros = jnp.zeros(2)
    carry = Rollout(env_state=None, obs=jnp.zeros((2, 4)), obs_stats=RunningStats.zeros((4,)),
                    ret_stats=RunningStats.zeros(()), disc_return=zeros, ep_return=zeros,
                    ep_length=zeros, finished=jnp.zeros(3), rng=None)  # fmt: skip
    act = Act(jnp.zeros((2, 4)), zeros, zeros, zeros, zeros, None)
    dones = []
    for t in range(1, 22):  # env 1 loses its lives one step after env 0
        term = jnp.array([t % 3 == 0, t > 1 and (t - 1) % 3 == 0])
        game_over = jnp.array([t % 9 == 0, t > 1 and (t - 1) % 9 == 0])
        info = {"final_obs": jnp.zeros((2, 4)), "score": jnp.full(2, 10.0),
                "episode_goes_on": term & ~game_over}  # fmt: skip
        out = (None, jnp.zeros((2, 4)), jnp.ones(2), term, jnp.zeros(2, bool), info)
        carry, (step, _) = learner._observe(carry, act, out)
        dones.append(np.asarray(step.done))
    # Four games ended: env 0's at steps 9 and 18 (9 steps, 90 points each), env 1's at 10
    # (its first step counted too: 10 steps, 100 points) and 19 (9 steps, 90 points).
    np.testing.assert_array_equal(np.asarray(carry.finished), [370.0, 37.0, 4.0])
    assert np.sum(dones) == 7 + 6  # every lost life still ends a training episode


@pytest.mark.timeout(300)
@pytest.mark.parametrize("env_on", ["device", "cpu"])
def test_jax_enable_x64_keeps_the_state_float32_and_runs_resume_either_way(env_on, tmp_path):
    """Under jax_enable_x64 a continuous policy's log_std and the running statistics were
    float64 beside float32 weights (the update failed in optax's clip), and a run saved so
    could not resume without x64 (its statistics' checksums no longer matched)."""
    cfg = PPOConfig.for_env("pendulum", members=2, num_envs=4, num_steps=32, total_steps=256,
                            env_on=env_on)  # fmt: skip
    dtypes = lambda tree: [(jax.tree_util.keystr(p), x.dtype) for p, x in
                           jax.tree_util.tree_leaves_with_path(tree)]  # fmt: skip
    # Shapes only, nothing compiled: init() makes these same dtypes without x64 (checked by
    # test_every_member_shaped_array_is_sharded_from_init_to_metrics).
    with Learner(cfg, devices=jax.devices()[:2]) as learner:
        plain = dtypes(learner.state_shapes())
    with jax.enable_x64(True):
        with Learner(cfg, devices=jax.devices()[:2]) as learner:
            assert dtypes(learner.init()) == plain
            train(cfg, tmp_path / "run", progress=False, learner=learner)  # its init compiled
    longer = dataclasses.replace(cfg, total_steps=512)
    warned = []
    state, rows = train(longer, tmp_path / "run", resume=True, progress=False,
                        devices=jax.devices()[:2], warn=warned.append)  # fmt: skip
    assert not warned, warned
    assert rows[-1]["env_steps"] == 512 and dtypes(state) == plain


def test_init_with_members_spanning_devices_warns_nothing():
    """The learner's own one-row sample batch warned that it does not split over a member's
    2 'data' devices: a warning the user could do nothing about."""
    import warnings

    cfg = PPOConfig.for_env("cartpole", members=4, num_envs=2, num_steps=8, total_steps=64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with Learner(cfg, devices=jax.devices()[:8]) as learner:
            assert learner.mesh.shape["data"] == 2
            learner.init()


class _Always(envs.Env):
    """Every step ends the episode with reward 1 from the same observation: every advantage
    of a rollout is the same number."""

    name = "always"
    max_episode_steps = 1
    observation_space = envs.Box.uniform((3,), -10.0, 10.0)
    action_space = envs.Discrete(2)

    def reset(self, key, params=None):
        return jnp.int32(0), jnp.array([5.0, 0.0, 0.0])

    def step(self, state, action, key, params=None):
        return (
            state,
            jnp.array([5.0, 0.0, 0.0]),
            jnp.float32(1.0),
            jnp.bool_(True),
            jnp.bool_(False),
            {},
        )


def test_advantages_that_are_all_equal_normalise_to_zero_not_to_rounding_noise():
    # Their float32 mean is off by an ulp, and (adv - mean) / (std + 1e-8) made that +-0.86:
    # a policy loss of 0.86 where every sample's advantage is 0.
    cfg = PPOConfig(env="always", members=2, num_envs=2, num_steps=16, num_minibatches=1,
                    update_epochs=1, total_steps=64, updates_per_call=1)  # fmt: skip
    assert cfg.norm_adv
    with Learner(cfg, devices=jax.devices()[:2], env=envs.AutoReset(_Always())) as learner:
        _, metrics = learner.update(learner.init(), 2)
    np.testing.assert_array_equal(np.asarray(metrics["policy_loss"]), 0.0)


def test_the_devices_advice_across_processes_lists_only_counts_a_process_has():
    """Under ensemble.launch --devices-per-process 2, --members 6 was told to give --devices 3,
    which the next run refused (a process has 2)."""
    from ensemble import layout
    from rollout.ppo._cli import UsageError, _check_fits

    for members, n_dev, procs in ((6, 4, 2), (12, 8, 2), (6, 8, 2), (9, 12, 3)):
        with pytest.raises(UsageError) as caught:
            _check_fits(members, n_dev, procs, on_cpu=True)
        said = str(caught.value)
        advice = said.split("give --devices ")[1].split(" (")[0].split(" or ")
        assert advice, said
        for per_process in map(int, advice):
            assert per_process <= n_dev // procs, said
            layout(members, per_process * procs)  # fits: no ValueError
