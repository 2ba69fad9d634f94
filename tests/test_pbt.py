"""Population-based training: the exploit/explore step against a numpy reference on the
member-major state, placement and donation, determinism, lineage in the CLI's rows, bad flags."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from subprocess_env import clean_env

import ensemble
from rollout.ppo import Learner, PPOConfig, train
from rollout.ppo import _pbt as pbt

ROOT = Path(__file__).resolve().parents[1]
FACTORS = (0.8, 1.2)
F32 = {float(np.float32(f)) for f in FACTORS}  # the factors as float32 holds them
# Jitted as the learner runs it (inside its PBT program); eager, every op would compile apart.
plan = jax.jit(pbt.plan, static_argnums=(2, 3))


def _scored_at(rows: list[dict], j: int) -> list[dict]:
    """The rows a PBT step at row ``j`` ranked: its own row before the step wrote its lineage."""
    return [*rows[:j], {k: v for k, v in rows[j].items() if k != "pbt_parent"}]


def _tiny(env: str, members: int, **kw) -> PPOConfig:
    base = dict(
        members=members,
        num_envs=2,
        num_steps=16,
        update_epochs=1,
        num_minibatches=2,
        total_steps=8 * 32,
        updates_per_call=2,
        pbt=True,
        pbt_interval=2,
        pbt_fraction=0.25,
    )
    base.update(kw)
    return PPOConfig.for_env(env, **base)


def _reference_plan(returns: np.ndarray, fraction: float) -> tuple[set[int], set[int]]:
    """numpy: (top, bottom) member sets among the members with a finite return."""
    valid = [i for i in range(len(returns)) if np.isfinite(returns[i])]
    ranked = sorted(valid, key=lambda i: (-returns[i], i))  # best first, ties by member index
    c = int(np.floor(fraction * len(valid)))
    return set(ranked[:c]), set(ranked[len(ranked) - c :]) if c else set()


@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_plan_replaces_the_bottom_with_top_members(fraction):
    rng = np.random.default_rng(0)
    for trial in range(20):
        n = (3, 8, 11)[trial % 3]  # few shapes: few compiles
        returns = rng.normal(size=n).astype(np.float32)
        returns[rng.random(n) < 0.2] = np.nan  # no finished episode yet: not ranked
        if trial % 5 == 0:
            returns[: n // 2] = 1.0  # ties
        parent, factor = plan(returns, jax.random.key(trial), fraction, FACTORS)
        parent, factor = np.asarray(parent), np.asarray(factor)
        top, bottom = _reference_plan(returns, fraction)
        for i in range(n):
            if i in bottom:
                assert parent[i] in top, (trial, i)
                assert set(factor[i].tolist()) <= F32
            else:
                assert parent[i] == i and np.all(factor[i] == 1.0), (trial, i)
    # Both factors and several parents occur (the choice is random, not fixed).
    returns = np.arange(8, dtype=np.float32)
    parents, factors = set(), set()
    for s in range(10):
        p, f = plan(returns, jax.random.key(s), 0.5, FACTORS)
        parents |= {int(v) for v in np.asarray(p)[:4]}
        factors |= set(np.asarray(f)[:4].ravel().tolist())
    assert parents == {4, 5, 6, 7} and factors == F32


def test_plan_replaces_as_many_members_as_the_config_check_counts():
    """floor(fraction * m) in float64, as PPOConfig checks it: float32 made 1/41 of 41 members
    and 7/23 of 23 replace 0 and 6."""
    for n, k in ((41, 1), (23, 7), (37, 3)):
        returns = np.arange(n, dtype=np.float32)
        parent, _ = plan(returns, jax.random.key(0), k / n, FACTORS)
        assert int((np.asarray(parent) != np.arange(n)).sum()) == k, (n, k)


def test_recent_returns_ignores_missing_episodes():
    rows = [
        {"returns": [None, 1.0, 5.0]},
        {"returns": [None, 3.0, None]},
        {"returns": [None, 5.0, 7.0]},
    ]
    got = pbt.recent_returns(rows, 2, 3)
    np.testing.assert_array_equal(np.isnan(got), [True, False, False])
    np.testing.assert_allclose(got[1:], [4.0, 7.0])
    assert np.isnan(pbt.recent_returns([], 3, 2)).all()
    # A window longer than the interval: a member that copied another is scored only on the
    # rows after the copy (before, the returns were of weights it no longer has).
    rows = [{"returns": [100.0, 60.0, 60.0, 20.0]},
            {"returns": [100.0, 60.0, 60.0, 10.0], "pbt_parent": [0, 1, 2, 0]},
            {"returns": [100.0, 60.0, 60.0, 100.0]},
            {"returns": [100.0, 60.0, 60.0, 100.0]}]  # fmt: skip
    np.testing.assert_allclose(pbt.recent_returns(rows, 4, 4), [100.0, 60.0, 60.0, 100.0])
    assert np.isnan(pbt.recent_returns(rows[:2], 4, 4)[3])  # nothing since its copy: not ranked


@pytest.mark.parametrize("n, d", [(8, 8), (4, 8), (16, 8), (6, 3), (5, 1)])
def test_gather_members_takes_the_parent_rows_on_any_layout(n, d):
    """One member per device, a member on 2 devices, 2 per device, 3 blocks, one device."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = ensemble.make_mesh(n, devices=jax.devices()[:d])
    rng = np.random.default_rng(n * 10 + d)
    host = {
        "w": rng.normal(size=(n, 3, 2)).astype(np.float32),
        "count": rng.integers(0, 9, (n,)).astype(np.int32),
    }
    gather = jax.jit(lambda x, p: pbt.gather_members(x, p, mesh))
    for parent in (rng.integers(0, n, n), np.arange(n)[::-1], np.zeros(n)):
        x = jax.device_put(host, NamedSharding(mesh, P("ensemble")))
        got = gather(x, jnp.asarray(parent, jnp.int32))
        for name, leaf in host.items():
            np.testing.assert_array_equal(np.asarray(got[name]), leaf[parent.astype(int)])
        ensemble.debug.assert_member_placement(got, mesh, n)


