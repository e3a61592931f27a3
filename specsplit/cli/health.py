"""`specsplit health HOST:PORT`: exit 0 when the service reports SERVING."""
from __future__ import annotations

from specsplit.rpc.health import check  # noqa: F401  (re-exported: tests and callers use specsplit.cli.health.check)


def add_arguments(p, name: str) -> None:
    p.add_argument("address", metavar="HOST:PORT")
    p.add_argument("--service", default="", help="service name to ask about ('' = the whole server)")
    p.add_argument("--timeout", type=float, default=3.0)
    from specsplit.rpc.security import add_client_security_flags

    add_client_security_flags(p)


def validate(args) -> None:
    from specsplit.cli.common import check_address

    from specsplit.rpc.security import ClientSecurity

    check_address("address", args.address)
    ClientSecurity.from_args(args).validate()


def run(args) -> int:
    from specsplit.rpc.security import ClientSecurity

    status = check(args.address, args.service, args.timeout, ClientSecurity.from_args(args))
    print(f"{args.address}{' ' + args.service if args.service else ''}: {status}")
    return 0 if status == "SERVING" else 1
