"""Host envs (gymnasium / EnvPool in CPU worker processes) stepped from jitted, sharded programs.

The env under test is a small pure-Python gymnasium env written by these tests into a temporary
module (``hostenv_walk``) and used as ``gymnasium:hostenv_walk:Walk-v0``, so the workers must
import and register it themselves. Trajectories are checked step by step against a plain Python
loop over ``gymnasium.make`` with the same seeds and actions.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from subprocess_env import alive, alive_after, clean_env, workers_of

import ensemble
from rollout import envs
from rollout.hostenv import _fast
from rollout.hostenv._fast import C_T

ROOT = Path(__file__).resolve().parents[1]

WALK = '''
import os
import sys

import gymnasium as gym
import numpy as np
from gymnasium import spaces


class Walk(gym.Env):
    """A noisy 1-D walk: terminates when |pos| > 3, truncated after 12 steps (registration)."""

    def __init__(self, continuous=False, fail_at=None, report_pid=False, tuple_obs=False,
                 pixels=False, pixel_dtype="uint8", grid=False, walls=False, int_actions=False,
                 short_obs_at=None, fork_child=None, step_sleep=0.0, multi_actions=False,
                 nan_at_end=False, close_raises=False, odd=None):
        if fork_child and "jax" not in sys.modules:  # in a worker only, not the learner: a
            # process of the env's own that outlives the worker, its pid in the file
            pid = os.fork()
            if pid == 0:
                import time
                time.sleep(120)
                os._exit(0)
            with open(fork_child, "a") as f:  # one line per env: the test kills them all
                f.write(f"{pid}\\n")
        self.continuous, self.fail_at, self.report_pid = continuous, fail_at, report_pid
        self.step_sleep = step_sleep
        self.nan_at_end = nan_at_end  # a terminated episode's last observation: all NaN
        self.close_raises = close_raises
        self.odd = odd  # 'old_reset' (obs alone), or a reward that is no number: 'none', ...
        self.short_obs_at = short_obs_at  # from this step on, one number short of the space
        self.walls = walls
        if continuous:
            self.action_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
        else:
            self.action_space = spaces.Discrete(3)
        self.observation_space = spaces.Box(-np.inf, np.inf, (4,), np.float64)
        self.tuple_obs = tuple_obs
        if tuple_obs:  # the position as one of 7 cells, and the rest: not a Box
            box = spaces.Box(-np.inf, np.inf, (3,), np.float64)
            self.observation_space = spaces.Tuple((spaces.Discrete(7), box))
        self.pixels, self.pixel_dtype = pixels, np.dtype(pixel_dtype)
        if pixels:  # a frame in [0, 255]: channel 0 shows the position, the others noise
            broken = (np.int64, np.float64)  # a uint8 space that gets other values
            space_dtype = np.uint8 if self.pixel_dtype in broken else self.pixel_dtype
            self.observation_space = spaces.Box(0, 255, (3, 5, 5), space_dtype)
        if grid:  # a 2x2 matrix: neither a vector nor an image
            self.observation_space = spaces.Box(-np.inf, np.inf, (2, 2), np.float64)
        self.grid, self.steps = grid, 0
        if int_actions:
            self.action_space = spaces.Box(0, 3, (2,), np.int64)
        if multi_actions:  # three binary choices per step: no head of the PPO networks
            self.action_space = spaces.MultiBinary(3)

    def _obs(self):
        extra = float(os.getpid()) if self.report_pid else self.np_random.normal()
        obs = np.array([self.pos, self.vel, self.np_random.normal(), extra])
        if self.pixels:
            frame = self.np_random.integers(0, 256, (3, 5, 5), dtype=np.uint8)
            frame[0] = np.uint8(np.clip(128 + 40 * self.pos, 0, 255))
            if self.pixel_dtype == np.int64:  # a uint8 space broken: values up to 355
                return frame.astype(np.int64) + 100
            if self.pixel_dtype == np.float64:  # ... or with fractions: 73.5
                return frame / 2.0
            return frame.astype(self.pixel_dtype)
        if self.tuple_obs:
            return int(np.clip(np.round(self.pos) + 3, 0, 6)), obs[1:]
        if self.short_obs_at is not None and self.steps >= self.short_obs_at:
            return obs[:1]
        return obs.reshape(2, 2) if self.grid else obs

    def close(self):
        if self.close_raises:
            raise RuntimeError("the walk would not close")

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.pos, self.vel = self.np_random.uniform(-1, 1), 0.0
        return self._obs() if self.odd == "old_reset" else (self._obs(), {})

    def step(self, action):
        self.steps += 1
        if self.step_sleep:
            import time
            time.sleep(self.step_sleep)
        if self.fail_at is not None and self.steps >= self.fail_at:
            raise ValueError(f"the walk fell over at step {self.steps}")
        a = float(action[0] - 0.5 * action[1]) if self.continuous else float(action) - 1.0
        self.vel = 0.8 * self.vel + 0.5 * a + 0.2 * self.np_random.normal()
        self.pos += self.vel
        if self.walls:
            self.pos = float(np.clip(self.pos, -3.0, 3.0))
        obs, terminated = self._obs(), bool(abs(self.pos) > 3.0)
        if self.nan_at_end and terminated:
            obs = np.full_like(obs, np.nan)
        odd_rewards = {"none": None, "text": "1", "array": np.array([1.0])}
        reward = odd_rewards.get(self.odd, a - self.pos**2)
        return obs, reward, terminated, False, {}


gym.register("Walk-v0", entry_point=Walk, max_episode_steps=12)
gym.register("WalkCont-v0", entry_point=Walk, max_episode_steps=12, kwargs={"continuous": True})
# No time limit, and walls instead of an end: an episode ends only if the policy's env does.
gym.register("Corridor-v0", entry_point=Walk, kwargs={"walls": True})
'''

WALK_ID = "hostenv_walk:Walk-v0"


@pytest.fixture(scope="module", autouse=True)
def walk_module(tmp_path_factory):
    """Writes the test env module and puts it on the import path (workers inherit the path)."""
    where = tmp_path_factory.mktemp("walk")
    (where / "hostenv_walk.py").write_text(WALK)
    sys.path.insert(0, str(where))
    yield where
    sys.path.remove(str(where))


@pytest.fixture(scope="module", autouse=True)
def no_leaked_workers():
    """After every test here: no worker process of this test process is left running."""
    yield
    deadline = time.monotonic() + 10
    while children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert children() == []


def children() -> list[int]:
    """Live host-env worker processes of this process."""
    return workers_of(os.getpid(), "hostenv")


# ---------------------------------------------------------------------- helpers


@pytest.fixture(params=["ffi", "python"])
def step_path(request, monkeypatch):
    """Each worker-process step made by the FFI handler, or by the Python step it falls back
    to without a compiler. The handler must build here: a test environment without one would
    otherwise test only the fallback."""
    if request.param == "ffi":
        assert _fast.library() is not None, _fast.why_not()
    else:
        monkeypatch.setitem(_fast._state, "lib", None)
        monkeypatch.setitem(_fast._state, "why", _fast.DISABLED)
    return request.param


def bound(env_id, members, num_envs, devices, **kwargs):
    env = envs.make(f"gymnasium:{env_id}", **kwargs)
    mesh = ensemble.make_mesh(members, devices=jax.devices()[:devices])
    return env.bind(mesh, members, num_envs), mesh


def run_host(host, mesh, keys, actions):
    """Reset, then all steps in one jitted scan: the path the learner takes."""

    def rollout(keys, actions):
        state, obs0 = host.reset(keys)

        def step(state, action):
            state, obs, reward, term, trunc, info = host.step(state, action, keys)
            return state, (obs, reward, term, trunc, info["final_obs"])

        return obs0, jax.lax.scan(step, state, actions)[1]

    with jax.set_mesh(mesh):
        out = jax.jit(rollout)(keys, actions)
    return jax.tree.map(np.asarray, out)


def reset_then_compile(host, mesh, keys, action):
    """The envs' first state, and their step compiled for it (a call needs no mesh context)."""
    with jax.set_mesh(mesh):
        state, _ = jax.block_until_ready(jax.jit(host.reset)(keys))
        return state, jax.jit(host.step).lower(state, action, keys).compile()


def seeds_of(keys) -> np.ndarray:
    """One uint32 seed per env key, drawn in plain JAX (the definition HostEnvs follows)."""
    flat = keys.reshape(-1)
    return np.array([int(jax.random.bits(k, (), jnp.uint32)) for k in flat]).reshape(keys.shape)


def assert_same_trajectory(obs0, steps, ref0, ref, tol=1e-5):
    """The host path's first observations and steps equal the reference loop's."""
    np.testing.assert_allclose(obs0, ref0, rtol=tol / 10, atol=tol / 10)
    for name, got, want in zip(("obs", "reward", "term", "trunc", "final_obs"), steps, ref):
        np.testing.assert_allclose(got, want.astype(got.dtype), rtol=tol, atol=tol, err_msg=name)


def reference(env_id, seeds, actions, **kwargs):
    """The same envs in a plain Python loop: gymnasium.make, reset(seed), same-step autoreset;
    observations that are not a Box flattened by gymnasium's own FlattenObservation."""
    import gymnasium

    def make():
        env = gymnasium.make(env_id, **kwargs)
        box = isinstance(env.observation_space, gymnasium.spaces.Box)
        return env if box else gymnasium.wrappers.FlattenObservation(env)

    n, e = seeds.shape
    T = actions.shape[0]
    probe = make()
    d = probe.observation_space.shape
    probe.close()
    obs0 = np.zeros((n, e, *d))
    obs, final = np.zeros((T, n, e, *d)), np.zeros((T, n, e, *d))
    reward, term, trunc = np.zeros((T, n, e)), np.zeros((T, n, e), bool), np.zeros((T, n, e), bool)
    for m in range(n):
        for j in range(e):
            env = make()
            obs0[m, j] = env.reset(seed=int(seeds[m, j]))[0]
            for t in range(T):
                a = actions[t, m, j]
                o, r, te, tr, _ = env.step(a if a.ndim else int(a))
                final[t, m, j], reward[t, m, j], term[t, m, j], trunc[t, m, j] = o, r, te, tr
                obs[t, m, j] = env.reset()[0] if (te or tr) else o
            env.close()
    return obs0, (obs, reward, term, trunc, final)


def actions_for(env_id, T, n, e, seed=0):
    rng = np.random.default_rng(seed)
    if "Cont" in env_id:
        return rng.uniform(-1, 1, (T, n, e, 2)).astype(np.float32)
    return rng.integers(0, 3, (T, n, e)).astype(np.int32)