def test_the_pbt_step_never_holds_the_population_on_one_device():
    """jnp.take along the sharded member axis all-gathers every leaf: each device would hold
    all 8 members' parameters and Adam state for the step. The ring holds about two blocks."""
    cfg = _tiny("pendulum", 8, pbt_fraction=0.5)
    learner = Learner(cfg)
    shapes = learner.state_shapes()
    one_device = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes)) // 8
    compiled = pbt.make_step(learner).lower(shapes).compile()
    temp = ensemble.compiled_memory(compiled).temp
    assert temp <= 2.5 * one_device, (temp, one_device)
    assert "collective-permute" in ensemble.debug.collectives(compiled)  # the ring
    # The reference: the same copy written as a take, in a program of the same state.
    take = jax.jit(
        lambda ms: jax.tree.map(lambda x: jnp.take(x, jnp.arange(8)[::-1], axis=0), ms),
        in_shardings=(learner.state_shardings().members,),
        out_shardings=learner.state_shardings().members,
    )
    taken = ensemble.compiled_memory(take.lower(shapes.members).compile()).temp
    assert taken >= 6 * one_device, (taken, one_device)


# Pendulum: observation and return normalisation are on, so their statistics are copied too.
# One member per device (8 on 8); several members per device are run by the train test below.
def test_exploit_explore_copies_exactly_the_parent_rows_on_the_devices(env="pendulum", members=8):
    lrs = tuple(float(v) for v in np.geomspace(1e-4, 1e-2, members))
    cfg = _tiny(env, members, learning_rate=lrs, ent_coef=0.01, pbt_fraction=0.5)
    learner = Learner(cfg)
    state, _ = learner.update(learner.init(), 2)  # Adam moments and statistics are non-trivial
    before = jax.device_get(state)
    twin = jax.device_put(before, learner.state_shardings())
    returns = np.linspace(-100.0, 0.0, members).astype(np.float32)[::-1].copy()
    returns[1] = np.nan  # member 1 is not ranked: it must stay as it is
    key = jax.random.key(7)

    new, (parent, hparams) = learner.exploit_explore(state, returns, key)
    assert all(x.is_deleted() for x in jax.tree.leaves(state.members.params))  # donated
    ensemble.debug.assert_member_placement(new.members, learner.mesh, members)
    got_shardings = jax.tree.leaves(jax.tree.map(lambda x: x.sharding, new))
    assert got_shardings == jax.tree.leaves(learner.state_shardings())
    after, parent = jax.device_get(new), np.asarray(parent)

    top, bottom = _reference_plan(returns, 0.5)
    assert {i for i in range(members) if parent[i] != i} == bottom and set(
        parent[list(bottom)]
    ) <= top
    # Learnt state: row i is the parent's row, exactly (numpy gather on the host copy).
    # (The optimizer's injected learning rate is checked below: it follows the new hparams.)
    for field in ("params", "opt_state", "obs_stats", "ret_stats"):
        ref = jax.tree.map(lambda x: x[parent], getattr(before.members, field))
        chex.assert_trees_all_equal(_without_lr(getattr(after.members, field)), _without_lr(ref))
    # Own envs, episodes, key: untouched for every member.
    for field in (
        "env_state",
        "obs",
        "disc_return",
        "ep_return",
        "ep_length",
        "last_return",
        "rng",
    ):
        chex.assert_trees_all_equal(getattr(after.members, field), getattr(before.members, field))
    _check_perturbed_hparams(before.members.hparams, after.members.hparams, hparams, parent, bottom)
    # The optimizer's injected learning rate still equals hparams * the annealing fraction of
    # the last update (update 2 of num_updates).
    frac = 1.0 - 1.0 / cfg.num_updates
    lr_in_opt = optax.tree_utils.tree_get(after.members.opt_state, "learning_rate")
    np.testing.assert_allclose(lr_in_opt, after.members.hparams["learning_rate"] * frac, rtol=1e-6)

    # Deterministic for a key: the same input state and key give the same result.
    again, _ = learner.exploit_explore(twin, returns, key)
    chex.assert_trees_all_equal(jax.device_get(again), after)
    # And training goes on from the new state.
    cont, metrics = learner.update(new, 2)  # the compiled program
    assert np.isfinite(np.asarray(metrics["policy_loss"])).all()
    ensemble.debug.assert_member_placement(cont.members, learner.mesh, members)


