"""One command that checks the accelerator path end to end and prints one table.

Checks (each catches its own exception and becomes a FAILED row with a one-line reason; the
rest still run):

- ``accelerator``, ``versions``, ``device``: the device JAX found, a GPU or a TPU (none is the
  row "no accelerator: skipped", not a failure), jax / jaxlib / plugin versions (CUDA, libtpu;
  ``importlib.metadata``),
  device kind and platform version, host cores and CPU devices.
- ``ensemble placement``: an 8-member ensemble of the MLP (``examples/memory_reduction.py``,
  5000 hidden units) built with ``ensemble.build`` on the accelerator, one donated
  ``ensemble.train_step``; ``ensemble.assert_member_placement`` and
  ``assert_no_replicated_members`` on parameters + Adam state, donated inputs freed, loss finite.
- ``ensemble memory``: the device's ``memory_stats()`` peak of that donated step against
  ``ensemble.compiled_memory``'s estimate (ratio; "warn" outside 0.75-1.25).
- ``on_cpu executor`` / ``result`` / ``speed-up``: ``rollout.on_cpu(render, executor='auto')``
  (the GRU synthesiser of ``benchmarks/on_cpu_speed.py``) called from a step jitted on the
  accelerator, on all host cores: which executor it picked ('inprocess' expected for an
  accelerator caller, 'process' for a CPU one), its output against the function run directly on
  one CPU device, and its speed-up over that one core.
- ``ppo steps/s`` / ``ppo first call``: ensemble PPO on CartPole (``rollout.ppo.Learner``,
  4 members, ``benchmarks/ppo.py``'s timing) on the accelerator against the same run on the host's
  CPU devices (one member per device, as ``python -m rollout.ppo`` sets them up), and the first
  call's time (compile + first updates).
- ``ppo host envs`` / ``ppo on_cpu envs``: the same PPO with its envs on the host, stepped from
  inside the update jitted on the accelerator: gymnasium's CartPole-v1 in worker processes
  (skipped without gymnasium), and the JAX CartPole through ``on_cpu`` (``env_on='cpu'``); env
  steps/s and finite parameters.

Without an accelerator (or with ``--dry``) it runs in DRY mode: tiny sizes, and on a CPU-only host
CPU devices stand in for the accelerator, so every code path runs but no figure is an accelerator
result; the table says so at the top. One simulated CPU device per core is configured before JAX
starts (``rollout.configure_cpu_devices``): on an accelerator host those are ``on_cpu``'s
in-process workers.

Run::

    python benchmarks/accelerator_check.py            # full on a GPU or TPU host (< 5 min)
    python benchmarks/accelerator_check.py --dry      # tiny sizes anywhere (about a minute)

Writes ``accelerator_check.txt`` and ``.json`` (``accelerator_check_dry.*`` in DRY mode, so a dry
run never overwrites an accelerator result) to ``--out`` (default ``benchmarks/results``).
A check that runs longer than ``--check-timeout`` seconds (default 240) is taken for a hang: the
table so far is written with that check FAILED and the later ones not run, and the command exits.
Exit code: 0 when no check FAILED, 1 otherwise, 2 for bad command-line input.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

MB = 1e6
OK, WARN, SKIPPED, FAILED = "ok", "warn", "skipped", "FAILED"
MEMORY_BAND = (0.75, 1.25)  # measured / estimated step peak outside this: "warn"
PACKAGES = (
    "jax",
    "jaxlib",
    "jax-cuda12-plugin",
    "jax-cuda12-pjrt",
    "jax-cuda13-plugin",
    "jax-cuda13-pjrt",
    "libtpu",
    "flax",
    "optax",
)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Problem sizes; FULL for an accelerator, DRY for a quick run anywhere."""

    members: int = 8  # ensemble members
    hidden: int = 5000  # the MLP's hidden units
    input_dim: int = 20  # the MLP's input features
    batch: int = 1024  # shared batch of the train step
    rollout_batch: int = 256  # on_cpu rows (benchmarks/on_cpu_speed.py's batch 256)
    samples: int = 2048  # audio samples per row
    synth_hidden: int = 32  # GRU units of the synthesiser
    reps: int = 5  # timed rounds of on_cpu (best kept)
    ppo_members: int = 4
    ppo_num_steps: int = 128  # env steps per env per update (CleanRL's CartPole)
    ppo_calls: int = 6  # timed calls of ...
    ppo_updates: int = 10  # ... this many PPO updates each


