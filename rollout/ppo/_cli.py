"""The main job: ``python -m rollout.ppo`` trains an n-member PPO ensemble, logs, checkpoints.

JAX reads its CPU device count once, when the backend starts, so :func:`main` parses the command
line first, configures the CPU devices, and only then imports the learner.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import dataclasses
import json
import math
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from rollout._devices import available_cores, with_thread_flag
from rollout._relay import worker_errors
from rollout.ppo._checkpoint import RunDirError, as_saved, config_differences, refuse_changed
from rollout.ppo._config import _ENV_DEFAULTS, canonical_env, canonical_env_kwargs
from rollout.ppo._parser import OneLineParser, missing_dirs, remove_empty
from rollout.ppo._plots import member_colors, member_key


def cpu_devices_for(members: int, cores: int) -> int:
    """How many simulated CPU devices the learner should use for ``members`` on ``cores`` cores.

    The smallest divisor of ``members`` from ``cores`` to ``max(64, 8 * cores)`` (every core
    busy, whole members per device); fewer members than cores: one device each; else the
    largest divisor below ``cores`` (a prime count of a million members asked for a million
    devices, and the search through every number up to a mistyped ``--members`` never ended).

    Example:
      >>> [cpu_devices_for(n, 2) for n in (1, 2, 3, 4, 8)], cpu_devices_for(100, 16)
      ([1, 2, 3, 2, 2], 20)
      >>> cpu_devices_for(1_048_573, 2), cpu_devices_for(3 * 1_048_573, 2)  # primes
      (1, 3)
    """
    cores = max(1, cores)
    if members <= cores:
        return max(1, members)
    for d in range(cores, max(64, 8 * cores) + 1):
        if members % d == 0:
            return d
    return max(d for d in range(1, cores + 1) if members % d == 0)


def configure_devices(num_cpu_devices: int) -> None:
    """Sets the CPU device count and one thread per device; must run before JAX starts."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_multi_thread_eigen" not in flags:  # a user's own choice stands
        os.environ["XLA_FLAGS"] = with_thread_flag(flags)
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", int(num_cpu_devices))
    except RuntimeError as e:  # JAX already started (e.g. main() called from a live session)
        have = len(jax.devices("cpu"))
        if have < num_cpu_devices:
            raise RuntimeError(
                f"JAX already started with {have} CPU devices; {num_cpu_devices} are needed. "
                "Run the CLI in a fresh process."
            ) from e


class Interrupted(Exception):
    """Training stopped on SIGINT / SIGTERM after writing a checkpoint (``code``: 128 + signal).

    Example:
      >>> import signal
      >>> Interrupted(signal.SIGTERM, "SIGTERM: stopped at update 3/8.").code  # the exit code
      143
    """

    def __init__(self, signum: int, stopped: str, out: Path | None = None, how: str = "") -> None:
        super().__init__(f"{stopped}; continue with {how}" if how else stopped)
        self.code = 128 + signum
        self.stopped = stopped  # what happened, without how to continue
        self.out = out  # the run directory its checkpoint went to, if any


class Diverged(FloatingPointError):
    """A member's losses became NaN or infinite: training stopped before saving that state.
    ``rows``: how many of the jitted call's updates to record (up to the first diverged).

    Example:
      >>> issubclass(Diverged, FloatingPointError)  # ``except FloatingPointError`` catches it
      True
    """

    rows = 0


#: The losses every update computes; one that is not finite means the member's parameters no
#: longer are either (or are about to be).
_LOSSES = ("policy_loss", "value_loss", "entropy", "approx_kl")


def _diverged(host: dict[str, Any], done: int) -> Diverged | None:
    """The error for the first update of this call whose losses are not finite, if any."""
    import numpy as np

    bad = ~np.all([np.isfinite(np.asarray(host[name], np.float64)) for name in _LOSSES], axis=0)
    if not bad.any():  # bad: [members, updates]
        return None
    j = int(np.flatnonzero(bad.any(axis=0))[0])
    members = ", ".join(str(i) for i in np.flatnonzero(bad[:, j]))
    error = Diverged(
        f"training diverged at update {done + j + 1}: member(s) {members} computed a NaN or "
        "infinite loss. Usual causes: the env returned a NaN or infinite reward or observation "
        "(also a float64 one beyond float32's range), or a learning rate too high. That state "
        "was not saved; metrics.jsonl shows the update."
    )
    error.rows = j + 1
    return error


def train(
    config: Any,
    out: str | os.PathLike | None = None,
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    checkpoint_every: int = 10,
    devices: Sequence[Any] | None = None,
    learner: Any = None,
    on_update: Callable[[dict[str, Any]], None] | None = None,
    on_resume: Callable[[list[dict[str, Any]]], None] | None = None,
    stop: Callable[[], int | None] | None = None,
    warn: Callable[[str], None] | None = None,
) -> tuple[Any, list[dict[str, Any]]]:
    """Trains ``config`` to ``config.total_steps``; returns the final state and the metric rows.

    With ``out`` (a run directory, see ``rollout.ppo._checkpoint``): ``run.json`` (the run's
    identity), one JSON row per update in ``metrics.jsonl``, the learning curves in
    ``learning_curve.png``, and a checkpoint every ``checkpoint_every`` jitted calls and at the
    end. A fresh run refuses a directory holding another run unless ``overwrite=True`` (which
    removes that run's files). ``resume=True`` continues from the newest checkpoint that restores
    whole, exactly as the uninterrupted run would (metric rows past it are cut and recomputed);
    ``config.total_steps`` may be larger than the saved run's (a longer run), nothing else may
    differ. Errors about the directory are :class:`RunDirError` (a ``ValueError``); a host env
    or ``env_on='cpu'`` worker that fails raises its own ``HostEnvError`` / ``WorkerError``
    (``rollout.worker_errors``), not JAX's wrapper of it. ``learner``: reuse an existing
    :class:`Learner` for ``config`` (and its compiled programs). ``on_update``: called with each
    metric row as it arrives; ``on_resume``: with ``resume=True``, called once with the rows
    restored with the checkpoint, before training continues. ``stop``: polled before every
    jitted call (the first too); when it returns a signal number (or ``True``: as SIGINT), a
    checkpoint is written and :class:`Interrupted` raised; ``None`` / ``False`` go on.
    ``warn``: where one-line notes go (default stderr). A member whose losses turn NaN or
    infinite stops the run with :class:`Diverged` (its metric rows written, that state not
    saved).

    Example:
      >>> import jax
      >>> from rollout.ppo import PPOConfig, train
      >>> cfg = PPOConfig.for_env("cartpole", members=jax.device_count(), total_steps=1024)
      >>> state, rows = train(cfg, progress=False)
      >>> sorted(rows[-1])[:3], rows[-1]["env_steps"]
      (['approx_kl', 'clipfrac', 'entropy'], 1024)
    """
    if resume and out is None:
        raise ValueError("resume=True needs out= (the run directory with the checkpoints).")
    if resume and overwrite:
        raise ValueError("resume=True and overwrite=True exclude each other.")
    if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int):
        raise TypeError(f"checkpoint_every must be an int >= 1, got {checkpoint_every!r}.")
    if checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be >= 1 (jitted calls), got {checkpoint_every}.")
    if out is not None and not str(out).strip():
        raise ValueError("out must name a directory (an empty path would be the current one).")
    if learner is not None and learner.config != config:
        raise ValueError("learner= was built for a different config than config=.")
    if not _FOR_CLI.get():  # (the CLI compared them already, before making --out)
        _check_same_config(config, checkpoint_every)
    warn = warn or (lambda line: print(line, file=sys.stderr))
    run, learner_given = None, learner
    try:
        run = _Run(Path(out), config, resume, overwrite, warn) if out is not None else None
        if learner is None:
            learner = _learner_for(config, devices, fresh=not resume)
        with worker_errors():
            state, rows = run.open(learner) if run is not None else (learner.init(), [])
            if resume and on_resume is not None:
                on_resume(list(rows))
            return _loop(learner, state, rows, run, progress, checkpoint_every, on_update, stop)
    except RunDirError as e:
        if not _FOR_CLI.get():  # say what to do in train()'s own words
            e.args = (_in_python_terms(str(e), str(Path(out or "."))),)
        raise
    finally:
        try:
            if learner_given is None and learner is not None:  # what we opened (env_on='cpu'
                learner.close()  # worker processes)
        finally:  # (a second Ctrl-C in the close above kept the run's lock in a notebook)
            if run is not None:
                run.close()


