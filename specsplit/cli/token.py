"""`specsplit token PATH`: create the internal bearer token once (compose's one-shot `token` service).

Writes 32 random bytes as hex to PATH (mode 0600) unless PATH already holds a token, which is kept:
restarts and re-runs reuse it, so engines and gateway always agree. The engines read it with
--auth-token-file and refuse every session without it; the gateway sends it with
--internal-auth-token-file. `--rotate` replaces an existing token (restart the engines and the
gateway afterwards).
"""
from __future__ import annotations

import os
import secrets
import tempfile
from pathlib import Path


def add_arguments(p, name: str) -> None:
    p.add_argument("path", metavar="PATH", help="the token file (created with mode 0600 if absent or empty)")
    p.add_argument("--rotate", action="store_true", help="replace an existing token")


def validate(args) -> None:
    if not args.path or args.path.endswith("/"):
        raise ValueError(f"PATH must name a file, got {args.path!r}")


def ensure_token(path: str, rotate: bool = False) -> bool:
    """Create the token file unless it holds a token; returns whether a new token was written."""
    p = Path(path)
    if not rotate and p.exists() and p.read_text().strip():
        return False
    p.parent.mkdir(parents=True, exist_ok=True)
    # A fresh, unpredictable temporary name created exclusively (O_EXCL, mode 0600): nobody can
    # plant a link or a file there for us to write through.
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
        os.replace(tmp, p)  # atomic: a reader never sees half a token
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


def run(args) -> int:
    wrote = ensure_token(args.path, args.rotate)
    print(f"{args.path}: {'new token written' if wrote else 'token exists, kept'}")
    return 0