def test_a_copy_is_clipped_to_the_bounds_whatever_factor_it_draws():
    """A child that drew 1.0 kept its parent's out-of-bounds values (a child that drew 0.8 or
    1.2 was clipped); a kept member keeps its own. Returns of the wrong length: one line."""
    cfg = _tiny(
        "cartpole", 2, learning_rate=0.5, clip_coef=0.9, pbt_fraction=0.5, pbt_factors=(1.0,)
    )
    learner = Learner(cfg, devices=jax.devices()[:2])
    state = learner.init()
    with pytest.raises(ValueError, match=r"one score per member, shape \(2,\); got shape \(3,\)"):
        learner.exploit_explore(state, np.zeros(3, np.float32), jax.random.key(0))
    _, (parent, hparams) = learner.exploit_explore(
        state, np.array([0.0, -1.0], np.float32), jax.random.key(0)
    )
    assert np.asarray(parent).tolist() == [0, 0]
    for name, start in (("learning_rate", 0.5), ("clip_coef", 0.9)):
        hi = pbt.BOUNDS[name][1]
        got = np.asarray(hparams[name])
        assert got[0] == np.float32(start)  # kept
        assert got[1] == np.float32(hi)  # the copy, clipped


@pytest.mark.parametrize("members", [3, 9, 12])
def test_a_too_small_pbt_fraction_is_refused_with_a_fraction_that_passes(members):
    cfg = _tiny("cartpole", members, pbt_fraction=0.05)
    with pytest.raises(ValueError, match="replaces no member; raise it to at least") as e:
        cfg.validate()
    least = float(str(e.value).rstrip(".").split()[-1])
    _tiny("cartpole", members, pbt_fraction=least).validate()