FULL = Sizes()
DRY = Sizes(
    hidden=64,
    batch=16,
    rollout_batch=8,
    samples=64,
    reps=2,
    ppo_num_steps=16,
    ppo_calls=1,
    ppo_updates=1,
)


@dataclasses.dataclass
class Context:
    """What every check needs: sizes, mode and devices."""

    sizes: Sizes
    dry: bool
    dry_reason: str | None
    accelerator: list[Any]  # accelerator devices, or CPU devices standing in for them (DRY)
    has_accelerator: bool
    cpus: list[Any]


@dataclasses.dataclass
class Row:
    """One line of the table: check name, status, one-line result, and values for the JSON."""

    check: str
    status: str
    result: str
    values: dict[str, Any] = dataclasses.field(default_factory=dict)


# ------------------------------------------------------------------------------- helpers


def _load(name: str, path: Path) -> Any:
    """Imports an example / benchmark script as a module, to reuse its helpers."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def one_line(e: BaseException) -> str:
    """``Type: first line of the message``, at most 300 characters."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def whole_members(members: int, available: int) -> int:
    """Most devices (<= available, <= members) that each hold a whole number of members.

    Example:
      >>> [whole_members(8, d) for d in (1, 2, 3, 16)], whole_members(4, 3)
      ([1, 2, 2, 8], 2)
    """
    return max(d for d in range(1, min(members, available) + 1) if members % d == 0)


def package_versions() -> dict[str, str | None]:
    """Installed version of each of PACKAGES (None when not installed)."""
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def step_peak(in_use_before: int, peak_before: int, peak_after: int, args_live: int) -> int | None:
    """A step's own peak bytes on a device, from ``memory_stats()`` read around one call.

    Before the call the device holds the step's arguments (``args_live`` bytes) and other arrays;
    the other arrays stay live through the call, so the step's peak is the new peak minus them.
    ``peak_bytes_in_use`` never resets: if the call did not raise it, the step's peak is hidden
    under an earlier one and ``None`` is returned.

    Example:
      >>> step_peak(in_use_before=500, peak_before=900, peak_after=1300, args_live=200)
      1000
      >>> step_peak(500, 900, 900, 200) is None
      True
    """
    if peak_after <= peak_before:
        return None
    return peak_after - (in_use_before - args_live)


def make_context(dry_flag: bool) -> Context:
    """Devices and mode; CPU devices stand in for the accelerator when there is none."""
    import jax

    devices = jax.devices()
    has_accelerator = devices[0].platform != "cpu"
    dry = dry_flag or not has_accelerator
    reason = "--dry" if dry_flag else (None if has_accelerator else "no accelerator found")
    return Context(
        sizes=DRY if dry else FULL,
        dry=dry,
        dry_reason=reason,
        accelerator=list(devices),
        has_accelerator=has_accelerator,
        cpus=list(jax.devices("cpu")),
    )


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


# ------------------------------------------------------------------------------- checks


def check_environment(ctx: Context) -> list[Row]:
    """Which accelerator, package versions, device kind."""
    versions = package_versions()
    plugins = {k: v for k, v in versions.items() if ("cuda" in k or "tpu" in k) and v}
    dev = ctx.accelerator[0]
    kind = f"{dev.platform} x{len(ctx.accelerator)} ({dev.device_kind})"
    if ctx.has_accelerator:
        accel = Row("accelerator", OK, kind, {"platform": dev.platform})
    else:
        hint = "; an accelerator plugin is installed but JAX found no device" if plugins else ""
        accel = Row(
            "accelerator",
            SKIPPED,
            f"no accelerator: skipped (DRY: {len(ctx.accelerator)} CPU devices stand in){hint}",
            {"platform": dev.platform},
        )
    main = ", ".join(f"{k} {versions[k] or 'missing'}" for k in ("jax", "jaxlib", "flax", "optax"))
    plugin = ", ".join(f"{k} {v}" for k, v in plugins.items()) or "none installed"
    vrow = Row("versions", OK, f"{main}; plugin: {plugin}", {"packages": versions})
    try:
        pv = str(dev.client.platform_version).strip().splitlines()[-1]
    except Exception:  # not every backend reports one
        pv = "unknown"
    values = {
        "device_kind": dev.device_kind,
        "platform": dev.platform,
        "platform_version": pv,
        "devices": len(ctx.accelerator),
        "host_cores": _cores(),
        "cpu_devices": len(ctx.cpus),
    }
    drow = Row(
        "device",
        OK,
        f"{kind}, platform version {pv!r}; host: {_cores()} cores, {len(ctx.cpus)} CPU devices",
        values,
    )
    return [accel, vrow, drow]


