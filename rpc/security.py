"""How every specsplit gRPC server and client is built: TLS / mTLS, the bearer token, keepalive
and message-size limits, in one place (the services, the gateway's clients, `specsplit health`
and `generate --server` all come through here).

Server side (`ServerSecurity`, flags from `add_server_security_flags`):
  --tls-cert/--tls-key     serve TLS with this certificate chain and key (PEM)
  --tls-ca                 also require a client certificate signed by this CA (mTLS)
  --auth-token-file        require `authorization: Bearer <token>` on every RPC except
                           grpc.health.v1.Health (left open so load balancers, `docker
                           healthcheck` and `specsplit up` can probe without a secret)
  --auth-token-env VAR     the same, the token read from the environment variable VAR
                           (compose passes a secret this way; `up` its per-run internal token)
  --no-reflection          do not serve grpc.reflection

Client side (`ClientSecurity`): a CA to verify the server (TLS), optionally a client certificate
and key (mTLS), optionally a token file; the gateway takes them as --internal-* flags for its
connections to the drafter and the verifier.

Keepalive: clients ping every `keepalive_time` s (also with no call in flight) and drop the
connection when a ping is not answered within `keepalive_timeout` s, so a frozen peer (SIGSTOP,
a dead host, a silent network) is seen as UNAVAILABLE within keepalive_time + keepalive_timeout.
Servers accept pings as often as every MIN_PING_INTERVAL_S s without data, so a client keepalive
time >= MIN_PING_INTERVAL_S never earns a GOAWAY `too_many_pings`.
"""
from __future__ import annotations

import collections
import hmac
import inspect
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

MAX_INTERNAL_MESSAGE_BYTES = 64 * 1024 * 1024  # drafter/verifier: a batch of dense q rows can be large
MAX_REQUEST_BYTES = 4 * 1024 * 1024  # gateway's public API: a GenerateRequest larger than this is RESOURCE_EXHAUSTED
MIN_PING_INTERVAL_S = 1.0  # servers accept a ping this often without data
SERVER_KEEPALIVE_TIME_S = 30.0  # servers ping idle clients this often (finds dead gateways)
SERVER_KEEPALIVE_TIMEOUT_S = 10.0
DEFAULT_KEEPALIVE_TIME_S = 10.0
DEFAULT_KEEPALIVE_TIMEOUT_S = 5.0
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)  # never need the token


def read_pem(path: str | None) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None


def read_token(path: str | None, env: str | None = None) -> str | None:
    """The token in the file `path`, or in the environment variable `env` (at most one is set)."""
    if path and env:
        raise ValueError("give the token as a file or as an environment variable, not both")
    if env:
        token = os.environ.get(env, "").strip()
        if not token:
            raise ValueError(f"the environment variable {env} (the bearer token) is unset or empty")
        return token
    if not path:
        return None
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"cannot read the token file {path}: {e.strerror}") from None
    if not token:
        raise ValueError(f"the token file {path} is empty")
    return token


# ---- server ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServerSecurity:
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    auth_token_file: str | None = None
    reflection: bool = True
    auth_token_env: str | None = None

    @classmethod
    def from_args(cls, args) -> "ServerSecurity":
        return cls(getattr(args, "tls_cert", None), getattr(args, "tls_key", None), getattr(args, "tls_ca", None),
                   getattr(args, "auth_token_file", None), not getattr(args, "no_reflection", False),
                   getattr(args, "auth_token_env", None))

    def token(self) -> str | None:
        return read_token(self.auth_token_file, self.auth_token_env)

    def validate(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_ca and not self.tls_cert:
            raise ValueError("--tls-ca (mTLS: require client certificates) needs --tls-cert and --tls-key")
        for p in (self.tls_cert, self.tls_key, self.tls_ca):
            read_pem(p)
        self.token()

    def credentials(self) -> grpc.ServerCredentials | None:
        if not self.tls_cert:
            return None
        ca = read_pem(self.tls_ca)
        return grpc.ssl_server_credentials([(read_pem(self.tls_key), read_pem(self.tls_cert))],
                                           root_certificates=ca, require_client_auth=ca is not None)

    def describe(self) -> str:
        tls = "mTLS" if self.tls_ca else ("TLS" if self.tls_cert else "plaintext")
        auth = "bearer token" if self.auth_token_file or self.auth_token_env else "no token"
        return f"{tls}, {auth}, reflection {'on' if self.reflection else 'off'}"


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for any RPC (unary or streaming) without `authorization: Bearer <token>`,
    except the health service."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    def _ok(self, metadata) -> bool:
        for key, value in metadata or ():
            if key == "authorization":
                got = value.encode() if isinstance(value, str) else value
                return hmac.compare_digest(got, self._expected)
        return False

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHOD_PREFIXES) or self._ok(details.invocation_metadata):
            return handler
        missing = not any(k == "authorization" for k, _ in details.invocation_metadata or ())
        message = ("missing bearer token: send metadata 'authorization: Bearer <token>' (--auth-token-file)" if missing
                   else "wrong bearer token")
        log.warning("refused %s: %s", details.method, message)
        return _denying(handler, message)


