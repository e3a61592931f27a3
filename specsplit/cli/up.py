"""`specsplit up`: drafter, verifier and gateway as three local processes (`--draft none`: the
verifier and the gateway, a split target-only stack).

Starts `python -m specsplit.cli verifier|drafter|gateway ...`, waits until each reports SERVING
over gRPC health, then waits. Ctrl-C / SIGTERM stops the gateway first (it drains its live
streams), then the drafter and the verifier. A verifier or gateway that exits on its own stops the
rest. A drafter that exits on its own is started again on its port after a pause (1 s, doubling
to 30 s while it keeps dying; back to 1 s once one has lived a minute): the gateway decodes
target-only meanwhile and its drafter probe finds the new one, so streams go on and speculation
comes back (a drafter is never needed for the tokens, only for their speed).

Exposure: only the gateway binds --host. The engines bind --engine-host (default 127.0.0.1) and
require an internal token of their own, never the public one: --internal-auth-token-file / -env,
else $SPECSPLIT_INTERNAL_TOKEN, else a random one made for this run (handed to the children in
their environment, never written to disk).
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from specsplit.cli.common import (add_deterministic_flag, add_engine_flags, add_http_flags, add_keepalive_flags,
                                  add_request_size_flag, add_gateway_limit_flags, add_server_flags, add_spec_flags, add_tensor_parallel_flag, port,
                                  spec_config, validate_engine, validate_http, validate_security)


DEFAULT_ENGINE_HOST = "127.0.0.1"
INTERNAL_TOKEN_ENV = "SPECSPLIT_INTERNAL_TOKEN"  # the engines' token, in the children's environment
RESTART_FIRST_S, RESTART_MAX_S, RESTART_STEADY_S = 1.0, 30.0, 60.0  # a dead drafter's restarts (RestartPause)


class RestartPause:
    """How long to wait before starting a process that died again: RESTART_FIRST_S, doubling with
    each death up to RESTART_MAX_S, and RESTART_FIRST_S again once a start has lived
    RESTART_STEADY_S (a crash loop does not spin; a rare crash is mended at once)."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.pause = RESTART_FIRST_S
        self.started = clock()

    def died(self) -> float:
        """The pause before the next start."""
        if self.clock() - self.started >= RESTART_STEADY_S:
            self.pause = RESTART_FIRST_S
        pause, self.pause = self.pause, min(RESTART_MAX_S, 2 * self.pause)
        return pause

    def restarted(self) -> None:
        self.started = self.clock()


def add_arguments(p, name: str) -> None:
    p.add_argument("--target", required=True)
    p.add_argument("--draft", default=None, help="draft model, 'ngram' or MODEL+ngram; omitted: the target's best "
                   "shipped draft (smollm2-135m: smollm2-135m-eagle3+ngram)")
    p.add_argument("--draft-device", default=None)
    p.add_argument("--drafter-port", type=port, default=0,
                   help="drafter port (0 = a free one: the drafter binds it and tells `up`)")
    p.add_argument("--verifier-port", type=port, default=0,
                   help="verifier port (0 = a free one: the verifier binds it and tells `up`)")
    p.add_argument("--addresses-file", default=None, metavar="PATH",
                   help='once all serve, write {"gateway": HOST:PORT, "drafter": ..., "verifier": ...} (JSON; no '
                        '"drafter" with --draft none) to PATH: where a supervisor finds the engines started on free ports')
    p.add_argument("--engine-host", default=DEFAULT_ENGINE_HOST,
                   help="address the drafter and the verifier bind (default %(default)s: only this host reaches "
                        "them, whatever --host the gateway binds; they trust whoever holds the internal token)")
    p.add_argument("--max-queue", type=int, default=64)
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for all three to be SERVING")
    p.add_argument("--drain-timeout", type=float, default=30.0)
    for name in ("verifier", "drafter", "gateway"):
        p.add_argument(f"--{name}-cpus", default=None, metavar="LIST",
                       help=f"pin the {name} process to these CPUs (e.g. 0 or 2-3 or 0,2; default: not pinned); "
                            "with --threads 1, --verifier-cpus 0 --drafter-cpus 1 gives each engine its own core")
    add_engine_flags(p)
    add_spec_flags(p)
    add_tensor_parallel_flag(p)  # the verifier's; the drafter stays at 1
    add_deterministic_flag(p)
    add_request_size_flag(p)
    add_gateway_limit_flags(p)
    add_keepalive_flags(p)
    add_server_flags(p, 50051)  # with --tls-*, --auth-token-file, --no-reflection: passed to all three
    add_http_flags(p)  # the gateway's
    from specsplit.rpc.security import add_client_security_flags

    # How the gateway (and `up`'s own health checks) reach the drafter and the verifier; the
    # internal token is never the public one (see internal_token).
    add_client_security_flags(p, "internal_", "the drafter and the verifier")


