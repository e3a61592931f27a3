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
    drafter: str
    verifier: str
    proc: subprocess.Popen
    log_path: Path | None = None

    @property
    def addresses(self) -> dict[str, str]:
        return {"gateway": self.address, "drafter": self.drafter, "verifier": self.verifier}

    def log_tail(self, chars: int = 3000) -> str:
        if self.log_path is None:
            return ""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def up_command(target: str, draft: str, *, port: int, drafter_port: int, verifier_port: int, host: str = "127.0.0.1",
               dtype: str | None = None, max_model_len: int | None = None, max_num_seqs: int | None = None,
               num_speculative_tokens: int | None = None, threads: int | None = None, extra: Sequence[str] = (),
               log_level: str = "WARNING") -> list[str]:
    """The `python -m specsplit.cli up ...` command line; a None option keeps `up`'s default."""
    cmd = [sys.executable, "-m", "specsplit.cli", "--log-level", log_level, "up", "--target", str(target),
           "--draft", str(draft), "--host", host, "--port", str(port), "--drafter-port", str(drafter_port),
           "--verifier-port", str(verifier_port)]
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
    `port` 0 picks free ports. `log`: a file for the children's output (None: this process's
    stdout/stderr). `env`: variables added to this process's environment.
    Raises RuntimeError when `up` exits, or is not ready within `startup_timeout` seconds."""
    from specsplit.rpc.health import free_ports, wait_serving

    engine_host = "127.0.0.1"  # `up` binds the engines on loopback (--engine-host), whatever --host is
    port = port or free_ports(1, host)[0]
    dport, vport = free_ports(2, engine_host, avoid=[port])
    cmd = up_command(target, draft, port=port, drafter_port=dport, verifier_port=vport, host=host, dtype=dtype,
                     max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                     num_speculative_tokens=num_speculative_tokens, threads=threads, extra=extra, log_level=log_level)
    log_file = open(log, "ab") if log is not None else None
    try:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT if log_file else None,
                                stdin=subprocess.DEVNULL, cwd=cwd, env={**os.environ, **(env or {})})
    except BaseException:
        if log_file is not None:
            log_file.close()
        raise
    up = RunningUp(f"{host}:{port}", f"{engine_host}:{dport}", f"{engine_host}:{vport}", proc, Path(log) if log is not None else None)
    try:
        def tail() -> str:
            return f"; its log ({up.log_path}) ends:\n{up.log_tail()}" if up.log_path else ""

        # All three are children of `up`'s process: it is the one this process sees exit.
        try:
            wait_serving({name: (proc, address) for name, address in up.addresses.items()}, startup_timeout,
                         describe=tail)
        except RuntimeError as e:
            raise RuntimeError(f"specsplit up: {e}") from None
        yield up
    finally:
        stop(proc, stop_timeout)
        if log_file is not None:
            log_file.close()
