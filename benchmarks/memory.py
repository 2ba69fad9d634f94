"""Per-device memory of a fixed ensemble spread over D = 1, 2, 4, 8 devices, linen and NNX.

What is compared: ONE ensemble of ``--members`` (default 8) MLP members, ``--params-mb``
(default about 76 MB) of float32 parameters in total, placed by ``ensemble.build`` on D devices
(``8 / D`` members per device; one member per device at D = 8). Per device, the largest over the
D devices used, it measures:

- ``state``: live bytes of parameters + Adam state (``ensemble.live_memory``: addressable shards);
- ``init``: peak of the compiled init program (``ensemble.compiled_memory``);
- ``step``: peak of the compiled, donated train step (argument + output + temp - alias), with
  its ``alias`` (donated bytes reused) and ``temp`` (activations, gradients).

The 1-device figure is the whole ensemble on one device; the goal is that each device
needs no more than its share: ``ratio = per_device(D) / (per_device(1) / D) <= 1.05`` for the
state and for the train step. The batch is shared by all members (replicated, a constant per
device), so it is kept small next to the parameters, as in real ensembles.

Only lowering and compiling happen for the step (no training run), so this is cheap; the state is
really initialised (it is what ``state`` measures). Results: a table on stdout,
``benchmarks/results/memory.json``, ``memory.txt`` and ``memory.png``.

Run: ``python benchmarks/memory.py`` (about a minute on 2 cores; 8 simulated CPU devices), or
``python benchmarks/memory.py --api linen`` for one API.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import pathlib
import platform
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import optax

import ensemble

MB = 1e6
GOAL = 1.05


def _simulate_cpu_devices(count: int) -> None:
    """Simulated CPU devices, one thread each; must run before JAX starts a backend."""
    os.environ.setdefault(
        "XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    )
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:  # a backend is already up (e.g. imported from a test): keep it
        pass


# ---------------------------------------------------------------------- the model


class LinenMLP(nn.Module):
    """A plain MLP; members are whole on their device(s), so no member-internal annotations."""

    hidden: int
    depth: int
    out: int = 10

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for _ in range(self.depth):
            x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(self.out)(x)


def _member_params(d_in: int, hidden: int, depth: int, out: int = 10) -> int:
    sizes = [d_in] + [hidden] * depth + [out]
    return sum(a * b + b for a, b in itertools.pairwise(sizes))


def _batch(args: argparse.Namespace) -> tuple[jax.Array, jax.Array]:
    kx, ky = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (args.batch, args.input_dim))
    y = jax.random.randint(ky, (args.batch,), 0, 10)
    return x, y


def _per_device(mem: dict[jax.Device, int], devices: list[jax.Device]) -> int:
    return max(mem.get(d, 0) for d in devices)


# ---------------------------------------------------------------------- linen


def measure_linen(args: argparse.Namespace, devices: list[jax.Device]) -> dict[str, Any]:
    n = args.members
    ens = ensemble.build(LinenMLP(args.hidden, args.depth), n, devices=devices)
    x, y = _batch(args)
    key = jax.random.key(0)
    init = ensemble.compiled_memory(ens.lower_init(key, x))
    params = ens.init(key, x)["params"]

    def loss_fn(p, x, y):  # one member's loss
        logits = ens.model.apply({"params": p}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    step = ensemble.train_step(loss_fn, optax.adam(1e-3), n=n, mesh=ens.mesh)
    opt_state = step.init(params)
    ensemble.assert_member_placement((params, opt_state), ens.mesh, n)
    stats = ensemble.compiled_memory(step, params, opt_state, x, y)
    state = _per_device(ensemble.live_memory((params, opt_state)), devices)
    param_bytes = sum(a.nbytes for a in jax.tree_util.tree_leaves(params))
    return _row(state, init, stats, param_bytes)


# ---------------------------------------------------------------------- NNX


def measure_nnx(args: argparse.Namespace, devices: list[jax.Device]) -> dict[str, Any]:
    from flax import nnx

    n = args.members
    hidden, depth, d_in = args.hidden, args.depth, args.input_dim

    class NNXMLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            sizes = [d_in] + [hidden] * depth
            self.layers = nnx.List(
                [nnx.Linear(a, b, rngs=rngs) for a, b in itertools.pairwise(sizes)]
            )
            self.head = nnx.Linear(hidden, 10, rngs=rngs)

        def __call__(self, x):
            for layer in self.layers:
                x = nnx.relu(layer(x))
            return self.head(x)

    ens = ensemble.build(lambda rngs: NNXMLP(rngs), n, devices=devices)
    init = ensemble.compiled_memory(
        ensemble.lower_build_nnx(lambda rngs: NNXMLP(rngs), n, devices=devices)
    )
    x, y = _batch(args)
    optimizer = ensemble.nnx_optimizer(ens, optax.adam(1e-3))

    def loss_fn(member, x, y):  # one member's loss; the step vmaps it over the members
        logits = member(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    step = ensemble.nnx_train_step(loss_fn)
    state = (nnx.state(ens), nnx.state(optimizer))
    ensemble.assert_member_placement(state, ens.mesh, n)
    stats = ensemble.compiled_memory(step, ens, optimizer, x, y)
    live = _per_device(ensemble.live_memory(state), devices)
    param_bytes = sum(a.nbytes for a in jax.tree_util.tree_leaves(nnx.state(ens, nnx.Param)))
    return _row(live, init, stats, param_bytes)


def _row(state: int, init: Any, step: Any, param_bytes: int) -> dict[str, Any]:
    return {
        "state": state,
        "init": init.peak if init is not None else None,
        "step": step.peak,
        "step_argument": step.argument,
        "step_temp": step.temp,
        "step_alias": step.alias,
        "param_bytes_total": param_bytes,
    }


# ---------------------------------------------------------------------- report

MEASURE: dict[str, Callable[[argparse.Namespace, list[jax.Device]], dict[str, Any]]] = {
    "linen": measure_linen,
    "nnx": measure_nnx,
}


def _ratios(per_d: dict[int, dict[str, Any]], ds: list[int]) -> None:
    base = per_d[ds[0]]
    for d, r in per_d.items():
        for metric in ("state", "init", "step"):
            if r[metric] is None or base[metric] is None:
                r[f"{metric}_ratio"] = None
                continue
            ideal = base[metric] * ds[0] / d
            r[f"{metric}_ratio"] = r[metric] / ideal


def _table(results: dict[str, dict[int, dict[str, Any]]]) -> str:
    head = (
        f"{'api':>5} {'D':>2} {'state MB':>9} {'ratio':>6} {'init MB':>8} {'ratio':>6} "
        f"{'step MB':>8} {'temp MB':>8} {'alias MB':>8} {'ratio':>6} {'goal':>5}"
    )
    lines = [
        "per-device memory of one fixed ensemble on D devices; "
        f"ratio = per-device(D) / (per-device(1) / D), goal <= {GOAL}",
        head,
        "-" * len(head),
    ]
    fmt = lambda v, spec: format(v, spec) if v is not None else "-".rjust(len(format(0, spec)))
    for api, per_d in results.items():
        for d, r in per_d.items():
            ok = all(r[f"{m}_ratio"] is None or r[f"{m}_ratio"] <= GOAL for m in ("state", "step"))
            lines.append(
                f"{api:>5} {d:>2} {r['state'] / MB:9.2f} {r['state_ratio']:6.3f} "
                f"{fmt(r['init'] and r['init'] / MB, '8.2f')} {fmt(r['init_ratio'], '6.3f')} "
                f"{r['step'] / MB:8.2f} {r['step_temp'] / MB:8.2f} {r['step_alias'] / MB:8.2f} "
                f"{r['step_ratio']:6.3f} {'ok' if ok else 'MISS':>5}"
            )
    return "\n".join(lines)


def _plot(results: dict[str, dict[int, dict[str, Any]]], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharex=True)
    for ax, metric, title in zip(axes, ("state", "step"), ("live state", "donated train step")):
        styles = ({"marker": "o", "ms": 9, "ls": "-"}, {"marker": "s", "ms": 5, "ls": ":"})
        for (api, per_d), style in zip(results.items(), styles):
            ds = sorted(per_d)
            ax.plot(ds, [per_d[d][metric] / MB for d in ds], label=api, **style)
            base = per_d[ds[0]][metric] * ds[0]
            ax.plot(ds, [base / d / MB for d in ds], "--", color="gray", lw=1)
        ax.plot([], [], "--", color="gray", lw=1, label="ideal 1/D")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ds, [str(d) for d in ds])
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_locator(matplotlib.ticker.LogLocator(subs=(2.0, 5.0)))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.set_xlabel("devices D")
        ax.set_ylabel("MB per device")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle("Per-device memory of one ensemble spread over D devices")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"))
    parser.add_argument("--api", choices=["linen", "nnx", "both"], default="both")
    parser.add_argument("--members", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=3, help="hidden layers per member")
    parser.add_argument("--input-dim", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32, help="shared batch size")
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args(argv)
    _simulate_cpu_devices(max(args.devices))
    available = jax.devices()
    ds = [d for d in args.devices if d <= len(available) and args.members % d == 0]
    if not ds:
        parser.error(f"none of D={args.devices} fits {len(available)} devices / n={args.members}")
    apis = ["linen", "nnx"] if args.api == "both" else [args.api]
    member_bytes = 4 * _member_params(args.input_dim, args.hidden, args.depth)
    print(
        f"{args.members} members x {member_bytes / MB:.2f} MB = "
        f"{args.members * member_bytes / MB:.1f} MB of float32 parameters; D = {ds}",
        flush=True,
    )

    start = time.perf_counter()
    results: dict[str, dict[int, dict[str, Any]]] = {}
    for api in apis:
        results[api] = {}
        for d in ds:
            results[api][d] = MEASURE[api](args, available[:d])
            gc.collect()  # the previous D's state is garbage now; free it before the next
            print(f"{api} D={d} done ({time.perf_counter() - start:.1f} s)", flush=True)
        _ratios(results[api], ds)

    table = _table(results)
    print()
    print(table)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "devices_used": ds,
        "platform": available[0].platform,
        "jax": jax.__version__,
        "machine": platform.machine(),
        "param_mb_total": args.members * member_bytes / MB,
        "goal": f"per-device peak <= {GOAL} x (1-device peak) / D",
        "results": {api: {str(d): r for d, r in per_d.items()} for api, per_d in results.items()},
        "seconds": time.perf_counter() - start,
    }
    (out / "memory.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "memory.txt").write_text(table + "\n")
    _plot(results, out / "memory.png")
    print(f"\nwrote {out / 'memory.json'}, memory.txt, memory.png")
    return report


if __name__ == "__main__":
    main()
