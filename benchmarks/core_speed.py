"""Speed of the member core (``shard_map`` with a manual member axis) against the old mechanism.

The old mechanism is ``jax.jit(jax.vmap(fn, spmd_axis_name='ensemble'))`` with the member axis left
to XLA's partitioner (what the library did before the core, e.g. at commit ``efcfbee``).

Parts:

- ``--part ops``: ms per call (median over rounds, after compile) of ``apply`` and of the donated
  train step (per-member Adam), new core vs old mechanism, for an MLP and a small CNN
  (``examples/conv_models.py``), 8 members on D = 1 and 2 devices. Old and new calls alternate
  inside every round, so load from other processes hits both alike.
- ``--part ppo``: env steps/s of ``rollout.ppo`` (CartPole, 4 envs x 128 steps, 4 epochs,
  4 minibatches, 4 members) with all members on one device and sharded over 2, for the code in
  this checkout against an older checkout (``--old-root``, e.g. a ``git archive`` of
  ``efcfbee``). Every measurement is a fresh subprocess; old and new alternate round by round.

Run: ``python benchmarks/core_speed.py --part ops`` and
``python benchmarks/core_speed.py --part ppo --old-root /tmp/ppo_old``. Writes
``benchmarks/results/core_speed.json`` (parts merged), ``core_speed.txt`` and ``core_speed.png``.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


# ---------------------------------------------------------------------- PPO: old vs new checkout

_PPO_WORKER = r"""
import json, sys, time
import jax, rollout
rollout.configure_cpu_devices(2)
from rollout.ppo import Learner, PPOConfig
calls, k = int(sys.argv[1]), int(sys.argv[2])
out = {}
for name, devices in (("one", jax.devices()[:1]), ("sharded", jax.devices()[:2])):
    cfg = PPOConfig.for_env("cartpole", members=4, total_steps=10**7, updates_per_call=k,
                            env_on="device")
    learner = Learner(cfg, devices=devices)
    try:
        state = learner.init()
        t0 = time.perf_counter()
        state, m = learner.update(state, k)
        jax.block_until_ready(m)
        first = time.perf_counter() - t0
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(calls):
            state, m = learner.update(state, k)
        jax.block_until_ready(m)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        learner.close()
    steps = calls * k * cfg.batch_size * cfg.members
    out[name] = {"steps_per_s": steps / wall, "steps_per_cpu_s": steps / cpu,
                 "first_call_s": first}
print("RESULT " + json.dumps(out))
"""


def _ppo_once(root: pathlib.Path, calls: int, k: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, "-c", _PPO_WORKER, str(calls), str(k)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return {**json.loads(line[7:]), "load_avg": os.getloadavg()[0]}
    raise RuntimeError(f"PPO worker under {root} failed:\n{proc.stderr[-3000:]}")


def ppo(old_root: pathlib.Path, rounds: int, calls: int, k: int) -> dict[str, Any]:
    """Alternating old/new subprocess runs; medians and every round's figure."""
    runs: dict[str, list[dict[str, Any]]] = {"old": [], "new": []}
    for r in range(rounds):
        order = ("old", "new") if r % 2 == 0 else ("new", "old")
        for which in order:
            res = _ppo_once(old_root if which == "old" else ROOT, calls, k)
            runs[which].append(res)
            one, sh = res["one"], res["sharded"]
            print(
                f"  round {r} {which}: one device {one['steps_per_s']:>9,.0f} "
                f"({one['steps_per_cpu_s']:,.0f}/cpu-s)  sharded {sh['steps_per_s']:>9,.0f} "
                f"({sh['steps_per_cpu_s']:,.0f}/cpu-s)  load {res['load_avg']:.1f}",
                flush=True,
            )
    summary = {}
    for layout in ("one", "sharded"):
        med = {w: statistics.median(x[layout]["steps_per_s"] for x in runs[w]) for w in runs}
        cpu = {w: statistics.median(x[layout]["steps_per_cpu_s"] for x in runs[w]) for w in runs}
        summary[layout] = {
            "old_steps_per_s": med["old"],
            "new_steps_per_s": med["new"],
            "new_over_old": med["new"] / med["old"],
            "old_steps_per_cpu_s": cpu["old"],
            "new_steps_per_cpu_s": cpu["new"],
            "new_over_old_cpu": cpu["new"] / cpu["old"],
            "old_rounds": [x[layout]["steps_per_s"] for x in runs["old"]],
            "new_rounds": [x[layout]["steps_per_s"] for x in runs["new"]],
        }
    return {
        "config": "CartPole, 4 members, 4 envs x 128 steps, 4 epochs, 4 minibatches, env on device",
        "old_root": str(old_root),
        "rounds": rounds,
        "updates_timed_per_round": calls * k,
        "summary": summary,
        "runs": runs,
    }


