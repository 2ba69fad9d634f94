"""Host-env throughput: ensemble PPO on gymnasium / EnvPool envs, the envs alone, a CleanRL loop.

For each env id and each E in ``--num-envs``, n members with E envs each (n*E env instances), on
this machine's cores:

- ``ppo``: env steps/s of the learner, all members together, the rollout stepping the envs in
  the host-env worker processes from inside one jitted call. ``ppo-rollout``: the learner's
  rollout alone (the same jitted rollout code as ``Learner.update``: policy, sampling, env
  steps, observation and reward statistics), no gradient steps: what the env layer delivers.
  ``ppo-full``: whole ``Learner.update`` calls (CleanRL's 10 epochs x 32 minibatches for
  continuous actions, 4 x 4 for discrete), whose gradient steps share the same CPU cores here.
  Both place the envs where ``rollout.envs.make`` puts them by default: in worker processes,
  stepped by the compiled host-env step. ``ppo-other-place``: as ``ppo-rollout`` with the envs
  in this process instead (``workers_per_device=0``; EnvPool pools on cores / devices C++
  threads per device).
- ``env-layer``: the learner's own host envs (same devices, placement and callback) stepped in
  one jitted scan with actions drawn before the clock starts: no policy, no statistics. What
  every jitted rollout pays per step for the callback and the env layer; ``ppo-rollout`` below
  it is the learner's own share.
- ``alone``: the same n*E env instances stepped with random actions (drawn before the clock
  starts) by plain loops, one process per core (same-step autoreset; an EnvPool pool of one
  thread per core): what the envs cost with no learner at all, the env-bound limit.
- ``cleanrl``: a CleanRL-style rollout: ``gymnasium.vector.SyncVectorEnv`` (or one EnvPool pool)
  over the n*E envs in this process, one jitted policy call per step from Python (the same
  actor-critic, vmapped over the n members); rollout only, no learning.
- Every mode is timed ``--repeats`` times in interleaved rounds (shuffled order per round);
  the table shows medians. A sample is ``--calls`` rollouts or updates, more where that would be
  under ``--sample-steps`` env steps (4 envs per member take 25 calls of 4,096 steps: a
  fraction of a second per sample would be as much scheduling noise as measurement). One
  sample on a shared 2-core machine varies by 20-30%.
- Where the time goes (a second table): the learner process's CPU per host step (all its
  threads; medians) for the PPO modes and the layer, and the share of the machine's cores idle
  while each mode ran. On a machine whose cores step the envs, the learner's CPU is taken from
  them; idle cores would instead mean the envs wait for the learner.
- Ratios (of the medians): ``layer/alone`` (the env layer's ceiling for any rollout),
  ``rollout/alone`` and ``full/alone`` (goal >= 0.8),
  ``rollout/cleanrl`` (goal >= 2; both rollouts without learning). The CleanRL loop steps its
  envs on one core, so on C cores
  ``rollout/cleanrl`` cannot exceed about ``alone / cleanrl`` (C times one core's env rate over
  the loop's): near 2 on this 2-core machine, reached only where the loop's own per-step cost
  is large next to the envs'.

Not a test: it times things, on whatever else runs on the machine (the JSON records the load).
Run it on a quiet machine::

    python benchmarks/envs.py          # HalfCheetah-v5 (gymnasium, EnvPool), CartPole-v1; 4x4/16/64
    python benchmarks/envs.py --envs gymnasium:Hopper-v5 --members 2 --num-envs 4

Writes ``benchmarks/results/envs.json``, ``envs.txt`` and ``envs.png`` (``--out NAME``: NAME.*).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _actions(space, steps: int, num_envs: int, seed: int):
    """Random actions for every step, drawn up front (so the timed loop is the envs alone)."""
    import gymnasium
    import numpy as np

    rng = np.random.default_rng(seed)
    if isinstance(space, gymnasium.spaces.Discrete):
        return rng.integers(0, int(space.n), (steps, num_envs))
    low, high = np.broadcast_to(space.low, space.shape), np.broadcast_to(space.high, space.shape)
    return rng.uniform(low, high, (steps, num_envs, *space.shape)).astype(np.float32)


def _alone_worker(name: str, num_envs: int, steps: int, seed: int) -> tuple[int, float]:
    """One core's share of the envs, random actions, same-step autoreset: (env steps, seconds)."""
    backend, _, env_id = name.partition(":")
    if backend == "envpool":  # one pool, its own single C++ thread, stepped synchronously
        import envpool

        pool = envpool.make(env_id, env_type="gymnasium", num_envs=num_envs, num_threads=1,
                            seed=seed)  # fmt: skip
        actions = _actions(pool.action_space, steps, num_envs, seed)
        pool.reset()
        start = time.perf_counter()
        for a in actions:
            pool.step(a)  # EnvPool resets finished envs itself
        return steps * num_envs, time.perf_counter() - start
    import gymnasium

    envs = [gymnasium.make(env_id) for _ in range(num_envs)]
    for i, env in enumerate(envs):
        env.reset(seed=seed + i)
    actions = _actions(envs[0].action_space, steps, num_envs, seed)
    discrete = isinstance(envs[0].action_space, gymnasium.spaces.Discrete)
    start = time.perf_counter()
    for row in actions:
        for env, a in zip(envs, row):
            _, _, term, trunc, _ = env.step(int(a) if discrete else a)
            if term or trunc:
                env.reset()
    return steps * num_envs, time.perf_counter() - start


