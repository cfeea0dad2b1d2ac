"""The server as an ASGI application: a `Service` (the model behind its batching queue, the limits, the metrics and
the server's state) and `build_app`, the Starlette application that speaks HTTP for it.

Routes: `POST /translate` (LibreTranslate's), `GET /languages` (LibreTranslate's: the pair this model translates),
`GET /health` (200 once the model is loaded and a warm-up batch decoded; 503 while loading, draining or failed),
`GET /metrics` (Prometheus' text format) and `GET /`, a page to type a sentence into. Every error is JSON,
`{"error": "..."}`, as LibreTranslate's are. With an API key, `/translate` and `/metrics` want it (the body's
`api_key`, LibreTranslate's way, or an `Authorization: Bearer` header); `/health` and the page do not.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hmac
import logging
import time
from importlib.resources import files

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from hf_deep_nmt.serving.decoder import Decoder
from hf_deep_nmt.serving.options import DecodingOptions
from hf_deep_nmt.serving.server.batching import Batcher
from hf_deep_nmt.serving.server.limits import RequestError, ServerLimits, parse_body, read_request
from hf_deep_nmt.serving.server.metrics import Metrics
from hf_deep_nmt.serving.server.sentences import join_sentences, split_sentences
from hf_deep_nmt.serving.translate import encode_sentences

logger = logging.getLogger(__name__)
WARM_UP_TEXT = "Hello world."


class Service:
    """One model served: `decoder` and its `tokenizer` behind a `Batcher`, the server's decoding `options` (a request
    may lower its output cap and choose its beams within `limits`), the `languages` it translates ((source, target);
    None: any pair asked is taken) and the `api_key` requests must carry (None: none). `state` is `loading` until the
    warm-up batch is decoded, then `ready`; `draining` once the server is told to stop; `failed` when the warm-up
    failed (`failure`, and `on_failure` is called)."""

    def __init__(
        self,
        decoder: Decoder,
        tokenizer,
        options: DecodingOptions,
        limits: ServerLimits | None = None,
        *,
        backend: str = "torch",
        model: str = "",
        languages: tuple[str, str] | None = None,
        api_key: str | None = None,
    ):
        self.decoder, self.options, self.limits = decoder, options, limits or ServerLimits()
        self.backend, self.model, self.languages, self.api_key = backend, model, languages, api_key
        # Requests are tokenized on the event loop while the decoding thread pads and decodes: a fast tokenizer is
        # one Rust object that refuses a second thread's use ("Already borrowed"), so each thread has its own.
        self.request_tokenizer = copy.deepcopy(tokenizer)
        self.metrics = Metrics()
        self.batcher = Batcher(decoder, tokenizer, self.limits, self.metrics)
        self.state, self.failure, self.on_failure = "loading", None, None
        self._checked: set[DecodingOptions] = set()
        self._warming: asyncio.Task | None = None

    async def start(self) -> None:
        """Begin the warm-up; the server answers (health: 503) meanwhile, and queues what it is asked."""
        self._warming = asyncio.create_task(self._warm_up(), name="hf-deep-nmt-warm-up")

    async def _warm_up(self) -> None:
        try:
            self.check_options(self.options)
            ids = self.request_tokenizer(WARM_UP_TEXT, verbose=False)["input_ids"]
            await self.batcher.warm_up(ids, self.options)
        except Exception as error:
            logger.error("The warm-up batch failed: %s", error)
            self.state, self.failure = "failed", error
            self.batcher.fail_pending(error)
            if self.on_failure is not None:
                self.on_failure(error)
            return
        self.batcher.start()
        if self.state == "loading":
            self.state = "ready"
            self.metrics.ready.set(1)

    async def stop(self) -> None:
        if self._warming is not None and not self._warming.done():
            self._warming.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._warming
        await self.batcher.stop()

    def begin_drain(self) -> None:
        """Refuse new requests (503); those accepted are still answered."""
        if self.state != "failed":
            self.state = "draining"
        self.metrics.ready.set(0)

    def check_key(self, authorization: str | None, body_key=None) -> None:
        """403 unless the request carries the API key (when the server has one)."""
        if self.api_key is None:
            return
        given = body_key if isinstance(body_key, str) else None
        if authorization and authorization[:7].lower() == "bearer ":
            given = authorization[7:].strip()
        if given is None or not hmac.compare_digest(given.encode(), self.api_key.encode()):
            raise RequestError(
                403, "unauthorized", "Invalid or missing API key: send it as `api_key`, or as `Authorization: Bearer`."
            )

    def check_options(self, options: DecodingOptions) -> None:
        """The decoder's own refusal of `options` (422), asked once per distinct options."""
        if options not in self._checked:
            try:
                self.decoder.check(self.request_tokenizer, options)
            except ValueError as error:
                raise RequestError(422, "malformed", str(error)) from None
            self._checked.add(options)

    async def translate(self, body: bytes, content_type: str = "application/json", authorization: str | None = None):
        """The answer to one `POST /translate` body, or `RequestError`."""
        arrived = asyncio.get_running_loop().time()
        if self.state in ("draining", "failed"):
            raise RequestError(503, "draining", "The server is shutting down; send the request again elsewhere.")
        payload = parse_body(body, content_type)
        self.check_key(authorization, payload.get("api_key"))
        request = read_request(payload, self.limits, self.options, self.languages)
        pieces = [split_sentences(text) for text in request.texts]
        sentences = [sentence for found, _ in pieces for sentence in found]
        if len(sentences) > self.limits.max_sentences:
            raise RequestError(
                413,
                "too_many_sentences",
                f"The request holds {len(sentences)} sentences, over this server's limit of "
                f"{self.limits.max_sentences} (--max-sentences); send them in several requests.",
            )
        self.check_options(request.options)
        try:
            encoded = encode_sentences(self.request_tokenizer, sentences, request.options)
        except ValueError as error:
            raise RequestError(413, "sentence_too_long", str(error)) from None
        futures = self.batcher.submit([encoded[index] for index in range(len(sentences))], request.options)
        texts = await self._answers(futures, arrived)
        translations, start = [], 0
        for found, gaps in pieces:
            translations.append(join_sentences(texts[start : start + len(found)], gaps))
            start += len(found)
        answer = {"translatedText": translations[0] if request.single else translations}
        if request.source == "auto" and self.languages is not None:
            answer["detectedLanguage"] = {"confidence": 100.0, "language": self.languages[0]}
        return answer

    async def _answers(self, futures: list[asyncio.Future], arrived: float) -> list[str]:
        """The translations of one request's sentences, by its deadline (504 past it; queued ones are dropped)."""
        left = arrived + self.limits.timeout_s - asyncio.get_running_loop().time()
        try:
            results = await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), max(left, 0.0))
        except TimeoutError:
            raise RequestError(
                504,
                "deadline",
                f"No translation within {self.limits.timeout_s:g} s (--timeout-s): the server is busy; try again "
                "later, or with fewer sentences.",
            ) from None
        for result in results:
            if isinstance(result, asyncio.CancelledError):
                raise RequestError(503, "draining", "The server stopped before translating this request.")
            if isinstance(result, BaseException):
                raise RequestError(500, "decoding", f"Decoding failed: {' '.join(str(result).split())}")
        return results


