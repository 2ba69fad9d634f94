"""Learning on other libraries' envs: HalfCheetah-v5 (gymnasium, MuJoCo) and Acrobot-v1 (gymnax).

Each run is the CLI contract, 4 members, CleanRL's hyperparameters (the defaults the CLI picks by
action space: ``ppo_continuous_action.py`` for HalfCheetah, ``ppo.py`` for Acrobot)::

    python -m rollout.ppo --env gymnasium:HalfCheetah-v5 --members 4 --total-steps 1000000 --out DIR
    python -m rollout.ppo --env gymnax:Acrobot-v1 --members 4 --total-steps 500000 --out DIR

and is compared with CleanRL's published figures (``docs/benchmark/ppo_continuous_action.md``
and ``docs/rl-algorithms/ppo.md`` of vwxyzjn/cleanrl: HalfCheetah-v4 1442.64 +- 46.03 at 1M
steps, 3 seeds; Acrobot-v1 -86.36 +- 1.32 at 500k). A member's final return is the mean return of
the episodes that finished in the last 5% of its steps (what CleanRL's curves end on).

Goals: HalfCheetah mean final >= 1442.64 and no member below half of it; Acrobot every member
>= -100.

Not a test: long runs. ``--runs DIR`` keeps the run directories (default ``runs/learning``);
an existing finished run is summarised, not re-run. Writes ``benchmarks/results/learning_envs``
``.{json,txt,png}``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

#: env -> (total steps per member, CleanRL mean, CleanRL std, goal text)
RUNS = {
    "gymnasium:HalfCheetah-v5": (1_000_000, 1442.64, 46.03, "mean >= 1442.64, min >= 721.32"),
    "gymnax:Acrobot-v1": (500_000, -86.36, 1.32, "every member >= -100"),
}


def run(env: str, steps: int, out: Path, members: int) -> tuple[float, int]:
    """Trains (unless ``out`` already holds a finished run) and resumes an unfinished one.

    Returns the wall seconds of this call and the env steps per member it started from (so a
    resumed or reused run's seconds are not read as the whole run's).
    """
    rows = _rows(out)
    start_steps = rows[-1]["env_steps"] if rows else 0
    if rows:
        cfg = json.loads((out / "run.json").read_text())["config"]
        if steps - start_steps < cfg["num_envs"] * cfg["num_steps"]:
            return 0.0, start_steps  # finished: total steps are whole updates
    cmd = [sys.executable, "-m", "rollout.ppo", "--env", env, "--members", str(members),
           "--total-steps", str(steps), "--out", str(out), "--no-progress"]  # fmt: skip
    cmd += ["--resume"] if rows else []
    start = time.perf_counter()
    if subprocess.run(cmd, cwd=ROOT).returncode:  # the run printed why
        raise SystemExit(f"learning_envs.py: the run of {env} failed: {' '.join(cmd)}")
    return time.perf_counter() - start, start_steps


def _rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def final_returns(rows: list[dict], tail: float = 0.05) -> list[float]:
    """Per member: the episode-weighted mean return over the rows of the last ``tail`` of steps."""
    last = rows[-1]["env_steps"]
    kept = [r for r in rows if r["env_steps"] > last * (1 - tail)]
    out = []
    for m in range(len(rows[-1]["returns"])):
        pairs = [(r["returns"][m], r["episodes"][m]) for r in kept if r["episodes"][m]]
        total = sum(e for _, e in pairs)
        out.append(sum(ret * e for ret, e in pairs) / total if total else float("nan"))
    return out


def summarise(env: str, out: Path, seconds: float, started_at: int = 0) -> dict:
    _, ref, ref_std, goal = RUNS[env]
    rows = _rows(out)
    final = final_returns(rows)
    mean = sum(final) / len(final)
    met = (mean >= ref and min(final) >= ref / 2) if ref > 0 else min(final) >= -100
    return dict(env=env, env_steps=rows[-1]["env_steps"], final=final, mean=mean, min=min(final),
                cleanrl=f"{ref} +- {ref_std}", goal=goal, met=bool(met), seconds=seconds,
                started_at=started_at,
                curve=[(r["env_steps"], r["returns"]) for r in rows])  # fmt: skip


def main() -> None:
    from rollout.ppo._parser import OneLineParser, positive_int, writable_dir

    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--envs", nargs="+", choices=list(RUNS), default=list(RUNS))
    p.add_argument("--members", type=positive_int, default=4)
    p.add_argument(
        "--runs",
        type=writable_dir,
        default=str(ROOT / "runs" / "learning"),
        metavar="DIR",
        help="folder that keeps the run directories (default runs/learning)",
    )
    args = p.parse_args()
    p.results_dir(RESULTS)
    from rollout.ppo import PPOConfig

    for env in args.envs:  # a missing extra is one line now, not after the runs before it
        try:
            PPOConfig.for_env(env, members=args.members)
        except ValueError as e:
            p.error(f"--envs {env}: {str(e).splitlines()[0]}")
    results = []
    for env in args.envs:
        out = args.runs / env.replace(":", "_")
        seconds, started_at = run(env, RUNS[env][0], out, args.members)
        results.append(summarise(env, out, seconds, started_at))
    report(results)


def report(results: list[dict]) -> None:
    lines = [f"{'env':26s} {'steps/member':>12s} {'final per member':>36s} {'mean':>9s} "
             f"{'CleanRL':>16s}  goal"]  # fmt: skip
    for r in results:
        per = ", ".join(f"{x:.1f}" for x in r["final"])
        verdict = "met" if r["met"] else "NOT met"
        lines.append(f"{r['env']:26s} {r['env_steps']:12,d} {per:>36s} {r['mean']:9.1f} "
                     f"{r['cleanrl']:>16s}  {r['goal']}: {verdict}")  # fmt: skip
    text = "\n".join(lines)
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "learning_envs.txt").write_text(text + "\n")
    (RESULTS / "learning_envs.json").write_text(json.dumps(results, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.6), squeeze=False)
    for ax, r in zip(axes[0], results):
        steps = [s for s, _ in r["curve"]]
        for m in range(len(r["final"])):
            ax.plot(steps, [ret[m] for _, ret in r["curve"]], lw=0.8, label=f"member {m}")
        ax.axhline(float(r["cleanrl"].split()[0]), color="k", ls="--", lw=1, label="CleanRL")
        ax.set_title(r["env"], fontsize=9)
        ax.set_xlabel("env steps per member")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("episode return")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "learning_envs.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
