"""Sequential CPU work (environments, audio RNNs) on all CPU cores from inside jitted steps.

Also home of the functional environments (``rollout.envs``) and the ensemble PPO learner
(``rollout.ppo``).
"""

from rollout._devices import configure_cpu_devices
from rollout._on_cpu import OnCpu, WorkerError, WorkerTimeout, on_cpu
from rollout._relay import worker_errors

__all__ = [
    "OnCpu",
    "WorkerError",
    "WorkerTimeout",
    "configure_cpu_devices",
    "on_cpu",
    "worker_errors",
]