def check_ensemble(ctx: Context) -> list[Row]:
    """The MLP ensemble on the accelerator: placement after a donated step, its memory."""
    import jax
    import jax.numpy as jnp
    import optax

    import ensemble

    seed = _load("memory_reduction", ROOT / "examples" / "memory_reduction.py")
    s, n = ctx.sizes, ctx.sizes.members
    devices = ctx.accelerator[: whole_members(n, len(ctx.accelerator))]
    ens = ensemble.build(seed.MLP(features=s.hidden), n, devices=devices, rules=seed.RULES)
    kx, ky = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (s.batch, s.input_dim))
    y = jax.random.normal(ky, (s.batch,))
    params = ens.init(jax.random.key(0), x)["params"]

    def loss_fn(p, x, y):  # ONE member's loss; train_step vmaps it over the members
        return jnp.mean((ens.model.apply({"params": p}, x) - y) ** 2)

    step = ensemble.train_step(loss_fn, optax.adam(1e-3), n=n, mesh=ens.mesh, rules=ens.rules)
    opt_state = step.init(params)
    donated = [a for a in jax.tree_util.tree_leaves((params, opt_state)) if a.shape[:1] == (n,)]
    # The first call compiles (and autotunes on GPU) before anything is measured.
    params, opt_state, losses = step(params, opt_state, x, y)
    losses = jax.device_get(losses)
    freed = all(a.is_deleted() for a in donated)
    placement = _placement_row(ctx, (params, opt_state), ens.mesh, devices, freed, losses)
    try:  # a failure here leaves the placement row standing
        memory = _memory_row(step, (params, opt_state, x, y), devices)
    except Exception as e:
        memory = Row("ensemble memory", FAILED, one_line(e), {"traceback": traceback.format_exc()})
    return [placement, memory]


def _placement_row(ctx, state, mesh, devices, freed, losses) -> Row:
    import numpy as np

    import ensemble

    n = ctx.sizes.members
    values = {
        "members": n,
        "devices": [str(d) for d in devices],
        "param_bytes": int(sum(a.nbytes for a in _leaves(state[0]))),
        "state_bytes": int(sum(a.nbytes for a in _leaves(state))),
        "donated_inputs_freed": freed,
        "losses": [float(v) for v in losses],
    }
    where = f"{n} members on {len(devices)} {devices[0].platform} device(s)"
    try:
        ensemble.assert_member_placement(state, mesh, n)
        ensemble.assert_no_replicated_members(state, n, mesh)
    except AssertionError as e:
        return Row("ensemble placement", FAILED, f"{where}: {one_line(e)}", values)
    if not freed:
        return Row("ensemble placement", FAILED, f"{where}: donated inputs were not freed", values)
    if not np.all(np.isfinite(losses)):
        return Row("ensemble placement", FAILED, f"{where}: non-finite loss {losses}", values)
    return Row(
        "ensemble placement",
        OK,
        f"{where}: assert_member_placement ok on params + Adam state after a donated step "
        "(inputs freed, losses finite)",
        values,
    )


def _leaves(tree: Any) -> list[Any]:
    import jax

    return jax.tree_util.tree_leaves(tree)


def _memory_stats(device: Any) -> dict[str, int] | None:
    try:
        return device.memory_stats()
    except Exception:  # some backends raise instead of returning None
        return None


