"""Deep-ensemble training speed: n members at once over D devices vs one after another.

The members, data, batch order and epochs of ``examples/deep_ensemble.py`` (MLP on scikit-learn's
digits), trained two ways side by side in ONE process:

- ``loop``: how deep ensembles are usually trained (Fortuna's ``DeepEnsemble`` does this): member
  after member, each with a plain jitted single-model train step (params and Adam state donated),
  in a Python loop, on one device;
- ``ensemble``: ``ensemble.build`` + ``ensemble.train_step``: one donated jitted step trains every
  member on its own batch, the members spread over D devices (D = 1 and every core).

Both start from the same initial parameters and see the same batches; the final parameters are
compared (``max |diff|``). That column is a check against gross errors, not a precision figure:
Adam's step is about ``lr * sign(g)`` where ``|g|`` is near zero (dead ReLU units: about 2e5 of a
1024 x 1024 layer's weights have ``|g| < 1e-9`` on the first step), so two correct computations
whose gradients differ in the last bits (matmuls split differently over threads) end up to a few
``lr`` apart in those weights: 2.5e-3 after 40 steps of 8 members over 8 devices on an 8-core
host (a TPU VM's CPUs), while the first step's gradients agree to 4e-7 relative.

The speed is member-steps per second (optimizer steps summed over members); the goal is ``ensemble
over D devices >= 0.9 x D x loop``. Devices are simulated CPU devices, one per core
(``rollout.configure_cpu_devices``), so the loop's small ops run on one core; its large matmuls do
not stay on one (see ``configure_cpu_devices``), which is why D = 2 simulated devices cannot double
the loop's speed for wide members. ``loop, all cores`` is the same loop in a fresh process with
JAX's default CPU setup (one device using every core), the loop as a user would run it. Each way is
timed ``--repeats`` times, the ways interleaved so that load from other processes hits all alike;
the best is kept, and ``spread`` (slowest / fastest repeat) shows how much the load moved each way's
time.

Not a test: it times things. Run it on a quiet machine::

    python benchmarks/deep_ensemble.py            # writes benchmarks/results/deep_ensemble.*
    python benchmarks/deep_ensemble.py --members 2,8 --hidden 128,1024 --repeats 5
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def load_example():
    """``examples/deep_ensemble.py`` as a module (model, loss, data, batch order)."""
    spec = importlib.util.spec_from_file_location(
        "deep_ensemble", ROOT / "examples/deep_ensemble.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["deep_ensemble"] = module  # linen dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class Workload:
    """Data, model, per-member batch order and initial parameters shared by every way."""

    def __init__(self, de, members: int, hidden: int, epochs: int, batch: int = 64) -> None:
        import jax

        self.de = de
        self.cfg = de.Config(members=members, hidden=hidden, epochs=epochs, batch_size=batch)
        self.data = de.load_digits(self.cfg.test_fraction, self.cfg.seed)
        self.model = de.make_model(self.cfg)
        self.loss_fn = de.make_loss(self.model)
        self.order = de.batch_order(
            members, len(self.data.x_train), batch, epochs, self.cfg.seed, bootstrap=False
        )
        ens = de.ensemble.build(self.model, members, devices=jax.devices()[:1])
        key = jax.random.key(self.cfg.seed)
        self.init = jax.device_get(ens.init(key, self.data.x_train[:1])["params"])

    @property
    def member_steps(self) -> int:
        return self.order.shape[0] * self.order.shape[1]

    def calls(self, scan: bool):
        """The batch order as the calls of a run: ``[steps, n, batch]``, one step per call, or
        ``[epochs, steps per epoch, n, batch]``, one epoch per call (``scan``)."""
        if not scan:
            return self.order
        return self.order.reshape(self.cfg.epochs, -1, *self.order.shape[1:])


def time_loop(w: Workload, device, scan: bool = False) -> tuple[float, list]:
    """Members one after another, a plain jitted single-model step each (``scan``: one call
    per epoch, a ``lax.scan`` over its steps); (seconds, params)."""
    import jax
    import optax

    tx = optax.adam(w.cfg.lr)
    x, y = jax.device_put((w.data.x_train, w.data.y_train), device)

    def step(p, s, idx):
        loss, grads = jax.value_and_grad(w.loss_fn)(p, idx, x, y)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    def one(carry, idx):
        p, s, loss = step(*carry, idx)
        return (p, s), loss

    def epoch(p, s, idxs):
        (p, s), losses = jax.lax.scan(one, (p, s), idxs)
        return p, s, losses

    run = jax.jit(epoch if scan else step, donate_argnums=(0, 1))
    # The state goes to the device at once: an uncommitted Adam count would compile the step again.
    member = lambda i: jax.device_put(jax.tree.map(lambda a: a[i], w.init), device)
    init = lambda p: jax.device_put(tx.init(p), device)
    calls = w.calls(scan)  # [calls, (steps per call,) n, batch]
    warm = member(0)
    jax.block_until_ready(run(warm, init(warm), calls[0][..., 0, :]))  # compile outside the clock
    out = []
    t0 = time.perf_counter()
    for i in range(w.cfg.members):
        p = member(i)
        s = init(p)
        for idx in calls:
            p, s, _ = run(p, s, idx[..., i, :])
        out.append(p)
    jax.block_until_ready(out)
    return time.perf_counter() - t0, jax.device_get(out)


def time_ensemble(w: Workload, devices, scan: bool = False) -> tuple[float, list]:
    """Every member at once with ensemble.train_step over ``devices`` (``scan``: one
    ``step.scan`` call per epoch); (seconds, params)."""
    import jax
    import optax
    from jax.sharding import NamedSharding, PartitionSpec

    import ensemble

    ens = ensemble.build(w.model, w.cfg.members, devices=devices)
    train = ensemble.train_step(
        w.loss_fn,
        optax.adam(w.cfg.lr),
        n=ens.n,
        mesh=ens.mesh,
        per_member_batch=(True, False, False),
    )
    step = functools.partial(train.scan, stacked=(True, False, False)) if scan else train
    x, y = jax.device_put(
        (w.data.x_train, w.data.y_train), NamedSharding(ens.mesh, PartitionSpec())
    )
    place = lambda: ensemble.shard_members(w.init, ens.mesh, ens.n)
    calls = w.calls(scan)
    warm = place()
    jax.block_until_ready(step(warm, train.init(warm), calls[0], x, y))  # compile
    t0 = time.perf_counter()
    p = place()
    s = train.init(p)
    for idx in calls:
        p, s, _ = step(p, s, idx, x, y)
    jax.block_until_ready(p)
    seconds = time.perf_counter() - t0
    p = jax.device_get(p)
    return seconds, [jax.tree.map(lambda a, i=i: a[i], p) for i in range(w.cfg.members)]


def max_diff(a: list, b: list) -> float:
    import jax
    import numpy as np

    return max(
        float(np.max(np.abs(np.asarray(u) - np.asarray(v))))
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def loop_all_cores(members: int, hidden: int, epochs: int) -> float | None:
    """Seconds of the loop in a fresh process with JAX's default CPU setup (None if it failed)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    cmd = [sys.executable, __file__, "--worker-loop", f"{members},{hidden},{epochs}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        print(f"loop, all cores: failed: {proc.stderr.strip()[-500:]}", file=sys.stderr)
        return None
    return float(json.loads(proc.stdout.strip().splitlines()[-1])["seconds"])


