"""Every command line in compose.yaml is a valid `specsplit` invocation, and the services agree.

Each service's argv (the image's entrypoint `specsplit` + `command`) and each healthcheck goes
through the real CLI with `--check` (parse + validate, no model loaded), under every scenario of
compose_support.SCENARIOS. Then the wiring: addresses, ports, GPUs, volumes, dependencies.
"""
from __future__ import annotations

import re
from collections import defaultdict

import pytest

from tests.deploy import compose_support as cs

SPLIT = ("drafter", "verifier", "gateway")
COLOCATED = "colocated"
TOKEN = "internal-token"  # one-shot: writes the internal bearer token, then exits
MODEL_SERVICES = ("drafter", "verifier", COLOCATED)  # the ones that load weights
SCENARIOS = list(cs.SCENARIOS)


def _services(scenario: str) -> dict[str, dict]:
    return cs.load(cs.SCENARIOS[scenario])["services"]


def _args(service: dict):
    return cs.parse_cli(cs.service_argv(service))


def _pairs():
    return [(s, name) for s in SCENARIOS for name in (*SPLIT, COLOCATED)]


# ---- the command lines themselves ----------------------------------------------------------------

def test_services_are_the_split_trio_plus_colocated():
    services = _services(SCENARIOS[0])
    assert set(services) == {*SPLIT, COLOCATED, TOKEN}
    for name in (*SPLIT, TOKEN):
        assert "profiles" not in services[name], f"{name} must start with a plain `docker compose up`"
    assert services[COLOCATED]["profiles"] == ["colocated"]


@pytest.mark.parametrize("scenario, name", _pairs())
def test_service_command_passes_check(scenario, name):
    argv = cs.service_argv(_services(scenario)[name])
    assert argv[0] == "specsplit", f"{name}: entrypoint must be specsplit, got {argv}"
    result = cs.specsplit_check(argv)
    assert result.code == 0, f"{name}: `{' '.join(argv)} --check` failed:\n{result.out}"


@pytest.mark.parametrize("scenario, name", _pairs())
def test_healthcheck_is_a_specsplit_health_call_on_the_service_port(scenario, name):
    service = _services(scenario)[name]
    argv = cs.healthcheck_argv(service)
    assert argv[:2] == ["specsplit", "health"], f"{name}: healthcheck must use `specsplit health`, got {argv}"
    result = cs.specsplit_check(argv)
    assert result.code == 0, f"{name}: healthcheck `{' '.join(argv)} --check` failed:\n{result.out}"
    host, port = cs.split_address(cs.parse_cli(argv).address)
    assert host in ("127.0.0.1", "localhost"), f"{name}: the healthcheck runs inside the container, ask loopback"
    assert port == _args(service).port, f"{name}: healthcheck asks port {port}, the server binds {_args(service).port}"


def test_subcommand_matches_service():
    services = _services(SCENARIOS[0])
    for name in SPLIT:
        assert _args(services[name]).command == name
    assert _args(services[COLOCATED]).command == "serve"


def test_check_would_catch_a_bad_value():
    """The --check test above can fail: an invalid value reaching a command line is rejected."""
    bad = cs.load({"DTYPE": "int3"})["services"]["verifier"]
    assert cs.specsplit_check(cs.service_argv(bad)).code != 0
    bad = cs.load({"DRAFTER_MEMORY_UTILIZATION": "1.5"})["services"]["drafter"]
    assert cs.specsplit_check(cs.service_argv(bad)).code != 0


def test_no_service_overrides_the_entrypoint():
    for name, service in _services(SCENARIOS[0]).items():
        assert "entrypoint" not in service, f"{name}: keep the image's `specsplit` entrypoint"


# ---- addresses and ports -------------------------------------------------------------------------

