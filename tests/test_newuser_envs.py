"""A new user's own gymnasium env on the ensemble PPO learner: spaces gymnasium allows but a
naive layer gets wrong (``Discrete(n, start=k)``, float64 action boxes), the gym < 0.26 step,
ids whose module is malformed or raises on import, an env registered in ``__main__``, and the
host layer's own make kwargs from ``--env-kwargs``. Each trains correctly (the env asserts that
every action is inside its space, and the learner's returns equal the env's own sums) or is
one line naming what to do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from rollout import envs
from tests.subprocess_env import ROOT, clean_env

MODULE = '''
import json, os
import numpy as np
import gymnasium as gym
from gymnasium import spaces


class Probe(gym.Env):
    """Asserts each action is in its space; logs each episode's return (worker pid, sum)."""

    def __init__(self, act=None, old_step=False, log=None, done_as=bool, scale=None):
        self.observation_space = spaces.Box(-1, 1, (2,), np.float32)
        self.action_space = act if act is not None else spaces.Discrete(2)
        self.old_step, self.log, self.done_as, self.scale = old_step, log, done_as, scale

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t, self.ret = 0, 0.0
        return np.zeros(2, np.float32), {}

    def step(self, action):
        assert self.action_space.contains(action), f"{action!r} not in {self.action_space}"
        if self.scale:
            action *= self.scale  # in place: a user's careless scaling
        self.t += 1
        r = float(np.sum(action)) + 0.25 * self.t
        self.ret += r
        done = self.t >= 5
        if done and self.log:
            with open(self.log, "a") as f:
                f.write(json.dumps([os.getpid(), self.ret]) + "\\n")
        obs = np.full(2, 0.1 * self.t, np.float32)
        done = self.done_as(done) if callable(self.done_as) else self.done_as
        return (obs, r, done, {}) if self.old_step else (obs, r, done, False, {})


gym.register("Start-v0", entry_point=Probe, kwargs={"act": spaces.Discrete(3, start=-1)})
gym.register("Box64-v0", entry_point=Probe, kwargs={"act": spaces.Box(
    np.array([-0.1, 0.3]), np.array([0.1, 0.7]), dtype=np.float64)})
gym.register("Multi-v0", entry_point=Probe, kwargs={"act": spaces.MultiDiscrete([3, 2, 4],
             start=[-1, 4, 0])})
gym.register("Multi8-v0", entry_point=Probe, kwargs={"act": spaces.MultiDiscrete([3, 2],
             dtype=np.int8)})
gym.register("Multi2D-v0", entry_point=Probe, kwargs={"act": spaces.MultiDiscrete([[2, 3],
             [2, 2]])})