def validate(args) -> None:
    from specsplit.defaults import is_no_draft, resolve_draft

    asked = args.draft
    args.draft = resolve_draft(args.target, args.draft, getattr(args, "tensor_parallel_size", 1))
    if args.draft is None and not is_no_draft(asked):
        raise ValueError(f"{args.target!r} has no default draft: give --draft MODEL (or ngram), or --draft none "
                         "for a target-only stack (the verifier and the gateway)")
    validate_security(args)
    validate_http(args)
    validate_engine(args)
    for name in ("verifier", "drafter", "gateway"):
        cpu_list(getattr(args, f"{name}_cpus", None), f"--{name}-cpus")


def cpu_list(text: str | None, flag: str = "cpus") -> set[int] | None:
    """'0', '2-3', '0,2-3' -> CPU ids (None: not pinned); ValueError names the flag."""
    if text is None:
        return None
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"{flag} takes CPU ids like 0 or 2-3 or 0,2-3, got {text!r}") from None
    available = os.sched_getaffinity(0)
    if not cpus or not cpus <= available:
        raise ValueError(f"{flag} {text!r}: this process may run on CPUs {sorted(available)}")
    return cpus


def _engine_flags(args, device: str) -> list[str]:
    out = ["--device", device, "--dtype", args.dtype, "--weights", getattr(args, "weights", "native"),
           "--max-model-len", str(args.max_model_len),
           "--max-num-seqs", str(args.max_num_seqs), "--block-size", str(args.block_size),
           "--max-prefill-tokens", str(args.max_prefill_tokens), "--num-blocks", str(args.num_blocks),
           "--prefix-caching" if getattr(args, "prefix_caching", True) else "--no-prefix-caching",
           "--memory-utilization", str(args.memory_utilization), "--threads", str(args.threads)]
    if args.memory_budget is not None:
        out += ["--memory-budget", str(args.memory_budget)]
    return out


def _spec_flags(args) -> list[str]:
    # K decided here from the draft argument, so the gateway need not wait for the drafter to learn it.
    k = spec_config(args, args.draft).num_speculative_tokens
    out = ["--num-speculative-tokens", str(k), "--draft-model-tokens", str(args.draft_model_tokens),
           "--k-policy", args.k_policy, "--suffix-cache-tokens", str(args.suffix_cache_tokens),
           "--suffix-share", args.suffix_share, "--draft-stop", str(args.draft_stop)]
    if getattr(args, "async_draft", None) is not None:  # else the gateway's default (on; off with --tree-nodes)
        out += ["--async-draft" if args.async_draft else "--no-async-draft"]
    if getattr(args, "tree_nodes", 0):
        out += ["--tree-nodes", str(args.tree_nodes)]
    if args.disable_by_batch_size is not None:  # else the gateway picks the default for the verifier's device
        out += ["--disable-by-batch-size", str(args.disable_by_batch_size)]
    return out