@pytest.mark.parametrize("scenario", SCENARIOS)
def test_gateway_points_at_the_drafter_and_verifier_services(scenario):
    services = _services(scenario)
    gateway = _args(services["gateway"])
    for role in ("drafter", "verifier"):
        host, port = cs.split_address(getattr(gateway, role))
        assert host == role, f"gateway --{role} host {host!r} is not the compose service {role!r}"
        assert port == _args(services[role]).port, f"gateway --{role} port {port} != {role} --port"
        assert [str(p) for p in services[role].get("expose", [])] == [str(port)]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_servers_bind_all_interfaces(scenario):
    """127.0.0.1 (the CLI default) inside a container is unreachable from the other containers."""
    for name, service in _services(scenario).items():
        if name == TOKEN:
            continue  # serves nothing
        assert _args(service).host == "0.0.0.0", f"{name} must bind 0.0.0.0 inside its container"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_only_the_public_api_is_published(scenario):
    services = _services(scenario)
    for name in ("drafter", "verifier"):
        assert "ports" not in services[name], f"{name} must not publish a host port"
    env = cs.SCENARIOS[scenario]
    for name in ("gateway", COLOCATED):  # alternatives: never both up (different profiles)
        (mapping,) = [cs.parse_port(p) for p in services[name]["ports"]]
        assert mapping.target == _args(services[name]).port
        assert mapping.published == env.get("GATEWAY_PORT", "50051")
        assert mapping.protocol == "tcp"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_split_services_agree_on_sequence_limits(scenario):
    """The gateway never batches more sequences, nor longer ones, than both engines were sized for."""
    services = _services(scenario)
    drafter, verifier, gateway = (_args(services[n]) for n in SPLIT)
    assert drafter.max_model_len == verifier.max_model_len
    assert gateway.max_num_seqs <= min(drafter.max_num_seqs, verifier.max_num_seqs)


def test_split_services_use_distinct_ports():
    services = _services(SCENARIOS[0])
    ports = [_args(services[n]).port for n in SPLIT]
    assert len(set(ports)) == len(ports), ports


# ---- GPUs ----------------------------------------------------------------------------------------

def _gpu_ids(service: dict) -> list[str]:
    (device,) = cs.gpu_reservations(service)
    assert device["driver"] == "nvidia"
    assert "gpu" in device["capabilities"]
    assert "count" not in device, "count and device_ids are exclusive; placement needs device_ids"
    return [str(i) for i in device["device_ids"]]


def test_split_gpu_by_default():
    services = _services("defaults (split GPUs)")
    assert _gpu_ids(services["drafter"]) != _gpu_ids(services["verifier"])
    assert cs.gpu_reservations(services["gateway"]) == [], "the gateway holds no model and needs no GPU"


@pytest.mark.parametrize(
    "env, drafter, verifier, colocated",
    [({}, ["0"], ["1"], ["0"]),
     ({"DRAFTER_GPU": "0", "VERIFIER_GPU": "0"}, ["0"], ["0"], ["0"]),
     ({"DRAFTER_GPU": "3", "VERIFIER_GPU": "GPU-5e1f", "COLOCATED_GPU": "2"}, ["3"], ["GPU-5e1f"], ["2"])],
)
def test_gpu_placement_follows_environment(env, drafter, verifier, colocated):
    services = cs.load(env)["services"]
    assert _gpu_ids(services["drafter"]) == drafter
    assert _gpu_ids(services["verifier"]) == verifier
    assert _gpu_ids(services[COLOCATED]) == colocated


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_device_flags_name_the_reserved_gpus(scenario):
    """A container sees only its reserved GPUs, numbered from cuda:0 whatever the host ids."""
    services = _services(scenario)
    for name in MODEL_SERVICES:
        visible = len(_gpu_ids(services[name]))
        args = _args(services[name])
        for flag in ("device", "draft_device"):
            dev = getattr(args, flag, None)
            if dev is None:
                continue
            assert dev.startswith("cuda"), f"{name} --{flag}={dev}: a GPU is reserved, use it"
            index = int(dev.partition(":")[2] or 0)
            assert index < visible, f"{name} --{flag}={dev} but only {visible} GPU(s) are reserved"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_services_sharing_a_gpu_fit_in_it(scenario):
    """Per GPU, the split services' --memory-utilization fractions add up to at most 1."""
    services = _services(scenario)
    used: dict[str, float] = defaultdict(float)
    for name in ("drafter", "verifier"):
        for gpu in _gpu_ids(services[name]):
            used[gpu] += _args(services[name]).memory_utilization
    assert all(v <= 1.0 + 1e-9 for v in used.values()), dict(used)


