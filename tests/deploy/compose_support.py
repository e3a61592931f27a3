"""Reading compose.yaml the way `docker compose` does, as far as these tests need, without Docker.

No Docker engine (nor the compose plugin) runs where the tests run, so this module does the three
steps of `docker compose config` that matter here: YAML with anchors and merge keys (PyYAML),
variable interpolation as the Compose Specification defines it, and access helpers for services.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "compose.yaml"
DOCKERFILE = REPO / "Dockerfile"
SCHEMA_FILE = Path(__file__).resolve().parent / "schemas" / "compose-spec.json"

# Environments the compose file must work under: the defaults, and the overrides docs/deployment.md
# tells users to set. Each is checked for schema validity, CLI validity and consistency.
SCENARIOS: dict[str, dict[str, str]] = {
    "defaults (split GPUs)": {},
    "one GPU": {
        "DRAFTER_GPU": "0",
        "VERIFIER_GPU": "0",
        "DRAFTER_MEMORY_UTILIZATION": "0.15",
        "VERIFIER_MEMORY_UTILIZATION": "0.75",
    },
    "GPUs 2 and 3, n-gram draft, fp16": {
        "DRAFTER_GPU": "2",
        "VERIFIER_GPU": "3",
        "COLOCATED_GPU": "2",
        "DRAFT_MODEL": "ngram",
        "DTYPE": "fp16",
        "GATEWAY_PORT": "8443",
    },
    "CPU image tag, custom models": {
        "SPECSPLIT_IMAGE": "registry.example/specsplit:0.1.0",
        "TORCH_VARIANT": "cpu",
        "TARGET_MODEL": "/models/my-target",
        "DRAFT_MODEL": "/models/my-draft.gguf",
        "MAX_MODEL_LEN": "4096",
        "MAX_NUM_SEQS": "8",
    },
}


# ---- interpolation -------------------------------------------------------------------------------

class InterpolationError(ValueError):
    pass


_VAR = re.compile(
    r"""\$(?:
        (?P<escaped>\$)                                   # $$ -> a literal $
      | (?P<plain>[A-Za-z_][A-Za-z0-9_]*)                 # $VAR
      | \{(?P<name>[A-Za-z_][A-Za-z0-9_]*)                # ${VAR ...
          (?:(?P<op>:-|-|:\?|\?|:\+|\+)(?P<arg>[^{}$]*))? #   :-default -default :?err ?err :+alt +alt
        \}
      | (?P<invalid>)                                     # any other $ is an error
    )""",
    re.VERBOSE,
)


def interpolate_str(text: str, env: Mapping[str, str]) -> str:
    """Compose-style interpolation of one string (nested defaults are not supported: not used)."""

    def one(m: re.Match) -> str:
        if m.group("escaped") is not None:
            return "$"
        if m.group("plain") is not None:
            return env.get(m.group("plain"), "")
        if m.group("name") is None:
            raise InterpolationError(f"invalid interpolation at {text[m.start():m.start() + 20]!r} in {text!r}")
        name, op, arg = m.group("name"), m.group("op"), m.group("arg") or ""
        value = env.get(name)
        unset_or_empty = value is None or value == ""
        if op is None:
            return value or ""
        if op == ":-":
            return arg if unset_or_empty else value
        if op == "-":
            return arg if value is None else value
        if op == ":?":
            if unset_or_empty:
                raise InterpolationError(f"required variable {name} is missing: {arg}")
            return value
        if op == "?":
            if value is None:
                raise InterpolationError(f"required variable {name} is missing: {arg}")
            return value
        if op == ":+":
            return "" if unset_or_empty else arg
        return "" if value is None else arg  # "+"

    return _VAR.sub(one, text)


def interpolate(node: Any, env: Mapping[str, str]) -> Any:
    """Interpolate every string value (not keys) of a loaded compose document."""
    if isinstance(node, str):
        return interpolate_str(node, env)
    if isinstance(node, list):
        return [interpolate(v, env) for v in node]
    if isinstance(node, dict):
        return {k: interpolate(v, env) for k, v in node.items()}
    return node


def variables_without_default(text: str) -> list[str]:
    """Variables that `docker compose` would silently replace with '' when unset."""
    out = []
    for m in _VAR.finditer(text):
        if m.group("plain") is not None:
            out.append(m.group("plain"))
        elif m.group("name") is not None and m.group("op") not in (":-", "-", ":?", "?"):
            out.append(m.group("name"))
    return out


# ---- loading -------------------------------------------------------------------------------------

def raw_text() -> str:
    return COMPOSE_FILE.read_text()


def load_raw() -> dict:
    return yaml.safe_load(raw_text())


def load(env: Mapping[str, str] | None = None) -> dict:
    """compose.yaml as `docker compose config` would see it with only `env` set."""
    return interpolate(load_raw(), dict(env or {}))


# ---- services ------------------------------------------------------------------------------------

IMAGE_ENTRYPOINT = ["specsplit"]  # the Dockerfile's ENTRYPOINT (tests/deploy/test_dockerfile_*.py)


def as_argv(value: Any) -> list[str]:
    """A compose `command` / healthcheck test in list or string form -> argv."""
    if value is None:
        return []
    if isinstance(value, str):
        return shlex.split(value)
    return [str(v) for v in value]


def service_argv(service: dict) -> list[str]:
    """The full argv the container runs: entrypoint (the image's unless overridden) + command."""
    entrypoint = as_argv(service["entrypoint"]) if "entrypoint" in service else IMAGE_ENTRYPOINT
    return entrypoint + as_argv(service.get("command"))


def healthcheck_argv(service: dict) -> list[str]:
    test = service["healthcheck"]["test"]
    if isinstance(test, str):
        return shlex.split(test)  # string form runs under a shell, like CMD-SHELL
    kind, *rest = test
    if kind == "CMD":
        return list(rest)
    if kind == "CMD-SHELL":
        return shlex.split(" ".join(rest))
    raise AssertionError(f"healthcheck test must start with CMD or CMD-SHELL, got {kind!r}")


@dataclass(frozen=True)
class CliResult:
    code: int
    out: str


def run_cli(argv: list[str]) -> CliResult:
    """`specsplit ARGV`, in this process (import once, no model is loaded with --check)."""
    from specsplit.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            code = main(list(argv))
        except SystemExit as e:  # argparse errors exit 2 with the usage message
            code = e.code if isinstance(e.code, int) else 1
    return CliResult(int(code or 0), buf.getvalue())


# The internal bearer token lives in a volume that exists only in the containers; --check reads
# token files, so command lines naming it are checked against a real temporary token instead.
INTERNAL_TOKEN = "/run/specsplit/internal-token"
_local_token: str | None = None


def local_token_path() -> str:
    global _local_token
    if _local_token is None:
        import tempfile

        d = tempfile.mkdtemp(prefix="specsplit-token-")
        _local_token = str(Path(d) / "internal-token")
        Path(_local_token).write_text("0123456789abcdef" * 4 + "\n")
    return _local_token


def with_local_token(argv: list[str]) -> list[str]:
    return [a.replace(INTERNAL_TOKEN, local_token_path()) for a in argv]


# The public token compose passes to the gateway in this variable (the operator sets it).
API_TOKEN_ENV = "SPECSPLIT_API_TOKEN"


def specsplit_check(argv: list[str]) -> CliResult:
    """Run a `specsplit ...` argv (argv[0] == 'specsplit') with --check appended, with the public
    token variable set as the operator must."""
    assert argv and argv[0] == "specsplit", f"not a specsplit command line: {argv}"
    saved = os.environ.get(API_TOKEN_ENV)
    os.environ[API_TOKEN_ENV] = "fedcba9876543210" * 4
    try:
        return run_cli(with_local_token(argv[1:]) + ["--check"])
    finally:
        if saved is None:
            del os.environ[API_TOKEN_ENV]
        else:
            os.environ[API_TOKEN_ENV] = saved


def parse_cli(argv: list[str]):
    """The argparse namespace of a `specsplit ...` argv (argv[0] == 'specsplit')."""
    from specsplit.cli import build_parser

    assert argv and argv[0] == "specsplit", f"not a specsplit command line: {argv}"
    return build_parser().parse_args(argv[1:])


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    assert sep and host and port.isdigit(), f"expected HOST:PORT, got {address!r}"
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class PortMapping:
    host_ip: str | None
    published: str | None
    target: int
    protocol: str


def parse_port(entry: Any) -> PortMapping:
    """Short ("[IP:][HOST:]CONTAINER[/PROTO]") or long ({target, published, ...}) port syntax."""
    if isinstance(entry, dict):
        return PortMapping(entry.get("host_ip"), str(entry.get("published")) if entry.get("published") else None,
                           int(entry["target"]), entry.get("protocol", "tcp"))
    text = str(entry)
    text, _, proto = text.partition("/")
    parts = text.rsplit(":", 2)
    target = int(parts[-1])
    published = parts[-2] if len(parts) >= 2 else None
    host_ip = parts[-3] if len(parts) == 3 else None
    return PortMapping(host_ip, published or None, target, proto or "tcp")


def gpu_reservations(service: dict) -> list[dict]:
    devices = (((service.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices") or []
    return list(devices)