def alone(name: str, total_envs: int, steps: int, cores: int) -> float:
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    import numpy as np

    counts = [len(c) for c in np.array_split(np.arange(total_envs), min(cores, total_envs))]
    with ProcessPoolExecutor(len(counts), mp_context=mp.get_context("spawn")) as pool:
        futures = [
            pool.submit(_alone_worker, name, c, steps, 100 * i) for i, c in enumerate(counts)
        ]
        results = [f.result() for f in futures]
    return sum(s for s, _ in results) / max(t for _, t in results)


def ppo(name: str, workers=None, *, members, num_envs, num_steps, calls, mode="update", **over):
    """A timer: each call runs ``calls`` compiled programs and returns env steps/s; and a closer.

    ``mode``: ``'update'``, whole ``Learner.update`` calls; ``'rollout'``, the learner's rollout
    alone (the same jitted rollout code as in ``update``: policy, env steps, statistics), no GAE
    and no gradient steps; ``'layer'``, the learner's envs alone (see ``_layer_program``).
    """
    import jax
    from accelerator_check import whole_members  # a script beside this one

    from rollout import envs
    from rollout.ppo import Learner, PPOConfig

    cfg = PPOConfig.for_env(
        name, members=members, num_envs=num_envs, num_steps=num_steps, total_steps=10**8, **over
    )
    env = envs.make(name, workers_per_device=workers)
    learner = Learner(
        cfg, devices=jax.devices()[: whole_members(members, len(jax.devices()))], env=env
    )
    programs = {"rollout": _rollout_program, "layer": _layer_program}
    run = (lambda state: learner.update(state, 1)) if mode == "update" else programs[mode](learner)
    box = {}
    try:
        box["state"], out = run(learner.init())  # compile
        jax.block_until_ready(out)
    except BaseException:
        learner.close()
        raise

    def timed() -> float:
        cpu, start = _process_cpu(), time.perf_counter()
        for _ in range(calls):
            box["state"], out = run(box["state"])
        jax.block_until_ready(out)
        seconds = time.perf_counter() - start
        timed.cpu_us_per_step.append((_process_cpu() - cpu) / (calls * num_steps) * 1e6)
        return calls * cfg.batch_size * members / seconds

    timed.cpu_us_per_step = []  # the learner process's CPU per host step, per sample
    return timed, learner.close


