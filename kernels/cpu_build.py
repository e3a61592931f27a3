"""Compiling the CPU kernels (kernels/cpu/*.cpp) on first use, the one way both loaders do it:
torch's cpp_extension with the ninja pip installed beside the interpreter, cached by torch after the
first build (about 25 s). Where there is no ninja or compiler, or the build fails, `build` returns
None and logs why; the callers fall back to torch's own kernels."""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)


def cpu_has(*flags: str) -> bool:
    """Whether this CPU has every one of the flags (x86 Linux: /proc/cpuinfo; elsewhere False)."""
    try:
        line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return False
    return set(flags) <= set(line.split())


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
        clear_stale_build_lock(name)
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


def clear_stale_build_lock(name: str, max_age_s: float = 600.0) -> None:
    """torch's extension build holds a lock file in its build directory; a process killed while
    compiling leaves it behind, and every later build of that extension then waits on it forever.
    A lock older than any build (about 25 s here) is such a leftover: remove it."""
    from torch.utils.cpp_extension import _get_build_directory

    try:
        lock = Path(_get_build_directory(name, verbose=False)) / "lock"
        if time.time() - lock.stat().st_mtime > max_age_s:
            log.warning("removing a stale build lock left by a killed build: %s", lock)
            lock.unlink()
    except (OSError, RuntimeError):  # no lock (the usual case), or no build directory yet
        pass
