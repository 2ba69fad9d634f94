"""The command lines' argument parser: a mistake is one line on stderr and exit code 2.

The ``type=`` functions below check a value when it is parsed, so a script refuses a mistake
before any long work starts, e.g. ``p.add_argument("--out", type=writable_dir)``.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a mistake in one line (not usage + error) and exits 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        _remove_made_dirs()  # a refused command leaves no folders behind
        if message.endswith("expected one argument"):  # argparse read "-1,2" as a flag
            flag = message.split(":")[0].removeprefix("argument ").split("/")[-1]
            message += f" (if its value starts with '-', write {flag}=VALUE)"
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")

    def results_dir(self, path: str | os.PathLike[str]) -> Path:
        """``writable_dir(path)`` for a folder no flag names (a script's fixed results folder),
        or exit 2 with one line; call it right after ``parse_args``, before the long work.

        >>> out = OneLineParser().results_dir(tempfile.gettempdir())  # the folder, as a Path
        """
        try:
            return writable_dir(os.fspath(path))
        except argparse.ArgumentTypeError as e:
            self.error(str(e))
            raise  # not reached: error() exits


def positive_int(text: str) -> int:
    """An argparse ``type``: an integer >= 1, else one line naming the value."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """An argparse ``type``: an integer >= 0 (``--epochs 0``: the default), else one line."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


def positive_float(text: str) -> float:
    """An argparse ``type``: a finite number > 0 (``--check-timeout 240``), else one line."""
    value = _float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """An argparse ``type``: a finite number >= 0 (``--settle 0``: no rest), else one line."""
    value = _float(text)
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def writable_dir(text: str) -> Path:
    """An argparse ``type``: a folder to write results in, created if missing, else one line.

    ``p.add_argument("--out", type=writable_dir, default="benchmarks/results")`` refuses
    ``--out /proc/x`` (cannot be created) or ``--out README.md`` (a file) while parsing, not
    when the results are written at the end of a long run.
    """
    if not text:
        raise argparse.ArgumentTypeError("expected a folder, got ''")
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a file, not a folder")
    try:
        missing = missing_dirs(path)
        path.mkdir(parents=True, exist_ok=True)
        _MADE_DIRS.extend(missing)  # deepest first
    except OSError as e:
        why = f"cannot create the folder {text!r}: {e.strerror or e}"
        raise argparse.ArgumentTypeError(why) from None
    try:
        with tempfile.TemporaryFile(dir=path):  # the only sure test (root, read-only mounts)
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write in {text!r}: {e.strerror or e}") from None
    return path.absolute()  # a script may run its work elsewhere (subprocesses in the repo root)


#: Folders ``writable_dir`` created in this process, deepest first.
_MADE_DIRS: list[Path] = []


def _remove_made_dirs() -> None:
    """Removes the folders ``writable_dir`` created, where still empty."""
    remove_empty(_MADE_DIRS)
    _MADE_DIRS.clear()


def missing_dirs(path: str | os.PathLike[str]) -> list[Path]:
    """``path`` and its parents that do not exist yet, deepest first (what a ``mkdir(parents=
    True)`` makes, for :func:`remove_empty` to take back)."""
    path = Path(path)
    return [d for d in (path, *path.absolute().parents) if not d.exists()]


def remove_empty(folders: list[Path]) -> None:
    """Removes these folders (deepest first) where they are still empty."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            pass  # not empty, or gone


def file_name(text: str) -> str:
    """An argparse ``type``: a bare file name, no folder (``--name pbt``: results/pbt.json)."""
    if text in ("", ".", "..") or "\0" in text or any(s and s in text for s in (os.sep, os.altsep)):
        raise argparse.ArgumentTypeError(f"expected a file name without a folder, got {text!r}")
    return text
