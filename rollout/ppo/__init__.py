"""Ensemble PPO: n PPO agents, one per device, trained by one jitted, donated update.

Example:
  >>> import jax
  >>> from rollout.ppo import Learner, PPOConfig
  >>> cfg = PPOConfig.for_env("cartpole", members=jax.device_count(), total_steps=1024)
  >>> learner = Learner(cfg)
  >>> state = learner.init()
  >>> state, metrics = learner.update(state, 2)  # 2 updates in one jitted call
  >>> metrics["returns"].shape == (cfg.members, 2)
  True

The command line (``python -m rollout.ppo --help``) trains, logs ``metrics.jsonl``, plots the
learning curves and checkpoints; :func:`train` is the same loop as a function.
"""

from rollout.ppo._checkpoint import RunDirError
from rollout.ppo._cli import Diverged, Interrupted, main, plot_curves, train
from rollout.ppo._config import PPOConfig
from rollout.ppo._gae import gae
from rollout.ppo._learner import (
    METRIC_NAMES,
    Learner,
    MemberState,
    RunningStats,
    TrainState,
)
from rollout.ppo._networks import ActorCritic

__all__ = [
    "METRIC_NAMES",
    "ActorCritic",
    "Diverged",
    "Interrupted",
    "Learner",
    "MemberState",
    "PPOConfig",
    "RunDirError",
    "RunningStats",
    "TrainState",
    "gae",
    "main",
    "plot_curves",
    "train",
]
