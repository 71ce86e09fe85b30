"""OpenAI's usage object for a response's outputs, with this server's speculation figures beside it.

`usage.completion_tokens_details` holds OpenAI's own fields: Predicted Outputs' accepted and rejected
prediction tokens where the request had a prediction, and the reasoning tokens where the server has a
reasoning parser (the output's tokens up to the end of its reasoning, `reasoning_tokens`). `usage.spec`, an extension, says what speculative
decoding did for the request, in SGLang's meta_info names: its verify steps (`spec_verify_ct`), the draft
tokens they accepted (`spec_accept_token_num`, bonus tokens not counted) and the tokens each step
produced on average (`spec_accept_length`: completion tokens / verify steps, null before any). It is
there whenever the server runs a speculative algorithm (zeros for a request no step verified), and
absent when it does not. OpenAI's clients keep fields they do not know (the Python client's
`usage.spec`), so it is always sent.
"""

from __future__ import annotations

from typing import Optional, Sequence


def of(prompt_tokens: int, outs: Sequence[Optional[dict]], reasoning: Optional[int] = None) -> dict:
    """Token counts over the outputs (None: a choice with no output yet), with their details and speculation;
    `reasoning`: their reasoning tokens, None where the server has no reasoning parser."""
    done = sum(o["meta_info"]["completion_tokens"] for o in outs if o)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": done, "total_tokens": prompt_tokens + done}
    details = {} if reasoning is None else {"reasoning_tokens": reasoning}
    predicted = [o["meta_info"] for o in outs if o and "accepted_prediction_tokens" in o["meta_info"]]
    if predicted:
        details |= {kind: sum(m[kind] for m in predicted) for kind in ("accepted_prediction_tokens",
                                                                       "rejected_prediction_tokens")}
    if details:
        usage["completion_tokens_details"] = details
    speculated = spec(outs)
    if speculated is not None:
        usage["spec"] = speculated
    return usage


def spec(outs: Sequence[Optional[dict]]) -> Optional[dict]:
    """The `spec` extension over the outputs; None when the server does not speculate."""
    metas = [o["meta_info"] for o in outs if o and "spec_accept_token_num" in o["meta_info"]]
    if not metas:
        return None
    steps = sum(m["spec_verify_ct"] for m in metas)
    tokens = sum(m["completion_tokens"] for m in metas)
    return {"spec_verify_ct": steps, "spec_accept_token_num": sum(m["spec_accept_token_num"] for m in metas),
            "spec_accept_length": tokens / steps if steps else None}


def reasoning_tokens(output_ids: Sequence[int], end: Sequence[int]) -> int:
    """The reasoning tokens of an output that reasoned: those up to its first reasoning's end, the end
    marker's tokens `end` included; all of them where the reasoning never ended."""
    ids, end = list(output_ids), list(end)
    return next((i + len(end) for i, token in enumerate(ids) if token == end[0] and ids[i:i + len(end)] == end),
                len(ids))