# ---------------------------------------------------------------------- trajectories


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "env_id, workers, kwargs",
    [
        (WALK_ID, 2, {}),
        ("hostenv_walk:WalkCont-v0", 2, {}),
        (WALK_ID, 0, {}),
        (WALK_ID, 2, {"tuple_obs": True}),  # Tuple(Discrete, Box) observations: flattened
        (WALK_ID, 2, {"pixels": True}),  # uint8 frames: they travel as uint8
    ],
)
def test_trajectories_equal_a_python_loop(env_id, workers, kwargs, step_path):
    # 4 members on 2 devices, 3 envs each, 2 workers per device: rows split unevenly; or the
    # envs in this process (workers_per_device=0).
    n, e, T = 4, 3, 30
    host, mesh = bound(env_id, n, e, devices=2, workers_per_device=workers, **kwargs)
    try:
        keys = jax.random.split(jax.random.key(7), (n, e))
        actions = actions_for(env_id, T, n, e)
        obs0, steps = run_host(host, mesh, keys, actions)
        assert len(host.pids) == 2 * workers
        # Every step of every group made without Python, where the handler applies; but for a
        # step whose worker was slower than the 0.2 s the handler waits (a descheduled worker on
        # a loaded machine: seen once in a run at load 7 on 2 cores), which Python finishes.
        if workers and step_path == "ffi":
            assert 2 * T - 3 <= host.fast_steps <= 2 * T
        else:
            assert host.fast_steps == 0
    finally:
        host.close()
    ref0, ref = reference(env_id, seeds_of(keys), actions, **kwargs)
    if kwargs.get("pixels"):
        assert obs0.shape[2:] == (3, 5, 5)
        assert obs0.dtype == steps[0].dtype == steps[4].dtype == np.uint8
    else:
        assert obs0.shape[-1] == (10 if kwargs else 4)  # one-hot of 7 cells + 3
        assert obs0.dtype == steps[0].dtype == np.float32
    assert_same_trajectory(obs0, steps, ref0, ref)
    # Both ways of ending an episode happened, and the final obs differ from the reset ones.
    assert ref[2].any() and (ref[3] & ~ref[2]).any()
    done = ref[2] | ref[3]
    assert not np.allclose(steps[0][done], steps[4][done])
    assert host.pids == []


@pytest.mark.timeout(180)
def test_mujoco_trajectories_equal_a_python_loop():
    # The `mujoco` extra: HalfCheetah-v5 with a 10-step time limit, so episodes are truncated and
    # reset within the run; physics and seeding equal to gymnasium called directly.
    pytest.importorskip("mujoco")
    n, e, T, kw = 2, 2, 25, {"max_episode_steps": 10}
    host, mesh = bound("HalfCheetah-v5", n, e, devices=2, workers_per_device=1, **kw)
    try:
        keys = jax.random.split(jax.random.key(3), (n, e))
        actions = np.random.default_rng(0).uniform(-1, 1, (T, n, e, 6)).astype(np.float32)
        obs0, steps = run_host(host, mesh, keys, actions)
    finally:
        host.close()
    ref0, ref = reference("HalfCheetah-v5", seeds_of(keys), actions, **kw)
    assert_same_trajectory(obs0, steps, ref0, ref, tol=1e-4)
    assert ref[3][9].all() and ref[3][19].all() and not ref[2].any()  # truncated at 10 and 20
    assert not np.allclose(steps[0][9], steps[4][9])  # reset obs, not the final one


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "axes, shape",
    [(("ensemble", "data", "model", "pipe"), (2, 1, 1, 2)), (("ensemble", "data"), (2, 2))],
    ids=["an-axis-of-its-own", "no-model-axis"],
)
def test_a_mesh_of_other_axes_steps_each_env_once(axes, shape, step_path):
    # A member's copies along an axis other than 'data' and 'model' each stepped its envs too
    # (the same worker group, twice a step: random restarts); a mesh without 'model' failed.
    from jax.sharding import AxisType, Mesh

    devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    mesh = Mesh(devices, axes, axis_types=(AxisType.Auto,) * len(axes))
    n, e, T = 2, 2, 14
    host = envs.make(f"gymnasium:{WALK_ID}", workers_per_device=1).bind(mesh, n, e)
    try:
        keys = jax.random.split(jax.random.key(3), (n, e))
        actions = actions_for(WALK_ID, T, n, e, seed=2)
        obs0, steps = run_host(host, mesh, keys, actions)
        assert host.restarts == 0
    finally:
        host.close()
    ref0, ref = reference(WALK_ID, seeds_of(keys), actions)
    assert_same_trajectory(obs0, steps, ref0, ref)


