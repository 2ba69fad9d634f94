"""``python -m rollout.ppo``: train an ensemble of PPO agents (see ``--help``).

Example:
  python -m rollout.ppo --env cartpole --members 4 --total-steps 500000 --out runs/cartpole
"""

from __future__ import annotations

import sys

from rollout.ppo._cli import main

if __name__ == "__main__":
    sys.exit(main())