def _denying(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    async def deny(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny, **kw)
    return grpc.stream_stream_rpc_method_handler(deny, **kw)


class _Undecodable:
    """What a request message that could not be decoded deserializes to (the call then ends)."""

    __slots__ = ("error",)

    def __init__(self, error: Exception):
        self.error = error


def _is_async(handler: grpc.RpcMethodHandler) -> bool:
    """Whether grpc.aio runs the handler on its event loop (every specsplit, health and reflection
    handler does); a sync one (a thread pool's) is left unwrapped."""
    fn = handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
    return inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)


def _wrapped(handler: grpc.RpcMethodHandler, start, request_deserializer=None) -> grpc.RpcMethodHandler:
    """The (async) handler with `await start(request_or_iterator, context)` first: it may abort the
    call, and returns the request (or request iterator) the handler then gets. Responses are left
    alone: a response stream is run the way grpc.aio runs one (an async generator's responses
    written one by one, or a coroutine that writes its own), from this coroutine, so wrapping adds
    no step per response."""
    kw = dict(request_deserializer=request_deserializer or handler.request_deserializer,
              response_serializer=handler.response_serializer)
    if handler.unary_unary or handler.stream_unary:
        inner = handler.unary_unary or handler.stream_unary

        async def unary_response(request, context):
            return await inner(await start(request, context), context)

        make = grpc.unary_unary_rpc_method_handler if handler.unary_unary else grpc.stream_unary_rpc_method_handler
        return make(unary_response, **kw)
    inner = handler.unary_stream or handler.stream_stream
    writes_itself = inspect.iscoroutinefunction(inner)

    async def stream_response(request, context):
        request = await start(request, context)
        if writes_itself:
            await inner(request, context)
            return
        async for response in inner(request, context):
            await context.write(response)

    make = grpc.unary_stream_rpc_method_handler if handler.unary_stream else grpc.stream_stream_rpc_method_handler
    return make(stream_response, **kw)


