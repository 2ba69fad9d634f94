"""The example and benchmark scripts' command lines: a mistake is one line on stderr, exit 2."""

from __future__ import annotations

import subprocess
import sys
from tempfile import gettempdir

import pytest
from forked_scripts import ForkedScripts
from subprocess_env import ROOT, clean_env

# (script, args, what its one line says). Every benchmark has a bad value here, and a bad output
# location where it has an output option; all fail while parsing, before any measurement.
NOT_A_FOLDER = "'README.md' is a file, not a folder"
CANNOT_CREATE = "cannot create the folder '/proc/x'"
MISTAKES = [
    ("examples/cpu_rollout.py", ["--nope"], "error: unrecognized arguments: --nope"),
    ("examples/cpu_rollout.py", ["--workers", "0"], "error: --workers must be >= 1, got 0"),
    ("examples/deep_ensemble.py", ["--members"], "error: argument --members: expected one"),
    ("examples/memory_reduction.py", ["--batch", "-1"], "error: --batch must be >= 1"),
    ("examples/memory_reduction.py", ["--out", "/proc/x/y"], "--out: cannot create the folder"),
    ("examples/memory_reduction.py", ["--devices", "1", "3"], "D=[3] of --devices does not"),
    ("examples/deep_ensemble.py", ["--bins", "2000"], "--bins must be at most 1000, got 2000"),
    ("benchmarks/accelerator_check.py", ["--check-timeout", "0"], "expected a number > 0"),
    ("benchmarks/accelerator_check.py", ["--out", "README.md"], NOT_A_FOLDER),
    ("benchmarks/callback_cost.py", ["--work", "spin:x"], "expected spin:W or sleep:W"),
    ("benchmarks/callback_cost.py", ["--work", "sleep:1e300"], "W us from 0 to 1e6"),
    ("benchmarks/callback_cost.py", ["--devices", "0"], "--devices: expected an integer >= 1"),
    ("benchmarks/core_speed.py", ["--part", "ops", "--rounds", "0"], "--rounds: expected an"),
    ("benchmarks/deep_ensemble.py", ["--members", "2,0"], "expected integers >= 1 like 2,8"),
    ("benchmarks/deep_ensemble.py", ["--out", "README.md"], NOT_A_FOLDER),
    ("benchmarks/deep_ensemble.py", ["--members", str(10**20)], "fewer or smaller members"),
    ("benchmarks/envs.py", ["--num-envs", "0"], "expected an integer >= 1, got '0'"),
    ("benchmarks/envs.py", ["--envs", "bogus"], "--envs bogus: expected gymnasium:<id> or"),
    ("benchmarks/envs.py", ["--envs", "gymnasium:Nope-v0"], "error: --envs gymnasium:Nope-v0: "),
    ("benchmarks/envs.py", ["--out", "/proc/x"], "expected a file name without a folder"),
    ("benchmarks/learning_envs.py", ["--envs", "bogus"], "invalid choice: 'bogus'"),
    ("benchmarks/learning_envs.py", ["--runs", "README.md"], NOT_A_FOLDER),
    ("benchmarks/loggers.py", ["--settle", "-1"], "--settle: expected a number >= 0"),
    ("benchmarks/loggers.py", ["--rounds", "-1"], "--rounds: expected an integer >= 1"),
    ("benchmarks/loggers.py", ["--updates", "8"], "--updates must be >= 16 (two timed calls)"),
    ("benchmarks/memory.py", ["--devices", "3"], "--devices 3 does not divide --members 8"),
    ("benchmarks/memory.py", ["--out", "/proc/x"], CANNOT_CREATE),
    ("benchmarks/on_cpu_speed.py", ["--batches", "0"], "--batches: expected an integer >= 1"),
    ("benchmarks/on_cpu_speed.py", ["--out", "README.md"], NOT_A_FOLDER),
    ("benchmarks/pbt.py", ["--seed", "-1"], "--seed: expected an integer >= 0"),
    # Parsed in full, so --work is made if missing: given, lest the test leave a runs/ folder.
    ("benchmarks/pbt.py", ["--total-steps", "100", "--work", gettempdir()], "total_steps=100 is"),
    ("benchmarks/pbt.py", ["--work", "README.md"], NOT_A_FOLDER),
    ("benchmarks/pbt.py", ["--name", "/proc/x"], "expected a file name without a folder"),
    ("benchmarks/ppo.py", ["--envs", "bogus"], "invalid choice: 'bogus'"),
    ("benchmarks/ppo.py", ["--members", "0"], "--members: expected an integer >= 1"),
    ("benchmarks/worker_start.py", ["--repeats", "1"], "--repeats must be >= 2"),
    ("benchmarks/worker_start.py", ["--out", "/proc/x"], CANNOT_CREATE),
    # Sizes past this host's memory: a RESOURCE_EXHAUSTED traceback, or an abort in XLA
    # (overflow in static extent product), or 4,919 processes started, before.
    ("benchmarks/memory.py", ["--hidden", str(10**9)], "the MLP members' state: at least"),
    ("examples/memory_reduction.py", ["--hidden", str(2 * 10**9)], "more than this host's"),
    ("examples/cpu_rollout.py", ["--samples", str(10**9), "--batch", "8"], "weights and states"),
    ("benchmarks/worker_start.py", ["--workers", "100000"], "more than 4 per CPU core"),
]


