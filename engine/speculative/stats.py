"""Engine-wide acceptance figures of speculative decoding."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Engine-wide acceptance figures."""
    steps: int                                   # draft depth, for per-position acceptance
    verify_ct: int = 0
    tokens: int = 0                              # tokens produced by verification (accepted + bonus)
    accepted_at_depth: list[int] = field(default_factory=list)   # [d]: verifies that accepted >= d+1 drafts

    def __post_init__(self):
        self.accepted_at_depth = [0] * self.steps

    def record(self, accepted: int) -> None:
        self.verify_ct += 1
        self.tokens += accepted + 1
        for d in range(min(accepted, self.steps)):
            self.accepted_at_depth[d] += 1

    def summary(self) -> dict:
        n = max(self.verify_ct, 1)
        return {
            "spec_verify_ct": self.verify_ct,
            "avg_spec_accept_length": self.tokens / n if self.verify_ct else None,
            # share of the draft depth accepted per step
            "spec_accept_rate": (self.tokens - self.verify_ct) / (n * self.steps) if self.verify_ct else None,
            "spec_accept_by_position": [c / n for c in self.accepted_at_depth],
        }
