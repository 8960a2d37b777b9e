"""The gateway deployments are real although no Docker engine nor cluster runs here: the compose
`gateway` profile and deploy/k8s/ are checked against the schemas (Kubernetes' own, offline, via
kubernetes-validate), SMG's own argument parser reads the commands they give it, and the pieces
point at each other (selector -> pod labels, worker URLs -> services and ports, RBAC -> the
ServiceAccount the gateway runs as)."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from dockerfile_parse import DockerfileParser
from smg.launch_router import parse_router_args

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy/k8s"
K8S_VERSION = "1.37.0"


def smg_pin() -> str:
    """The smg version the test extra pins (so the deployed gateway is the one tested)."""
    text = (ROOT / "pyproject.toml").read_text()
    return re.search(r'"smg==([0-9.]+)"', text).group(1)


def k8s_docs() -> list[dict]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def one(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def gateway_args(command: list[str]):
    """SMG's RouterArgs for `smg launch ...` as given to the container."""
    assert command[0] == "launch", command
    return parse_router_args(command[1:])


@pytest.mark.parametrize("doc", k8s_docs(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_k8s_manifest_matches_kubernetes_schema_strictly(doc):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises ValidationError


def test_k8s_validation_rejects_a_broken_manifest():
    """The check above can fail: a probe on a named port that gRPC probes do not take."""
    dep = one(k8s_docs(), "Deployment", "llmsvc")
    dep["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = "grpc"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSION, strict=True)


def test_k8s_gateway_discovers_the_llmsvc_pods_on_their_grpc_port():
    docs = k8s_docs()
    ns = one(docs, "Namespace", "llmsvc")["metadata"]["name"]
    assert all(d["metadata"].get("namespace") == ns for d in docs if d["kind"] != "Namespace")
    worker = one(docs, "Deployment", "llmsvc")["spec"]["template"]
    (llmsvc,) = worker["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in llmsvc["ports"]}
    env = {e["name"]: e.get("value") for e in llmsvc["env"]}
    assert env["LLMSVC_HOST"] == "0.0.0.0" and int(env["LLMSVC_PORT"]) == ports["grpc"]

    gw_spec = one(docs, "Deployment", "smg")["spec"]["template"]["spec"]
    (smg,) = gw_spec["containers"]
    args = gateway_args(smg["args"])
    assert args.service_discovery and args.worker_urls == []
    assert args.selector and args.selector.items() <= worker["metadata"]["labels"].items()
    assert args.service_discovery_port == ports["grpc"]
    assert args.service_discovery_namespace == ns
    assert args.policy == "cache_aware" and args.host == "0.0.0.0"
    assert args.balance_rel_threshold == 1.2  # the spill gate measured with two replicas
    gw_ports = {p["name"]: p["containerPort"] for p in smg["ports"]}
    assert gw_ports == {"http": args.port, "metrics": args.prometheus_port}
    assert smg["image"].endswith(":" + smg_pin())
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in smg["env"]

    # the gateway's ServiceAccount may watch pods in the namespace, and nothing more
    sa = gw_spec["serviceAccountName"]
    one(docs, "ServiceAccount", sa)
    binding = next(d for d in docs if d["kind"] == "RoleBinding"
                   and any(s["kind"] == "ServiceAccount" and s["name"] == sa for s in d["subjects"]))
    role = one(docs, "Role", binding["roleRef"]["name"])
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]

    svc = one(docs, "Service", "smg")
    assert svc["spec"]["selector"].items() <= one(docs, "Deployment", "smg")["spec"]["template"]["metadata"][
        "labels"].items()


def test_k8s_llmsvc_probes_and_drain_fit_a_rolling_restart():
    docs = k8s_docs()
    spec = one(docs, "Deployment", "llmsvc")["spec"]
    pod = spec["template"]["spec"]
    (c,) = pod["containers"]
    grpc_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == grpc_port, probe
    # ready only once the engine serves; alive as long as the process answers
    assert c["readinessProbe"]["grpc"]["service"] == "llmsvc.v1.LlmService"
    assert c["livenessProbe"]["grpc"].get("service", "") == ""
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}
    # in-flight requests finish inside the drain, which ends before Kubernetes SIGKILLs the pod
    assert float(env["LLMSVC_SHUTDOWN_GRACE"]) < pod["terminationGracePeriodSeconds"]
    # compute threads follow the cores the pod requests, not the node's
    ref = env["LLMSVC_NUM_THREADS"]["resourceFieldRef"]
    assert (ref["containerName"], ref["resource"]) == (c["name"], "requests.cpu") and "cpu" in c["resources"]["requests"]
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    svc = one(docs, "Service", "llmsvc")
    assert svc["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_gateway_profile_fronts_two_replicas_default_unchanged():
    services = compose()["services"]
    assert "profiles" not in services["llmsvc"]  # `docker compose up` still starts llmsvc alone
    gateway = {name for name, s in services.items() if "gateway" in s.get("profiles", [])}
    assert gateway == {"llmsvc-2", "smg"}
    smg = services["smg"]
    args = gateway_args(smg["command"])
    assert args.policy == "cache_aware" and args.host == "0.0.0.0"
    assert args.balance_rel_threshold == 1.2  # the spill gate measured with two replicas
    workers = []
    for url in args.worker_urls:
        m = re.fullmatch(r"grpc://([\w-]+):(\d+)", url)
        assert m, url
        workers.append(m.group(1))
        assert services[m.group(1)]["environment"]["LLMSVC_PORT"] == m.group(2)
        assert services[m.group(1)]["environment"]["LLMSVC_HOST"] == "0.0.0.0"
    assert sorted(workers) == ["llmsvc", "llmsvc-2"]
    assert smg["depends_on"] == {w: {"condition": "service_healthy"} for w in workers}
    assert f"{args.port}:{args.port}" in smg["ports"] and f"{args.prometheus_port}:{args.prometheus_port}" in smg["ports"]
    # each replica converts the model into a volume of its own
    caches = {v.split(":")[0] for w in workers for v in services[w]["volumes"]}
    assert len(caches) == 2 and caches <= set(compose()["volumes"])


def test_gateway_image_installs_the_pinned_smg():
    build = compose()["services"]["smg"]["build"]
    df = DockerfileParser(path=str(ROOT / build["dockerfile"]))
    stages = [i["value"].split()[-1] for i in df.structure if i["instruction"] == "FROM"]
    assert build["target"] in stages
    runs = " ".join(i["value"] for i in df.structure if i["instruction"] == "RUN")
    assert f"smg=={smg_pin()}" in shlex.split(runs)
    assert compose()["services"]["smg"]["image"].endswith(":" + smg_pin())
    entry = [i["value"] for i in df.structure if i["instruction"] == "ENTRYPOINT"]
    assert entry == ['["smg"]']