def _check_perturbed_hparams(old_h, new_h, returned, parent, bottom) -> None:
    """Hyperparameters: the parent's times 0.8 or 1.2 (clipped to the bounds); donors unchanged."""
    for name in pbt.HPARAMS:
        old, got = old_h[name], new_h[name]
        np.testing.assert_array_equal(np.asarray(returned[name]), got)
        lo, hi = pbt.BOUNDS[name]
        for i in range(len(parent)):
            if i not in bottom:
                assert got[i] == old[i]
            else:
                options = [
                    np.clip(np.float32(old[parent[i]]) * np.float32(f), lo, hi) for f in FACTORS
                ]
                assert np.any(np.isclose(got[i], options, rtol=1e-6, atol=0)), (name, i)


def _without_lr(tree):
    if optax.tree_utils.tree_get(tree, "learning_rate") is None:
        return tree
    return optax.tree_utils.tree_set(tree, learning_rate=np.zeros(()))


def test_train_with_pbt_writes_lineage_and_resumes_exactly(tmp_path):
    # CartPole: episodes finish within an update, so every member is ranked.
    cfg = _tiny("cartpole", 4, total_steps=6 * 32, learning_rate=(1e-4, 3e-4, 1e-3, 3e-3))
    learner = Learner(cfg, devices=jax.devices()[:2])
    full, rows = train(cfg, tmp_path / "full", progress=False, learner=learner)
    assert [("pbt_parent" in r) for r in rows] == [False, True, False, True, False, True]
    assert all(len(r["hparams"]["learning_rate"]) == 4 for r in rows)
    for prev, row in itertools.pairwise(rows):  # hparams change only after a PBT step
        if "pbt_parent" not in prev:
            assert row["hparams"] == prev["hparams"]
        for i, p in enumerate(prev.get("pbt_parent", [])):
            if p != i:
                ratio = row["hparams"]["learning_rate"][i] / prev["hparams"]["learning_rate"][p]
                assert min(abs(ratio - f) for f in FACTORS) < 1e-5
    # Each PBT step replaces floor(fraction * m) of the m members ranked then (those with a
    # finished episode in the window): 1 of 4 when all are ranked.
    ranked = [
        np.isfinite(pbt.recent_returns(_scored_at(rows, k), cfg.pbt_window, 4)).sum()
        for k, r in enumerate(rows)
        if "pbt_parent" in r
    ]
    want = sum(int(cfg.pbt_fraction * m) for m in ranked)
    assert want >= 1
    assert sum(p != i for r in rows for i, p in enumerate(r.get("pbt_parent", []))) == want
    assert (tmp_path / "full" / "pbt_lineage.png").stat().st_size > 0
    # A PBT row also holds the values its step set (the next row's; the last row has none
    # after it, and the final checkpoint holds them).
    for prev, row in itertools.pairwise(rows):
        if "pbt_parent" in prev:
            assert prev["pbt_hparams"] == row["hparams"]
    final = jax.device_get(full.members.hparams)
    assert rows[-1]["pbt_hparams"] == {
        k: [float(f"{v:.7g}") for v in final[k]] for k in rows[-1]["pbt_hparams"]
    }

    class Stop(Exception):
        pass

    def stop_at_5(row):
        if row["update"] == 5:
            raise Stop

    with pytest.raises(Stop):
        train(
            cfg,
            tmp_path / "cut",
            progress=False,
            checkpoint_every=1,
            learner=learner,
            on_update=stop_at_5,
        )
    resumed, _ = train(cfg, tmp_path / "cut", resume=True, progress=False, learner=learner)
    chex.assert_trees_all_equal(jax.device_get(resumed), jax.device_get(full))
    cut = [json.loads(x) for x in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    strip = lambda rs: [{k: v for k, v in r.items() if k != "env_steps_per_s"} for r in rs]
    assert strip(cut) == strip(rows)


def test_pbt_at_its_defaults_compiles_one_update_program(tmp_path):
    """pbt_interval 10 with calls of 8 ran 8 + 2 per interval: two update programs compiled
    (about 13 s each on this machine)."""
    cfg = _tiny("cartpole", 4, total_steps=20 * 32, updates_per_call=8, pbt_interval=10)
    learner = Learner(cfg, devices=jax.devices()[:2])
    _, rows = train(cfg, tmp_path / "run", progress=False, learner=learner)
    assert list(learner._programs) == [5] and len(rows) == 20
    assert [r["update"] for r in rows if "pbt_parent" in r] == [10, 20]


def test_an_extended_run_takes_the_pbt_step_at_its_old_last_update(tmp_path):
    # 4 updates, then --total-steps 6 updates: the PBT step after update 4 (the first run's
    # last) must happen, so the extension equals one run of 6 (lr annealing off: it follows
    # the total).
    kw = dict(anneal_lr=False, learning_rate=(1e-4, 3e-4, 1e-3, 3e-3))
    short = _tiny("cartpole", 4, total_steps=4 * 32, **kw)
    longer = _tiny("cartpole", 4, total_steps=6 * 32, **kw)
    learner = Learner(longer, devices=jax.devices()[:2])
    full, rows = train(longer, tmp_path / "full", progress=False, learner=learner)
    train(
        short, tmp_path / "ext", progress=False, learner=Learner(short, devices=jax.devices()[:2])
    )
    extended, ext_rows = train(
        longer, tmp_path / "ext", resume=True, progress=False, learner=learner
    )
    assert "pbt_parent" in ext_rows[3]
    chex.assert_trees_all_equal(jax.device_get(extended), jax.device_get(full))
    strip = lambda rs: [{k: v for k, v in r.items() if k != "env_steps_per_s"} for r in rs]
    assert strip(ext_rows) == strip(rows)


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--members", "1"], "pbt needs at least 2 members"),
        (["--pbt-fraction", "0.7"], r"pbt_fraction must be in \(0, 0.5\]"),
        (["--pbt-fraction", "0.1"], "replaces no member"),
        (["--pbt-factors", "0.8,-1"], "pbt_factors must be positive finite"),
        (["--pbt-factors", "0.8,1e39"], "pbt_factors must be positive finite float32"),
        (["--pbt-interval", "0"], "pbt_interval must be a positive integer"),
        (["--pbt-window", "-2"], "pbt_window must be a positive integer"),
        (  # PBT would never act: it used to run silently without it
            ["--total-steps", "4096", "--pbt-interval", "100"],
            r"pbt_interval=100 updates is more than the run's \d+ updates",
        ),
    ],
)
def test_cli_bad_pbt_flags_are_one_line_errors(tmp_path, capsys, flags, match):
    from rollout.ppo import main

    argv = ["--pbt", "--members", "4", "--devices", "2", "--out", str(tmp_path), "--no-progress"]
    assert main(argv + flags) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ")
    assert re.search(match, err), err
    assert not any(tmp_path.iterdir())  # nothing written


