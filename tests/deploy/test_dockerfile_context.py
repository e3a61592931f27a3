"""What `COPY . .` + `pip install .` in the Dockerfile put in the image, checked without Docker.

The build context is simulated from .dockerignore, a wheel is built from exactly those files (as
the image's `pip install .` does), and the wheel must hold every module of the packages, the
shipped draft model, the generated gRPC modules and the `specsplit` console script.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

from tests.deploy import compose_support as cs
from tests.deploy import dockerfile_support as df

PYPROJECT = tomllib.loads((cs.REPO / "pyproject.toml").read_text())
PACKAGES = [p.rstrip("*").rstrip(".") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]]
# The folders the package reaches through its links (specsplit/gateway -> ../gateway, ...): sent too.
LINKED = sorted({os.path.normpath(os.path.join(pkg, os.readlink(cs.REPO / pkg / d.name))).split(os.sep)[0]
                 for pkg in PACKAGES for d in (cs.REPO / pkg).iterdir() if d.is_symlink()})


@pytest.fixture(scope="module")
def context_files() -> list[str]:
    return df.build_context(cs.REPO)


@pytest.fixture(scope="module")
def wheel(context_files, tmp_path_factory) -> zipfile.ZipFile:
    src = tmp_path_factory.mktemp("context")
    for rel in context_files:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        if (cs.REPO / rel).is_symlink():  # as Docker's COPY does
            os.symlink(os.readlink(cs.REPO / rel), src / rel)
        else:
            shutil.copy2(cs.REPO / rel, src / rel)
    out = tmp_path_factory.mktemp("wheel")
    # --no-build-isolation: the venv's setuptools (no network); the image builds with isolation.
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"the package does not build from the Docker context:\n{proc.stdout}{proc.stderr}"
    (whl,) = out.glob("specsplit-*.whl")
    return zipfile.ZipFile(whl)


def test_context_sends_only_the_package(context_files):
    tops = {f.split("/")[0] for f in context_files}
    assert LINKED == ["drafter_svc", "gateway", "kernels", "protos", "rpc", "verifier_svc"], LINKED
    assert tops <= {"pyproject.toml", "README.md", *PACKAGES, *LINKED}, tops
    assert not [f for f in context_files if "__pycache__" in f or f.endswith(".pyc") or ".egg-info" in f]


def test_matcher_follows_docker_rules():
    rules = df.dockerignore_rules(cs.REPO / ".dockerignore")
    assert df.is_ignored("tests/deploy/test_compose_schema.py", rules)
    assert df.is_ignored(".venv/bin/python", rules)
    assert not df.is_ignored("specsplit/cli/__init__.py", rules)
    assert df.is_ignored("specsplit/cli/__pycache__/x.cpython-311.pyc", rules)


def test_wheel_from_the_context_has_every_module(wheel):
    names = set(wheel.namelist())
    for pkg in PACKAGES:
        for root, _, files in os.walk(cs.REPO / pkg, followlinks=True):  # through the links, as setuptools
            here = Path(root)
            if "__pycache__" in here.parts or (here != cs.REPO / pkg and not (here / "__init__.py").exists()):
                continue  # not a package: setuptools' find would skip it in the repo too
            for f in files:
                if f.endswith(".py"):
                    rel = (here / f).relative_to(cs.REPO).as_posix()  # e.g. specsplit/gateway/app.py
                    assert rel in names, f"{rel} is missing from the image's install"


def test_wheel_carries_the_shipped_draft_and_grpc_modules(wheel):
    names = set(wheel.namelist())
    asset = cs.REPO / "specsplit" / "assets" / "smollm2-135m-draft"
    if not asset.is_dir():
        pytest.skip("the shipped draft is not in this checkout")
    for f in asset.iterdir():
        assert f"specsplit/assets/smollm2-135m-draft/{f.name}" in names
    assert any(n.startswith("specsplit/v1/") and n.endswith("_pb2_grpc.py") for n in names)
    assert "specsplit/kernels/cpu/skinny_linear.cpp" in names and "specsplit/gateway/app.py" in names
    assert not any(n.split("/")[0] in LINKED for n in names)  # one import root: nothing installs beside specsplit


def test_wheel_installs_the_console_script_and_pins_torch(wheel):
    dist_info = next(n.split("/")[0] for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    entry_points = wheel.read(f"{dist_info}/entry_points.txt").decode()
    assert "specsplit = specsplit.cli:main" in entry_points
    meta = Parser().parsestr(wheel.read(f"{dist_info}/METADATA").decode())
    requires = [r.replace(" ", "") for r in meta.get_all("Requires-Dist") or []]
    torch_pin = next(r for r in PYPROJECT["project"]["dependencies"] if r.startswith("torch"))
    assert torch_pin.replace(" ", "") in requires, requires