@pytest.mark.timeout(120)
def test_a_refused_command_leaves_no_folder_behind(tmp_path):
    """``--out``/``--work`` folders are made while parsing (to refuse an unwritable one early);
    a command refused after that removes the ones it made, and only those."""
    made = tmp_path / "new" / "a" / "b"
    (tmp_path / "kept").mkdir()
    for args in (
        ["benchmarks/deep_ensemble.py", "--out", str(made), "--members", "0"],
        ["benchmarks/pbt.py", "--report-only", "--work", str(made)],
        ["benchmarks/pbt.py", "--report-only", "--work", str(tmp_path / "kept")],
    ):
        proc = subprocess.run(
            [sys.executable, *args], capture_output=True, text=True, timeout=100,
            env=clean_env(), cwd=ROOT,
        )  # fmt: skip
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"], args


def test_an_output_folder_given_relative_is_the_callers(tmp_path, monkeypatch):
    """The benchmarks run their work in subprocesses started in the repository root: a
    relative --runs / --work went there, and the summary read the caller's folder (nothing)."""
    from rollout.ppo._parser import writable_dir

    monkeypatch.chdir(tmp_path)
    assert writable_dir("rel/runs") == tmp_path / "rel" / "runs"
    assert (tmp_path / "rel" / "runs").is_dir()


def test_every_benchmark_has_a_mistake_case():
    benchmarks = {f"benchmarks/{p.name}" for p in (ROOT / "benchmarks").glob("*.py")}
    assert benchmarks <= {script for script, _, _ in MISTAKES}


@pytest.fixture(scope="module")
def scripts():
    """``python SCRIPT ARGS`` run in forks of one interpreter that imported the project (a
    fresh one per run spent 1.8 s of CPU importing; the ``--help`` test below starts each
    benchmark fresh, as the README runs it)."""
    runner = ForkedScripts(cwd=str(ROOT), env=clean_env())
    yield runner
    runner.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("script, args, message", MISTAKES)
def test_a_mistake_is_one_line_and_exit_code_2(scripts, script, args, message):
    proc = scripts.run(str(ROOT / script), args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert lines[0].endswith("--help)")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "benchmarks").glob("*.py")))
def test_every_benchmark_starts_as_the_readme_runs_it(script):
    """`python benchmarks/<script> --help` from the repository root: each imports the project's
    packages, not a file of benchmarks/ that shares a package's name."""
    proc = subprocess.run(
        [sys.executable, f"benchmarks/{script}", "--help"],
        capture_output=True,
        text=True,
        timeout=100,
        env=clean_env(),
        cwd=ROOT,
    )
    assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stderr[-2000:]


def test_the_envs_benchmark_writes_strict_json():
    """An idle fraction the machine cannot give (gVisor) was written as NaN, which strict JSON
    parsers refuse; the printed rows too."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("bench_envs", f"{ROOT}/benchmarks/envs.py")
    envs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(envs)
    text = envs._strict_json({"idle": {"ppo-full": float("nan"), "env-layer": 0.25}}, indent=1)

    def refuse(name):
        raise ValueError(name)

    want = {"idle": {"ppo-full": None, "env-layer": 0.25}}
    assert json.loads(text, parse_constant=refuse) == want
