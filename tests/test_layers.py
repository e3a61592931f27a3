"""The layering of DESIGN.md, checked by import-linter's contracts in pyproject.toml:

    specsplit.cli -> specsplit.{gateway | drafter_svc | verifier_svc} -> specsplit.rpc
                  -> the engine library (specsplit.engine, .spec, .models, ...) -> specsplit.kernels

and the engine library never imports grpc or the generated protos (specsplit.v1). `make test` runs this."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _lint_imports() -> list[str]:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.fail("lint-imports is not installed: `pip install -e '.[test]'` (import-linter)")
    return [exe]


def test_import_contracts_hold():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run(_lint_imports() + ["--no-cache"], cwd=REPO, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


def test_cli_contract_lists_every_engine_module():
    """The 'only the CLI imports the CLI' contract names specsplit's modules one by one (layers
    cannot nest specsplit.cli inside specsplit): a new module must be added there."""
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    contract = next(c for c in cfg["contracts"] if c["name"] == "Only the CLI imports the CLI")
    listed = set(contract["source_modules"])
    modules = {f"specsplit.{p.stem}" for p in (REPO / "specsplit").iterdir()
               if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()}
    missing = modules - listed - {"specsplit.cli"}
    assert not missing, f"add {sorted(missing)} to the contract's source_modules in pyproject.toml"


def test_contracts_catch_a_violation(tmp_path):
    """The contracts are not vacuous: an engine-library module importing grpc breaks them."""
    shutil.copytree(REPO, tmp_path / "repo", ignore=shutil.ignore_patterns(".venv", ".git", "tests", "*.safetensors",
                                                                           "bench_out", "docs", "__pycache__"))
    bad = tmp_path / "repo" / "specsplit" / "protocols.py"
    bad.write_text(bad.read_text() + "\nimport grpc  # noqa\nfrom specsplit.rpc import wire  # noqa\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "repo"))
    out = subprocess.run(_lint_imports() + ["--no-cache"], cwd=tmp_path / "repo", env=env, capture_output=True, text=True)
    assert out.returncode != 0
    assert "specsplit.protocols -> grpc" in out.stdout
    assert "specsplit.protocols is not allowed to import specsplit.rpc" in out.stdout