def _memory_row(step: Any, args: tuple, devices: Sequence[Any], stats=_memory_stats) -> Row:
    """The step's measured peak (``stats``: ``Device.memory_stats``) against its estimate."""
    import ensemble

    estimate = ensemble.compiled_memory(step, *args)  # the program already compiled: cached
    values: dict[str, Any] = {"estimate": estimate.as_dict(), "estimate_peak": estimate.peak}
    first = stats(devices[0])
    if not first or "peak_bytes_in_use" not in first:
        return Row(
            "ensemble memory",
            SKIPPED,
            f"no accelerator: skipped ({devices[0].platform} devices give no memory_stats); "
            f"compiled estimate {estimate.peak / MB:.2f} MB per device",
            values,
        )
    measured = measure_step_peak(step, args, devices, stats)
    values["measured"] = {str(d): m for d, m in measured.items()}
    known = [m for m in measured.values() if m is not None]
    if not known:
        return Row("ensemble memory", WARN, "step peak hidden under an earlier peak", values)
    worst = max(known, key=lambda m: abs(math.log(m / estimate.peak)))
    buffers = estimate.argument + estimate.output - estimate.alias
    if estimate.temp and worst < buffers + estimate.temp / 2:
        # A TPU's allocator keeps a program's scratch out of these counters: what it reports is
        # the step's arguments and results alone, whatever the temporaries were.
        return Row(
            "ensemble memory",
            SKIPPED,
            f"not measurable here: memory_stats peak {worst / MB:.2f} MB is about the step's "
            f"arguments and results ({buffers / MB:.2f} MB), so this device's counters leave "
            f"out the program's {estimate.temp / MB:.2f} MB of temporaries; compiled estimate "
            f"{estimate.peak / MB:.2f} MB per device",
            values,
        )
    ratio = worst / estimate.peak
    values["ratio"] = ratio
    lo, hi = MEMORY_BAND
    return Row(
        "ensemble memory",
        OK if lo <= ratio <= hi else WARN,
        f"memory_stats peak {worst / MB:.2f} MB vs compiled estimate {estimate.peak / MB:.2f} MB "
        f"per device: ratio {ratio:.3f} (ok within {lo}-{hi})",
        values,
    )


def measure_step_peak(
    step: Any, args: tuple, devices: Sequence[Any], stats=_memory_stats
) -> dict[Any, int | None]:
    """Per device, the peak bytes of one call of ``step(*args)`` (which donates ``args``).

    ``peak_bytes_in_use`` only grows, so first each device gets a ballast that lifts what it
    holds to its peak so far: the call then sets a new peak, whatever came before (compilation,
    autotuning, other checks), and :func:`step_peak` reads the step's share off it.
    """
    import jax
    import jax.numpy as jnp

    import ensemble

    ballast = []
    for d in devices:
        st = stats(d)
        gap = max(0, st["peak_bytes_in_use"] - st["bytes_in_use"]) + 2**20
        ballast.append(jnp.zeros((gap,), jnp.uint8, device=d))
    jax.block_until_ready(ballast)
    live = ensemble.live_memory(args)
    before = {d: stats(d) for d in devices}
    jax.block_until_ready(step(*args))
    after = {d: stats(d) for d in devices}
    del ballast
    return {
        d: step_peak(
            before[d]["bytes_in_use"],
            before[d]["peak_bytes_in_use"],
            after[d]["peak_bytes_in_use"],
            live.get(d, 0),
        )
        for d in devices
    }


def check_on_cpu(ctx: Context) -> list[Row]:
    """rollout.on_cpu(executor='auto') from a step jitted on the accelerator, all host cores."""
    import jax
    import numpy as np

    import rollout
    from rollout.envs import init_synth_params

    bench = _load("rollout_benchmark", ROOT / "benchmarks" / "on_cpu_speed.py")
    s = ctx.sizes
    render = bench.make_render(s.samples, s.synth_hidden)
    rng = np.random.default_rng(0)  # gain and frequency per row, as in benchmarks/on_cpu_speed.py
    b = s.rollout_batch
    gf = np.stack([rng.uniform(0, 2, b), np.exp(rng.uniform(np.log(110), np.log(880), b))], -1)
    gf = gf.astype(np.float32)
    params = init_synth_params(jax.random.key(0), s.synth_hidden)
    cpu_args = jax.device_put((params, gf), ctx.cpus[0])
    acc_args = jax.device_put((params, gf), ctx.accelerator[0])
    one_core = jax.jit(render)  # one CPU device, one thread: one core
    f = rollout.on_cpu(render, in_axes=(None, 0), executor="auto")
    try:
        step = jax.jit(f)  # the caller: a program on the accelerator
        got = np.asarray(step(*acc_args))
        picked, workers = f.last_executor, (f.workers or len(f.pids) or len(ctx.cpus))
        ref = np.asarray(one_core(*cpu_args))
        (t_one, _), (t_all, _) = bench.timeit([(one_core, cpu_args), (step, acc_args)], s.reps)
    finally:
        f.close()
    return [
        _executor_row(ctx, picked),
        _equal_row(got, ref),
        _speed_row(ctx, t_one, t_all, picked, workers),
    ]


