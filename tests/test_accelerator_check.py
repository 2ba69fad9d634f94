"""benchmarks/accelerator_check.py: DRY mode end to end (subprocess), and its parts in process."""

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import ensemble
from rollout.ppo import PPOConfig

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "accelerator_check.py"
_spec = importlib.util.spec_from_file_location("accelerator_check", SCRIPT)
check = importlib.util.module_from_spec(_spec)
sys.modules["accelerator_check"] = check  # dataclasses look their module up there
_spec.loader.exec_module(check)

ROW_NAMES = [name for names, _ in check.CHECKS for name in names]
ON_CPU_HOST = jax.default_backend() == "cpu"


def _run(args, timeout, script=SCRIPT):
    """The script in a fresh process (its own CPU devices), killed with its workers on timeout."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, str(script), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"accelerator_check {args} did not finish within {timeout} s")
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    out = tmp_path_factory.mktemp("accelerator_check")
    # Without a GPU, no flag: DRY must switch itself on. With one, ask for it.
    args = ["--out", str(out)] + ([] if ON_CPU_HOST else ["--dry"])
    rc, stdout, stderr = _run(args, timeout=120)
    report = json.loads((out / "accelerator_check_dry.json").read_text())
    text = (out / "accelerator_check_dry.txt").read_text()
    rows = {r["check"]: r for r in report["rows"]}
    return {
        "rc": rc,
        "stdout": stdout,
        "stderr": stderr,
        "report": report,
        "text": text,
        "rows": rows,
        "out": out,
    }


@pytest.mark.timeout(180)
def test_dry_run_passes_and_labels_itself(dry):
    assert dry["rc"] == 0, dry["stderr"][-3000:]
    report, text = dry["report"], dry["text"]
    assert report["mode"] == "dry" and report["exit_code"] == 0
    assert text.splitlines()[0].startswith("accelerator check: DRY MODE")
    assert dry["stdout"].strip() == text.strip()  # the printed table is the one written
    assert not (dry["out"] / "accelerator_check.json").exists()  # a dry run never takes that name
    if ON_CPU_HOST:
        assert report["dry_reason"] == "no accelerator found"
        assert "NOT accelerator results" in text.splitlines()[0]


@pytest.mark.timeout(180)
def test_dry_run_has_every_check_once_in_order(dry):
    names = [r["check"] for r in dry["report"]["rows"]]
    assert names == ROW_NAMES
    body = dry["text"].splitlines()[3:]
    assert [line.split("  ")[0].strip() for line in body] == ROW_NAMES
    for r in dry["report"]["rows"]:
        assert r["status"] in (check.OK, check.SKIPPED), r
    if ON_CPU_HOST:
        assert dry["rows"]["accelerator"]["status"] == check.SKIPPED
        assert dry["rows"]["accelerator"]["result"].startswith("no accelerator: skipped")
        assert dry["rows"]["ensemble memory"]["status"] == check.SKIPPED
        assert dry["rows"]["ensemble memory"]["result"].startswith("no accelerator: skipped")


@pytest.mark.timeout(180)
def test_dry_run_versions_and_devices(dry):
    import jaxlib

    packages = dry["rows"]["versions"]["values"]["packages"]
    assert packages["jax"] == jax.__version__ and packages["jaxlib"] == jaxlib.__version__
    device = dry["rows"]["device"]["values"]
    cores = len(os.sched_getaffinity(0))
    assert device["host_cores"] == cores and device["cpu_devices"] == cores  # one per core


@pytest.mark.timeout(180)
def test_dry_run_ensemble_figures(dry):
    sizes, n = dry["report"]["sizes"], dry["report"]["sizes"]["members"]
    place = dry["rows"]["ensemble placement"]["values"]
    # The MLP has no biases: input x hidden + hidden x 1 weights per member, float32.
    params = n * (sizes["input_dim"] * sizes["hidden"] + sizes["hidden"]) * 4
    assert place["param_bytes"] == params
    assert place["state_bytes"] == 3 * params + 4 * n  # + Adam's mu, nu and a count per member
    assert place["donated_inputs_freed"] and np.all(np.isfinite(place["losses"]))
    assert len(place["losses"]) == n
    estimate = dry["rows"]["ensemble memory"]["values"]["estimate"]
    d = len(place["devices"])
    batch = (sizes["batch"] * sizes["input_dim"] + sizes["batch"]) * 4  # x and y, on every device
    assert estimate["argument"] == place["state_bytes"] // d + batch
    assert estimate["alias"] == place["state_bytes"] // d  # the donated state is reused
    assert estimate["peak"] >= estimate["argument"]


@pytest.mark.timeout(180)
def test_dry_run_on_cpu_figures(dry):
    sizes = dry["report"]["sizes"]
    picked = dry["rows"]["on_cpu executor"]["values"]
    assert picked["picked"] == picked["expected"] == ("process" if ON_CPU_HOST else "inprocess")
    result = dry["rows"]["on_cpu result"]["values"]
    assert result["shape"] == [sizes["rollout_batch"], sizes["samples"]]
    assert 0 <= result["max_abs_diff"] <= 1e-5
    speed = dry["rows"]["on_cpu speed-up"]["values"]
    assert speed["workers"] == len(os.sched_getaffinity(0))
    assert speed["speedup"] == pytest.approx(speed["seconds_one_core"] / speed["seconds_all"])
    assert np.isfinite(speed["speedup"]) and speed["speedup"] > 0


@pytest.mark.timeout(180)
def test_dry_run_ppo_figures(dry):
    sizes = dry["report"]["sizes"]
    row = dry["rows"]["ppo steps/s"]["values"]
    cfg = PPOConfig.for_env("cartpole", members=sizes["ppo_members"])
    steps = sizes["ppo_calls"] * sizes["ppo_updates"] * cfg.num_envs * sizes["ppo_num_steps"]
    for layout in ("accelerator", "host CPU"):
        run = row[layout]
        assert run["env_steps"] == steps * sizes["ppo_members"]
        assert run["env_steps_per_s"] == pytest.approx(run["env_steps"] / run["seconds"])
        assert run["first_call_s"] > 0
    assert row["finite_params"]
    assert row["ratio"] == pytest.approx(
        row["accelerator"]["env_steps_per_s"] / row["host CPU"]["env_steps_per_s"]
    )


# ---------------------------------------------------------------------------- in process


def test_a_failing_check_is_a_row_and_the_rest_still_run(capsys):
    def boom(ctx):
        raise ValueError("broken here\nsecond line not shown")

    def fine(ctx):
        return [check.Row("c", check.OK, "fine")]

    rows = check.run_checks([(("a", "b"), boom), (("c",), fine)], ctx=None)
    assert [(r.check, r.status) for r in rows] == [("a", "FAILED"), ("b", "FAILED"), ("c", "ok")]
    assert rows[0].result == "ValueError: broken here"
    assert "second line" in rows[0].values["traceback"]
    assert check.exit_code(rows) == 1
    assert check.exit_code(rows[2:]) == 0
    assert re.search(r"^a +FAILED +ValueError: broken here$", check.table("t", rows), re.M)


def test_a_hung_check_is_reported_and_the_rest_marked_not_run():
    release = threading.Event()
    reported = []

    def hang(ctx):
        release.wait(30)
        return [check.Row("h", check.OK, "late")]

    def on_stuck(rows):
        reported.append(rows)
        release.set()

    fine = lambda name: lambda ctx: [check.Row(name, check.OK, "fine")]
    checks = [(("a",), fine("a")), (("h",), hang), (("z",), fine("z"))]
    check.run_checks(checks, None, limit_s=0.3, on_stuck=on_stuck)
    (rows,) = reported
    assert [(r.check, r.status) for r in rows] == [("a", "ok"), ("h", "FAILED"), ("z", "FAILED")]
    assert rows[1].result == "did not finish within 0.3 s (hung?)"
    assert rows[2].result == "not run: h hung"


@pytest.mark.timeout(120)
def test_a_hung_check_ends_the_command_with_the_table_so_far(tmp_path):
    # The script with its ensemble check hanging (a timing alone would not make it hang: with a
    # warm compilation cache the check can finish in 0.5 s): it must report it and exit 1.
    hangs = tmp_path / "hangs.py"
    hangs.write_text(
        "import importlib.util, sys, threading\n"
        f"spec = importlib.util.spec_from_file_location('accelerator_check', {str(SCRIPT)!r})\n"
        "check = importlib.util.module_from_spec(spec)\n"
        "sys.modules['accelerator_check'] = check\n"
        "spec.loader.exec_module(check)\n"
        "hang = lambda ctx: threading.Event().wait(60)\n"
        "check.CHECKS = tuple((names, hang if 'ensemble placement' in names else fn)\n"
        "                     for names, fn in check.CHECKS)\n"
        "sys.exit(check.main())\n"
    )
    args = ["--dry", "--out", str(tmp_path), "--check-timeout", "0.5"]
    rc, out, err = _run(args, timeout=100, script=hangs)
    assert rc == 1, err[-2000:]
    report = json.loads((tmp_path / "accelerator_check_dry.json").read_text())
    status = {r["check"]: (r["status"], r["result"]) for r in report["rows"]}
    assert list(status) == ROW_NAMES and report["exit_code"] == 1
    assert status["versions"][0] == check.OK
    assert status["ensemble placement"] == (check.FAILED, "did not finish within 0.5 s (hung?)")
    assert status["ppo first call"] == (check.FAILED, "not run: ensemble placement hung")
    assert out.strip() == (tmp_path / "accelerator_check_dry.txt").read_text().strip()


def test_whole_members():
    assert [check.whole_members(8, d) for d in (1, 2, 3, 4, 5, 8, 16)] == [1, 2, 2, 4, 4, 8, 8]
    assert [check.whole_members(4, d) for d in (1, 3, 16)] == [1, 2, 4]


def test_step_peak():
    # 300 other bytes + 200 of arguments before; the step peaks at 700 above the others.
    assert (
        check.step_peak(in_use_before=500, peak_before=900, peak_after=1000, args_live=200) == 700
    )
    assert check.step_peak(500, 900, 900, 200) is None  # hidden under an earlier peak


class _GpuLikeStats:
    """memory_stats() as a GPU gives it: live bytes now, and a peak that never resets.

    ``wrap(step, extra)`` makes the step raise the peak to what was held when it started plus
    ``extra`` (its output + temp beyond the donated arguments), as the device would see it.
    """

    def __init__(self, earlier: int):
        live = ensemble.live_memory()
        self.peak = {d: live[d] + earlier for d in jax.devices()}  # e.g. left by autotuning

    def __call__(self, device):
        in_use = ensemble.live_memory()[device]
        self.peak[device] = max(self.peak[device], in_use)
        return {"bytes_in_use": in_use, "peak_bytes_in_use": self.peak[device]}

    def wrap(self, step, extra: int):
        def run(*args):
            held = ensemble.live_memory()
            for d in jax.devices():
                self.peak[d] = max(self.peak[d], held[d] + extra)
            return step(*args)

        run.lower = step.lower  # compiled_memory reads the real program
        return run


def _donated_step(fn=lambda w, x: w * 2 + x.mean()):
    n = jax.device_count()
    mesh = ensemble.make_mesh(n)
    w = ensemble.shard_members(jnp.ones((n, 1000)), mesh, n)
    x = jax.device_put(jnp.ones((50,)), NamedSharding(mesh, PartitionSpec()))  # on every device
    return jax.jit(fn, donate_argnums=0), w, x


@pytest.mark.timeout(120)
def test_memory_row_reads_the_step_peak_under_an_earlier_one():
    step, w, x = _donated_step()
    est = ensemble.compiled_memory(step, w, x)
    stats = _GpuLikeStats(earlier=10**6)  # far above what the step adds: hides it, but for ballast
    # The step holds its arguments plus (peak - argument): the row must read ratio 1.
    row = check._memory_row(stats.wrap(step, est.peak - est.argument), (w, x), jax.devices(), stats)
    assert row.status == check.OK, row.result
    assert row.values["ratio"] == pytest.approx(1.0)
    assert set(row.values["measured"].values()) == {est.peak}


@pytest.mark.timeout(120)
def test_memory_row_warns_when_the_device_needs_more_than_estimated():
    step, w, x = _donated_step()
    est = ensemble.compiled_memory(step, w, x)
    stats = _GpuLikeStats(earlier=0)
    row = check._memory_row(stats.wrap(step, 2 * est.peak), (w, x), jax.devices(), stats)
    assert row.status == check.WARN
    assert row.values["ratio"] == pytest.approx((est.argument + 2 * est.peak) / est.peak)


@pytest.mark.timeout(120)
def test_memory_row_is_skipped_where_the_counters_leave_out_temporaries():
    """A TPU's memory_stats peak stays at the step's arguments and results (seen on a v5e: 10.4
    MB for a step compiled with 165 MB of temporaries): no ratio is claimed from it."""
    step, w, x = _donated_step(lambda w, x: w + jnp.sort(jnp.sin(w), axis=1)[:, ::-1] * x.mean())
    est = ensemble.compiled_memory(step, w, x)
    assert est.temp > est.argument / 2  # a step whose temporaries matter
    stats = _GpuLikeStats(earlier=0)
    row = check._memory_row(stats.wrap(step, 1), (w, x), jax.devices(), stats)
    assert row.status == check.SKIPPED and row.result.startswith("not measurable here"), row
    assert "ratio" not in row.values and set(row.values["measured"].values()) == {est.argument + 1}


def test_memory_row_without_memory_stats_is_skipped():
    step, w, x = _donated_step()
    row = check._memory_row(step, (w, x), jax.devices(), lambda d: None)
    assert row.status == check.SKIPPED and row.result.startswith("no accelerator: skipped")
    assert not w.is_deleted()  # nothing ran


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "make_args",
    [
        lambda p: ["--out", str(p)],
        lambda p: ["--bogus"],
        lambda p: ["--check-timeout", "-1"],
    ],
)
def test_bad_command_line_exits_2_with_one_line(tmp_path, make_args):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    rc, out, err = _run(make_args(blocker), timeout=60)
    assert rc == 2
    assert "Traceback" not in err and out == ""
    last = err.strip().splitlines()[-1]
    assert last.startswith("accelerator_check: cannot use --out") or "error: " in last