def _process_cpu() -> float:
    """CPU seconds of this process, all its threads (the learner, XLA, the env callbacks)."""
    import resource

    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def _machine_ticks() -> tuple[int, int]:
    """(all, idle) CPU ticks of the machine since boot (Linux), or (0, 0) elsewhere."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return 0, 0
    return sum(ticks), ticks[3] + ticks[4]  # idle + iowait


def _rollout_program(learner):
    """``state -> (state, checksum)``: one rollout of every member, no learning; the state
    advances (envs, observation statistics, keys) so the next call goes on from it."""
    import jax
    import jax.numpy as jnp

    def rollout(state):
        carry, traj = learner._rollout(state.members)
        ms = learner._after_rollout(state.members, carry)
        # A sum over every trajectory leaf, so none of the rollout's work can be dropped.
        checksum = sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(traj))
        return state.replace(members=ms), checksum

    shardings = learner.state_shardings()
    program = jax.jit(rollout, in_shardings=(shardings,), out_shardings=(shardings, None),
                      donate_argnums=0)  # fmt: skip

    def run(state):
        with jax.set_mesh(learner.mesh):
            return program(state)

    return run


def _layer_program(learner):
    """``state -> (state, checksum)``: the learner's own envs (same devices, placement and
    callback) stepped for one rollout's length with actions drawn once, here; no policy, no
    statistics. Only the envs' state advances."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from rollout.envs import Discrete

    cfg, host, space = learner.config, learner.envs, learner.env.action_space
    n, e = cfg.members, cfg.num_envs
    rng, shape = np.random.default_rng(0), (cfg.num_steps, n, e)
    if isinstance(space, Discrete):
        actions = rng.integers(0, space.num_actions, shape, dtype=np.int32)
    else:
        low = np.asarray(space.low, np.float32).reshape(space.shape)
        high = np.asarray(space.high, np.float32).reshape(space.shape)
        actions = rng.uniform(low, high, (*shape, *space.shape)).astype(np.float32)
    actions = jax.device_put(actions, NamedSharding(learner.mesh, P(None, "ensemble")))

    def layer(state, actions):
        # Seeds are read only if the envs must restart, which they do not here; derived once,
        # before the loop, as the learner's rollout does.
        seeds = host.seeds(jax.random.split(jax.random.key(0), (n, e)))

        def one(env_state, action):
            env_state, obs, reward, *_ = host.step(env_state, action, seeds=seeds)
            # Per member: a sum over members would be a collective across devices every step.
            return env_state, reward.sum(axis=1) + obs.reshape(n, -1).sum(axis=1)

        env_state, checks = jax.lax.scan(one, state.members.env_state, actions)
        members = state.members.replace(env_state=env_state)
        return state.replace(members=members), checks.sum()

    program = jax.jit(layer, donate_argnums=0)

    def run(state):
        with jax.set_mesh(learner.mesh):
            return program(state, actions)

    return run


def _vector_env(name: str, count: int):
    """CleanRL's vector env: gymnasium's SyncVectorEnv, or one EnvPool pool (CleanRL's EnvPool
    scripts), in this process."""
    import gymnasium

    backend, _, env_id = name.partition(":")
    if backend == "envpool":
        import envpool

        return envpool.make(env_id, env_type="gymnasium", num_envs=count, num_threads=1, seed=0)
    return gymnasium.vector.SyncVectorEnv(
        [lambda: gymnasium.make(env_id) for _ in range(count)],
        autoreset_mode=gymnasium.vector.AutoresetMode.SAME_STEP,
    )


def cleanrl(name: str, members: int, num_envs: int, steps: int):
    """A timer of the CleanRL-style rollout (env steps/s per call), and a closer."""
    import gymnasium
    import jax
    import jax.numpy as jnp
    import numpy as np

    from rollout.ppo import ActorCritic
    from rollout.ppo import _networks as nets

    n, e = members, num_envs
    vec = _vector_env(name, n * e)
    space = vec.single_action_space if hasattr(vec, "single_action_space") else vec.action_space
    discrete = isinstance(space, gymnasium.spaces.Discrete)
    dim = space.n if discrete else space.shape[0]
    obs_space = getattr(vec, "single_observation_space", vec.observation_space)
    obs_dim = obs_space.shape[-1]
    net = ActorCritic(action_dim=dim, discrete=discrete)
    keys = jax.random.split(jax.random.key(0), n)
    params = jax.vmap(net.init, in_axes=(0, None))(keys, jnp.zeros((1, obs_dim)))

    @jax.jit
    def policy(params, obs, key):  # one call per step: every member's actions for its envs
        def one(p, o, k):
            pi, value = net.apply(p, o)
            return nets.sample(pi, nets.noise(k, (e,), discrete, dim), discrete), value

        return jax.vmap(one)(params, obs.reshape(n, e, -1), jax.random.split(key, n))

    obs, _ = vec.reset(seed=0) if not name.startswith("envpool:") else vec.reset()
    key = jax.random.key(1)

    def run(k):
        nonlocal obs, key
        for _ in range(k):
            key, sub = jax.random.split(key)
            action, _ = policy(params, jnp.asarray(obs, jnp.float32), sub)
            action = np.asarray(action).reshape(n * e, *np.shape(action)[2:])
            obs, *_ = vec.step(action if discrete else np.clip(action, -1, 1))

    run(5)  # compile

    def timed() -> float:
        start = time.perf_counter()
        run(steps)
        return steps * n * e / (time.perf_counter() - start)

    return timed, vec.close


