"""Start `specsplit up` (drafter, verifier, gateway as three local processes) as a child process,
wait until all three report SERVING over gRPC health, and stop it on exit.

    with specsplit_up("smollm2-135m", "ngram", max_model_len=1024) as up:
        ...  # Generate on up.address

Used by `make demo` (specsplit.gateway.demo), the split arm of `specsplit bench`, and the end-to-end tests.
Stopping: SIGTERM to `specsplit up` (it drains the gateway, then stops the engines), then kill
after `stop_timeout`; this happens on every exit from the block, an exception included.
"""
from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence


@dataclass
class RunningUp:
    address: str  # the gateway, HOST:PORT
    drafter: str | None  # None: `up --draft none` (no drafter)
    verifier: str
    proc: subprocess.Popen
    log_path: Path | None = None

    @property
    def addresses(self) -> dict[str, str]:
        out = {"gateway": self.address, "drafter": self.drafter, "verifier": self.verifier}
        return {name: a for name, a in out.items() if a is not None}

    def log_tail(self, chars: int = 3000) -> str:
        return _log_tail(self.log_path, chars)


def _log_tail(path: Path | None, chars: int = 3000) -> str:
    if path is None:
        return ""
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def up_command(target: str, draft: str, *, port: int, addresses_file: str | Path, host: str = "127.0.0.1",
               dtype: str | None = None, max_model_len: int | None = None, max_num_seqs: int | None = None,
               num_speculative_tokens: int | None = None, threads: int | None = None, extra: Sequence[str] = (),
               log_level: str = "WARNING") -> list[str]:
    """The `python -m specsplit.cli up ...` command line (the engines on free ports, their
    addresses written to `addresses_file` once all three serve); a None option keeps `up`'s default."""
    cmd = [sys.executable, "-m", "specsplit.cli", "--log-level", log_level, "up", "--target", str(target),
           "--draft", str(draft), "--host", host, "--port", str(port), "--addresses-file", str(addresses_file)]
    for flag, value in (("--dtype", dtype), ("--max-model-len", max_model_len), ("--max-num-seqs", max_num_seqs),
                        ("--num-speculative-tokens", num_speculative_tokens), ("--threads", threads)):
        if value is not None:
            cmd += [flag, str(value)]
    return cmd + [str(f) for f in extra]


def stop(proc: subprocess.Popen, timeout: float = 60.0) -> int | None:
    """SIGTERM, wait up to `timeout`, then kill. Returns the exit code (None if it would not die)."""
    from specsplit.rpc.health import stop_process

    return stop_process(proc, timeout)


@contextmanager
def specsplit_up(target: str, draft: str, *, dtype: str | None = None, max_model_len: int | None = None,
                 max_num_seqs: int | None = None, num_speculative_tokens: int | None = None, threads: int | None = None,
                 extra: Sequence[str] = (), port: int = 0, host: str = "127.0.0.1", log: str | Path | None = None,
                 env: dict[str, str] | None = None, cwd: str | Path | None = None, log_level: str = "WARNING",
                 startup_timeout: float = 600.0, stop_timeout: float = 60.0) -> Iterator[RunningUp]:
    """Run `specsplit up` for the duration of the block; yields once drafter, verifier and gateway
    are all SERVING (the gateway alone may serve target-only while the drafter still loads).

    Options left None are not passed (`up`'s defaults apply); `extra` is appended as given.
    `port`: the gateway's (0: a free one; the engines always take free ones). `log`: a file for
    the children's output (None: this process's stdout/stderr). `env`: variables added to this
    process's environment.
    Raises RuntimeError when `up` exits, or is not ready within `startup_timeout` seconds."""
    import json
    import tempfile

    from specsplit.rpc.health import wait_written

    log_path = Path(log) if log is not None else None
    with tempfile.TemporaryDirectory(prefix="specsplit-launch-") as tmp:
        # `up` writes the three addresses once all three serve. The engines (and, with port 0, the
        # gateway) bind free ports of their own choosing: no port is picked here that something
        # else could take before the service binds it.
        addresses_file = os.path.join(tmp, "addresses.json")
        cmd = up_command(target, draft, port=port, addresses_file=addresses_file, host=host, dtype=dtype,
                         max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                         num_speculative_tokens=num_speculative_tokens, threads=threads, extra=extra, log_level=log_level)
        log_file = open(log_path, "ab") if log_path is not None else None
        try:
            proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT if log_file else None,
                                    stdin=subprocess.DEVNULL, cwd=cwd, env={**os.environ, **(env or {})})
        except BaseException:
            if log_file is not None:
                log_file.close()
            raise
        try:
            def tail() -> str:
                return f"; its log ({log_path}) ends:\n{_log_tail(log_path)}" if log_path else ""

            # All three are children of `up`'s process: it is the one this process sees exit.
            try:
                written = wait_written("specsplit up", proc, addresses_file, startup_timeout, describe=tail)
            except RuntimeError as e:
                raise RuntimeError(f"specsplit up: {e}") from None
            a = json.loads(written)
            yield RunningUp(a["gateway"], a.get("drafter"), a["verifier"], proc, log_path)
        finally:
            stop(proc, stop_timeout)
            if log_file is not None:
                log_file.close()
