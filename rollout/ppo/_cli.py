"""The main job: ``python -m rollout.ppo`` trains an n-member PPO ensemble, logs, checkpoints.

JAX reads its CPU device count once, when the backend starts, so :func:`main` parses the command
line first, configures the CPU devices, and only then imports the learner.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

_THREAD_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def cpu_devices_for(members: int, cores: int) -> int:
    """How many simulated CPU devices the learner should use for ``members`` on ``cores`` cores.

    The smallest divisor of ``members`` that is >= ``cores`` (every core busy, whole members per
    device), or ``members`` itself when there is none (fewer members than cores: one each).

    Example:
      >>> [cpu_devices_for(n, 2) for n in (1, 2, 3, 4, 8)], cpu_devices_for(100, 16)
      ([1, 2, 3, 2, 2], 20)
    """
    cores = max(1, cores)
    for d in range(cores, members + 1):
        if members % d == 0:
            return d
    return members


def configure_devices(num_cpu_devices: int) -> None:
    """Sets the CPU device count and one thread per device; must run before JAX starts."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_multi_thread_eigen" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {_THREAD_FLAGS}".strip()
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", int(num_cpu_devices))
    except RuntimeError as e:  # JAX already started (e.g. main() called from a live session)
        have = len(jax.devices("cpu"))
        if have < num_cpu_devices:
            raise RuntimeError(
                f"JAX already started with {have} CPU devices; {num_cpu_devices} are needed. "
                "Run the CLI in a fresh process."
            ) from e


def train(
    config: Any,
    out: str | os.PathLike | None = None,
    *,
    resume: bool = False,
    progress: bool = True,
    checkpoint_every: int = 10,
    devices: Sequence[Any] | None = None,
    learner: Any = None,
    on_update: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[Any, list[dict[str, Any]]]:
    """Trains ``config`` to ``config.total_steps``; returns the final state and the metric rows.

    With ``out``: one JSON row per update in ``out/metrics.jsonl``, the learning curves in
    ``out/learning_curve.png``, and a checkpoint every ``checkpoint_every`` jitted calls (and at
    the end) in ``out/``. ``resume=True`` continues from the newest checkpoint there, exactly as
    the uninterrupted run would (metric rows past the checkpoint are dropped and recomputed).
    ``learner``: reuse an existing :class:`Learner` for ``config`` (and its compiled programs).
    ``on_update``: called with each metric row as it arrives.

    Example:
      >>> import jax
      >>> from rollout.ppo import PPOConfig, train
      >>> cfg = PPOConfig.for_env("cartpole", members=jax.device_count(), total_steps=1024)
      >>> state, rows = train(cfg, progress=False)
      >>> sorted(rows[-1])[:3], rows[-1]["env_steps"]
      (['approx_kl', 'clipfrac', 'entropy'], 1024)
    """
    import jax

    from rollout.ppo import _checkpoint as ckpt
    from rollout.ppo import _pbt
    from rollout.ppo._learner import METRIC_NAMES, Learner, to_host

    owned = learner is None  # close what we open (env_on='cpu' worker processes)
    if learner is None:
        learner = Learner(config, devices=devices)
    elif learner.config != config:
        raise ValueError("learner= was built for a different config than config=.")
    cfg = learner.config
    out = Path(out) if out is not None else None
    rows: list[dict[str, Any]] = []
    state = None
    if resume:
        if out is None:
            raise ValueError("resume=True needs out= (the directory with the checkpoints).")
        path = ckpt.latest(out)
        if path is not None:
            saved = ckpt.read_meta(path)["config"]
            mine = cfg.to_dict()
            diff = sorted(k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k))
            if diff:
                raise ValueError(
                    f"--resume: checkpoint {path} was written with a different config; "
                    f"differences in {diff} (saved {[saved.get(k) for k in diff]}, now "
                    f"{[mine.get(k) for k in diff]})."
                )
            state = ckpt.restore(path, learner.state_shapes(), learner.state_shardings())
    if state is None:
        state = learner.init()
    done = int(jax.device_get(state.update))  # replicated: every process has it
    main = jax.process_index() == 0  # the one process that writes metrics and the plot
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        rows = _read_rows(out / "metrics.jsonl", upto=done) if done else []
        if main:
            _write_rows(out / "metrics.jsonl", rows)

    bar = _progress(cfg, done, enabled=progress)
    calls = 0
    start, steps_at_start = None, done  # throughput: from the end of the first (compiling) call
    try:
        while done < cfg.num_updates:
            k = _pbt.chunk(cfg, done, min(cfg.updates_per_call, cfg.num_updates - done))
            state, metrics = learner.update(state, k)
            host = to_host(metrics)  # [n, k] scalars per member: the only gather
            new_rows = []
            for j in range(k):
                u = done + j + 1
                row: dict[str, Any] = {"update": u, "env_steps": u * cfg.batch_size}
                for name in METRIC_NAMES:
                    row[name] = [_json_float(v) for v in host[name][:, j]]
                new_rows.append(row)
            done += k
            if cfg.pbt:  # lineage into the rows; every pbt_interval updates, exploit/explore
                state = _pbt.after_updates(learner, state, rows, new_rows, done)
            calls += 1
            if start is None:
                start, steps_at_start, sps = time.perf_counter(), done, None
            else:
                elapsed = time.perf_counter() - start
                sps = (done - steps_at_start) * cfg.batch_size * cfg.members / max(elapsed, 1e-9)
            for row in new_rows:
                row["env_steps_per_s"] = sps  # all members together, compile excluded
                if on_update is not None:
                    on_update(row)
            rows.extend(new_rows)
            if out is not None:
                if main:
                    _append_rows(out / "metrics.jsonl", new_rows)
                if calls % checkpoint_every == 0 or done >= cfg.num_updates:
                    ckpt.save(out, state, cfg)  # collective: every process calls it
            if bar is not None:
                bar.update(k * cfg.batch_size)
                bar.set_postfix_str(_postfix(new_rows[-1]["returns"], sps), refresh=False)
    finally:
        if bar is not None:
            bar.close()
        if owned:
            learner.close()
    if out is not None and rows and main:
        plot_curves(_read_rows(out / "metrics.jsonl"), out / "learning_curve.png", cfg.env)
        if cfg.pbt:
            _pbt.plot_lineage(_read_rows(out / "metrics.jsonl"), out / "pbt_lineage.png", cfg.env)
    return state, rows