def _flag_values(args, names: list[str], prefix: str = "") -> list[str]:
    out = []
    for n in names:
        v = getattr(args, prefix + n, None)
        if v:
            out += ["--" + (prefix + n).replace("_", "-"), str(v)]
    return out


def internal_token(args, environ=os.environ) -> tuple[list[str], dict[str, str]]:
    """The internal token: (the engines' server flags for it, variables to add to the children's
    environment). --internal-auth-token-file / --internal-auth-token-env when given; else
    $SPECSPLIT_INTERNAL_TOKEN; else a random token for this run. Never the public token."""
    if args.internal_auth_token_file:
        return ["--auth-token-file", args.internal_auth_token_file], {}
    if args.internal_auth_token_env:
        return ["--auth-token-env", args.internal_auth_token_env], {}
    token = environ.get(INTERNAL_TOKEN_ENV, "").strip() or secrets.token_hex(32)
    return ["--auth-token-env", INTERNAL_TOKEN_ENV], {INTERNAL_TOKEN_ENV: token}


def internal_security(args):
    """How `up` and its gateway reach the engines: the --internal-* TLS flags and the internal token."""
    from specsplit.rpc.security import ClientSecurity

    sec = ClientSecurity.from_args(args, "internal_")
    if not sec.auth_token_file and not sec.auth_token_env:
        sec = ClientSecurity(sec.tls_ca, sec.tls_cert, sec.tls_key, None, sec.server_name, INTERNAL_TOKEN_ENV)
    return sec


def engine_address(args, port_: int) -> str:
    """Where the gateway and `up` reach an engine bound on --engine-host."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(args.engine_host, args.engine_host)
    return f"[{host}]:{port_}" if ":" in host else f"{host}:{port_}"


def services(args) -> tuple[str, ...]:
    """The children `up` starts, in start order: no drafter for --draft none."""
    return ("verifier", "drafter", "gateway") if args.draft else ("verifier", "gateway")


def commands(args, drafter_port: int, verifier_port: int, port_files: dict[str, str] | None = None) -> dict[str, list[str]]:
    """Each child's command line (services(args) of them). A port of 0 lets that child bind a free
    one; `port_files` (name -> path) tells the children with port 0 where to write it (`up` reads
    it there)."""
    port_files = port_files or {}

    def port_file(name: str, port_: int) -> list[str]:
        return ["--port-file", port_files[name]] if not port_ and name in port_files else []

    base = [sys.executable, "-m", "specsplit.cli", "--log-level", args.log_level]
    tls = _flag_values(args, ["tls_cert", "tls_key", "tls_ca"])
    common = ["--drain-timeout", str(args.drain_timeout), *tls]
    if args.no_reflection:
        common.append("--no-reflection")
    engine_token, _ = internal_token(args, environ={INTERNAL_TOKEN_ENV: "-"})  # the flags only
    engine = ["--host", args.engine_host, *common, *engine_token]
    public = ["--host", args.host, *common, *_flag_values(args, ["auth_token_file", "auth_token_env"])]
    isec = internal_security(args)
    internal = _flag_values(isec, ["tls_ca", "tls_cert", "tls_key", "auth_token_file", "auth_token_env", "server_name"])
    internal = [f.replace("--", "--internal-", 1).replace("server-name", "tls-server-name") if f.startswith("--") else f
                for f in internal]
    gateway_only = ["--keepalive-time", str(args.keepalive_time), "--keepalive-timeout", str(args.keepalive_timeout),
                    "--max-request-bytes", str(args.max_request_bytes), "--stall-timeout", str(args.stall_timeout),
                    "--max-concurrent-rpcs", str(args.max_concurrent_rpcs),
                    "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                    *internal]
    if getattr(args, "http_port", None):
        gateway_only += ["--http-port", str(args.http_port), "--http-limit-concurrency", str(args.http_limit_concurrency),
                         "--tool-call-stream", args.tool_call_stream,
                         *(["--http-host", args.http_host] if args.http_host else [])]

    def metrics(offset: int) -> list[str]:
        return [] if args.metrics_port is None else ["--metrics-port", str(args.metrics_port + offset)]

    drafter = ["--drafter", engine_address(args, drafter_port)] if args.draft else []
    out = {
        "verifier": base + ["verifier", "--model", args.target, "--port", str(verifier_port),
                            *port_file("verifier", verifier_port), *engine,
                            *_engine_flags(args, args.device), *_spec_flags(args), *metrics(1),
                            *(["--tensor-parallel-size", str(args.tensor_parallel_size)]
                              if getattr(args, "tensor_parallel_size", 1) > 1 else []),
                            *(["--deterministic"] if getattr(args, "deterministic", False) else [])],
        "drafter": base + ["drafter", "--model", args.draft, "--port", str(drafter_port),
                           *port_file("drafter", drafter_port), *engine,
                           *_engine_flags(args, args.draft_device or args.device), *_spec_flags(args), *metrics(2)],
        "gateway": base + ["gateway", "--verifier", engine_address(args, verifier_port), *drafter,
                           "--port", str(args.port), *port_file("gateway", args.port),
                           "--max-num-seqs", str(args.max_num_seqs),
                           "--max-queue", str(args.max_queue), *public, *gateway_only, *_spec_flags(args), *metrics(0)],
    }
    return {name: out[name] for name in services(args)}


# The child pins itself, then execs the service (same pid; the affinity survives exec). A
# preexec_fn would do it between fork and exec, but it makes Popen fork() with the at-fork
# handlers this process's gRPC channels registered: once `up` had checked an engine's health,
# starting the next one could deadlock in them (seen: `up` stuck in Popen for its gateway, a
# channel's grpc_shutdown thread alive). Without preexec_fn, Popen uses vfork and runs none.
_PIN = "import os, sys; os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(',')}); os.execv(sys.argv[2], sys.argv[2:])"


def pinned(cmd: list[str], cpus: set[int] | None) -> list[str]:
    """`cmd` started on `cpus` (None: as it is): a short Python that sets its own affinity and
    execs cmd[0] (an absolute path: sys.executable) with cmd's arguments."""
    if cpus is None:
        return cmd
    return [sys.executable, "-c", _PIN, ",".join(str(c) for c in sorted(cpus)), *cmd]


