"""rpc: the gRPC layer that the gateway and both engine services share.

Why a top-level package of its own: `drafter_svc`, `verifier_svc` and `gateway` all speak the same
plumbing (proto <-> dataclass conversion, the engine Session stream, TLS / token / keepalive,
health, drain on SIGTERM, Prometheus metrics), and before this package the two servicers imported
it from `gateway`, so an engine service depended on the public API's package. Putting it under
`specsplit/` was not an option (the engine library never imports grpc), and a subpackage of
`protos/` would mix hand-written code into generated modules. So it sits beside them, one layer
down from the three services and one layer up from the engine library:

    specsplit.cli -> gateway | drafter_svc | verifier_svc -> rpc -> specsplit -> kernels

(checked by the import-linter contracts in pyproject.toml; `make test` runs them). rpc never
imports gateway, drafter_svc, verifier_svc or specsplit.cli.

  wire.py            proto <-> dataclasses of specsplit.protocols, packed rows, exception -> status
  sessions.py        the Session stream of an engine service (worker thread, per-session namespace)
  build.py           build one engine for a service from its flags; its memory plan
  engine_server.py   GetInfo, the start-up log line, serve() with drain
  serving.py         every server's health, reflection, metrics endpoint and SIGTERM drain
  security.py        TLS / mTLS, bearer token, keepalive and message-size limits (server and client)
  health.py          the health probe and free-port helper of `specsplit health`, `up` and tests
  metrics.py         the Prometheus metrics of every service
"""