@pytest.mark.timeout(120)
def test_members_over_8_devices_step_their_own_envs_on_their_own_workers():
    n, e, T = 8, 2, 14
    host, mesh = bound(WALK_ID, n, e, devices=8, report_pid=True)
    try:
        keys = jax.random.split(jax.random.key(3), (n, e))
        actions = actions_for(WALK_ID, T, n, e, seed=1)
        obs0, steps = run_host(host, mesh, keys, actions)
        group_pids = [g.pids for g in host.groups]
    finally:
        host.close()
    assert all(len(p) == 1 for p in group_pids) and len({p[0] for p in group_pids}) == 8
    for m in range(n):  # member m's envs ran in the worker of device m, and nowhere else
        assert np.all(obs0[m, :, 3] == group_pids[m][0])
        assert np.all(steps[0][:, m, :, 3] == group_pids[m][0])
    ref0, ref = reference(WALK_ID, seeds_of(keys), actions, report_pid=True)
    np.testing.assert_allclose(obs0[..., :3], ref0[..., :3], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(steps[0][..., :3], ref[0][..., :3], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(steps[1], ref[1], rtol=1e-5, atol=1e-5)
    # Distinct envs: different seeds give every member a different trajectory.
    assert len({tuple(np.round(obs0[m, 0, :2], 6)) for m in range(n)}) == n


@pytest.mark.timeout(120)
def test_member_spanning_two_devices_steps_its_envs_once():
    # 2 members on 4 devices: each member's state is on 2 devices, one of them steps the envs.
    n, e, T = 2, 2, 12
    host, mesh = bound(WALK_ID, n, e, devices=4)
    try:
        keys = jax.random.split(jax.random.key(5), (n, e))
        actions = actions_for(WALK_ID, T, n, e, seed=2)
        _, steps = run_host(host, mesh, keys, actions)
    finally:
        host.close()
    _, ref = reference(WALK_ID, seeds_of(keys), actions)
    np.testing.assert_allclose(steps[0], ref[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(steps[4], ref[4], rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(120)
def test_steps_slower_than_the_handler_waits_are_finished_by_python(step_path):
    # Steps of 0.3 s: the handler sends each and hands the wait to Python after 0.2 s; the
    # trajectory is the same as the plain loop's, and the group's timeout still applies.
    n, e, T, kw = 2, 2, 3, {"step_sleep": 0.3}
    host, mesh = bound(WALK_ID, n, e, devices=2, workers_per_device=1, **kw)
    try:
        keys = jax.random.split(jax.random.key(4), (n, e))
        actions = actions_for(WALK_ID, T, n, e, seed=3)
        obs0, steps = run_host(host, mesh, keys, actions)
        assert host.fast_steps == 0
    finally:
        host.close()
    ref0, ref = reference(WALK_ID, seeds_of(keys), actions, **kw)
    assert_same_trajectory(obs0, steps, ref0, ref)
    env = envs.make(f"gymnasium:{WALK_ID}", step_sleep=2.0, workers_per_device=1, timeout=0.5)
    mesh = ensemble.make_mesh(n, devices=jax.devices()[:2])
    host = env.bind(mesh, n, e)
    try:
        state, step = reset_then_compile(host, mesh, keys, actions[0])
        with pytest.raises(
            Exception, match=r"worker 0 \(pid \d+\) did not answer a step within 0.5 s"
        ):
            jax.block_until_ready(step(state, actions[0], keys))
    finally:
        host.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["slow", "stopped"])
def test_a_timeout_shorter_than_the_poll_holds_and_a_stuck_worker_is_not_awaited(how, step_path):
    # slow: steps of 0.18 s against a 0.1 s timeout (under the 0.2 s the handler and Python
    # otherwise wait between checks); stopped: a SIGSTOPped worker, which closing the group
    # must not wait for (it would ignore the request to exit). The timeout holds for the reset
    # too, which a loaded machine once took over 0.05 s to answer.
    timeout = 0.1 if how == "slow" else 0.3
    kw = {"step_sleep": 0.18} if how == "slow" else {}
    env = envs.make(f"gymnasium:{WALK_ID}", workers_per_device=1, timeout=timeout, **kw)
    mesh = ensemble.make_mesh(2, devices=jax.devices()[:2])
    host = env.bind(mesh, 2, 2)
    keys = jax.random.split(jax.random.key(0), (2, 2))
    action = jnp.zeros((2, 2), jnp.int32)
    try:
        state, step = reset_then_compile(host, mesh, keys, action)
        victim = host.groups[1].pids[0]
        if how == "stopped":
            os.kill(victim, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(Exception, match=rf"did not answer a step within {timeout:g} s"):
            jax.block_until_ready(step(state, action, keys))
        assert time.monotonic() - start < 4  # not the 5 s a close waits for a worker to exit
        assert not alive(victim)
    finally:
        host.close()


@pytest.mark.timeout(60)
def test_an_answer_just_past_the_timeout_is_an_error_on_either_path(step_path):
    # Steps 0.3 ms longer than the 0.1 s timeout: the handler once polled a millisecond past
    # its deadline and took such answers, where the Python step (the reference) refused them.
    env = envs.make(f"gymnasium:{WALK_ID}", workers_per_device=1, timeout=0.1,
                    step_sleep=0.1003)  # fmt: skip
    mesh = ensemble.make_mesh(1, devices=jax.devices()[:1])
    host = env.bind(mesh, 1, 1)
    keys = jax.random.split(jax.random.key(0), (1, 1))
    action = jnp.zeros((1, 1), jnp.int32)
    try:
        state, step = reset_then_compile(host, mesh, keys, action)
        with pytest.raises(Exception, match=r"did not answer a step within 0.1 s"):
            for _ in range(3):
                state = jax.block_until_ready(step(state, action, keys))[0]
        assert host.fast_steps == 0
    finally:
        host.close()


INTERRUPTED_LOCK = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    sys.path.insert(0, sys.argv[1])
    import jax
    import ensemble
    from rollout import envs
    from rollout.hostenv import _fast

    # As in a terminal's Python: pytest-xdist's workers ignore SIGINT, and this process would
    # inherit that (the signal below would never arrive).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    env = envs.make("gymnasium:hostenv_walk:Walk-v0", workers_per_device=1)
    mesh = ensemble.make_mesh(1, devices=jax.devices()[:1])
    host = env.bind(mesh, 1, 1)
    with jax.set_mesh(mesh):
        jax.block_until_ready(jax.jit(host.reset)(jax.random.split(jax.random.key(0), (1, 1))))
    control = host.groups[0].control
    lib = _fast.library()
    assert lib is not None, _fast.why_not()

    held, release = threading.Event(), threading.Event()

    def handler():  # holds the block as the compiled step does through a slow step
        lib.hostenv_lock(control._address)
        held.set()
        release.wait(30)
        lib.hostenv_unlock(control._address)

    thread = threading.Thread(target=handler)
    thread.start()
    held.wait(30)
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
    try:
        with control:
            print("took the lock")
    except KeyboardInterrupt:
        print("interrupted")
    release.set()
    thread.join()
    print("lock word", control[_fast.C_LOCK], "thread lock held", control._threads.locked())
    host.close()
    print("closed")
    """
)


@pytest.mark.timeout(120)
def test_ctrl_c_while_waiting_for_the_compiled_steps_lock_leaves_it_free(walk_module):
    # The wait was a call into the C library, which Ctrl-C cannot end: the KeyboardInterrupt
    # came just after it had taken the lock, and every later step and close() waited forever.
    done = subprocess.run([sys.executable, "-c", INTERRUPTED_LOCK, str(walk_module)],
                          capture_output=True, text=True, timeout=90, env=clean_env())  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.split("\n")
    assert lines[:3] == ["interrupted", "lock word 0 thread lock held False", "closed"], lines


@pytest.mark.timeout(60)
def test_the_step_counter_wraps_past_int32_without_an_error(step_path):
    # 2**31 steps is hours of a fast env: the device's int32 counter wraps, the group's does not.
    host, mesh = bound(WALK_ID, 2, 2, devices=2, workers_per_device=1)
    keys = jax.random.split(jax.random.key(3), (2, 2))
    actions = actions_for(WALK_ID, 3, 2, 2, seed=5)
    step = _step_fn(host, mesh)
    try:
        with jax.set_mesh(mesh):
            state, _ = jax.block_until_ready(jax.jit(host.reset)(keys))
        state = state._replace(t=jnp.full((2, 2), 2**31 - 1, jnp.int32))
        for group in host.groups:
            group.control[C_T] = 2**31 - 1
        got = []
        for t in range(3):
            state, obs, *_, info = step(state, jnp.asarray(actions[t]), keys)
            got.append(np.asarray(obs))
            assert not np.asarray(info["restarted"]).any()
        assert np.asarray(state.t).tolist() == [[-(2**31) + 2] * 2] * 2  # 2**31 + 2, wrapped
        assert host.fast_steps == (6 if step_path == "ffi" else 0)
    finally:
        host.close()
    _, ref = reference(WALK_ID, seeds_of(keys), actions)
    np.testing.assert_allclose(np.stack(got), ref[0], rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(60)
def test_a_step_sent_before_its_group_closed_restarts_the_envs():
    # close() from another thread does not wait for a program this thread dispatched: the
    # handler may have sent a step (PENDING) whose answers the close then threw away.
    from rollout.hostenv._host import _RESTART, _TRUNC

    host, mesh = bound(WALK_ID, 2, 2, devices=2, workers_per_device=1)
    keys = jax.random.split(jax.random.key(0), (2, 2))
    try:
        with jax.set_mesh(mesh):
            state, _ = jax.block_until_ready(jax.jit(host.reset)(keys))
        host.close()
        local = lambda x: np.asarray(x)[:1]  # group 0's member
        seeds = np.full((1, 2), 7, np.uint32)
        with pytest.warns(RuntimeWarning, match="restarting the envs from reset"):
            out = host._host_finish(np.int32(_fast.PENDING), np.int32(0), np.bool_(True),
                                    local(state.session), local(state.t), local(state.obs),
                                    np.zeros((1, 2), np.int32), seeds)  # fmt: skip
        assert (out[3] == _TRUNC | _RESTART).all() and host.groups[0].running
        np.testing.assert_array_equal(out[4], local(state.obs))  # the cut episodes' last obs
    finally:
        host.close()


# ---------------------------------------------------------------------- ordering, resume


def _step_fn(host, mesh):
    def step(state, action, keys):
        return host.step(state, action, keys)

    jitted = jax.jit(step)

    def call(*args):
        with jax.set_mesh(mesh):
            return jitted(*args)

    return call


@pytest.mark.timeout(120)
def test_replayed_step_is_an_error_and_restart_reseeds_reproducibly():
    host, mesh = bound(WALK_ID, 2, 2, devices=2)
    try:
        keys = jax.random.split(jax.random.key(0), (2, 2))
        with jax.set_mesh(mesh):
            state, _ = jax.jit(host.reset)(keys)
        step = _step_fn(host, mesh)
        action = jnp.ones((2, 2), jnp.int32)
        state1 = step(state, action, keys)[0]
        state2 = step(state1, action, keys)[0]
        with pytest.raises(Exception, match=r"step 1 arrived where step 2 was due"):
            jax.block_until_ready(step(state1, action, keys))  # state1 again: a duplicate
        # After close() (or in a resumed process) the envs restart: episodes cut, new seeds.
        restart_keys = jax.random.split(jax.random.key(9), (2, 2))
        results = []
        for i in range(2):  # the same saved state restarted twice: identical restarts
            host.close()
            if i == 0:
                # The callback runs when the program does: wait for it inside the block.
                with pytest.warns(RuntimeWarning, match="restarting the envs from reset"):
                    out = jax.block_until_ready(step(state2, action, restart_keys))
            else:
                out = jax.block_until_ready(step(state2, action, restart_keys))
            results.append(jax.tree.map(np.asarray, out))
        new_state, new_obs, reward, term, trunc, info = results[0]
        assert trunc.all() and not term.any() and (reward == 0).all() and info["restarted"].all()
        np.testing.assert_array_equal(info["final_obs"], np.asarray(state2.obs))
        np.testing.assert_array_equal(new_obs, results[1][1])
        ref0, _ = reference(WALK_ID, seeds_of(restart_keys), np.zeros((0, 2, 2), np.int32))
        np.testing.assert_allclose(new_obs, ref0, rtol=1e-6, atol=1e-6)
        assert (new_state.t == 3).all() and host.restarts == 4  # 2 groups x 2 restarts
        # The seeds derived beforehand (how the learner steps: once per rollout) restart alike.
        host.close()
        with jax.set_mesh(mesh):
            by_seeds = jax.jit(lambda s, a, z: host.step(s, a, seeds=z))
            out = jax.block_until_ready(by_seeds(state2, action, host.seeds(restart_keys)))
        np.testing.assert_array_equal(np.asarray(out[1]), new_obs)
        on = step(jax.tree.map(jnp.asarray, out[0]), action, keys)  # steps on normally
        assert not np.asarray(on[5]["restarted"]).any()
        with pytest.raises(TypeError, match="keys or seeds, exactly one"):
            host.step(state2, action)
        with pytest.raises(ValueError, match=r"seeds must be uint32 \[2, 2\]"):
            host.step(state2, action, seeds=jnp.zeros((2, 2), jnp.int32))
        with pytest.raises(ValueError, match=r"2 members x 2 envs take \[\.\.\., 2, 2\]"):
            host.seeds(jax.random.split(jax.random.key(0), (2, 3)))
    finally:
        host.close()


# ---------------------------------------------------------------------- faults


@pytest.mark.timeout(60)
def test_an_observation_of_the_wrong_shape_is_an_error_not_broadcast():
    host, mesh = bound(WALK_ID, 2, 2, devices=2, short_obs_at=3, workers_per_device=1)
    try:
        keys = jax.random.split(jax.random.key(0), (2, 2))
        with pytest.raises(Exception) as info:
            run_host(host, mesh, keys, jnp.ones((5, 2, 2), jnp.int32))
        want = "step returned an observation of shape (1,); the env's observation space has "
        assert want + "shape (4,)" in str(info.value)
    finally:
        host.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "odd, want",
    [
        ("old_reset", "reset returned a ndarray, not (observation, info)"),
        ("none", "step returned the reward None (NoneType); a reward is one real number"),
        ("text", "step returned the reward '1' (str)"),
        ("array", "step returned the reward array([1.]) (ndarray)"),
    ],
)
def test_a_reset_or_reward_off_the_gymnasium_api_is_an_error_not_converted(odd, want):
    """NumPy would turn a None reward into NaN and '1' into 1.0 without a word."""
    host, mesh = bound(WALK_ID, 2, 2, devices=2, odd=odd, workers_per_device=1)
    try:
        keys = jax.random.split(jax.random.key(0), (2, 2))
        with pytest.raises(Exception) as info:
            run_host(host, mesh, keys, jnp.ones((5, 2, 2), jnp.int32))
        assert want in str(info.value)
    finally:
        host.close()


@pytest.mark.timeout(60)
def test_actions_of_the_wrong_shape_are_refused_not_broadcast():
    # 2 envs per device, 2 numbers per action: [2, 2] actions would fill each env's action
    # with one number by broadcasting, a silently different policy.
    host, mesh = bound("hostenv_walk:WalkCont-v0", 2, 2, devices=2, workers_per_device=1)
    try:
        keys = jax.random.split(jax.random.key(0), (2, 2))
        with pytest.raises(ValueError, match=r"actions have shape \(2, 2\); 2 members x 2 envs "
                           r"take \(2, 2, 2\)"):  # fmt: skip
            run_host(host, mesh, keys, jnp.zeros((3, 2, 2), jnp.float32))
    finally:
        host.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ["gymnasium", "envpool"])
def test_an_action_outside_a_discrete_space_is_an_error(engine, step_path):
    # Walk-v0 (3 actions) does not check its actions, and EnvPool takes any integer.
    if engine == "envpool":
        pytest.importorskip("envpool")
        env = envs.make("envpool:CartPole-v1")
    else:
        env = envs.make(f"gymnasium:{WALK_ID}")
    mesh = ensemble.make_mesh(2, devices=jax.devices()[:2])
    host = env.bind(mesh, 2, 2)
    try:
        keys = jax.random.split(jax.random.key(0), (2, 2))
        n = env.action_space.n
        actions = jnp.zeros((3, 2, 2), jnp.int32).at[1, 1, 0].set(n)
        with pytest.raises(Exception) as info:
            run_host(host, mesh, keys, actions)
        want = f"action {n} of this worker's env 0 is outside the Discrete action space of {n} "
        assert want in str(info.value)
    finally:
        host.close()


@pytest.mark.timeout(60)
def test_float_actions_for_a_discrete_space_are_refused_not_truncated():
    host, mesh = bound(WALK_ID, 2, 2, devices=2)
    try:
        keys = jax.random.split(jax.random.key(0), (2, 2))
        with pytest.raises(TypeError, match=r"takes integer actions, not float32; cast them"):
            run_host(host, mesh, keys, jnp.full((3, 2, 2), 1.7, jnp.float32))
    finally:
        host.close()


@pytest.mark.timeout(60)
def test_pixel_values_outside_a_uint8_space_are_an_error_not_wrapped():
    host, mesh = bound(WALK_ID, 2, 2, devices=2, pixels=True, pixel_dtype="int64")
    try:
        keys = jax.random.split(jax.random.key(0), (2, 2))
        with pytest.raises(Exception) as info:
            run_host(host, mesh, keys, jnp.ones((3, 2, 2), jnp.int32))
        assert "reset returned observation values in [" in str(info.value)
        assert "observation space is uint8 (0-255), and they would wrap around" in str(info.value)
    finally:
        host.close()
    host, mesh = bound(WALK_ID, 2, 2, devices=2, pixels=True, pixel_dtype="float64")
    try:  # fractions would be cut off in training (and kept by evaluate)
        with pytest.raises(Exception, match=r"reset returned observation values with fractions"):
            run_host(host, mesh, keys, jnp.ones((3, 2, 2), jnp.int32))
    finally:
        host.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [1, 0])
def test_env_exception_names_env_worker_and_traceback(workers, step_path, monkeypatch):
    from rollout.hostenv import _worker

    closed = []  # in this process: the failed envs are closed, as a stopped worker's are
    close = _worker._Gymnasium.close
    monkeypatch.setattr(_worker._Gymnasium, "close", lambda self: closed.append(close(self)))
    host, mesh = bound(WALK_ID, 2, 2, devices=2, fail_at=3, workers_per_device=workers)
    try:
        keys = jax.random.split(jax.random.key(0), (2, 2))
        actions = jnp.zeros((5, 2, 2), jnp.int32)
        with pytest.raises(Exception) as info:
            run_host(host, mesh, keys, actions)
        text = str(info.value)
        assert "host env gymnasium:hostenv_walk:Walk-v0" in text
        where = "worker 0 (pid" if workers else f"in process {os.getpid()}"
        assert where in text and "raised ValueError: the walk fell over at step 3" in text
        assert "traceback ---" in text and "hostenv_walk.py" in text
        assert host.pids == []  # the failed groups stopped their workers
        assert len(closed) == (2 if workers == 0 else 0)  # each device's envs (no close() later)
    finally:
        host.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [1, 0])
def test_a_step_after_an_env_error_restarts_the_envs_and_says_why(workers, step_path):
    # The restart's warning said "resumed from a checkpoint, or stepped after close()"; envs
    # in this process (workers_per_device=0) never restarted: "stopped after an error".
    host, mesh = bound(WALK_ID, 1, 2, devices=1, fail_at=2, workers_per_device=workers)
    step = _step_fn(host, mesh)
    keys = jax.random.split(jax.random.key(0), (1, 2))
    action = jnp.zeros((1, 2), jnp.int32)
    try:
        with jax.set_mesh(mesh):
            state, _ = jax.block_until_ready(jax.jit(host.reset)(keys))
        good = jax.block_until_ready(step(state, action, keys))[0]
        with pytest.raises(Exception, match="the walk fell over at step 2"):
            jax.block_until_ready(step(good, action, keys))
        with pytest.warns(RuntimeWarning) as caught:
            jax.block_until_ready(step(good, action, keys))
        text = str(caught[0].message)
        want = "restarting the envs from reset (device group 0 (members 0) had stopped after an"
        assert want in text and "the walk fell over at step 2" in text, text
        assert caught[0].filename == __file__
    finally:
        host.close()


@pytest.mark.timeout(60)
def test_a_state_of_more_device_groups_restarts_the_envs_of_fewer(step_path):
    # A run resumed on fewer devices puts the members of two groups, with two sessions, in one
    # group: that was called an altered state ("mixed sessions") instead of a restart.
    keys = jax.random.split(jax.random.key(0), (2, 2))
    action = jnp.zeros((2, 2), jnp.int32)
    two, mesh = bound(WALK_ID, 2, 2, devices=2, workers_per_device=1)
    try:
        with jax.set_mesh(mesh):
            state, _ = jax.block_until_ready(jax.jit(two.reset)(keys))
        state = jax.device_get(_step_fn(two, mesh)(state, action, keys)[0])
    finally:
        two.close()
    assert len(set(np.asarray(state.session).ravel())) == 2
    one, mesh = bound(WALK_ID, 2, 2, devices=1, workers_per_device=1)
    try:
        with pytest.warns(RuntimeWarning, match="restarting the envs from reset"):
            state, _, _, _, trunc, info = _step_fn(one, mesh)(state, action, keys)
        assert np.asarray(info["restarted"]).all() and np.asarray(trunc).all()
        assert len(set(np.asarray(state.session).ravel())) == 1  # one live session again
        _step_fn(one, mesh)(state, action, keys)  # and it steps on
    finally:
        one.close()


@pytest.mark.timeout(90)
def test_a_retry_after_one_groups_error_restarts_the_groups_that_went_on(step_path):
    # Group 1's worker dies; group 0 made the step. A retry with the state from before it was
    # refused by group 0 as a replayed step ("step 1 arrived where step 2 was due"), forever.
    host, mesh = bound(WALK_ID, 2, 2, devices=2, workers_per_device=1)
    step = _step_fn(host, mesh)
    keys = jax.random.split(jax.random.key(0), (2, 2))
    action = jnp.zeros((2, 2), jnp.int32)
    try:
        with jax.set_mesh(mesh):
            state, _ = jax.block_until_ready(jax.jit(host.reset)(keys))
        state = jax.block_until_ready(step(state, action, keys))[0]
        victim = host.groups[1].pids[0]
        os.kill(victim, signal.SIGKILL)
        assert alive_after([victim], 10) == []
        with pytest.raises(Exception, match=r"device group 1 \(members 1\)"):
            jax.block_until_ready(step(state, action, keys))
        with pytest.warns(RuntimeWarning) as caught:
            state, *_, info = jax.block_until_ready(step(state, action, keys))
        assert np.asarray(info["restarted"]).all()
        texts = {str(w.message) for w in caught}
        assert texts and all("device group 1 (members 1) had stopped after an error" in t
                             for t in texts), texts  # fmt: skip
        state, *_, info = jax.block_until_ready(step(state, action, keys))  # and on it goes
        assert not np.asarray(info["restarted"]).any()
        # Another error, then a fresh reset rather than a retry: a replayed step of the new
        # session is refused again (group 0 was taken for behind for good, and restarted).
        os.kill(host.groups[1].pids[0], signal.SIGKILL)
        with pytest.raises(Exception, match=r"device group 1 \(members 1\)"):
            jax.block_until_ready(step(state, action, keys))
        with jax.set_mesh(mesh):
            state, _ = jax.block_until_ready(jax.jit(host.reset)(keys))
        first = jax.block_until_ready(step(state, action, keys))[0]
        jax.block_until_ready(step(first, action, keys))
        restarts = host.restarts
        with pytest.raises(Exception, match=r"step 1 arrived where step 2 was due"):
            jax.block_until_ready(step(first, action, keys))
        assert host.restarts == restarts  # neither group took the replay for a restart
    finally:
        host.close()


@pytest.mark.timeout(240)
def test_a_run_resumed_by_its_live_learner_restarts_its_envs(tmp_path):
    # The learner's envs had gone on past the checkpoint: the restored state's first step was
    # refused as a replayed step.
    from rollout.ppo import Learner, PPOConfig, train

    cfg = PPOConfig.for_env(f"gymnasium:{WALK_ID}", members=2, num_envs=2, num_steps=8,
                            num_minibatches=1, update_epochs=1, total_steps=64,
                            updates_per_call=1)  # fmt: skip
    learner = Learner(cfg, devices=jax.devices()[:2])

    class Stop(Exception):
        pass

    def stop_at_3(row):
        if row["update"] == 3:  # past the checkpoint of update 2
            raise Stop

    try:
        with pytest.raises(Stop):
            train(cfg, tmp_path / "run", learner=learner, progress=False, checkpoint_every=2,
                  on_update=stop_at_3)  # fmt: skip
        with pytest.warns(RuntimeWarning, match="restarting the envs from reset"):
            _, rows = train(cfg, tmp_path / "run", resume=True, learner=learner, progress=False)
        assert [r["update"] for r in rows] == [1, 2, 3, 4]
    finally:
        learner.close()


STUCK_STEP = textwrap.dedent(
    """
    import sys, threading, time
    sys.path.insert(0, sys.argv[1])
    import jax, jax.numpy as jnp
    import ensemble
    from rollout import envs

    env = envs.make("gymnasium:hostenv_walk:Walk-v0", step_sleep=100)
    mesh = ensemble.make_mesh(1, devices=jax.devices()[:1])
    host = env.bind(mesh, 1, 1)
    keys = jax.random.split(jax.random.key(0), (1, 1))
    step = jax.jit(lambda k: host.step(host.reset(k)[0], jnp.zeros((1, 1), jnp.int32), k)[1])

    def go():
        with jax.set_mesh(mesh):
            step(keys)

    threading.Thread(target=go, daemon=True).start()
    while not host.pids:
        time.sleep(0.1)
    time.sleep(3.0)  # the worker is in its 100 s step
    print(*host.pids, flush=True)
    time.sleep(100)
    """
)


@pytest.mark.timeout(120)
def test_a_worker_in_a_stuck_step_ends_soon_after_its_parent_is_sigkilled(walk_module):
    parent = subprocess.Popen([sys.executable, "-c", STUCK_STEP, str(walk_module)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              env=clean_env())  # fmt: skip
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 1 and alive(pids[0])
        parent.kill()
        parent.wait(10)
        assert not alive_after(pids, 5), "the orphaned worker still runs 5 s after its parent died"
    finally:
        parent.kill()


@pytest.mark.timeout(60)
def test_a_stopped_worker_is_an_error_not_a_hang(monkeypatch):
    """No timeout is set, but a SIGSTOPped worker never answers: after STOPPED_LIMIT_S
    (shortened here) the step fails naming it, instead of waiting forever."""
    import rollout.hostenv._group as group

    monkeypatch.setattr(group, "STOPPED_LIMIT_S", 1.5)
    host, mesh = bound(WALK_ID, 2, 2, devices=2, workers_per_device=1)
    victims: list[int] = []
    try:
        stopped = r"pid {}\) stayed stopped .* over 1.5 s"
        _signal_a_worker_then_step(host, mesh, signal.SIGSTOP, stopped, victims)
    finally:
        host.close()
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    assert not alive_after(victims, 5)


def _signal_a_worker_then_step(host, mesh, sig, error: str, victims: list[int]) -> None:
    """Resets, sends ``sig`` to a worker of device group 1 (noted in ``victims`` first, for the
    caller's cleanup), then a step must raise ``error`` (``{}``: the pid) within 20 s."""
    keys = jax.random.split(jax.random.key(0), (2, 2))
    with jax.set_mesh(mesh):
        state, _ = jax.block_until_ready(jax.jit(host.reset)(keys))
    victims.append(victim := host.groups[1].pids[0])
    os.kill(victim, sig)
    start = time.monotonic()
    with pytest.raises(Exception, match=error.format(victim)):
        step = _step_fn(host, mesh)
        jax.block_until_ready(step(state, jnp.zeros((2, 2), jnp.int32), keys))
    assert time.monotonic() - start < 20


@pytest.mark.timeout(60)
@pytest.mark.parametrize("child_holds_socket", [False, True])
def test_killed_worker_is_an_error_within_seconds(child_holds_socket, tmp_path, step_path):
    # child_holds_socket: a process forked by the env inherits the worker's socket, so the
    # worker's death closes nothing; the group must notice it by watching the process.
    pid_file = tmp_path / "child"
    extra = {"fork_child": str(pid_file)} if child_holds_socket else {}
    host, mesh = bound(WALK_ID, 2, 2, devices=2, workers_per_device=1, **extra)
    victims: list[int] = []
    try:
        killed = r"pid {}.*was killed by signal SIGKILL"
        _signal_a_worker_then_step(host, mesh, signal.SIGKILL, killed, victims)
        if child_holds_socket:
            assert all(alive(int(pid)) for pid in pid_file.read_text().split())
    finally:
        host.close()
        children = [int(p) for p in pid_file.read_text().split()] if pid_file.exists() else []
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert victims and not alive(victims[0])
    assert not alive_after(children, 5)  # SIGKILL is delivered, not awaited


def _interrupt_once(monkeypatch, host, where) -> Callable[[], None]:
    """Arms a KeyboardInterrupt (a Ctrl-C where the step runs in the main thread: one device)
    at ``where`` in a later step: in the wait for an answer ('recv'), once the answers are in
    but before the step is counted ('counter'), or after the compiled step handed the wait to
    Python but before Python took it ('handover'). Returns the function that arms it."""
    armed = [False]

    def once():
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt

    def arm():
        armed[0] = True
        if where == "recv":  # the workers start with the first reset
            wire = host.groups[0]._workers[0].wire
            monkeypatch.setattr(wire, "recv", lambda *a, real=wire.recv: once() or real(*a))

    if where == "counter":
        real = _fast.Control.__setitem__
        hook = lambda c, k, v: (once() if k == _fast.C_T else None) or real(c, k, v)
        monkeypatch.setattr(_fast.Control, "__setitem__", hook)
    elif where == "handover":  # before the step is traced: it calls the method it finds then
        real = type(host)._host_finish
        monkeypatch.setattr(type(host), "_host_finish", lambda s, *a: once() or real(s, *a))
    return arm


@pytest.mark.timeout(90)
@pytest.mark.parametrize("where", ["recv", "counter", "handover", "counter, in process"])
def test_an_interrupted_step_stops_its_group_and_a_retry_restarts_not_steps_twice(
    where, step_path, monkeypatch
):
    """An interrupt in a step left the group running: with an answer owed, every later step
    read the one before's; with the answers in but the step not counted, or the compiled
    step's wait never taken up, the retry stepped the envs twice or was refused (envs in
    this process: an AttributeError, then the double step). Each now stops the group, and
    the retry restarts its envs."""
    if where == "handover" and step_path == "python":
        pytest.skip("only the compiled step hands its wait over")
    workers = 0 if where.endswith("in process") else 1
    where = where.split(",")[0]
    n, e, T, kw = 1, 2, 4, {"step_sleep": 0.3}  # > the handler's 0.2 s: Python waits too
    host, mesh = bound(WALK_ID, n, e, devices=1, workers_per_device=workers, **kw)
    arm = _interrupt_once(monkeypatch, host, where)
    step = _step_fn(host, mesh)
    keys = jax.random.split(jax.random.key(5), (n, e))
    actions = jnp.asarray(actions_for(WALK_ID, T, n, e, seed=4))
    try:
        with jax.set_mesh(mesh):
            state, _ = jax.block_until_ready(jax.jit(host.reset)(keys))
        state = step(state, actions[0], keys)[0]
        group = host.groups[0]
        arm()
        with pytest.raises(BaseException, match="KeyboardInterrupt"):
            jax.block_until_ready(step(state, actions[1], keys))
        if where != "handover":  # (there, the next step finds the answers owed)
            assert not group.running and "KeyboardInterrupt" in group.failed
            if workers:  # its answer can reach no one
                assert all(w.proc.poll() is not None for w in group._workers)
        with pytest.warns(RuntimeWarning, match=r"restarting .*a step was (interrupted|cut)"):
            out = jax.tree.map(np.asarray, step(state, actions[1], keys))  # the retry
        assert out[5]["restarted"].all() and out[4].all()  # truncated: a new episode
        # From the restart on, the envs follow a fresh reset of the same seeds, step by step.
        got = []
        for action in actions[2:]:
            out = jax.tree.map(np.asarray, step(out[0], action, keys))
            got.append(out)
        _, ref = reference(WALK_ID, seeds_of(keys), np.asarray(actions[2:]))  # (no sleeps)
        np.testing.assert_allclose([g[1] for g in got], ref[0], rtol=1e-6)  # observations
        np.testing.assert_allclose([g[2] for g in got], ref[1], rtol=1e-6)  # rewards
    finally:
        host.close()


@pytest.mark.timeout(60)
def test_a_reset_after_a_step_python_never_took_up_starts_afresh(monkeypatch):
    """The workers still owed the handed-over step's answers: the reset read one as its own
    and failed ("answered request 2 where request 3 was due")."""
    host, mesh = bound(WALK_ID, 1, 2, devices=1, workers_per_device=1, step_sleep=0.3)
    arm = _interrupt_once(monkeypatch, host, "handover")
    step = _step_fn(host, mesh)
    keys = jax.random.split(jax.random.key(2), (1, 2))
    action = jnp.ones((1, 2), jnp.int32)
    try:
        with jax.set_mesh(mesh):
            reset = jax.jit(host.reset)
            state, _ = jax.block_until_ready(reset(keys))
        arm()
        with pytest.raises(BaseException, match="KeyboardInterrupt"):
            jax.block_until_ready(step(state, action, keys))
        with jax.set_mesh(mesh):
            _, obs = jax.block_until_ready(reset(keys))
        ref0, _ = reference(WALK_ID, seeds_of(keys), np.zeros((0, 1, 2), np.int32))
        np.testing.assert_allclose(np.asarray(obs), ref0, rtol=1e-6)
    finally:
        host.close()


@pytest.mark.timeout(60)
def test_an_answer_to_another_request_is_an_error_not_taken():
    from rollout.hostenv._group import HostEnvError, WorkerGroup
    from rollout.hostenv._worker import STEP

    group = WorkerGroup("gymnasium", WALK_ID, {}, [2], "t", (4,), np.float64, (), np.int32)
    group.start()
    try:
        group.reset(np.arange(2))  # request 0
        group._send(group._workers[0], STEP, 1)  # request 1, its answer never collected
        group.control[_fast.C_SEQ] = 2
        with pytest.raises(HostEnvError, match="answered request 1 where request 2 was due"):
            group.step(np.ones(2, np.int32))  # request 2 read request 1's answer as its own
        assert not group.running
    finally:
        group.close()


@pytest.mark.timeout(60)
def test_a_worker_refuses_a_request_out_of_sequence():
    from rollout.hostenv._group import HostEnvError, WorkerGroup
    from rollout.hostenv._worker import STEP

    group = WorkerGroup("gymnasium", WALK_ID, {}, [2], "t", (4,), np.float64, (), np.int32)
    group.start()
    try:
        group.reset(np.arange(2))
        group.step(np.ones(2, np.int32))  # requests 0 (reset) and 1
        w = group._workers[0]
        group._send(w, STEP, 1)  # request 1 again: a replay
        with pytest.raises(HostEnvError, match="request 1 arrived where request 2 was due"):
            group._collect(group._workers, 10.0, "step")
        assert not group.running  # the envs' state is unknown: the group stopped
    finally:
        group.close()


def _hand_made_worker(sock):
    """A group's worker whose answers this test writes by hand into ``sock``'s other end; the
    process is a stand-in that lives until killed."""
    from rollout.hostenv._group import _POLL_S, _Worker
    from rollout.hostenv._worker import Wire

    w = _Worker.__new__(_Worker)
    w.index, w.rows = 0, range(0, 2)
    w.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    w.wire = Wire(sock, timeout=_POLL_S)
    return w


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["stops", "dies"])
def test_an_answer_that_stops_part_way_is_an_error_within_the_timeout(how):
    import socket

    from rollout.hostenv._group import HostEnvError, WorkerGroup
    from rollout.hostenv._worker import _HEADER, OK

    group = WorkerGroup("gymnasium", WALK_ID, {}, [2], "t", (4,), np.float64, (), np.int32)
    ours, theirs = socket.socketpair()
    w = _hand_made_worker(ours)
    try:
        theirs.sendall(_HEADER.pack(OK, 1000, 3) + b"x" * 10)  # 10 of 1000 payload bytes
        if how == "dies":
            threading.Timer(0.5, w.proc.kill).start()
        start = time.monotonic()
        with pytest.raises(HostEnvError) as info:
            group._collect([w], 1.0 if how == "stops" else None, "reset")
        assert time.monotonic() - start < 5
        if how == "stops":
            assert str(info.value).endswith(
                f"worker 0 (pid {w.pid}) did not answer a reset within 1 s (worker 0 stopped "
                "part-way through its answer)"
            )
        else:
            assert f"(pid {w.pid}, envs 0-1 of the group) was killed by signal SIGKILL" in str(
                info.value
            )
    finally:
        w.proc.kill()
        w.proc.wait()
        theirs.close()
        ours.close()


@pytest.mark.timeout(60)
def test_a_dead_worker_is_an_error_before_its_slow_sibling_answers():
    from rollout.hostenv._group import HostEnvError, WorkerGroup

    group = WorkerGroup(
        "gymnasium", WALK_ID, {"step_sleep": 20.0}, [1, 1], "t", (4,), np.float64, (), np.int32
    )
    group.start()
    try:
        group.reset(np.arange(2))
        victim = group.pids[1]
        threading.Timer(0.5, os.kill, (victim, signal.SIGKILL)).start()
        start = time.monotonic()
        with pytest.raises(HostEnvError, match=rf"pid {victim}.*killed by signal SIGKILL"):
            group.step(np.ones(2, np.int32))  # worker 0 would answer after 20 s
        assert time.monotonic() - start < 10
    finally:
        group.close()


def test_make_kwargs_the_workers_cannot_receive_are_refused_by_name():
    from rollout.hostenv._group import WorkerGroup

    with pytest.raises(ValueError, match=r"make kwarg fail_at=<function .* cannot be sent to the"):
        envs.make(f"gymnasium:{WALK_ID}", fail_at=lambda: 99)
    envs.make(f"gymnasium:{WALK_ID}", fail_at=lambda: 99, workers_per_device=0)  # in-process
    # The group itself leaves nothing half-started if its kwargs cannot be sent.
    kwargs = {"fail_at": lambda: 99}
    group = WorkerGroup("gymnasium", WALK_ID, kwargs, [1, 1], "t", (4,), np.float64, (), np.int32)
    with pytest.raises(Exception, match="pickle"):
        group.start()
    assert not group.running and children() == []


REPLICA_LEADER_DIES = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, sys.argv[1])
    import jax, jax.numpy as jnp
    jax.config.update("jax_num_cpu_devices", 4)
    import ensemble
    from rollout import envs

    env = envs.make("gymnasium:hostenv_walk:Walk-v0", workers_per_device=1)
    mesh = ensemble.make_mesh(2, devices=jax.devices())  # each member on 2 devices
    host = env.bind(mesh, 2, 2)
    keys = jax.random.split(jax.random.key(0), (2, 2))

    def steps(state):  # several steps: the replicas go on to the next one's psum
        step = lambda s, a: (host.step(s, a, keys)[0], None)
        return jax.lax.scan(step, state, jnp.ones((4, 2, 2), jnp.int32))[0]

    with jax.set_mesh(mesh):
        state, _ = jax.jit(host.reset)(keys)
        state = jax.block_until_ready(jax.jit(steps)(state))
        os.kill(host.groups[1].pids[0], signal.SIGKILL)
        try:
            jax.block_until_ready(jax.jit(steps)(state))
        except Exception as e:
            print("raised:", "device group 1 (members 1)" in str(e), flush=True)
    host.close()
    print("alive", flush=True)
    """
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ffi", ["1", "0"])
def test_a_dead_worker_of_a_member_on_several_devices_is_an_error_not_an_abort(walk_module, ffi):
    # Only a member's first device steps its envs; a psum shares the results. Its error was
    # raised there at once, and the member's other device waited in that psum until XLA
    # aborted the whole process 40 s later ("Termination timeout ... exceeded"), no error named.
    env = clean_env(ROLLOUT_HOSTENV_FFI=ffi)
    done = subprocess.run([sys.executable, "-c", REPLICA_LEADER_DIES, str(walk_module)],
                          capture_output=True, text=True, timeout=100, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:2] == ["raised: True", "alive"], done.stdout


@pytest.mark.timeout(120)
def test_exit_with_a_rollout_still_running_lets_it_finish_then_closes(walk_module):
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(walk_module)!r})
        import jax, jax.numpy as jnp
        import ensemble
        from rollout import envs

        env = envs.make("gymnasium:{WALK_ID}", step_sleep=0.1)
        mesh = ensemble.make_mesh(2, devices=jax.devices()[:2])
        host = env.bind(mesh, 2, 1)
        keys = jax.random.split(jax.random.key(0), (2, 1))

        def rollout(keys):
            state, _ = host.reset(keys)
            step = lambda s, a: (host.step(s, a, keys)[0], None)
            return jax.lax.scan(step, state, jnp.ones((8, 2, 1), jnp.int32))[0].t

        with jax.set_mesh(mesh):
            jax.jit(rollout)(keys)  # dispatched; the interpreter exits while it runs
        print("exiting", flush=True)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], env=clean_env(), cwd=ROOT,
        capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout == "exiting\n", done.stderr
    assert "restarting the envs" not in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_wire_frames_messages_cut_anywhere_and_tells_timeout_from_close():
    import socket

    from rollout.hostenv._worker import _HEADER, OK, Wire

    ours, theirs = socket.socketpair()
    wire = Wire(ours, timeout=0.05)
    assert wire.recv() is None  # nothing began within the timeout
    payload = {"obs": np.arange(5.0), "text": "é" * 3}
    sender, capture = socket.socketpair()  # the bytes a send writes, written below in pieces
    Wire(sender).send(OK, 7, payload)
    sender.close()
    message = capture.makefile("rb").read()
    capture.close()
    assert _HEADER.unpack(message[: _HEADER.size])[:2] == (OK, len(message) - _HEADER.size)

    def dribble():
        for cut in (3, _HEADER.size + 2, len(message)):
            theirs.sendall(message[dribble.at : cut])
            dribble.at = cut
            time.sleep(0.12)  # longer than the timeout: the reader must wait for the rest

    dribble.at = 0
    writer = threading.Thread(target=dribble)
    writer.start()
    kind, seq, got = wire.recv()
    writer.join()
    assert (kind, seq, got["text"]) == (OK, 7, payload["text"])
    np.testing.assert_array_equal(got["obs"], payload["obs"])
    theirs.sendall(message[:5])
    theirs.close()
    with pytest.raises(EOFError, match="in the middle of a message"):
        wire.recv()
    with pytest.raises(EOFError, match="closed"):
        wire.recv()
    wire.close()


def test_env_kwargs_are_a_json_object_for_gymnasium_and_envpool_ids():
    from rollout.ppo import PPOConfig
    from rollout.ppo.evaluate import make_kwargs

    cfg = PPOConfig.for_env(f"gymnasium:{WALK_ID}", env_kwargs={"tuple_obs": True, "fail_at": 99})
    assert cfg.env_kwargs == '{"fail_at": 99, "tuple_obs": true}'  # canonical: one run identity
    assert cfg.make_kwargs() == {"fail_at": 99, "tuple_obs": True}
    meta = {"env": cfg.env, "config": cfg.to_dict()}
    assert make_kwargs(meta) == {"fail_at": 99, "tuple_obs": True}  # evaluate makes the same env
    assert make_kwargs({**meta, "env": "envpool:CartPole-v1"}) == cfg.make_kwargs()  # EnvPool too
    # evaluate runs pure-JAX ids as JAX envs, never as a gymnasium env of the same name.
    from rollout.ppo.evaluate import is_functional

    assert [is_functional(e) for e in ("CartPole-v1", "gymnax:CartPole-v1", "brax:ant")] == [
        True, True, True
    ]  # fmt: skip
    assert not any(is_functional(e) for e in ("gymnasium:CartPole-v1", "envpool:Ant-v4"))
    for text, match in [
        ("{nope", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
    ]:
        with pytest.raises(ValueError, match=match):
            PPOConfig.for_env(f"gymnasium:{WALK_ID}", env_kwargs=text).validate()
    with pytest.raises(ValueError, match=r"env_kwargs go to .* not to 'cartpole'"):
        PPOConfig.for_env("cartpole", env_kwargs={"a": 1}).validate()
    # The dataclass itself holds the JSON text; a dict there is refused with the two ways in.
    with pytest.raises(ValueError, match=r"JSON object string such as .*for_env also takes a dict"):
        PPOConfig(env=f"gymnasium:{WALK_ID}", env_kwargs={"fail_at": 9}).make_kwargs()


@pytest.mark.timeout(60)
def test_bad_ids_fail_with_one_clear_line(monkeypatch):
    with pytest.raises(ValueError, match=r"gymnasium cannot make 'NoSuchEnv-v0'"):
        envs.make("gymnasium:NoSuchEnv-v0")
    with pytest.raises(ValueError, match=r"gymnasium cannot make 'no_such_module:X-v0'"):
        envs.make("gymnasium:no_such_module:X-v0")
    with pytest.raises(ValueError, match=r"unknown env 'gymnasiun:CartPole-v1'"):
        envs.make("gymnasiun:CartPole-v1")
    # An env gymnasium moved to another package raises a plain ImportError (exit 1 from the CLI).
    with pytest.raises(ValueError, match=r"gymnasium cannot make 'Hopper-v2': .*gymnasium-robot"):
        envs.make("gymnasium:Hopper-v2")
    with pytest.raises(ValueError, match=r"has integer actions, which a Gaussian policy"):
        envs.make(f"gymnasium:{WALK_ID}", int_actions=True)
    with pytest.raises(ValueError, match=r"env.close\(\) raised RuntimeError: the walk would not"):
        envs.make(f"gymnasium:{WALK_ID}", close_raises=True)
    monkeypatch.setitem(sys.modules, "gymnasium", None)  # as if not installed
    with pytest.raises(ValueError, match=r"need the gymnasium package: pip install"):
        envs.make("gymnasium:CartPole-v1")


@pytest.mark.timeout(60)
def test_envpool_kwargs_the_layer_owns_or_envpool_rejects_are_one_line():
    pytest.importorskip("envpool")
    with pytest.raises(ValueError, match=r"may not set batch_size, seed: the learner makes"):
        envs.make("envpool:CartPole-v1", batch_size=2, seed=1)
    with pytest.raises(ValueError, match=r"may not set env_seed, gym_reset_return_info"):
        envs.make("envpool:CartPole-v1", gym_reset_return_info=False, env_seed=[1])
    with pytest.raises(ValueError, match=r"envpool cannot make 'CartPole-v1' .*TypeError") as e:
        envs.make("envpool:CartPole-v1", nope=1)
    assert "\n" not in str(e.value)
    # Only EnvPool's pool checks these, in a worker (num_threads=-1 aborts the process); a
    # limit of -5 made every episode one step long.
    for key, value, least in (("num_threads", -1, 0), ("thread_affinity_offset", -2, -1),
                              ("max_episode_steps", -5, 1), ("max_episode_steps", 0, 1),
                              ("max_episode_steps", "x", 1), ("num_threads", 2.0, 0),
                              ("max_episode_steps", 2**31, 1)):  # fmt: skip
        with pytest.raises(ValueError, match=rf"{key} must be an int in \[{least}, 2147483647\]"):
            envs.make("envpool:CartPole-v1", **{key: value})


_EXIT_SCRIPT = """
import os, signal, sys
import jax
jax.config.update("jax_num_cpu_devices", 2)
import ensemble
from rollout import envs
env = envs.make("gymnasium:CartPole-v1")
host = env.bind(ensemble.make_mesh(2), 2, 2)
with jax.set_mesh(host.mesh):
    jax.block_until_ready(jax.jit(host.reset)(jax.random.split(jax.random.key(0), (2, 2))))
print(" ".join(map(str, host.pids)), flush=True)
if sys.argv[1] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)  # no atexit: the workers must notice on their own
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["exit", "kill"])
def test_workers_stop_when_the_parent_exits_or_is_killed(how, tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(_EXIT_SCRIPT))
    proc = subprocess.run(
        [sys.executable, str(script), how],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 2, proc.stderr[-2000:]
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)


# ---------------------------------------------------------------------- learner and CLI


@pytest.mark.timeout(120)
def test_learner_with_make_kwargs_closes_its_workers():
    from rollout.ppo import Learner, PPOConfig

    cfg = PPOConfig.for_env(
        f"gymnasium:{WALK_ID}", members=2, total_steps=128, num_envs=2, num_steps=32
    )
    assert cfg.num_envs == 2 and cfg.learning_rate == 2.5e-4  # discrete: CleanRL's ppo.py
    env = envs.make(f"gymnasium:{WALK_ID}", report_pid=True)  # make kwargs via the Python API
    learner = Learner(cfg, devices=jax.devices()[:2], env=env)
    try:
        state = learner.init()
        state, metrics = learner.update(state, 2)
        pids = learner.envs.pids
        assert len(pids) == 2 and all(alive(p) for p in pids)
        obs = np.asarray(state.members.obs)
        assert {int(p) for p in obs[..., 3].ravel()} == set(pids)  # the kwarg reached the workers
        returns, episodes = np.asarray(metrics["returns"]), np.asarray(metrics["episodes"])
        assert episodes.sum() > 0
        assert np.isfinite(returns[episodes > 0]).all() and np.isnan(returns[episodes == 0]).all()
        # The step arrays' shared file is unlinked once the workers have mapped it.
        assert not _shared_files()
    finally:
        learner.close()
    assert learner.envs.pids == [] and not any(alive(p) for p in pids)
    assert not _shared_files()


@pytest.mark.timeout(180)
def test_a_terminated_episodes_last_observation_is_never_used():
    """NaN as the last observation of every terminated episode (an env that ends episodes whose
    state left its valid range) trains exactly like the same env without it: only a truncated
    episode's last observation is bootstrapped, and 0 * NaN must not reach the rewards."""
    from rollout.ppo import Learner, PPOConfig

    cfg = PPOConfig.for_env(
        "gymnasium:hostenv_walk:WalkCont-v0", members=2, total_steps=512, num_envs=2,
        num_steps=64, num_minibatches=2, update_epochs=2,
    )  # fmt: skip
    assert cfg.bootstrap_truncation
    results = []
    for nan_at_end in (False, True):
        env = envs.make("gymnasium:hostenv_walk:WalkCont-v0", nan_at_end=nan_at_end)
        learner = Learner(cfg, devices=jax.devices()[:2], env=env)
        try:
            state, metrics = learner.update(learner.init(), 4)
            results.append((state.members.params, np.asarray(metrics["episode_length"])))
        finally:
            learner.close()
    (plain, lengths), (with_nan, _) = results
    assert np.nanmin(lengths) < 12  # episodes that terminated before the time limit
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(with_nan)):
        assert np.isfinite(np.asarray(b)).all()
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_restart_is_not_an_env_step_in_the_episode_metrics():
    from rollout.ppo import Learner, PPOConfig

    # One step per update: the first after close() only restarts the envs (no env step).
    cfg = PPOConfig.for_env(
        f"gymnasium:{WALK_ID}", members=2, total_steps=8, num_envs=2, num_steps=1, num_minibatches=1
    )
    learner = Learner(cfg, devices=jax.devices()[:2])
    try:
        fresh = learner.init()  # episodes just reset: none has taken a step
        learner.close()
        with pytest.warns(RuntimeWarning, match="restarting the envs"):
            _, metrics = learner.update(fresh, 1)
            metrics = jax.tree.map(np.asarray, metrics)
        assert (metrics["episodes"] == 0).all() and np.isnan(metrics["returns"]).all()
        state, _ = learner.update(learner.init(), 1)  # one real step into the episodes
        learner.close()
        _, metrics = learner.update(state, 1)  # (the warning comes once per learner)
        metrics = jax.tree.map(np.asarray, metrics)
        # Each env's cut episode: 1 real step, not 2.
        assert (metrics["episodes"] == 2).all() and (metrics["episode_length"] == 1).all()
    finally:
        learner.close()


@pytest.mark.timeout(240)
def test_uint8_frames_stay_uint8_to_the_rollout_buffer_and_train_like_float_frames():
    """The same frames as uint8 or as float32: the learner keeps uint8 ones as they come
    (workers, carry, rollout buffer), so the compiled update holds at least 3 bytes less per
    pixel of its rollout; the network casts them, so both train to the same numbers."""
    from rollout.ppo import Learner, PPOConfig

    cfg = PPOConfig.for_env(
        f"gymnasium:{WALK_ID}", members=1, total_steps=128, num_envs=4, num_steps=16,
        env_kwargs={"pixels": True},
    )  # fmt: skip
    assert cfg.clip_coef == 0.1  # discrete actions on images: CleanRL's Atari defaults
    runs = {}
    for dtype in ("uint8", "float32"):
        env = envs.make(f"gymnasium:{WALK_ID}", pixels=True, pixel_dtype=dtype)
        learner = Learner(cfg, devices=jax.devices()[:1], env=env)
        try:
            assert learner.normalize_obs is False and learner.network.obs_scale == 1 / 255
            shapes = learner.state_shapes()
            assert shapes.members.obs.dtype == dtype
            like = jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                shapes, learner.state_shardings(),
            )  # fmt: skip
            state, metrics = learner.update(learner.init(), 2)
            # The program update(state, 2) just ran, lowered again for its memory analysis:
            # JAX hands back the executable it compiled (a host env's program is compiled
            # anew by every jit, not taken from the persistent cache).
            with jax.set_mesh(learner.mesh):
                compiled = learner._programs[2].lower(like, learner._run_length()).compile()
            runs[dtype] = (compiled.memory_analysis().temp_size_in_bytes,
                           jax.device_get((state.members.params, metrics)))  # fmt: skip
        finally:
            learner.close()
    (temp8, out8), (temp32, out32) = runs["uint8"], runs["float32"]
    chex.assert_trees_all_close(out8, out32, rtol=1e-5, atol=1e-6)
    assert np.asarray(out8[1]["episodes"]).sum() > 0
    # The rollout's frames and its final frames (for the truncation
    # bootstrap), num_steps x num_envs x 75 pixels each.
    rollout_pixels = cfg.num_steps * cfg.num_envs * 3 * 5 * 5
    assert temp32 - temp8 >= 2 * 3 * rollout_pixels, (temp32, temp8)