def worker_loop(spec: str) -> None:
    import jax

    members, hidden, epochs = (int(v) for v in spec.split(","))
    w = Workload(load_example(), members, hidden, epochs)
    seconds, _ = time_loop(w, jax.devices()[0])
    print(json.dumps({"seconds": seconds, "cpu_devices": len(jax.devices())}))


def bench_one(de, members: int, hidden: int, epochs: int, repeats: int) -> dict:
    """Every way for one (members, hidden) pair; best of ``repeats`` interleaved timings."""
    import jax

    devices = jax.devices()
    w = Workload(de, members, hidden, epochs)
    layouts = sorted({1, len(devices)})
    times: dict[str, list[float]] = {}
    params: dict[str, list] = {}
    for _ in range(repeats):
        runs = {
            "loop": lambda: time_loop(w, devices[0]),
            "loop, scan": lambda: time_loop(w, devices[0], scan=True),
        }
        for d in layouts:
            if members % d == 0 or d % members == 0:
                runs[f"ensemble D={d}"] = lambda d=d: time_ensemble(w, devices[:d])
                runs[f"ensemble D={d}, scan"] = lambda d=d: time_ensemble(w, devices[:d], True)
        runs["loop, all cores"] = lambda: (loop_all_cores(members, hidden, epochs), None)
        for name, fn in runs.items():
            seconds, p = fn()
            if seconds is not None:
                times.setdefault(name, []).append(seconds)
            if p is not None:
                params[name] = p
    best = {name: min(t) for name, t in times.items()}
    rate = {name: w.member_steps / s for name, s in best.items()}
    loop = rate["loop"]
    ways = []
    for name, r in rate.items():
        d = int(name.split("D=")[1].split(",")[0]) if "D=" in name else None
        ways.append(
            {
                "way": name,
                "devices": d,
                "member_steps_per_s": r,
                "seconds": best[name],
                "seconds_all": times[name],
                # the noise: slowest over fastest of the interleaved repeats
                "spread": max(times[name]) / best[name],
                "x_loop": r / loop,
                "goal_x_loop": 0.9 * d if d else None,
                "goal_met": (r >= 0.9 * d * loop) if d else None,
                "max_abs_param_diff_vs_loop": (
                    max_diff(params[name], params["loop"]) if name in params else None
                ),
            }
        )
    return {"members": members, "hidden": hidden, "epochs": epochs,
            "member_steps": w.member_steps, "ways": ways}  # fmt: skip