#: Set while the CLI runs :func:`train`: its errors then name the command's flags.
_FOR_CLI = contextvars.ContextVar("rollout.ppo CLI", default=False)
# (run directory, its lock): the CLI takes the lock before it removes an old run's logger files
# and opens its own loggers there, and train() runs under it instead of taking it again.
_HELD_LOCK: contextvars.ContextVar[tuple[Path, Any] | None] = contextvars.ContextVar(
    "rollout.ppo CLI lock", default=None
)
_PYTHON_TERMS = (
    ("Leave those flags out to use the saved values", "Pass the saved config (run.json's)"),
    ("drop --resume", "drop resume=True"),
    ("--resume", "resume=True"),
    ("--overwrite", "overwrite=True"),
    ("--total-steps", "config.total_steps"),
    ("another --out", "another out="),
    ("--out ", "out="),
)


def _in_python_terms(text: str, path: str) -> str:
    """A run-directory error's advice for a caller of :func:`train` (it names CLI flags);
    ``path``, the run directory, as it is (it may hold anything, '--out' too)."""
    parts = text.split(path)
    for cli, python in _PYTHON_TERMS:
        parts = [part.replace(cli, python) for part in parts]
    return path.join(parts)


def _device_layout(learner: Any) -> dict[str, Any]:
    """The devices a run's members are split over, as ``run.json`` records them."""
    devices = learner.mesh.devices
    return {"devices": int(devices.size), "platform": str(devices.flat[0].platform)}


def _learner_for(config: Any, devices: Any, fresh: bool) -> Any:
    import jax

    from rollout.ppo import _pbt
    from rollout.ppo._learner import Learner, StateTooLarge

    learner = None
    try:
        learner = Learner(config, devices=devices)
        if fresh:  # (a resumed run's first call is checked when it is made: its size differs)
            # The first call's program, compiled now for the state's shapes, weak types and
            # placement (the call reuses it) and refused before the state takes memory where
            # its activations cannot fit.
            shapes = jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(
                    x.shape, x.dtype, sharding=s, weak_type=x.weak_type
                ),
                learner.state_shapes(),
                learner.state_shardings(),
            )
            k = _pbt.chunk(config, 0, min(config.updates_per_call, config.num_updates))
            learner._program(k, shapes, live=False)
        return learner
    except StateTooLarge as e:  # a mistake in --hidden or --members: exit 2
        if learner is not None:
            learner.close()
        if _FOR_CLI.get():
            raise UsageError(str(e)) from None
        raise


class _Run:
    """One run directory as :func:`train` uses it: identity, metrics, checkpoints."""

    def __init__(self, out: Path, config: Any, resume: bool, overwrite: bool, warn) -> None:
        import jax

        from rollout.ppo import _checkpoint as ckpt

        self.out, self.config, self.warn = out, config, warn
        self.main = jax.process_index() == 0  # the one process that writes files
        self.lock = None
        self._check(resume, overwrite)  # before anything is written
        # One writer per run directory (a second run or resume on it is refused); then check
        # again, as another process may have written until we got the lock.
        held = _HELD_LOCK.get()
        self._own_lock = held is None or held[0] != out
        self.lock = (ckpt.lock(out) if self._own_lock else held[1]) if self.main else None
        try:
            self._check(resume, overwrite)
        except Exception:
            self.close()
            raise
        self.resume, self.overwrite = resume, overwrite
        self.saved_at = -1

    def _check(self, resume: bool, overwrite: bool) -> None:
        from rollout.ppo import _checkpoint as ckpt

        found = ckpt.inspect(self.out)  # every process checks before anyone writes
        if resume:
            self.record = ckpt.check_resume(found, self.config.to_dict())
        else:
            ckpt.check_fresh(found, overwrite)
            self.record = ckpt.new_record(self.config.to_dict())

    def _check_layout(self, layout: dict[str, Any]) -> None:
        """Says so when a run resumes on other devices than it ran on: members split another
        way compute the same maths with other float rounding (not exactly the same run)."""
        saved = {k: self.record.get(k) for k in layout}
        if saved["devices"] is not None and saved != layout:
            self.warn(
                f"note: run {self.record['run_id'][:8]} ran on {saved['devices']} "
                f"{saved['platform']} devices and resumes on {layout['devices']} "
                f"{layout['platform']} devices: from here its numbers differ from the "
                "uninterrupted run's by float rounding (resume on the same devices, e.g. "
                f"--devices {saved['devices']}, to continue it exactly)."
            )

    def _check_env(self, learner: Any) -> None:
        """A run resumes on the env it trained on: its config's, or the caller's env object."""
        if self.record.get("env_from_config", True) == learner.env_from_config:
            return
        if learner.env_from_config:
            _refuse_env_object_run(self.out)
        raise RunDirError(
            f"--resume: the run in {self.out} trained on the env its config makes "
            f"({self.config.env}), not the env given to Learner(config, env=...); resume it with "
            "Learner(config), or an env made with the config's env and env_kwargs."
        )

    def open(self, learner: Any) -> tuple[Any, list[dict[str, Any]]]:
        """The state to start from (restored or fresh) and the metric rows so far."""

        from rollout.ppo import _checkpoint as ckpt

        layout = _device_layout(learner)
        if not self.resume:
            # What the settings left to the env resolved to: a resume may give them explicitly.
            resolved = {
                "normalize_obs": learner.normalize_obs,
                "normalize_reward": learner.normalize_reward,
            }
            record = {**layout, "env_from_config": learner.env_from_config, "resolved": resolved}
            self.record = {**self.record, **record}
            _on_main_then_all(lambda: ckpt.start(self.out, self.record, overwrite=self.overwrite))
            # Every process takes process 0's run id.
            if not (self.out / ckpt.RUN_FILE).is_file():
                raise UsageError(
                    f"{self.out}/{ckpt.RUN_FILE}, which process 0 has just written, is not here: "
                    "give every process the same --out, on a file system every host sees."
                )
            self.record = json.loads((self.out / ckpt.RUN_FILE).read_text())
            return learner.init(), []
        self._check_env(learner)
        self._check_layout(layout)
        like = ckpt.restore_targets(learner)
        state, meta = ckpt.restore_latest(self.out, self.record, like, self.warn)
        if learner._host_envs:  # live ones (a learner resumed in this process) are ahead of it
            learner.envs.close()  # they restart from reset at the first step, as in a new one
        done = meta["update"]
        self.saved_at = done

        def cut() -> None:
            ckpt.cut_metrics(self.out, meta["metrics_rows"], done)
            ckpt.update_record(self.out, self.record)  # a longer total_steps, if asked

        _on_main_then_all(cut)
        return state, _read_rows(self.out / ckpt.METRICS_FILE)

    def append(self, rows: list[dict[str, Any]]) -> None:
        from rollout.ppo import _checkpoint as ckpt

        if self.main:
            _append_rows(self.out / ckpt.METRICS_FILE, rows)

    def save(self, state: Any, rows: int) -> Path:
        """A checkpoint of ``state`` (collective); ``rows``: metric rows written so far."""
        import jax

        from rollout.ppo import _checkpoint as ckpt

        update = int(jax.device_get(state.update))
        path = self.out / f"ckpt_{update:08d}"
        if update != self.saved_at:
            ckpt.save(
                self.out, state, run_id=self.record["run_id"], rows=rows,
                config=self.record["config"],  # as run.json has it (see as_saved)
            )  # fmt: skip
            self.saved_at = update
        return path

    def finish(self) -> None:
        from rollout.ppo import _checkpoint as ckpt

        if self.main:
            rows = _read_rows(self.out / ckpt.METRICS_FILE)
            plot_curves(rows, self.out / ckpt.CURVE_FILE, self.config.env)
            if self.config.pbt:
                from rollout.ppo import _pbt

                _pbt.plot_lineage(rows, self.out / "pbt_lineage.png", self.config.env)

    def close(self) -> None:
        if self.lock is not None and self._own_lock:
            self.lock.close()
        self.lock = None


