"""The FastAPI application: OpenAI routes (openai_api.py), SGLang's /generate, health, models, metrics
and server info, behind an optional API key."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import os
import time
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from engine.config import ServerArgs
from engine.engine import Engine
from engine.core.sampling_params import SamplingParams
from engine.server import logprobs as lp_format
from engine.server import openai_api, responses_api, tool_calls
from engine.server.bodies import BodyParser
from engine.server.errors import APIError, error_response, error_responses, install_error_handlers
from engine.server.limits import BodyLimit, JSONBodyRoute
from engine.server.protocol import GenerateRequest
from engine.server.serving import Serving, engine_abort, error_event

HEALTH_GENERATE_TIMEOUT_S = 20.0
# At shutdown, what still runs has been aborted: the engine thread ends after its current step.
ENGINE_STOP_S = 5.0
# Liveness probes work without the API key.
OPEN_PATHS = ("/health",)
# Flags that hold filesystem paths: /get_server_info reports their last component, never where the files are.
PATH_FLAGS = ("tokenizer_path", "speculative_draft_model_path", "speculative_token_map")


def create_app(engine: Engine, args: ServerArgs) -> FastAPI:
    serving = Serving(engine, args)
    parser = BodyParser(serving.context_len)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        serving.loop.start()
        yield
        await asyncio.to_thread(serving.loop.stop, ENGINE_STOP_S)
        serving.tokenizer.close()
        parser.close()

    app = FastAPI(title="spec", summary="OpenAI-compatible and SGLang-compatible LLM server with speculative decoding",
                  lifespan=lifespan)
    app.state.serving = serving
    app.state.bodies = parser          # large bodies' parser (JSONBodyRoute)
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_mb=args.max_request_body_mb)
    if serving.api_key:     # added last, so it runs first: no body is read for a client without the key
        app.add_middleware(APIKeyMiddleware, key=serving.api_key)
    app.include_router(openai_api.router)
    app.include_router(responses_api.router)
    app.include_router(_router(serving))
    app.openapi = lambda: app.openapi_schema or _openapi(app, serving)
    return app


def _openapi(app: FastAPI, serving: Serving) -> dict:
    """FastAPI's schema with the statuses this server sends (FastAPI lists 422 for invalid requests,
    which get 400 here; every route may answer 413 and 500, and 401 without the key) and the limits
    it sets at start-up."""
    from fastapi.openapi.utils import get_openapi

    schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
    common = error_responses(413, 500) | (error_responses(401) if serving.api_key else {})
    for path, operations in schema["paths"].items():
        for op in operations.values():
            responses = op["responses"]
            responses.pop("422", None)
            for status, spec in common.items():
                if path not in OPEN_PATHS or status != 401:
                    responses.setdefault(str(status), {"description": spec["description"], "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}})
    for unused in ("HTTPValidationError", "ValidationError"):
        schema["components"]["schemas"].pop(unused, None)
    _served_limits(schema["components"]["schemas"], serving)
    app.openapi_schema = schema
    return schema


def _served_limits(schemas: dict, serving: Serving) -> None:
    """What the request models cannot know: --max-n, the queue, the context length, the vocabulary, and
    whether the chat template takes tools (chat completions and responses alike). The queue bounds
    n x prompts, which a schema cannot state: it says n <= --max-n and prompts <= --max-queued-requests."""
    context, vocab = serving.context_len, serving.engine.model_config.vocab_size
    queue = serving.args.max_queued_requests

    def cap_integers(node, maximum: int) -> None:
        for option in node.get("anyOf", [node]):
            if option.get("type") == "integer":
                option["maximum"] = min(option.get("maximum", maximum), maximum)

    def cap_token_ids(node) -> None:
        for option in node.get("anyOf", [node]):
            items = option.get("items", {})
            if option.get("type") == "array" and items.get("type") == "integer":
                option["maxItems"] = min(option.get("maxItems", context - 1), context - 1)
                items["maximum"] = vocab - 1
            elif option.get("type") == "array":
                cap_token_ids(items)

    def cap_logit_bias(node) -> None:
        for option in node.get("anyOf", [node]):
            if "patternProperties" in option:
                option["patternProperties"] = {_ids_below(vocab): next(iter(option["patternProperties"].values()))}

    def cap_prompts(node) -> None:
        for option in node.get("anyOf", [node]):
            if option.get("type") == "array" and option.get("items", {}).get("type") != "integer":
                option["maxItems"] = min(option.get("maxItems", queue), queue)

    for name in ("ChatCompletionRequest", "CompletionRequest", "SGLangSampling"):
        props = schemas[name]["properties"]
        cap_integers(props["n"], min(serving.args.max_n, queue))
        cap_logit_bias(props["logit_bias"])
    for name, key in (("ChatCompletionRequest", "max_tokens"), ("ChatCompletionRequest", "max_completion_tokens"),
                      ("CompletionRequest", "max_tokens"), ("SGLangSampling", "max_new_tokens"),
                      ("ResponsesRequest", "max_output_tokens")):
        cap_integers(schemas[name]["properties"][key], context)
    for node in (schemas["CompletionRequest"]["properties"]["prompt"], schemas["GenerateRequest"]["properties"]["text"],
                 schemas["GenerateRequest"]["properties"]["input_ids"]):
        cap_prompts(node)
    cap_token_ids(schemas["CompletionRequest"]["properties"]["prompt"])
    cap_token_ids(schemas["GenerateRequest"]["properties"]["input_ids"])
    cap_token_ids(schemas["SGLangSampling"]["properties"]["prediction"])
    cap_token_ids(schemas["SGLangSampling"]["properties"]["reasoning_end"])
    template = getattr(serving.tokenizer.hf, "chat_template", None)
    if tool_calls.tool_format(serving.args.tool_call_parser, template) is None:
        for name in ("ChatCompletionRequest", "ResponsesRequest"):
            props = schemas[name]["properties"]
            props["tools"] = {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}]}
            props["tool_choice"] = {"anyOf": [{"type": "null"}, {"const": "none"}]}


# /generate's errors name sampling parameters where the body holds them.
SAMPLING_NAMES = {f.name: f"sampling_params.{f.name}" for f in dataclasses.fields(SamplingParams)}


def _ids_below(n: int) -> str:
    """A regex for the decimal integers in [0, n), without leading zeros (logit_bias keys: token ids)."""
    top = str(n - 1)
    alternatives = ["0"] + ([f"[1-9][0-9]{{0,{len(top) - 2}}}"] if len(top) > 1 else [])
    for i, digit in enumerate(top):
        low, high = (1 if i == 0 else 0), int(digit) - 1
        rest = len(top) - i - 1
        if high >= low:
            alternatives.append(top[:i] + (f"[{low}-{high}]" if high > low else str(low))
                                + (f"[0-9]{{{rest}}}" if rest else ""))
    alternatives.append(top)
    return f"^({'|'.join(dict.fromkeys(alternatives))})$"


def _router(serving: Serving) -> APIRouter:
    router = APIRouter(route_class=JSONBodyRoute)
    engine = serving.engine
    created = int(time.time())
    static_info = engine.get_server_info()
    static_info |= {"model_path": serving.model_name} | {
        k: os.path.basename(str(static_info[k]).rstrip("/")) for k in PATH_FLAGS if static_info.get(k)}

    def model_card() -> dict:
        return {"id": serving.model_name, "object": "model", "created": created, "owned_by": "spec",
                "root": serving.model_name, "max_model_len": serving.context_len}

    @router.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @router.get("/v1/models/{model:path}", responses=error_responses(404))
    async def retrieve_model(model: str):
        serving.check_model(model)
        return model_card()

    stalled = f"The engine loop has stopped, or has held requests for {serving.loop.stall_s:g} s without progress"

    @router.get("/health", response_class=Response, responses={503: {"description": stalled}})
    async def health():
        """200 while the engine loop runs and makes progress on the requests it holds."""
        return Response(status_code=200 if serving.loop.healthy else 503)

    @router.get("/health_generate", response_class=Response,
                responses={503: {"description": f"No token within {HEALTH_GENERATE_TIMEOUT_S:g} s"}})
    async def health_generate():
        """One greedy token through the whole engine: proves the model loop is making progress."""
        if not serving.loop.healthy:
            return Response(status_code=503)
        bos = serving.tokenizer.hf.bos_token_id
        req = engine.make_request([bos if bos is not None else 0], SamplingParams(max_new_tokens=1, temperature=0.0))
        sub = serving.loop.submit([req])
        try:
            outs = await asyncio.wait_for(sub.wait(), HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            serving.loop.abort(sub.rids)
            return Response(status_code=503)
        return Response(status_code=200 if outs[0]["output_ids"] else 503)

    @router.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return Response(serving.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @router.get("/get_server_info")
    async def get_server_info():
        info = {**static_info, **serving.loop.snapshot, "served_model_name": serving.model_name}
        info.setdefault("avg_spec_accept_length", None)
        return info

    @router.get("/get_model_info")
    async def get_model_info():
        """SGLang's model card: sglang-router names the replicas' model from it."""
        config = engine.model_config
        return {"model_path": serving.model_name, "served_model_name": serving.model_name, "is_generation": True,
                "max_context_length": serving.context_len, "vocab_size": config.vocab_size,
                "model_type": config.model_type, "architectures": getattr(config, "architectures", None)}

    # SGLang's newer names, which sglang-router reads.
    router.add_api_route("/server_info", get_server_info, methods=["GET"], include_in_schema=False)
    router.add_api_route("/model_info", get_model_info, methods=["GET"], include_in_schema=False)

    @router.post("/generate", responses=openai_api.STREAMED | error_responses(400, 503))
    async def generate(body: GenerateRequest, http: HTTPRequest):
        """SGLang's native API: cumulative `text`, `output_ids` and `meta_info` per prompt (and per n)."""
        if (body.text is None) == (body.input_ids is None):
            raise APIError(400, "Pass exactly one of text and input_ids.", param="text")
        single_text = isinstance(body.text, str)
        single_ids = body.input_ids is not None and (not body.input_ids or isinstance(body.input_ids[0], int))
        if body.text is not None:
            texts = [body.text] if single_text else body.text
            serving.check_count(len(texts), "text")
            prompts = await serving.tokenizer.encode(texts)
        else:
            prompts = [list(body.input_ids)] if single_ids else [list(x) for x in body.input_ids]
        # A Predicted Output beside sampling_params (it wins over theirs) is named where the body holds it.
        names = SAMPLING_NAMES | ({"prediction": "prediction"} if body.prediction is not None else {})
        reqs = await serving.make_requests(prompts, body.sampling(), http=http, names=names,
                                           default_max_tokens=SamplingParams.max_new_tokens,
                                           return_logprob=body.return_logprob, top_logprobs_num=body.top_logprobs_num)
        single = (single_text or single_ids) and len(reqs) == 1
        texts = serving.tokenizer if body.return_logprob and body.return_text_in_logprobs else None
        sub = serving.submit(reqs)
        if body.stream:
            return serving.stream(sub, _generate_events(sub, single, texts))
        outs = await serving.wait(sub, http)
        if outs is None:
            return Response(status_code=499)
        for out in outs:
            err = engine_abort(out)
            if err is not None:
                raise err
        outs = [await _with_texts(o, texts) for o in outs]
        return JSONResponse(outs[0] if single else [{**o, "index": i} for i, o in enumerate(outs)])

    return router


async def _with_texts(out: dict, tokenizer) -> dict:
    """The output with token texts in its logprobs, when return_text_in_logprobs asked for them."""
    if tokenizer is None:
        return out
    texts = await lp_format.texts_for(tokenizer, out["meta_info"])
    return {**out, "meta_info": lp_format.with_texts(out["meta_info"], texts)}


async def _generate_events(sub, single: bool, tokenizer):
    async for ready in sub.updates():
        for i in ready:
            err = engine_abort(sub.latest[i])
            if err is not None:
                yield error_event(err)
                return
            out = await _with_texts(sub.latest[i], tokenizer)
            yield out if single else {**out, "index": i}


class APIKeyMiddleware:
    """401 unless the request carries `Authorization: Bearer <key>` (checked before anything else)."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            return await self.app(scope, receive, send)
        response = error_response(401, "Missing or wrong API key: send it as the header "
                                       "'Authorization: Bearer <key>'.", code="invalid_api_key",
                                  headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _authorized(self, scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
        return False
