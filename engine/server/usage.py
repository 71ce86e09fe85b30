"""OpenAI's usage object for a response's outputs."""

from __future__ import annotations

from typing import Optional, Sequence


def of(prompt_tokens: int, outs: Sequence[Optional[dict]]) -> dict:
    """Token counts over the outputs (None: a choice with no output yet), with Predicted Outputs'
    accepted and rejected prediction tokens where the request had a prediction."""
    done = sum(o["meta_info"]["completion_tokens"] for o in outs if o)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": done, "total_tokens": prompt_tokens + done}
    predicted = [o["meta_info"] for o in outs if o and "accepted_prediction_tokens" in o["meta_info"]]
    if predicted:
        usage["completion_tokens_details"] = {
            kind: sum(m[kind] for m in predicted) for kind in ("accepted_prediction_tokens",
                                                               "rejected_prediction_tokens")}
    return usage