def _refuse_env_object_run(out: Any) -> None:
    raise RunDirError(
        f"--resume: the run in {out} trained on an env given to Learner(config, env=...), which "
        "its run.json cannot make again; resume it in Python with that env: train(config, out, "
        "resume=True, learner=Learner(config, env=...))."
    )


def _check_same_config(config: Any, checkpoint_every: int | None = None) -> None:
    """Every process of a run trains one config: processes started with different ones (a
    --total-steps of their own) waited forever in collectives that did not match, deaf to
    signals, or trained their members on settings run.json does not record. With
    ``checkpoint_every`` (train()'s): one process saving while the others trained hung too."""
    import jax

    from ensemble import _distributed as distributed

    if jax.process_count() == 1:
        return
    if jax.local_device_count() * jax.process_count() != jax.device_count():
        # (made from --members / --devices: no collective of JAX's can even compare them)
        raise UsageError(
            "the processes of this run have different device counts "
            f"({jax.local_device_count()} here of {jax.device_count()}): start every process "
            "with the same arguments, and on CPU with the same --devices (without it, a "
            "process's CPU count sets its devices)."
        )
    fields = config.to_dict() | distributed.numeric_jax_settings()
    if checkpoint_every is not None:
        fields["checkpoint_every"] = checkpoint_every
    differ = distributed.settings_that_differ(fields)
    if differ:
        distributed.leave_together()  # (every process refuses; the run cannot go on)
        raise UsageError(
            "the processes of this run were started with different settings (these differ "
            f"between them: {', '.join(differ)}); start every process with the same arguments "
            "and JAX settings (JAX_ENABLE_X64, JAX_DEFAULT_PRNG_IMPL, ...)."
        )


#: Arguments that may differ between the processes of a run: the coordinator is the same
#: one under another name (127.0.0.1 on its own host), --debug only shows tracebacks, and
#: progress and the --log outputs are process 0's alone (W&B installed on its host only).
_PER_PROCESS_ARGS = ("process_id", "coordinator", "no_progress", "debug", "log", "log_interval")


def _check_same_args(args: argparse.Namespace, config: Any) -> None:
    """Every process of a run gets the same arguments. Compared before any collective between
    devices, so also those that are not the config's: a --checkpoint-every of its own made one
    process save while the others trained (both waited forever, deaf to signals); a --devices
    of its own failed in gloo after 45 s, leaving a run.json behind. A config flag counts by
    the value it resolved to: ``--seed 0`` on one process and no --seed on another agree."""
    from ensemble import _distributed as distributed

    fields = {k: v for k, v in vars(args).items() if k not in _PER_PROCESS_ARGS}
    fields |= {arg: getattr(config, field) for arg, field in _CONFIG_FLAGS}
    differ = distributed.settings_that_differ(fields)
    if differ:
        distributed.leave_together()  # (every process refuses; the run cannot go on)
        flags = ", ".join("--" + name.replace("_", "-") for name in differ)
        raise UsageError(
            f"the processes of this run were started with different arguments ({flags}); "
            "start every process with the same arguments."
        )


def _on_main_then_all(fn: Callable[[], Any]) -> None:
    """``fn`` on process 0 once all processes are here; the others wait until it is done."""
    import jax

    if jax.process_count() == 1:
        fn()
        return
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("rollout.ppo run dir: checked")
    if jax.process_index() == 0:
        fn()
    multihost_utils.sync_global_devices("rollout.ppo run dir: written")


def _emit(new_rows, sps, run, on_update) -> None:
    """New metric rows, stamped with the run's throughput (all members together, compile
    excluded), to ``on_update`` and then the run folder (which so holds only rows it took)."""
    for row in new_rows:
        row["env_steps_per_s"] = sps
        if on_update is not None:
            on_update(row)
    if run is not None:
        run.append(new_rows)


def _loop(learner, state, rows, run, progress, checkpoint_every, on_update, stop):
    """The training loop of :func:`train` from ``state`` (whose metric rows are ``rows``)."""
    import jax

    from rollout.ppo import _pbt
    from rollout.ppo._learner import to_host

    cfg = learner.config
    # The whole state first: where it did not fit in memory, JAX's CPU runtime never delivers
    # a small result of the same program (device_get of the update count waited forever, deaf
    # to signals), while the state's own buffers raise RESOURCE_EXHAUSTED.
    jax.block_until_ready(state)
    done = int(jax.device_get(state.update))  # replicated: every process has it
    bar = _progress(cfg, done, enabled=progress)
    calls, start, steps_at_start, sps = 0, None, done, None
    try:
        while done < cfg.num_updates:
            signum = _stop_requested(stop)
            if signum is not None:
                raise _interrupt(run, state, len(rows), signum, done, learner)
            # A jitted call stops at the next PBT step (exploit/explore runs between calls).
            k = _pbt.chunk(cfg, done, min(cfg.updates_per_call, cfg.num_updates - done))
            state, metrics = _update(learner, state, k)
            _raise_a_failed_part(metrics)
            host = to_host(metrics)  # the only gather
            new_rows = _rows(host, done, k, cfg.batch_size)
            diverged = _diverged(host, done)
            if diverged is not None:  # its rows up to the diverged update, in the usual form
                new_rows = new_rows[: diverged.rows]
                if cfg.pbt:  # what the members ran with: after a PBT step, the likely cause
                    _pbt.record_hparams(state, new_rows)
                _emit(new_rows, sps, run, on_update)  # the error points at these rows
                raise diverged
            done += k
            if cfg.pbt:  # lineage into the rows; every pbt_interval updates, exploit/explore
                state = _pbt.after_updates(learner, state, rows, new_rows, done)
            calls += 1
            if start is None:  # throughput: from the end of the first (compiling) call
                start, steps_at_start = time.perf_counter(), done
            else:
                elapsed = time.perf_counter() - start
                sps = (done - steps_at_start) * cfg.batch_size * cfg.members / max(elapsed, 1e-9)
            _emit(new_rows, sps, run, on_update)
            rows.extend(new_rows)
            if run is not None and (calls % checkpoint_every == 0 or done >= cfg.num_updates):
                run.save(state, len(rows))  # collective: every process calls it
            if bar is not None:
                bar.update(k * cfg.batch_size)
                bar.set_postfix_str(_postfix(latest_returns(rows), sps), refresh=False)
    finally:
        if bar is not None:
            bar.close()
    if run is not None and rows:
        run.finish()
    return state, rows


def _update(learner: Any, state: Any, k: int) -> tuple[Any, Any]:
    """``learner.update``; an update that cannot fit in memory (checked at its first call, a
    resumed run's) is a usage error on the command line: one line, exit 2."""
    from rollout.ppo._learner import StateTooLarge

    try:
        return learner.update(state, k)
    except StateTooLarge as e:
        if _FOR_CLI.get():
            raise UsageError(str(e)) from None
        raise


def _raise_a_failed_part(metrics: Any, timeout: float = 5.0) -> None:
    """Waits for every device's part of the call; where one failed (an ``on_cpu`` worker
    killed under its rows), raises its error after waiting up to ``timeout`` s for the others.
    Read in order, the outputs waited on a part that waits in a collective for the failed one,
    until XLA aborted the process (exit 134, no error line); a process that exited while parts
    still ran was aborted or crashed in its finalisation. Parts still running then (in such a
    collective): the process will end without finalising the interpreter (``exit_process``)."""
    from ensemble._exit import device_work_left_running
    from rollout._relay import wait_for_outputs

    ended, error = wait_for_outputs(metrics, after_failure=timeout)
    if error is not None:
        if not ended:
            device_work_left_running()
        raise error


