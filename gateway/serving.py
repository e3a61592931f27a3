"""What every specsplit gRPC server does the same way: bind, health, reflection, metrics, and
drain on SIGTERM / Ctrl-C (health NOT_SERVING, new streams UNAVAILABLE, live ones finish, exit 0).
"""
from __future__ import annotations

import asyncio
import logging
import signal
from typing import Awaitable, Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gateway.metrics import start_metrics_server

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a batch of dense q rows can be large
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),  # a port in use is an error, not a second listener
]


class Server:
    """A grpc.aio server with health and reflection for `service_names` (full proto names)."""

    def __init__(self, name: str, host: str, port: int, service_names: Iterable[str]):
        self.name = name
        self.host = host
        self.port = port
        self.service_names = list(service_names)
        self.server = grpc.aio.server(options=SERVER_OPTIONS)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            self.service_names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self.server,
        )
        self.draining = False

    async def start(self, metrics_host: str | None = None, metrics_port: int | None = None) -> int:
        address = f"{self.host}:{self.port}"
        try:
            bound = self.server.add_insecure_port(address)
        except RuntimeError as e:
            raise RuntimeError(f"{self.name}: cannot listen on {address} ({e}); is the port in use?") from None
        if not bound:
            raise RuntimeError(f"{self.name}: cannot listen on {address}; is the port in use?")
        self.port = bound
        await self.server.start()
        start_metrics_server(metrics_host or self.host, metrics_port)
        for s in ["", *self.service_names]:
            await self.health.set(s, health_pb2.HealthCheckResponse.SERVING)
        log.info("%s listening on %s:%d (health: SERVING)", self.name, self.host, bound)
        return bound

    async def run_until_signal(self, drain: Callable[[], Awaitable[None]]) -> int:
        """Wait for SIGTERM / SIGINT, then drain: NOT_SERVING, `drain()` (live work finishes), stop."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        signals = (signal.SIGTERM, signal.SIGINT)
        for sig in signals:
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("%s: signal received; draining (health NOT_SERVING, new streams refused)", self.name)
        self.draining = True
        await self.health.enter_graceful_shutdown()
        stop.clear()
        drain_task = asyncio.ensure_future(drain())
        second = asyncio.ensure_future(stop.wait())
        done, _ = await asyncio.wait({drain_task, second}, return_when=asyncio.FIRST_COMPLETED)
        if second in done and not drain_task.done():
            log.warning("%s: second signal; stopping without waiting for live work", self.name)
            drain_task.cancel()
        second.cancel()
        await self.server.stop(grace=1.0)
        for sig in signals:
            loop.remove_signal_handler(sig)
        log.info("%s stopped", self.name)
        return 0


async def wait_until(predicate: Callable[[], bool], timeout: float, poll: float = 0.05) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        if loop.time() >= end:
            return False
        await asyncio.sleep(poll)
    return True


def exit_now(rc: int) -> None:
    """End a service process at once after a clean stop. Everything is stopped, flushed and closed
    by now; this skips only the interpreter's final garbage collection, which takes seconds once
    torch is loaded (and would stretch every drain and every `specsplit up` stop)."""
    import os
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
