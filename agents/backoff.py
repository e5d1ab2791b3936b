"""Retry delays for talking to a controller that may be down.

Exponential backoff with full jitter (AWS architecture blog, "Exponential Backoff And
Jitter"): many agents that lost the controller at the same moment spread their retries out
instead of returning in lock-step when it comes back. Not stamina or tenacity (the client's
submission uses stamina): the agent's loop never gives up and spends this delay between its
own steps (heartbeat, lease, probes), where a retry that wraps one call has nothing to wrap.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Backoff:
    """Delay before retry `attempt` (0-based): uniform in [0, min(cap, base * 2**attempt)]."""

    base_s: float = 1.0
    cap_s: float = 30.0
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        if self.base_s < 0 or self.cap_s < 0:
            raise ValueError("backoff base and cap must be >= 0 seconds")

    def ceiling(self, attempt: int) -> float:
        # min() before the power would overflow floats after ~1000 attempts.
        return min(self.cap_s, self.base_s * 2.0 ** min(attempt, 62))

    def delay(self, attempt: int) -> float:
        return self.rng.uniform(0.0, self.ceiling(attempt))
