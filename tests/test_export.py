"""Exported members: the loaded policy acts exactly like the learner's own network, each member
is taken from its own devices, and ``python -m rollout.ppo.evaluate`` reports returns."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from subprocess_env import clean_env

from rollout import envs
from rollout.ppo import Learner, PPOConfig, evaluate, export

ROOT = Path(__file__).resolve().parents[1]
MEMBERS, DEVICES = 4, 2


def _trained(env: str, **overrides):
    cfg = PPOConfig.for_env(
        env,
        members=MEMBERS,
        total_steps=4 * 256,
        num_envs=4,
        num_steps=64,
        num_minibatches=2,
        update_epochs=2,
        updates_per_call=2,
        **overrides,
    )
    learner = Learner(cfg, devices=jax.devices()[:DEVICES])
    state = learner.init()
    for _ in range(2):
        state, _ = learner.update(state, 2)
    return learner, state


@pytest.fixture(scope="module")
def cartpole():
    return _trained("cartpole")


@pytest.fixture(scope="module")
def pendulum():
    return _trained("pendulum")  # continuous: observation normalisation on


def _learner_actions(learner, state, i, obs):
    """The learner's own deterministic action: its network on its own normalisation."""
    ms = state.members
    params = jax.tree.map(lambda x: np.asarray(x)[i], ms.params)  # plain slice: a reference
    stats = jax.tree.map(lambda x: np.asarray(x)[i], ms.obs_stats)
    pi, _ = learner.network.apply({"params": params}, learner._normalize(jnp.asarray(obs), stats))
    if learner.spec.discrete:
        return np.asarray(jnp.argmax(pi, axis=-1))
    from rollout.ppo import _env as envlib

    return np.asarray(envlib.to_env_action(pi[0], learner.spec))


def _observations(learner, n=64):
    rng = np.random.default_rng(0)
    shape = learner.spec.obs_shape
    # Mostly typical values, some huge ones (normalisation clip), some exactly at the mean.
    obs = rng.normal(size=(n, *shape)) * np.r_[[1.0] * (n - 8), [50.0] * 8][:, None]
    return obs.astype(np.float32)


@pytest.mark.parametrize("which", ["cartpole", "pendulum"])
def test_loaded_policy_acts_like_the_learner(which, request, tmp_path):
    learner, state = request.getfixturevalue(which)
    paths = export.export_members(learner, state, tmp_path)
    assert [p.name for p in paths] == [f"member_{i}" for i in range(MEMBERS)]
    obs = _observations(learner)
    heads = []
    for i, path in enumerate(paths):
        act = jax.jit(export.load_member(path))
        got = np.asarray(act(obs))
        want = _learner_actions(learner, state, i, obs)
        if learner.spec.discrete:
            np.testing.assert_array_equal(got, want)
            assert got.dtype == np.int32
        else:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        # Runs on one device.
        assert act(obs).devices() == {jax.devices()[0]}
        heads.append(np.asarray(export.read_member(path).head(obs)))
    # Members differ (each its own params), so a mixed-up member index would show.
    assert not np.allclose(heads[0], heads[1])
    meta = json.loads((paths[1] / "member.json").read_text())
    assert meta["member"] == 1 and meta["env"] == which
    assert meta["env_steps"] == 4 * 256  # 4 updates of 4 envs x 64 steps
    assert meta["obs_norm"]["enabled"] == (which == "pendulum")
    assert meta["network"] == {
        "kind": "ActorCritic",
        "obs_shape": list(learner.spec.obs_shape),
        "hidden": [64, 64],
        "action_dim": learner.spec.action_dim,
        "discrete": which == "cartpole",
        "action_groups": [],
        "activation": "tanh",
    }
    with np.load(paths[1] / "obs_norm.npz") as f:
        np.testing.assert_array_equal(f["mean"], np.asarray(state.members.obs_stats.mean)[1])
        assert float(f["count"]) == float(np.asarray(state.members.obs_stats.count)[1])


def test_infinite_action_bounds_clip_only_the_finite_sides(pendulum, tmp_path):
    """A box unbounded on some sides still clips the others, in the learner's env step and in
    an exported member (JSON has no infinity: null)."""
    from rollout.ppo import _env as envlib

    def spec(action_space):
        env = type("E", (), dict(name="mine", action_space=action_space,
                                 observation_space=envs.Box.uniform((2,), -1, 1)))()  # fmt: skip
        return envlib.spec_of(env)

    box = spec(envs.Box((3,), (0.0, -1.0, -np.inf), (np.inf, 1.0, np.inf)))
    actions = jnp.asarray([[-5.0, 7.0, 3.0], [9.0, -9.0, -4.0]])
    want = np.asarray([[0.0, 1.0, 3.0], [9.0, -1.0, -4.0]])
    np.testing.assert_array_equal(envlib.to_env_action(actions, box), want)
    free = spec(envs.Box((3,), (-np.inf,) * 3, (np.inf,) * 3))
    np.testing.assert_array_equal(envlib.to_env_action(actions, free), actions)
    with pytest.raises(ValueError, match=r"mine: continuous actions of shape \(2, 2\) are not"):
        spec(envs.Box.uniform((2, 2), -1, 1))
    # One categorical head picks one action per env: a shaped Discrete would get scalars.
    with pytest.raises(ValueError, match=r"mine: discrete actions of shape \(2,\) are not"):
        spec(envs.Discrete(3, shape=(2,)))
    # A gymnasium space is not read as a box to flatten.
    with pytest.raises(ValueError, match=r"gymnasium.spaces.discrete.Discrete is not supported"):
        spec(pytest.importorskip("gymnasium").spaces.Discrete(3))
    for n in (0, -2, 2.0, True):
        with pytest.raises(ValueError, match="num_actions must be a positive int"):
            envs.Discrete(n)

    learner, state = pendulum  # its network, with this box written into the export
    (path,) = export.export_members(learner, state, tmp_path, members=[0])
    meta_path = path / "member.json"
    meta = json.loads(meta_path.read_text())
    assert meta["action"] == {"low": [-2.0], "high": [2.0], "start": None}
    meta["action"] = {"low": [0.0, -1.0, None], "high": [None, 1.0, None], "start": None}
    written = export._metadata(learner.config, box, meta["network"], True, 0, 0, {})["action"]
    assert written == meta["action"]
    member = export.read_member(path)  # this box on a 1-dim action: a member in memory
    member = dataclasses.replace(member, meta={**member.meta, "action": meta["action"]})
    np.testing.assert_array_equal(member.clip_action(actions), want)
    meta_path.write_text(json.dumps(meta))  # in the file, it disagrees with the network
    with pytest.raises(export.NotAnExport, match=r"'action\.low' has 3 bounds but 'network\.acti"):
        export.read_member(path)
    meta["action"] = {"low": [-2.0], "high": [2.0], "start": [0]}  # a start: discrete only
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(export.NotAnExport, match=r"'action\.start' is a list, but 'network\.dis"):
        export.read_member(path)


