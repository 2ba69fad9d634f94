"""How long worker processes take to start: forked from a template against fresh interpreters.

For each way (``ROLLOUT_FORK_WORKERS`` = 1 or 0) and each kind of worker, this starts a pool of W
workers R times (closing it in between) and reports the wall time from the call to the pool being
ready, and the whole machine's CPU-seconds meanwhile (from /proc/stat; keep the machine quiet).
Each way runs in its own fresh process, so the template's one start is counted.

  python benchmarks/worker_start.py            # W = cores, R = 5
  python benchmarks/worker_start.py --workers 4 --repeats 3

Writes benchmarks/results/worker_start.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results"
KINDS = ("on_cpu", "gymnasium", "envpool")
WAYS = {"fork": "1", "fresh": "0"}


def _cpu_s() -> float:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields[:3]) + sum(fields[5:8])) / os.sysconf("SC_CLK_TCK")


def _starter(kind: str, workers: int):
    """(start, stop) of a pool of ``workers`` workers of ``kind``."""
    if kind == "on_cpu":
        from rollout._pool import ProcessPool

        pool = ProcessPool(workers)
        return pool._ensure_workers, pool._shutdown
    import numpy as np

    from rollout.hostenv._group import WorkerGroup

    counts, obs, act = [1] * workers, ((4,), np.float32), ((), np.int32)
    group = WorkerGroup(kind, "CartPole-v1", {}, counts, "bench", *obs, *act)
    return group.start, group.close


def _child(kind: str, workers: int, repeats: int) -> dict:
    start, stop = _starter(kind, workers)
    walls, cpus = [], []
    for _ in range(repeats):
        t, c = time.perf_counter(), _cpu_s()
        start()
        walls.append(time.perf_counter() - t)
        cpus.append(_cpu_s() - c)
        stop()
        time.sleep(0.5)  # the stopped workers' exits are not the next start's
    return {"wall_s": walls, "cpu_s": cpus}


def _available(kind: str) -> bool:
    if kind != "envpool":
        return True
    import importlib.util

    return importlib.util.find_spec("envpool") is not None


def main(argv: list[str] | None = None) -> int:
    from rollout._devices import available_cores
    from rollout._on_cpu import MAX_WORKERS_PER_CORE
    from rollout.ppo._parser import OneLineParser, positive_int, writable_dir

    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=positive_int, default=os.cpu_count() or 2)
    p.add_argument("--repeats", type=positive_int, default=5, help="at least 2")
    p.add_argument("--out", type=writable_dir, help=f"output folder (default {OUT})")
    p.add_argument("--child", nargs=1, choices=KINDS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.repeats < 2:
        p.error(f"--repeats must be >= 2 (the first start is reported apart), got {args.repeats}")
    most = MAX_WORKERS_PER_CORE * available_cores()  # as on_cpu and the host envs allow
    if args.workers > most:
        p.error(f"--workers {args.workers} is more than {MAX_WORKERS_PER_CORE} per CPU core "
                f"({available_cores()} cores); give at most {most}")  # fmt: skip
    if args.child:  # writes nothing, so takes no --out
        print(json.dumps(_child(args.child[0], args.workers, args.repeats)))
        return 0
    args.out = args.out or p.results_dir(OUT)
    rows = []
    for kind in filter(_available, KINDS):
        for way, flag in WAYS.items():
            env = dict(os.environ, ROLLOUT_FORK_WORKERS=flag, PYTHONPATH=str(ROOT))
            cmd = [sys.executable, __file__, "--child", kind, "--workers", str(args.workers),
                   "--repeats", str(args.repeats)]  # fmt: skip
            out = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if out.returncode != 0:
                why = (out.stderr.strip().splitlines() or ["no output"])[-1]
                p.exit(1, f"error: the {kind} start ({way}) failed: {why}\n")
            got = json.loads(out.stdout.strip().splitlines()[-1])
            w, c = got["wall_s"], got["cpu_s"]
            rows.append({"kind": kind, "way": way, "workers": args.workers,
                         "first_wall_s": w[0], "first_cpu_s": c[0],
                         "restart_wall_s": sum(w[1:]) / len(w[1:]),
                         "restart_cpu_s": sum(c[1:]) / len(c[1:])})  # fmt: skip
    header = f"{'kind':>9} {'way':>6} {'first start':>18} {'restart (mean)':>18}"
    lines = [header, f"{'':>16} {'wall s':>8} {'CPU s':>9} {'wall s':>8} {'CPU s':>9}"]
    for r in rows:
        first = f"{r['first_wall_s']:8.2f} {r['first_cpu_s']:9.2f}"
        lines.append(f"{r['kind']:>9} {r['way']:>6} {first} "
                     f"{r['restart_wall_s']:8.2f} {r['restart_cpu_s']:9.2f}")  # fmt: skip
    text = "\n".join(lines)
    print(text)
    meta = {"cores": os.cpu_count(), "workers": args.workers, "repeats": args.repeats}
    (args.out / "worker_start.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