def _strict_json(obj: Any, indent: int | None = None) -> str:
    """JSON that strict parsers read: an idle fraction the machine cannot give (NaN) is null."""
    strict = json.loads(json.dumps(obj), parse_constant=lambda _: None)
    return json.dumps(strict, indent=indent, allow_nan=False)


def main() -> None:
    from rollout.ppo._parser import OneLineParser, file_name, positive_int

    p = OneLineParser()
    p.add_argument(
        "--envs",
        nargs="+",
        default=["gymnasium:HalfCheetah-v5", "envpool:HalfCheetah-v5", "gymnasium:CartPole-v1"],
    )
    p.add_argument("--members", type=positive_int, default=4)
    p.add_argument(
        "--num-envs", type=positive_int, nargs="+", default=[4, 16, 64], help="envs per member"
    )
    p.add_argument("--num-steps", type=positive_int, default=256, help="rollout length per update")
    p.add_argument(
        "--calls", type=positive_int, default=3, help="timed PPO updates per sample (at least)"
    )
    p.add_argument(
        "--sample-steps",
        type=positive_int,
        default=100_000,
        help="env steps of all members per sample (at least): small settings take more calls, "
        "so no sample is a fraction of a second",
    )
    p.add_argument(
        "--repeats", type=positive_int, default=3, help="interleaved rounds (medians reported)"
    )
    p.add_argument(
        "--out", type=file_name, default="envs", help="results' file name under benchmarks/results"
    )
    args = p.parse_args()
    p.results_dir(RESULTS)
    _check_settings(p, args)
    cores = len(os.sched_getaffinity(0))
    import rollout

    rollout.configure_cpu_devices(cores)
    rows = []
    for name in args.envs:
        for e in args.num_envs:
            per_call = args.members * e * args.num_steps
            calls = max(args.calls, math.ceil(args.sample_steps / per_call))
            rows.append(measure(name, args.members, e, args.num_steps, calls, cores, args.repeats))
            print(_strict_json(rows[-1]), flush=True)
    report(rows, args)


def _check_settings(p, args: argparse.Namespace) -> None:
    """Refuses, in one line, an env or a setting the PPO modes cannot run (before any timing):
    builds one env of each to read its action space, compiles nothing."""
    import dataclasses

    from rollout.envs import HOST_PREFIXES
    from rollout.ppo import PPOConfig

    for name in args.envs:
        if not name.startswith(HOST_PREFIXES):
            p.error(f"--envs {name}: expected gymnasium:<id> or envpool:<task> (host envs)")
        try:
            cfg = PPOConfig.for_env(name, members=args.members, num_steps=args.num_steps,
                                    total_steps=10**8)  # fmt: skip
            for e in args.num_envs:
                dataclasses.replace(cfg, num_envs=e).validate()
        except ValueError as e:
            p.error(f"--envs {name}: {str(e).splitlines()[0]}")