def test_export_takes_each_member_from_its_own_devices(cartpole):
    _learner, state = cartpole
    per_device = MEMBERS // DEVICES
    for i in range(MEMBERS):
        owner = jax.devices()[i // per_device]
        for leaf in jax.tree.leaves(export.member_arrays(state, i)):
            assert leaf.sharding.device_set == {owner}, i


def test_format_version_1_still_reads_and_an_unknown_one_is_refused(cartpole, tmp_path):
    learner, state = cartpole
    (path,) = export.export_members(learner, state, tmp_path, members=[2])
    meta_path = path / "member.json"
    meta = json.loads(meta_path.read_text())
    assert meta["version"] == export.VERSION == 4 and meta["action"]["start"] == [0]
    obs = _observations(learner)
    member = export.read_member(path)
    want, acts = np.asarray(member.head(obs)), np.asarray(member.act(obs))
    older = {k: v for k, v in meta["network"].items() if k != "action_groups"}  # (new in 3)
    before_4 = {"low": None, "high": None}  # (action.start: new in 4)
    for version in (1, 2, 3):  # what versions 1 (MLPs only), 2 and 3 wrote
        network = meta["network"] if version == 3 else older
        meta_path.write_text(json.dumps({**meta, "version": version, "network": network,
                                         "action": before_4}))  # fmt: skip
        member = export.read_member(path)
        np.testing.assert_array_equal(member.head(obs), want)
        np.testing.assert_array_equal(member.act(obs), acts)
        assert member.action_start == (0,)
        evaluate.check_env([member], {})  # its action (no start) was refused as edited
    odd = {**older, "action_groups": ["x"]}  # not a field of version 2: not read there
    meta_path.write_text(json.dumps({**meta, "version": 2, "network": odd}))
    assert export.read_member(path).action_groups == ()
    meta_path.write_text(json.dumps({**meta, "network": older}))
    with pytest.raises(export.NotAnExport, match=r"field 'network.action_groups' is missing"):
        export.read_member(path)
    meta_path.write_text(json.dumps({**meta, "action": before_4}))
    with pytest.raises(export.NotAnExport, match=r"field 'action.start' is missing"):
        export.read_member(path)
    # A start whose actions int32 cannot hold reads (as written), but act says what to do
    # instead of wrapping round to -2**31 (outside the env's space).
    for start, ok in ((2**31 - 2, True), (2**31 - 1, False), (2**33, False), (-(2**31), True)):
        meta_path.write_text(json.dumps({**meta, "action": {**before_4, "start": [start]}}))
        member = export.read_member(path)
        if ok:
            np.testing.assert_array_equal(np.asarray(member.act(obs), np.int64), acts + start)
        else:
            with pytest.raises(ValueError, match=r"beyond the int32 that act computes in"):
                member.act(obs)
    meta_path.write_text(json.dumps({**meta, "version": 5}))
    with pytest.raises(export.NotAnExport, match=r"format version 5; .* reads 1, 2, 3, 4"):
        export.read_member(path)
    meta_path.write_text(json.dumps({**meta, "network": {**meta["network"], "kind": "GRU"}}))
    with pytest.raises(export.NotAnExport, match=r"field 'network.kind' is \"GRU\", not 'Actor"):
        export.read_member(path)


def test_export_from_state_equals_export_members(cartpole, tmp_path):
    learner, state = cartpole
    a = export.export_members(learner, state, tmp_path / "a", members=[2])
    b = export.export_from_state(learner.config, state, tmp_path / "b", members=[2])
    assert json.loads((a[0] / "member.json").read_text()) == json.loads(
        (b[0] / "member.json").read_text()
    )
    for name in ("params.npz", "obs_norm.npz"):
        with np.load(a[0] / name) as fa, np.load(b[0] / name) as fb:
            assert fa.files == fb.files
            for k in fa.files:
                np.testing.assert_array_equal(fa[k], fb[k])
    with pytest.raises(IndexError, match="member 4 out of range"):
        export.export_members(learner, state, tmp_path / "c", members=[4])


def _returns_by_hand(policy, env_name, keys, max_steps=None):
    """Episode returns stepped one at a time in Python with the bare env (no auto-reset)."""
    env = envs.make(env_name, auto_reset=False)
    out = []
    for key in keys:
        key = jax.random.wrap_key_data(key)
        state, obs = env.reset(key)
        total, done, t = 0.0, False, 0
        while not done:
            action, t = policy(np.asarray(obs)[None])[0], t + 1
            state, obs, reward, term, trunc, _ = env.step(state, action, jax.random.fold_in(key, t))
            total += float(reward)
            done = bool(term) or bool(trunc) or t == max_steps
        out.append(total)
    return np.asarray(out)


def test_evaluation_returns_equal_a_step_by_step_loop(cartpole, tmp_path):
    learner, state = cartpole
    paths = export.export_members(learner, state, tmp_path, members=[0, 1])
    members = [export.read_member(p) for p in paths]
    result = evaluate.evaluate(members, episodes=3, seed=5)
    keys = np.asarray(jax.random.key_data(evaluate.reset_keys(5, 3)))
    act = jax.jit(members[1].act)
    np.testing.assert_allclose(result["member_1"], _returns_by_hand(act, "cartpole", keys))

    # The ensemble's policy: argmax of the members' mean action probabilities. (Compared on
    # observations and through the same batched runner: near-tied probabilities make a
    # step-by-step loop's last-bit float differences flip actions in a long episode.)
    def ens(obs):
        return jnp.argmax((members[0].probs(obs) + members[1].probs(obs)) / 2, axis=-1)

    obs = _observations(learner)
    np.testing.assert_array_equal(evaluate.ensemble_act(members)(obs), ens(obs))
    ref = evaluate.episode_returns(ens, "cartpole", evaluate.reset_keys(5, 3))
    np.testing.assert_array_equal(result["ensemble"], ref)


def test_evaluate_refuses_a_member_index_given_twice(cartpole, tmp_path):
    learner, state = cartpole
    (path,) = export.export_members(learner, state, tmp_path, members=[1])
    with pytest.raises(ValueError, match=r"^evaluate got member_1 more than once"):
        evaluate.evaluate([export.read_member(path), export.read_member(path)], 1, 0)


def test_evaluating_again_compiles_nothing(cartpole, tmp_path, caplog):
    """Each policy's episodes compiled anew on every evaluate() (its arrays were constants of
    the program): n + 1 compiles per call, also for the members of a later checkpoint."""
    import logging

    learner, state = cartpole
    paths = export.export_members(learner, state, tmp_path, members=[0, 2])
    first = evaluate.evaluate([export.read_member(p) for p in paths], episodes=2, seed=1)
    later = [  # read again, other weights (as a later checkpoint's): same layout
        dataclasses.replace(m, params=jax.tree.map(lambda w: w * 1.5, m.params))
        for m in map(export.read_member, paths)
    ]
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        again = evaluate.evaluate(later, episodes=2, seed=1)
    compiled = [r.getMessage() for r in caplog.records]
    assert not [c for c in compiled if "Finished XLA compilation of jit(" in c], compiled
    assert set(again) == set(first) == {"member_0", "member_2", "ensemble"}
    ref = evaluate.episode_returns(later[1].act, "cartpole", evaluate.reset_keys(1, 2))
    np.testing.assert_array_equal(again["member_2"], ref)  # the new arrays, not the first ones


def test_max_steps_cuts_the_episodes_of_pure_jax_envs_too(cartpole, tmp_path):
    learner, state = cartpole
    member = export.read_member(export.export_members(learner, state, tmp_path, members=[0])[0])
    result = evaluate.evaluate([member], episodes=2, seed=5, max_steps=7)
    keys = np.asarray(jax.random.key_data(evaluate.reset_keys(5, 2)))
    by_hand = _returns_by_hand(jax.jit(member.act), "cartpole", keys, max_steps=7)
    np.testing.assert_allclose(result["member_0"], by_hand)
    assert by_hand.max() <= 7


def test_evaluation_draws_fresh_env_randomness_every_step():
    # A bandit arm pays 1 with some probability, drawn anew each step: an episode's return is
    # a count of successes, not 0 or 100 (which one key reused for every step would give).
    pytest.importorskip("gymnax")
    policy = lambda obs: jnp.zeros(obs.shape[0], jnp.int32)  # always arm 0
    name, keys = "gymnax:BernoulliBandit-misc", evaluate.reset_keys(3, 8)
    returns = evaluate.episode_returns(policy, name, keys)
    assert len(set(returns.tolist()) - {0.0, 100.0}) >= 4, returns
    # The same as stepping the bare env by hand with key fold_in(reset key, t) at step t.
    env = envs.make(name, auto_reset=False)
    for key, want in zip(keys, returns):
        state, _ = env.reset(key)
        total, t, done = 0.0, 0, False
        while not done:
            t += 1
            state, _, reward, term, trunc, _ = env.step(
                state, jnp.int32(0), jax.random.fold_in(key, t)
            )
            total, done = total + float(reward), bool(term | trunc)
        assert total == want


def test_ensemble_of_continuous_members_is_the_mean_action(pendulum, tmp_path):
    learner, state = pendulum
    members = [export.read_member(p) for p in export.export_members(learner, state, tmp_path)]
    obs = _observations(learner)
    want = np.clip(np.mean([np.asarray(m.head(obs)) for m in members], axis=0), -2.0, 2.0)
    np.testing.assert_allclose(evaluate.ensemble_act(members)(obs), want, rtol=1e-5, atol=1e-6)


def _run_evaluate(*args, timeout=240):
    env = clean_env()
    cmd = [sys.executable, "-m", "rollout.ppo.evaluate", *map(str, args)]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(300)
def test_evaluate_cli_prints_a_row_per_member_and_the_ensemble(cartpole, tmp_path):
    learner, state = cartpole
    export.export_members(learner, state, tmp_path, members=[0, 3])
    video = tmp_path / "episode.gif"
    proc = _run_evaluate(tmp_path, "--episodes", "2", "--seed", "1", "--video", video)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # A video, or one line saying why not (gymnasium's renderer needs pygame): with the
    # [video] extra (the test extra has it) always a video.
    notes = [line for line in proc.stderr.splitlines() if line.startswith("video")]
    assert len(notes) == 1, proc.stderr
    if not all(importlib.util.find_spec(m) for m in ("pygame", "imageio")):
        assert notes[0].startswith("video skipped: ") and not video.exists()
    else:
        assert notes[0].startswith(f"video: {video} (") and video.stat().st_size > 0
    lines = proc.stdout.strip().splitlines()
    row = re.compile(r"^(member_\d+|ensemble) +2 +(-?\d+\.\d\d) \+- (\d+\.\d\d)$")
    assert lines[0].split() == ["policy", "episodes", "return", "mean", "+-", "std"]
    names = [row.match(line).group(1) for line in lines[1:]]
    assert names == ["member_0", "member_3", "ensemble"]
    # CartPole returns per episode lie in [1, 500].
    for line in lines[1:]:
        assert 1.0 <= float(row.match(line).group(2)) <= 500.0


@pytest.mark.timeout(120)
def test_evaluate_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    cases = [
        [str(tmp_path / "missing")],
        [str(tmp_path)],  # exists, holds no member
        [str(tmp_path), "--episodes", "0"],
        [str(tmp_path), "--max-steps", "0"],
        [str(tmp_path), "--seed", str(2**32)],  # jax.random.key would wrap it onto seed 0
        [str(tmp_path), "--seed", "-1"],
        [str(tmp_path), "--video", str(tmp_path / "no_dir" / "run.gif")],
        [str(tmp_path), "--video", str(tmp_path)],
    ]
    (tmp_path / "member_0").mkdir()
    (tmp_path / "member_0" / "member.json").write_text("{not json")
    cases.append([str(tmp_path / "member_0")])
    for argv in cases:
        assert evaluate.main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), (argv, err)


