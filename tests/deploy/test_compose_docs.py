"""docs/deployment.md stays true: its commands parse, its override file validates and works."""
from __future__ import annotations

import copy
import json
import re
import shlex

import jsonschema
import pytest
import yaml

from tests.deploy import compose_support as cs

DOC = cs.REPO / "docs" / "deployment.md"
IMAGE = re.compile(r"^specsplit(:[\w.-]+)?$")  # the image names the page uses


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", DOC.read_text(), flags=re.S | re.M)


def _shell_lines() -> list[str]:
    lines = []
    for block in _blocks("sh"):
        buf = ""
        for line in block.splitlines():
            if line.rstrip().endswith("\\"):
                buf += line.rstrip()[:-1] + " "
                continue
            lines.append(buf + line)
            buf = ""
    return [ln for ln in lines if ln.strip()]


def _strip_env(argv: list[str]) -> list[str]:
    while argv and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", argv[0]):
        argv = argv[1:]
    return argv


def _specsplit_commands() -> list[tuple[str, list[str], list[str]]]:
    """(line, specsplit argv, docker run options before the image or [])."""
    out = []
    for line in _shell_lines():
        argv = _strip_env(shlex.split(line, comments=True))
        if argv[:1] == ["specsplit"]:
            out.append((line, argv, []))
        elif argv[:2] == ["docker", "run"] and "--entrypoint" not in argv:
            image_at = next(i for i, tok in enumerate(argv) if IMAGE.match(tok))
            out.append((line, ["specsplit", *argv[image_at + 1:]], argv[2:image_at]))
    return out


def _inline_commands() -> list[list[str]]:
    """`specsplit SUBCOMMAND ARGS...` in inline code (bare `specsplit serve` names, placeholders skipped)."""
    out = []
    for span in re.findall(r"`([^`\n]+)`", DOC.read_text()):
        if "specsplit " not in span or re.search(r"\b[A-Z]{3,}\b|\.\.\.", span):
            continue
        argv = shlex.split(span[span.index("specsplit "):])
        if len(argv) >= 3:
            out.append(argv)
    return out


def test_the_page_has_commands_to_check():
    commands = _specsplit_commands()
    assert len(commands) >= 10, [c[0] for c in commands]
    assert len(_inline_commands()) >= 5, _inline_commands()
    assert {argv[1] for _, argv, _ in commands} >= {"drafter", "verifier", "gateway", "serve", "up", "health", "generate"}


def _ids(commands) -> list[str]:
    return [f"{i}-{'docker-run-' if docker else ''}{argv[1]}" for i, (_, argv, docker) in enumerate(commands)]


@pytest.mark.parametrize("line, argv, docker", _specsplit_commands(), ids=_ids(_specsplit_commands()))
def test_documented_command_passes_check(line, argv, docker):
    result = cs.specsplit_check(argv)
    assert result.code == 0, f"docs/deployment.md: `{line}` fails --check:\n{result.out}"


@pytest.mark.parametrize("argv", _inline_commands(), ids=" ".join)
def test_documented_inline_command_passes_check(argv):
    result = cs.specsplit_check(argv)
    assert result.code == 0, f"docs/deployment.md: `{' '.join(argv)}` fails --check:\n{result.out}"


@pytest.mark.parametrize("line, argv, docker", [c for c in _specsplit_commands() if c[2]],
                         ids=_ids([c for c in _specsplit_commands() if c[2]]))
def test_documented_docker_run_publishes_the_port_it_serves(line, argv, docker):
    args = cs.parse_cli(argv)
    published = [docker[i + 1] for i, tok in enumerate(docker) if tok == "-p"]
    if args.command in ("drafter", "verifier", "gateway", "serve"):
        assert args.host == "0.0.0.0", f"`{line}`: bind 0.0.0.0 inside a container"
        assert [cs.parse_port(p).target for p in published] == [args.port], line
        assert "--init" in docker, f"`{line}`: without --init the server ignores SIGTERM as PID 1"
    if "--gpus" in docker:
        assert args.device == "cuda:0", f"`{line}`: the one GPU --gpus exposes is cuda:0"


def test_every_compose_variable_is_documented():
    used = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", cs.raw_text()))
    text = DOC.read_text()
    missing = sorted(v for v in used if f"`{v}`" not in text)
    assert not missing, f"document these compose.yaml variables in docs/deployment.md: {missing}"


# ---- the colocated two-GPU override file -----------------------------------------------------------

class _Override:
    def __init__(self, value):
        self.value = value


class _ComposeLoader(yaml.SafeLoader):
    """PyYAML plus compose's merge tags: !override replaces, !reset removes."""


_ComposeLoader.add_constructor("!override", lambda loader, node: _Override(
    loader.construct_sequence(node, deep=True) if isinstance(node, yaml.SequenceNode)
    else loader.construct_mapping(node, deep=True) if isinstance(node, yaml.MappingNode)
    else loader.construct_scalar(node)))


def _plain(node):
    if isinstance(node, _Override):
        return _plain(node.value)
    if isinstance(node, dict):
        return {k: _plain(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_plain(v) for v in node]
    return node


def _merge(base, override):
    """Compose's merge for what the page's override uses: mappings merge, !override replaces."""
    if isinstance(override, _Override):
        return _plain(override.value)
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for k, v in override.items():
            out[k] = _merge(base[k], v) if k in base else _plain(v)
        return out
    return _plain(override)


def _override_block() -> str:
    (block,) = [b for b in _blocks("yaml") if "colocated:" in b]
    return block


def test_two_gpu_override_validates_and_reserves_both_gpus():
    schema = json.loads(cs.SCHEMA_FILE.read_text())
    fragment = yaml.load(_override_block(), Loader=_ComposeLoader)
    jsonschema.Draft7Validator(schema).validate(_plain(fragment))  # an override file is a compose file

    env = {"COLOCATED_DRAFT_DEVICE": "cuda:1"}  # as the page's command sets it
    assert "COLOCATED_DRAFT_DEVICE=cuda:1" in DOC.read_text()
    merged = _merge(copy.deepcopy(cs.load_raw()), fragment)
    service = cs.interpolate(merged, env)["services"]["colocated"]
    jsonschema.Draft7Validator(schema).validate(cs.interpolate(merged, env))

    (device,) = cs.gpu_reservations(service)
    assert device["device_ids"] == ["0", "1"]
    argv = cs.service_argv(service)
    assert cs.specsplit_check(argv).code == 0
    args = cs.parse_cli(argv)
    assert (args.device, args.draft_device) == ("cuda:0", "cuda:1")