def _shared_files() -> list[str]:
    from rollout.hostenv._group import _shared_dir

    # This process's files only (the pid is in the name): other test processes may run at once.
    return glob.glob(os.path.join(_shared_dir(), f"rollout-hostenv-{os.getpid()}-*"))


@pytest.mark.timeout(300)
def test_cli_trains_a_gymnasium_id_and_resume_restarts_its_envs_reproducibly(tmp_path, walk_module):
    """The CLI trains a user's registered id with make kwargs. On resume, policy, optimizer and
    statistics come back from the checkpoint and the envs restart from seeds of the restored
    key, so resuming the same checkpoint twice gives the same rows."""
    env = clean_env(PYTHONPATH=os.pathsep.join([str(ROOT), str(walk_module)]))

    def cli(out, steps, *extra, kwargs='{"tuple_obs":true}', code=0):
        cmd = [
            sys.executable, "-m", "rollout.ppo", "--env", f"gymnasium:{WALK_ID}", "--members",
            "2", "--total-steps", str(steps), "--num-envs", "2", "--num-steps", "64", "--out",
            str(out), "--no-progress", "--env-kwargs", kwargs, *extra,
        ]  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == code, proc.stderr[-3000:]
        return proc.stderr

    def rows(out):
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    a, b = tmp_path / "a", tmp_path / "b"
    assert " envs_on=cpu-workers " in cli(a, 256).splitlines()[0]  # not --env-on's default
    config = json.loads((a / "run.json").read_text())["config"]
    assert config["env_kwargs"] == '{"tuple_obs": true}'  # one text: spacing is not identity
    first = rows(a)
    assert [r["env_steps"] for r in first] == [128, 256]
    assert all(len(r["returns"]) == 2 for r in first)
    assert any(v is not None for v in first[-1]["returns"])

    shutil.copytree(a, b)
    for out in (a, b):
        err = cli(out, 512, "--resume", kwargs='{ "tuple_obs" : true }')
        assert "restarting the envs from reset" in err, err[-2000:]
    assert [r["env_steps"] for r in rows(a)] == [128, 256, 384, 512]
    assert rows(a)[:2] == first and rows(a) == rows(b)

    # An env that raises: one line naming the env, the worker and the env's own exception
    # (not JAX's callback wrapper), and nothing more at exit.
    err = cli(tmp_path / "c", 256, kwargs='{"tuple_obs": true, "fail_at": 3}', code=1)
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("ensemble PPO:"), err[-3000:]
    assert re.fullmatch(
        rf"error: HostEnvError: host env gymnasium:{WALK_ID}, device group \d \(members \d\), "
        r"worker 0 \(pid \d+, envs 0-1 of the group\) raised ValueError: the walk fell over at "
        r"step 3 \(run again with --debug for the traceback\)",
        lines[1],
    ), lines[1]

    # Exported, the members play the user's module env in evaluate: gymnasium.make gets the id
    # without the 'gymnasium:' prefix (with it, 'gymnasium:hostenv_walk:Walk-v0' cannot parse).
    from rollout.ppo import evaluate, export

    paths = export.export_run(a, tmp_path / "export", devices=jax.devices()[:2])
    members = [export.read_member(p) for p in paths]
    assert members[0].meta["gymnasium_id"] == WALK_ID
    results = evaluate.evaluate(members, 2, 0)
    assert sorted(results) == ["ensemble", "member_0", "member_1"]
    assert all(len(r) == 2 and np.isfinite(r).all() for r in results.values())


