"""KVBudget: how many KV slots fit the memory, and, when they run out, which flag to turn and to what.

The pool gets --mem-fraction-static of the device's memory (RAM on CPU) once the weights are in, or
--max-total-tokens slots. Knowing how it was sized, every out-of-memory message (docs/serving.md,
"Out of memory") can name a value that would fit: at start-up (the weights leave no room), for a
request larger than the pool, and when decode steps have to retract requests.

A target with sliding-window layers keeps their K/V in a window pool of --swa-full-tokens-ratio slots
per slot (engine/memory/window_pool.py): a slot costs the global layers' (and a draft's) K/V and that
fraction of the windowed layers', so the same memory holds more tokens.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Optional

from engine.errors import ConfigError

log = logging.getLogger(__name__)

# The most of the device --mem-fraction-static is worth raising to: activations need the rest.
MAX_FRACTION = 0.95
# The smallest pool worth starting with.
MIN_SLOTS = 64
# Retraction advice is logged at most this often.
_RETRACTION_LOG_S = 60.0


def slot_bytes(full: int, windowed: int, ratio: float) -> int:
    """Bytes of one slot: `full` (the K/V of layers every token keeps, a draft's included) and `ratio` of
    `windowed` (the sliding-window layers', whose pool has `ratio` slots per slot)."""
    return full + math.ceil(ratio * windowed)


def window_slots(slots: int, ratio: float, least: int) -> int:
    """The window pool's size for a full pool of `slots`: `ratio` of it, and at least `least` (a window, a
    prefill chunk and a step's tree, which one request may hold at once) where the full pool has that many."""
    return max(int(ratio * slots), min(slots, least))


@dataclass
class KVBudget:
    slots: int
    bytes_per_token: int = 0        # one slot: the target's and the draft's K/V of one token (slot_bytes)
    weight_bytes: int = 0           # target and draft
    device_bytes: int = 0           # the device's memory (RAM on CPU); 0: unknown
    fraction: Optional[float] = None     # --mem-fraction-static in effect; None when --max-total-tokens sized it
    _logged_at: float = field(default=-math.inf, repr=False)

    @classmethod
    def plan(cls, max_total_tokens: Optional[int], fraction: float, device_bytes: int, weight_bytes: int,
             bytes_per_token: int, wanted: int) -> "KVBudget":
        """The pool for --max-total-tokens, or for `fraction` of `device_bytes` after the weights; refused
        with the fraction that would hold `wanted` tokens (one full-context request) when no useful pool fits."""
        if max_total_tokens:
            return cls(max_total_tokens, bytes_per_token, weight_bytes, device_bytes)
        budget = cls(0, bytes_per_token, weight_bytes, device_bytes, fraction)
        budget.slots = budget.tokens_at(fraction)
        if budget.slots < MIN_SLOTS:
            raise ConfigError(f"The weights take {weight_bytes / 2**30:.2f} GiB (draft included), leaving no KV cache "
                              f"within --mem-fraction-static {fraction} of {device_bytes / 2**30:.1f} GiB: "
                              f"{budget._room_for(wanted, 'one request of the full context')}.")
        return budget

    def tokens_at(self, fraction: float) -> int:
        return max(0, int(self.device_bytes * fraction) - self.weight_bytes) // self.bytes_per_token

    def fraction_for(self, tokens: int) -> Optional[float]:
        """The --mem-fraction-static (rounded up to 0.01) that holds the weights and `tokens` slots; None
        past MAX_FRACTION or when the device's memory is unknown."""
        if not self.device_bytes:
            return None
        f = math.ceil(100 * (self.weight_bytes + tokens * self.bytes_per_token) / self.device_bytes) / 100
        return f if f <= MAX_FRACTION else None

    def _room_for(self, tokens: int, what: str) -> str:
        """How to give the pool `tokens` slots ("raise ..."), or what to lower when the device cannot."""
        if self.fraction is None or not self.device_bytes:       # --max-total-tokens sized the pool
            return f"raise --max-total-tokens to {tokens} ({what})"
        fraction = self.fraction_for(tokens)
        if fraction is not None:
            return f"raise --mem-fraction-static to {fraction} or pass --max-total-tokens {tokens} ({what})"
        most = self.tokens_at(MAX_FRACTION)
        return (f"even --mem-fraction-static {MAX_FRACTION} holds only {most} KV tokens, fewer than {tokens} "
                f"({what}): lower --context-length to {max(1, most - MIN_SLOTS)}, or serve a smaller model or --dtype")

    def warn_if_short(self, wanted: int, context_length: int) -> None:
        """At start-up: a pool smaller than one request of the full context (`wanted` slots) refuses
        the longest requests; say so, and what would hold one."""
        if self.slots < wanted:
            log.warning("The KV pool holds %d tokens, fewer than one request of --context-length %d needs (%d), "
                        "so longer requests will be refused: %s, or lower --context-length to %d.", self.slots,
                        context_length, wanted, self._room_for(wanted, "one request of the full context"),
                        max(1, self.slots - (wanted - context_length)))

    def allocation_failed(self, free_bytes: int) -> ConfigError:
        """The pool's buffers did not fit the device's free memory: the size that would."""
        fits = int(0.9 * free_bytes) // self.bytes_per_token
        fraction = self.fraction_for(fits)
        lower = f"lower --mem-fraction-static to {fraction} or " if fraction is not None and self.fraction else ""
        size = self.slots * self.bytes_per_token / 2**30
        return ConfigError(f"Allocating the KV pool of {self.slots} tokens ({size:.2f} GiB) ran out of memory with "
                           f"{free_bytes / 2**30:.2f} GiB free: {lower}pass --max-total-tokens {fits}.")

    # ------------------------------------------------------------------ under load
    def request_too_large(self, full_length: int, tree: int) -> str:
        """The abort message of a request that will hold `full_length` tokens when done and verifies a
        `tree`-slot draft tree per step."""
        tokens = full_length + tree
        smaller_tree = " or the tree (--speculative-num-draft-tokens)" if tree > 1 else ""
        room = self._room_for(tokens, "this request alone")
        return (f"out of KV cache: the request needs {tokens} token slots to finish (prompt and max_new_tokens"
                f"{f', and a {tree}-slot draft tree' if tree > 1 else ''}) and the KV pool holds {self.slots}: "
                f"{room}; or lower --context-length{smaller_tree}")

    def retracting(self, running: int, per_request: int, free: int, full_lengths: list[int]) -> None:
        """Log, at most once a minute, that a decode step must retract requests: `running` requests need
        `per_request` slots each and `free` are left. `full_lengths`: the tokens the requests that want
        to run (running, then waiting, up to --max-running-requests) will hold when done. Names the
        values that would let them run without retraction."""
        now = time.monotonic()
        if now - self._logged_at < _RETRACTION_LOG_S:
            return
        self._logged_at = now
        # As many as fit even if the longest come together.
        longest = sorted(full_lengths, reverse=True)
        fits = max(1, sum(1 for k in range(1, len(longest) + 1) if sum(longest[:k]) + k * per_request <= self.slots))
        tree = (f", or a smaller tree ({per_request} slots per request per step: --speculative-num-draft-tokens, "
                "--speculative-num-steps, --speculative-eagle-topk)") if per_request > 1 else ""
        room = self._room_for(sum(full_lengths) + len(full_lengths) * per_request,
                              f"all {len(full_lengths)} requests to their max_new_tokens")
        log.warning("KV cache full: %d running requests need %d slots for a decode step and %d are free, so some "
                    "are retracted and recomputed later. To avoid it: --max-running-requests %d; or %s%s.",
                    running, running * per_request, free, fits, room, tree)
