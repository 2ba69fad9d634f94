"""What one host callback per device and step costs, on 1 device and on several.

A jitted ``lax.scan`` of ``--steps`` steps whose body calls ``rollout._host_call.host_call``
inside ``shard_map`` once per device (the path every host-env step takes), with a callback that
returns a small array after ``spin:W`` (W us of Python, holding the interpreter lock) or
``sleep:W`` (W us asleep, the lock free, as while waiting for a worker). Per device count D and
callback: wall time and the process's CPU time per step, median of ``--repeats`` runs, each in a
fresh process (the CPU device count is fixed at JAX's start).

With D devices, D threads each enter Python once per step. ``spin``: they take turns on the
interpreter lock, and the difference between D = 1 and D = 2 at ``spin:0`` is that
turn-taking. ``sleep``: their waits overlap.

Run: ``python benchmarks/callback_cost.py`` (about half a minute). Writes
``benchmarks/results/callback_cost.json`` and ``callback_cost.txt``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

_WORKER = r"""
import json, os, sys, time
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from rollout._host_call import host_call

d, (how, work_us), steps = int(sys.argv[1]), sys.argv[2].split(":"), int(sys.argv[3])
work_us = float(work_us)
mesh = jax.make_mesh((d,), ("e",), devices=jax.devices()[:d])
result = np.zeros((1, 4), np.float32)


def callback(x):
    if how == "sleep":
        time.sleep(work_us * 1e-6)
    end = time.perf_counter() + work_us * 1e-6
    while how == "spin" and time.perf_counter() < end:
        pass
    return (result,)


def per_device(x):
    return host_call(callback, [jax.ShapeDtypeStruct((1, 4), jnp.float32)], x)[0]


@jax.jit
def run(x):
    def body(c, _):
        step = jax.shard_map(per_device, mesh=mesh, in_specs=P("e"), out_specs=P("e"))
        return step(c) + 1, None

    return jax.lax.scan(body, x, None, length=steps)[0]


x = jax.device_put(jnp.zeros((d, 4)), NamedSharding(mesh, P("e")))
jax.block_until_ready(run(x))  # compile
t0, c0 = time.perf_counter(), time.process_time()
jax.block_until_ready(run(x))
wall, cpu = time.perf_counter() - t0, time.process_time() - c0
print("RESULT " + json.dumps({"wall_us": wall / steps * 1e6, "cpu_us": cpu / steps * 1e6}))
"""


def _one(devices: int, work: str, steps: int) -> dict[str, float]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", _WORKER, str(devices), work, str(steps)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if proc.returncode != 0 or "RESULT " not in proc.stdout:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        sys.exit(f"error: the run on {devices} device(s) with --work {work} failed: {last}")
    return json.loads(proc.stdout.split("RESULT ", 1)[1])


def callback_work(text: str) -> str:
    """An argparse ``type``: ``spin:W`` or ``sleep:W``, W microseconds from 0 to 1e6 (a
    second of work per call is no callback's cost to measure)."""
    from rollout.ppo._parser import non_negative_float

    how, _, work_us = text.partition(":")
    try:
        if non_negative_float(work_us) > 1e6:
            how = ""
    except argparse.ArgumentTypeError:
        how = ""
    if how not in ("spin", "sleep"):
        raise argparse.ArgumentTypeError(
            f"expected spin:W or sleep:W (W us from 0 to 1e6), got {text!r}"
        )
    return text


def main(argv: list[str] | None = None) -> None:
    from rollout.ppo._parser import OneLineParser, positive_int

    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--devices", type=positive_int, nargs="+", default=[1, 2], help="device counts to compare"
    )
    p.add_argument(
        "--work",
        type=callback_work,
        nargs="+",
        default=["spin:0", "spin:30", "sleep:200"],
        help="host work per callback: spin:W (busy) or sleep:W, W microseconds >= 0",
    )
    p.add_argument("--steps", type=positive_int, default=3000, help="steps per timed run")
    p.add_argument(
        "--repeats", type=positive_int, default=3, help="timed runs (the median is reported)"
    )
    args = p.parse_args(argv)
    p.results_dir(RESULTS)
    rows = []
    for work in args.work:
        for d in args.devices:
            samples = [_one(d, work, args.steps) for _ in range(args.repeats)]
            med = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
            rows.append({"devices": d, "callback": work, **med, "samples": samples})
            print(f"D={d} {work} us: {med['wall_us']:.1f} us wall, "
                  f"{med['cpu_us']:.1f} us CPU per step", flush=True)  # fmt: skip
    head = f"{'devices':>7} {'callback':>10} {'wall/step':>10} {'CPU/step':>9}   (us, medians)"
    lines = [head] + [
        f"{r['devices']:>7} {r['callback']:>10} {r['wall_us']:>10.1f} {r['cpu_us']:>9.1f}"
        for r in rows
    ]
    meta = {"machine": platform.machine(), "cores": os.cpu_count(), "command": " ".join(sys.argv)}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "callback_cost.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    (RESULTS / "callback_cost.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
