"""Ensemble PPO benchmark: learning curves (CartPole, Pendulum) and env steps/s by layout.

(a) Learning: CartPole-v1 n=4 to 500k env steps per member (goal: every member >= 475 mean
    return), Pendulum-v1 n=4 to 1M (goal: member mean >= -250). Table + JSON + PNG curves.
(b) Speed, side by side in ONE process: env steps/s (all members together) for n = 1, 4, 8 with
    all members vmapped on ONE device (the PureJaxRL layout) against members sharded over all
    devices (one simulated CPU device per core, one thread each), CartPole, env on device.
(c) The same with ``env_on='cpu'`` (env steps through ``rollout.on_cpu`` worker processes).

Not a test: it times things. Run it on a quiet machine::

    python benchmarks/ppo.py                 # everything
    python benchmarks/ppo.py --part speed    # (b) and (c) only
    python benchmarks/ppo.py --part learn --envs cartpole

Writes ``benchmarks/results/ppo.json`` (merged with earlier parts), ``ppo_learning_{env}.png`` and
``ppo_speed.png``, and prints the tables.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _setup_devices() -> int:
    # One simulated CPU device per core, one thread per device: before JAX starts.
    import rollout

    return rollout.configure_cpu_devices(os.cpu_count() or 1)


def _timed_run(cfg, devices, calls: int, k: int) -> dict:
    """Compile (first call), then time ``calls`` calls of ``k`` updates; params for comparison."""
    import jax

    from rollout.ppo import Learner

    learner = Learner(cfg, devices=devices)
    try:
        state = learner.init()
        t0 = time.perf_counter()
        state, metrics = learner.update(state, k)
        jax.block_until_ready(metrics)
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(calls):
            state, metrics = learner.update(state, k)
        jax.block_until_ready(metrics)
        wall = time.perf_counter() - t0
        steps = calls * k * cfg.batch_size * cfg.members
        params = jax.device_get(state.members.params)
        return {
            "env_steps_per_s": steps / wall,
            "seconds": wall,
            "env_steps": steps,
            "first_call_s": compile_s,
            "params": params,
        }
    finally:
        learner.close()


def speed(ns=(1, 4, 8), env_on_cpu: bool = True, repeats: int = 3) -> list[dict]:
    import jax
    import numpy as np

    from rollout.ppo import PPOConfig

    rows = []
    all_devices = jax.devices()
    layouts = {"one device": all_devices[:1], f"sharded ({len(all_devices)} devices)": all_devices}
    for env_on in ("device", "cpu") if env_on_cpu else ("device",):
        calls, k = (6, 10) if env_on == "device" else (2, 2)
        for n in ns:
            cfg = PPOConfig.for_env(
                "cartpole", members=n, total_steps=10**7, updates_per_call=k, env_on=env_on
            )
            # Layouts alternate within each repeat so that load from other processes hits both
            # alike; the best repeat of each layout is kept.
            res: dict = {}
            for _ in range(repeats if env_on == "device" else 1):
                for name, devices in layouts.items():
                    r = _timed_run(cfg, devices, calls, k)
                    if name not in res or r["env_steps_per_s"] > res[name]["env_steps_per_s"]:
                        res[name] = r
            (one_name, sh_name) = list(layouts)
            one, sh = res[one_name], res[sh_name]
            diff = max(
                float(np.max(np.abs(a - b)))
                for a, b in zip(
                    jax.tree_util.tree_leaves(one["params"]),
                    jax.tree_util.tree_leaves(sh["params"]),
                )
            )
            row = {
                "env": "cartpole",
                "env_on": env_on,
                "members": n,
                "one_device_steps_per_s": one["env_steps_per_s"],
                "sharded_steps_per_s": sh["env_steps_per_s"],
                "speedup": sh["env_steps_per_s"] / one["env_steps_per_s"],
                "max_abs_param_diff": diff,
                "sharded_devices": len(all_devices),
                "updates_timed": calls * k,
            }
            rows.append(row)
            print(
                f"  env_on={env_on:6s} n={n}: one device {row['one_device_steps_per_s']:>10,.0f}"
                f"  sharded {row['sharded_steps_per_s']:>10,.0f}  x{row['speedup']:.2f}"
                f"  max|dparams|={diff:.1e}",
                flush=True,
            )
    return rows


def learn(envs=("cartpole", "pendulum"), members: int = 4) -> list[dict]:
    import jax
    import numpy as np

    from rollout.ppo import PPOConfig, plot_curves, train

    rows = []
    for env in envs:
        cfg = PPOConfig.for_env(env, members=members, updates_per_call=10)
        out = ROOT / "runs" / f"bench_ppo_{env}"  # metrics + checkpoints (not committed)
        t0 = time.perf_counter()
        devices = jax.devices()[: _fitting(len(jax.devices()), members)]
        _, metrics = train(
            cfg, out, overwrite=True, progress=True, checkpoint_every=10**9, devices=devices
        )
        wall = time.perf_counter() - t0
        final = np.nanmean(np.array([r["returns"] for r in metrics[-10:]], dtype=float), axis=0)
        goal = 475.0 if env == "cartpole" else -250.0
        row = {
            "env": env,
            "members": members,
            "env_steps_per_member": metrics[-1]["env_steps"],
            "final_returns": [float(x) for x in final],
            "goal": goal,
            "goal_met": bool(np.all(final >= goal))
            if env == "cartpole"
            else bool(final.mean() >= goal),
            "wall_s": wall,
            "devices": len(devices),
            "curve": [[r["env_steps"], r["returns"]] for r in metrics],
        }
        rows.append(row)
        plot_curves(metrics, RESULTS / f"ppo_learning_{env}.png", env)
        print(
            f"  {env}: final returns (mean of last 10 updates) {np.round(final, 1).tolist()} "
            f"goal {goal} met={row['goal_met']} ({wall:.0f} s)",
            flush=True,
        )
    return rows


def _fitting(available: int, members: int) -> int:
    """The most devices, at most ``available``, ``members`` spread over: whole members per
    device, or each member over the same number of devices (``ensemble.layout``)."""
    d = available
    while members % d and d % members:
        d -= 1
    return d


def _plot_speed(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    envs_on = sorted({r["env_on"] for r in rows})
    fig, axes = plt.subplots(1, len(envs_on), figsize=(5 * len(envs_on), 3.8), squeeze=False)
    for ax, env_on in zip(axes[0], envs_on):
        sub = [r for r in rows if r["env_on"] == env_on]
        ns = [r["members"] for r in sub]
        x = range(len(ns))
        ax.bar(
            [i - 0.2 for i in x], [r["one_device_steps_per_s"] for r in sub], 0.4, label="1 device"
        )
        ax.bar(
            [i + 0.2 for i in x],
            [r["sharded_steps_per_s"] for r in sub],
            0.4,
            label=f"sharded ({sub[0]['sharded_devices']} devices)",
        )
        ax.set_xticks(list(x), [f"n={n}" for n in ns])
        ax.set_ylabel("env steps/s (all members)")
        ax.set_title(f"CartPole PPO, env_on={env_on}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "ppo_speed.png", dpi=110)
    plt.close(fig)


def main() -> None:
    from rollout.ppo._parser import OneLineParser, positive_int

    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("all", "speed", "learn"), default="all")
    p.add_argument(
        "--envs",
        nargs="+",
        choices=("cartpole", "pendulum"),
        default=["cartpole", "pendulum"],
        help="envs of the learn part (the speed part always runs CartPole at n = 1, 4, 8)",
    )
    p.add_argument("--members", type=positive_int, default=4, help="members of the learn part")
    p.add_argument("--no-cpu-env", action="store_true", help="skip the env_on='cpu' speed rows")
    args = p.parse_args()
    p.results_dir(RESULTS)
    devices = _setup_devices()
    import jax

    path = RESULTS / "ppo.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data["machine"] = data.get("machine", {}) | {
        "cpu_count": os.cpu_count(),
        "jax_devices": devices,
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "note": "shared, noisy 2-core machine (other jobs running); figures are indicative",
    }
    if args.part in ("all", "speed"):
        data["machine"]["load_avg_before_speed"] = os.getloadavg()
        print("speed: CartPole PPO, CleanRL config, env steps/s of all members together")
        data["speed"] = speed(env_on_cpu=not args.no_cpu_env)
        _plot_speed(data["speed"])
    if args.part in ("all", "learn"):
        data["machine"]["load_avg_before_learning"] = os.getloadavg()
        print(f"learning: n={args.members}")
        learned = learn(tuple(args.envs), args.members)
        data.setdefault("learning", {})
        for row in learned:
            data["learning"][row["env"]] = row
    path.write_text(json.dumps(data, indent=1))
    print_tables(data)


def print_tables(data: dict) -> None:
    if data.get("speed"):
        print(
            "\n| env_on | n | 1 device (steps/s) | sharded (steps/s) | speed-up | max abs dparams |"
        )
        print("|---|---|---|---|---|---|")
        for r in data["speed"]:
            print(
                f"| {r['env_on']} | {r['members']} | {r['one_device_steps_per_s']:,.0f} | "
                f"{r['sharded_steps_per_s']:,.0f} | {r['speedup']:.2f}x | "
                f"{r['max_abs_param_diff']:.1e} |"
            )
    if data.get("learning"):
        print("\n| env | n | env steps/member | final mean return per member | goal | met | wall |")
        print("|---|---|---|---|---|---|---|")
        for r in data["learning"].values():
            rets = ", ".join(f"{x:.1f}" for x in r["final_returns"])
            print(
                f"| {r['env']} | {r['members']} | {r['env_steps_per_member']:,} | {rets} | "
                f"{r['goal']} | {r['goal_met']} | {r['wall_s']:.0f} s |"
            )


if __name__ == "__main__":
    main()
