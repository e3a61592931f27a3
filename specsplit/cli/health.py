"""`specsplit health HOST:PORT`: exit 0 when the service reports SERVING."""
from __future__ import annotations


def add_arguments(p, name: str) -> None:
    p.add_argument("address", metavar="HOST:PORT")
    p.add_argument("--service", default="", help="service name to ask about ('' = the whole server)")
    p.add_argument("--timeout", type=float, default=3.0)
    from gateway.security import add_client_security_flags

    add_client_security_flags(p)


def check(address: str, service: str = "", timeout: float = 3.0, security=None) -> str:
    """The serving status name (SERVING, NOT_SERVING, ...) or 'UNREACHABLE: <why>'.
    `security`: a gateway.security.ClientSecurity for a TLS / mTLS server."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from gateway.security import channel as make_channel

    with make_channel(address, security) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as e:
            return f"UNREACHABLE: {e.code().name}: {e.details()}"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def validate(args) -> None:
    from specsplit.cli.common import check_address

    from gateway.security import ClientSecurity

    check_address("address", args.address)
    ClientSecurity.from_args(args).validate()


def run(args) -> int:
    from gateway.security import ClientSecurity

    status = check(args.address, args.service, args.timeout, ClientSecurity.from_args(args))
    print(f"{args.address}{' ' + args.service if args.service else ''}: {status}")
    return 0 if status == "SERVING" else 1