def _ppo_table(p: dict[str, Any]) -> str:
    lines = [
        f"PPO env steps/s (all 4 members), median of {p['rounds']} alternating rounds",
        "(wall clock; per CPU-second of this process in brackets: less sensitive to load)",
        f"{'layout':>22} {'old':>10} {'new':>10} {'new/old':>8} {'cpu new/old':>11}  "
        "rounds old | new",
    ]
    names = {"one": "4 members on 1 device", "sharded": "sharded over 2 devices"}
    for layout, s in p["summary"].items():
        fmt = lambda xs: " ".join(f"{x / 1e3:.0f}k" for x in xs)
        lines.append(
            f"{names[layout]:>22} {s['old_steps_per_s']:>10,.0f} {s['new_steps_per_s']:>10,.0f} "
            f"{s['new_over_old']:8.3f} {s['new_over_old_cpu']:11.3f}  "
            f"{fmt(s['old_rounds'])} | {fmt(s['new_rounds'])}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------- apply / step: old vs new


def _op_pairs(name: str, devices: list, n: int) -> dict[str, Any]:
    """For one model on ``devices``: zero-argument callables, new core and old mechanism."""
    import conv_models
    import jax
    import memory
    import optax

    import ensemble

    if name == "MLP":
        model, shape = memory.LinenMLP(1024, 3), (32, 512)
    else:
        model, shape = conv_models.CNN(), (16, 28, 28, 1)
    x, y = memory._batch(shape[0], shape[1:])
    ens = ensemble.build(model, n, devices=devices)
    variables = ens.init(jax.random.key(0), x)
    loss = memory.ce_loss(lambda p, x: model.apply({"params": p}, x))
    tx = optax.adam(1e-3)
    new_step = ens.train_step(loss, tx)
    old_step = memory.old_train_step(loss, tx, n, ens.mesh, (None, None))
    old_apply = memory.old_apply(model.apply, n, ens.mesh)
    sharding = memory._member_sharding(ens.mesh)
    copy = lambda t: jax.tree.map(lambda a: jax.device_put(a.copy(), sharding), t)
    state = {"new": [copy(variables["params"])], "old": [copy(variables["params"])]}
    state["new"].append(new_step.init(state["new"][0]))
    init_old = jax.jit(jax.vmap(tx.init), out_shardings=sharding)
    state["old"].append(init_old(state["old"][0]))

    def stepper(which, fn):
        def run():
            p, s, losses = fn(*state[which], x, y)
            state[which] = [p, s]
            return losses

        return run

    def under_mesh(fn):
        def run():
            with jax.set_mesh(ens.mesh):
                return fn()

        return run

    return {
        "apply new": lambda: ens.apply(variables, x),
        "apply old": under_mesh(lambda: old_apply(variables, x)),
        "step new": stepper("new", new_step),
        "step old": under_mesh(stepper("old", old_step)),
    }


def _time_ms(fn: Any, reps: int) -> float:
    import jax

    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps * 1e3


def ops(rounds: int, reps: int = 5, n: int = 8) -> dict[str, Any]:
    """ms per call, median over ``rounds``; new and old alternate inside every round."""
    import jax

    rows = []
    for name in ("MLP", "CNN"):
        for d in (1, 2):
            fns = _op_pairs(name, jax.devices()[:d], n)
            for fn in fns.values():  # compile, and warm up
                jax.block_until_ready(fn())
            times: dict[str, list[float]] = {k: [] for k in fns}
            for r in range(rounds):
                keys = list(fns) if r % 2 == 0 else list(reversed(fns))
                for k in keys:
                    times[k].append(_time_ms(fns[k], reps))
            med = {k: statistics.median(v) for k, v in times.items()}
            rows.append({"model": name, "devices": d, "ms": med, "rounds_ms": times})
            print(f"  {name} D={d}: " + "  ".join(f"{k} {v:.2f}" for k, v in med.items()))
    return {"members": n, "rounds": rounds, "calls_per_round": reps, "rows": rows}


def ops_table(data: dict[str, Any]) -> str:
    lines = [
        f"ms per call, {data['members']} members, median of {data['rounds']} rounds x "
        f"{data['calls_per_round']} calls (2 CPU cores; each simulated device one thread)",
        f"{'model':>5} {'D':>2} {'apply new':>10} {'apply old':>10} {'step new':>9} "
        f"{'step old':>9}",
    ]
    for r in data["rows"]:
        ms = r["ms"]
        lines.append(
            f"{r['model']:>5} {r['devices']:>2} {ms['apply new']:10.2f} {ms['apply old']:10.2f} "
            f"{ms['step new']:9.2f} {ms['step old']:9.2f}"
        )
    return "\n".join(lines)


def _ops_plot(data: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    for ax, op in zip(axes, ("apply", "step")):
        labels = [f"{r['model']} D={r['devices']}" for r in data["rows"]]
        xs = range(len(labels))
        for off, which in ((-0.2, "old"), (0.2, "new")):
            vals = [r["ms"][f"{op} {which}"] for r in data["rows"]]
            ax.bar([x + off for x in xs], vals, 0.4, label=which)
        ax.set_xticks(list(xs), labels, fontsize=8)
        ax.set_ylabel("ms per call (median)")
        ax.set_title(op)
        ax.legend()
    fig.suptitle("Member core (new) vs jit(vmap(spmd_axis_name)) (old), 8 members")
    fig.tight_layout()
    fig.savefig(RESULTS / "core_speed.png", dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------- report


def _merge_write(part: str, data: Any, table: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "core_speed.json"
    report = json.loads(path.read_text()) if path.exists() else {}
    report[part] = data
    report.setdefault("machine", {}).update(
        {
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "note": "2-core machine shared with other busy jobs; figures are noisy",
        }
    )
    path.write_text(json.dumps(report, indent=2) + "\n")
    tables = report.setdefault("_tables", {})
    tables[part] = table
    path.write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / "core_speed.txt").write_text("\n\n".join(tables.values()) + "\n")


def main(argv: list[str] | None = None) -> None:
    from rollout.ppo._parser import OneLineParser, positive_int

    p = OneLineParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=("ops", "ppo"), required=True)
    p.add_argument("--old-root", type=pathlib.Path, help="old checkout (for --part ppo)")
    p.add_argument("--rounds", type=positive_int, default=5)
    p.add_argument("--calls", type=positive_int, default=4, help="PPO: timed calls per round")
    p.add_argument("--k", type=positive_int, default=10, help="PPO: updates per call")
    args = p.parse_args(argv)
    p.results_dir(RESULTS)
    start = time.perf_counter()
    if args.part == "ppo":
        if args.old_root is None or not (args.old_root / "rollout").is_dir():
            p.error("--part ppo needs --old-root DIR holding an older checkout (with rollout/)")
        data = ppo(args.old_root.resolve(), args.rounds, args.calls, args.k)
        table = _ppo_table(data)
    else:
        import memory

        memory._simulate_cpu_devices(2)
        data = ops(args.rounds)
        table = ops_table(data)
        _ops_plot(data)
    data["seconds"] = time.perf_counter() - start
    print()
    print(table)
    _merge_write(args.part, data, table)


if __name__ == "__main__":
    main()