def _rows(host: dict[str, Any], done: int, k: int, batch_size: int) -> list[dict[str, Any]]:
    from rollout.ppo._learner import METRIC_NAMES

    rows = []
    for j in range(k):
        u = done + j + 1
        row: dict[str, Any] = {"update": u, "env_steps": u * batch_size}
        for name in METRIC_NAMES:
            row[name] = [_json_float(v) for v in host[name][:, j]]
        rows.append(row)
    return rows


_STOP = "return None or False to go on, and True or a signal number (signal.SIGTERM) to stop"


def _as_signal(value: Any) -> int | None:
    """What ``stop()`` returned: falsy keeps training, ``True`` stops as SIGINT does, else a
    signal number (``signal.SIGTERM``)."""
    import numpy as np

    if hasattr(value, "dtype"):  # NumPy / JAX scalars and 0-d arrays: jnp.any(flag) too
        if np.size(value) != 1:
            shape = np.shape(value)
            raise ValueError(f"train(stop=...) returned an array of shape {shape}; {_STOP}")
        value = np.asarray(value).item()
    if not value:
        return None
    if isinstance(value, bool):  # (True would read as signal 1, SIGHUP)
        return int(signal.SIGINT)
    try:
        return int(signal.Signals(value))
    except (ValueError, TypeError):
        raise ValueError(f"train(stop=...) returned {value!r}; {_STOP}") from None


def _stop_requested(stop: Callable[[], int | None] | None) -> int | None:
    """The signal to stop on; with several processes, all agree (any one asked: all stop)."""
    import jax

    signum = _as_signal(stop()) if stop is not None else None
    if jax.process_count() == 1:
        return signum
    import numpy as np
    from jax.experimental import multihost_utils

    every = multihost_utils.process_allgather(np.asarray(signum or 0, np.int32))
    asked = [int(s) for s in np.ravel(every) if s]
    return asked[0] if asked else None


def _interrupt(run, state, rows: int, signum: int, done: int, learner) -> Interrupted:
    """Writes a checkpoint of ``state`` and says how to resume (the caller raises it)."""
    cfg, name = learner.config, signal.Signals(signum).name
    if run is None:
        return Interrupted(signum, f"{name}: stopped at update {done}/{cfg.num_updates}.")
    run.save(state, rows)
    run.finish()  # the learning curves so far
    how = f"train(config, {str(run.out)!r}, resume=True"
    if learner.env_from_config:
        how += f") or: python -m rollout.ppo --resume --out {shlex.quote(str(run.out))}"
    else:  # the command line cannot make a user's env object
        how += ", learner=Learner(config, env=<your env>))"
    stopped = f"{name}: stopped at update {done}/{cfg.num_updates}, checkpoint written"
    return Interrupted(signum, stopped, run.out, how)


def plot_curves(rows: list[dict[str, Any]], path: str | os.PathLike, title: str = "") -> None:
    """One line per member: mean episode return against env steps per member.

    ``rows`` are metric rows (``metrics.jsonl``); a ``None`` return (no episode finished in
    that update) has no point. Nothing is written for no rows.

    Example:
      >>> import os, shutil, tempfile
      >>> rows = [{"env_steps": 512 * k, "returns": [9.0 * k, None if k == 1 else 20.0]}
      ...         for k in (1, 2, 3)]
      >>> out = tempfile.mkdtemp()
      >>> plot_curves(rows, os.path.join(out, "curves.png"), title="cartpole")
      >>> os.listdir(out)
      ['curves.png']
      >>> shutil.rmtree(out)
    """
    # A bare Figure, not pyplot: no global backend or figure registry is touched in the
    # caller's process (a notebook keeps its own backend), and pyplot's import is skipped.
    from matplotlib.figure import Figure

    if not rows:
        return
    steps = [r["env_steps"] for r in rows]
    n = len(rows[0]["returns"])
    fig = Figure(figsize=(8, 4), layout="constrained")
    ax = fig.subplots()
    for i, color in enumerate(member_colors(n)):  # updates without a finished episode: no point
        xy = [(x, r["returns"][i]) for x, r in zip(steps, rows) if r["returns"][i] is not None]
        ax.plot([x for x, _ in xy], [y for _, y in xy], lw=1.2, color=color, label=f"member {i}")
    ax.set_xlabel("env steps per member")
    ax.set_ylabel("mean episode return")
    ax.set_title(f"ensemble PPO {title} (n={n})")
    ax.grid(alpha=0.3)
    member_key(fig, [ax], n)
    fig.savefig(path, dpi=110)


def latest_returns(rows: list[dict[str, Any]]) -> list[float | None]:
    """Per member, the return of the latest update in which an episode finished (None: none
    did). A row's own ``returns`` is None where none finished in that update.

    >>> latest_returns([{"returns": [1.0, 2.0]}, {"returns": [None, 3.0]}])
    [1.0, 3.0]
    """
    latest: list[float | None] = [None] * (len(rows[-1]["returns"]) if rows else 0)
    for row in reversed(rows):  # newest first: usually done after a row or two
        latest = [new if old is None else old for old, new in zip(latest, row["returns"])]
        if None not in latest:
            break
    return latest


def _postfix(returns: list[float | None], sps: float | None) -> str:
    rets = " ".join("-" if r is None else f"{r:.0f}" for r in returns[:8])
    more = " ..." if len(returns) > 8 else ""
    speed = "compiling" if sps is None else f"{sps:,.0f} env steps/s (all members)"
    return f"{speed} | returns {rets}{more}"


