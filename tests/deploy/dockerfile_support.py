"""A small Dockerfile reader: instructions per stage, ARG defaults, `${VAR}` expansion.

Enough for the pin and layout tests; hadolint (test_dockerfile_lint.py) does the real linting.
"""
from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Instruction:
    keyword: str          # upper case: FROM, RUN, ARG, ...
    args: str             # the rest of the (joined) line
    line: int             # 1-based line of the instruction in the file


@dataclass
class Stage:
    name: str | None
    base: str
    instructions: list[Instruction] = field(default_factory=list)

    def args_defaults(self, global_args: dict[str, str], overrides: dict[str, str] | None = None) -> dict[str, str]:
        """The ARG values in effect at the end of the stage (build-arg overrides win)."""
        overrides = overrides or {}
        values: dict[str, str] = {}
        for ins in self.instructions:
            if ins.keyword != "ARG":
                continue
            name, eq, default = ins.args.partition("=")
            name = name.strip()
            if name in overrides:
                values[name] = overrides[name]
            elif eq:
                values[name] = expand(default.strip().strip('"'), values)
            elif name in global_args:  # `ARG NAME` re-declares a global ARG inside the stage
                values[name] = global_args[name]
        return values

    def runs(self) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == "RUN"]


@dataclass
class Dockerfile:
    global_args: dict[str, str]
    stages: list[Stage]

    def stage(self, name: str) -> Stage:
        return next(s for s in self.stages if s.name == name)

    def instructions(self, keyword: str) -> list[Instruction]:
        return [i for s in self.stages for i in s.instructions if i.keyword == keyword]

    def all_arg_names(self) -> set[str]:
        names = set(self.global_args)
        for ins in self.instructions("ARG"):
            names.add(ins.args.partition("=")[0].strip())
        return names


def expand(text: str, values: dict[str, str]) -> str:
    """Dockerfile variable expansion: $VAR, ${VAR}, ${VAR:-default}."""
    def one(m: re.Match) -> str:
        name = m.group(1) or m.group(3)
        default = m.group(2)
        value = values.get(name, "")
        return value if value or default is None else default

    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)", one, text)


def parse(path: Path) -> Dockerfile:
    logical: list[tuple[int, str]] = []
    buf, start = "", 0
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        stripped = raw.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):  # comment lines inside a continued instruction
            continue
        if not buf:
            start = n
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        logical.append((start, buf + stripped))
        buf = ""
    assert not buf, f"{path}: the last instruction ends with a line continuation"

    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line, text in logical:
        keyword, _, args = text.partition(" ")
        ins = Instruction(keyword.upper(), args.strip(), line)
        if ins.keyword == "FROM":
            parts = ins.args.split()
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(name, expand(parts[0], global_args)))
        elif not stages:
            assert ins.keyword == "ARG", f"line {line}: only ARG may come before the first FROM"
            name, _, default = ins.args.partition("=")
            global_args[name.strip()] = default.strip().strip('"')
        else:
            stages[-1].instructions.append(ins)
    return Dockerfile(global_args, stages)


def exec_form(args: str) -> list[str] | None:
    """["a", "b"] -> ['a', 'b']; None when the instruction uses the shell form."""
    try:
        value = json.loads(args)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, list) and all(isinstance(v, str) for v in value) else None


def shell_commands(run_args: str) -> list[list[str]]:
    """A RUN line's shell text split at && ; || into argv lists (quotes respected)."""
    lexer = shlex.shlex(run_args, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    commands, current = [], []
    for token in lexer:
        if token in ("&&", ";", "||", "|", "&"):
            if current:
                commands.append(current)
            current = []
        else:
            current.append(token)
    if current:
        commands.append(current)
    return commands


def pip_installs(run_args: str) -> list[list[str]]:
    """Each `pip install ...` / `python -m pip install ...` in a RUN line, as the argv after 'install'."""
    out = []
    for argv in shell_commands(run_args):
        for i in range(len(argv) - 1):
            if argv[i] in ("pip", "pip3") or argv[i].endswith("/pip") or argv[i:i + 2] == ["-m", "pip"]:
                j = i + 1 if argv[i] != "-m" else i + 2
                if j < len(argv) and argv[j] == "install":
                    out.append(argv[j + 1:])
                break
    return out


_OPTIONS_WITH_VALUE = {"--index-url", "-i", "--extra-index-url", "-f", "--find-links", "-c", "--constraint",
                       "-r", "--requirement", "--target", "-t", "--prefix", "--root", "--platform",
                       "--python-version", "--implementation", "--abi", "--trusted-host", "--progress-bar"}


def pip_requirements(install_argv: list[str]) -> list[str]:
    """The requirement arguments of one pip install argv (options and their values dropped)."""
    reqs, skip = [], False
    for tok in install_argv:
        if skip:
            skip = False
            continue
        if tok.startswith("-"):
            skip = tok in _OPTIONS_WITH_VALUE
            continue
        reqs.append(tok)
    return reqs


# ---- .dockerignore ---------------------------------------------------------------------------------

def _pattern_regex(pattern: str) -> re.Pattern:
    """A .dockerignore pattern (Go filepath.Match plus `**`) as a regex over /-separated paths."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def dockerignore_rules(path: Path) -> list[tuple[bool, re.Pattern]]:
    """(is_exception, regex) per rule, in file order."""
    import os

    rules = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        exception = line.startswith("!")
        line = line[1:] if exception else line
        rules.append((exception, _pattern_regex(os.path.normpath(line).lstrip("/"))))
    return rules


def is_ignored(rel_path: str, rules: list[tuple[bool, re.Pattern]]) -> bool:
    """Docker's rule: a pattern matching the path or any parent excludes it; the last match wins."""
    parts = rel_path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    ignored = False
    for exception, rx in rules:
        if any(rx.match(p) for p in prefixes):
            ignored = not exception
    return ignored


def build_context(repo: Path) -> list[str]:
    """The files `docker build .` would send (relative paths), per the repo's .dockerignore."""
    import os

    rules = dockerignore_rules(repo / ".dockerignore")
    files = []
    for root, dirs, names in os.walk(repo):
        rel_root = os.path.relpath(root, repo)
        # walk into a directory only if it is sent, or an exception rule might bring back part of it
        keep = []
        for d in dirs:
            rel_dir = os.path.normpath(os.path.join(rel_root, d))
            if os.path.islink(os.path.join(root, d)):  # a link is sent as a link (specsplit/gateway -> ../gateway)
                if not is_ignored(rel_dir, rules):
                    files.append(rel_dir)
                continue
            if not is_ignored(rel_dir, rules) or _may_reinclude(rel_dir, rules):
                keep.append(d)
        dirs[:] = keep
        for name in names:
            rel = os.path.normpath(os.path.join(rel_root, name))
            if not is_ignored(rel, rules):
                files.append(rel)
    return sorted(files)


def _may_reinclude(rel_dir: str, rules) -> bool:
    """Whether an exception rule could bring back something inside an ignored directory."""
    return any(exc and (rx.pattern.startswith(re.escape(rel_dir + "/")) or rx.pattern.startswith(".*"))
               for exc, rx in rules)
