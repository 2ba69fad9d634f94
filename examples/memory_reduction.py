"""A reported ensemble that did not shrink, reproduced and fixed.

Does an ensemble spread over D devices use 1/D of the memory?

A user built an MLP (Dense 5000 hidden, xavier init, logical annotations
``('input', 'hidden')`` / ``('hidden', 'output')``, no biases) as an ``nn.vmap`` ensemble, sharded
it over 2 GPUs and saw per-GPU memory go from 2447 MB to 2193 MB instead of halving. This script
runs the same ensemble of ``--members`` (default 8) members on D = 1, 2, 4, 8 devices two ways:

- ``naive``: the reported code. ``jax.jit(model.init)`` without ``out_shardings``, no logical rules
  and no mesh in scope (so every ``with_logical_constraint`` is a silent no-op), plain
  ``optax.adam`` and a train step without donation. The input is placed on the mesh, so
  everything computed from it is *replicated* on all D devices: per-device memory stays flat.
- ``advice``: the reported code with the advice the thread gave applied by hand: rules and mesh
  in scope, init jitted with ``out_shardings`` from the logical annotations, donation. The
  parameters are sharded, but ``jax.jit(tx.init)`` puts Adam's moments on every device (and
  donation cannot reuse them): per-device memory falls, far from 1/D.
- ``ensemble``: ``ensemble.build`` (init jitted straight into member shards) and
  ``ensemble.train_step`` (per-member Adam, parameters and optimizer state donated).

Per D it measures, per device (the largest over the D devices used):

- ``state``: live bytes of parameters + optimizer state after initialisation, from
  ``addressable_shards`` (``replicated``: ``ensemble.assert_no_replicated_members`` fails on
  that state);
- ``init``: the compiled init program's peak (argument + output + temp - alias + constants);
- ``step``: the compiled train step's peak, the same formula (donation makes alias > 0).

The total ensemble is fixed (``--members``; at D = 8 it is one member per device), so the ideal
is the 1-device figure divided by D. Prints a table and writes JSON and a PNG plot to ``--out``.

Devices: one process with 8 simulated CPU devices, and D-device subsets of them (``devices=``).
Memory is a property of each device's own buffers (compiled per-device sizes, shards per
device), so the unused devices change nothing, and one process compiles much faster than four.

Unannotated biases: with ``--bias`` the Dense layers get default (unannotated) biases. The
reported logical-partitioning route gives them ``PartitionSpec()``: replicated on every device
even once the kernels are sharded; ``ensemble.build`` puts their member axis on the mesh too.
The script prints both specs.

Run: ``python examples/memory_reduction.py [--out out/memory_reduction]`` (about a minute on 2
cores).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import ensemble
from rollout._devices import beyond_free_memory
from rollout.ppo._parser import OneLineParser, writable_dir

MB = 1e6

# The reported parameter annotations name 'input', 'hidden', 'output'. Members are whole on their
# device(s), so those axes stay unsplit; saying so explicitly keeps ensemble.partitioning from
# warning that they are unmapped.
RULES = (("input", None), ("hidden", None), ("output", None))


class MLP(nn.Module):
    """The reported MLP, as posted (``use_bias=False``); ``use_bias=True`` for the bias variant."""

    features: int = 5000
    use_bias: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        init = nn.initializers.xavier_normal()
        y = nn.Dense(
            self.features,
            use_bias=self.use_bias,
            kernel_init=nn.with_logical_partitioning(init, ("input", "hidden")),
        )(x)
        y = nn.with_logical_constraint(y, ("batch", None))
        y = nn.Dense(
            1,
            use_bias=self.use_bias,
            kernel_init=nn.with_logical_partitioning(init, ("hidden", "output")),
        )(y)
        y = y.reshape(-1)
        return nn.with_logical_constraint(y, ("batch",))


def _per_device(mem: dict[jax.Device, int], devices: list[jax.Device]) -> int:
    return max(mem.get(d, 0) for d in devices)


def _data(args: argparse.Namespace) -> tuple[jax.Array, jax.Array]:
    kx, ky = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (args.batch, args.input_dim))
    y = jax.random.normal(ky, (args.batch,))
    return x, y


def _naive_ensemble(args: argparse.Namespace) -> nn.Module:
    """The reported ``nn.vmap`` ensemble, verbatim (no ``spmd_axis_name``)."""
    ensemble_mlp = nn.vmap(
        MLP,
        in_axes=None,
        out_axes=0,
        axis_size=args.members,
        variable_axes={"params": 0},
        metadata_params={nn.PARTITION_NAME: "ensemble"},
        split_rngs={"params": True},
    )
    return ensemble_mlp(features=args.hidden, use_bias=args.bias)


def _naive_step(model: nn.Module, tx: optax.GradientTransformation) -> Any:
    """The reporting user's natural train step: one loss over all members, one optax state."""

    def step(params, opt_state, x, y):
        def loss_fn(p):
            return jnp.mean((model.apply({"params": p}, x) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def naive_way(args: argparse.Namespace, devices: list[jax.Device]) -> dict[str, Any]:
    """The reported code: nn.vmap ensemble, unsharded init, no rules/mesh in scope, no donation."""
    n = args.members
    mesh = Mesh(np.asarray(devices).reshape(len(devices), 1), ("model", "data"))
    model = _naive_ensemble(args)
    x, y = _data(args)
    # As reported: the input goes onto the mesh ('data' has size 1, so: replicated).
    x = jax.device_put(x, NamedSharding(mesh, PartitionSpec("data", None)))
    y = jax.device_put(y, NamedSharding(mesh, PartitionSpec("data")))
    rng = jax.random.PRNGKey(0)

    init = jax.jit(model.init)  # no out_shardings: XLA replicates what it computes
    init_stats = ensemble.compiled_memory(init, rng, x)
    params = nn.meta.unbox(init(rng, x))["params"]
    tx = optax.adam(1e-3)
    opt_state = jax.jit(tx.init)(params)

    jitted = jax.jit(_naive_step(model, tx))  # no donate_argnums: old and new state coexist
    step_stats = ensemble.compiled_memory(jitted, params, opt_state, x, y)
    state_bytes = _per_device(ensemble.live_memory((params, opt_state)), devices)
    replicated = _replicated((params, opt_state), n, devices)
    params, opt_state, loss = jitted(params, opt_state, x, y)
    return {
        "state": state_bytes,
        "init": init_stats.peak,
        "step": step_stats.peak,
        "step_alias": step_stats.alias,
        "replicated": replicated,
        "loss": float(loss),
    }


def advice_way(args: argparse.Namespace, devices: list[jax.Device]) -> dict[str, Any]:
    """The reported model with the thread's advice applied by hand.

    Logical rules and the mesh in scope (``jax.set_mesh`` + ``nn.logical_axis_rules``), init
    jitted with ``out_shardings`` from the logical annotations, donated train step. What is
    still missing compared with ``ensemble.build``:

    - ``jax.jit(tx.init)(params)`` does not inherit the parameters' sharding: Adam's moments
      (``zeros_like``) come out replicated, two thirds of the state on every device;
    - so the donated step cannot reuse those replicated buffers for its (sharded) outputs:
      only the parameters alias;
    - unannotated leaves (biases, with ``--bias``) get ``P()`` and stay replicated.

    (Activations are fine here: the reported constraints only name 'batch', mapped to a 'data'
    axis of size 1; the step's temp bytes equal ``ensemble.train_step``'s.)
    """
    n = args.members
    mesh = Mesh(np.asarray(devices).reshape(len(devices), 1), ("model", "data"))
    rules = (("ensemble", "model"), ("batch", "data"), *RULES)
    model = _naive_ensemble(args)
    x, y = _data(args)
    x = jax.device_put(x, NamedSharding(mesh, PartitionSpec("data", None)))
    y = jax.device_put(y, NamedSharding(mesh, PartitionSpec("data")))
    rng = jax.random.PRNGKey(0)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        specs = nn.get_partition_spec(jax.eval_shape(model.init, rng, x))
        shardings = nn.logical_to_mesh_sharding(specs, mesh, rules)
        init = jax.jit(lambda r, x: nn.meta.unbox(model.init(r, x)), out_shardings=shardings)
        init_stats = ensemble.compiled_memory(init, rng, x)
        params = init(rng, x)["params"]
        tx = optax.adam(1e-3)
        opt_state = jax.jit(tx.init)(params)
        jitted = jax.jit(_naive_step(model, tx), donate_argnums=(0, 1))
        step_stats = ensemble.compiled_memory(jitted, params, opt_state, x, y)
        state_bytes = _per_device(ensemble.live_memory((params, opt_state)), devices)
        replicated = _replicated((params, opt_state), n, devices)
        params, opt_state, loss = jitted(params, opt_state, x, y)
    return {
        "state": state_bytes,
        "init": init_stats.peak,
        "step": step_stats.peak,
        "step_alias": step_stats.alias,
        "replicated": replicated,
        "loss": float(loss),
    }


def _replicated(state: Any, n: int, devices: list[jax.Device]) -> bool:
    """Whether some member-shaped leaf of the state is held whole by one device."""
    try:
        ensemble.assert_no_replicated_members(state, n, ensemble.make_mesh(n, devices=devices))
    except AssertionError:
        return True
    return False


def ensemble_way(args: argparse.Namespace, devices: list[jax.Device]) -> dict[str, Any]:
    """ensemble.build + ensemble.train_step: sharded init, per-member Adam, donation."""
    n = args.members
    model = MLP(features=args.hidden, use_bias=args.bias)
    ens = ensemble.build(model, n, devices=devices, rules=RULES)
    x, y = _data(args)
    key = jax.random.key(0)
    init_stats = ensemble.compiled_memory(ens.lower_init(key, x))
    params = ens.init(key, x)["params"]

    def loss_fn(p, x, y):  # ONE member's loss; train_step vmaps it over the members
        return jnp.mean((ens.model.apply({"params": p}, x) - y) ** 2)

    step = ensemble.train_step(loss_fn, optax.adam(1e-3), n=n, mesh=ens.mesh, rules=ens.rules)
    opt_state = step.init(params)
    step_stats = ensemble.compiled_memory(step, params, opt_state, x, y)
    state_bytes = _per_device(ensemble.live_memory((params, opt_state)), devices)
    params, opt_state, losses = step(params, opt_state, x, y)
    # The claim is checked on the real shards, not on sharding metadata.
    ensemble.assert_member_placement((params, opt_state), ens.mesh, n)
    ensemble.assert_no_replicated_members((params, opt_state), n, ens.mesh)
    return {
        "state": state_bytes,
        "init": init_stats.peak,
        "step": step_stats.peak,
        "step_alias": step_stats.alias,
        "replicated": False,
        "loss": float(jnp.mean(losses)),
    }


def bias_specs(args: argparse.Namespace, devices: list[Any]) -> dict[str, str]:
    """Where a default (unannotated) bias goes: the reported logical route vs ensemble.build."""
    n = args.members
    x, _ = _data(args)
    vmapped = nn.vmap(
        MLP,
        in_axes=None,
        out_axes=0,
        axis_size=n,
        variable_axes={"params": 0},
        metadata_params={nn.PARTITION_NAME: "ensemble"},
        split_rngs={"params": True},
    )(features=args.hidden, use_bias=True)
    specs = nn.get_partition_spec(jax.eval_shape(vmapped.init, jax.random.PRNGKey(0), x))
    rules = (("ensemble", "model"), ("batch", "data"))
    naive = nn.logical_to_mesh(specs, rules)["params"]["Dense_0"]
    ens = ensemble.build(MLP(features=args.hidden, use_bias=True), n, rules=RULES, devices=devices)
    built = ens.init_shardings(jax.random.key(0), x)["params"]["Dense_0"]
    return {
        "naive kernel": str(naive["kernel"]),
        "naive bias": str(naive["bias"]),
        "ensemble.build kernel": str(built["kernel"].spec),
        "ensemble.build bias": str(built["bias"].spec),
    }


def _table(results: dict[str, dict[int, dict[str, Any]]], ds: list[int]) -> str:
    head = f"{'way':>8} {'D':>2} {'state MB':>9} {'init MB':>8} {'step MB':>8} "
    head += f"{'alias MB':>8} {'state/ideal':>11} {'step/ideal':>10} {'replicated':>10}"
    lines = [
        "per-device memory (largest over the D devices used); ideal = ensemble's D=1 value / D"
        if ds[0] == 1
        else f"per-device memory (largest over the D devices used); ideal = ensemble's D={ds[0]} "
        f"value x {ds[0]} / D",
        head,
        "-" * len(head),
    ]
    base = results["ensemble"][ds[0]]
    for way, per_d in results.items():
        for d in ds:
            r = per_d[d]
            ideal_state, ideal_step = base["state"] * ds[0] / d, base["step"] * ds[0] / d
            lines.append(
                f"{way:>8} {d:>2} {r['state'] / MB:9.2f} {r['init'] / MB:8.2f} "
                f"{r['step'] / MB:8.2f} {r['step_alias'] / MB:8.2f} "
                f"{r['state'] / ideal_state:11.2f} {r['step'] / ideal_step:10.2f} "
                f"{'yes' if r['replicated'] else 'no':>10}"
            )
    return "\n".join(lines)


def _plot(results: dict[str, dict[int, dict[str, Any]]], ds: list[int], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharex=True)
    for ax, metric, title in zip(axes, ("state", "step"), ("live state", "train step peak")):
        for way, style in (("naive", "o-"), ("advice", "^-"), ("ensemble", "s-")):
            ax.plot(ds, [results[way][d][metric] / MB for d in ds], style, label=way)
        base = results["ensemble"][ds[0]][metric] * ds[0]
        ax.plot(ds, [base / d / MB for d in ds], "k--", label="ideal 1/D")
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
    fig.suptitle("Per-device memory of an ensemble spread over D devices")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _simulate_cpu_devices(count: int) -> None:
    """8 simulated CPU devices, one thread each; must run before JAX starts a backend."""
    os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:  # a backend is already up (e.g. imported from a test): keep it
        pass


def _arguments(argv: list[str] | None) -> tuple[argparse.Namespace, pathlib.Path, list[int]]:
    """The checked arguments, the output folder and the device counts D that fit here; a
    mistake is one line (exit 2) before anything runs."""
    parser = OneLineParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="out/memory_reduction", help="output folder")
    parser.add_argument("--members", type=int, default=8, help="ensemble size (fixed over D)")
    parser.add_argument("--hidden", type=int, default=5000, help="hidden features (reported: 5000)")
    parser.add_argument("--input-dim", type=int, default=20, help="input features (reported: 20)")
    parser.add_argument("--batch", type=int, default=64, help="batch size")
    parser.add_argument("--bias", action="store_true", help="Dense layers with default biases")
    parser.add_argument(
        "--devices", type=int, nargs="+", default=[1, 2, 4, 8], help="device counts D"
    )
    args = parser.parse_args(argv)
    for name in ("members", "hidden", "input_dim", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if min(args.devices) < 1:
        parser.error(f"--devices must be >= 1, got {args.devices}")
    # Parameters, gradients and Adam's two moments, and the hidden activations: the least.
    params = (args.input_dim + 2) * args.hidden + 1
    need = 4 * args.members * (4 * params + args.batch * args.hidden)
    too_big = beyond_free_memory(need, "the members' state and activations")
    if too_big:
        parser.error(f"{too_big}; give a smaller --hidden, --members or --batch")
    _simulate_cpu_devices(8)
    available = jax.devices()
    unfit = [d for d in args.devices if args.members % d]
    if unfit:
        parser.error(f"D={unfit} of --devices does not divide n={args.members}: give divisors")
    ds = sorted({d for d in args.devices if d <= len(available)})  # each D once
    if not ds:
        parser.error(f"none of D={args.devices} fits the {len(available)} devices here")
    if len(ds) < len(args.devices):  # (the default's D=8 on a host of 4 GPUs)
        print(f"note: D > {len(available)} skipped: only {len(available)} devices here")
    try:
        out = writable_dir(args.out)  # before the runs: not a traceback after them
    except argparse.ArgumentTypeError as e:
        parser.error(f"--out: {e}; give another folder")
    return args, out, ds


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args, out, ds = _arguments(argv)
    available = jax.devices()
    start = time.perf_counter()
    results: dict[str, dict[int, dict[str, Any]]] = {"naive": {}, "advice": {}, "ensemble": {}}
    for d in ds:
        devices = available[:d]
        results["naive"][d] = naive_way(args, devices)
        results["advice"][d] = advice_way(args, devices)
        results["ensemble"][d] = ensemble_way(args, devices)
        print(f"D={d} done ({time.perf_counter() - start:.1f} s)", flush=True)

    table = _table(results, ds)
    specs = bias_specs(args, available[: max(ds)])
    print()
    print(table)
    print("\nUnannotated bias (use_bias=True): the reported logical route vs ensemble.build")
    for k, v in specs.items():
        print(f"  {k:>22}: {v}")
    report = {
        "config": {**vars(args), "platform": available[0].platform, "devices": ds},
        "results": {way: {str(d): r for d, r in per_d.items()} for way, per_d in results.items()},
        "bias_specs": specs,
        "seconds": time.perf_counter() - start,
    }
    (out / "memory_reduction.json").write_text(json.dumps(report, indent=2))
    (out / "memory_reduction.txt").write_text(table + "\n")
    _plot(results, ds, out / "memory_reduction.png")
    print(f"\nwrote {out / 'memory_reduction.json'}, .txt and .png")
    return report


if __name__ == "__main__":
    main()