def _progress(cfg: Any, done: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(
        total=cfg.num_updates * cfg.batch_size,
        initial=done * cfg.batch_size,
        unit="step",
        unit_scale=True,
        dynamic_ncols=True,
        desc=f"PPO {cfg.env} x{cfg.members} (steps/member)",
    )


def _json_float(v: Any) -> float | None:
    v = float(v)
    return None if not math.isfinite(v) else float(f"{v:.7g}")  # float32 has ~7 digits


def _read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a crash
            continue
        rows.append(row)
    return rows


def _append_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    from rollout.ppo import _checkpoint as ckpt

    try:
        with path.open("a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    except OSError as e:
        raise ckpt.named(e, path) from None


# ---------------------------------------------------------------------- command line


class UsageError(ValueError):
    """A mistake on the command line: reported in one line, exit code 2."""


def _items(text: str) -> list[str]:
    """The entries of a list flag (``3e-4,1e-3`` or ``3e-4 1e-3``); an empty one between
    commas (``1e-3,,2e-3``, a typo) raises ValueError: dropped, it changed the count."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) > 1 and not all(parts):
        raise ValueError(f"{text!r} has an empty entry")
    return [x for p in parts for x in p.split()]


def _floats(text: str) -> float | tuple[float, ...]:
    try:
        values = tuple(float(v) for v in _items(text))
    except ValueError:
        values = ()
    if not values:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number or a list of numbers like 3e-4,1e-3"
        )
    return values[0] if len(values) == 1 else values


#: CLI defaults of the config flags; on --resume the saved run's values are used instead.
_DEFAULTS = {"env": "cartpole", "members": 4, "seed": 0, "env_on": "device"}
#: config flags: (flag attribute, PPOConfig field).
_PBT_OPTIONS = ("pbt_interval", "pbt_fraction", "pbt_factors", "pbt_window")  # tune --pbt
#: PPOConfig fields with a flag of their own name (default: CleanRL's for the env); the
#: switches have --name / --no-name.
_SWITCHES = (
    "anneal_lr",
    "norm_adv",
    "clip_vloss",
    "normalize_obs",
    "normalize_reward",
    "bootstrap_truncation",
)
_TUNING = (
    "update_epochs",
    "num_minibatches",
    "gamma",
    "gae_lambda",
    "vf_coef",
    "max_grad_norm",
    "hidden",
    *_SWITCHES,
)
_CONFIG_FLAGS = (
    ("env", "env"),
    ("env_kwargs", "env_kwargs"),
    ("members", "members"),
    ("seed", "seed"),
    ("env_on", "env_on"),
    ("total_steps", "total_steps"),
    ("lr", "learning_rate"),
    ("ent_coef", "ent_coef"),
    ("clip_coef", "clip_coef"),
    ("num_envs", "num_envs"),
    ("num_steps", "num_steps"),
    ("updates_per_call", "updates_per_call"),
    *((flag, flag) for flag in _TUNING),
    ("pbt", "pbt"),
    *((flag, flag) for flag in _PBT_OPTIONS),
)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m rollout.ppo",
        description="Train an ensemble of PPO agents, one per device (CleanRL defaults per env).",
        epilog="--resume takes the config from the run in --out; only --total-steps may grow.",
    )
    for add in (_run_args, _ppo_args, _tuning_args, _output_args, _process_args):
        add(p)
    return p


def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--env",
        default=None,
        help="cartpole (CartPole-v1), pendulum, or gymnasium:<id> (e.g. gymnasium:HalfCheetah-v5),"
        " envpool:<task>, gymnax:<name>, brax:<name> (default cartpole)",
    )
    p.add_argument(
        "--env-kwargs",
        default=None,
        metavar="JSON",
        help="""keyword arguments of the env library's make (gymnasium:, envpool:, gymnax:,"""
        """ brax: ids), e.g. '{"is_slippery": false}'""",
    )
    p.add_argument("--members", type=int, default=None, help="number of agents (default 4)")
    p.add_argument(
        "--total-steps",
        type=int,
        default=None,
        help="env steps per member (default: 500k CartPole, 1M Pendulum)",
    )
    p.add_argument(
        "--out",
        default="runs/ppo",
        help="run dir: run.json, metrics.jsonl, PNG, checkpoints (default runs/ppo)",
    )
    run = p.add_mutually_exclusive_group()
    run.add_argument("--resume", action="store_true", help="continue the run in --out")
    run.add_argument(
        "--overwrite", action="store_true", help="remove the run already in --out and start anew"
    )
    p.add_argument(
        "--seed", type=int, default=None, help="root seed; members get split keys (default 0)"
    )
    p.add_argument(
        "--env-on",
        choices=("device", "cpu"),
        default=None,
        help="envs vmapped next to each member (default), or on host CPU cores (rollout.on_cpu)",
    )


def _ppo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lr", type=_floats, default=None, help="learning rate, or one per member")
    p.add_argument("--ent-coef", type=_floats, default=None, help="entropy coef, or one per member")
    p.add_argument("--clip-coef", type=_floats, default=None, help="clip range, or one per member")
    p.add_argument("--num-envs", type=int, default=None, help="parallel envs per member")
    p.add_argument("--num-steps", type=int, default=None, help="rollout length per update")
    p.add_argument(
        "--updates-per-call",
        type=int,
        default=None,
        help="PPO updates per jit call (default 8; with --pbt at most that, each "
        "--pbt-interval split into calls of one size where it divides well)",
    )
    p.add_argument(
        "--pbt",
        action="store_const",
        const=True,
        default=None,
        help="population-based training (default off)",
    )
    p.add_argument(
        "--pbt-interval", type=int, default=None, help="PPO updates between PBT steps (10)"
    )
    p.add_argument("--pbt-fraction", type=float, default=None, help="bottom/top fraction (0.25)")
    p.add_argument("--pbt-factors", type=_floats, default=None, help="perturbations (0.8,1.2)")
    p.add_argument("--pbt-window", type=int, default=None, help="updates averaged for ranking (3)")


def _tuning_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "PPO settings", "default: CleanRL's ppo.py / ppo_continuous_action.py for the env"
    )
    g.add_argument("--update-epochs", type=int, default=None, help="epochs over each batch")
    g.add_argument("--num-minibatches", type=int, default=None, help="minibatches per epoch")
    g.add_argument("--gamma", type=float, default=None, help="discount factor")
    g.add_argument("--gae-lambda", type=float, default=None, help="GAE lambda")
    g.add_argument("--vf-coef", type=float, default=None, help="value loss coefficient")
    g.add_argument("--max-grad-norm", type=float, default=None, help="gradient clipping norm")
    g.add_argument("--hidden", type=_widths, default=None, help="MLP widths, e.g. 64,64")
    for name in _SWITCHES:
        g.add_argument(
            f"--{name.replace('_', '-')}",
            action=argparse.BooleanOptionalAction,
            default=None,
            help=_SWITCH_HELP[name],
        )


_SWITCH_HELP = {
    "anneal_lr": "learning rate decays linearly to 0",
    "norm_adv": "advantages normalised per minibatch",
    "clip_vloss": "clipped value loss",
    "normalize_obs": "running mean/std of observations (default: on for continuous actions)",
    "normalize_reward": "rewards scaled by the return's std (default: on for continuous)",
    "bootstrap_truncation": "bootstrap the value at a time limit instead of a terminal state",
}


def _widths(text: str) -> tuple[int, ...]:
    try:
        widths = tuple(int(v) for v in _items(text))
    except ValueError:
        widths = ()
    if not widths or min(widths) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of positive widths like 64,64")
    return widths


def _output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--checkpoint-every", type=int, default=10, help="jit calls per checkpoint (default 10)"
    )
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        help="CPU-only hosts: simulated devices for the members (default: the smallest divisor "
        "of --members from the CPU cores to 64 or 8 x the cores, else one device per member where "
        "there are fewer members than cores, else the largest divisor below the cores); with "
        "several processes, per process",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    p.add_argument(
        "--log",
        default="",
        help="extra metric outputs: tensorboard, wandb (comma-separated); metrics.jsonl is "
        "always written",
    )
    p.add_argument(
        "--log-interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="at most one metric row per SECONDS goes to --log outputs, and always the last "
        "(default 0.1; 0: every row; metrics.jsonl has every row)",
    )


def _process_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "several processes / hosts",
        "default: $JAX_COORDINATOR_ADDRESS, $ENSEMBLE_NUM_PROCESSES, $ENSEMBLE_PROCESS_ID (set "
        "by python -m ensemble.launch), else SLURM / Open MPI / Kubernetes detection, else one "
        "process",
    )
    g.add_argument("--coordinator", default=None, help="host:port of process 0")
    g.add_argument("--num-processes", type=int, default=None)
    g.add_argument("--process-id", type=int, default=None)