def _rows(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if k != "env_steps_per_s"} for x in lines]


@pytest.mark.timeout(300)
def test_cli_pbt_on_two_processes_learns_exactly_like_one(tmp_path):
    """4 members, PBT every 2 updates, on 1 process x 4 devices and on 2 processes x 2 devices
    (the copy moves members between processes): the same metrics, bit for bit; each PBT step
    replaced exactly the numpy reference's bottom members with top ones and perturbed their
    hyperparameters by one of the factors; the lineage plot is written. (The reference runs
    in this process, as the two processes run: it needs no interpreter of its own.)"""
    from rollout.ppo import main

    args = ["--env", "cartpole", "--members", "4", "--total-steps", "1536", "--num-steps", "64",
            "--no-progress", "--pbt", "--pbt-interval", "2", "--pbt-fraction", "0.5",
            "--pbt-factors", "0.5,2"]  # fmt: skip
    one, two = tmp_path / "one", tmp_path / "two"
    launch = [sys.executable, "-m", "ensemble.launch", "-n", "2", "--timeout", "270", "--"]
    deadline = time.monotonic() + 290
    logs = tmp_path / "launch.out", tmp_path / "launch.err"  # files: no pipe to drain
    with open(logs[0], "w") as stdout, open(logs[1], "w") as stderr:
        proc = subprocess.Popen(
            [*launch, sys.executable, "-m", "rollout.ppo", *args, "--devices", "2", "--out",
             str(two)], env=clean_env(), cwd=ROOT, stdout=stdout, stderr=stderr,
        )  # fmt: skip
    try:
        assert main([*args, "--devices", "4", "--out", str(one)]) == 0
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out, err = (log.read_text() for log in logs)
    assert proc.returncode == 0, err[-3000:]
    assert "[rank 0] final returns per member" in out
    assert "[rank 1] final returns" not in out  # printing on process 0 only
    rows = _rows(one)
    assert _rows(two) == rows
    assert (one / "pbt_lineage.png").stat().st_size > 0
    assert all(sorted(r["hparams"]) == sorted(pbt.HPARAMS) for r in rows)
    steps = [j for j, r in enumerate(rows) if "pbt_parent" in r]
    assert [rows[j]["update"] for j in steps] == [2, 4, 6]
    for j in steps:  # each step replaced exactly the numpy reference's bottom with its top
        top, bottom = _reference_plan(pbt.recent_returns(_scored_at(rows, j), 3, 4), 0.5)
        parent = rows[j]["pbt_parent"]
        assert {i for i in range(4) if parent[i] != i} == bottom
        assert {parent[i] for i in bottom} <= top
        for i in bottom if j + 1 < len(rows) else ():  # the last step's hparams: no next row
            ratio = (
                rows[j + 1]["hparams"]["clip_coef"][i] / rows[j]["hparams"]["clip_coef"][parent[i]]
            )
            assert min(abs(ratio - 0.5), abs(ratio - 2.0)) < 1e-5


