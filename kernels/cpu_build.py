"""Compiling the CPU kernels (kernels/cpu/*.cpp) on first use, the one way both loaders do it:
torch's cpp_extension with the ninja pip installed beside the interpreter, cached by torch after the
first build (about 25 s). Where there is no ninja or compiler, or the build fails, `build` returns
None and logs why; the callers fall back to torch's own kernels."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import sys
from pathlib import Path

log = logging.getLogger(__name__)


def _cpuinfo(key: str) -> str | None:
    """The value of the first `key : value` line of /proc/cpuinfo (x86 Linux), or None."""
    try:
        line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith(key))
    except (OSError, StopIteration):
        return None
    return line.split(":", 1)[1].strip() if ":" in line else ""


def cpu_has(*flags: str) -> bool:
    """Whether this CPU has every one of the flags (x86 Linux: /proc/cpuinfo; elsewhere False)."""
    line = _cpuinfo("flags")
    return line is not None and set(flags) <= set(line.split())


def cpu_vendor() -> str:
    """The CPU's vendor_id ("AuthenticAMD", "GenuineIntel"; "" where /proc/cpuinfo has none)."""
    return _cpuinfo("vendor_id") or ""


def build(name: str, source: Path, cflags: list[str], what: str, fallback: str, includes: tuple[Path, ...] = ()):
    """The compiled module `name` from `source`, or None (logged: '<what>: <why>; <fallback>').
    includes: the files `source` #includes from this tree (their text is part of the cache key)."""
    bin_dir = str(Path(sys.executable).parent)  # where pip puts `ninja`
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    if shutil.which("ninja") is None or shutil.which(os.environ.get("CXX", "c++")) is None:
        log.warning("%s: no ninja or C++ compiler; %s", what, fallback)
        return None
    try:
        from torch.utils.cpp_extension import load

        name = build_name(name, source, cflags, includes)
        with build_guard(name):
            return load(name, [str(source)], extra_cflags=cflags, verbose=False)
    except Exception as e:  # a missing header, an old compiler: fall back, say why
        log.warning("%s: build failed (%s); %s", what, e, fallback)
        return None


def build_name(name: str, source: Path, cflags: list[str], includes: tuple[Path, ...] = ()) -> str:
    """The extension's name in torch's build cache: `name` and a digest of the source's path, the
    flags and the text of the source and of the files it includes. Named after what is compiled
    and where it lies: torch keys its build cache by name and rebuilds whenever the path or the
    text under a name changes, so two checkouts (a clone for CI beside a working tree) used to take
    turns rebuilding each other's; now each source version in each place keeps its own build. An
    included file's text is in the digest, or a change to it alone would load the stale build."""
    key = f"{source.resolve()}\0{chr(0).join(cflags)}\0".encode() + b"".join(f.read_bytes() for f in (source, *includes))
    return f"{name}_{hashlib.sha256(key).hexdigest()[:12]}"


@contextlib.contextmanager
def build_guard(name: str):
    """Held while this process loads (and, the first time, compiles) extension `name`: an exclusive
    flock on a file beside torch's build lock, so one process at a time builds it and the others
    wait, then load what it built. The kernel drops a flock when its holder dies, so whoever holds
    it knows no live builder is left: a torch `lock` file found then is the leftover of a build that
    was killed (a cancelled test run), on which torch would wait forever. It is removed.

    Before, a lock was removed only when older than any build (10 minutes), so a run started
    within 10 minutes of a killed one hung (seen: a clean-clone CI run restarted at once)."""
    from torch.utils.cpp_extension import _get_build_directory

    directory = Path(_get_build_directory(name, verbose=False))
    with open(directory / "specsplit.flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            lock = directory / "lock"
            if lock.exists():
                log.warning("removing a build lock left by a killed build: %s", lock)
                lock.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