@contextlib.contextmanager
def _worker_errors_unlogged() -> Iterator[None]:
    """Keeps JAX's log of a callback that failed with a worker's error off stderr: the run
    ends with that error's one line, and each device's callback logged its whole traceback
    before it (``--debug`` shows them)."""
    import logging

    from rollout._pool import WorkerError
    from rollout.hostenv._group import HostEnvError

    def keep(record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not isinstance(error, WorkerError | HostEnvError)

    logger = logging.getLogger("jax._src.callback")
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m rollout.ppo`` and the ``ensemble-ppo`` console script.

    Exit codes: 0 done; 2 a mistake in the arguments or the run directory (one line on stderr
    says what to do); 130 / 143 stopped by SIGINT / SIGTERM after writing a checkpoint; 1 a
    member diverged (NaN losses; one line) or an unexpected error (``--debug`` shows its
    traceback).
    """
    args = build_parser().parse_args(argv)
    quiet = contextlib.nullcontext() if args.debug else _worker_errors_unlogged()
    try:
        with _Signals() as signals, quiet:
            return _main(args, signals)
    except Interrupted as e:
        print(e if e.out is None else f"{e.stopped}; {_resume_hint(args)}", file=sys.stderr)
        return e.code
    except (UsageError, RunDirError) as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Diverged as e:  # a finding about the run, not a bug: no traceback to offer
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        if args.debug:
            raise
        first = (str(e).strip().splitlines() or [""])[0][:300]
        print(
            f"error: {type(e).__name__}: {first}{_os_cause(e, first)} (run again with --debug "
            "for the traceback)",
            file=sys.stderr,
        )
        return 1


def _os_cause(e: BaseException, shown: str) -> str:
    """The operating system's reason (a full disk, a file-size limit, ...) where an error's
    long message, or an error it was raised from, holds one that the shown part cut off."""
    import errno

    texts, seen = [], e
    while seen is not None and len(texts) < 8:
        texts.append(str(seen))
        seen = seen.__cause__ or seen.__context__
    codes = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EIO)
    for reason in map(os.strerror, codes):
        if reason not in shown and any(reason in t for t in texts):
            return f" ({reason})"
    return ""


def _main(args: argparse.Namespace, signals: _Signals) -> int:
    from rollout.ppo import _checkpoint as ckpt
    from rollout.ppo import _loggers

    try:  # a bad name or a missing package: before anything is written or compiled
        log_names = _loggers.parse_log_flag(args.log)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.log_interval is not None and not log_names:
        raise UsageError(
            "--log-interval paces --log outputs and there are none; add --log tensorboard "
            "(or wandb) or drop --log-interval (metrics.jsonl always has every row)."
        )
    interval = _loggers.DEFAULT_INTERVAL_S if args.log_interval is None else args.log_interval
    if not (interval >= 0 and math.isfinite(interval)):
        raise UsageError(f"--log-interval must be a number of seconds >= 0, got {interval}.")
    _check_numbers(args)
    found = ckpt.inspect(args.out)  # read-only: nothing is written before all checks pass
    # To undo a failed logger's files, and the folders this start made (none: --out existed).
    before, made = _logger_files(args.out), missing_dirs(args.out)
    had_lock = os.path.lexists(os.path.join(args.out, ckpt.LOCK_FILE))
    config, info, devices, n_dev = _set_up(args, found, signals)
    # One writer from here on: an old run's logger files go, and the new loggers open, only
    # once no other process can be resuming that run in this directory.
    held = ckpt.lock(Path(args.out)) if info.is_main else None
    try:
        return _train_locked(args, signals, config, info, devices, n_dev, log_names,
                             (before, made, had_lock), interval, held)  # fmt: skip
    finally:
        if held is not None:
            held.close()


def _train_locked(
    args: argparse.Namespace,
    signals: _Signals,
    config: Any,
    info: Any,
    devices: Any,
    n_dev: int,
    log_names: Sequence[str],
    undo: tuple[Any, list[Path], bool],
    interval: float,
    held: Any,
) -> int:
    from rollout.ppo import _loggers

    aside: list[tuple[Path, Path]] = []
    if info.is_main:
        _settle_set_aside(args)
    if info.is_main and not args.resume:
        aside = _check_no_old_logs(args, set_aside=True)  # again: another run may have written
    _print_header(args, config, info, n_dev)
    names = log_names if info.is_main else ()  # only the main process logs (it alone writes
    try:  # metrics.jsonl)
        logs = _loggers.open_loggers(names, args.out, config.to_dict(), interval, args.resume)
    except Exception as e:  # e.g. W&B online without a login
        _remove_new_logger_files(args.out, *undo)
        _put_back(aside)  # a refused start leaves the old run's logs as they were
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        print(f"error: --log {args.log}: {first}", file=sys.stderr)
        return 2
    try:
        rows = _train_logged(args, config, info, devices, signals, logs, held)
    except UsageError:  # refused before the run wrote anything (--hidden too wide for memory)
        _put_back(aside)
        _remove_new_logger_files(args.out, *undo)  # and the folder this start made, lock too
        raise
    except BaseException:
        _put_back(aside)  # where train failed before it removed the old run (and them)
        raise
    if rows and info.is_main:
        final = ", ".join("-" if r is None else f"{r:.1f}" for r in latest_returns(rows))
        print(f"final returns per member: [{final}]  ({args.out}/metrics.jsonl)")
    return 0


def _put_back(aside: list[tuple[Path, Path]]) -> None:
    """The old run's logger files set aside, back in place of what the new loggers made there,
    where they still are: the old run was not removed (which removes them too)."""
    from rollout.ppo import _checkpoint as ckpt

    for old, moved in aside:
        if os.path.lexists(moved):
            ckpt.delete(old)
            os.replace(moved, old)


def _train_logged(args, config, info, devices, signals, logs, held) -> list[dict[str, Any]]:
    """``train`` under the CLI's lock, rows to the loggers, which it closes however it ends.
    The old logs set aside stay until train removes the old run (with them, under the lock):
    a start killed before that leaves the old run whole, its logs to be put back."""
    token = _FOR_CLI.set(True)
    lock_token = _HELD_LOCK.set((Path(args.out), held) if held is not None else None)
    code = 1  # how the run ended, for loggers that record it (W&B: finished or failed)
    try:
        _, rows = train(
            config,
            args.out,
            resume=args.resume,
            overwrite=args.overwrite,
            progress=not args.no_progress and info.is_main,
            checkpoint_every=args.checkpoint_every,
            devices=devices,
            stop=signals.received,
            warn=lambda line: print(line, file=sys.stderr) if info.is_main else None,
            on_update=logs.write,
            on_resume=logs.restore,  # rows a killed run's loggers had not written yet
        )
        code = 0
    except Interrupted as e:
        code = e.code
        raise
    except (UsageError, RunDirError):
        code = 2
        raise
    finally:
        _FOR_CLI.reset(token)
        _HELD_LOCK.reset(lock_token)
        # Also when training stops (a signal, a divergence, an error): a process of a
        # multi-process run that fails ends without the atexit handlers.
        logs.close(code)
    return rows


def _print_header(args: argparse.Namespace, config: Any, info: Any, n_dev: int) -> None:
    """What the run is and where it runs, on stderr (and a note on a cut-short last batch)."""
    import jax

    from rollout.envs import HOST_PREFIXES

    # Host envs step in CPU worker processes, or in this one with workers_per_device=0 (which
    # the header called cpu-workers too); env_on only places functional envs.
    where = config.env_on
    if config.env.startswith(HOST_PREFIXES):
        in_process = config.make_kwargs().get("workers_per_device") == 0
        where = "this-process" if in_process else "cpu-workers"
    print(
        f"ensemble PPO: env={config.env} members={config.members} processes={info.num_processes} "
        f"devices={n_dev}x{jax.default_backend()} envs_on={where} "
        f"total_steps/member={config.num_updates * config.batch_size} out={args.out}"
        f"{' (resumed)' if args.resume else ''}",
        file=sys.stderr,
    )
    if config.total_steps % config.batch_size and info.is_main:
        print(
            f"note: --total-steps {config.total_steps} is not a multiple of one update's batch "
            f"(num_envs x num_steps = {config.batch_size}): the run takes {config.num_updates} "
            f"update{'s' * (config.num_updates != 1)}, "
            f"{config.num_updates * config.batch_size} env steps per member.",
            file=sys.stderr,
        )


_LOGGER_FILES = ("tensorboard", "wandb", "wandb_run_id")  # what open_loggers may create


def _resume_hint(args: argparse.Namespace) -> str:
    """The command that continues an interrupted run as it ran: with its loggers (not kept in
    ``run.json``: a resume without ``--log`` would stop logging silently)."""
    words = ["python -m rollout.ppo --resume --out", shlex.quote(str(args.out))]
    if args.log:
        words += ["--log", shlex.quote(args.log)]
    if args.log_interval is not None:
        words += ["--log-interval", repr(float(args.log_interval))]  # (:g kept 6 digits)
    if args.checkpoint_every != 10:
        words += ["--checkpoint-every", str(args.checkpoint_every)]
    return "continue with: " + " ".join(words)


def _check_no_old_logs(
    args: argparse.Namespace, set_aside: bool = False
) -> list[tuple[Path, Path]]:
    """A fresh run's loggers must not write into another run's: its TensorBoard events would
    show as one curve with the new ones, and W&B would continue its run id. ``--overwrite``
    replaces them (``set_aside``: with the run directory's lock held, they are moved aside
    for the new loggers, ``[(where, moved to)]``, still the old run's files: train removes
    them with it, and a start that fails before puts them back)."""
    old = sorted(_logger_files(args.out) or ())
    if old and not args.overwrite:
        raise UsageError(
            f"--out {args.out} holds another run's logs ({', '.join(old)}); use --overwrite "
            "(removes that run's files) or choose another --out."
        )
    moves = []
    try:
        for name in old if set_aside else ():
            path = Path(args.out) / name
            moved = _aside(path)
            os.replace(path, moved)
            moves.append((path, moved))
    except OSError as e:
        for path, moved in moves:
            os.replace(moved, path)
        raise UsageError(
            f"--overwrite: cannot move the old run's {path.name} aside in --out {args.out} "
            f"({e.strerror or e}); give it back write permission, or choose another --out."
        ) from None
    return moves


def _aside(path: Path) -> Path:
    """Where ``--overwrite`` keeps an old run's logger file until the new run removes the old."""
    return path.with_name(f".{path.name}.overwritten")


def _settle_set_aside(args: argparse.Namespace) -> None:
    """Logger files an ``--overwrite`` start killed while they were set aside (before it
    removed the old run, which removes them too): an ``--overwrite`` removes them, a
    ``--resume`` of the old run puts them back, in place of what the killed start's loggers
    made."""
    from rollout.ppo import _checkpoint as ckpt

    aside = [(path, _aside(path)) for path in (Path(args.out) / n for n in _LOGGER_FILES)]
    if not args.overwrite:
        _put_back(aside)
    for _, moved in aside:  # what is left: an --overwrite's to remove
        ckpt.delete(moved)


def _remove_logger_files(out: str, names: Iterable[str]) -> None:
    """Removes these loggers' files from ``out``, where they are (tolerates a race)."""
    from rollout.ppo import _checkpoint as ckpt

    for name in names:
        ckpt.delete(Path(out) / name)


def _logger_files(out: str) -> set[str] | None:
    """Which of the loggers' files ``out`` holds (None: no ``out`` yet)."""
    if not os.path.isdir(out):
        return None
    return {name for name in _LOGGER_FILES if os.path.lexists(os.path.join(out, name))}


def _remove_new_logger_files(
    out: str, before: set[str] | None, made: list[Path], had_lock: bool = False
) -> None:
    """Undoes what loggers that failed to open left in ``out``, and the folders this start
    made (``out`` and its new parents) where they are empty: a failed start leaves no run
    directory behind."""
    from rollout.ppo import _checkpoint as ckpt

    _remove_logger_files(out, set(_LOGGER_FILES) - (before or set()))
    if not had_lock:  # this start's, held: no run's
        with contextlib.suppress(OSError):
            os.remove(os.path.join(out, ckpt.LOCK_FILE))
    if before is None:
        remove_empty(made)  # only if empty: nothing but what the loggers made was there


def _set_up(args: argparse.Namespace, found: Any, signals: _Signals) -> tuple:
    """Checks the run directory, starts JAX's devices (joining the other processes, if any)
    and builds the config: ``(config, process info, learner devices, their count)``."""
    from ensemble import _distributed as distributed
    from rollout.ppo import _checkpoint as ckpt

    try:
        joining = distributed.resolve_settings(
            args.coordinator, args.num_processes, args.process_id
        )
    except ValueError as e:  # before anything is created or started
        flags = "--coordinator HOST:PORT, --num-processes N and --process-id I"
        raise UsageError(f"{e} On the command line: {flags}.") from None
    cores = available_cores()
    procs = args.num_processes or _env_processes(distributed.ENV_NUM_PROCESSES)
    members = _members_hint(args, found)
    if members % procs:
        raise UsageError(
            f"--members {members} must be a multiple of the number of processes "
            f"({procs}): every process holds the same number of members."
        )
    # Devices per process for this process's members (on CPU-only hosts). Set before the config
    # is built: building it may make the env once (gymnax envs start JAX).
    learner_devices = args.devices or _saved_cpu_devices(args, found, procs)
    learner_devices = learner_devices or cpu_devices_for(members // procs, cores)
    # Before JAX makes that many devices: the envs per member are known only with the config,
    # whose env may start JAX (gymnax), so first against the most any default gives.
    _check_device_count(args.devices, members, *_envs_hint(args, found), procs)
    configure_devices(max(learner_devices, cores))
    config = _config_from_args(args, found)
    _check_device_count(args.devices, config.members, config.num_envs, True, procs)
    ckpt.check_unlocked(args.out)  # first: a run still going there explains whatever it holds
    if args.resume:
        ckpt.check_resume(found, config.to_dict())
        if not found.record.get("env_from_config", True):  # the CLI makes envs from configs
            _refuse_env_object_run(args.out)
    else:
        ckpt.check_fresh(found, args.overwrite)
        _check_no_old_logs(args)
    made: list[Path] = []
    try:
        info = _join_and_compare(args, joining, config)
        made = missing_dirs(args.out)  # what check_writable makes
        ckpt.check_writable(args.out)
        signals.install()  # again: JAX's preemption notifier takes SIGTERM in a distributed run
        devices, n_dev = _learner_devices(info, learner_devices)
        _check_devices_of(args, info, devices, n_dev)
        _check_fits(config.members, n_dev, procs, on_cpu=devices is not None)
        try:
            config.validate(num_devices=n_dev)
        except ValueError as e:
            raise UsageError(str(e)) from None
    except UsageError:
        remove_empty(made)  # a refused command leaves no folders behind
        raise
    return config, info, devices, n_dev


def _check_devices_of(args: argparse.Namespace, info: Any, devices: Any, n_dev: int) -> None:
    if args.devices and devices is not None and n_dev < args.devices * info.num_processes:
        raise UsageError(
            f"--devices {args.devices}: each process has only {n_dev // info.num_processes} CPU "
            "devices (ensemble.launch --devices-per-process sets them); give --devices at most "
            "that, or launch with more."
        )


def _join_and_compare(args: argparse.Namespace, joining: Any, config: Any) -> Any:
    """Joins the other processes and compares every argument and the config with theirs.
    Compared first: a setting one process's own checks refuse would leave the others waiting
    in a later collective. Before any process makes --out: a process the launcher stops once
    another is refused would leave it behind."""
    info = _join(args, joining)
    _check_same_args(args, config)
    _check_same_config(config)  # (train() checks it for the Python API)
    return info


def _join(args: argparse.Namespace, joining: Any) -> Any:
    """Joins the other processes (if any) before JAX starts; a no-op for a single process."""
    from ensemble import _distributed as distributed

    if joining is not None and joining[1] and joining[1] > 1:
        # JAX says nothing while it waits, and aborts the process if the others never come.
        address, n, i = joining
        print(
            f"process {i} of {n}: joining the run through the coordinator at "
            f"{address or '(from the cluster)'}; waiting up to 120 s for every process ...",
            file=sys.stderr,
            flush=True,
        )
    try:
        return distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    except OSError as e:  # the coordinator's port is taken
        raise UsageError(f"{e} On the command line: --coordinator HOST:PORT.") from None


def _check_device_count(
    devices: int | None, members: int, num_envs: int, exact: bool, procs: int
) -> None:
    """Refuses simulated CPU devices that no env would use: each device steps at least one
    env of its members (``--devices 100000`` would build 100,000 devices, gigabytes).
    ``exact=False``: ``num_envs`` is only the most the env's defaults could give."""
    most = members * num_envs // procs
    if devices is not None and devices > most:
        envs = f"{num_envs} envs" if exact else f"at most {num_envs} envs by default"
        raise UsageError(
            f"--devices {devices}: more devices than the envs they would step ({members} "
            f"members x {envs}{f' / {procs} processes' if procs > 1 else ''}); "
            f"give --devices at most {most}."
        )


def _check_fits(members: int, n_dev: int, procs: int, on_cpu: bool) -> None:
    """The members must fill the devices evenly (``ensemble.layout``'s rule); the error names
    the flag that fixes it."""
    from ensemble import layout

    try:
        layout(members, n_dev)
        return
    except ValueError:
        pass  # said below, in the CLI's own terms
    if on_cpu:
        per = members // procs
        divisors = [d for d in range(1, per + 1) if per % d == 0]
        where = f"{n_dev} devices" + (f" ({n_dev // procs} per process)" if procs > 1 else "")
        listed = ", ".join(map(str, divisors))
        if procs > 1:  # a process has the devices the launcher gave it, no more
            local = n_dev // procs
            fits = [d for d in (*divisors, *range(2 * per, local + 1, per)) if d <= local]
            raise UsageError(
                f"--members {members} does not fit {where}: give --devices "
                f"{' or '.join(map(str, fits))} (a process has {local}; ensemble.launch "
                "--devices-per-process sets them), or --members a multiple of "
                f"{local * procs}."
            )
        raise UsageError(
            f"--members {members} does not fit {where}: give --devices a divisor of {per} "
            f"({listed}: several members per device) or a multiple of it ({per}, {2 * per}, "
            "...: each member spans several devices)."
        )
    raise UsageError(
        f"--members {members} does not fit the {n_dev} accelerators: use a multiple or a "
        f"divisor of {n_dev}, or show the run fewer devices (e.g. CUDA_VISIBLE_DEVICES)."
    )


def _check_numbers(args: argparse.Namespace) -> None:
    """Flags outside the config that must be positive (the config checks its own)."""
    for flag, low in (("checkpoint_every", 1), ("devices", 1), ("num_processes", 1)):
        value = getattr(args, flag)
        if value is not None and value < low:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= {low}, got {value}.")
    if args.process_id is not None and args.process_id < 0:
        raise UsageError(f"--process-id must be >= 0, got {args.process_id}.")
    if not args.out.strip():
        raise UsageError("--out must name a directory; an empty one would be the current one.")


def _config_from_args(args: argparse.Namespace, found: Any) -> Any:
    """The run's config: the flags given over the defaults (over the saved run's on --resume)."""
    from rollout.ppo._config import PPOConfig
    from rollout.ppo._env import known_envs

    given = {f: getattr(args, a) for a, f in _CONFIG_FLAGS if getattr(args, a) is not None}
    try:
        if args.resume and found.record is not None:
            saved = PPOConfig.from_dict(found.record["config"])
            if "env" in given:
                given["env"] = canonical_env(given["env"])
                if given["env"] != saved.env:  # before its other settings are judged for it
                    record = found.record["config"]
                    changed = {**record, "env": given["env"]}
                    refuse_changed(args.out, config_differences(record, changed))
            if "env_kwargs" in given:
                given["env_kwargs"] = canonical_env_kwargs(given["env_kwargs"])
            # A per-member list of the saved value (--lr 2.5e-4,2.5e-4 for 2.5e-4) is that value;
            # one of another length is not (refused by validate, as on a fresh run).
            members = given.get("members", saved.members)
            same = lambda k, v: (
                isinstance(v, tuple)
                and len(v) == members
                and all(x == getattr(saved, k) for x in v)
            )
            given = {k: getattr(saved, k) if same(k, v) else v for k, v in given.items()}
            given = as_saved(found.record["config"], given, found.record)
            config = dataclasses.replace(saved, **given)
            # A change is refused as one, before what it breaks is judged (--members 4 on a run
            # of two per-member learning rates: "learning_rate has 2 values").
            diffs = config_differences(found.record["config"], config.to_dict())
            if diffs:
                refuse_changed(args.out, diffs)
        else:
            given = {**{k: v for k, v in _DEFAULTS.items() if k not in given}, **given}
            config = PPOConfig.for_env(given.pop("env"), **given)
        config.validate(known_envs=known_envs())
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from None
    stray = [f"--{a.replace('_', '-')}" for a in _PBT_OPTIONS if getattr(args, a) is not None]
    if stray and not config.pbt:  # most likely --pbt was forgotten: say so, do not ignore them
        raise UsageError(
            f"{', '.join(stray)} only {'tune' if len(stray) > 1 else 'tunes'} --pbt, which "
            "this run does not use: add --pbt."
        )
    return config


def _saved_cpu_devices(args: argparse.Namespace, found: Any, procs: int) -> int | None:
    """A resumed CPU run's devices per process, as it ran (so it continues exactly)."""
    record = found.record if args.resume else None
    if not record or record.get("platform") != "cpu" or not record.get("devices"):
        return None
    return max(1, int(record["devices"]) // procs)


def _members_hint(args: argparse.Namespace, found: Any) -> int:
    """The member count the run will have, read before the config is built (no JAX needed)."""
    if args.members is not None:
        return int(args.members)
    if args.resume and found.record is not None:
        return int(found.record["config"].get("members", _DEFAULTS["members"]))
    return int(_DEFAULTS["members"])


def _envs_hint(args: argparse.Namespace, found: Any) -> tuple[int, bool]:
    """The envs per member, read before the config is built (no JAX needed), and whether that
    is the run's own number (else the most any env's defaults give)."""
    if args.num_envs is not None:
        return int(args.num_envs), True
    if args.resume and found.record is not None and "num_envs" in found.record["config"]:
        return int(found.record["config"]["num_envs"]), True
    return max(int(d["num_envs"]) for d in _ENV_DEFAULTS.values()), False


def _env_processes(name: str) -> int:
    value = os.environ.get(name) or "1"
    try:
        procs = int(value)
    except ValueError:
        raise UsageError(f"${name}={value!r} must be a positive integer.") from None
    if procs < 1:
        raise UsageError(f"${name}={value!r} must be a positive integer.")
    return procs


def _learner_devices(info: Any, per_process: int) -> tuple[list[Any] | None, int]:
    """The devices the members use, and how many.

    On a CPU-only host each process contributes its first ``per_process`` CPU devices, in
    process order (``jax.devices()`` lists all processes' devices); on accelerators, all.
    """
    import jax

    if jax.default_backend() != "cpu":
        return None, jax.device_count()
    devices = [
        d
        for p in range(info.num_processes)
        for d in [d for d in jax.devices() if d.process_index == p][:per_process]
    ]
    return devices, len(devices)


class _Signals:
    """SIGINT / SIGTERM: the first asks training to stop after the current jitted call (and
    write a checkpoint); a second one exits at once (the last checkpoint stays whole)."""

    def __init__(self) -> None:
        self._got: list[int] = []
        self._old: dict[int, Any] = {}
        self._training = False  # the loop polls: setup (envs, networks, restore) is over

    def received(self) -> int | None:
        self._training = True
        return self._got[0] if self._got else None

    def _handle(self, signum: int, frame: Any) -> None:
        self._got.append(signum)
        name = signal.Signals(signum).name
        if len(self._got) > 1:
            again = (
                "again" if signum == self._got[0] else f"after {signal.Signals(self._got[0]).name}"
            )
            sys.stderr.write(
                f"{name} {again}: exiting now; checkpoints already written are kept.\n"
            )
            sys.stderr.flush()
            os._exit(128 + signum)
        if self._training:
            sys.stderr.write(f"{name}: stopping after the current update to write a checkpoint.\n")
        else:  # the setup cannot be cut short safely: say how long it keeps going
            sys.stderr.write(
                f"{name}: still setting up (envs, networks, checkpoint); stopping before the "
                f"first update, with a checkpoint. {name} again exits now.\n"
            )
        sys.stderr.flush()

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                old = signal.signal(sig, self._handle)
                self._old.setdefault(sig, old)

    def __enter__(self) -> _Signals:
        self.install()
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