def stop_all(procs: dict[str, subprocess.Popen], timeout: float) -> None:
    """SIGTERM the gateway first (it drains while the engines are still up), then the drafter and
    the verifier together; kill whatever has not exited after `timeout`."""
    from specsplit.rpc.health import stop_processes

    def killing(name: str) -> None:
        print(f"specsplit up: {name} did not stop in {timeout:.0f}s; killing it", file=sys.stderr)

    for group in (("gateway",), ("drafter", "verifier")):
        stop_processes({n: procs[n] for n in group if n in procs}, timeout, on_kill=killing)


def run(args) -> int:
    from specsplit.rpc.health import wait_serving, wait_written
    from specsplit.rpc.security import ClientSecurity
    from specsplit.rpc.serving import write_port_file

    # A child given port 0 binds a free one and writes it to its port file once it serves; `up`
    # reads it there. Ports picked here and handed down could be taken before the child binds
    # them: the engines bind only after their models load (a minute or more).
    ports = {"verifier": args.verifier_port, "drafter": args.drafter_port, "gateway": args.port}
    port_dir = tempfile.mkdtemp(prefix="specsplit-up-")
    port_files = {name: os.path.join(port_dir, f"{name}.port") for name in ports}
    _, token_env = internal_token(args)
    env = {**os.environ, **token_env}
    addresses: dict[str, str] = {}
    stop_requested = []
    # up's own checks are health checks (open without a token): the TLS part of the internal flags only
    i = internal_security(args)
    isec = ClientSecurity(i.tls_ca, i.tls_cert, i.tls_key, None, i.server_name)

    def on_signal(signum, frame):
        stop_requested.append(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    procs: dict[str, subprocess.Popen] = {}
    rc = 0
    try:
        # One at a time: each engine times its own steps at start-up (the K policy's costs), which
        # another process loading a model on the same cores would inflate (measured: the drafter's
        # cost per token 36 ms instead of 4 when it calibrated beside the verifier's start-up).
        # The gateway comes last, told the engines' ports.
        deadline = time.monotonic() + args.startup_timeout

        def start(name: str, again: bool = False) -> None:
            cmd = commands(args, ports["drafter"], ports["verifier"], port_files)[name]
            # Children ignore the terminal's Ctrl-C (own process group): this process forwards it.
            cpus = cpu_list(getattr(args, f"{name}_cpus", None))
            procs[name] = subprocess.Popen(pinned(cmd, cpus), start_new_session=True, env=env)
            where = f"port {ports[name]}" if ports[name] else "a free port"
            print(f"specsplit up: {'restarted' if again else 'started'} {name} (pid {procs[name].pid}) on {where}"
                  + ("" if cpus is None else f", CPUs {sorted(cpus)}"), file=sys.stderr, flush=True)

        for name in services(args):
            if stop_requested:
                break
            start(name)
            if not ports[name]:
                written = wait_written(name, procs[name], port_files[name], max(1.0, deadline - time.monotonic()),
                                       stop_requested=lambda: bool(stop_requested), describe=lambda: "; see its log above")
                if written is None:
                    break
                ports[name] = int(written)
            addresses[name] = engine_address(args, ports[name]) if name != "gateway" else f"{args.host}:{ports[name]}"
            wait_serving({name: (procs[name], addresses[name])}, max(1.0, deadline - time.monotonic()), security=isec,
                         stop_requested=lambda: bool(stop_requested),
                         on_serving=lambda name: print(f"specsplit up: {name} is SERVING on {addresses[name]}",
                                                       file=sys.stderr),
                         describe=lambda: "; see its log above")
        if not stop_requested:
            if args.port_file:
                write_port_file(args.port_file, ports["gateway"])
            if args.addresses_file:
                write_addresses_file(args.addresses_file, addresses)
            print(f"specsplit up: ready; Generate on {addresses['gateway']} (Ctrl-C stops all {len(procs)})",
                  file=sys.stderr, flush=True)
        pause = RestartPause()
        drafter_back_at: float | None = None  # when a drafter that died is started again
        while not stop_requested:
            dead = [n for n, p in procs.items() if p.poll() is not None]
            needed = [n for n in dead if n != "drafter"]
            if needed:
                print(f"specsplit up: {needed[0]} exited with code {procs[needed[0]].returncode}; stopping the others",
                      file=sys.stderr)
                rc = 1
                break
            if dead and drafter_back_at is None:
                wait = pause.died()
                drafter_back_at = time.monotonic() + wait
                print(f"specsplit up: drafter exited with code {procs['drafter'].returncode}; the gateway decodes "
                      f"target-only until it is back; starting it again in {wait:.0f} s", file=sys.stderr, flush=True)
            if drafter_back_at is not None and time.monotonic() >= drafter_back_at:
                start("drafter", again=True)  # on the port it had: the gateway's address for it
                pause.restarted()
                drafter_back_at = None
            time.sleep(0.2)
    except RuntimeError as e:
        print(f"specsplit up: {e}", file=sys.stderr)
        rc = 1
    finally:
        stop_all(procs, args.drain_timeout + 10)
        shutil.rmtree(port_dir, ignore_errors=True)
        for s, h in old.items():
            signal.signal(s, h)
    if stop_requested:
        print("specsplit up: stopped", file=sys.stderr)
    return rc


def write_addresses_file(path: str, addresses: dict[str, str]) -> None:
    """{"gateway": HOST:PORT, "drafter": ..., "verifier": ...} as JSON, written whole: for a
    supervisor or a test that started `up` with free ports."""
    from specsplit.rpc.serving import write_whole

    write_whole(path, json.dumps(addresses), "--addresses-file")
