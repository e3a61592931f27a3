"""compose.yaml against the official Compose Specification JSON schema (vendored, see schemas/SOURCE.md)."""
from __future__ import annotations

import copy
import hashlib
import json
import re

import jsonschema
import pytest

from tests.deploy import compose_support as cs


@pytest.fixture(scope="module")
def validator() -> jsonschema.protocols.Validator:
    schema = json.loads(cs.SCHEMA_FILE.read_text())
    # The schema says draft-07 (its $schema URL is not one jsonschema maps by itself): say so.
    assert "draft-07" in schema["$schema"]
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def _errors(validator, doc) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
            for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))]


def test_vendored_schema_is_the_recorded_one():
    """The file is the one SOURCE.md names (same sha256), so nobody edits it to make a test pass."""
    source = (cs.SCHEMA_FILE.parent / "SOURCE.md").read_text()
    recorded = re.search(r"sha256:\s*`?([0-9a-f]{64})", source)
    assert recorded, "schemas/SOURCE.md must record the sha256 of compose-spec.json"
    assert hashlib.sha256(cs.SCHEMA_FILE.read_bytes()).hexdigest() == recorded.group(1)
    schema = json.loads(cs.SCHEMA_FILE.read_text())
    assert schema["title"] == "Compose Specification"


@pytest.mark.parametrize("scenario", list(cs.SCENARIOS))
def test_compose_file_validates(validator, scenario):
    doc = cs.load(cs.SCENARIOS[scenario])
    assert _errors(validator, doc) == []


def test_every_variable_has_a_default():
    """An unset variable without a default becomes '' in `docker compose`: never rely on that."""
    assert cs.variables_without_default(cs.raw_text()) == []


def test_interpolation_leaves_nothing_unresolved():
    for scenario, env in cs.SCENARIOS.items():
        text = json.dumps(cs.load(env))
        assert "${" not in text, f"{scenario}: unresolved variable left in {text}"


@pytest.mark.parametrize(
    "mutate, where",
    [
        (lambda d: d["services"]["gateway"].__setitem__("comand", ["gateway"]), "services/gateway"),
        (lambda d: d["services"]["gateway"]["depends_on"]["drafter"].__setitem__("condition", "service_ready"),
         "services/gateway/depends_on"),
        (lambda d: d["services"]["drafter"]["deploy"]["resources"]["reservations"]["devices"][0].pop("capabilities"),
         "services/drafter/deploy"),
        (lambda d: d["services"]["drafter"]["healthcheck"].__setitem__("interval_s", 15), "services/drafter/healthcheck"),
        (lambda d: d["services"]["verifier"].__setitem__("command", {"verifier": True}), "services/verifier/command"),
        (lambda d: d.__setitem__("volume", {}), "<root>"),
    ],
    ids=["misspelt-key", "bad-depends-condition", "gpu-without-capabilities", "healthcheck-unknown-key",
         "command-as-mapping", "unknown-top-level"],
)
def test_schema_catches_mistakes(validator, mutate, where):
    """The validation above is not vacuous: typical mistakes in this very file are rejected."""
    doc = copy.deepcopy(cs.load())
    mutate(doc)
    errors = _errors(validator, doc)
    assert errors, "the schema accepted a broken compose file"
    assert any(e.startswith(where) for e in errors), errors


def test_interpolation_rules():
    env = {"SET": "x", "EMPTY": ""}
    f = cs.interpolate_str
    assert f("${SET:-d}|${EMPTY:-d}|${UNSET:-d}", env) == "x|d|d"
    assert f("${SET-d}|${EMPTY-d}|${UNSET-d}", env) == "x||d"
    assert f("${SET:+a}|${EMPTY:+a}|${UNSET+a}|${EMPTY+a}", env) == "a|||a"
    assert f("$$SET $SET ${SET}", env) == "$SET x x"
    with pytest.raises(cs.InterpolationError):
        f("${UNSET:?needed}", env)
    with pytest.raises(cs.InterpolationError):
        f("${", env)
