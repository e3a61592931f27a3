"""The HTTP API's app (gateway/http_api.py) served on loopback from an event loop on a thread of
its own, for tests that drive it with a scripted scheduler."""
from __future__ import annotations

import asyncio
import threading
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def serving(servicer, model: str) -> Iterator:
    """HttpServer(create_app(HttpBackend(servicer, model))) on 127.0.0.1, a free port (`.port`),
    for the duration of the block; stopped, and its loop closed, after it."""
    from specsplit.gateway.http_api import HttpBackend, HttpServer, create_app

    http = HttpServer(create_app(HttpBackend(servicer, model)), "127.0.0.1", 0)
    loop = asyncio.new_event_loop()
    started = threading.Event()

    def run():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(http.start())
        started.set()
        loop.run_forever()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert started.wait(10), "the HTTP server did not start within 10 s"
    try:
        yield http
    finally:
        asyncio.run_coroutine_threadsafe(http.stop(), loop).result(15)
        loop.call_soon_threadsafe(loop.stop)
        t.join(5)
