"""Optional metric outputs next to ``metrics.jsonl``: TensorBoard event files and Weights & Biases.

``python -m rollout.ppo --log tensorboard,wandb`` turns them on; ``metrics.jsonl`` is always
written. Each metric row (one per PPO update, see ``train``) becomes scalars named so dashboards
group them: ``member_0/return``, ``member_0/entropy``, ... and ``ensemble/return_mean``,
``ensemble/entropy_mean``, ..., with the env steps per member as the step.

The writers run on a background thread: a row is handed over in microseconds and the training
loop never waits for protobuf encoding or disk (the thread mostly works while the loop waits on
the device for the next update). And they get at most one row per ``--log-interval`` seconds
(default 0.1; ``metrics.jsonl`` keeps every row): a row costs them a fixed few hundred
microseconds of CPU (W&B more, in its service process), which is nothing next to an update of
seconds but would slow a small model doing a hundred updates per second by several percent.
"""

from __future__ import annotations

import atexit
import math
import os
import queue
import secrets
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

#: Logger names for ``--log`` and the package each one needs (and the extra that installs it).
LOGGERS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboardX", "tensorboard"),
    "wandb": ("wandb", "wandb"),
}

# Row keys that are per-member lists, and the scalar name each gets (``returns`` -> ``return``).
_RENAME = {"returns": "return"}


