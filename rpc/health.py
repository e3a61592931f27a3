"""Asking a specsplit server whether it serves (gRPC health), and picking a free local port:
what `specsplit health`, `specsplit up`, the gateway's launcher and the tests share."""
from __future__ import annotations

import socket


def check(address: str, service: str = "", timeout: float = 3.0, security=None) -> str:
    """The serving status name (SERVING, NOT_SERVING, ...) or 'UNREACHABLE: <why>'.
    `security`: a rpc.security.ClientSecurity for a TLS / mTLS server."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from rpc.security import channel as make_channel

    with make_channel(address, security) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as e:
            return f"UNREACHABLE: {e.code().name}: {e.details()}"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