@pytest.mark.timeout(60)
def test_cli_unknown_gymnasium_id_is_one_line_exit_2(tmp_path, capsys):
    cmd = [sys.executable, "-m", "rollout.ppo", "--env", "gymnasium:Nope-v9", "--no-progress"]
    proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=50)
    assert proc.returncode == 2
    assert "error: gymnasium cannot make 'Nope-v9'" in proc.stderr
    assert "Traceback" not in proc.stderr
    # Spaces the networks cannot take: the same, before JAX compiles anything.
    from rollout.ppo._cli import main

    out = tmp_path / "run"
    argv = ["--env", f"gymnasium:{WALK_ID}", "--env-kwargs", '{"grid": true}', "--out", str(out)]
    assert main([*argv, "--no-progress"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: gymnasium:{WALK_ID}: observations of shape (2, 2) are not supported: the PPO "
        "networks take vectors [D] (an MLP) or images [H, W, C] / [C, H, W] of at least 3x3 (a "
        "conv net); reshape them in the env."
    )
    argv = ["--env", f"gymnasium:{WALK_ID}", "--env-kwargs", '{"multi_actions": true}']
    assert main([*argv, "--out", str(out), "--no-progress"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: gymnasium:{WALK_ID}: action space MultiBinary(3) is not supported "
        "(observations: a Box, or for gymnasium ids any space gymnasium can flatten; actions: a "
        "Box, a Discrete or a MultiDiscrete)."
    )
    assert not out.exists()


@pytest.mark.timeout(120)
def test_evaluate_cuts_episodes_of_an_env_without_time_limit(capsys):
    from rollout.ppo import evaluate

    stay = lambda obs: jnp.ones(obs.shape[0], jnp.int32)  # action 1: no push; walls: no end
    name = "hostenv_walk:Corridor-v0"
    returns = evaluate.gymnasium_returns(stay, name, episodes=2, seed=0, max_steps=7)
    assert "2 of 2 episodes" in capsys.readouterr().err
    import gymnasium

    for e, got in enumerate(returns):  # the first 7 steps' rewards, stepped by hand
        env = gymnasium.make(name)
        env.reset(seed=e)
        want = sum(env.step(1)[1] for _ in range(7))
        np.testing.assert_allclose(got, want)
    # No --max-steps and no time limit of the env's own: the default cap, not a hang.
    returns = evaluate.gymnasium_returns(stay, name, episodes=1, seed=0)
    assert f"after {evaluate.DEFAULT_MAX_STEPS} steps" in capsys.readouterr().err
    # An env with a time limit ends there (12 steps), uncut and without a note.
    evaluate.gymnasium_returns(stay, WALK_ID, episodes=1, seed=0)
    assert capsys.readouterr().err == ""


@pytest.mark.timeout(120)
def test_evaluate_names_an_env_that_raises_or_that_it_cannot_make(tmp_path, capsys):
    """The env's own exception and an unimportable env module: one line each, exit 1 and 2,
    as in training; not a traceback."""
    from rollout.ppo import Learner, PPOConfig, evaluate
    from rollout.ppo.export import export_members

    stay = lambda obs: jnp.ones(obs.shape[0], jnp.int32)
    kw = {"fail_at": 30}  # the env's 30th step raises, in a later episode (at most 12 steps)
    fell = r"Walk-v0 raised ValueError at step \d+ of the episode of seed [2-9]: the walk fell " \
        r"over at step 30"  # fmt: skip
    with pytest.raises(evaluate.EnvFailed, match=f"^{fell}$"):
        evaluate.gymnasium_returns(stay, WALK_ID, episodes=4, seed=0, kwargs=kw)
    with pytest.raises(ValueError, match=r"^gymnasium cannot make 'no_such_module:Walk-v0': No "
                       r"module named 'no_such_module'"):  # fmt: skip
        evaluate.gymnasium_returns(stay, "no_such_module:Walk-v0", episodes=1, seed=0)
    cfg = PPOConfig.for_env(f"gymnasium:{WALK_ID}", members=2, num_envs=2, env_kwargs=kw)
    learner = Learner(cfg, devices=jax.devices()[:2])
    try:
        export_members(learner, learner.init(), tmp_path / "export")
    finally:
        learner.close()
    assert evaluate.main([str(tmp_path / "export"), "--episodes", "4"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.fullmatch(f"error: {fell}", err[0]), err


def test_evaluate_leaves_out_the_host_env_layers_own_kwargs():
    from rollout.ppo import PPOConfig, evaluate

    kw = '{"timeout": 30, "workers_per_device": 1, "continuous": true}'
    for env in (f"gymnasium:{WALK_ID}", "envpool:CartPole-v1", "gymnax:CartPole-v1"):
        config = PPOConfig.for_env(f"gymnasium:{WALK_ID}").to_dict()
        config["env"], config["env_kwargs"] = env, kw
        host = not env.startswith("gymnax:")  # a functional env's kwargs are all its own
        want = {"continuous": True} if host else json.loads(kw)
        assert evaluate.make_kwargs({"env": env, "config": config}) == want


# ---------------------------------------------------------------------- EnvPool


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "workers, kwargs, devices",
    [(None, {}, 2), (1, {}, 2), (4, {}, 1), (0, {}, 2), (0, {"num_threads": 3}, 2), (0, {}, 1)],
    ids=["default", "worker-process", "members-split-over-workers", "in-process",
         "in-process-3-threads", "in-process-one-device"],
)  # fmt: skip
def test_envpool_task_equals_envpool_called_directly(workers, kwargs, devices):
    """Whatever the devices and workers (4 workers for 6 envs hold rows 0-1, 2-3, 4, 5: members
    split across workers, one worker with the ends of both), the envs step as one pool of all
    of them seeded from the first env's key, in env order whatever order the threads finish."""
    envpool = pytest.importorskip("envpool")
    n, e, T = 2, 3, 40
    env = envs.make("envpool:CartPole-v1", workers_per_device=workers, **kwargs)
    mesh = ensemble.make_mesh(n, devices=jax.devices()[:devices])
    host = env.bind(mesh, n, e)
    keys = jax.random.split(jax.random.key(1), (n, e))
    actions = np.random.default_rng(0).integers(0, 2, (T, n, e)).astype(np.int32)
    try:
        obs0, steps = run_host(host, mesh, keys, actions)
        assert (host.pids == []) == (workers == 0)  # worker processes, or none
        assert (host.fast_steps == devices * T) == (workers != 0)  # the compiled step, or Python
    finally:
        host.close()
    seed = int(seeds_of(keys)[0, 0]) % (2**31 - n * e)  # EnvPool's seeds are int32
    pool = envpool.make("CartPole-v1", env_type="gymnasium", num_envs=n * e, seed=seed)
    flat = lambda x: np.asarray(x).reshape(n * e, *np.shape(x)[2:])
    o, _ = pool.reset()
    np.testing.assert_allclose(flat(obs0), o, rtol=1e-6)
    ids = np.arange(n * e, dtype=np.int32)
    for t in range(T):
        o, r, te, tr, _ = pool.step(flat(actions[t]), ids)
        np.testing.assert_allclose(flat(steps[4][t]), o, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(flat(steps[1][t]), r)
        done = np.flatnonzero(te | tr)
        if done.size:
            o = o.copy()
            o[done] = pool.reset(done.astype(np.int32))[0]
        np.testing.assert_allclose(flat(steps[0][t]), o, rtol=1e-5, atol=1e-6)
    pool.close()
    assert steps[2].any()  # episodes ended and were reset


def envpool_own_autoreset(task, seed, actions, **kwargs):
    """``actions`` [T, N] stepped by one EnvPool pool with EnvPool's own autoreset (the step
    after a done one resets that env, its action ignored), that reset step taken out: per step
    the observation after autoreset, reward, terminated, truncated, the final observation and
    (Atari) whether the game is over."""
    import envpool

    pool = envpool.make(task, env_type="gymnasium", num_envs=actions.shape[1], seed=seed, **kwargs)
    pool.reset()
    out = []
    for a in actions:
        final, reward, term, trunc, info = pool.step(a)
        obs, done = final.copy(), np.flatnonzero(term | trunc)
        if done.size:
            obs[done] = pool.step(a[done], done.astype(np.int32))[0]
        out.append((obs, reward, term, trunc, final, info.get("terminated", term | trunc)))
    pool.close()
    return [np.stack(x) for x in zip(*out)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 1], ids=["in-process", "compiled-step"])
def test_envpool_a_lost_life_goes_on_with_the_same_game(workers):
    """``episodic_life``: a lost life ends an episode and the next one is the same game with a
    life fewer, as in EnvPool's own stepping (resetting the env started a new game, so the agent
    only ever saw the first life). The step says which ends were lost lives (the game goes on),
    and under ``reward_clip`` gives the raw reward as ``info["score"]`` and trains on its sign."""
    pytest.importorskip("envpool")
    n, e, T = 2, 2, 240
    kw = dict(episodic_life=True, img_height=36, img_width=36)
    env = envs.make("envpool:Breakout-v5", workers_per_device=workers, reward_clip=True, **kw)
    mesh = ensemble.make_mesh(n, devices=jax.devices()[:2])
    host = env.bind(mesh, n, e)
    keys = jax.random.split(jax.random.key(3), (n, e))
    actions = (np.arange(T)[:, None, None] // 3 + np.arange(n * e).reshape(n, e)) % 4
    actions = actions.astype(np.int32)

    def rollout(keys, actions):
        def step(state, action):
            state, obs, reward, term, trunc, info = host.step(state, action, keys)
            extra = info["score"], info["episode_goes_on"]
            return state, (obs, reward, term, trunc, info["final_obs"], *extra)

        return jax.lax.scan(step, host.reset(keys)[0], actions)[1]

    try:
        with jax.set_mesh(mesh):
            steps = jax.tree.map(np.asarray, jax.jit(rollout)(keys, actions))
        assert (host.fast_steps == 2 * T) == (workers != 0)  # the compiled step, or Python
    finally:
        host.close()
    seed = int(seeds_of(keys)[0, 0]) % (2**31 - n * e)
    obs, raw, term, trunc, final, game_over = envpool_own_autoreset(
        "Breakout-v5", seed, actions.reshape(T, -1), **kw
    )
    flat = lambda x: np.asarray(x).reshape(T, n * e, *np.shape(x)[3:])
    goes_on = term & ~game_over & ~trunc
    assert goes_on.sum() >= 2 * n * e and raw.sum() > 0  # lives lost, played on; points scored
    want = (obs, np.sign(raw), term, trunc, final, raw, goes_on)
    for got, expected in zip(steps, want, strict=True):
        np.testing.assert_array_equal(flat(got), expected)


@pytest.mark.timeout(120)
def test_envpool_an_episode_that_ends_on_its_time_limit_is_terminated_and_truncated():
    """EnvPool reports a terminal state reached on the time limit as truncated only, and the
    learner would bootstrap it; gymnasium's TimeLimit reports both, and so does this layer."""
    pytest.importorskip("envpool")
    n, e, T, limit = 2, 8, 12, 10
    env = envs.make("envpool:CartPole-v1", workers_per_device=0, max_episode_steps=limit)
    mesh = ensemble.make_mesh(n, devices=jax.devices()[:2])
    host = env.bind(mesh, n, e)
    actions = np.ones((T, n, e), np.int32)  # push right: the pole falls near step 10
    try:
        _, (_, _, term, trunc, final) = run_host(
            host, mesh, jax.random.split(jax.random.key(0), (n, e)), actions
        )
    finally:
        host.close()
    x, theta = final[..., 0], final[..., 2]
    fallen = (np.abs(x) > 2.4) | (np.abs(theta) > 12 * 2 * np.pi / 360)  # CartPole-v1's terminal
    np.testing.assert_array_equal(term, fallen)
    np.testing.assert_array_equal(trunc[limit - 1], ~term[: limit - 1].any(0))  # no earlier end
    at_limit = term[limit - 1] & trunc[limit - 1]
    assert at_limit.any() and (trunc[limit - 1] & ~term[limit - 1]).any()  # both kinds occur
    # The families whose limit only truncates; MuJoCo's family is 'envpool.mujoco.gym'.
    from rollout.hostenv._worker import _EnvPool

    for task in ("Hopper-v4", "HalfCheetah-v5", "Pong-v5", "LunarLander-v2", "Pendulum-v1"):
        assert _EnvPool(task, {"max_episode_steps": 50}, 1).limit == 50, task
    # EnvPool's own "no limit" (2**31 - 1, an int32): the pool's one step more stays an int32
    # (2**31 failed in the worker's first reset, mid-run).
    unlimited = _EnvPool("CartPole-v1", {"max_episode_steps": 2**31 - 1}, 2)
    try:
        assert unlimited.reset(np.array([3, 4])).shape == (2, 4)
    finally:
        unlimited.close()
    # ViZDoom has episodic_life but no game-over key: its episodes stay EnvPool's own.
    assert not _EnvPool("D1Basic-v1", {"episodic_life": True}, 1).lives


@pytest.mark.timeout(120)
def test_without_a_compiler_the_steps_go_through_python_with_one_warning(tmp_path):
    # A fresh process (the handler is built once per process) whose compiler does not exist and
    # whose cache is empty: one RuntimeWarning names why, and the steps still come out right.
    script = textwrap.dedent("""
        import warnings
        import jax, numpy as np
        import ensemble
        from rollout import envs
        env = envs.make("gymnasium:CartPole-v1", workers_per_device=1)
        mesh = ensemble.make_mesh(2, devices=jax.devices()[:2])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            host = env.bind(mesh, 2, 2)
        print([str(w.message) for w in caught if w.category is RuntimeWarning])
        keys = jax.random.split(jax.random.key(0), (2, 2))
        with jax.set_mesh(mesh):
            state, obs = jax.jit(host.reset)(keys)
            out = jax.jit(host.step)(state, jax.numpy.ones((2, 2), "int32"), keys)
        print("steps", host.fast_steps, np.asarray(out[2]).tolist())
        host.close()
    """)
    env = clean_env(
        CXX=str(tmp_path / "no-such-compiler"),
        XDG_CACHE_HOME=str(tmp_path),
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
    )
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=100, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert "every step goes through Python" in lines[0] and "no-such-compiler" in lines[0]
    assert lines[0].count("every step goes through Python") == 1
    assert lines[1] == "steps 0 [[1.0, 1.0], [1.0, 1.0]]"


@pytest.mark.timeout(120)
def test_a_compiler_given_with_a_launcher_and_flags_builds_the_step(tmp_path):
    # $CXX as build systems set it ("ccache g++ -m64"): a command line, not one program.
    compiler = shutil.which(os.environ.get("CXX") or "c++") or shutil.which("c++")
    script = textwrap.dedent("""
        from rollout.hostenv import _fast
        print(_fast.why_not())
    """)
    env = clean_env(CXX=f"env {compiler} -DHOSTENV_TEST_FLAG=1", XDG_CACHE_HOME=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=100, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "None"
    (built,) = (tmp_path / "sharded-ensembles").glob("hostenv-*.so")
    assert built.stat().st_mode & 0o555 == 0o555  # others sharing the cache load it too


@pytest.mark.timeout(120)
def test_a_cache_that_cannot_be_written_is_named_in_the_advice_not_the_compiler(tmp_path):
    # The warning said "install a C++ compiler" whatever stopped the build.
    (tmp_path / "a-file").write_text("")
    script = "from rollout.hostenv import _fast; print(_fast.why_not()); print(_fast.how_to_fix())"
    env = clean_env(XDG_CACHE_HOME=str(tmp_path / "a-file"))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=100, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    why, fix = done.stdout.splitlines()
    assert "a-file" in why
    assert fix.startswith("set $XDG_CACHE_HOME to a folder this user can write and read (not ")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("why", ["slots-run-out", "too-many-workers"])
def test_where_the_compiled_step_cannot_serve_python_steps_with_a_warning(why, monkeypatch):
    if why == "slots-run-out":
        monkeypatch.setattr(_fast, "_next_slot", [_fast.SLOTS - 1])  # one slot left, two groups
        workers, says = 1, "has bound the 65536 device groups it can serve"
    else:
        monkeypatch.setattr(_fast, "MAX_WORKERS", 1)
        workers, says = 2, "2 workers per device; it serves at most 1"
    assert _fast.library() is not None, _fast.why_not()
    with pytest.warns(RuntimeWarning, match=says):
        host, mesh = bound(WALK_ID, 2, 2, devices=2, workers_per_device=workers)
    try:
        keys = jax.random.split(jax.random.key(2), (2, 2))
        actions = actions_for(WALK_ID, 5, 2, 2)
        _, steps = run_host(host, mesh, keys, actions)
        assert host.fast_steps == 0
    finally:
        host.close()
    _, ref = reference(WALK_ID, seeds_of(keys), actions)
    np.testing.assert_allclose(steps[0], ref[0], rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(120)
def test_a_mesh_with_explicit_axes_takes_unplaced_keys():
    """jax.make_mesh's axes are Explicit, and the docstrings' meshes come from it: the reset's
    shard_map refused keys not already on the member axis with JAX's bare in_specs error."""
    mesh = jax.make_mesh((4,), ("ensemble",), devices=jax.devices()[:4])
    assert mesh.axis_types == (jax.sharding.AxisType.Explicit,)
    host = envs.make(f"gymnasium:{WALK_ID}", workers_per_device=0).bind(mesh, 4, 2)
    try:
        _, obs = jax.jit(host.reset)(jax.random.split(jax.random.key(1), (4, 2)))
        assert obs.shape[:2] == (4, 2)
    finally:
        host.close()