def plot_curves(rows: list[dict[str, Any]], path: str | os.PathLike, title: str = "") -> None:
    """One line per member: mean episode return against env steps per member."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        return
    steps = [r["env_steps"] for r in rows]
    n = len(rows[0]["returns"])
    fig, ax = plt.subplots(figsize=(7, 4))
    for i in range(n):
        ys = [r["returns"][i] if r["returns"][i] is not None else math.nan for r in rows]
        ax.plot(steps, ys, lw=1.2, label=f"member {i}")
    ax.set_xlabel("env steps per member")
    ax.set_ylabel("mean episode return")
    ax.set_title(f"ensemble PPO {title} (n={n})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _postfix(returns: list[float | None], sps: float | None) -> str:
    rets = " ".join("-" if r is None else f"{r:.0f}" for r in returns[:8])
    more = " ..." if len(returns) > 8 else ""
    speed = "compiling" if sps is None else f"{sps:,.0f} env steps/s (all members)"
    return f"{speed} | returns {rets}{more}"


def _progress(cfg: Any, done: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(
        total=cfg.num_updates * cfg.batch_size,
        initial=done * cfg.batch_size,
        unit="step",
        unit_scale=True,
        dynamic_ncols=True,
        desc=f"PPO {cfg.env} x{cfg.members} (steps/member)",
    )


def _json_float(v: Any) -> float | None:
    v = float(v)
    return None if not math.isfinite(v) else float(f"{v:.7g}")  # float32 has ~7 digits


def _read_rows(path: Path, upto: int | None = None) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a crash
            continue
        if upto is None or row.get("update", 0) <= upto:
            rows.append(row)
    return rows


def _write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _append_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


# ---------------------------------------------------------------------- command line


def _floats(text: str) -> float | tuple[float, ...]:
    values = tuple(float(v) for v in text.replace(",", " ").split())
    if not values:
        raise argparse.ArgumentTypeError("expected one number or a list like 3e-4,1e-3")
    return values[0] if len(values) == 1 else values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m rollout.ppo",
        description="Train an ensemble of PPO agents, one per device (CleanRL defaults per env).",
    )
    p.add_argument("--env", default="cartpole", help="cartpole (CartPole-v1) or pendulum")
    p.add_argument("--members", type=int, default=4, help="number of agents (default 4)")
    p.add_argument(
        "--total-steps",
        type=int,
        default=None,
        help="env steps per member (default: 500k CartPole, 1M Pendulum)",
    )
    p.add_argument("--out", default="runs/ppo", help="output dir: metrics.jsonl, PNG, checkpoints")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    p.add_argument("--seed", type=int, default=0, help="root seed; members get split keys")
    p.add_argument(
        "--env-on",
        choices=("device", "cpu"),
        default="device",
        help="envs vmapped next to each member, or on host CPU cores via rollout.on_cpu",
    )
    p.add_argument("--lr", type=_floats, default=None, help="learning rate, or one per member")
    p.add_argument("--ent-coef", type=_floats, default=None, help="entropy coef, or one per member")
    p.add_argument("--clip-coef", type=_floats, default=None, help="clip range, or one per member")
    p.add_argument("--num-envs", type=int, default=None, help="parallel envs per member")
    p.add_argument("--num-steps", type=int, default=None, help="rollout length per update")
    p.add_argument("--updates-per-call", type=int, default=None, help="PPO updates per jit call")
    p.add_argument("--pbt", action="store_true", help="population-based training of the members")
    p.add_argument("--pbt-interval", type=int, default=None, help="PPO updates between PBT steps")
    p.add_argument("--pbt-fraction", type=float, default=None, help="bottom/top fraction (0.25)")
    p.add_argument("--pbt-factors", type=_floats, default=None, help="perturbations (0.8,1.2)")
    p.add_argument("--pbt-window", type=int, default=None, help="updates averaged for ranking")
    p.add_argument("--checkpoint-every", type=int, default=10, help="jit calls per checkpoint")
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        help="CPU-only hosts: simulated devices for the members (default: cpu_devices_for)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    g = p.add_argument_group(
        "several processes / hosts",
        "default: $JAX_COORDINATOR_ADDRESS, $ENSEMBLE_NUM_PROCESSES, $ENSEMBLE_PROCESS_ID (set "
        "by python -m ensemble.launch), else SLURM / Open MPI / Kubernetes detection, else one "
        "process",
    )
    g.add_argument("--coordinator", default=None, help="host:port of process 0")
    g.add_argument("--num-processes", type=int, default=None)
    g.add_argument("--process-id", type=int, default=None)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m rollout.ppo`` and the ``ensemble-ppo`` console script."""
    args = build_parser().parse_args(argv)
    if args.members <= 0:
        print(f"error: --members must be positive, got {args.members}", file=sys.stderr)
        return 2
    cores = os.cpu_count() or 1
    from ensemble import _distributed as distributed

    procs = args.num_processes or int(os.environ.get(distributed.ENV_NUM_PROCESSES) or 1)
    if args.members % procs:
        print(
            f"error: --members {args.members} must be a multiple of the number of processes "
            f"({procs}): every process holds the same number of members.",
            file=sys.stderr,
        )
        return 2
    # Devices per process for this process's members (on CPU-only hosts).
    learner_devices = args.devices or cpu_devices_for(args.members // procs, cores)
    configure_devices(max(learner_devices, cores))
    # Joins the other processes (if any) before JAX starts; a no-op for a single process.
    info = distributed.initialize(args.coordinator, args.num_processes, args.process_id)

    import jax

    from rollout.ppo._config import PPOConfig

    overrides: dict[str, Any] = {"members": args.members, "seed": args.seed}
    overrides["env_on"] = args.env_on
    for flag, field in (
        ("total_steps", "total_steps"),
        ("lr", "learning_rate"),
        ("ent_coef", "ent_coef"),
        ("clip_coef", "clip_coef"),
        ("num_envs", "num_envs"),
        ("num_steps", "num_steps"),
        ("updates_per_call", "updates_per_call"),
        ("pbt", "pbt"),
        ("pbt_interval", "pbt_interval"),
        ("pbt_fraction", "pbt_fraction"),
        ("pbt_factors", "pbt_factors"),
        ("pbt_window", "pbt_window"),
    ):
        value = getattr(args, flag)
        if value is not None:
            overrides[field] = value
    try:
        config = PPOConfig.for_env(args.env, **overrides)
        # On a CPU-only host the members use the first `learner_devices` CPU devices; on an
        # accelerator host, all accelerators.
        # Each process contributes its first `learner_devices` devices, in process order, so
        # every process holds members (jax.devices() lists all processes' devices).
        devices = (
            [
                d
                for p in range(info.num_processes)
                for d in [d for d in jax.devices() if d.process_index == p][:learner_devices]
            ]
            if jax.default_backend() == "cpu"
            else None
        )
        n_dev = len(devices) if devices is not None else jax.device_count()
        from rollout.ppo._env import known_envs

        config.validate(num_devices=n_dev, known_envs=known_envs())
    except (ValueError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"ensemble PPO: env={config.env} members={config.members} processes={info.num_processes} "
        f"devices={n_dev}x{jax.default_backend()} env_on={config.env_on} "
        f"total_steps/member={config.num_updates * config.batch_size} out={args.out}",
        file=sys.stderr,
    )
    _, rows = train(
        config,
        args.out,
        resume=args.resume,
        progress=not args.no_progress and info.is_main,
        checkpoint_every=args.checkpoint_every,
        devices=devices,
    )
    if rows and info.is_main:
        final = ", ".join("-" if r is None else f"{r:.1f}" for r in rows[-1]["returns"])
        print(f"final returns per member: [{final}]  ({args.out}/metrics.jsonl)")
    return 0