async def _read_body(request: Request, limit: int) -> bytes:
    """The request's body, refused (413) as soon as it is known to pass `limit` bytes."""
    declared = request.headers.get("content-length", "")
    size, chunks = int(declared) if declared.isdigit() else 0, []
    if size <= limit:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                break
            chunks.append(chunk)
    if size > limit:
        raise RequestError(
            413, "body_too_large", f"The body is over this server's limit of {limit} bytes (--max-body-bytes)."
        )
    return b"".join(chunks)


def _error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _languages(service: Service) -> list[dict]:
    """LibreTranslate's `/languages`: each source language, with the targets it is translated into."""
    if service.languages is None:
        return []
    source, target = service.languages
    return [{"code": source, "name": source, "targets": [target]}]


def build_app(service: Service) -> Starlette:
    """The Starlette application serving `service`; its lifespan starts and stops the service."""
    page = files(__package__).joinpath("page.html").read_text(encoding="utf-8")
    metrics = service.metrics

    async def translate(request: Request) -> Response:
        started = time.perf_counter()
        metrics.in_progress.inc()
        try:
            body = await _read_body(request, service.limits.max_body_bytes)
            headers = request.headers
            response = JSONResponse(
                await service.translate(body, headers.get("content-type", ""), headers.get("authorization"))
            )
        except RequestError as error:
            metrics.errors.labels(error.kind).inc()
            response = _error(error.status, error.message, error.headers)
        finally:
            metrics.in_progress.dec()
        metrics.requests.labels(str(response.status_code)).inc()
        metrics.latency.observe(time.perf_counter() - started)
        return response

    async def health(request: Request) -> Response:
        status = {"status": service.state, "backend": service.backend, "model": service.model}
        return JSONResponse(status, status_code=200 if service.state == "ready" else 503)

    async def prometheus(request: Request) -> Response:
        try:
            service.check_key(request.headers.get("authorization"))
        except RequestError as error:
            return _error(error.status, error.message)
        return Response(metrics.exposition(), headers={"Content-Type": metrics.content_type})

    async def languages(request: Request) -> Response:
        return JSONResponse(_languages(service))

    async def index(request: Request) -> Response:
        return HTMLResponse(page)

    async def http_error(request: Request, error: HTTPException) -> Response:
        return _error(error.status_code, str(error.detail), getattr(error, "headers", None))

    async def server_error(request: Request, error: Exception) -> Response:
        logger.exception("Unexpected error answering %s", request.url.path)
        return _error(500, f"Unexpected error: {type(error).__name__}: {' '.join(str(error).split())}")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    routes = [
        Route("/", index, methods=["GET"]),
        Route("/translate", translate, methods=["POST"]),
        Route("/languages", languages, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
    ]
    handlers = {HTTPException: http_error, Exception: server_error}
    return Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)
