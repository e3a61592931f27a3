"""Real service processes on free loopback ports, started and stopped reliably.

Every process is `python -m specsplit.cli ...` with its output in a log file; stop() sends
SIGTERM, waits, and kills on timeout, so a failing test never leaves a process behind.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from specsplit.v1 import common_pb2, drafter_pb2_grpc, gateway_pb2, gateway_pb2_grpc, verifier_pb2_grpc
from specsplit.rpc.health import bindable, ephemeral_low, free_ports

REPO = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
# Small engines: one thread each (2 cores shared), short sequences. --max-prefill-tokens below
# --max-model-len keeps the start-up profile's drafter shape inside max_model_len.
TINY_ENGINE = ["--max-model-len", "256", "--max-prefill-tokens", "128", "--threads", "1"]
# The stacks test speculation at every batch size: the CPU default (speculate only for a lone
# sequence) would switch it off as soon as two requests overlap. A fixture's own value comes later
# on the command line and wins.
SPECULATE_ALWAYS = ["--disable-by-batch-size", "0", "--k-policy", "fixed"]  # tiny drafts cost what the target does: the policy would pick K=0
# A gateway started beside its drafter waits for it (under load a drafter may take tens of seconds
# to start; past --drafter-connect-timeout the gateway would begin target-only and its first
# steps would not speculate).
DRAFTER_JOINS = ["--drafter-connect-timeout", "240"]


def _port_block(worker: str, count: int, ephemeral_low: int) -> range:
    """xdist worker `worker` ('gw3') of `count`: its own block of ports, below the kernel's ephemeral
    range and apart from the other workers' blocks; empty when the range starts too low to leave
    room. A port the kernel picked (bind to 0) was only free when it was picked: before the service
    bound it, another worker's bind to 0 or any process's outgoing connection could take it (a
    colocated server once died on 'Address already in use' for its metrics port in CI). Ports below
    the range are never handed out that way."""
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    count = max(1, count)
    base, top = 20000, min(ephemeral_low, 32768)
    size = min(2000, (top - base) // count)
    if size < 200:
        return range(0)
    start = base + (index % count) * size
    return range(start, start + size)


class _PortPicker:
    """Hands out ports free now and never twice in this process (the kernel may give a closed port
    again at once, and two services started on one once left a gateway's address on a verifier)."""

    def __init__(self, block: range, start: int):
        self.block, self.next = block, start
        self.handed_out: set[int] = set()

    def pick(self) -> int:
        """The next bindable port of the block; one the kernel picks when the block is empty or used up."""
        for _ in range(len(self.block)):
            port = self.block[self.next % len(self.block)]
            self.next += 1
            if port not in self.handed_out and bindable(HOST, port):
                self.handed_out.add(port)
                return port
        port = free_ports(1, HOST, avoid=self.handed_out)[0]
        self.handed_out.add(port)
        return port


# This test process's picker. Two test runs at once on one machine (each with a worker gw0) start at
# different places in the block, and every port is checked by binding it.
_PORTS = _PortPicker(_port_block(os.environ.get("PYTEST_XDIST_WORKER", "gw0"),
                                 int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), ephemeral_low()),
                     start=os.getpid() * 7919)


def free_port() -> int:
    """A port free now and not handed out before in this test process (`_PortPicker`)."""
    return _PORTS.pick()


def health(address: str, timeout: float = 1.0, security=None) -> str:
    from specsplit.cli.health import check

    return check(address, timeout=timeout, security=security)


class ServiceProcess:
    """`env`: extra environment variables; `security`: the specsplit.rpc.security.ClientSecurity its
    health is checked with (a TLS / mTLS server); `module`: what `python -m` runs (the CLI, or a
    test wrapper around it such as tests.helpers.faulty_verifier)."""

    def __init__(self, name: str, argv: list[str], log_dir: Path, port: int | None = None, metrics_port: int | None = None,
                 env: dict[str, str] | None = None, security=None, module: str = "specsplit.cli"):
        self.name = name
        self.module = module
        self.env = dict(env or {})
        self.security = security
        self.metrics_port = metrics_port
        if metrics_port:
            argv = [*argv, "--metrics-port", str(metrics_port)]
        self.argv = argv
        self.port = port
        self.address = f"{HOST}:{port}" if port else None
        self.log_path = Path(log_dir) / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        """Start the process (the constructor does; call again only after stop or kill9)."""
        if self.alive():
            raise RuntimeError(f"{self.name} is already running (pid {self.proc.pid}): stop it before starting it again")
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **self.env)
        log = open(self.log_path, "ab")
        log.write(f"\n==== {' '.join(self.argv)}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", self.module, "--log-level", "INFO", *self.argv],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO, env=env,
        )
        log.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def wait_serving(self, timeout: float = 180.0) -> None:
        from specsplit.rpc.health import wait_serving

        wait_serving({self.name: (self.proc, self.address)}, timeout, security=self.security,
                     describe=lambda: ":\n" + self.log_tail())

    def serving(self, timeout: float = 180.0) -> "ServiceProcess":
        """wait_serving; where it never serves, the process is stopped and the error (with the end of
        its log) raised. Returns self (for fixtures)."""
        try:
            self.wait_serving(timeout)
        except Exception:
            print(self.log_tail(80))
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM, wait, then SIGKILL. Returns the exit code."""
        from specsplit.rpc.health import stop_process

        return None if self.proc is None else stop_process(self.proc, timeout)

    def kill9(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait(10)


@dataclass
class Stack:
    """Some of drafter, verifier, gateway (or one colocated server as 'gateway')."""

    procs: dict[str, ServiceProcess] = field(default_factory=dict)

    def __getitem__(self, name: str) -> ServiceProcess:
        return self.procs[name]

    @property
    def gateway(self) -> str:
        return self.procs["gateway"].address

    @property
    def http_port(self) -> int | None:
        """The gateway's --http-port (the OpenAI-compatible API), if it was given one."""
        argv = self.procs["gateway"].argv
        return int(argv[argv.index("--http-port") + 1]) if "--http-port" in argv else None

    def wait_serving(self, timeout: float = 240.0) -> None:
        for p in self.procs.values():
            p.wait_serving(timeout)

    def ready(self) -> "Stack":
        """Wait until every process is SERVING (printing their logs if one never is); returns self."""
        try:
            self.wait_serving()
        except Exception:
            print(self.logs())
            raise
        return self

    def stop(self) -> dict[str, int | None]:
        codes = {}
        for name in ("gateway", "drafter", "verifier"):
            if name in self.procs:
                codes[name] = self.procs[name].stop()
        return codes

    def logs(self) -> str:
        return "\n".join(f"---- {n}\n{p.log_tail()}" for n, p in self.procs.items())