gym.register("Old-v0", entry_point=Probe, kwargs={"old_step": True})
gym.register("Plain-v0", entry_point=Probe)
gym.register("Exits-v0", entry_point=lambda: exit(4))
gym.register("Scale-v0", entry_point=Probe, kwargs={"act": spaces.Box(-1, 1, (2,)), "scale": 10})
'''


@pytest.fixture(scope="module", autouse=True)
def probe_module(tmp_path_factory):
    """The user's module (``nu_probe``), on the import path (workers inherit it), and one that
    raises when imported (``nu_broken``)."""
    where = tmp_path_factory.mktemp("newuser")
    (where / "nu_probe.py").write_text(MODULE)
    (where / "nu_broken.py").write_text("import gymnasium\nundefined_name + 1\n")
    (where / "nu_exits.py").write_text("import sys\nsys.exit(3)\n")
    sys.path.insert(0, str(where))
    yield where
    sys.path.remove(str(where))


def _train_and_compare(env_id: str, log, **cfg_kwargs) -> None:
    """Trains 2 members on ``env_id`` (the env asserts every action is in its space) and checks
    each member's episode returns, summed over the run, against the env's own sums."""
    from rollout.ppo import Learner, PPOConfig, train

    env = envs.make(f"gymnasium:nu_probe:{env_id}", log=str(log), workers_per_device=1)
    cfg = PPOConfig.for_env(
        f"gymnasium:nu_probe:{env_id}", members=2, total_steps=128, num_steps=32, num_envs=2,
        env_kwargs={"log": str(log)}, **cfg_kwargs,
    )  # fmt: skip
    learner = Learner(cfg, env=env, devices=jax.devices()[:2])
    try:
        _, rows = train(cfg, learner=learner, progress=False)
    finally:
        learner.close()
    sums: dict[int, float] = {}
    for pid, ret in map(json.loads, log.read_text().splitlines()):
        sums[pid] = sums.get(pid, 0.0) + ret
    learned = [sum((r["returns"][m] or 0.0) * r["episodes"][m] for r in rows) for m in range(2)]
    episodes = sum(sum(r["episodes"]) for r in rows)
    assert episodes == len(log.read_text().splitlines()) > 0
    np.testing.assert_allclose(sorted(learned), sorted(sums.values()), rtol=1e-5)


@pytest.mark.timeout(60)
def test_a_discrete_space_starting_at_k_gets_actions_shifted_into_it(tmp_path):
    """``Discrete(3, start=-1)``: the policy's index i reaches the env as i - 1 (was refused;
    stepping it unshifted would take 0 for the space's first action)."""
    from rollout.hostenv._worker import make_gymnasium

    env = make_gymnasium("nu_probe:Start-v0")
    assert env.action_space.n == 3 and int(env.action_space.start) == 0
    env.reset(seed=0)
    assert env.step(0)[1] == -1 + 0.25 and env.step(2)[1] == 1 + 0.5
    assert envs.make("gymnasium:nu_probe:Start-v0").action_space.num_actions == 3
    _train_and_compare("Start-v0", tmp_path / "episodes.jsonl")


@pytest.mark.timeout(60)
def test_a_multidiscrete_space_trains_with_each_element_shifted_into_it(tmp_path):
    """``MultiDiscrete([3, 2, 4], start=[-1, 4, 0])``: one categorical per element (was
    refused); index i of element j reaches the env as i + start[j], and an action outside
    ``nvec`` is refused naming the element."""
    from rollout.hostenv._worker import _check_discrete, make_gymnasium

    env = make_gymnasium("nu_probe:Multi-v0")
    assert env.action_space.nvec.tolist() == [3, 2, 4] and not env.action_space.start.any()
    env.reset(seed=0)
    assert env.step(np.array([0, 0, 0], np.int32))[1] == -1 + 4 + 0 + 0.25
    assert env.step(np.array([2, 1, 3], np.int32))[1] == 1 + 5 + 3 + 0.5
    space = envs.make("gymnasium:nu_probe:Multi-v0").action_space
    assert isinstance(space, envs.MultiDiscrete) and space.nvec == (3, 2, 4)
    with pytest.raises(
        ValueError, match=r"action \[0, 2, 0\] of this worker's env 1 .*\(element 1"
    ):
        _check_discrete(np.array([[0, 1, 3], [0, 2, 0]], np.int32), np.array([3, 2, 4]))
    _train_and_compare("Multi-v0", tmp_path / "episodes.jsonl")
    # The env gets its own dtype (the policy's actions are int32), in the workers and in
    # evaluate alike (both make it here); a 2-D nvec is refused in one line.
    step = make_gymnasium("nu_probe:Multi8-v0").func
    assert step(np.array([2, 1], np.int32)).dtype == np.int8
    with pytest.raises(ValueError) as e:
        envs.make("gymnasium:nu_probe:Multi2D-v0")
    assert "must have a vector nvec" in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.timeout(60)
def test_a_float64_action_box_gets_clipped_actions_inside_it(tmp_path):
    """A float64 bound such as -0.1 is -0.10000000149 in float32: the learner's clipped action
    was outside the env's box. The bounds are now float32 values inside it."""
    space = envs.make("gymnasium:nu_probe:Box64-v0").action_space
    low, high = np.float32(space.low), np.float32(space.high)
    assert (low >= [-0.1, 0.3]).all() and (high <= [0.1, 0.7]).all()
    assert (low - np.float32([-0.1, 0.3]) <= 1e-7).all()  # one float32 step in, no more
    _train_and_compare("Box64-v0", tmp_path / "episodes.jsonl")


def _cli(where, *args: str) -> subprocess.CompletedProcess:
    """``python -m rollout.ppo ARGS`` with the user's modules (in ``where``) importable."""
    env = clean_env(PYTHONPATH=os.pathsep.join([str(ROOT), str(where)]))
    cmd = [sys.executable, "-m", "rollout.ppo", *args, "--no-progress"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=80)


@pytest.mark.timeout(90)
def test_a_gym_0_21_step_is_one_line_naming_the_api(tmp_path, probe_module):
    """A 4-tuple step was "not enough values to unpack (expected 5, got 4)", naming nothing."""
    out = tmp_path / "run"
    size = ["--members", "2", "--num-envs", "2", "--num-steps", "16", "--total-steps", "32"]
    in_process = ["--env-kwargs", '{"workers_per_device": 0}']  # the header said cpu-workers
    proc = _cli(probe_module, "--env", "gymnasium:nu_probe:Old-v0", *size, *in_process,
                "--out", str(out))  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert " envs_on=this-process " in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "step returned a 4-tuple, not gymnasium's (obs, reward, terminated, truncated, " \
        "info) (gym < 0.26 returned (obs, reward, done, info))" in last, last  # fmt: skip
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("done_as", [None, "no", 2])
@pytest.mark.timeout(20)
def test_a_terminated_flag_that_is_not_a_bool_is_refused_not_stored(done_as):
    """NumPy stored ``terminated=None`` as False (an episode that never ends) and 'no' as True."""
    from rollout.hostenv._worker import _Gymnasium

    envs_ = _Gymnasium("nu_probe:Plain-v0", {"done_as": done_as}, 1)
    envs_.reset(np.zeros(1, np.uint32))
    out = (np.zeros((1, 2), np.float32), np.zeros(1), *np.zeros((2, 1), bool))
    out = (*out, np.zeros((1, 2), np.float32))
    with pytest.raises(ValueError, match=f"^step returned terminated={done_as!r} "):
        envs_.step(np.zeros(1, np.int32), out)
    for ok in (np.bool_(False), 0, np.int64(1)):  # bools, and the ints 0 and 1, are taken
        envs_ = _Gymnasium("nu_probe:Plain-v0", {"done_as": ok}, 1)
        envs_.reset(np.zeros(1, np.uint32))
        envs_.step(np.zeros(1, np.int32), out)
        assert out[2][0] == bool(ok)


@pytest.mark.timeout(20)
def test_an_env_scaling_its_action_in_place_steps_in_this_process_too():
    """With ``workers_per_device=0`` the actions are the callback's read-only view: an env
    that scales its action in place failed there ("output array is read-only"), not in a
    worker process, which copies them. Each env now gets its own writable copy."""
    from rollout.hostenv._worker import _Gymnasium

    envs_ = _Gymnasium("nu_probe:Scale-v0", {}, 2)
    envs_.reset(np.zeros(2, np.uint32))
    actions = np.full((2, 2), 0.5, np.float32)
    actions.flags.writeable = False
    out = (np.zeros((2, 2), np.float32), np.zeros(2), *np.zeros((2, 2), bool))
    envs_.step(actions, (*out, np.zeros((2, 2), np.float32)))
    np.testing.assert_array_equal(out[1], [10 + 0.25, 10 + 0.25])  # sum of 10 x 0.5, 2 dims
    assert (actions == 0.5).all()


@pytest.mark.parametrize(
    "env_id, kwargs, message",
    [
        (":X-v0", {}, r"gymnasium cannot make ':X-v0': an id with a module is 'module:EnvId-v0'"),
        ("nu_probe:Start-v0:x", {}, r"an id with a module is 'module:EnvId-v0'"),
        (
            "nu_broken:X-v0",
            {},
            r"^gymnasium cannot make 'nu_broken:X-v0': importing 'nu_broken' "
            r"raised NameError: name 'undefined_name' is not defined$",
        ),
        (  # a sys.exit ended the run with its code and no word
            "nu_exits:X-v0",
            {},
            r"^gymnasium cannot make 'nu_exits:X-v0': importing 'nu_exits' raised SystemExit: 3$",
        ),
        (
            "nu_probe:Exits-v0",
            {},
            r"^gymnasium cannot make 'nu_probe:Exits-v0' with \{\}: it raised SystemExit\(4\) ",
        ),
        (
            "nu_probe:Start-v0",
            {"max_episode_steps": 0},
            r"^gymnasium cannot make "
            r"'nu_probe:Start-v0' with \{'max_episode_steps': 0\}: AssertionError: ",
        ),
        ("nu_probe:Start-v0", {"timeout": "60"}, r"timeout must be a number of seconds > 0"),
        ("nu_probe:Start-v0", {"timeout": -1}, r"timeout must be a number of seconds > 0"),
        ("nu_probe:Start-v0", {"workers_per_device": -1}, r"workers_per_device must be an int "),
        ("nu_probe:Start-v0", {"workers_per_device": 1.5}, r"workers_per_device must be an int "),
    ],
)
@pytest.mark.timeout(20)
def test_bad_ids_and_make_kwargs_are_one_value_error_line(env_id, kwargs, message):
    """Each was a bare Python error naming neither the env nor the fix ("Empty module name",
    a silent exit with the module's own code,
    an unpacking error, the module's own NameError, a bare AssertionError), a traceback from
    deep in the worker group ("timeout": "60") or an error at every reset (a negative one)."""
    with pytest.raises(ValueError, match=message) as e:
        envs.make(f"gymnasium:{env_id}", **kwargs)
    assert "\n" not in str(e.value)


@pytest.mark.timeout(60)
def test_cli_env_module_that_raises_on_import_is_one_line_exit_2(tmp_path, probe_module):
    proc = _cli(probe_module, "--env", "gymnasium:nu_broken:X-v0", "--out", str(tmp_path / "r"))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: gymnasium cannot make 'nu_broken:X-v0': importing 'nu_broken' raised NameError: "
        "name 'undefined_name' is not defined"
    ]


SCRIPT = textwrap.dedent(
    """
    import gymnasium as gym, numpy as np
    from gymnasium import spaces
    import nu_probe

    class Mine(nu_probe.Probe):
        pass

    gym.register("Mine-v0", entry_point=Mine)          # in __main__: workers cannot make it
    gym.register("Imported-v0", entry_point=nu_probe.Probe)  # in a module they never import
    from rollout import envs
    try:
        envs.make("gymnasium:Mine-v0")
    except ValueError as e:
        print(e)
    envs.make("gymnasium:Mine-v0", workers_per_device=0)  # stepped here: fine
    from rollout.hostenv._worker import _Gymnasium
    gym.envs.registration.registry.pop("Imported-v0")  # as in a worker that never ran it
    try:
        _Gymnasium("Imported-v0", {}, 1)
    except ValueError as e:
        print(e)
    from rollout.ppo import PPOConfig  # its defaults need the spaces only: read here
    print("for_env", PPOConfig.for_env("gymnasium:Mine-v0").env)
    """
)


@pytest.mark.timeout(60)
def test_an_id_registered_where_workers_cannot_see_it_says_how_to_register_it(probe_module):
    """Registered in the script's ``__main__``: refused at make. Registered by code the workers
    do not run: their error says to give the module in the id (was gymnasium's bare
    "Environment `X` doesn't exist", for an id the learner had just made)."""
    env = clean_env(PYTHONPATH=os.pathsep.join([str(ROOT), str(probe_module)]))
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=50
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith(
        "gymnasium:Mine-v0: its env is defined in the script being run (__main__), which the "
        "env worker processes do not run: move the env and its gymnasium.register into a module"
    ), lines
    assert lines[1].startswith("'Imported-v0' is not registered in the env worker processes ")
    assert lines[1].endswith("give the id as 'gymnasium:<module>:<id>', which every worker imports")
    assert lines[2] == "for_env gymnasium:Mine-v0", lines  # was refused, with advice it cannot take


@pytest.mark.parametrize("env_id", ["Start-v0", "Multi-v0"])
@pytest.mark.timeout(90)
def test_an_exported_member_acts_in_the_env_s_own_action_space(env_id, tmp_path):
    """An export records the space's ``start``: a member deployed on ``gymnasium.make(id)`` as
    it is (without the learner's shift) steps the learner's argmax plus the start. ``act``
    gave the index, which the ``Discrete(3, start=-1)`` env took as the wrong action, or
    refused (2); ``evaluate`` still equals a plain loop of ``act``."""
    import gymnasium
    import jax.numpy as jnp

    from rollout.ppo import Learner, PPOConfig, export
    from rollout.ppo import _networks as nets
    from rollout.ppo.evaluate import evaluate

    name = f"gymnasium:nu_probe:{env_id}"
    cfg = PPOConfig.for_env(name, members=2, total_steps=64, num_steps=32, num_envs=2)
    learner = Learner(cfg, devices=jax.devices()[:2])
    try:
        state = learner.init()
        (path,) = export.export_members(learner, state, tmp_path, members=[1])
        obs = np.random.default_rng(0).uniform(-1, 1, (64, 2)).astype(np.float32)
        params = jax.device_get(export.member_arrays(state, 1)[0])
        logits = np.asarray(learner.network.apply({"params": params}, jnp.asarray(obs))[0])
    finally:
        learner.close()
    space = gymnasium.make(f"nu_probe:{env_id}").action_space
    groups = learner.spec.action_groups
    index = np.stack([p.argmax(-1) for p in nets.split_groups(logits, groups)], -1)
    want = index + np.asarray(space.start) if groups else index[:, 0] + int(space.start)
    member = export.read_member(path)
    np.testing.assert_array_equal(member.act(obs), want)
    assert (
        json.loads((path / "member.json").read_text())["action"]["start"]
        == np.ravel(space.start).tolist()
    )
    env = gymnasium.make(f"nu_probe:{env_id}")  # asserts each action is in its space
    mine = []
    for seed in range(3):
        o, _ = env.reset(seed=seed)
        done, total = False, 0.0
        while not done:
            o, r, term, trunc, _ = env.step(np.asarray(member.act(o[None]))[0])
            total, done = total + r, term or trunc
        mine.append(total)
    np.testing.assert_allclose(evaluate([member], 3, seed=0)["member_1"], mine, rtol=1e-6)
