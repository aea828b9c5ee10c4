"""deploy/: container images, compose, Kubernetes and systemd, checked without a Docker engine or a cluster."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from plexus import identity, pki
from plexus.config import load_coordinator_config, load_relay_config, load_site_config, split_address

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"

DOCKERFILES = sorted(p for p in (DEPLOY / "docker").glob("Dockerfile.*") if p.suffix != ".dockerignore")
K8S = ("coordinator", "site")


def run(*cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL, **kw)


# --- container images -------------------------------------------------------------------
def test_there_are_three_dockerfiles():
    assert [p.name for p in DOCKERFILES] == ["Dockerfile.coordinator", "Dockerfile.relay", "Dockerfile.site"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_passes_hadolint(tools, dockerfile):
    result = run(tools / "bin" / "hadolint", "--failure-threshold", "style", dockerfile)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_is_slim_cpu_nonroot_and_healthchecked(dockerfile):
    text = dockerfile.read_text()
    assert re.search(r"^FROM python:3\.11[\w.]*-slim", text, re.M)
    assert "--index-url https://download.pytorch.org/whl/cpu torch==2.13.0" in text
    assert re.search(r"^USER 10001:10001$", text, re.M)
    assert re.search(r"^HEALTHCHECK .*\\\n\s+CMD \[\"plexus\", \"health\"", text, re.M)
    assert 'VOLUME ["/var/lib/plexus"]' in text
    for source in re.findall(r"^COPY (\S+)", text, re.M):   # everything it copies is in the repo
        assert (REPO / source).exists(), source
    ignore = Path(f"{dockerfile}.dockerignore").read_text()
    assert ignore.startswith("#") and "\n*\n" in ignore and "!plexus/" in ignore


# --- install instructions ---------------------------------------------------------------
def test_install_instructions_install_only_what_exists():
    """Plexus is not on PyPI: every `pip install` in the install and upgrade instructions names a checkout or
    the wheel built from one (or torch), and every deploy/ file they use is in the repository."""
    docs = [REPO / "docs" / "install-site.md", REPO / "docs" / "install-relay.md", REPO / "docs" / "upgrading.md",
            *sorted(DEPLOY.glob("systemd/*.service"))]
    for doc in docs:
        text = doc.read_text()
        installs = re.findall(r"pip install ([^`\n#&]*)", text)
        assert installs, doc
        for words in installs:
            for word in words.split():
                assert (word.startswith(("-", "torch==", "https://download.pytorch.org/")) or word == "."
                        or re.fullmatch(r"\./plexus_fl-[0-9X.Y.Z]+-py3-none-any\.whl", word)), f"{doc.name}: {word}"
        for path in re.findall(r"\bdeploy/[\w./-]*\w", text):
            assert (REPO / path).exists(), f"{doc.name} names {path}"


# --- configs shipped in deploy/ ---------------------------------------------------------
def test_every_shipped_config_loads():
    coordinators = [DEPLOY / "docker/coordinator.yaml", DEPLOY / "compose/coordinator.yaml",
                    DEPLOY / "k8s/coordinator/coordinator.yaml", DEPLOY / "systemd/coordinator.yaml"]
    sites = [*sorted((DEPLOY / "compose/sites").glob("*.yaml")), DEPLOY / "k8s/site/site.yaml",
             DEPLOY / "systemd/site.yaml"]
    for path in coordinators:
        cfg = load_coordinator_config(path)
        assert cfg.kit == Path("/etc/plexus/kit") and cfg.state_dir == Path("/var/lib/plexus"), path
    assert load_coordinator_config(DEPLOY / "docker/coordinator.yaml").health_listen == "127.0.0.1:8081"
    assert load_coordinator_config(DEPLOY / "systemd/coordinator.yaml").metrics_listen == "127.0.0.1:9100"
    for path in sites:
        cfg = load_site_config(path)
        assert cfg.kit == Path("/etc/plexus/kit") and cfg.datasets, path
    assert {load_site_config(p).site for p in (DEPLOY / "compose/sites").glob("*.yaml")} == {
        "cleveland", "hungary", "va"}
    for path in (DEPLOY / "docker/relay.yaml", DEPLOY / "systemd/relay.yaml"):
        cfg = load_relay_config(path)
        assert cfg.kit == Path("/etc/plexus/kit") and cfg.crl == Path("/etc/plexus/kit/crl.pem"), path
        assert split_address(cfg.listen)[1] == 8443 and split_address(cfg.parent)[1] == 8443, path
    assert load_relay_config(DEPLOY / "docker/relay.yaml").state_dir == Path("/var/lib/plexus")
    assert load_relay_config(DEPLOY / "docker/relay.yaml").health_listen == "127.0.0.1:8081"
    assert load_relay_config(DEPLOY / "systemd/relay.yaml").state_dir == Path("/var/lib/plexus-relay")
    assert load_relay_config(DEPLOY / "systemd/relay.yaml").metrics_listen == "127.0.0.1:9100"


@pytest.mark.parametrize("role", ["coordinator", "relay"])
def test_unit_and_image_run_their_role_on_the_config_shipped_beside_them(role):
    """Each unit and image starts `plexus ROLE run` on the config shipped beside it, and writes where it may."""
    config = f"/etc/plexus/{role}.yaml"
    unit = (DEPLOY / "systemd" / f"plexus-{role}.service").read_text()
    assert re.search(rf"^ExecStart=/opt/plexus/bin/plexus {role} run --config {config}$", unit, re.M)
    (state,) = re.findall(r"^StateDirectory=(\S+)$", unit, re.M)
    loaders = {"coordinator": load_coordinator_config, "relay": load_relay_config}
    assert loaders[role](DEPLOY / "systemd" / f"{role}.yaml").state_dir == Path("/var/lib") / state
    image = (DEPLOY / "docker" / f"Dockerfile.{role}").read_text()
    assert f'CMD ["{role}", "run", "--config", "{config}"]' in image
    assert f"COPY deploy/docker/{role}.yaml {config}" in image
    _, health_port = split_address(loaders[role](DEPLOY / "docker" / f"{role}.yaml").health_listen)
    assert f'"--plaintext", "127.0.0.1:{health_port}"' in image
    for package in ("plexus", "coordinator", "site_agent", *(("relay",) if role == "relay" else ())):
        assert f"COPY {package} ./{package}" in image
        assert f"\n!{package}/\n" in (DEPLOY / "docker" / f"Dockerfile.{role}.dockerignore").read_text()


# --- docker compose -----------------------------------------------------------------------
def test_compose_file_validates_with_kits_from_plexus_pki(tools, tmp_path):
    root = tmp_path / "fed"
    pki.init_federation(root, "plexus-compose", hosts=["coordinator", "localhost"])
    for site in ("cleveland", "hungary", "va"):
        pki.add_site(root, site)
    compose = DEPLOY / "compose" / "docker-compose.yaml"
    env = {**os.environ, "PLEXUS_PKI": str(root), "DOCKER_HOST": "unix:///nonexistent/docker.sock"}
    result = run(tools / "bin" / "docker-compose", "-f", compose, "config", env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    assert sorted(config["services"]) == ["coordinator", "site-cleveland", "site-hungary", "site-va"]
    for name, service in config["services"].items():
        mounts = {v.split(":")[1]: v.split(":")[0] for v in service["volumes"]}
        kit = Path(mounts["/etc/plexus/kit"])
        assert (kit / "cert.pem").exists() and (kit / "key.pem").exists(), name
        config_file = Path(mounts.get("/etc/plexus/site.yaml") or mounts["/etc/plexus/coordinator.yaml"])
        assert config_file.is_file() and service["read_only"] is True and service["cap_drop"] == ["ALL"]
        if name != "coordinator":
            cert_pem = (kit / "cert.pem").read_bytes()
            assert identity.identity_from_cert(cert_pem).name == load_site_config(config_file).site
            assert split_address(load_site_config(config_file).coordinator) == ("coordinator", 8443)
            assert service["depends_on"]["coordinator"]["condition"] == "service_healthy"
    assert "127.0.0.1:9100:9100" in str(config["services"]["coordinator"]["ports"])
    # The coordinator's certificate names the host the sites dial.
    assert b"coordinator" in (root / "coordinator" / "cert.pem").read_bytes() or _san(root / "coordinator")


def _san(kit: Path) -> bool:
    from cryptography import x509

    cert = x509.load_pem_x509_certificate((kit / "cert.pem").read_bytes())
    return "coordinator" in cert.extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)


# --- Kubernetes ------------------------------------------------------------------------------
def _render(kubectl: str, name: str, tmp_path: Path) -> tuple[Path, list[dict]]:
    result = run(kubectl, "kustomize", DEPLOY / "k8s" / name)
    assert result.returncode == 0, result.stderr
    assert "Warning" not in result.stderr, result.stderr
    out = tmp_path / f"{name}.yaml"
    out.write_text(result.stdout)
    return out, [d for d in yaml.safe_load_all(result.stdout) if d]


@pytest.mark.parametrize("name", K8S)
def test_kustomize_renders_manifests_that_validate_offline(kubectl, tools, tmp_path, name):
    rendered, docs = _render(kubectl, name, tmp_path)
    for version in ("1.30.0", "1.37.0"):
        result = run(tools / "bin" / "kubernetes-validate", "--strict", "--quiet", "-k", version, rendered)
        assert result.returncode == 0, result.stdout + result.stderr
    kinds = {d["kind"] for d in docs}
    assert {"Namespace", "ServiceAccount", "ConfigMap", "NetworkPolicy"} <= kinds
    for doc in docs:
        if doc["kind"] in ("StatefulSet", "Deployment"):
            pod = doc["spec"]["template"]["spec"]
            assert pod["securityContext"]["runAsNonRoot"] is True
            for container in pod["containers"] + pod.get("initContainers", []):
                assert container["resources"]["requests"], container["name"]
                assert container["securityContext"]["allowPrivilegeEscalation"] is False
                assert container["securityContext"]["readOnlyRootFilesystem"] is True
                assert container["image"].startswith("registry.example.org/plexus/")
            secrets = [v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v]
            assert secrets == [f"plexus-{name}-kit"]


def test_coordinator_statefulset_probes_the_health_port_its_config_opens(kubectl, tmp_path):
    _, docs = _render(kubectl, "coordinator", tmp_path)
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet"]
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap"]
    config = yaml.safe_load(config_map["data"]["coordinator.yaml"])
    _, health_port = split_address(config["health_listen"])
    container = sts["spec"]["template"]["spec"]["containers"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == health_port
    assert sts["spec"]["replicas"] == 1
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert any(m["name"] == claim["metadata"]["name"] and m["mountPath"] == config["state_dir"]
               for m in container["volumeMounts"])
    (service,) = [d for d in docs if d["kind"] == "Service" and d["spec"].get("clusterIP") != "None"]
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]}["grpc"] == split_address(config["listen"])[1]
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    metrics_rule = [r for r in policy["spec"]["ingress"] if r.get("from")]
    assert metrics_rule and metrics_rule[0]["ports"] == [{"port": 9100, "protocol": "TCP"}]
    # The config a pod gets is one the coordinator accepts.
    path = tmp_path / "coordinator.yaml"
    path.write_text(config_map["data"]["coordinator.yaml"])
    assert load_coordinator_config(path).crl == Path("/etc/plexus/crl/crl.pem")


# --- systemd ---------------------------------------------------------------------------------
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))
HARDENING = ("NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes",
             "User=plexus", "CapabilityBoundingSet=", "ReadOnlyPaths=/etc/plexus", "StateDirectory=plexus")


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_systemd_unit_is_hardened(unit):
    lines = unit.read_text().splitlines()
    for setting in HARDENING:
        assert any(line.startswith(setting) for line in lines), setting


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_systemd_analyze_verifies_the_unit(unit, tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed on this machine")
    # verify insists that ExecStart's binary exists; stand in for the venv's plexus.
    stub = tmp_path / "plexus"
    stub.write_text("#!/bin/sh\n")
    stub.chmod(0o755)
    local = tmp_path / unit.name
    local.write_text(unit.read_text().replace("/opt/plexus/bin/plexus", str(stub)))
    result = run(analyze, "verify", "--man=no", local)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr
    security = run(analyze, "security", "--offline=yes", local)
    level = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", security.stdout)
    assert level and float(level.group(1)) <= 2.0, security.stdout[-3000:]
