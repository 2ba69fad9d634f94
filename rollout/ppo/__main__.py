"""``python -m rollout.ppo``: train an ensemble of PPO agents (see ``--help``).

Example:
  python -m rollout.ppo --env cartpole --members 4 --total-steps 500000 --out runs/cartpole
"""

from __future__ import annotations

import sys
from typing import NoReturn

from ensemble._exit import exit_process
from rollout.ppo._checkpoint import quiet_failed_checkpoint_io
from rollout.ppo._cli import main


def run() -> NoReturn:
    """The ``ensemble-ppo`` console script: :func:`main`, then the process ends."""
    if "--debug" not in sys.argv:
        quiet_failed_checkpoint_io()
    exit_process(main())


if __name__ == "__main__":
    run()
