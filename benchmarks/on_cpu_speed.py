"""Throughput of a heavy sequential rollout (a GRU synthesising audio sample by sample) on CPUs.

Rows of the table, for each batch size:

- ``naive``: ``jax.jit(render)`` on one CPU device (the naive first attempt: everything on one
  device; with one thread per device that is one core).
- ``direct``: the same function called directly, ``jit(shard_map(render))`` over k CPU devices,
  no callback: the reference for the callback's overhead at k cores.
- ``inprocess`` / ``process``: ``rollout.on_cpu(render, executor=...)`` with k workers, called
  from a jitted caller on one device (the only caller for which ``'inprocess'`` is safe on a
  CPU-only host; the process executor is safe from any caller).

speed-up = samples/s over one core (the faster of naive and direct at k=1); overhead = time /
direct time at the same k, minus 1; both from the best of ``--reps`` rounds (medians printed too).
Goals: speed-up >= 0.85 x cores, overhead <= 10 % at batch >= 64.

    python benchmarks/on_cpu_speed.py                 # ~2 min on 2 cores
    python benchmarks/on_cpu_speed.py --batches 64 256 1024 --samples 4096 --reps 7

Writes benchmarks/results/on_cpu_speed.json and benchmarks/results/on_cpu_speed.png. Figures on a
machine shared with other work are noisy: the JSON records the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import jax  # noqa: E402

import rollout  # noqa: E402
from rollout.ppo._parser import OneLineParser, positive_int, writable_dir  # noqa: E402

rollout.configure_cpu_devices()  # one CPU device and one thread per core, before JAX starts

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from rollout.envs import init_synth_params, synthesize  # noqa: E402


def make_render(samples: int, hidden: int):
    t = jnp.arange(samples, dtype=jnp.float32) / 16000.0

    def render(synth_params, gain_freq):
        def one(gf):
            excitation = gf[0] * jnp.sin(2 * jnp.pi * gf[1] * t)
            return synthesize(synth_params, jnp.zeros((hidden,), jnp.float32), excitation)[1]

        return jax.vmap(one)(gain_freq)

    return render


def timeit(configs, reps: int) -> list[tuple[float, float]]:
    """(best, median) seconds per call of each (fn, args). Configurations are timed in turns,
    one call each per round, so that load from other processes spreads evenly over them; the
    best of the rounds is the least disturbed one, and what the figures below are computed from."""
    for fn, args in configs:
        for _ in range(2):  # compile, start workers, warm caches
            jax.block_until_ready(fn(*args))
    times: list[list[float]] = [[] for _ in configs]
    for _ in range(reps):
        for (fn, args), ts in zip(configs, times):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            ts.append(time.perf_counter() - t0)
    return [(min(ts), statistics.median(ts)) for ts in times]


def main(argv=None) -> None:
    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batches", type=positive_int, nargs="+", default=[64, 256])
    ap.add_argument("--samples", type=positive_int, default=2048)
    ap.add_argument("--hidden", type=positive_int, default=32)
    ap.add_argument("--reps", type=positive_int, default=7)
    ap.add_argument("--out", type=writable_dir, default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)

    cpus = jax.devices("cpu")
    render = make_render(args.samples, args.hidden)
    params = jax.device_put(init_synth_params(jax.random.key(0), args.hidden), cpus[0])
    load_before = os.getloadavg()
    rows = []
    for batch in args.batches:
        rows += measure_batch(render, params, batch, args.samples, args.reps, cpus)
    add_ratios(rows)
    load_after = os.getloadavg()
    print_table(rows)
    print(f"load average before {load_before}, after {load_after} on {os.cpu_count()} cores")

    meta = dict(
        command=" ".join([os.path.relpath(sys.argv[0]), *(argv or sys.argv[1:])]),
        date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        jax=jax.__version__,
        python=platform.python_version(),
        cpu_devices=len(cpus),
        cpu_count=os.cpu_count(),
        samples=args.samples,
        hidden=args.hidden,
        reps=args.reps,
        load_average_before=load_before,
        load_average_after=load_after,
    )
    with open(os.path.join(args.out, "on_cpu_speed.json"), "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    plot(rows, len(cpus), os.path.join(args.out, "on_cpu_speed.png"))
    print(f"wrote {args.out}/on_cpu_speed.json and on_cpu_speed.png")


def measure_batch(render, params, batch: int, samples: int, reps: int, cpus) -> list[dict]:
    """One batch of rows rendered every way (naive, direct, both ``on_cpu`` executors) on 1..all
    cores, timed interleaved; each way's output is checked against the naive one first."""
    rng = np.random.default_rng(batch)
    gf = np.stack(
        [rng.uniform(0, 2, batch), np.exp(rng.uniform(np.log(110), np.log(880), batch))], -1
    ).astype(np.float32)
    x = jax.device_put(gf, cpus[0])
    print(f"batch {batch}:", flush=True)
    ref = np.asarray(jax.jit(render)(params, x))
    configs = [("naive", 1, jax.jit(render), (params, x))]
    wrappers = []
    for k in range(1, len(cpus) + 1):
        mesh = jax.sharding.Mesh(np.array(cpus[:k]), ("w",))
        direct = jax.jit(
            jax.shard_map(
                render, mesh=mesh, in_specs=(P(), P("w")), out_specs=P("w"), check_vma=False
            )
        )
        pad = -(-batch // k) * k
        xk = np.concatenate([gf, gf[: pad - batch]])
        xk = jax.device_put(xk, NamedSharding(mesh, P("w")))
        pk = jax.device_put(params, NamedSharding(mesh, P()))
        configs.append(("direct", k, direct, (pk, xk)))
        for executor in ("inprocess", "process"):
            f = rollout.on_cpu(render, in_axes=(None, 0), executor=executor, workers=k)
            step = jax.jit(f)
            np.testing.assert_allclose(np.asarray(step(params, x)), ref, atol=1e-5)
            configs.append((executor, k, step, (params, x)))
            wrappers.append(f)
    rows = []
    for (mode, k, _, _), (seconds, median) in zip(
        configs, timeit([(fn, a) for _, _, fn, a in configs], reps)
    ):
        rows.append(
            dict(
                batch=batch,
                mode=mode,
                cores=k,
                seconds=seconds,
                median_seconds=median,
                samples_per_s=batch * samples / seconds,
            )
        )
        print(f"  {mode:9s} k={k}  {seconds * 1e3:8.1f} ms/call (median {median * 1e3:.1f})")
    for f in wrappers:
        f.close()
    return rows


def add_ratios(rows: list[dict]) -> None:
    """``speedup`` over one core and ``overhead`` over ``direct`` at the same cores, per row."""
    # One core's throughput: the faster of naive and direct at k=1 (so no speed-up is flattered).
    base = {}
    for r in rows:
        if r["cores"] == 1 and r["mode"] in ("naive", "direct"):
            base[r["batch"]] = min(base.get(r["batch"], np.inf), r["seconds"])
    direct = {(r["batch"], r["cores"]): r["seconds"] for r in rows if r["mode"] == "direct"}
    for r in rows:
        r["speedup"] = base[r["batch"]] / r["seconds"]
        r["overhead"] = r["seconds"] / direct[r["batch"], r["cores"]] - 1.0


def print_table(rows: list[dict]) -> None:
    header = f"{'batch':>6} {'mode':>10} {'cores':>5} {'ms/call':>9} {'median':>8} "
    header += f"{'Msamples/s':>11} {'speed-up':>9} {'overhead':>9}"
    print("\n" + header)
    for r in rows:
        print(
            f"{r['batch']:>6} {r['mode']:>10} {r['cores']:>5} {r['seconds'] * 1e3:>9.1f} "
            f"{r['median_seconds'] * 1e3:>8.1f} {r['samples_per_s'] / 1e6:>11.2f} "
            f"{r['speedup']:>8.2f}x {100 * r['overhead']:>8.1f}%"
        )


def plot(rows, cores, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        sel = [r for r in rows if r["batch"] == batch]
        one = max(r["samples_per_s"] for r in sel if r["cores"] == 1 and r["mode"] != "inprocess"
                  and r["mode"] != "process") / 1e6  # fmt: skip
        ks = list(range(1, cores + 1))
        ax.plot(ks, [one * k for k in ks], "k:", label="ideal (one core x cores)")
        ax.plot(ks, [one * 0.85 * k for k in ks], "k--", lw=0.8, label="goal 0.85 x cores")
        ax.plot([1], [sel[0]["samples_per_s"] / 1e6], "kx", label="naive")
        for mode, style in (("direct", "s-"), ("inprocess", "o-"), ("process", "^-")):
            pts = sorted((r["cores"], r["samples_per_s"] / 1e6) for r in sel if r["mode"] == mode)
            ax.plot(*zip(*pts), style, label=mode)
        ax.set(title=f"batch {batch}", xlabel="CPU cores", ylabel="M samples / s", xticks=ks)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