class UndecodableRequestInterceptor(grpc.aio.ServerInterceptor):
    """INVALID_ARGUMENT, with a message naming the method and the decode error, for a request
    message to a specsplit service that does not decode (most often a string field holding invalid
    UTF-8), where grpc.aio itself would answer UNKNOWN "Unexpected <class DecodeError>" (the sync
    server: INTERNAL "Exception deserializing request!"). Unary requests and every message of a
    request stream (the engines' internal Session streams) alike: the first undecodable message
    ends the call. A message that decodes is handed on as it is, for one type check."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if (handler is None or handler.request_deserializer is None or not details.method.startswith("/specsplit.")
                or not _is_async(handler)):
            return handler
        return _decoding(handler, details.method)


def _decoding(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    deserialize = handler.request_deserializer
    name = method.lstrip("/")

    def safe(data: bytes):
        try:
            return deserialize(data)
        except Exception as e:  # protobuf's DecodeError, whatever its module
            return _Undecodable(e)

    async def refuse(request: _Undecodable, context, what: str) -> None:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"{what} {name} could not be decoded ({request.error}); every string field (prompt, "
                            "messages, stop, request_id, seq_id) must be valid UTF-8")

    if handler.request_streaming:
        async def start(unused_iterator, context):
            # Messages are read here, in place of gRPC's own iterator (left unused), so a good one
            # costs a type check and no extra step.
            return _CheckedRequests(context, refuse)
    else:
        async def start(request, context):
            if type(request) is _Undecodable:
                await refuse(request, context, "the request to")
            return request

    return _wrapped(handler, start, request_deserializer=safe)


class _CheckedRequests:
    """A request stream read from the call's context; an undecodable message ends the call
    INVALID_ARGUMENT (the handler sees the abort where it reads)."""

    __slots__ = ("_context", "_refuse")

    def __init__(self, context, refuse):
        self._context = context
        self._refuse = refuse

    def __aiter__(self):
        return self

    async def __anext__(self):
        message = await self._context.read()
        if message is grpc.aio.EOF:
            raise StopAsyncIteration
        if type(message) is _Undecodable:
            await self._refuse(message, self._context, "a message of the stream")
        return message


class ConcurrentRpcLimit(grpc.aio.ServerInterceptor):
    """At most `limit` calls open at once on this server, every method counted (health checks and
    reflection included, as gRPC's own maximum_concurrent_rpcs counts them: a server this full
    answers its health checks RESOURCE_EXHAUSTED too); past it a call ends RESOURCE_EXHAUSTED
    naming the limit and `flag` before its handler runs. A call counts from when its handler
    starts to when it ends, however it ends (returned, failed, aborted, cancelled by the client,
    past its deadline, the server stopping): the count is given back by the call's done callback,
    which grpc.aio runs when the call's task is done. Calls refused by the token check are not
    counted (they are answered at once). One event loop serves the server: no lock."""

    def __init__(self, limit: int, flag: str = "--max-concurrent-rpcs"):
        if limit <= 0:
            raise ValueError(f"the concurrent RPC limit must be positive, got {limit}")
        self.limit = limit
        self.flag = flag
        self.open = 0

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not _is_async(handler):
            return handler
        return _wrapped(handler, self._start)

    async def _start(self, request, context):
        if self.open >= self.limit:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.open} gRPC calls are open on this server, the most it takes at once "
                                f"({self.flag} {self.limit}); retry later, send the call to another server, or "
                                f"raise {self.flag}")
        self.open += 1
        context.add_done_callback(self._release)
        return request

    def _release(self, unused_context) -> None:
        self.open -= 1


def server_options(max_receive_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", MAX_INTERNAL_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", max_receive_bytes),
        ("grpc.so_reuseport", 0),  # a port in use is an error, not a second listener
        ("grpc.keepalive_time_ms", int(SERVER_KEEPALIVE_TIME_S * 1000)),
        ("grpc.keepalive_timeout_ms", int(SERVER_KEEPALIVE_TIMEOUT_S * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", int(MIN_PING_INTERVAL_S * 1000)),
        ("grpc.http2.max_pings_without_data", 0),
    ]


# gRPC's own maximum_concurrent_rpcs stays on as a backstop this far above ConcurrentRpcLimit's.
# Ours answers with the limit and the flag, but it counts a call only once its handler runs; gRPC
# counts every call from its arrival, so it still bounds what ours never sees: calls whose handler
# has not started (a unary call whose request message has not arrived), calls refused by the token
# check, calls to unknown methods, a sync (thread-pool) handler, which ours leaves unwrapped (none
# on specsplit's servers), and our own refusals while they are being answered. Past
# limit + this, those get gRPC's "Concurrent RPC limit exceeded!".
BACKSTOP_EXTRA_RPCS = 16


def make_server(security: ServerSecurity, max_receive_bytes: int, max_concurrent_rpcs: int | None = None,
                limit_flag: str = "--max-concurrent-rpcs") -> grpc.aio.Server:
    """max_concurrent_rpcs: calls open at once (health included); past it a call is
    RESOURCE_EXHAUSTED naming the limit and `limit_flag` before its handler runs (ConcurrentRpcLimit)."""
    token = security.token()
    interceptors: list[grpc.aio.ServerInterceptor] = [TokenAuthInterceptor(token)] if token else []
    backstop = None
    if max_concurrent_rpcs is not None:
        interceptors.append(ConcurrentRpcLimit(max_concurrent_rpcs, limit_flag))
        backstop = max_concurrent_rpcs + BACKSTOP_EXTRA_RPCS
    interceptors.append(UndecodableRequestInterceptor())
    return grpc.aio.server(options=server_options(max_receive_bytes), interceptors=interceptors,
                           maximum_concurrent_rpcs=backstop)


def add_port(server: grpc.aio.Server, address: str, security: ServerSecurity) -> int:
    creds = security.credentials()
    return server.add_secure_port(address, creds) if creds is not None else server.add_insecure_port(address)


# ---- client ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClientSecurity:
    tls_ca: str | None = None
    tls_cert: str | None = None  # client certificate, for mTLS
    tls_key: str | None = None
    auth_token_file: str | None = None
    server_name: str | None = None  # override the name checked against the server certificate
    auth_token_env: str | None = None  # or the token in this environment variable

    @classmethod
    def from_args(cls, args, prefix: str = "") -> "ClientSecurity":
        def get(name):
            return getattr(args, prefix + name, None)

        return cls(get("tls_ca"), get("tls_cert"), get("tls_key"), get("auth_token_file"), get("tls_server_name"),
                   get("auth_token_env"))

    def token(self) -> str | None:
        return read_token(self.auth_token_file, self.auth_token_env)

    def validate(self, flag_prefix: str = "--") -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError(f"{flag_prefix}tls-cert and {flag_prefix}tls-key go together")
        if self.tls_cert and not self.tls_ca:
            raise ValueError(f"{flag_prefix}tls-cert (a client certificate) needs {flag_prefix}tls-ca")
        for p in (self.tls_ca, self.tls_cert, self.tls_key):
            read_pem(p)
        self.token()


def keepalive_options(time_s: float = DEFAULT_KEEPALIVE_TIME_S, timeout_s: float = DEFAULT_KEEPALIVE_TIMEOUT_S):
    if time_s < MIN_PING_INTERVAL_S:
        raise ValueError(f"keepalive time must be >= {MIN_PING_INTERVAL_S:g}s (servers refuse pings more often)")
    return [
        ("grpc.keepalive_time_ms", int(time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(timeout_s * 1000)),
        # Any ping (a keepalive ping may ride on a flow-control one), not only keepalive ones, must
        # be answered this fast; the default is 60 s, which would hide a frozen peer mid-stream.
        ("grpc.http2.ping_timeout_ms", int(timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


_Details = collections.namedtuple("_Details", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"))


class _TokenClientInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                              grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str):
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, d):
        md = [*(d.metadata or ()), self._header]
        return _Details(d.method, d.timeout, md, d.credentials, d.wait_for_ready, getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


def channel(address: str, security: ClientSecurity | None = None, options=()) -> grpc.Channel:
    """A sync channel: TLS when security.tls_ca is set (mTLS with tls_cert/tls_key), plaintext
    otherwise; the bearer token added to every call when auth_token_file is set."""
    security = security or ClientSecurity()
    options = list(options)
    if security.server_name:
        options.append(("grpc.ssl_target_name_override", security.server_name))
    if security.tls_ca:
        creds = grpc.ssl_channel_credentials(read_pem(security.tls_ca), read_pem(security.tls_key),
                                             read_pem(security.tls_cert))
        ch = grpc.secure_channel(address, creds, options=options)
    else:
        ch = grpc.insecure_channel(address, options=options)
    token = security.token()
    return grpc.intercept_channel(ch, _TokenClientInterceptor(token)) if token else ch


# ---- flags -----------------------------------------------------------------------------------
def add_server_security_flags(p) -> None:
    g = p.add_argument_group("security")
    g.add_argument("--tls-cert", default=None, metavar="PEM", help="serve TLS with this certificate (chain)")
    g.add_argument("--tls-key", default=None, metavar="PEM", help="the certificate's private key")
    g.add_argument("--tls-ca", default=None, metavar="PEM",
                   help="require client certificates signed by this CA (mTLS); needs --tls-cert")
    g.add_argument("--auth-token-file", default=None, metavar="PATH",
                   help="require 'authorization: Bearer <token>' (the file's content) on every RPC but health")
    g.add_argument("--auth-token-env", default=None, metavar="VAR",
                   help="the same, with the token in the environment variable VAR (not with --auth-token-file)")
    g.add_argument("--no-reflection", action="store_true", help="do not serve gRPC server reflection")


def add_client_security_flags(p, prefix: str = "", what: str = "the server") -> None:
    dash = "--" + prefix.replace("_", "-")
    g = p.add_argument_group(f"security ({what})")
    g.add_argument(f"{dash}tls-ca", default=None, metavar="PEM", help=f"connect to {what} over TLS, verified with this CA")
    g.add_argument(f"{dash}tls-cert", default=None, metavar="PEM", help="client certificate (mTLS); needs the CA flag")
    g.add_argument(f"{dash}tls-key", default=None, metavar="PEM", help="the client certificate's private key")
    g.add_argument(f"{dash}tls-server-name", default=None, metavar="NAME",
                   help="name to check the server certificate against (default: the host in the address)")
    g.add_argument(f"{dash}auth-token-file", default=None, metavar="PATH", help=f"send this bearer token to {what}")
    g.add_argument(f"{dash}auth-token-env", default=None, metavar="VAR",
                   help=f"send the bearer token in the environment variable VAR to {what}")
