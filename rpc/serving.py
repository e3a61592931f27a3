"""What every specsplit gRPC server does the same way: bind, health, reflection, metrics, and
drain on SIGTERM / Ctrl-C (health NOT_SERVING, new streams UNAVAILABLE, live ones finish, exit 0).
"""
from __future__ import annotations

import asyncio
import logging
import signal
from typing import Awaitable, Callable, Iterable

from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specsplit.rpc import security as sec
from specsplit.rpc.metrics import start_metrics_server

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = sec.MAX_INTERNAL_MESSAGE_BYTES  # a batch of dense q rows can be large
FATAL_GRACE_S = 2.0  # after a fatal failure: NOT_SERVING this long before the process exits


class Server:
    """A grpc.aio server with health and (unless turned off) reflection for `service_names` (full
    proto names); TLS, mTLS, the bearer token and keepalive as specsplit.rpc.security builds them."""

    def __init__(self, name: str, host: str, port: int, service_names: Iterable[str],
                 security: sec.ServerSecurity | None = None, max_receive_bytes: int = MAX_MESSAGE_BYTES,
                 max_concurrent_rpcs: int | None = None):
        self.name = name
        self.host = host
        self.port = port
        self.service_names = list(service_names)
        self.security = security or sec.ServerSecurity()
        self.server = sec.make_server(self.security, max_receive_bytes, max_concurrent_rpcs)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if self.security.reflection:
            reflection.enable_server_reflection(
                self.service_names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
                self.server,
            )
        self.draining = False

    async def start(self, metrics_host: str | None = None, metrics_port: int | None = None,
                    port_file: str | None = None) -> int:
        """Bind, serve, report SERVING; then, with `port_file`, write the bound port there (how a
        supervisor that started this process with --port 0 learns its port, and that it serves)."""
        address = f"{self.host}:{self.port}"
        try:
            bound = sec.add_port(self.server, address, self.security)
        except RuntimeError as e:
            raise RuntimeError(f"{self.name}: cannot listen on {address} ({e}); is the port in use?") from None
        if not bound:
            raise RuntimeError(f"{self.name}: cannot listen on {address}; is the port in use?")
        self.port = bound
        start_metrics_server(metrics_host or self.host, metrics_port)  # before start: a refused port leaves no server running
        await self.server.start()
        for s in ["", *self.service_names]:
            await self.health.set(s, health_pb2.HealthCheckResponse.SERVING)
        log.info("%s listening on %s:%d (%s; health: SERVING)", self.name, self.host, bound, self.security.describe())
        if port_file:
            write_port_file(port_file, bound)
        return bound

    async def run_until_signal(self, drain: Callable[[], Awaitable[None]],
                               fatal: Awaitable[str | None] | None = None) -> int:
        """Wait for SIGTERM / SIGINT, then drain: NOT_SERVING, `drain()` (live work finishes), stop; 0.
        `fatal`: completes with a reason when the service can never serve again (a dead
        tensor-parallel worker): then NOT_SERVING, FATAL_GRACE_S for open streams to end with their
        errors and for health checkers to see it, stop, and 1, so a supervisor restarts the process."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        signals = (signal.SIGTERM, signal.SIGINT)
        for sig in signals:
            loop.add_signal_handler(sig, stop.set)
        signalled = asyncio.ensure_future(stop.wait())
        fatal_task = asyncio.ensure_future(fatal) if fatal is not None else None
        waiting = {signalled} | ({fatal_task} if fatal_task is not None else set())
        reason = None
        while not signalled.done() and not reason:
            done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if fatal_task in done:
                reason = fatal_task.result()  # None: nothing to watch
        for t in waiting:
            t.cancel()
        if reason:
            log.error("%s cannot serve any more (%s): NOT_SERVING, stopping in %.0fs, exit code 1", self.name, reason,
                      FATAL_GRACE_S)
            self.draining = True
            await self.health.enter_graceful_shutdown()
            await asyncio.sleep(FATAL_GRACE_S)
            await self.server.stop(grace=1.0)
            for sig in signals:
                loop.remove_signal_handler(sig)
            return 1
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


def write_whole(path: str, text: str, flag: str) -> None:
    """`text` into `path`, whole or not at all: written beside it, then renamed over it, so a
    reader polling for the file never sees it half written. RuntimeError naming `flag`."""
    import os

    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        raise RuntimeError(f"cannot write {flag} {path} ({e.strerror or e})") from None


def write_port_file(path: str, port: int) -> None:
    """The bound port and a newline, whole (--port-file)."""
    write_whole(path, f"{port}\n", "the bound port to --port-file")


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