def _executor_row(ctx: Context, picked: str | None) -> Row:
    platform_ = ctx.accelerator[0].platform
    # The documented rule: in-process for accelerator callers when it gets several CPU devices.
    several = len(ctx.cpus) >= min(_cores(), 2)
    expected = "inprocess" if platform_ != "cpu" and several else "process"
    return Row(
        "on_cpu executor",
        OK if picked == expected else FAILED,
        f"auto picked {picked!r} (expected {expected!r} for a {platform_} caller)",
        {"picked": picked, "expected": expected},
    )


def _equal_row(got: Any, ref: Any) -> Row:
    import numpy as np

    if got.shape != ref.shape:
        return Row("on_cpu result", FAILED, f"shape {got.shape}, direct gives {ref.shape}")
    diff = float(np.max(np.abs(got - ref))) if got.size else 0.0
    ok = bool(np.allclose(got, ref, atol=1e-5, rtol=1e-5))
    return Row(
        "on_cpu result",
        OK if ok else FAILED,
        f"max |on_cpu - direct on one CPU device| = {diff:.1e} over {got.shape} (atol 1e-5)",
        {"max_abs_diff": diff, "shape": list(got.shape)},
    )


def _speed_row(ctx: Context, t_one: float, t_all: float, picked: Any, workers: int) -> Row:
    speedup = t_one / t_all
    slow = not ctx.dry and workers > 1 and speedup < 1
    return Row(
        "on_cpu speed-up",
        WARN if slow else OK,
        f"{speedup:.2f}x over one core with {workers} {picked} workers ({t_all * 1e3:.1f} vs "
        f"{t_one * 1e3:.1f} ms per call, best of {ctx.sizes.reps})",
        {"speedup": speedup, "seconds_all": t_all, "seconds_one_core": t_one, "workers": workers},
    )


PPO_ROWS = ("ppo steps/s", "ppo first call")


def check_ppo(ctx: Context) -> list[Row]:
    """Ensemble PPO CartPole on the accelerator against the same run on the host's CPU devices."""
    from rollout.ppo import PPOConfig

    s, m = ctx.sizes, ctx.sizes.ppo_members
    cfg = PPOConfig.for_env(
        "cartpole",
        members=m,
        total_steps=10**7,
        num_steps=s.ppo_num_steps,
        updates_per_call=s.ppo_updates,
    )
    layouts = {
        "accelerator": ctx.accelerator[: whole_members(m, len(ctx.accelerator))],
        "host CPU": ctx.cpus[: whole_members(m, len(ctx.cpus))],
    }
    runs = _ppo_runs(cfg, layouts, s)
    errors = [f"{k} run: {r['error']}" for k, r in runs.items() if "error" in r]
    if errors:
        return [Row(name, FAILED, "; ".join(errors), {"runs": runs}) for name in PPO_ROWS]
    finite = _finite([r.pop("params") for r in runs.values()])  # not written to the JSON
    acc, host = runs["accelerator"], runs["host CPU"]
    label = "accelerator" if ctx.has_accelerator else "CPU stand-in"
    one_run = layouts["accelerator"] == layouts["host CPU"]
    ratio = acc["env_steps_per_s"] / host["env_steps_per_s"]
    values = {k: {**r, "devices": len(layouts[k])} for k, r in runs.items()}
    speed = Row(
        "ppo steps/s",
        OK if finite else FAILED,
        f"{label} ({len(layouts['accelerator'])} dev) {acc['env_steps_per_s']:,.0f} vs host CPU "
        f"({len(layouts['host CPU'])} dev) {host['env_steps_per_s']:,.0f} env steps/s: "
        f"{ratio:.2f}x, {m} members"
        + (" (same devices: one run)" if one_run else "")
        + ("" if finite else "; NON-FINITE parameters"),
        {**values, "ratio": ratio, "finite_params": finite, "one_run": one_run},
    )
    first = Row(
        "ppo first call",
        OK,
        f"{label} {acc['first_call_s']:.1f} s, host CPU {host['first_call_s']:.1f} s "
        f"(compile + {s.ppo_updates} update(s))",
        {k: r["first_call_s"] for k, r in runs.items()},
    )
    return [speed, first]