@pytest.mark.timeout(120)
def test_episodes_beyond_memory_are_one_line_before_any_allocation(cartpole, tmp_path, capsys):
    """Pure-JAX envs run all episodes at once: --episodes 200000000 of CartPole was a
    RESOURCE_EXHAUSTED traceback after trying to allocate 107 GB (exit 1)."""
    learner, state = cartpole
    export.export_members(learner, state, tmp_path, members=[0, 1])
    assert evaluate.main([str(tmp_path), "--episodes", "200000000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert re.match(r"error: 200,000,000 episodes of cartpole run at once and need about "
                    r"[\d,.]+ GB, more than the [\d,.]+ GB of this host's free memory; evaluate "
                    r"fewer episodes \(about [\d,]+ fit\)", err[0]), err  # fmt: skip
    fit = int(re.search(r"about ([\d,]+) fit", err[0]).group(1).replace(",", ""))
    # The episodes' keys are arguments of the program, not part of the members: counted as
    # such, 10x the episodes gave 5x fewer "fit", and at 1e10 blamed the members.
    assert evaluate.main([str(tmp_path), "--episodes", "2000000000"]) == 2
    again = re.search(r"about ([\d,]+) fit", capsys.readouterr().err)
    # (the host's free memory moves between the two calls: 1.8% on a busy machine)
    assert again and abs(int(again.group(1).replace(",", "")) - fit) < fit / 10, (again, fit)
    assert evaluate.main([str(tmp_path), "--episodes", str(min(fit // 4, 64))]) == 0


@pytest.mark.timeout(120)
def test_members_that_fit_are_evaluated_and_the_margin_is_only_on_the_episodes(
    cartpole, tmp_path, capsys, monkeypatch
):
    """The margin for XLA's low figure of the episodes' scan was taken on the members' arrays
    too: 5 members of 12,000-unit layers (1.7 GB) were refused even 1 episode, with "evaluate
    fewer episodes (about 1 fit)", although they ran in 6.6 GB."""
    import rollout._devices as devices
    from ensemble import compiled_memory

    learner, state = cartpole
    export.export_members(learner, state, tmp_path, members=[0, 1])
    members = evaluate._load(str(tmp_path))
    run, arrays = evaluate._runner(members, True, "cartpole", {}, None)
    memory = compiled_memory(run.lower(arrays, evaluate.reset_keys(0, 1)).compile())
    grows = evaluate._ANALYSIS_MARGIN * (memory.peak - memory.argument) + 8
    assert evaluate._ANALYSIS_MARGIN * memory.peak > memory.argument + grows  # (the old need)
    monkeypatch.setattr(devices, "available_memory", lambda: memory.argument + grows)
    assert evaluate.main([str(tmp_path), "--episodes", "1"]) == 0
    capsys.readouterr()
    monkeypatch.setattr(devices, "available_memory", lambda: memory.argument + grows - 9)
    assert evaluate.main([str(tmp_path), "--episodes", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "GB of them the members)" in err[0], err
    assert "evaluate one member at a time (give its member_<i> directory)" in err[0], err


def test_envpool_evaluation_seeds_past_int32_are_refused_not_wrapped():
    with pytest.raises(ValueError, match=r"seeds 2147483646\.\.2147483648 do not fit; use a "
                       r"--seed below 2147483645"):  # fmt: skip
        evaluate.envpool_returns(None, "envpool:CartPole-v1", 3, 2**31 - 2)


def _refused_exports(a_file: Path) -> list[tuple[list[str], str]]:
    """Export flags refused next to a file ``a_file``, and the one line each is refused with."""
    return [
        (
            ["--to", str(a_file)],
            f"error: {a_file} is a file; export to a directory (another --to).",
        ),
        (
            ["--members", "1,1"],
            "error: members [1] are given more than once; list each member once.",
        ),
        (
            ["--to", str(a_file / "sub")],
            f"error: cannot write the export to {a_file / 'sub'}: Not a directory",
        ),
    ]


@pytest.mark.timeout(300)
def test_export_cli_writes_the_members_of_the_runs_last_checkpoint(cartpole, tmp_path, capsys):
    """Both runs train on the ``cartpole`` fixture's learner (its config, compiled once): a
    run's export does not depend on its sizes, and each train() is still a run of its own."""
    from rollout.ppo import train

    learner, _ = cartpole
    cfg = learner.config
    run = tmp_path / "run"
    state, _ = train(cfg, run, progress=False, learner=learner)
    before = sorted(p.name for p in run.iterdir())
    # Evaluating the run itself, not an export, says the command that exports it.
    assert evaluate.main([str(run)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {run} is a training run, not an export: export it "
        f"(python -m rollout.ppo.export {run}), then evaluate {run / 'export'}."
    )
    a_file = tmp_path / "a_file"
    a_file.write_text("keep")
    for argv, message in _refused_exports(a_file):
        assert export.main([str(run), *argv]) == 2
        assert capsys.readouterr().err.strip() == message
    assert a_file.read_text() == "keep"
    assert export.main([str(run), "--to", str(tmp_path / "cli"), "--members", "1,3"]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(tmp_path / "cli" / f"member_{i}") for i in (1, 3)]
    assert sorted(p.name for p in run.iterdir()) == before  # the run is only read
    export.export_from_state(cfg, state, tmp_path / "ref", members=[1, 3])
    for i in (1, 3):
        for name in ("params.npz", "obs_norm.npz"):
            got, ref = (np.load(tmp_path / d / f"member_{i}" / name) for d in ("cli", "ref"))
            assert sorted(got) == sorted(ref)
            for key in ref:
                np.testing.assert_array_equal(got[key], ref[key])
        meta = json.loads((tmp_path / "cli" / f"member_{i}" / "member.json").read_text())
        assert meta["member"] == i and meta["env_steps"] == 4 * 256
        assert meta["run_id"] == json.loads((run / "run.json").read_text())["run_id"]
    # Another run of the same config and seed (the same learner: the same numbers) is still
    # another run: its members join neither this export nor an evaluation of it.
    import shutil

    twin = tmp_path / "twin"
    train(cfg, twin, progress=False, learner=learner)
    assert export.main([str(twin), "--to", str(tmp_path / "cli"), "--members", "0"]) == 2
    assert "holds members of another run (member_1)" in capsys.readouterr().err
    assert export.main([str(twin), "--to", str(tmp_path / "twin_export"), "--members", "0"]) == 0
    shutil.copytree(tmp_path / "twin_export" / "member_0", tmp_path / "cli" / "member_0")
    assert evaluate.main([str(tmp_path / "cli"), "--episodes", "1"]) == 2
    assert "differ in 'run_id'" in capsys.readouterr().err
    shutil.rmtree(tmp_path / "cli" / "member_0")
    assert export.main([str(run)]) == 0  # the default place, which the error then names
    capsys.readouterr()
    assert evaluate.main([str(run)]) == 2
    assert capsys.readouterr().err.strip().endswith(f"not an export: evaluate {run / 'export'}.")


def test_exporting_a_run_that_is_still_writing_checkpoints_reads_again(tmp_path, monkeypatch):
    """A training run prunes old checkpoints while an export reads them: the export lists
    them again, and never advises --overwrite on a healthy run."""
    from rollout.ppo import _checkpoint as ckpt

    calls = []

    def restore_latest(out, record, like, warn, set_aside, keys_as_saved):
        calls.append(out)
        if len(calls) == 1:  # the run writes a newer checkpoint while this one is read
            (out / "ckpt_00000009").mkdir()
            warn(f"warning: checkpoint {out / 'ckpt_00000008'} cannot be restored (gone)")
            raise ckpt.NoRestorableCheckpoint(out, ["ckpt_00000008"])
        return "state", {}

    monkeypatch.setattr(ckpt, "restore_latest", restore_latest)
    (tmp_path / "ckpt_00000008").mkdir()
    assert export._restore_newest(tmp_path, {"run_id": "id"}, None) == "state" and len(calls) == 2

    def never(out, record, like, warn, set_aside, keys_as_saved):
        raise ckpt.NoRestorableCheckpoint(out, ["ckpt_00000009", "ckpt_00000008"])

    monkeypatch.setattr(ckpt, "restore_latest", never)
    with pytest.raises(export.NotAnExport) as e:
        export._restore_newest(tmp_path, {"run_id": "id"}, None)
    assert str(e.value) == (
        f"no checkpoint in {tmp_path} can be restored (tried ckpt_00000009, ckpt_00000008; "
        "reasons above)."
    )


def test_a_run_extended_by_resume_exports_into_its_own_export_again(cartpole, tmp_path):
    """--resume --total-steps (the one change a resume allows) made the run's own earlier
    export 'members of another run': export refused, and evaluate's advice looped."""
    learner, state = cartpole
    cfg = learner.config
    export.export_from_state(cfg, state, tmp_path / "run" / "export", members=[0, 1])
    longer = dataclasses.replace(cfg, total_steps=2 * cfg.total_steps)
    (tmp_path / "run" / "run.json").write_text(json.dumps({"config": longer.to_dict()}))
    assert export._export_of(tmp_path / "run" / "export", tmp_path / "run")
    export.export_from_state(longer, state, tmp_path / "run" / "export", members=[0, 1])
    meta = json.loads((tmp_path / "run" / "export" / "member_1" / "member.json").read_text())
    assert meta["config"]["total_steps"] == longer.total_steps
    other = dataclasses.replace(longer, gamma=0.9)  # another run still is one
    with pytest.raises(ValueError, match=r"holds members of another run \(member_0\)"):
        export.export_from_state(other, state, tmp_path / "run" / "export", members=[0])


def test_exporting_some_members_beside_another_checkpoints_is_refused(cartpole, tmp_path):
    """Members of two checkpoints of one run in one export: evaluate refuses the mix, so the
    export that would make it refuses first."""
    learner, state = cartpole
    export.export_members(learner, state, tmp_path, members=[0])
    meta_file = tmp_path / "member_0" / "member.json"
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({**meta, "env_steps": meta["env_steps"] - 64}))  # older
    with pytest.raises(ValueError, match=r"holds member_0 of another checkpoint of this run"):
        export.export_members(learner, state, tmp_path, members=[1])
    assert not (tmp_path / "member_1").exists()
    export.export_members(learner, state, tmp_path, members=[0, 1])  # replacing it: fine
    assert json.loads(meta_file.read_text())["env_steps"] == meta["env_steps"]


def test_members_of_different_runs_in_one_directory_are_not_evaluated_as_one(
    cartpole, tmp_path, capsys
):
    import shutil

    learner, state = cartpole
    export.export_members(learner, state, tmp_path / "mixed", members=[0])
    other = dataclasses.replace(learner.config, seed=learner.config.seed + 1)
    with pytest.raises(ValueError, match=r"holds members of another run \(member_0\)"):
        export.export_from_state(other, state, tmp_path / "mixed", members=[1])
    assert (tmp_path / "mixed" / "member_0").is_dir() and not (
        tmp_path / "mixed" / "member_1"
    ).exists()
    export.export_from_state(other, state, tmp_path / "other", members=[1])
    shutil.copytree(tmp_path / "other" / "member_1", tmp_path / "mixed" / "member_1")  # by hand
    assert evaluate.main([str(tmp_path / "mixed"), "--episodes", "1"]) == 2
    err = capsys.readouterr().err
    assert "differ in 'config'" in err and "different runs or checkpoints" in err
    # A run dir whose export/ is an older run's (left by --overwrite) says so.
    run = tmp_path / "run"
    export.export_from_state(other, state, run / "export", members=[0])
    (run / "run.json").write_text(json.dumps({"config": learner.config.to_dict()}))
    assert evaluate.main([str(run)]) == 2
    assert "its export holds another run's members: export again" in capsys.readouterr().err


def test_a_copied_member_or_damaged_arrays_are_refused_not_averaged(cartpole, tmp_path, capsys):
    """A member copied in by hand would count twice in the ensemble's mean action; a truncated
    or empty params.npz is one line, not NumPy's zipfile traceback."""
    import shutil

    learner, state = cartpole
    out = tmp_path / "export"
    export.export_members(learner, state, out, members=[0, 1])
    shutil.copytree(out / "member_1", out / "member_7")
    assert evaluate.main([str(out), "--episodes", "1"]) == 2
    assert "are both member 1 of the run: a copy would count twice" in capsys.readouterr().err
    shutil.rmtree(out / "member_7")
    # Renamed as a member the run does not have: member 1 would count twice.
    shutil.copytree(out / "member_1", out / f"member_{MEMBERS}")
    meta_path = out / f"member_{MEMBERS}" / "member.json"
    meta_path.write_text(json.dumps({**json.loads(meta_path.read_text()), "member": MEMBERS}))
    assert evaluate.main([str(out), "--episodes", "1"]) == 2
    assert f"field 'member' is {MEMBERS}, but 'config.members' is" in capsys.readouterr().err
    shutil.rmtree(out / f"member_{MEMBERS}")
    params = out / "member_1" / "params.npz"
    with np.load(params) as f:
        arrays = dict(f)
    arrays["actor_out/bias"][0] = np.nan  # a NaN logit: argmax plays action 0, a real score
    np.savez(params, **arrays)
    assert evaluate.main([str(out), "--episodes", "1"]) == 2
    assert "hold NaN or infinite values" in capsys.readouterr().err
    for damaged in (params.read_bytes()[:300], b""):
        params.write_bytes(damaged)
        assert evaluate.main([str(out), "--episodes", "1"]) == 2
        assert "cannot read the member's arrays" in capsys.readouterr().err


def test_an_action_box_unlike_the_envs_is_refused(pendulum, tmp_path, capsys):
    """The ensemble clips its mean action into member 0's box: an edited one scored another
    policy without a word."""
    learner, state = pendulum
    out = tmp_path / "export"
    export.export_members(learner, state, out, members=[0, 1])
    meta_path = out / "member_0" / "member.json"
    meta = json.loads(meta_path.read_text())
    assert meta["action"] == {"low": [-2.0], "high": [2.0], "start": None}
    meta_path.write_text(json.dumps({**meta, "action": {**meta["action"], "low": [-0.01],
                                                         "high": [0.01]}}))  # fmt: skip
    assert evaluate.main([str(out), "--episodes", "1"]) == 2
    assert "field 'action' is {'low': [-0.01]" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_export_cli_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "no_ckpt").mkdir()
    (tmp_path / "no_ckpt" / "run.json").write_text(json.dumps({"run_id": "x", "config": {}}))
    (tmp_path / "bad_config").mkdir()
    (tmp_path / "bad_config" / "run.json").write_text(
        json.dumps({"run_id": "x", "config": {"members": "two"}})
    )
    (tmp_path / "bad_config" / "ckpt_00000001").mkdir()
    cases = [
        [str(tmp_path / "missing")],
        [str(tmp_path / "empty")],
        [str(tmp_path / "no_ckpt")],
        [str(tmp_path / "bad_config")],
        [str(tmp_path / "empty"), "--members", "a,b"],
    ]
    errors = []
    for argv in cases:
        assert export.main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), (argv, err)
        errors.append(err[0])
    assert errors[0].endswith("missing does not exist: give the --out directory of a training run.")
    assert errors[1].endswith("empty has no run.json: give the --out directory of a training run.")
    # Argument mistakes too (argparse's own usage + error would be two lines).
    for main, argv in [(export.main, ["--bogus"]), (evaluate.main, ["x", "--episodes", "y"])]:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err


@pytest.mark.parametrize("module", ["imageio", "pygame"])
def test_video_without_its_packages_names_the_extra(module, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    monkeypatch.delitem(sys.modules, "imageio.v2", raising=False)
    meta = {"env": "cartpole", "gymnasium_id": None}
    note = evaluate.record_video(None, meta, str(tmp_path / "run.gif"), seed=0)
    assert note.startswith("video skipped: cannot render CartPole-v1 (")
    assert note.endswith("; pip install 'sharded-ensembles[video]'"), note
    assert not (tmp_path / "run.gif").exists()


@pytest.mark.parametrize("env", ["gymnax:Catch-bsuite", "envpool:HalfCheetah-v5", "audio"])
def test_video_of_an_env_gymnasium_cannot_make_is_skipped_with_the_reason(env, tmp_path):
    # Not gymnasium.make's NameNotFound for an id it never had (nor another library's env
    # rendered under the same name): one line naming the env and what videos cover.
    meta = {"env": env, "gymnasium_id": None}
    note = evaluate.record_video(None, meta, str(tmp_path / "run.gif"), seed=0)
    assert note == (
        f"video skipped: {env} has no gymnasium renderer (videos cover gymnasium:<id> envs and "
        "the CartPole / Pendulum ports)"
    )
    assert not (tmp_path / "run.gif").exists()


_DROP = object()


def _with(field, value):
    """A member.json edit: the dotted ``field`` set to ``value`` (``_DROP``: removed)."""

    def edit(meta):
        *parents, key = field.split(".")
        for name in parents:
            meta = meta[name]
        if value is _DROP:
            del meta[key]
        else:
            meta[key] = value

    return edit


#: Hand edits of member 0's member.json, and what the refusal says after the file's name.
_EDITS = [
    ("{not json", "not valid JSON (Expecting property name"),
    ("[1, 2]", "not a rollout.ppo.member file (field 'format' is not an object)"),
    (_with("format", "other"), """not a rollout.ppo.member file (field 'format' is "other")"""),
    (_with("version", _DROP), "field 'version' is missing, not a format version number"),
    (_with("version", "2"), """field 'version' is "2", not a format version number"""),
    (_with("member", "0"), """field 'member' is "0", not a member index (an integer >= 0)"""),
    (_with("env", "pendulum"), "field 'env' is \"pendulum\" but field 'config.env' is \"cartp"),
    (
        _with("gymnasium_id", "Pendulum-v1"),
        'field \'gymnasium_id\' is "Pendulum-v1" but env "cartpole" is gymnasium\'s "CartPole-v1"',
    ),
    (
        _with("network.obs_shape", [5]),
        "field 'network.obs_shape' ([5]) does not match "
        "params.npz: its actor_0/kernel has shape (4, 64), the field makes it (5, 64)",
    ),
    (_with("network.obs_shape", 4), "field 'network.obs_shape' is 4, not [D] (vector obs"),
    (
        _with("network.action_dim", 3),
        "field 'network.action_dim' (3) does not match params.npz: "
        "its actor_out/kernel has shape (64, 2), the field makes it (64, 3)",
    ),
    (
        _with("network.hidden", [64]),
        "field 'network.hidden' does not match params.npz (not in "
        "the network: actor_1/bias, actor_1/kernel, critic_1/bias, critic_1/kernel)",
    ),
    (
        _with("network.discrete", False),
        "field 'network.discrete' does not match params.npz (missing from it: log_std)",
    ),
    (_with("network.activation", "relu"), 'field \'network.activation\' is "relu", not "tanh"'),
    (_with("network", _DROP), "field 'network' is missing"),
    (
        _with("obs_norm.enabled", True),
        "field 'obs_norm.enabled' is true but training did not normalise observations",
    ),
    (_with("obs_norm.clip", "10"), """field 'obs_norm.clip' is "10", not 10 (training's clip)"""),
    # Numbers the policy runs with, but training never did: no longer the trained policy.
    (_with("obs_norm.clip", 0.5), "field 'obs_norm.clip' is 0.5, not 10 (training's clip)"),
    (_with("obs_norm.epsilon", 0.1), "field 'obs_norm.epsilon' is 0.1, not 1e-08 (training's"),
    (_with("action.low", [-1.0]), "field 'action.low' is a box, but 'network.discrete' is true"),
    (_with("action.start", [0.5]), "field 'action.start' is [0.5], not null or a list of integ"),
    (_with("action.start", [0, 1]), "field 'action.start' is 2 integers, but the discrete act"),
    (_with("action.start", None), "field 'action.start' is null, but the discrete action has 1"),
    (_with("hparams", [0.1]), "field 'hparams' is [0.1], not an object of numbers"),
    (_with("network.kind", ["x"]), "field 'network.kind' is [\"x\"], not 'ActorCritic' or"),
    (
        _with("config.env_kwargs", "{bad"),
        "field 'config' is not a training config (env_kwargs is not valid JSON",
    ),
]


@pytest.mark.timeout(120)
def test_a_hand_edited_member_json_is_one_line_naming_the_file_and_the_field(
    cartpole, tmp_path, capsys
):
    """Fields that disagree with the format, each other or the arrays: not a traceback from
    inside the policy, nor another env's episodes; the same line from Python and the CLI."""
    learner, state = cartpole
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text("{}")  # a run's default export: the fix is one command
    out = run / "export"
    export.export_members(learner, state, out, members=[0, 1])
    meta_path = out / "member_0" / "member.json"
    original = meta_path.read_text()
    again = f"; export the member again (python -m rollout.ppo.export {run})."
    for edit, said in _EDITS:
        if callable(edit):
            meta = json.loads(original)
            edit(meta)
            edit = json.dumps(meta)
        meta_path.write_text(edit)
        with pytest.raises(export.NotAnExport) as e:
            export.read_member(out / "member_0")
        assert str(e.value).startswith(f"{meta_path}: {said}") and str(e.value).endswith(again)
        assert evaluate.main([str(out), "--episodes", "1"]) == 2
        assert capsys.readouterr().err.splitlines() == [f"error: {e.value}"], said
    meta_path.write_text(original)
    assert evaluate.main([str(out), "--episodes", "1"]) == 0  # the run's own file reads again
    capsys.readouterr()


@pytest.mark.timeout(180)
def test_a_member_json_edited_to_another_env_is_refused_before_any_episode(cartpole, tmp_path):
    """Every field of the env edited alike still disagrees with the network (and the env
    itself): one line and exit 2 from the CLI, the same error from evaluate()."""
    learner, state = cartpole
    paths = export.export_members(learner, state, tmp_path, members=[0, 1])
    for path in paths:
        meta = json.loads((path / "member.json").read_text())
        meta.update(env="pendulum", gymnasium_id="Pendulum-v1")
        meta["config"]["env"] = "pendulum"
        (path / "member.json").write_text(json.dumps(meta))
    said = (
        f"{paths[0] / 'member.json'}: its network takes observations (4,) and 2 discrete "
        "actions, but pendulum has observations (3,) and 1-dim continuous actions: fields 'env' "
        "and 'network' disagree (edited, or the env changed since training); export the member "
        f"again (python -m rollout.ppo.export RUN_DIR --to {tmp_path})."
    )
    members = [export.read_member(p) for p in paths]  # each file agrees with itself
    with pytest.raises(export.NotAnExport) as e:
        evaluate.evaluate(members, episodes=1, seed=0)
    assert str(e.value) == said
    proc = _run_evaluate(tmp_path, "--episodes", "1", timeout=150)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [f"error: {said}"]
    assert proc.stdout == ""


@pytest.mark.timeout(120)
def test_a_member_directory_without_member_json_is_refused_not_left_out(
    cartpole, tmp_path, capsys, monkeypatch
):
    """An interrupted export leaves member_<i> without member.json: evaluating the rest would
    quietly report a smaller ensemble. Exporting again repairs it."""
    import shutil

    learner, state = cartpole
    out = tmp_path / "export"
    export.export_members(learner, state, out, members=[0, 1])
    (out / "member_2").mkdir()  # made, nothing written yet
    again = f"export again (python -m rollout.ppo.export RUN_DIR --to {out}) or remove it."
    said = f"{out / 'member_2'} has no member.json: an interrupted or partial export? {again}"
    with pytest.raises(export.NotAnExport) as e:
        export.member_dirs(out)
    assert str(e.value) == said
    assert evaluate.main([str(out), "--episodes", "1"]) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {said}"]

    # Cut short while writing over member 1: its old member.json is gone first, never left
    # beside new arrays; the directory itself is refused the same way.
    save = np.savez

    def disk_full(file, **arrays):
        if Path(file).name == "obs_norm.npz":
            raise OSError(28, "No space left on device")
        save(file, **arrays)

    monkeypatch.setattr(export.np, "savez", disk_full)
    with pytest.raises(OSError):
        export.export_members(learner, state, out, members=[1])
    monkeypatch.undo()
    with pytest.raises(export.NotAnExport, match=r"member_1 \(and 1 more member_<i> directory\) "
                       r"has no member.json: an interrupted or partial export\?"):  # fmt: skip
        export.member_dirs(out)
    assert evaluate.main([str(out / "member_1"), "--episodes", "1"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: {out / 'member_1'} has no member.json: an interrupted or partial export? {again}"
    ]

    export.export_members(learner, state, out)  # exporting again repairs both
    assert [p.name for p in export.member_dirs(out)] == [f"member_{i}" for i in range(MEMBERS)]
    assert not list(out.glob("*/*.tmp"))
    # A member under another member's name (renamed or copied by hand) is refused too.
    shutil.rmtree(out / "member_3")
    (out / "member_2").rename(out / "member_3")
    assert evaluate.main([str(out), "--episodes", "1"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: {out / 'member_3' / 'member.json'}: field 'member' is 2 but its directory is "
        "member_3: a member renamed or copied by hand? export the member again (python -m "
        f"rollout.ppo.export RUN_DIR --to {out})."
    ]


def test_the_note_on_cut_gymnasium_episodes_names_the_policy(capsys):
    # One per policy (each member and the ensemble): three identical lines, before, could not
    # be told apart.
    import jax.numpy as jnp

    push_left = lambda obs: jnp.zeros(obs.shape[:1], jnp.int32)  # a batch of one
    returns = evaluate.gymnasium_returns(push_left, "CartPole-v1", 2, 0, max_steps=3, name="m1")
    assert list(returns) == [3.0, 3.0]
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "note: m1: 2 of 2 episodes of CartPole-v1 had not ended after 3 steps; their return "
        "counts those steps (--max-steps sets the cap)"
    ]


def test_a_run_on_an_env_object_its_config_cannot_make_is_not_resumed_or_evaluated_on_another(
    tmp_path, capsys
):
    """An env given to Learner(config, env=...) that the config's env and kwargs do not make
    (CartPole with a 50-step limit under a config that names plain CartPole): the run records
    it, so the CLI's --resume, export_run and evaluate refuse instead of silently making the
    config's env; one the config makes alike counts as the config's."""
    from rollout.ppo import _env as envlib
    from rollout.ppo import main, train

    cfg = PPOConfig.for_env("cartpole", members=2, total_steps=256, num_envs=2, num_steps=64)
    assert envlib.made_by_config(cfg, envs.make("cartpole"))
    assert not envlib.made_by_config(cfg, envs.make("cartpole", max_episode_steps=50))
    gym = "gymnasium:CartPole-v1"  # make kwargs in the config: the same env
    made = envs.make(gym, sutton_barto_reward=True)
    with_kwargs = PPOConfig.for_env(gym, members=2, env_kwargs='{"sutton_barto_reward": true}')
    assert envlib.made_by_config(with_kwargs, made)
    assert not envlib.made_by_config(PPOConfig.for_env(gym, members=2), made)
    learner = Learner(
        cfg, env=envs.make("cartpole", max_episode_steps=50), devices=jax.devices()[:2]
    )
    state, _ = train(cfg, tmp_path / "run", learner=learner, progress=False)
    assert json.loads((tmp_path / "run" / "run.json").read_text())["env_from_config"] is False
    assert main(["--resume", "--out", str(tmp_path / "run"), "--no-progress"]) == 2
    assert "resume it in Python with that env" in capsys.readouterr().err
    with pytest.raises(export.NotAnExport, match="export it in Python with that env"):
        export.export_run(tmp_path / "run")
    paths = export.export_members(learner, state, tmp_path / "members")
    with pytest.raises(ValueError, match="step your env with the member's act"):
        evaluate.evaluate([export.read_member(p) for p in paths], 1, 0)
    learner.close()


def test_only_unawaited_orbax_failures_leave_asyncios_log():
    """The CLIs drop asyncio's "Task exception was never retrieved" for a failed read that
    orbax left unawaited (a damaged checkpoint: one printed before the warning line, in CI),
    and keep every other record."""
    import logging

    from rollout.ppo._checkpoint import _unawaited_orbax_failures

    def record(msg: str, where: str) -> logging.LogRecord:
        try:
            exec(compile("raise ValueError('OUT_OF_RANGE')", where, "exec"))
        except ValueError:
            info = sys.exc_info()
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, msg, None, info)

    unawaited = "Task exception was never retrieved\nfuture: <Task finished>"
    assert not _unawaited_orbax_failures(record(unawaited, "/site/orbax/checkpoint/io.py"))
    assert _unawaited_orbax_failures(record(unawaited, "/home/me/my_code.py"))
    assert _unawaited_orbax_failures(record("Exception in callback", "/site/orbax/io.py"))
    # A TensorStore future's error has asyncio's frames alone, and names its spec.
    future = "Future exception was never retrieved\nfuture: <Future finished>"
    failed = record(future, "/lib/asyncio/tasks.py")
    assert _unawaited_orbax_failures(failed)
    failed.exc_info[1].args = ("OUT_OF_RANGE: Error reading [tensorstore_spec='{}']",)
    assert not _unawaited_orbax_failures(failed)


def test_only_work_that_outlived_its_loop_or_the_interpreter_is_kept_from_the_hooks():
    """A failed checkpoint write's last stderr line was once orbax's thread scheduling work at
    exit ("cannot schedule new futures after interpreter shutdown"), not the CLI's error."""
    from types import SimpleNamespace

    from rollout.ppo._checkpoint import without_closed_loop_noise

    seen = []
    hook = without_closed_loop_noise(seen.append)
    for text in ("Event loop is closed", "cannot schedule new futures after interpreter shutdown"):
        hook(SimpleNamespace(exc_value=RuntimeError(text)))
    assert seen == []
    for exc in (RuntimeError("my own error"), ValueError("Event loop is closed")):
        hook(SimpleNamespace(exc_value=exc))
    assert len(seen) == 2


@pytest.mark.timeout(300)
def test_export_cli_falls_back_past_a_damaged_checkpoint_in_one_warning_line(cartpole, tmp_path):
    """Orbax's reads still in flight when the damaged checkpoint's restore failed complete into
    its closed event loop: each printed a traceback (hundreds) around the one warning. The run
    trains on the ``cartpole`` fixture's learner (compiled once): checkpoints after 2 and 4
    updates."""
    from rollout.ppo import _checkpoint as ckpt
    from rollout.ppo import train

    learner, _ = cartpole
    run = tmp_path / "run"
    train(learner.config, run, progress=False, checkpoint_every=1, learner=learner)
    older, newest = ckpt.checkpoints(run)[-2:]
    for path in newest.rglob("*"):
        if path.is_file() and path.parent.name == "d":  # the array data
            path.write_bytes(b"")
    cmd = [sys.executable, "-m", "rollout.ppo.export", str(run)]
    proc = subprocess.run(cmd, env=clean_env(), cwd=ROOT, capture_output=True, text=True,
                          timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"warning: checkpoint {newest} cannot be"), (
        proc.stderr[-3000:]
    )
    meta = json.loads((run / "export" / "member_0" / "member.json").read_text())
    assert meta["env_steps"] == int(older.name.split("_")[1]) * 256  # 4 envs x 64 steps


def test_a_run_without_checkpoints_says_when_training_writes_them(tmp_path):
    """'train longer' was the only advice, also for a run that diverged before its first
    checkpoint (training longer would diverge again)."""
    (tmp_path / "run.json").write_text(json.dumps({"run_id": "id", "config": {}}))
    with pytest.raises(export.NotAnExport, match=r"has no checkpoint yet: training writes one "
                       r"every --checkpoint-every calls and when it ends, but not at an error "
                       r"\(a divergence included\)"):  # fmt: skip
        export.export_run(tmp_path)
