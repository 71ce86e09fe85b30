"""What spec's OpenAPI schema cannot state, for schemathesis, so that "schema-valid request rejected"
means the server refused a request it should serve:
- the grammar formats: a field holds a regex, an EBNF grammar, a JSON schema as text or a structural
  tag, but a schema cannot say which texts of that kind compile; these strategies draw texts that do;
- the rules across fields: a /generate batch takes one sampling_params per prompt, and n x prompts
  must fit the queue (--max-queued-requests; SPEC_QUEUE here, 1024 by default).

    SCHEMATHESIS_HOOKS=benchmarks.schemathesis_formats schemathesis run http://127.0.0.1:30118/openapi.json ...
"""

from __future__ import annotations

import json
import os

import schemathesis
from hypothesis import strategies as st

_PIECES = st.lists(st.sampled_from(["a", "[0-9]+", "(yes|no)", "[a-z]{1,3}", " ", "x?", "\\.", "[A-Z]*"]),
                   min_size=1, max_size=5)
_TYPES = st.sampled_from([{"type": "string"}, {"type": "integer"}, {"type": "boolean"}, {"enum": ["a", "b"]},
                          {"type": "array", "items": {"type": "number"}, "maxItems": 3}])
_SCHEMAS = st.one_of(_TYPES, st.dictionaries(st.from_regex(r"\A[a-z]{1,6}\Z"), _TYPES, min_size=1, max_size=3).map(
    lambda props: {"type": "object", "properties": props, "required": sorted(props)}))

schemathesis.openapi.format("xgrammar-regex", _PIECES.map("".join))
schemathesis.openapi.format("ebnf", _PIECES.map(
    lambda pieces: "root ::= " + " ".join(json.dumps(p) for p in pieces)))
schemathesis.openapi.format("json-schema", _SCHEMAS.map(json.dumps))
schemathesis.openapi.format("structural-tag", st.text("abc ", min_size=1, max_size=8).map(
    lambda text: json.dumps({"type": "structural_tag", "format": {"type": "const_string", "value": text}})))


@schemathesis.hook
def filter_body(context, body) -> bool:
    if not isinstance(body, dict):
        return True
    prompts = next((body[k] for k in ("text", "input_ids", "prompt") if body.get(k) is not None), None)
    batch = prompts if isinstance(prompts, list) and prompts and isinstance(prompts[0], (str, list)) else None
    sampling = body.get("sampling_params")
    if batch is not None and isinstance(sampling, list) and len(sampling) != len(batch):
        return False
    n = body.get("n") if isinstance(body.get("n"), (int, float)) else 1
    return n * len(batch or [prompts]) <= int(os.environ.get("SPEC_QUEUE", 1024))
