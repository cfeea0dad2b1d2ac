"""The server process: the application under uvicorn, on one event loop, with SIGTERM (and Ctrl+C) draining it.

uvicorn's own graceful shutdown stops listening and waits for the requests in progress; the service refuses new ones
meanwhile (503) and keeps decoding until every accepted request is answered. uvicorn then raises the signal again, so
that the process dies of it; a drained server is a clean exit here instead (exit code 0).
"""

from __future__ import annotations

import contextlib
import signal
import threading

import uvicorn

from hf_deep_nmt.serving.server.app import Service, build_app


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, telling the service to drain at the first SIGTERM or SIGINT, and not dying of the signal."""

    def __init__(self, config: uvicorn.Config, service: Service):
        super().__init__(config)
        self.service = service

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig, frame) -> None:
        self.service.begin_drain()
        super().handle_exit(sig, frame)


def run_server(service: Service, host: str = "127.0.0.1", port: int = 5000, access_log: bool = False) -> None:
    """Serve `service` on `host`:`port` until SIGTERM or Ctrl+C (a second Ctrl+C stops without waiting); raises the
    warm-up's error when the model could not decode its first batch."""
    config = uvicorn.Config(
        build_app(service),
        host=host,
        port=port,
        access_log=access_log,
        lifespan="on",
        timeout_graceful_shutdown=None,  # every accepted request is answered, by its own deadline at the latest
    )
    server = _DrainingServer(config, service)

    def stop(error: BaseException) -> None:
        server.should_exit = True

    service.on_failure = stop
    server.run()
    if service.failure is not None:
        raise service.failure