def _finite(tree: Any) -> bool:
    import numpy as np

    return all(bool(np.all(np.isfinite(a))) for a in _leaves(tree))


def _ppo_runs(cfg: Any, layouts: dict[str, list[Any]], s: Sizes) -> dict[str, dict[str, Any]]:
    """benchmarks/ppo.py's timed run on each layout; identical layouts share one run."""
    bench = _load("ppo_benchmark", ROOT / "benchmarks" / "ppo.py")
    runs: dict[str, dict[str, Any]] = {}
    for name, devices in layouts.items():
        same = [k for k in runs if layouts[k] == devices]
        if same:  # DRY on a CPU-only host: the stand-in is the host itself
            runs[name] = dict(runs[same[0]])
            continue
        try:  # one layout failing still leaves the other's figures in the row
            runs[name] = bench._timed_run(cfg, devices, s.ppo_calls, s.ppo_updates)
        except Exception as e:
            runs[name] = {"error": one_line(e), "traceback": traceback.format_exc()}
    return runs


ENV_ROWS = ("ppo host envs", "ppo on_cpu envs")


def check_ppo_envs(ctx: Context) -> list[Row]:
    """PPO whose envs run on the host, stepped from the update jitted on the accelerator:
    gymnasium's CartPole in worker processes, and the JAX CartPole through ``on_cpu``."""
    from rollout.ppo import PPOConfig

    s, m = ctx.sizes, ctx.sizes.ppo_members
    devices = ctx.accelerator[: whole_members(m, len(ctx.accelerator))]
    common = dict(members=m, total_steps=10**7, num_steps=s.ppo_num_steps, updates_per_call=1)
    runs = (
        ("ppo host envs", "gymnasium:CartPole-v1", {}),
        ("ppo on_cpu envs", "cartpole", {"env_on": "cpu"}),
    )
    rows = []
    for name, env, extra in runs:
        if env.startswith("gymnasium:") and importlib.util.find_spec("gymnasium") is None:
            rows.append(Row(name, SKIPPED, "gymnasium is not installed"))
            continue
        try:  # one failing leaves the other's row standing
            rows.append(_env_row(name, PPOConfig.for_env(env, **extra, **common), devices, s))
        except Exception as e:
            rows.append(Row(name, FAILED, one_line(e), {"traceback": traceback.format_exc()}))
    return rows


def _env_row(name: str, cfg: Any, devices: Sequence[Any], s: Sizes) -> Row:
    bench = _load("ppo_benchmark", ROOT / "benchmarks" / "ppo.py")
    run = bench._timed_run(cfg, devices, s.ppo_calls, 2)
    finite = _finite(run.pop("params"))
    where = f"{cfg.env} ({cfg.members} members x {cfg.num_envs} envs) on {len(devices)} "
    return Row(
        name,
        OK if finite else FAILED,
        where + f"{devices[0].platform} device(s): {run['env_steps_per_s']:,.0f} env steps/s, "
        f"first call {run['first_call_s']:.1f} s" + ("" if finite else "; NON-FINITE parameters"),
        {**run, "finite_params": finite, "devices": len(devices)},
    )


CHECKS: tuple[tuple[tuple[str, ...], Callable[[Context], list[Row]]], ...] = (
    (("accelerator", "versions", "device"), check_environment),
    (("ensemble placement", "ensemble memory"), check_ensemble),
    (("on_cpu executor", "on_cpu result", "on_cpu speed-up"), check_on_cpu),
    (PPO_ROWS, check_ppo),
    (ENV_ROWS, check_ppo_envs),
)


# ------------------------------------------------------------------------------- running


