"""``python -m rollout.ppo``: train an ensemble of PPO agents (see ``--help``).

Example:
  python -m rollout.ppo --env cartpole --members 4 --total-steps 500000 --out runs/cartpole
"""

from __future__ import annotations

import sys
from typing import Any, NoReturn

from ensemble._exit import exit_process
from rollout.ppo._cli import main


def run() -> NoReturn:
    """The ``ensemble-ppo`` console script: :func:`main`, then the process ends."""
    if "--debug" not in sys.argv:
        sys.unraisablehook = _without_closed_loop_noise(sys.unraisablehook)
    exit_process(main())


def _without_closed_loop_noise(hook: Any) -> Any:
    """``hook`` that skips ``Event loop is closed`` errors. When a checkpoint write fails (a
    full disk), TensorStore's writes still in flight complete into orbax's closed event loop,
    each printing a traceback (up to hundreds) around the one line that says what failed."""

    def skip(info: Any) -> None:
        if not (
            isinstance(info.exc_value, RuntimeError)
            and "Event loop is closed" in str(info.exc_value)
        ):
            hook(info)

    return skip


if __name__ == "__main__":
    run()
