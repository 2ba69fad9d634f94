"""Does logging slow training? Env steps/s of ``train`` with and without ``--log`` loggers.

(a) Training throughput: the same compiled learner trains the same run with no extra logger,
    TensorBoard, W&B (offline) and both (at the default ``--log-interval``), and both with every
    row (``--log-interval 0``: the worst case, a row per update), in interleaved rounds (every
    round runs every arm, in a shuffled order, so machine load drifts hit all arms alike, each
    after ``--settle`` seconds of rest).
    Reported per arm: the median over rounds of the loop's env steps/s (all members, compile
    excluded, the number ``train`` itself reports), its ratio to the no-logger arm per round,
    the rows the loggers got, the time ``close()`` takes at the end (flushing what the
    background thread still holds) and the CPU time of the logger thread per second of
    training. Goal: <= 2% slower.
(b) CPU cost per metric row: ``scalars`` + the logger's ``write`` (+ its flush), timed directly
    on rows of the run's shape (what logging costs per PPO update).

Not a test: it times things. Run it on a quiet machine::

    python benchmarks/loggers.py                       # CartPole defaults, 4 members, 7 rounds
    python benchmarks/loggers.py --rounds 3 --num-steps 32

Writes ``benchmarks/results/loggers.{json,txt}`` and prints the tables.
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

ARMS = ("none", "tensorboard", "wandb", "tensorboard,wandb", "tensorboard,wandb/every-row")


UPDATES_PER_CALL = 8


def _run(learner, arm: str, config, settle_s: float = 0.0) -> dict:
    """One training run with the loggers of ``arm``; the loop's env steps/s and close time.

    Waits ``settle_s`` first: W&B's service process goes on finishing the previous run for a
    moment after ``finish()`` returns, and would slow whichever run comes next (in a real
    training run there is no previous run).
    """
    from rollout.ppo import _loggers, train

    time.sleep(settle_s)

    with tempfile.TemporaryDirectory() as out:
        flag, _, every = arm.partition("/")
        names = _loggers.parse_log_flag("" if flag == "none" else flag)
        interval = 0.0 if every else _loggers.DEFAULT_INTERVAL_S
        logs = _loggers.open_loggers(names, out, config.to_dict(), interval)
        t0 = time.perf_counter()
        _, rows = train(
            config,
            out,
            progress=False,
            learner=learner,
            checkpoint_every=10**9,  # only the final checkpoint, after the last timing
            on_update=logs.write,
        )
        wall = time.perf_counter() - t0
        t0 = time.perf_counter()
        logs.close()
        close_s = time.perf_counter() - t0
    return {
        "env_steps_per_s": rows[-1]["env_steps_per_s"],
        "wall_s": wall,
        "close_s": close_s,
        "writer_cpu_s": logs.cpu_s,  # the writer thread's CPU time over the whole run
        "rows_logged": logs.queued,
    }


def throughput(
    config, devices, rounds: int, arms: tuple[str, ...], settle_s: float, seed: int = 0
) -> dict:
    from rollout.ppo import Learner

    learner = Learner(config, devices=devices)
    try:
        _run(learner, "none", config)  # compile once, outside the timings
        order = random.Random(seed)
        runs: dict[str, list[dict]] = {arm: [] for arm in arms}
        for r in range(rounds):
            shuffled = list(arms)
            order.shuffle(shuffled)
            for arm in shuffled:
                runs[arm].append(_run(learner, arm, config, settle_s))
            base = runs["none"][-1]["env_steps_per_s"]
            print(
                f"  round {r + 1}/{rounds}: "
                + ", ".join(f"{a} {runs[a][-1]['env_steps_per_s'] / base:.3f}" for a in arms),
                flush=True,
            )
    finally:
        learner.close()
    return runs


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    base = [r["env_steps_per_s"] for r in runs["none"]]
    out = {}
    for arm, rs in runs.items():
        sps = [r["env_steps_per_s"] for r in rs]
        ratios = [s / b for s, b in zip(sps, base)]
        out[arm] = {
            "median_env_steps_per_s": statistics.median(sps),
            "median_ratio_to_none": statistics.median(ratios),
            "ratios": ratios,
            "median_close_s": statistics.median(r["close_s"] for r in rs),
            # CPU the writer thread took, per second of training (one core = 1.0).
            "writer_cpu_per_train_s": statistics.median(
                r["writer_cpu_s"] / r["wall_s"] for r in rs
            ),
            "env_steps_per_s": sps,
            "rows_logged": statistics.median(r["rows_logged"] for r in rs),
        }
    return out


def row_cost(members: int, rows: int = 300) -> dict[str, float]:
    """CPU microseconds per metric row for ``scalars`` and each logger (write + close).

    Process CPU time, not wall time: on a loaded machine wall time counts the time the process
    waits for a core. It includes tensorboardX's own writer thread (checksums, file writes),
    not W&B's separate service process.
    """
    import math

    from rollout.ppo import METRIC_NAMES, _loggers

    def row(u: int) -> dict:
        r = {"update": u, "env_steps": 512 * u, "env_steps_per_s": 1e4}
        for name in METRIC_NAMES:
            r[name] = [float(f"{math.sin(u + i):.7g}") for i in range(members)]
        return r

    data = [row(u + 1) for u in range(rows)]
    out = {}
    t0 = time.process_time()
    for r in data:
        _loggers.scalars(r)
    out["scalars_us"] = (time.process_time() - t0) / rows * 1e6
    with tempfile.TemporaryDirectory() as d:
        for name in ("tensorboard", "wandb"):
            (logger,) = _loggers.open_loggers(_loggers.parse_log_flag(name), d).loggers
            t0 = time.process_time()
            for r in data:
                logger.write(r)
            logger.close()  # flushes: the records are checksummed and written by now
            out[f"{name}_write_us"] = (time.process_time() - t0) / rows * 1e6
    out["scalars_per_row"] = len(_loggers.scalars(data[0]))
    return out


def _parse_args():
    """The flags, checked; the results folder made and writable (before any training)."""
    from rollout.ppo._parser import OneLineParser, non_negative_float, positive_int

    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--members", type=positive_int, default=4)
    p.add_argument("--rounds", type=positive_int, default=7)
    p.add_argument(
        "--updates", type=positive_int, default=1024, help="PPO updates per run (at least 16)"
    )
    p.add_argument(
        "--settle", type=non_negative_float, default=2.0, help="seconds of rest before each run"
    )
    p.add_argument("--num-steps", type=positive_int, default=128, help="rollout length per update")
    args = p.parse_args()
    from rollout.ppo import _loggers

    try:  # both backends are timed: a missing package is one line before any run
        _loggers.parse_log_flag("tensorboard,wandb")
    except ValueError as e:
        p.error(str(e))
    if args.updates < 2 * UPDATES_PER_CALL:  # the first call compiles and has no rate
        p.error(
            f"--updates must be >= {2 * UPDATES_PER_CALL} (two timed calls), got {args.updates}"
        )
    p.results_dir(RESULTS)
    return args


def main() -> None:
    args = _parse_args()
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    import rollout

    n_dev = rollout.configure_cpu_devices(os.cpu_count() or 1)
    import jax
    from accelerator_check import whole_members  # a script beside this one

    from rollout.ppo import PPOConfig

    devices = jax.devices()[: whole_members(args.members, n_dev)]
    cfg = PPOConfig.for_env(
        "cartpole",
        members=args.members,
        num_steps=args.num_steps,
        updates_per_call=UPDATES_PER_CALL,
    )
    cfg = PPOConfig.for_env(
        "cartpole",
        members=args.members,
        num_steps=args.num_steps,
        updates_per_call=UPDATES_PER_CALL,
        total_steps=args.updates * cfg.batch_size,
    )
    title = (
        f"(a) CartPole n={cfg.members} on {len(devices)} CPU devices, {cfg.num_updates} updates "
        f"of {cfg.batch_size} steps/member, {args.rounds} interleaved rounds"
    )
    print(title, flush=True)
    summary = summarize(throughput(cfg, devices, args.rounds, ARMS, args.settle))
    cost = row_cost(cfg.members)
    text = "\n".join([
        "$ python benchmarks/loggers.py " + " ".join(sys.argv[1:]), title,
        throughput_table(summary, cfg.num_updates),
        f"(b) CPU per metric row ({cost['scalars_per_row']} scalars, n={cfg.members}): "
        f"scalars {cost['scalars_us']:.0f} us, tensorboard {cost['tensorboard_write_us']:.0f}"
        f" us, wandb {cost['wandb_write_us']:.0f} us (process CPU time, W&B service excluded)",
    ])  # fmt: skip
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    result = {
        "command": "python benchmarks/loggers.py " + " ".join(sys.argv[1:]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "versions": _versions(),
        "config": cfg.to_dict(),
        "devices": len(devices),
        "rounds": args.rounds,
        "settle_s": args.settle,
        "throughput": summary,
        "row_cost": cost,
    }
    (RESULTS / "loggers.json").write_text(json.dumps(result, indent=1))
    (RESULTS / "loggers.txt").write_text(text + "\n")
    print(f"wrote {RESULTS / 'loggers.json'} and loggers.txt")


def throughput_table(summary: dict, num_updates: int) -> str:
    head = f"{'loggers':<30} {'env steps/s':>12} {'vs none':>8} {'rows':>6} {'close s':>8}"
    lines = [f"{head} {'writer CPU':>11}"]
    for arm, s in summary.items():
        lines.append(
            f"{arm:<30} {s['median_env_steps_per_s']:>12,.0f} "
            f"{s['median_ratio_to_none']:>8.3f} {s['rows_logged']:>6.0f} "
            f"{s['median_close_s']:>8.3f} {100 * s['writer_cpu_per_train_s']:>10.2f}%"
        )
    lines.append(
        f"(median over rounds; rows: metric rows the loggers got of {num_updates}; writer "
        "CPU: the logger thread's CPU time / training wall time)"
    )
    return "\n".join(lines)


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("jax", "tensorboardX", "wandb"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "absent"
    return out


if __name__ == "__main__":
    main()