def run_checks(
    checks: Sequence[tuple[tuple[str, ...], Callable]],
    ctx: Any,
    limit_s: float | None = None,
    on_stuck: Callable[[list[Row]], None] | None = None,
) -> list[Row]:
    """Runs every check; an exception turns that check's rows into FAILED rows with its reason.

    A check still running after ``limit_s`` seconds (a hang: Python cannot interrupt a thread
    blocked in XLA) makes ``on_stuck`` get the rows so far, that check's rows FAILED and the
    later checks' rows "not run"; ``main`` writes them and exits, so the command never hangs.
    """
    rows: list[Row] = []
    for i, (names, fn) in enumerate(checks):
        timer = None
        if limit_s is not None and on_stuck is not None:
            reason = f"did not finish within {limit_s:g} s (hung?)"
            later = [n for more, _ in checks[i + 1 :] for n in more]
            stuck = [Row(n, FAILED, reason) for n in names]
            stuck += [Row(n, FAILED, f"not run: {names[0]} hung") for n in later]
            timer = threading.Timer(limit_s, on_stuck, args=(rows + stuck,))
            timer.daemon = True
            timer.start()
        t0 = time.perf_counter()
        try:
            got = fn(ctx)
        except Exception as e:  # a failing check is reported, and the next one still runs
            tb = traceback.format_exc()
            got = [Row(name, FAILED, one_line(e), {"traceback": tb}) for name in names]
        finally:
            if timer is not None:
                timer.cancel()
        seconds = time.perf_counter() - t0
        for row in got:
            row.values.setdefault("check_seconds", seconds)
        rows.extend(got)
        print(f"  {', '.join(names)}: {seconds:.1f} s", file=sys.stderr, flush=True)
    return rows


def exit_code(rows: Sequence[Row]) -> int:
    """0 when no row FAILED, else 1."""
    return 1 if any(r.status == FAILED for r in rows) else 0


def header(ctx: Context) -> str:
    dev = ctx.accelerator[0]
    if not ctx.dry:
        return f"accelerator check: FULL on {dev.device_kind} x{len(ctx.accelerator)}"
    where = (
        f"on {dev.device_kind}"
        if ctx.has_accelerator
        else f"{len(ctx.accelerator)} CPU devices stand in for the accelerator: NOT accelerator "
        "results"
    )
    return f"accelerator check: DRY MODE ({ctx.dry_reason}; tiny sizes; {where})"


def table(title: str, rows: Sequence[Row]) -> str:
    width = max(len(r.check) for r in rows)
    head = f"{'check':<{width}}  {'status':<7}  result"
    lines = [title, head, "-" * max(len(head), 72)]
    lines += [f"{r.check:<{width}}  {r.status:<7}  {r.result}" for r in rows]
    return "\n".join(lines)


def _json_default(x: Any) -> Any:
    return str(x)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    from rollout.ppo._parser import OneLineParser, positive_float, writable_dir

    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--dry", action="store_true", help="tiny sizes (automatic without an accelerator)"
    )
    p.add_argument(
        "--out",
        type=writable_dir,
        default=str(ROOT / "benchmarks" / "results"),
        help="output folder",
    )
    p.add_argument(
        "--check-timeout",
        type=positive_float,
        default=240.0,
        help="seconds one check may take before it is reported as hung (default 240)",
    )
    return p.parse_args(argv)


def write_report(out: Path, ctx: Context, title: str, rows: list[Row], start: float) -> int:
    """Prints the table, writes it and the JSON; returns the exit code."""
    text = table(title, rows)
    print(text, flush=True)
    stem = "accelerator_check_dry" if ctx.dry else "accelerator_check"
    report = {
        "mode": "dry" if ctx.dry else "full",
        "dry_reason": ctx.dry_reason,
        "header": title,
        "sizes": dataclasses.asdict(ctx.sizes),
        "rows": [dataclasses.asdict(r) for r in rows],
        "exit_code": exit_code(rows),
        "seconds": time.perf_counter() - start,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "load_avg": os.getloadavg(),
    }
    (out / f"{stem}.txt").write_text(text + "\n")
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1, default=_json_default) + "\n")
    print(f"wrote {out / stem}.txt and .json ({report['seconds']:.0f} s)", file=sys.stderr)
    return report["exit_code"]


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    out = args.out
    import rollout

    try:
        rollout.configure_cpu_devices()  # one CPU device per core, before JAX starts
    except RuntimeError:  # JAX already running (called from a live session): keep its devices
        pass
    start = time.perf_counter()
    ctx = make_context(args.dry)
    title = header(ctx)
    print(title, file=sys.stderr, flush=True)

    def on_stuck(rows: list[Row]) -> None:
        write_report(out, ctx, title, rows, start)
        os._exit(1)  # the stuck thread cannot be joined; leave with what was measured

    rows = run_checks(CHECKS, ctx, args.check_timeout, on_stuck)
    return write_report(out, ctx, title, rows, start)


if __name__ == "__main__":
    sys.exit(main())
