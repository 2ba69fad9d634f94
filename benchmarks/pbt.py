"""Population-based training benchmark: Pendulum-v1, 8 members, a poor learning-rate spread.

Both arms start from the same 8 learning rates drawn log-uniform in [1e-5, 1e-2] (seeded) and
run the same env steps per member through the real command line (``python -m rollout.ppo``):
one plain ensemble, one with ``--pbt``. A member's final score is its mean return over the last
``--tail`` updates. The question: is PBT's best member at least as good as the best member
without PBT, and is the population's median clearly higher? The gap between the two bests also
gets a 95% interval from resampling each arm's last ``--tail`` updates (``best_gap``), the
noise of the scores themselves.

A best-of-8 training score is biased upwards by the members' own noise (the winner's curse),
more for 8 independent members than for a PBT population of near-copies. So each arm's final
checkpoint is also exported and every member runs ``--eval-episodes`` fresh deterministic
episodes (mean action, the same initial states for every policy; ``rollout.ppo.evaluate``): the
member its training score ranks first is scored there, as a user would deploy it, and the two
arms' picks are compared episode by episode (``held_out``).

The two arms run at the same time as two processes (each gets the same share of the machine).
Not a test: it trains for minutes. Run::

    python benchmarks/pbt.py                       # default 300k env steps per member
    python benchmarks/pbt.py --total-steps 100000  # quicker, noisier

Writes ``benchmarks/results/pbt.json``, ``pbt.png`` (both arms' curves and PBT's learning rates)
and ``pbt_lineage.png`` (``--name`` changes the stem), and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MEMBERS = 8


def learning_rates(seed: int = 0) -> list[float]:
    """The deliberately poor spread: 8 draws log-uniform in [1e-5, 1e-2], sorted."""
    rng = np.random.default_rng(seed)
    return [float(f"{v:.4g}") for v in np.sort(10 ** rng.uniform(-5, -2, MEMBERS))]


def arm_command(pbt: bool, args: argparse.Namespace, out: Path) -> list[str]:
    lrs = ",".join(str(v) for v in learning_rates(args.seed))
    cmd = [sys.executable, "-m", "rollout.ppo", "--env", "pendulum", "--members", str(MEMBERS)]
    cmd += ["--total-steps", str(args.total_steps), "--lr", lrs, "--seed", str(args.seed)]
    cmd += ["--out", str(out), "--no-progress", "--checkpoint-every", "1000"]
    if pbt:
        cmd += ["--pbt", "--pbt-interval", str(args.interval), "--pbt-fraction", "0.25"]
    return cmd


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def returns_matrix(rows: list[dict]) -> np.ndarray:
    """[updates, members] mean episode return (NaN where none finished yet)."""
    return np.array([[np.nan if v is None else v for v in r["returns"]] for r in rows], np.float64)


def final_scores(rows: list[dict], tail: int) -> np.ndarray:
    """Each member's mean return over the last ``tail`` updates (unrounded: picks and
    comparisons use these, so members that round alike are still told apart)."""
    return np.nanmean(returns_matrix(rows)[-tail:], axis=0)


def summarise(final: np.ndarray) -> dict:
    """``final_scores`` rounded for the report."""
    return {
        "final_per_member": [round(float(v), 1) for v in final],
        "best": round(float(np.max(final)), 1),
        "median": round(float(np.median(final)), 1),
        "worst": round(float(np.min(final)), 1),
    }


def best_gap_interval(
    runs: dict[str, list[dict]], tail: int, resamples: int = 2000, seed: int = 0
) -> dict[str, object]:
    """PBT's best score minus the plain arm's, over bootstrap resamples of each arm's last
    ``tail`` updates (a member's score is the mean of its resampled updates; each arm's best
    picked again on every resample): the observed gap, its 95% interval and the share of
    resamples where PBT's best is at or above. An interval that holds 0 means the scores'
    own update-to-update noise cannot tell the two bests apart."""
    rng = np.random.default_rng(seed)

    def bests(rows: list[dict]) -> np.ndarray:
        last = returns_matrix(rows)[-tail:]  # [tail, members]
        picks = rng.integers(0, len(last), (resamples, len(last)))
        return np.nanmax(np.nanmean(last[picks], axis=1), axis=1)

    with warnings.catch_warnings():  # a member without episodes: NaN, left out by nanmax
        warnings.simplefilter("ignore", RuntimeWarning)
        gap = bests(runs["PBT"]) - bests(runs["no PBT"])
        observed = np.nanmax(np.nanmean(returns_matrix(runs["PBT"])[-tail:], axis=0))
        observed -= np.nanmax(np.nanmean(returns_matrix(runs["no PBT"])[-tail:], axis=0))
    return {
        "gap": round(float(observed), 1),
        "ci95": [round(float(np.quantile(gap, q)), 1) for q in (0.025, 0.975)],
        "share_at_or_above": round(float(np.mean(gap >= 0)), 3),
    }


def evaluate_arm(run: Path, episodes: int, seed: int) -> np.ndarray:
    """[members, episodes] returns of the arm's final checkpoint, exported to ``run/export``."""
    from rollout.ppo import evaluate, export

    shutil.rmtree(run / "export", ignore_errors=True)
    cmd = [sys.executable, "-m", "rollout.ppo.export", str(run), "--to", str(run / "export")]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    members = [export.read_member(d) for d in export.member_dirs(run / "export")]
    returns = evaluate.evaluate(members, episodes, seed)
    return np.stack([returns[f"member_{i}"] for i in range(len(members))])