def measure(name: str, n: int, e: int, num_steps: int, calls: int, cores: int, repeats: int):
    """Every mode for one env and envs-per-member setting, in ``repeats`` interleaved rounds.

    Every round times every mode once, in a shuffled order, so load that drifts during the run
    hits all modes alike; the row holds each mode's median and the ratios of the medians (the
    samples themselves under ``samples``).
    """
    import random

    common = dict(members=n, num_envs=e, num_steps=num_steps, calls=calls)
    timers, closers = {"alone": lambda: alone(name, n * e, num_steps * calls, cores)}, []
    try:
        for mode, make in (
            ("ppo-rollout", lambda: ppo(name, mode="rollout", **common)),
            ("ppo-full", lambda: ppo(name, **common)),
            ("ppo-other-place", lambda: ppo(name, 0, mode="rollout", **common)),
            ("env-layer", lambda: ppo(name, mode="layer", **common)),
            ("cleanrl", lambda: cleanrl(name, n, e, num_steps * calls)),
        ):
            timers[mode], close = make()
            closers.append(close)
        samples: dict[str, list[float]] = {m: [] for m in timers}
        order = list(timers)
        rng = random.Random(0)
        idle: dict[str, list[float]] = {m: [] for m in timers}
        for _ in range(repeats):
            rng.shuffle(order)
            for mode in order:
                before = _machine_ticks()
                samples[mode].append(timers[mode]())
                (all_, idle_) = (a - b for a, b in zip(_machine_ticks(), before))
                idle[mode].append(idle_ / all_ if all_ else float("nan"))
    finally:
        for close in closers:
            close()
    r = {"env": name, "members": n, "envs_per_member": e, "cores": cores, "repeats": repeats,
         "calls": calls}  # fmt: skip
    r.update({m: statistics.median(v) for m, v in samples.items()})
    r["layer/alone"] = r["env-layer"] / r["alone"]
    r["rollout/alone"] = r["ppo-rollout"] / r["alone"]
    r["full/alone"] = r["ppo-full"] / r["alone"]
    r["rollout/cleanrl"] = r["ppo-rollout"] / r["cleanrl"]
    # Where the time goes: the learner process's CPU per host step (PPO modes and the layer),
    # and the share of the machine's cores left idle while each mode ran.
    r["learner_cpu_us_per_step"] = {
        m: statistics.median(t.cpu_us_per_step)
        for m, t in timers.items()
        if getattr(t, "cpu_us_per_step", None)
    }
    r["idle"] = {m: statistics.median(v) for m, v in idle.items()}
    r["samples"] = samples
    return r


def report(rows: list[dict], args: argparse.Namespace) -> None:
    modes = ("alone", "env-layer", "ppo-rollout", "ppo-full", "ppo-other-place", "cleanrl")
    ratios = ("layer/alone", "rollout/alone", "full/alone", "rollout/cleanrl")
    label = lambda r: f"{r['env']} {r['members']}x{r['envs_per_member']}"
    lines = [
        f"{'env, members x envs':34s} " + " ".join(f"{m:>13s}" for m in modes + ratios)
        + "   (env steps/s, all members; ratios)"
    ]  # fmt: skip
    for r in rows:
        lines.append(f"{label(r):34s} " + " ".join(f"{r[m]:13,.0f}" for m in modes)
                     + " " + " ".join(f"{r[m]:13.2f}" for m in ratios))  # fmt: skip
    cpu_modes = ("env-layer", "ppo-rollout", "ppo-full", "ppo-other-place")
    lines += ["", f"{'env, members x envs':34s} " + " ".join(f"{m:>15s}" for m in cpu_modes)
              + "   (learner CPU us per host step / machine idle %)"]  # fmt: skip
    for r in rows:
        cpu, idle = r["learner_cpu_us_per_step"], r["idle"]
        # (idle is NaN where the machine's CPU ticks cannot be read: gVisor, not Linux)
        cells = [f"{cpu[m]:8.0f} / " + (f"{100 * idle[m]:3.0f}%" if idle[m] == idle[m] else "n/a")
                 for m in cpu_modes]  # fmt: skip
        lines.append(f"{label(r):34s} " + " ".join(f"{c:>15s}" for c in cells))
    text = "\n".join(lines)
    print(text)
    meta = {
        "machine": platform.machine(),
        "cores": rows[0]["cores"] if rows else None,
        "loadavg_at_end": os.getloadavg(),
        "command": "python benchmarks/envs.py " + " ".join(sys.argv[1:]),
        "settings": vars(args),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(_strict_json({"meta": meta, "rows": rows}, indent=1))
    (RESULTS / f"{args.out}.txt").write_text(text + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.8 / len(modes)
    for i, m in enumerate(modes):
        xs = np.arange(len(rows)) + i * width
        ax.bar(xs, [r[m] for r in rows], width, label=m)
    ax.set_xticks(np.arange(len(rows)) + 0.4 - width / 2, [label(r) for r in rows], fontsize=7,
                  rotation=20, ha="right")  # fmt: skip
    ax.set_ylabel("env steps/s (all members)")
    ax.set_yscale("log")
    ax.set_title(f"host envs: env steps/s, {rows[0]['cores']} cores")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(RESULTS / f"{args.out}.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
