"""Per-device memory of a fixed ensemble spread over D = 1, 2, 4, 8 devices: MLPs and conv nets.

What is compared: ONE ensemble of ``--members`` (default 8) members placed by ``ensemble.build``
on D devices (``n / D`` members per device; one member per device at D = n), for each model:

- ``linen`` / ``nnx``: an MLP of about 84 MB of float32 parameters in total (linen and NNX);
- ``cnn``, ``resnet18``, ``nnx_cnn``: the conv nets of ``examples/conv_models.py`` (a small CNN
  on 28x28x1, ResNet-18 at ``--resnet-width`` 16 on 32x32x3 with BatchNorm statistics through
  aux, the NNX tutorial CNN), a shared batch of ``--conv-batch`` 16 images.

Per device, the largest over the D devices used, it measures:

- ``state``: live bytes of parameters + Adam state (``ensemble.live_memory``: addressable shards);
- ``init``: peak of the compiled init program (``ensemble.compiled_memory``);
- ``step``: peak of the compiled, donated train step (argument + output + temp - alias +
  constants), with its ``alias`` (donated bytes reused), ``temp`` (activations, gradients)
  and its collectives (``ensemble.debug.collectives``);
- ``old_step``: the same for the step the library built before its member core,
  ``jax.jit(vmap(value_and_grad(loss) + per-member Adam, spmd_axis_name='ensemble'))`` on the
  same member-sharded, donated params (:func:`old_train_step`), where the member axis is left to
  XLA's partitioner.

The 1-device figure is the whole ensemble on one device; the goal is that each device needs no
more than its share: ``ratio = per_device(D) / (per_device(1) / D) <= 1.05`` for the state and for
the train step. The batch is shared by all members (replicated, a constant per device), so it is
kept small next to the parameters, as in real ensembles.

Only lowering and compiling happen for the steps (no training run); the state is really
initialised (it is what ``state`` measures). Results: a table on stdout,
``benchmarks/results/memory.json``, ``memory.txt`` and ``memory.png``.

Run: ``python benchmarks/memory.py`` (about 25 minutes on 2 busy cores, most of it compiling
ResNet-18; 8 simulated CPU devices), ``--models linen cnn`` for some models, or
``--api linen`` for the linen MLP only.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import pathlib
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import optax

import ensemble
import ensemble.debug
from rollout._devices import beyond_free_memory
from rollout.ppo._parser import OneLineParser, positive_int, writable_dir

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import conv_models

MB = 1e6
GOAL = 1.05
MEMBER = "ensemble"


def _simulate_cpu_devices(count: int) -> None:
    """Simulated CPU devices, one thread each; must run before JAX starts a backend."""
    os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:  # a backend is already up (e.g. imported from a test): keep it
        pass


# ---------------------------------------------------------------------- the old mechanism


def old_train_step(
    loss_fn: Callable[..., Any],
    tx: optax.GradientTransformation,
    n: int,
    mesh: jax.sharding.Mesh,
    batch_axes: tuple[int | None, ...],
    has_aux: bool = False,
) -> Any:
    """The step as the library built it before the member core: the member axis left to XLA.

    ``jax.jit(vmap(value_and_grad(loss) + per-member optax, spmd_axis_name='ensemble'))``,
    params and optimizer state donated, every output on the member axis. Lower or call it
    under ``jax.set_mesh(mesh)``.
    """

    def member(params, opt_state, *batch):
        out, grads = jax.value_and_grad(loss_fn, has_aux=has_aux)(params, *batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, out

    step = jax.vmap(member, in_axes=(0, 0, *batch_axes), axis_size=n, spmd_axis_name=MEMBER)
    return jax.jit(step, out_shardings=_member_sharding(mesh), donate_argnums=(0, 1))


def old_apply(apply_fn: Callable[..., Any], n: int, mesh: jax.sharding.Mesh) -> Any:
    """``apply_fn(member_variables, x)`` for every member, the old way (shared ``x``)."""
    fn = jax.vmap(apply_fn, in_axes=(0, None), axis_size=n, spmd_axis_name=MEMBER)
    return jax.jit(fn, out_shardings=_member_sharding(mesh))


def _member_sharding(mesh: jax.sharding.Mesh) -> jax.sharding.NamedSharding:
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(MEMBER))


def _stacked(member_tree: Any, n: int, mesh: jax.sharding.Mesh) -> Any:
    """One member's (abstract) tree -> the n-member abstract tree on the member axis."""
    sharding = _member_sharding(mesh)
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct((n, *a.shape), a.dtype, sharding=sharding), member_tree
    )