def held_out(scores: dict[str, np.ndarray], returns: dict[str, np.ndarray]) -> dict[str, object]:
    """Each arm's pick (its best member by training score) scored on the held-out episodes,
    and PBT's pick minus the plain arm's: the mean over the same episodes and its standard
    error (paired: every policy saw the same initial states)."""
    out: dict[str, object] = {}
    for arm in ("no PBT", "PBT"):
        pick = int(np.nanargmax(scores[arm]))
        means = returns[arm].mean(axis=1)
        out[arm] = {
            "pick": pick,
            "pick_mean": round(float(means[pick]), 1),
            "best_mean": round(float(means.max()), 1),
            "median_mean": round(float(np.median(means)), 1),
        }
    diff = returns["PBT"][out["PBT"]["pick"]] - returns["no PBT"][out["no PBT"]["pick"]]
    out["pick_gap"] = round(float(diff.mean()), 1)
    out["pick_gap_se"] = round(float(diff.std(ddof=1) / np.sqrt(len(diff))), 1)
    return out


def plot(runs: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (name, rows) in zip(axes[:2], runs.items(), strict=True):
        steps = np.array([r["env_steps"] for r in rows])
        ret = returns_matrix(rows)
        for i in range(ret.shape[1]):
            ax.plot(steps, ret[:, i], lw=0.8, alpha=0.6)
        ax.plot(steps, np.nanmedian(ret, axis=1), "k", lw=2, label="median")
        ax.plot(steps, np.nanmax(ret, axis=1), "k--", lw=1.2, label="best")
        ax.set_title(f"{name}: Pendulum-v1, {ret.shape[1]} members")
        ax.set_xlabel("env steps per member")
        ax.set_ylabel("mean episode return")
        ax.set_ylim(-1700, 0)
        ax.xaxis.set_major_formatter(lambda x, _: f"{x / 1000:.0f}k")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    rows = runs["PBT"]
    steps = [r["env_steps"] for r in rows]
    lr = np.array([r["hparams"]["learning_rate"] for r in rows])
    axes[2].plot(steps, lr, lw=1)
    axes[2].set_yscale("log")
    axes[2].set_title("PBT: each member's learning rate")
    axes[2].set_xlabel("env steps per member")
    axes[2].grid(alpha=0.3)
    axes[2].xaxis.set_major_formatter(lambda x, _: f"{x / 1000:.0f}k")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_arms(args: argparse.Namespace, work: Path) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs, logs, walls = {}, {}, {}
    t0 = time.perf_counter()
    for name, pbt in (("no PBT", False), ("PBT", True)):
        out = work / ("pbt" if pbt else "plain")
        shutil.rmtree(out, ignore_errors=True)
        logs[name] = open(work / f"{out.name}.log", "w")
        procs[name] = subprocess.Popen(
            arm_command(pbt, args, out), cwd=ROOT, env=env, stdout=logs[name], stderr=logs[name]
        )
    try:
        while len(walls) < len(procs):  # each arm's own wall time, whichever ends first
            for name, p in procs.items():
                if name in walls or p.poll() is None:
                    continue
                if p.returncode != 0:
                    raise SystemExit(f"{name} arm failed; see {logs[name].name}")
                walls[name] = round(time.perf_counter() - t0, 1)
            time.sleep(0.1)
    finally:  # an arm that failed takes the other down with it
        for name, p in procs.items():
            if p.poll() is None:
                p.terminate()
                p.wait()
            logs[name].close()
    return walls


def _parser():
    from rollout.ppo._parser import (
        OneLineParser,
        file_name,
        non_negative_int,
        positive_int,
        writable_dir,
    )

    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--total-steps", type=positive_int, default=300_000, help="env steps per member")
    p.add_argument(
        "--interval", type=positive_int, default=10, help="PPO updates between PBT steps"
    )
    p.add_argument(
        "--tail", type=positive_int, default=10, help="updates averaged for the final score"
    )
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument(
        "--eval-episodes", type=int, default=500, help="held-out episodes per member (at least 2)"
    )
    p.add_argument(
        "--work",
        type=writable_dir,
        default=str(ROOT / "runs" / "pbt_bench"),
        help="arm output dirs",
    )
    p.add_argument(
        "--name", type=file_name, default="pbt", help="result files: benchmarks/results/NAME.*"
    )
    p.add_argument("--report-only", action="store_true", help="re-read finished arms")
    return p


def _check(parser, args: argparse.Namespace) -> None:
    """Refuses, in one line, what would fail only after the arms have trained."""
    if args.eval_episodes < 2:
        parser.error(f"--eval-episodes must be >= 2, got {args.eval_episodes}")
    parser.results_dir(RESULTS)
    if args.report_only:
        missing = [d for d in ("plain", "pbt") if not (args.work / d / "metrics.jsonl").exists()]
        if missing:
            parser.error(f"--report-only: no finished arm in {args.work / missing[0]}")
        return
    from rollout.ppo import PPOConfig

    cfg = PPOConfig.for_env(
        "pendulum", members=MEMBERS, total_steps=args.total_steps, seed=args.seed, pbt=True,
        pbt_interval=args.interval, pbt_fraction=0.25, learning_rate=learning_rates(args.seed),
    )  # fmt: skip
    try:
        cfg.validate()
    except ValueError as e:
        parser.error(f"the arms' config: {str(e).splitlines()[0]}")
    if args.tail > cfg.num_updates:
        parser.error(f"--tail {args.tail} is more than the arms' {cfg.num_updates} updates")


def build_result(args: argparse.Namespace, work: Path, runs: dict, walls: dict, load) -> dict:
    scores = {name: final_scores(rows, args.tail) for name, rows in runs.items()}
    summary = {name: summarise(final) for name, final in scores.items()}
    pbt, plain = scores["PBT"], scores["no PBT"]
    evaluated = {
        name: evaluate_arm(work / d, args.eval_episodes, 10_000 + args.seed)
        for name, d in (("no PBT", "plain"), ("PBT", "pbt"))
    }
    return {
        "env": "pendulum",
        "members": MEMBERS,
        "env_steps_per_member": runs["PBT"][-1]["env_steps"],
        "initial_learning_rates": learning_rates(args.seed),
        "pbt": {"interval_updates": args.interval, "fraction": 0.25, "factors": [0.8, 1.2]},
        "final_score": f"mean return over the last {args.tail} updates, per member",
        "arms": summary,
        "pbt_best_ge_plain_best": bool(np.nanmax(pbt) >= np.nanmax(plain)),
        "best_gap": best_gap_interval(runs, args.tail, seed=args.seed),
        "median_gain": round(float(np.median(pbt) - np.median(plain)), 1),
        "held_out": held_out(scores, evaluated),
        "held_out_episodes": args.eval_episodes,
        "wall_s": walls,
        "machine": {
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "load_avg_before": [round(v, 2) for v in load],
            "note": "both arms ran at once as two processes (load average before: load_avg_before)",
        },
        "final_hparams_pbt": runs["PBT"][-1]["hparams"],
    }


def print_report(result: dict, tail: int) -> None:
    print(f"Pendulum-v1, {MEMBERS} members, {result['env_steps_per_member']} env steps each")
    print(f"{'arm':8} {'best':>8} {'median':>8} {'worst':>8}  final per member")
    for name, s in result["arms"].items():
        finals = s["final_per_member"]
        print(f"{name:8} {s['best']:8.1f} {s['median']:8.1f} {s['worst']:8.1f}  {finals}")
    gap, ho = result["best_gap"], result["held_out"]
    print(
        f"PBT best >= no-PBT best: {result['pbt_best_ge_plain_best']} (gap {gap['gap']:+.1f}, "
        f"95% interval over the last {tail} updates [{gap['ci95'][0]:+.1f}, "
        f"{gap['ci95'][1]:+.1f}]); median gain {result['median_gain']:+.1f}; "
        f"wall {result['wall_s']}"
    )
    print(
        f"held out ({result['held_out_episodes']} episodes each): no-PBT pick member "
        f"{ho['no PBT']['pick']} {ho['no PBT']['pick_mean']:.1f}, PBT pick member "
        f"{ho['PBT']['pick']} {ho['PBT']['pick_mean']:.1f}, gap {ho['pick_gap']:+.1f} "
        f"+- {ho['pick_gap_se']:.1f} (s.e.)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _check(parser, args)
    work = args.work
    load = os.getloadavg()
    walls = {} if args.report_only else run_arms(args, work)
    runs = {
        "no PBT": read_rows(work / "plain" / "metrics.jsonl"),
        "PBT": read_rows(work / "pbt" / "metrics.jsonl"),
    }
    shortest = min(len(rows) for rows in runs.values())
    if args.tail > shortest:
        parser.error(f"--tail {args.tail} is more than an arm's {shortest} updates")
    result = build_result(args, work, runs, walls, load)
    result["command"] = "python benchmarks/pbt.py " + " ".join(argv or sys.argv[1:])
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(runs, RESULTS / f"{args.name}.png")
    if (work / "pbt" / "pbt_lineage.png").exists():
        shutil.copy(work / "pbt" / "pbt_lineage.png", RESULTS / f"{args.name}_lineage.png")
    print_report(result, args.tail)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