def machine() -> dict:
    import jax

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "load_average_1min_at_start": os.getloadavg()[0],
        "jax": jax.__version__,
        "cpu_devices": len(jax.devices()),
    }


def format_table(rows: list[dict]) -> str:
    head = (
        f"{'n':>3} {'hidden':>6} {'epochs':>6} {'way':>19} {'member-steps/s':>15} {'x loop':>7} "
        f"{'goal':>13} {'max|diff|':>9} {'spread':>6}"
    )
    lines = [head]
    for row in rows:
        for way in row["ways"]:
            goal = ""
            if way["goal_x_loop"]:  # the verdict, which rounding of x loop could hide
                goal = f"{'met' if way['goal_met'] else 'MISSED'} >={way['goal_x_loop']:.1f}"
            diff = way["max_abs_param_diff_vs_loop"]
            lines.append(
                f"{row['members']:>3} {row['hidden']:>6} {row['epochs']:>6} {way['way']:>19} "
                f"{way['member_steps_per_s']:>15,.0f} {way['x_loop']:>6.2f}x {goal:>13} "
                f"{'' if diff is None else f'{diff:.1e}':>9} {way['spread']:>5.2f}x"
            )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(max(3.6 * len(rows), 7.5), 4), squeeze=False)
    for ax, row in zip(axes[0], rows):
        names = [w["way"] for w in row["ways"]]
        rates = [w["member_steps_per_s"] for w in row["ways"]]
        colors = ["tab:green" if "ensemble" in n else "tab:gray" for n in names]
        ax.bar(range(len(names)), rates, color=colors)
        loop = row["ways"][0]["member_steps_per_s"]
        for i, w in enumerate(row["ways"]):
            if w["goal_x_loop"]:
                ax.hlines(w["goal_x_loop"] * loop, i - 0.4, i + 0.4, colors="k", linestyles="--")
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(f"n={row['members']}, hidden={row['hidden']}", fontsize=9)
        ax.set_ylabel("member-steps/s")
    fig.suptitle("deep ensemble training: one step for all members vs a loop (dashed: goal)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def positive_ints(text: str) -> list[int]:
    """An argparse ``type``: comma-separated integers >= 1 (``2,8``), else one line."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = [0]
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1 like 2,8, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> dict:
    from rollout.ppo._parser import OneLineParser, non_negative_int, positive_int, writable_dir

    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--members", type=positive_ints, default=[2, 8], help="ensemble sizes, e.g. 2,8"
    )
    parser.add_argument("--hidden", type=positive_ints, default=[128, 1024], help="MLP widths")
    parser.add_argument(
        "--epochs",
        type=non_negative_int,
        default=0,
        help="per run (0: 20 x 128 / hidden, at least 2)",
    )
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--out", type=writable_dir, help=f"output folder (default {RESULTS})")
    parser.add_argument("--worker-loop", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker_loop:  # a child: writes nothing, so takes no --out
        return worker_loop(args.worker_loop)
    args.out = args.out or parser.results_dir(RESULTS)
    import rollout

    rollout.configure_cpu_devices(len(os.sched_getaffinity(0)))
    de = load_example()
    try:
        num_train = len(de.load_digits().x_train)
    except ValueError as e:  # scikit-learn missing: one line
        parser.error(str(e))
    # Enough steps that a small model's run lasts about as long as a big one's.
    epochs = {h: args.epochs or max(2, round(20 * 128 / h)) for h in args.hidden}
    for hidden, members in itertools.product(args.hidden, args.members):  # before any run
        try:
            cfg = de.Config(members=members, hidden=hidden, epochs=epochs[hidden])
            de.check_fits(cfg, num_train)
        except ValueError as e:
            parser.error(str(e))
    report = {"machine": machine(), "rows": []}
    for hidden in args.hidden:
        for members in args.members:
            row = bench_one(de, members, hidden, epochs[hidden], args.repeats)
            report["rows"].append(row)
            print("\n".join(format_table([row]).splitlines()[1:]), flush=True)
    table = format_table(report["rows"])
    (args.out / "deep_ensemble.txt").write_text(table + "\n")
    (args.out / "deep_ensemble.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(report["rows"], args.out / "deep_ensemble.png")
    print(report["machine"])
    print(table)
    return report


if __name__ == "__main__":
    main()