def _old_compiled(
    loss_fn: Callable[..., Any],
    member_params: Any,
    n: int,
    mesh: jax.sharding.Mesh,
    batch: tuple[Any, ...],
    batch_axes: tuple[int | None, ...],
    has_aux: bool = False,
) -> Any:
    """Compiles the old-style step for abstract member-sharded params + Adam state."""
    tx = optax.adam(1e-3)
    params = _stacked(member_params, n, mesh)
    opt_state = _stacked(jax.eval_shape(tx.init, member_params), n, mesh)
    step = old_train_step(loss_fn, tx, n, mesh, batch_axes, has_aux)
    with jax.set_mesh(mesh):
        return step.lower(params, opt_state, *batch).compile()


# ---------------------------------------------------------------------- the models


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


def _nnx_mlp(d_in: int, hidden: int, depth: int) -> Callable[..., Any]:
    from flax import nnx

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

    return NNXMLP


def _member_params(d_in: int, hidden: int, depth: int, out: int = 10) -> int:
    sizes = [d_in] + [hidden] * depth + [out]
    return sum(a * b + b for a, b in itertools.pairwise(sizes))


def _batch(size: int, shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    kx, ky = jax.random.split(jax.random.key(1))
    return jax.random.normal(kx, (size, *shape)), jax.random.randint(ky, (size,), 0, 10)


def _per_device(mem: dict[jax.Device, int], devices: list[jax.Device]) -> int:
    return max(mem.get(d, 0) for d in devices)


def ce_loss(apply_fn: Callable[..., Any]) -> Callable[..., Any]:
    """One member's cross-entropy of ``apply_fn(params, x)``."""

    def loss(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        return optax.softmax_cross_entropy_with_integer_labels(apply_fn(params, x), y).mean()

    return loss


# ---------------------------------------------------------------------- linen


def _linen_row(
    model: nn.Module, loss: Callable, x: jax.Array, y: jax.Array, devices: list, n: int, stats=False
) -> dict[str, Any]:
    """New step (the library) and old-style step of a linen model; with ``stats``, BatchNorm."""
    ens = ensemble.build(model, n, devices=devices)
    key = jax.random.key(0)
    init = ensemble.compiled_memory(ens.lower_init(key, x))
    variables = ens.init(key, x)
    params = variables["params"]
    extra = (variables["batch_stats"],) if stats else ()
    axes = (0, None, None) if stats else (None, None)
    pmb = tuple(a == 0 for a in axes)
    step = ens.train_step(loss, optax.adam(1e-3), has_aux=stats, per_member_batch=pmb)
    opt_state = step.init(params)
    ensemble.assert_member_placement((params, opt_state), ens.mesh, n)
    compiled = step.lower(params, opt_state, *extra, x, y).compile()
    state = _per_device(ensemble.live_memory((params, opt_state)), devices)
    member = jax.eval_shape(lambda: model.init(key, x))
    old_batch = (*(_stacked(member["batch_stats"], n, ens.mesh) for _ in extra), x, y)
    old = _old_compiled(loss, member["params"], n, ens.mesh, old_batch, axes, has_aux=stats)
    param_bytes = sum(a.nbytes for a in jax.tree_util.tree_leaves(params))
    return _row(state, init, compiled, old, param_bytes)


def measure_linen(args: argparse.Namespace, devices: list[jax.Device]) -> dict[str, Any]:
    model = LinenMLP(args.hidden, args.depth)
    x, y = _batch(args.batch, (args.input_dim,))
    loss = ce_loss(lambda p, x: model.apply({"params": p}, x))
    return _linen_row(model, loss, x, y, devices, args.members)


def measure_cnn(args: argparse.Namespace, devices: list[jax.Device]) -> dict[str, Any]:
    model = conv_models.CNN()
    x, y = _batch(args.conv_batch, (28, 28, 1))
    return _linen_row(model, conv_models.cnn_loss(model), x, y, devices, args.members)


def measure_resnet(args: argparse.Namespace, devices: list[jax.Device]) -> dict[str, Any]:
    model = conv_models.ResNet18(width=args.resnet_width)
    x, y = _batch(args.conv_batch, (args.resnet_image, args.resnet_image, 3))
    loss = conv_models.resnet_loss(model)
    return _linen_row(model, loss, x, y, devices, args.members, stats=True)


# ---------------------------------------------------------------------- NNX


def _nnx_row(make: Callable, loss: Callable, x: jax.Array, y: jax.Array, devices: list, n: int):
    """New NNX step (the library) and the old-style step over the member's split state."""
    from flax import nnx

    ens = ensemble.build(make, n, devices=devices)
    init = ensemble.compiled_memory(ensemble.lower_build_nnx(make, n, devices=devices))
    step = ens.train_step(loss, optax.adam(1e-3))
    optimizer = step.init()
    state = (nnx.state(ens), nnx.state(optimizer))
    ensemble.assert_member_placement(state, ens.mesh, n)
    compiled = step.lower(ens, optimizer, x, y).compile()
    live = _per_device(ensemble.live_memory(state), devices)
    graphdef, member = nnx.split(nnx.eval_shape(lambda: make(nnx.Rngs(0))))
    old_loss = lambda s, x, y: loss(nnx.merge(graphdef, s), x, y)
    old = _old_compiled(old_loss, member, n, ens.mesh, (x, y), (None, None))
    param_bytes = sum(a.nbytes for a in jax.tree_util.tree_leaves(nnx.state(ens, nnx.Param)))
    return _row(live, init, compiled, old, param_bytes)


def measure_nnx(args: argparse.Namespace, devices: list[jax.Device]) -> dict[str, Any]:
    mlp = _nnx_mlp(args.input_dim, args.hidden, args.depth)
    x, y = _batch(args.batch, (args.input_dim,))
    loss = lambda m, x, y: ce_loss(lambda m, x: m(x))(m, x, y)
    return _nnx_row(lambda rngs: mlp(rngs), loss, x, y, devices, args.members)


def measure_nnx_cnn(args: argparse.Namespace, devices: list[jax.Device]) -> dict[str, Any]:
    x, y = _batch(args.conv_batch, (28, 28, 1))
    make = lambda rngs: conv_models.NNXCNN(rngs=rngs)
    return _nnx_row(make, conv_models.nnx_cnn_loss, x, y, devices, args.members)


def _row(state: int, init: Any, step: Any, old: Any, param_bytes: int) -> dict[str, Any]:
    new, before = ensemble.compiled_memory(step), ensemble.compiled_memory(old)
    return {
        "state": state,
        "init": init.peak if init is not None else None,
        "step": new.peak,
        "step_argument": new.argument,
        "step_temp": new.temp,
        "step_alias": new.alias,
        "step_collectives": ensemble.debug.collectives(step),
        "old_step": before.peak,
        "old_step_temp": before.temp,
        "old_step_alias": before.alias,
        "old_step_collectives": ensemble.debug.collectives(old),
        "param_bytes_total": param_bytes,
    }


# ---------------------------------------------------------------------- report

MEASURE: dict[str, Callable[[argparse.Namespace, list[jax.Device]], dict[str, Any]]] = {
    "linen": measure_linen,
    "nnx": measure_nnx,
    "cnn": measure_cnn,
    "resnet18": measure_resnet,
    "nnx_cnn": measure_nnx_cnn,
}
LABELS = {
    "linen": "MLP linen",
    "nnx": "MLP NNX",
    "cnn": "CNN",
    "resnet18": "ResNet18",
    "nnx_cnn": "NNX CNN",
}


def _ratios(per_d: dict[int, dict[str, Any]], ds: list[int]) -> None:
    base = per_d[ds[0]]
    for d, r in per_d.items():
        for metric in ("state", "init", "step", "old_step"):
            if r[metric] is None or base[metric] is None:
                r[f"{metric}_ratio"] = None
                continue
            ideal = base[metric] * ds[0] / d
            r[f"{metric}_ratio"] = r[metric] / ideal


def _count(c: dict[str, int]) -> str:
    return str(sum(c.values()))


def _table(results: dict[str, dict[int, dict[str, Any]]], members: int) -> str:
    head = (
        f"{'model':>9} {'D':>2} {'state MB':>9} {'ratio':>6} {'step MB':>8} {'ratio':>6} "
        f"{'coll':>4} {'goal':>4} | {'old MB':>8} {'ratio':>6} {'coll':>4}"
    )
    lines = [
        f"per-device memory of one fixed {members}-member ensemble on D devices; ratio = "
        f"per-device(D) / (per-device(1) / D), goal <= {GOAL}; coll = collectives in the "
        "compiled step; old = jit(vmap(..., spmd_axis_name='ensemble')) step",
        head,
        "-" * len(head),
    ]
    for name, per_d in results.items():
        for d, r in per_d.items():
            ok = all(r[f"{m}_ratio"] <= GOAL for m in ("state", "step"))
            lines.append(
                f"{LABELS[name]:>9} {d:>2} {r['state'] / MB:9.2f} {r['state_ratio']:6.3f} "
                f"{r['step'] / MB:8.2f} {r['step_ratio']:6.3f} {_count(r['step_collectives']):>4} "
                f"{'ok' if ok else 'MISS':>4} | {r['old_step'] / MB:8.2f} "
                f"{r['old_step_ratio']:6.3f} {_count(r['old_step_collectives']):>4}"
            )
    return "\n".join(lines)


def _plot(results: dict[str, dict[int, dict[str, Any]]], path: pathlib.Path, members: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, per_d) in enumerate(results.items()):
        ds = sorted(per_d)
        color = f"C{i}"
        ax.plot(ds, [per_d[d]["step_ratio"] for d in ds], "o-", color=color, label=LABELS[name])
        ax.plot(ds, [per_d[d]["old_step_ratio"] for d in ds], "x:", color=color)
    ax.plot([], [], "x:", color="gray", label="old mechanism (dotted)")
    ax.axhline(GOAL, color="gray", lw=1, ls="--", label=f"goal {GOAL}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ds, [str(d) for d in ds])
    ax.set_xlabel("devices D")
    ax.set_ylabel("step peak per device / (1-device peak / D)")
    ax.set_title(f"Donated train step, per-device peak vs ideal 1/D ({members} members)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _parser() -> OneLineParser:
    parser = OneLineParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--out", type=writable_dir, default=str(pathlib.Path(__file__).parent / "results")
    )
    parser.add_argument(
        "--api", choices=["linen", "nnx", "both"], help="only the MLP, with this API / both"
    )
    parser.add_argument("--models", nargs="+", choices=list(MEASURE), default=list(MEASURE))
    parser.add_argument("--members", type=positive_int, default=8)
    parser.add_argument("--hidden", type=positive_int, default=1024)
    parser.add_argument("--depth", type=positive_int, default=3, help="hidden layers per member")
    parser.add_argument("--input-dim", type=positive_int, default=512)
    parser.add_argument("--batch", type=positive_int, default=32, help="shared batch size")
    parser.add_argument(
        "--devices",
        type=positive_int,
        nargs="+",
        default=[1, 2, 4, 8],
        help="divisors of --members",
    )
    parser.add_argument(
        "--conv-batch", type=positive_int, default=16, help="shared batch of conv nets"
    )
    parser.add_argument(
        "--resnet-width", type=positive_int, default=16, help="64 is the real ResNet-18"
    )
    parser.add_argument("--resnet-image", type=positive_int, default=32, help="ResNet input side")
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = _parser()
    args = parser.parse_args(argv)
    for d in args.devices:
        if args.members % d:
            parser.error(f"--devices {d} does not divide --members {args.members}")
    _simulate_cpu_devices(max(args.devices))
    available = jax.devices()
    ds = [d for d in args.devices if d <= len(available)]
    if not ds:
        parser.error(f"none of D={args.devices} fits {len(available)} devices / n={args.members}")
    apis = args.models if args.api is None else {"both": ["linen", "nnx"]}.get(args.api, [args.api])
    member_bytes = 4 * _member_params(args.input_dim, args.hidden, args.depth)
    # Parameters, gradients and Adam's two moments: the least any way holds.
    too_big = beyond_free_memory(4 * args.members * member_bytes, "the MLP members' state")
    if too_big:
        parser.error(f"{too_big}; give a smaller --hidden, --depth or --members")
    print(
        f"{args.members} members x {member_bytes / MB:.2f} MB = "
        f"{args.members * member_bytes / MB:.1f} MB of float32 parameters (MLP); D = {ds}",
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

    table = _table(results, args.members)
    print()
    print(table)
    out = args.out
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
    _plot(results, out / "memory.png", args.members)
    print(f"\nwrote {out / 'memory.json'}, memory.txt, memory.png")
    return report


if __name__ == "__main__":
    main()
