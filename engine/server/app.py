"""The FastAPI application: OpenAI routes (openai_api.py), SGLang's /generate, health, models, metrics
and server info, behind an optional API key."""

from __future__ import annotations

import asyncio
import hmac
import time
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from engine.config import ServerArgs
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from engine.server import openai_api
from engine.server.errors import APIError, error_response, install_error_handlers
from engine.server.protocol import GenerateRequest
from engine.server.serving import Serving

HEALTH_GENERATE_TIMEOUT_S = 20.0
# Liveness probes work without the API key.
OPEN_PATHS = ("/health",)


def create_app(engine: Engine, args: ServerArgs) -> FastAPI:
    serving = Serving(engine, args)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        serving.loop.start()
        yield
        await asyncio.to_thread(serving.loop.stop)

    app = FastAPI(title="spec", summary="OpenAI-compatible and SGLang-compatible LLM server with speculative decoding",
                  lifespan=lifespan)
    app.state.serving = serving
    install_error_handlers(app)
    if serving.api_key:
        app.add_middleware(APIKeyMiddleware, key=serving.api_key)
    app.include_router(openai_api.router)
    app.include_router(_router(serving))
    return app


def _router(serving: Serving) -> APIRouter:
    router = APIRouter()
    engine = serving.engine
    created = int(time.time())
    static_info = engine.get_server_info()

    def model_card() -> dict:
        return {"id": serving.model_name, "object": "model", "created": created, "owned_by": "spec",
                "root": str(engine.model_dir), "max_model_len": serving.context_len}

    @router.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @router.get("/v1/models/{model:path}")
    async def retrieve_model(model: str):
        serving.check_model(model)
        return model_card()

    @router.get("/health")
    async def health():
        return Response(status_code=200 if serving.loop.alive else 503)

    @router.get("/health_generate")
    async def health_generate():
        """One greedy token through the whole engine: proves the model loop is making progress."""
        if not serving.loop.alive:
            return Response(status_code=503)
        bos = serving.tokenizer.bos_token_id
        req = engine.make_request([bos if bos is not None else 0], SamplingParams(max_new_tokens=1, temperature=0.0))
        sub = serving.loop.submit([req])
        try:
            outs = await asyncio.wait_for(sub.wait(), HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            serving.loop.abort(sub.rids)
            return Response(status_code=503)
        return Response(status_code=200 if outs[0]["output_ids"] else 503)

    @router.get("/metrics")
    async def metrics():
        return Response(serving.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @router.get("/get_server_info")
    async def get_server_info():
        info = {**static_info, **serving.loop.snapshot, "served_model_name": serving.model_name}
        info.setdefault("avg_spec_accept_length", None)
        return info

    @router.post("/generate")
    async def generate(body: GenerateRequest, http: HTTPRequest):
        """SGLang's native API: cumulative `text`, `output_ids` and `meta_info` per prompt (and per n)."""
        serving.check_body(body)
        if (body.text is None) == (body.input_ids is None):
            raise APIError(400, "Pass exactly one of text and input_ids.", param="text")
        single_text = isinstance(body.text, str)
        single_ids = body.input_ids is not None and (not body.input_ids or isinstance(body.input_ids[0], int))
        if body.text is not None:
            prompts = [serving.encode(t) for t in ([body.text] if single_text else body.text)]
        else:
            prompts = [list(body.input_ids)] if single_ids else [list(x) for x in body.input_ids]
        reqs = serving.make_requests(prompts, body.sampling_params or {}, max_tokens_param="max_new_tokens",
                                     default_max_tokens=SamplingParams.max_new_tokens)
        single = (single_text or single_ids) and len(reqs) == 1
        sub = serving.submit(reqs)
        if body.stream:
            return serving.stream(sub, _generate_events(sub, single))
        outs = await serving.wait(sub, http)
        if outs is None:
            return Response(status_code=499)
        return JSONResponse(outs[0] if single else [{**o, "index": i} for i, o in enumerate(outs)])

    return router


async def _generate_events(sub, single: bool):
    async for ready in sub.updates():
        for i in ready:
            yield sub.latest[i] if single else {**sub.latest[i], "index": i}


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
