"""CPU-heavy work inside a sharded train step: its loss runs a GRU rollout on the CPU cores.

A jitted train step, with its batch sharded over every device, synthesises audio sample by sample
with a GRU whose weights change every step (a non-static rollout model), on all CPU cores through
``rollout.on_cpu``; gradients are stopped there; a small model then trains on the audio (it learns
to predict the audio's loudness from the excitation's gain and frequency).

On a GPU/TPU host the step runs on the accelerators and ``on_cpu`` picks the in-process executor.
On a CPU-only host the step's devices are CPU devices (one per core, ``configure_cpu_devices``), the
case in which the naive ``pure_callback`` + ``pmap`` deadlocks; ``on_cpu`` picks worker processes.

    python examples/cpu_rollout.py                         # ~20 s on 2 cores
    python examples/cpu_rollout.py --steps 200 --batch 256 --samples 8192 --hidden 64
    python examples/cpu_rollout.py --executor process --workers 2

Prints steps/s, rollout samples/s and CPU utilisation: CPU seconds of this process plus its worker
processes (read from /proc while they run) over wall seconds, in cores and as a share of the cores.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax

import rollout
from rollout._devices import beyond_free_memory
from rollout.ppo._parser import OneLineParser

# Before JAX starts: one CPU device (and thread) per core. On an accelerator host this only shapes
# the CPU client that the in-process executor uses; the train step stays on the accelerator.
rollout.configure_cpu_devices()

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from rollout.envs import init_synth_params, synthesize  # noqa: E402

SAMPLE_RATE = 16000.0


def render(synth_params, gain_freq, *, samples: int, hidden: int):
    """The heavy, sequential part: audio[B, samples] from per-row (gain, freq), sample by sample."""
    t = jnp.arange(samples, dtype=jnp.float32) / SAMPLE_RATE

    def one(gf):
        excitation = gf[0] * jnp.sin(2 * jnp.pi * gf[1] * t)
        return synthesize(synth_params, jnp.zeros((hidden,), jnp.float32), excitation)[1]

    return jax.vmap(one)(gain_freq)


def init_mlp(key, sizes=(2, 64, 64, 1)):
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        (jax.random.normal(k, (a, b)) * np.sqrt(1.0 / a), jnp.zeros((b,)))
        for k, a, b in zip(keys, sizes[:-1], sizes[1:])
    ]


def mlp(params, x):
    for w, b in params[:-1]:
        x = jnp.tanh(x @ w + b)
    w, b = params[-1]
    return (x @ w + b)[..., 0]


def parse(argv=None) -> tuple[argparse.Namespace, rollout.OnCpu]:
    """The flags, checked against each other and the devices (one ``error:`` line, exit 2), and
    the ``on_cpu`` rollout they ask for."""
    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=64, help="rollouts per step (all devices)")
    ap.add_argument("--samples", type=int, default=2048, help="audio samples per rollout")
    ap.add_argument("--hidden", type=int, default=32, help="GRU hidden size")
    ap.add_argument("--executor", default="auto", choices=["auto", "inprocess", "process"])
    ap.add_argument("--workers", type=int, default=None, help="CPU workers (default: cores)")
    args = ap.parse_args(argv)
    for name in ("steps", "batch", "samples", "hidden", "workers"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    # The GRU's three weight matrices, and the states of every sample of every rollout.
    need = 12 * args.hidden * (args.hidden + args.batch * args.samples)
    too_big = beyond_free_memory(need, "the synthesiser's weights and states")
    if too_big:
        ap.error(f"{too_big}; give a smaller --hidden, --samples or --batch")
    devices = jax.devices()
    if args.batch % len(devices):
        ap.error(
            f"--batch {args.batch} must be a multiple of the {len(devices)} devices it is split "
            "over"
        )
    if args.executor == "inprocess" and devices[0].platform == "cpu" and len(devices) > 1:
        ap.error(
            f"--executor inprocess cannot serve a step over {len(devices)} CPU devices (it "
            "would deadlock); use --executor process (or auto)"
        )
    try:
        rollout_fn = rollout.on_cpu(
            lambda sp, gf: render(sp, gf, samples=args.samples, hidden=args.hidden),
            in_axes=(None, 0),  # synthesiser weights go whole to every worker, rows are split
            executor=args.executor,
            workers=args.workers,
        )
    except ValueError as e:  # e.g. far more workers than cores
        ap.error(f"--workers: {e}")
    return args, rollout_fn


def make_train_step(rollout_fn, tx: optax.GradientTransformation):
    """The jitted step: audio rendered on the CPU cores, then one Adam step of the MLP."""

    @jax.jit
    def train_step(model, opt_state, synth_params, gain_freq):
        def loss_fn(model):
            audio = rollout_fn(synth_params, gain_freq)  # on CPU cores; no gradient flows back
            level = jnp.sqrt(jnp.mean(jnp.square(audio), axis=-1))
            features = jnp.stack([gain_freq[:, 0], jnp.log(gain_freq[:, 1]) - 6.0], axis=-1)
            return jnp.mean(jnp.square(mlp(model, features) - level))

        loss, grads = jax.value_and_grad(loss_fn)(model)
        updates, opt_state = tx.update(grads, opt_state, model)
        return optax.apply_updates(model, updates), opt_state, loss

    return train_step


def make_batches(batch_size: int, hidden: int, data: NamedSharding, replicated: NamedSharding):
    """``batch(step)``: the synthesiser's weights at that step and a fresh batch of rows."""
    base = init_synth_params(jax.random.key(1), hidden)
    drift = init_synth_params(jax.random.key(2), hidden)
    rng = np.random.default_rng(0)

    def batch(step):
        # The rollout model is not static: its weights drift a little every step.
        sp = jax.tree.map(lambda b, d: b + 0.01 * step * d, base, drift)
        gf = np.stack(
            [
                rng.uniform(0.0, 2.0, batch_size),
                np.exp(rng.uniform(np.log(110), np.log(880), batch_size)),
            ],
            axis=-1,
        ).astype(np.float32)
        return jax.device_put(sp, replicated), jax.device_put(gf, data)

    return batch