def _benchmark():
    import importlib.util

    spec = importlib.util.spec_from_file_location("pbt_benchmark", ROOT / "benchmarks" / "pbt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(60)
def test_benchmark_times_each_arm_alone_and_a_failed_arm_stops_the_other(tmp_path):
    bench = _benchmark()
    sleep = lambda s: [sys.executable, "-c", f"import time; time.sleep({s})"]
    bench.arm_command = lambda pbt, args, out: sleep(0.5 if pbt else 3)
    walls = bench.run_arms(None, tmp_path)
    assert walls["PBT"] < 2 <= walls["no PBT"]  # PBT was charged the plain arm's 3 s
    mark = f"pbt-arm-{os.getpid()}-{os.urandom(4).hex()}"
    hang = [sys.executable, "-c", f"import time; time.sleep(60)  # {mark}"]
    bench.arm_command = lambda pbt, args, out: (
        hang if pbt else [sys.executable, "-c", "raise SystemExit(1)"]
    )
    with pytest.raises(SystemExit, match="no PBT arm failed"):
        bench.run_arms(None, tmp_path)
    left = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            left += [proc.name] if mark.encode() in (proc / "cmdline").read_bytes() else []
        except OSError:
            pass  # gone meanwhile
    assert not left  # the PBT arm was stopped, not left running


def test_benchmark_best_gap_interval_separates_only_what_the_noise_allows():
    bench, rng = _benchmark(), np.random.default_rng(0)

    def rows(means, noise, nan_member=None):
        out = []
        for _ in range(20):
            r = [float(m + rng.normal(0, noise)) for m in means]
            if nan_member is not None:
                r[nan_member] = None  # a member that finished no episode in that update
            out.append({"returns": r})
        return out

    # Noise-free scores: the gap is exact and every resample agrees.
    flat = {"PBT": rows([-150, -140], 0), "no PBT": rows([-145, -900], 0)}
    assert bench.best_gap_interval(flat, 10) == {
        "gap": 5.0, "ci95": [5.0, 5.0], "share_at_or_above": 1.0,
    }  # fmt: skip
    # Bests 1 apart under noise of 20 per update: the interval holds 0.
    noisy = bench.best_gap_interval({"PBT": rows([-149], 20), "no PBT": rows([-150], 20)}, 10)
    assert noisy["ci95"][0] < 0 < noisy["ci95"][1]
    # 50 apart under noise of 2: excluded; a member without episodes is left out, not NaN.
    clear = {"PBT": rows([-100, -300], 2, nan_member=1), "no PBT": rows([-150], 2)}
    gap = bench.best_gap_interval(clear, 10)
    assert 40 < gap["ci95"][0] <= gap["ci95"][1] < 60 and gap["share_at_or_above"] == 1.0


def test_benchmark_held_out_scores_the_training_pick_on_shared_episodes():
    """Each arm's pick is its best member by *training* score, whatever the held-out episodes
    say; the gap is paired over the same episodes (numpy reference)."""
    bench, rng = _benchmark(), np.random.default_rng(1)
    base = rng.normal(-150, 30, 400)  # one initial state per episode, shared by every policy
    plain = np.stack([base + d for d in (-900.0, -5.0, -2.0)])  # [members, episodes]
    pbt = np.stack([base + d + rng.normal(0, 1, 400) for d in (-3.0, 0.0)])
    scores = {"no PBT": [-1000.0, -140.0, -160.0], "PBT": [float("nan"), -150.0]}
    out = bench.held_out(scores, {"no PBT": plain, "PBT": pbt})
    assert out["no PBT"]["pick"] == 1 and out["PBT"]["pick"] == 1  # by score; NaN skipped
    assert out["no PBT"]["pick_mean"] == round(float(plain[1].mean()), 1)
    assert out["no PBT"]["best_mean"] == round(float(plain[2].mean()), 1)  # not the pick
    diff = pbt[1] - plain[1]
    assert out["pick_gap"] == round(float(diff.mean()), 1)
    assert out["pick_gap_se"] == round(float(diff.std(ddof=1) / 20), 1)
    # Shared episodes: the gap's error is the 1-point noise, not the 30-point spread of states.
    assert 4.5 < out["pick_gap"] < 5.5 and out["pick_gap_se"] <= 0.1  # unpaired: about 2


def test_benchmark_picks_and_compares_on_unrounded_scores(tmp_path, monkeypatch):
    """Members whose scores round alike (-140.33 and -140.29 to -140.3) were told apart by
    member number, not score: the pick was member 0, the lower."""
    import argparse

    bench = _benchmark()
    runs = {
        "PBT": [{"returns": [-140.33, -150.0, -140.29], "env_steps": 64, "hparams": {}}] * 3,
        "no PBT": [{"returns": [-140.32, -141.0, -900.0], "env_steps": 64, "hparams": {}}] * 3,
    }
    monkeypatch.setattr(bench, "evaluate_arm", lambda run, episodes, seed: np.zeros((3, 4)))
    args = argparse.Namespace(tail=2, seed=0, eval_episodes=4, interval=1)
    result = bench.build_result(args, tmp_path, runs, {"PBT": 1.0, "no PBT": 1.0}, (0, 0, 0))
    assert result["arms"]["PBT"]["final_per_member"] == [-140.3, -150.0, -140.3]  # shown rounded
    assert result["held_out"]["PBT"]["pick"] == 2 and result["held_out"]["no PBT"]["pick"] == 0
    assert result["pbt_best_ge_plain_best"]  # -140.29 >= -140.32, though both show -140.3


@pytest.mark.timeout(240)
def test_benchmark_evaluates_an_arms_final_checkpoint(tmp_path):
    """evaluate_arm exports a run's last checkpoint and returns [members, episodes] returns,
    the same as evaluating the exported members directly."""
    from rollout.ppo import evaluate, export, train

    cfg = PPOConfig.for_env(
        "pendulum", members=2, total_steps=256, num_envs=4, num_steps=64,
        num_minibatches=2, update_epochs=1,
    )  # fmt: skip
    train(cfg, tmp_path / "arm", progress=False, devices=jax.devices()[:2])
    got = _benchmark().evaluate_arm(tmp_path / "arm", episodes=3, seed=5)
    members = [export.read_member(d) for d in export.member_dirs(tmp_path / "arm" / "export")]
    want = evaluate.evaluate(members, 3, 5)
    assert got.shape == (2, 3)
    np.testing.assert_array_equal(got, np.stack([want["member_0"], want["member_1"]]))
