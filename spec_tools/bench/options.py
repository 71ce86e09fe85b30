"""Options of `spec bench` and `spec tune` beyond the engine's flags, with their defaults and checks.

Light on purpose (no torch, no numpy): the CLI reads the defaults from here when it builds its help.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from spec_tools.bench import BenchError

_LIST_FLAGS = {"steps": "--search-steps", "topk": "--search-topk", "draft_tokens": "--search-draft-tokens",
               "batch_sizes": "--batch-sizes"}


@dataclass
class BenchOptions:
    dataset: Optional[str] = None
    dataset_path: Optional[str] = None
    num_prompts: Optional[int] = None
    max_new_tokens: int = 256
    temperature: float = 0.0
    max_concurrency: int = 1
    random_input_len: int = 128
    random_output_len: int = 128
    url: Optional[str] = None
    baseline_url: Optional[str] = None
    compare_baseline: bool = False
    use_prediction: bool = False

    def check(self) -> None:
        if self.use_prediction and (self.compare_baseline or self.baseline_url):
            raise BenchError("--use-prediction compares the same configuration with and without predictions; "
                             "drop --compare-baseline and --baseline-url.")
        if self.max_new_tokens < 1:
            raise BenchError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}.")
        if self.max_concurrency < 1:
            raise BenchError(f"--max-concurrency must be at least 1, got {self.max_concurrency}.")
        if self.temperature < 0:
            raise BenchError(f"--temperature must be at least 0, got {self.temperature}.")
        if self.baseline_url and not self.url:
            raise BenchError("--baseline-url compares two servers: pass the speculative one as --url too.")
        if self.url and self.compare_baseline and not self.baseline_url:
            raise BenchError("Against a server, --compare-baseline needs a second server without speculation: "
                             "pass its address as --baseline-url (or drop --url to compare in-process).")


@dataclass
class TuneOptions:
    steps: Sequence[int] = (1, 2, 3, 4, 5)
    topk: Sequence[int] = (1, 2, 4)
    draft_tokens: Sequence[int] = (4, 8, 16)
    batch_sizes: Sequence[int] = (1,)
    time_budget: float = 900.0
    dataset: Optional[str] = None
    dataset_path: Optional[str] = None
    num_prompts: int = 16
    max_new_tokens: int = 128
    temperature: float = 0.0

    def check(self) -> None:
        for name, flag in _LIST_FLAGS.items():
            values = getattr(self, name)
            if not values or any(v < 1 for v in values):
                raise BenchError(f"{flag} needs positive integers, got {list(values)}.")
        if self.time_budget <= 0:
            raise BenchError(f"--time-budget must be positive seconds, got {self.time_budget}.")
        if self.max_new_tokens < 1 or self.num_prompts < 1:
            raise BenchError("--max-new-tokens and --num-prompts must be at least 1.")