def main(argv=None) -> None:
    args, rollout_fn = parse(argv)
    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    data, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    print(
        f"train step on {len(devices)} {devices[0].platform} device(s); "
        f"{len(jax.devices('cpu'))} CPU device(s); {os.cpu_count()} cores"
    )
    tx = optax.adam(3e-3)
    train_step = make_train_step(rollout_fn, tx)
    model = jax.device_put(init_mlp(jax.random.key(0)), replicated)
    opt_state = jax.device_put(tx.init(model), replicated)
    batch = make_batches(args.batch, args.hidden, data, replicated)

    t0 = time.perf_counter()
    model, opt_state, loss = train_step(model, opt_state, *batch(0))  # compile + start workers
    print(
        f"first step (compile, start workers): {time.perf_counter() - t0:.1f} s, "
        f"executor={rollout_fn.last_executor}, loss={float(loss):.4f}"
    )
    cpu0, wall0 = cpu_seconds(rollout_fn.pids), time.perf_counter()
    stop = threading.Event()
    # Ctrl-C stops between steps: raised inside a step, the step would go on running in XLA
    # while the interpreter exits, which XLA may abort (a crash, not an exit). A second one
    # interrupts at once.
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        for step in range(1, args.steps + 1):
            model, opt_state, loss = train_step(model, opt_state, *batch(step))
            if step % max(1, args.steps // 5) == 0:
                print(f"step {step:4d}  loss {float(loss):.5f}")
            if stop.is_set():
                args.steps = step
                break
        jax.block_until_ready(loss)
    finally:
        signal.signal(signal.SIGINT, previous)
    report(args, time.perf_counter() - wall0, cpu_seconds(rollout_fn.pids) - cpu0, rollout_fn)
    rollout_fn.close()
    if stop.is_set():
        print(f"interrupted: stopped after step {args.steps}", file=sys.stderr)
        sys.exit(130)


def report(args: argparse.Namespace, wall: float, cpu: float, rollout_fn: rollout.OnCpu) -> None:
    """Steps/s, rollout samples/s and how many of the cores were busy."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(
        f"{args.steps / wall:.2f} steps/s, "
        f"{args.steps * args.batch * args.samples / wall / 1e6:.2f} M rollout samples/s"
    )
    print(
        f"CPU utilisation: {cpu / wall:.2f} cores busy of {cores} "
        f"({100 * cpu / wall / cores:.0f}%; this process + {len(rollout_fn.pids)} workers)"
    )


def cpu_seconds(pids) -> float:
    """CPU seconds used so far by this process and the given (running) child processes."""
    total = time.process_time()
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        except OSError:  # not Linux: fall back to children that have exited
            import resource

            ru = resource.getrusage(resource.RUSAGE_CHILDREN)
            return total + ru.ru_utime + ru.ru_stime
    return total


if __name__ == "__main__":
    main()
