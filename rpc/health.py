"""Asking a specsplit server whether it serves (gRPC health), picking a free local port, learning
the port a service bound (--port 0 --port-file), waiting for service processes to serve and
stopping them: what `specsplit health`, `specsplit up`, the
gateway's launcher (gateway/launch.py) and the tests (tests/services/procs.py) share."""
from __future__ import annotations

import signal
import socket
import subprocess
import time
from typing import Callable, Iterable, Mapping


# What grpc's C core says when the address answers but not in HTTP/2 (an HTTP/1.x server: ours is
# the OpenAI API's --http-port)
HTTP1_SIGN = "Failed parsing HTTP/2"
HTTP1_HINT = ("that address answers, but not in gRPC's HTTP/2: it looks like an HTTP/1.x port (the "
              "OpenAI-compatible API's --http-port?); gRPC clients take the gateway's --port")


def error_text(e) -> str:
    """'CODE: details' of a failed gRPC call (or str(e) of anything else), with what to change where
    the address answers in HTTP/1.x."""
    text = f"{e.code().name}: {e.details()}" if hasattr(e, "code") and hasattr(e, "details") else str(e)
    return f"{text}; {HTTP1_HINT}" if HTTP1_SIGN in text else text


def check(address: str, service: str = "", timeout: float = 3.0, security=None) -> str:
    """The serving status name (SERVING, NOT_SERVING, ...) or 'UNREACHABLE: <why>'.
    `security`: a specsplit.rpc.security.ClientSecurity for a TLS / mTLS server."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specsplit.rpc.security import channel as make_channel

    with make_channel(address, security) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as e:
            return f"UNREACHABLE: {error_text(e)}"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1", avoid: Iterable[int] = ()) -> list[int]:
    """n distinct ports free now, none in `avoid`: all held open together while they are picked
    (the kernel may hand a just-closed port out again, and two services told one port would
    leave the second unable to bind while the first answers the health checks meant for it)."""
    avoid = set(avoid)
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(s)
            s.bind((host, 0))
            port = s.getsockname()[1]
            if port not in avoid:  # an avoided one stays held too: it cannot come back
                ports.append(port)
        return ports
    finally:
        for s in held:
            s.close()


def ephemeral_low() -> int:
    """The lowest port the kernel hands out by itself (bind to port 0, and the source port of every
    outgoing connection); 32768 where the range cannot be read."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_run(n: int, host: str = "127.0.0.1", low: int = 20000) -> int:
    """The first of n consecutive ports, all bindable now, below the kernel's ephemeral range: what
    to hand `up --metrics-port` (the gateway takes it, the engines the next ones). A port drawn
    from that range (free_ports) can be the very one the kernel then gives an engine that binds
    port 0 (CI once saw a gateway's metrics port taken by its own drafter's gRPC port); these
    never are. Starts at a random place, so two tools at once rarely try the same ports."""
    import random

    top = min(ephemeral_low(), 65536) - n
    if top <= low:
        raise RuntimeError(f"no room for {n} ports below the ephemeral range (it starts at {ephemeral_low()})")
    start = random.randrange(low, top)
    for i in range(top - low):
        first = low + (start - low + i) % (top - low)
        if all(bindable(host, first + j) for j in range(n)):
            return first
    raise RuntimeError(f"no {n} consecutive free ports in [{low}, {top + n})")


def bindable(host: str, port: int) -> bool:
    """Whether `port` on `host` can be bound now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def wait_written(name: str, proc: subprocess.Popen, path: str, timeout: float,
                 stop_requested: Callable[[], bool] = lambda: False, describe: Callable[[], str] = lambda: "") -> str | None:
    """What `proc` writes to `path` once it serves: the port of a service started with --port 0
    --port-file `path` (specsplit.rpc.serving.Server.start), or `up`'s --addresses-file; both are
    written whole (beside, then renamed). RuntimeError when the process exits first or `timeout`
    seconds pass (with `describe()` appended); None when `stop_requested()` first.
    Nothing picks a port for a child and hopes it is still free when the child binds it: a port
    picked that way can be taken meanwhile (by any outgoing connection: the kernel draws those
    from the same range), the longer the more so, and an engine binds only once its model loads."""
    deadline = time.monotonic() + timeout
    while not stop_requested():
        try:
            with open(path) as f:
                text = f.read().strip()
        except FileNotFoundError:
            text = ""
        if text:
            return text
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with code {proc.returncode} during start-up{describe()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} not SERVING after {timeout:.0f}s{describe()}")
        time.sleep(0.1)
    return None


def wait_serving(procs: Mapping[str, tuple[subprocess.Popen, str]], timeout: float, security=None,
                 stop_requested: Callable[[], bool] = lambda: False,
                 on_serving: Callable[[str], None] = lambda name: None, describe: Callable[[], str] = lambda: "") -> None:
    """Wait until every process (name -> (process, HOST:PORT)) reports SERVING; RuntimeError when
    one exits first or `timeout` seconds pass (with `describe()`, e.g. a log tail, appended).
    Returns early, without error, when `stop_requested()`."""
    deadline = time.monotonic() + timeout
    pending = dict(procs)
    while pending and not stop_requested():
        for name, (proc, address) in list(pending.items()):
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode} during start-up{describe()}")
            if check(address, timeout=1.0, security=security) == "SERVING":
                del pending[name]
                on_serving(name)
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"{', '.join(sorted(pending))} not SERVING after {timeout:.0f}s{describe()}")
        if pending:
            time.sleep(0.25)


def stop_processes(procs: Mapping[str, subprocess.Popen], timeout: float,
                   on_kill: Callable[[str], None] = lambda name: None) -> dict[str, int | None]:
    """SIGTERM them all (they drain), wait up to `timeout` seconds together, then SIGKILL the rest.
    Returns each exit code (None for one that would not die even then)."""
    live = {n: p for n, p in procs.items() if p.poll() is None}
    for p in live.values():
        p.send_signal(signal.SIGTERM)
    end = time.monotonic() + timeout
    for name, p in live.items():
        try:
            p.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            on_kill(name)
            p.kill()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
    return {n: p.poll() for n, p in procs.items()}


def stop_process(proc: subprocess.Popen, timeout: float) -> int | None:
    """SIGTERM, wait up to `timeout`, then kill. Returns the exit code (None if it would not die)."""
    return stop_processes({"": proc}, timeout)[""]
