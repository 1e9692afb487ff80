"""docker-compose.yml, the cluster demo as containers: it validates with the compose
tool CI installs (docker-compose 1.29; there is no Docker engine to run it), its
structure keeps the promises deploy/README.md makes (health checks, resource limits,
ordered start-up, no secret in the file), it mounts the same config files as the
local launcher (`lmtier cluster up`), and its monitoring files name what the sidecar
really exports.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import urllib.request
from importlib.metadata import entry_points
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import torch
import yaml

import lmtier
from lmtier import KVSpec, load_config
from lmtier.cli import _build_parser
from lmtier.testing.sidecar import SidecarProcess
from support import ROOT

pytestmark = pytest.mark.integration

COMPOSE = ROOT / "docker-compose.yml"
CLUSTER = ROOT / "deploy" / "cluster"
EXAMPLE_ENV = CLUSTER / "example.env"
CONFIG_DIR = PurePosixPath("/etc/lmtier")

# Every service, by kind. A new service must be added here, and so be classified.
LONG_RUNNING = {
    "router",
    "redis",
    "redis-node-1",
    "redis-node-2",
    "redis-node-3",
    "minio",
    "sidecar-a",
    "engine-a",
    "sidecar-b",
    "engine-b",
    "prometheus",
    "grafana",
}
ONE_SHOT = {"redis-cluster-init", "minio-init", "cluster-secrets", "warmup", "client"}
SIDECARS = ("sidecar-a", "sidecar-b")
ENGINES = {"engine-a": "sidecar-a", "engine-b": "sidecar-b"}
PROFILES = {"redis-cluster", "monitoring"}
SECRET_NAME = re.compile(r"PASSWORD|TOKEN|SECRET|ACCESS_KEY|_AUTH$")
METRIC = re.compile(r"\blmtier_[a-z0-9_]+\b")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def example_env() -> dict[str, str]:
    values = {}
    for line in EXAMPLE_ENV.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, value = line.partition("=")
            values[name.strip()] = value.strip()
    return values


def bind_mounts(service: dict[str, Any]) -> dict[PurePosixPath, tuple[Path, str]]:
    """The service's bind mounts of repository files: target -> (source relative to
    the repository root, mode)."""
    mounts = {}
    for entry in service.get("volumes", []):
        source, target, *mode = str(entry).split(":")
        if source.startswith("./"):
            mounts[PurePosixPath(target)] = (Path(source[2:]), mode[0] if mode else "rw")
    return mounts


def volume(service: dict[str, Any], target: str) -> str:
    """The source of what the service mounts at ``target``."""
    (source,) = [str(v).split(":")[0] for v in service["volumes"] if str(v).split(":")[1] == target]
    return source


def config_path(service: dict[str, Any]) -> PurePosixPath:
    command = [str(part) for part in service["command"]]
    return PurePosixPath(command[command.index("--config") + 1])


# --- the compose tool --------------------------------------------------------------


def run_compose(*args: str, env_file: Path) -> subprocess.CompletedProcess[str]:
    executable = shutil.which("docker-compose")
    if executable is None:
        pytest.skip("docker-compose is not installed (.ci/run installs it)")
    # Only the env file supplies the secrets: none may come from this environment.
    env = {k: v for k, v in os.environ.items() if k not in example_env() and k != "REDIS_HOST"}
    command = [executable, "-f", str(COMPOSE), "--env-file", str(env_file), *args]
    return subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.parametrize("profiles", [(), tuple(sorted(PROFILES))], ids=["default", "all"])
def test_compose_file_validates(profiles: tuple[str, ...]) -> None:
    flags = [part for profile in profiles for part in ("--profile", profile)]
    result = run_compose(*flags, "config", env_file=EXAMPLE_ENV)
    assert result.returncode == 0, result.stderr
    rendered = yaml.safe_load(result.stdout)
    assert set(rendered["services"]) == LONG_RUNNING | ONE_SHOT
    # Interpolated from the env file, and every service got its limits.
    sidecar = rendered["services"]["sidecar-a"]
    assert sidecar["environment"]["SIDECAR_TOKEN"] == example_env()["SIDECAR_TOKEN"]
    for name, service in rendered["services"].items():
        assert service["deploy"]["resources"]["limits"]["memory"], name


def test_compose_validates_without_an_env_file_on_demo_only_defaults(tmp_path: Path) -> None:
    """A fresh checkout: `docker compose config` (and `up`) works with no .env, on the
    demo-only secrets; every service agrees on them, and an env file overrides them."""
    empty = tmp_path / "empty.env"
    empty.write_text("")
    result = run_compose("config", env_file=empty)
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    password = services["redis"]["environment"]["REDIS_PASSWORD"]
    assert password.startswith("demo-only")
    assert f":{password}@" in services["sidecar-a"]["environment"]["LMTIER_REDIS__URL"]
    tokens = {services[name]["environment"]["SIDECAR_TOKEN"] for name in ("sidecar-a", "engine-a")}
    assert len(tokens) == 1 and tokens.pop().startswith("demo-only")
    overridden = yaml.safe_load(run_compose("config", env_file=EXAMPLE_ENV).stdout)["services"]
    assert overridden["redis"]["environment"]["REDIS_PASSWORD"] == example_env()["REDIS_PASSWORD"]


# --- structure ----------------------------------------------------------------------


def test_every_service_is_classified(
    compose: dict[str, Any], services: dict[str, dict[str, Any]]
) -> None:
    assert set(services) == LONG_RUNNING | ONE_SHOT
    assert "version" not in compose  # compose v2 calls it obsolete; 1.29 does not need it
    used = {profile for service in services.values() for profile in service.get("profiles", [])}
    assert used == PROFILES


def test_long_running_services_have_health_checks_and_limits(
    services: dict[str, dict[str, Any]],
) -> None:
    for name in LONG_RUNNING:
        check = services[name].get("healthcheck", {})
        assert check.get("test"), f"{name} has no health check"
        assert not check.get("disable"), name
    for name, service in services.items():
        limits = service.get("deploy", {}).get("resources", {}).get("limits", {})
        assert limits.get("cpus") and limits.get("memory"), f"{name} has no resource limits"


def test_start_up_order_uses_conditions(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        depends = service.get("depends_on", {})
        assert isinstance(depends, dict), f"{name}: depends_on needs conditions (a mapping)"
        for dependency, spec in depends.items():
            assert dependency in services, f"{name} depends on unknown {dependency}"
            expected = (
                "service_completed_successfully" if dependency in ONE_SHOT else "service_healthy"
            )
            assert spec == {"condition": expected}, f"{name} -> {dependency}"
            # A service of the default set may not wait for one of a profile.
            if not service.get("profiles"):
                assert not services[dependency].get("profiles"), f"{name} -> {dependency}"
    # The chain the demo needs.
    assert "minio-init" in services["sidecar-a"]["depends_on"]
    assert "redis" in services["sidecar-b"]["depends_on"]
    assert "engine-a" in services["warmup"]["depends_on"]
    assert {"warmup", "engine-b"} <= set(services["client"]["depends_on"])


def test_engines_share_their_own_sidecars_socket_and_memory(
    services: dict[str, dict[str, Any]],
) -> None:
    for engine, sidecar in ENGINES.items():
        assert services[sidecar]["ipc"] == "shareable"
        assert services[engine]["ipc"] == f"service:{sidecar}"
        assert services[engine]["depends_on"][sidecar] == {"condition": "service_healthy"}
        assert volume(services[sidecar], "/run/lmtier") == volume(services[engine], "/run/lmtier")
        command = [str(part) for part in services[engine]["command"]]
        assert "unix:///run/lmtier/sidecar.sock" in command
        assert "unix:///run/lmtier/sidecar.sock" in services[sidecar]["command"]
    # Each node has volumes of its own.
    runs = {str(v).split(":")[0] for s in SIDECARS for v in services[s]["volumes"]}
    # run and disk per node, the one sidecar.yaml and the cluster's secrets
    assert len(runs) == 2 * 2 + 2


@pytest.mark.parametrize("name", [*SIDECARS, *ENGINES, "warmup", "client"])
def test_lmtier_services_run_commands_the_cli_accepts(
    services: dict[str, dict[str, Any]], name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    service = services[name]
    assert service["build"]["dockerfile"] == "deploy/docker/Dockerfile"
    assert (ROOT / service["build"]["dockerfile"]).is_file()
    assert service["image"] == services["sidecar-a"]["image"]
    entrypoint = service.get("entrypoint")
    if entrypoint is not None:  # the token file, then lmtier with the command's arguments
        assert entrypoint[:2] == ["sh", "-c"] and entrypoint[2].endswith('exec lmtier "$$@"')
    argv = [re.sub(r"\$\{[^}]*\}", "x", str(part)) for part in service["command"]]
    if "cluster" in argv and not entry_points(group="lmtier.commands", name="cluster"):
        pytest.skip("`lmtier cluster` is not installed (pip install -e . registers it)")
    try:
        _build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{name}: lmtier rejects {argv}: {capsys.readouterr().err}")


def test_no_secret_is_written_in_the_file(services: dict[str, dict[str, Any]]) -> None:
    text = COMPOSE.read_text()
    for name, value in example_env().items():
        assert value not in text, f"the value of {name} is written in docker-compose.yml"
        assert "${" + name in text, f"{name} is never used"
    for name, service in services.items():
        environment = service.get("environment", {})
        assert isinstance(environment, dict), f"{name}: environment as a mapping"
        for key, raw in environment.items():
            value = str(raw)
            if SECRET_NAME.search(key) and not key.endswith("_FILE"):
                assert value.startswith("${"), f"{name}: {key} must come from a variable"
            credentials = re.search(r"://([^@/]*)@", value)
            if credentials:
                assert "${" in credentials[1], f"{name}: {key} holds credentials"
        lines = [*service.get("command", []), *service.get("healthcheck", {}).get("test", [])]
        for part in lines:
            for flag in re.finditer(r"(--requirepass|--masterauth|-a)\s+(\S+)", str(part)):
                assert flag[2].startswith('"$$'), f"{name}: {flag[1]} takes a variable"
            for url in re.finditer(r"://([^@/\s]*)@", str(part)):
                assert "${" in url[1], f"{name}: credentials in a URL of its command"
    # Neither a commit nor the image's build context carries the real env file.
    assert ".env" in (ROOT / ".gitignore").read_text().split()
    assert ".env" in (ROOT / ".dockerignore").read_text().split()


def test_config_files_are_the_committed_ones(services: dict[str, dict[str, Any]]) -> None:
    mounted: dict[PurePosixPath, set[Path]] = {}
    for name, service in services.items():
        for target, (source, mode) in bind_mounts(service).items():
            assert (ROOT / source).is_file(), f"{name} mounts {source}, which does not exist"
            assert mode == "ro", f"{name} mounts {source} writable"
            mounted.setdefault(target, set()).add(source)
    lmtier_files = {t: s for t, s in mounted.items() if t.parent == CONFIG_DIR}
    cluster = Path("deploy/cluster")
    assert lmtier_files == {
        CONFIG_DIR / "sidecar.yaml": {cluster / "sidecar.yaml"},
        CONFIG_DIR / "engine.yaml": {cluster / "engine.yaml"},
        CONFIG_DIR / "prompts.jsonl": {cluster / "prompts.jsonl"},
    }
    assert mounted[PurePosixPath("/etc/prometheus/prometheus.yml")] == {cluster / "prometheus.yml"}
    # Both sidecars run the one sidecar.yaml, the engines and the jobs engine.yaml.
    for name in SIDECARS:
        assert config_path(services[name]) == CONFIG_DIR / "sidecar.yaml"
    for name in (*ENGINES, "warmup"):
        assert config_path(services[name]) == CONFIG_DIR / "engine.yaml"
        assert CONFIG_DIR / "engine.yaml" in bind_mounts(services[name])


def test_sidecars_get_the_variables_sidecar_yaml_expects(
    services: dict[str, dict[str, Any]],
) -> None:
    comment = "\n".join(
        line for line in (CLUSTER / "sidecar.yaml").read_text().splitlines() if line.startswith("#")
    )
    expected = set(re.findall(r"\b(?:LMTIER_[A-Z0-9_]+|AWS_[A-Z_]+)\b", comment))
    assert {"LMTIER_REDIS__URL", "LMTIER_S3__ENDPOINT_URL", "AWS_ACCESS_KEY_ID"} <= expected
    for name in SIDECARS:
        environment = services[name]["environment"]
        assert expected <= set(environment), f"{name} lacks {expected - set(environment)}"
        assert environment["LMTIER_SIDECAR__METRICS_LISTEN"] == "0.0.0.0:9464"


def test_peers_trust_only_what_the_secrets_job_made(services: dict[str, dict[str, Any]]) -> None:
    """A shared Redis is no way in: the sidecars prove a node secret of their own (not
    the sidecar token) over mutual TLS, check chunks with an integrity key, and dial
    only each other; all from the cluster-secrets job's volume, which only they mount
    (read-only) and which it fills before they start."""
    job = services["cluster-secrets"]
    assert job["command"][:3] == ["cluster", "secrets", "--dir"]
    where = PurePosixPath(job["command"][3])
    assert volume(job, str(where)) == "cluster-secrets"
    for name in SIDECARS:
        service = services[name]
        environment = service["environment"]
        assert service["depends_on"]["cluster-secrets"] == {
            "condition": "service_completed_successfully"
        }
        assert f"cluster-secrets:{where}:ro" in service["volumes"]
        files = {
            "LMTIER_PEER__TOKEN_FILE": "peer.secret",
            "LMTIER_PEER__TLS_CA_FILE": "peer-ca.pem",
            "LMTIER_PEER__TLS_CERT_FILE": "peer.pem",
            "LMTIER_PEER__TLS_KEY_FILE": "peer-key.pem",
            "LMTIER_INTEGRITY__KEY_FILE": "integrity.key",
        }
        for variable, file in files.items():
            assert environment[variable] == str(where / file), (name, variable)
        assert environment["LMTIER_PEER__TLS_SERVER_NAME"] == "lmtier-peer"
        assert set(environment["LMTIER_PEER__ALLOWED_PEERS"].split(",")) == set(SIDECARS)
        assert "LMTIER_PEER__TOKEN" not in environment
    for name, service in services.items():
        if name not in SIDECARS and name != "cluster-secrets":
            mounted = [str(v).split(":")[0] for v in service.get("volumes", [])]
            assert "cluster-secrets" not in mounted, f"{name} mounts the cluster's secrets"


def test_cluster_secrets_writes_what_is_missing_and_keeps_the_rest(tmp_path: Path) -> None:
    """The job's command, as a process: five private files at the first run; a second
    run keeps them (a restarted cluster keeps its keys) and remakes only what went."""
    where = tmp_path / "secrets"
    command = [sys.executable, "-m", "lmtier.cli", "cluster", "secrets", "--dir", str(where)]
    first = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    assert "kept 0 file(s)" in first.stdout
    names = {"peer.secret", "integrity.key", "peer-ca.pem", "peer.pem", "peer-key.pem"}
    assert {p.name for p in where.iterdir()} == names
    assert where.stat().st_mode & 0o777 == 0o700
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in where.iterdir())
    before = {p.name: p.read_bytes() for p in where.iterdir()}
    (where / "peer.pem").unlink()
    again = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    assert "kept 2 file(s)" in again.stdout  # the TLS files are made together
    after = {p.name: p.read_bytes() for p in where.iterdir()}
    for name in ("peer.secret", "integrity.key"):
        assert after[name] == before[name]
    assert after["peer-ca.pem"] != before["peer-ca.pem"]


def test_bucket_job_creates_sidecar_yamls_bucket(services: dict[str, dict[str, Any]]) -> None:
    bucket = yaml.safe_load((CLUSTER / "sidecar.yaml").read_text())["s3"]["bucket"]
    script = "\n".join(str(part) for part in services["minio-init"]["command"])
    assert re.search(rf"mc mb --ignore-existing \S+/{re.escape(bucket)}\s*$", script, re.MULTILINE)


def test_warmup_prompts_span_several_chunks(services: dict[str, dict[str, Any]]) -> None:
    assert "/etc/lmtier/prompts.jsonl" in services["warmup"]["command"]
    prompts = [json.loads(line) for line in (CLUSTER / "prompts.jsonl").read_text().splitlines()]
    assert len(prompts) >= 4
    for prompt in prompts:
        text = prompt.get("prompt") or "".join(m["content"] for m in prompt["messages"])
        assert len(text.encode()) > 1000, prompt.get("id")  # > 3 chunks of 256 byte tokens


# --- the local launcher -------------------------------------------------------------


def test_launcher_uses_the_same_config_files(services: dict[str, dict[str, Any]]) -> None:
    launcher = pytest.importorskip("lmtier_apps.cluster.launcher")
    files = {role: Path(path) for role, path in launcher.CONFIG_FILES.items()}
    mounted = {
        "sidecar": {
            bind_mounts(services[name])[config_path(services[name])][0] for name in SIDECARS
        },
        "engine": {bind_mounts(services[name])[config_path(services[name])][0] for name in ENGINES},
    }
    assert set(files) == set(mounted)
    for role, path in files.items():
        assert not path.is_absolute(), f"{role}: relative to the repository root"
        assert mounted[role] == {path}, role
        assert (ROOT / path).is_file()


# --- monitoring ---------------------------------------------------------------------


def test_prometheus_scrapes_both_sidecars(services: dict[str, dict[str, Any]]) -> None:
    config = yaml.safe_load((CLUSTER / "prometheus.yml").read_text())
    targets = {
        target
        for job in config["scrape_configs"]
        for group in job.get("static_configs", [])
        for target in group["targets"]
    }
    assert targets == {f"{name}:9464" for name in SIDECARS}
    nodes = {
        group["labels"]["node"]
        for job in config["scrape_configs"]
        for group in job["static_configs"]
    }
    assert nodes == {"a", "b"}


def test_grafana_is_provisioned_with_the_dashboard(services: dict[str, dict[str, Any]]) -> None:
    provisioning = yaml.safe_load((CLUSTER / "grafana-provisioning.yml").read_text())
    dashboard = json.loads((CLUSTER / "grafana-dashboard.json").read_text())
    (source,) = provisioning["datasources"]
    (provider,) = provisioning["providers"]
    mounts = bind_mounts(services["grafana"])
    folder = PurePosixPath(provider["options"]["path"])
    assert mounts[folder / "lmtier.json"][0] == Path("deploy/cluster/grafana-dashboard.json")
    assert source["url"] == "http://prometheus:9090"
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == source["uid"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == source["uid"], panel["title"]


def dashboard_queries() -> list[str]:
    dashboard = json.loads((CLUSTER / "grafana-dashboard.json").read_text())
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        queries.append(query["query"] if isinstance(query, dict) else str(query))
    return queries


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def exported_names(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """The sample names a real sidecar's /metrics exports once a client has called it
    (CPU and disk tiers: every tier exports the same names, under its own `tier`
    label)."""
    folder = tmp_path_factory.mktemp("metrics")
    port = free_port()
    settings = {
        "cpu": {"capacity_bytes": "8MiB", "staging_bytes": "8MiB"},
        "disk": {"path": str(folder / "disk"), "capacity_bytes": "64MiB"},
        "sidecar": {"metrics_listen": f"127.0.0.1:{port}", "shared_memory": False},
    }
    with SidecarProcess(folder, settings) as sidecar:
        client = load_config(env={}, overrides={"cpu": {"capacity_bytes": "1MiB"}})
        spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8)
        with lmtier.connect(sidecar.target, client, kv=spec, model_id="compose") as cache:
            tokens = list(range(600))
            cache.store(tokens, torch.ones(spec.shape(len(tokens))))
            with cache.load(tokens) as hit:
                assert hit.num_tokens == 512
        url = f"http://127.0.0.1:{port}/metrics"
        with urllib.request.urlopen(url, timeout=30) as reply:
            text = reply.read().decode()
    return {
        re.split(r"[{ ]", line, maxsplit=1)[0]
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def test_dashboard_queries_name_exported_metrics(exported_names: set[str]) -> None:
    used = {name for query in dashboard_queries() for name in METRIC.findall(query)}
    assert used, "the dashboard queries no lmtier metric"
    assert used <= exported_names, f"not exported by the sidecar: {sorted(used - exported_names)}"
    # What deploy/README.md says the dashboard shows.
    for needed in (
        "lmtier_tier_hits_total",
        "lmtier_tier_misses_total",
        "lmtier_tier_read_bytes_total",
        "lmtier_tier_written_bytes_total",
        "lmtier_tier_read_duration_seconds_bucket",
        "lmtier_sidecar_request_duration_seconds_bucket",
        "lmtier_tier_queue_depth",
        "lmtier_sidecar_leases",
        "lmtier_sidecar_sessions",
    ):
        assert needed in used, needed
    assert any("histogram_quantile(0.99" in query for query in dashboard_queries())