class Logger(Protocol):
    """Anything that takes metric rows: ``write(row)`` per update, ``close()`` at the end.

    A logger may also have ``restore(rows)``: on a resumed run, it gets the rows restored with
    the checkpoint first, to write those the stopped run did not get to write. And
    ``set_exit_code(code)``: before ``close()``, the run's exit code where it did not end well
    (the CLI's: 1 diverged or failed, 2 refused, 128 + signal stopped by a signal)."""

    def write(self, row: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def parse_log_flag(text: str | None) -> tuple[str, ...]:
    """``'tensorboard,wandb'`` -> ``('tensorboard', 'wandb')``; checks names and packages.

    ``jsonl`` is accepted and ignored (``metrics.jsonl`` is always written). Raises
    ``ValueError`` with one line saying what to do for an unknown name or a missing package.

    Example:
      >>> parse_log_flag("jsonl, tensorboard")
      ('tensorboard',)
      >>> parse_log_flag("tensorbord")
      Traceback (most recent call last):
      ...
      ValueError: unknown logger 'tensorbord' in --log; choose from jsonl, tensorboard, wandb.
    """
    names: list[str] = []
    for name in (text or "").replace(" ", "").lower().split(","):
        if name in ("", "jsonl") or name in names:
            continue
        if name not in LOGGERS:
            raise ValueError(
                f"unknown logger {name!r} in --log; choose from jsonl, {', '.join(LOGGERS)}."
            )
        names.append(name)
    for name in names:
        module, extra = LOGGERS[name]
        try:
            __import__(module)
        except ImportError as e:
            raise ValueError(
                f"--log {name} needs the {module} package ({e}); install it with "
                f"pip install 'sharded-ensembles[{extra}]'."
            ) from None
    return tuple(names)


def scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """The scalars of one metric row: ``member_i/<metric>`` and ``ensemble/<metric>_mean``.

    Missing values (``None``: e.g. no episode finished yet) are left out, never logged as 0.
    ``returns`` also gets ``ensemble/return_min`` and ``ensemble/return_max``; the throughput
    ``env_steps_per_s`` (all members) becomes ``perf/env_steps_per_s``. With PBT, each member's
    hyperparameters in effect (``hparams``) become ``member_i/hparam_<name>``, and the member it
    copied, ``member_i/pbt_parent`` (no mean: it is an index).

    Example:
      >>> scalars({"env_steps": 512, "returns": [10.0, None], "entropy": [0.5, 0.7]})
      ... # doctest: +NORMALIZE_WHITESPACE
      {'member_0/return': 10.0, 'ensemble/return_mean': 10.0, 'ensemble/return_min': 10.0,
       'ensemble/return_max': 10.0, 'member_0/entropy': 0.5, 'member_1/entropy': 0.7,
       'ensemble/entropy_mean': 0.6}
    """
    out: dict[str, float] = {}
    for key, value in row.items():
        if key == "hparams" and isinstance(value, Mapping):
            for name, per_member in value.items():
                _per_member(out, f"hparam_{name}", per_member)
        elif isinstance(value, list | tuple):
            _per_member(out, _RENAME.get(key, key), value)
    sps = row.get("env_steps_per_s")
    if sps is not None and math.isfinite(sps):
        out["perf/env_steps_per_s"] = float(sps)
    return out


def _per_member(out: dict[str, float], name: str, values: Sequence[Any]) -> None:
    present = []
    for i, v in enumerate(values):
        if v is not None and math.isfinite(v):
            out[f"member_{i}/{name}"] = float(v)
            present.append(float(v))
    if present and name != "pbt_parent":
        out[f"ensemble/{name}_mean"] = math.fsum(present) / len(present)
        if name == "return":
            out["ensemble/return_min"] = min(present)
            out["ensemble/return_max"] = max(present)


class TensorBoardLogger:
    """TensorBoard event files in ``directory`` (``tensorboard --logdir <out>/tensorboard``).

    One event per row holds all of the row's scalars (one protobuf and one record instead of
    one per scalar: ~10x less writer time than ``SummaryWriter.add_scalar`` per tag).
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        from tensorboardX import FileWriter
        from tensorboardX.proto.summary_pb2 import Summary

        self.directory = Path(directory)
        self._summary = Summary
        self._writer = FileWriter(str(self.directory), flush_secs=30)
        self._started = False

    def write(self, row: Mapping[str, Any]) -> None:
        if not self._started:
            # A session start at the first step written: TensorBoard drops the events a
            # killed run wrote from there on, which a resumed run writes again.
            from tensorboardX.proto.event_pb2 import Event, SessionLog

            start = SessionLog(status=SessionLog.START)
            self._writer.add_event(Event(step=int(row["env_steps"]), session_log=start))
            self._started = True
        value = self._summary.Value
        summary = self._summary(
            value=[value(tag=tag, simple_value=v) for tag, v in scalars(row).items()]
        )
        self._writer.add_summary(summary, global_step=int(row["env_steps"]))

    def restore(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Writes a resumed run's rows again, from its first: events the stopped run had not
        flushed (up to 30 s of them) were lost with it, and the session start at the first
        row makes TensorBoard drop every older event for these."""
        self._started = False  # the session start goes at the first row written again
        for row in rows:
            self.write(row)

    def close(self) -> None:
        self._writer.close()


class WandbLogger:
    """A Weights & Biases run; ``WANDB_MODE=offline`` writes it under ``directory`` only.

    ``config``: logged as the run's config (``PPOConfig.to_dict()``). Other settings (project,
    entity, name, mode) come from W&B's own environment variables (``WANDB_PROJECT``, ...).
    """

    def __init__(
        self, directory: str | os.PathLike, config: Mapping[str, Any] | None, resume: bool = False
    ) -> None:
        import wandb

        self._exit_code = 0
        Path(directory).mkdir(parents=True, exist_ok=True)
        # One W&B run per training run: a resumed run continues the W&B run it started.
        id_file = Path(directory) / "wandb_run_id"
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else None
        run_id = run_id or secrets.token_hex(8)
        id_file.write_text(run_id + "\n")
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "rollout-ppo"),
            dir=str(directory),
            config=dict(config or {}),
            id=run_id,
            resume="allow",
        )

    def write(self, row: Mapping[str, Any]) -> None:
        self._run.log(scalars(row), step=int(row["env_steps"]))

    def restore(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Logs a resumed run's rows that W&B has not got: the rows still queued when the
        stopped run was killed were lost with it. A resumed online run starts at the step after
        W&B's last; an offline one knows none (step 0), so it gets them all again."""
        first = int(self._run.step)
        for row in rows:
            if int(row["env_steps"]) >= first:
                self.write(row)

    def set_exit_code(self, code: int) -> None:
        self._exit_code = code

    def close(self) -> None:
        # Non-zero: W&B shows the run as failed, not finished (a stopped run, a diverged one).
        self._run.finish(exit_code=self._exit_code)


#: Default seconds between two rows handed to the loggers (``--log-interval``).
DEFAULT_INTERVAL_S = 0.1


class Loggers:
    """The loggers of one run behind one background thread; a context manager.

    ``write(row)`` only queues the row, and only if ``interval_s`` seconds have passed since the
    last row it queued; otherwise it keeps the row aside, and ``close()`` writes the last one
    kept, so the loggers always end at the run's final row. ``interval_s=0`` passes every row.
    A logger that fails is reported once on stderr, then skipped (and still closed):
    ``metrics.jsonl``, written by the training loop itself, still has every row.
    """

    def __init__(
        self, loggers: Sequence[Logger] = (), interval_s: float = DEFAULT_INTERVAL_S
    ) -> None:
        if not interval_s >= 0:
            raise ValueError(f"the log interval must be >= 0 seconds, got {interval_s}")
        self.interval_s = float(interval_s)
        self._last = -math.inf  # when the last row was queued (time.monotonic)
        self._held: Mapping[str, Any] | None = None  # the latest row not queued yet
        #: Rows queued for the loggers, rows kept back by the interval.
        self.queued, self.skipped = 0, 0
        self.loggers = list(loggers)
        self._live = list(loggers)  # those that have not failed
        #: CPU seconds the writer thread has spent writing rows (for benchmarks).
        self.cpu_s = 0.0
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        if self.loggers:
            self._thread = threading.Thread(target=self._drain, name="rollout-loggers", daemon=True)
            self._thread.start()
            # Rows already handed over are written even if training stops with an exception.
            atexit.register(self.close)

    def write(self, row: Mapping[str, Any]) -> None:
        if self._thread is None:
            return
        now = time.monotonic()
        # A PBT step's row always goes: its lineage (member_i/pbt_parent) is in no other row.
        if now - self._last < self.interval_s and "pbt_parent" not in row:
            self._held = dict(row)
            self.skipped += 1
            return
        self._last, self._held = now, None
        self.queued += 1
        self._queue.put(dict(row))

    def close(self, exit_code: int = 0) -> None:
        """Writes what is queued (and the last row kept back), then closes every logger.
        ``exit_code``: how the run ended, for loggers that record it (``set_exit_code``)."""
        if self._thread is not None:
            if self._held is not None:
                self._queue.put(self._held)
                self.queued, self.skipped, self._held = self.queued + 1, self.skipped - 1, None
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        for logger in self.loggers:  # failed ones too: they may hold open files
            if exit_code and hasattr(logger, "set_exit_code"):
                _report(logger, "set_exit_code", lambda lg=logger: lg.set_exit_code(exit_code))
            _report(logger, "close", logger.close)
        self.loggers, self._live = [], []
        atexit.unregister(self.close)

    def restore(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """A resumed run's metric rows so far, for loggers to write what they missed (every
        logger that has a ``restore`` method), before any new row and whatever the interval."""
        if self._thread is not None and rows:
            self._queue.put(("restore", [dict(r) for r in rows]))

    def __enter__(self) -> Loggers:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _drain(self) -> None:
        while (row := self._queue.get()) is not None:
            start = time.thread_time()
            for logger in list(self._live):
                if isinstance(row, tuple):  # ("restore", rows)
                    if not hasattr(logger, "restore"):
                        continue
                    ok = _report(logger, "restore", lambda lg=logger: lg.restore(row[1]))
                else:
                    ok = _report(logger, "write", lambda lg=logger: lg.write(row))
                if not ok:
                    self._live.remove(logger)
            self.cpu_s += time.thread_time() - start


def _report(logger: Any, what: str, fn: Any) -> bool:
    try:
        fn()
        return True
    except Exception as e:  # a logging failure must not stop training
        print(f"warning: {type(logger).__name__}.{what} failed, logger off: {e}", file=sys.stderr)
        return False


def open_loggers(
    names: Sequence[str],
    out: str | os.PathLike,
    config: Mapping[str, Any] | None = None,
    interval_s: float = DEFAULT_INTERVAL_S,
    resume: bool = False,
) -> Loggers:
    """Opens the loggers ``names`` (from :func:`parse_log_flag`) for the run directory ``out``.

    TensorBoard writes to ``out/tensorboard``, W&B to ``out/wandb``; they get at most one row
    per ``interval_s`` seconds (see :class:`Loggers`). ``resume``: the run continues from a
    checkpoint, so W&B continues the run's own W&B run (TensorBoard drops the events past the
    checkpoint that the stopped run had written, as the resumed run writes them again).

    Example:
      >>> import tempfile
      >>> with open_loggers(["tensorboard"], tempfile.mkdtemp()) as logs:
      ...     logs.write({"env_steps": 512, "returns": [9.0, 11.0]})
    """
    out = Path(out)
    opened: list[Logger] = []
    try:
        for name in names:
            if name == "tensorboard":
                opened.append(TensorBoardLogger(out / "tensorboard"))
            elif name == "wandb":
                opened.append(WandbLogger(out, config, resume))
            else:
                raise ValueError(f"unknown logger {name!r}; choose from {', '.join(LOGGERS)}.")
    except BaseException:
        for logger in opened:
            logger.close()
        raise
    return Loggers(opened, interval_s)