# ---- start-up order, volumes, image --------------------------------------------------------------

def test_gateway_waits_for_healthy_backends():
    services = _services(SCENARIOS[0])
    depends = services["gateway"]["depends_on"]
    assert depends == {"drafter": {"condition": "service_healthy"}, "verifier": {"condition": "service_healthy"},
                       TOKEN: {"condition": "service_completed_successfully"}}


def test_drafter_starts_after_the_verifier():
    """One GGUF conversion and one memory profile at a time (see the comment in compose.yaml)."""
    depends = _services(SCENARIOS[0])["drafter"]["depends_on"]
    assert depends == {"verifier": {"condition": "service_healthy"}, TOKEN: {"condition": "service_completed_successfully"}}


def test_dependencies_have_healthchecks_and_no_cycle():
    services = _services(SCENARIOS[0])
    graph = {name: set(s.get("depends_on", {})) for name, s in services.items()}
    for name, deps in graph.items():
        for dep in deps:
            assert dep in services, f"{name} depends on unknown service {dep}"
            if services[name]["depends_on"][dep]["condition"] == "service_completed_successfully":
                assert services[dep].get("restart") == "no", f"{dep} is one-shot: it must not be restarted"
                continue
            assert "healthcheck" in services[dep], f"{name} waits for {dep} to be healthy, {dep} has no healthcheck"
    done: set[str] = set()
    while len(done) < len(graph):
        ready = {n for n, deps in graph.items() if n not in done and deps <= done}
        assert ready, f"dependency cycle among {set(graph) - done}"
        done |= ready


def _seconds(duration: str) -> float:
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|us|ns)", str(duration))
    assert parts and "".join(a + b for a, b in parts) == str(duration), f"not a compose duration: {duration!r}"
    scale = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
    return sum(float(a) * scale[b] for a, b in parts)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_stop_grace_period_outlasts_the_drain(scenario):
    """docker sends SIGKILL after stop_grace_period: let --drain-timeout finish live streams first."""
    for name, service in _services(scenario).items():
        drain = getattr(_args(service), "drain_timeout", None)
        if drain is not None:
            assert _seconds(service["stop_grace_period"]) > drain, (name, service["stop_grace_period"], drain)
        assert service.get("init") is True, f"{name}: a Python PID 1 ignores SIGTERM; use init: true"


def test_healthcheck_budget_covers_a_cold_start():
    """The health probe starts a Python that imports the CLI; model services may convert a GGUF."""
    for name, service in _services(SCENARIOS[0]).items():
        if name == TOKEN:
            continue  # one-shot, no server to probe
        hc = service["healthcheck"]
        assert _seconds(hc["timeout"]) >= 10, f"{name}: the probe itself takes seconds"
        if name in MODEL_SERVICES:
            assert _seconds(hc["start_period"]) >= 300, f"{name}: first start loads (and may convert) weights"


def _mounts(service: dict) -> dict[str, str]:
    """named volume -> container path"""
    out = {}
    for v in service.get("volumes", []):
        source, target, *_ = str(v).split(":")
        out[source] = target
    return out


def test_model_volume_is_mounted_at_the_cache_dir():
    doc = cs.load()
    assert "models" in doc["volumes"]
    services = doc["services"]
    for name in MODEL_SERVICES:
        cache = services[name]["environment"]["SPECSPLIT_CACHE"]
        assert _mounts(services[name]).get("models") == cache, (
            f"{name}: mount the named volume at SPECSPLIT_CACHE={cache}")
    # the gateway loads the tokenizer from the path the verifier reports, which lies in that volume
    assert _mounts(services["gateway"]).get("models") == services["verifier"]["environment"]["SPECSPLIT_CACHE"]
    assert str(services["gateway"]["volumes"][0]).endswith(":ro")


def test_every_service_uses_the_one_image_built_from_the_dockerfile():
    services = _services(SCENARIOS[0])
    images = {s["image"] for s in services.values()}
    assert images == {"specsplit:latest"}
    for name, service in services.items():
        assert service["build"]["context"] == ".", name
        assert (cs.REPO / service["build"]["context"] / "Dockerfile").exists()