def start_split(log_dir: Path, target: Path, draft: Path | str | None, max_num_seqs: int = 8, max_queue: int = 32,
                gateway_extra: tuple[str, ...] = (), service_extra: tuple[str, ...] = (),
                verifier_env: dict[str, str] | None = None, security=None,
                verifier_module: str = "specsplit.cli") -> Stack:
    """service_extra: flags for the drafter and the verifier (e.g. --tls-cert ...); security: the
    ClientSecurity the health checks use; verifier_env and verifier_module: e.g. the fault hook
    (tests.helpers.faulty_verifier and its environment)."""
    stack = Stack()
    vport, gport = free_port(), free_port()
    stack.procs["verifier"] = ServiceProcess(
        "verifier", ["verifier", "--model", str(target), "--port", str(vport), "--max-num-seqs", str(max_num_seqs),
                     *TINY_ENGINE, *service_extra], log_dir, vport, free_port(), env=verifier_env, security=security,
        module=verifier_module)
    gw = ["gateway", "--verifier", f"{HOST}:{vport}", "--port", str(gport), "--max-num-seqs", str(max_num_seqs),
          "--max-queue", str(max_queue), "--drain-timeout", "20", "--drafter-timeout", "2",
          *DRAFTER_JOINS, *SPECULATE_ALWAYS,
          *gateway_extra]
    if draft is not None:
        dport = free_port()
        stack.procs["drafter"] = ServiceProcess(
            "drafter", ["drafter", "--model", str(draft), "--port", str(dport), "--max-num-seqs", str(max_num_seqs),
                        *TINY_ENGINE, *service_extra], log_dir, dport, free_port(), security=security)
        gw += ["--drafter", f"{HOST}:{dport}"]
    stack.procs["gateway"] = ServiceProcess("gateway", gw, log_dir, gport, free_port(), security=security)
    return stack


def start_colocated(log_dir: Path, target: Path, draft: Path | str | None, max_num_seqs: int = 8,
                    extra: tuple[str, ...] = ()) -> Stack:
    port = free_port()
    argv = ["serve", "--target", str(target), "--port", str(port), "--max-num-seqs", str(max_num_seqs), *TINY_ENGINE,
            *SPECULATE_ALWAYS, *extra]
    if draft is not None:
        argv += ["--draft", str(draft)]
    return Stack({"gateway": ServiceProcess("colocated", argv, log_dir, port)})


# ---- talking to the services ------------------------------------------------------------------
def request(ids=None, prompt: str = "", max_tokens: int = 16, **kw) -> gateway_pb2.GenerateRequest:
    spec = kw.pop("speculation", None)
    req = gateway_pb2.GenerateRequest(prompt=prompt, prompt_token_ids=ids or [], max_tokens=max_tokens, **kw)
    if spec is not None:
        req.speculation.CopyFrom(spec)
    return req


def generate(address: str, req: gateway_pb2.GenerateRequest, timeout: float = 60.0) -> dict:
    """One stream -> {token_ids, text, finish_reason, usage, messages}."""
    from specsplit.gateway.generate_client import collect

    with grpc.insecure_channel(address) as ch:
        responses = list(gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=timeout))
    out = collect(responses)
    out["messages"] = len(responses)
    return out


def server_info(address: str, timeout: float = 5.0) -> gateway_pb2.ServerInfo:
    with grpc.insecure_channel(address) as ch:
        return gateway_pb2_grpc.GatewayStub(ch).GetServerInfo(gateway_pb2.GetServerInfoRequest(), timeout=timeout)


def service_info(address: str, role: str, timeout: float = 5.0) -> common_pb2.ServiceInfo:
    stub_cls = drafter_pb2_grpc.DrafterStub if role == "drafter" else verifier_pb2_grpc.VerifierStub
    with grpc.insecure_channel(address) as ch:
        return stub_cls(ch).GetInfo(common_pb2.InfoRequest(), timeout=timeout)


def http_call(port: int, path: str, body: dict | None = None, timeout: float = 30.0,
              host: str = "127.0.0.1", token: str | None = None) -> tuple[int, bytes]:
    """(status, body bytes) of a GET, or a POST of `body` as JSON, to an HTTP API on host:port
    (with `token` as the bearer token); an HTTP error status is returned, not raised."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    req = urllib.request.Request(f"http://{host}:{port}{path}", data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_for(predicate, timeout: float, poll: float = 0.02) -> float | None:
    """Seconds until predicate() is true, or None after timeout."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if predicate():
            return time.monotonic() - t0
        time.sleep(poll)
    return None


def scrape(metrics_port: int) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}."""
    from specsplit.rpc.metrics import read_metrics

    return read_metrics(metrics_port, HOST)
