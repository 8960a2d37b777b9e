"""docker-compose.yml and the Dockerfile are real: validated here although no Docker engine runs."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml
from dockerfile_parse import DockerfileParser

from llmsvc.__main__ import COMMANDS

ROOT = Path(__file__).resolve().parents[1]


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_matches_the_compose_spec_schema():
    schema = json.loads((ROOT / "tests/data/compose_spec.json").read_text())
    # the spec names draft 2019-09 by an http URI that jsonschema's registry does not know:
    # pick that draft's validator ourselves rather than let it guess the latest
    jsonschema.Draft201909Validator.check_schema(schema)
    jsonschema.Draft201909Validator(schema).validate(compose())


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="Debian's docker-compose not installed")
@pytest.mark.parametrize("profiles", [[], ["--profile", "gpu", "--profile", "monitoring", "--profile", "gateway"]])
def test_docker_compose_config_accepts_the_file(profiles):
    r = subprocess.run(["docker-compose", *profiles, "config", "-q"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_compose_services_are_wired_for_operations():
    services = compose()["services"]
    svc = services["llmsvc"]
    health = svc["healthcheck"]["test"]
    assert health[:3] == ["CMD", "llmsvc", "health"] and "health" in COMMANDS
    assert "llmsvc.v1.LlmService" in health
    assert svc["restart"] == "unless-stopped"
    assert any(v.endswith(":/cache") for v in svc["volumes"])
    assert svc["environment"]["LLMSVC_CACHE"] == "/cache"
    assert "50051:50051" in svc["ports"]
    gpu = services["llmsvc-gpu"]
    assert gpu["profiles"] == ["gpu"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    prom = services["prometheus"]
    assert prom["profiles"] == ["monitoring"]
    src = prom["volumes"][0].split(":")[0]
    scrape = yaml.safe_load((ROOT / src).read_text())
    jobs = {j["job_name"]: j["static_configs"][0]["targets"] for j in scrape["scrape_configs"]}
    replicas = {f"{name}:{s['environment']['LLMSVC_METRICS_PORT']}" for name, s in services.items()
                if "LLMSVC_METRICS_PORT" in s.get("environment", {})}
    assert len(replicas) == 3 and set(jobs["llmsvc"]) == replicas  # every replica scraped, nothing else
    smg = services["smg"]["command"]
    assert jobs["smg"] == [f"smg:{smg[smg.index('--prometheus-port') + 1]}"]
    assert svc["build"]["args"]["TORCH_INDEX_URL"].endswith("/cpu")  # not PyPI's CUDA wheel in a CPU image


def test_dockerfile_stages_copy_real_paths_and_run_the_cli():
    df = DockerfileParser(path=str(ROOT / "Dockerfile"))
    stages = [i["value"].split()[-1] for i in df.structure if i["instruction"] == "FROM"]
    assert stages == ["cpu", "cuda"]
    # a plain `docker build -t llmsvc:cpu .` (deploy/k8s/llmsvc.yaml) takes torch's CPU build too
    args = dict(i["value"].split("=", 1) for i in df.structure if i["instruction"] == "ARG" and "=" in i["value"])
    assert args["TORCH_INDEX_URL"].endswith("/whl/cpu")
    targets = {s["build"]["target"] for s in compose()["services"].values()
               if "build" in s and "dockerfile" not in s["build"]}  # the gateway has its own
    assert targets <= set(stages)
    for ins in df.structure:
        if ins["instruction"] == "COPY":
            for src in ins["value"].split()[:-1]:
                assert (ROOT / src).exists(), f"Dockerfile copies missing {src}"
        if ins["instruction"] == "RUN" and "pip" in ins["value"] and "torch" in ins["value"]:
            assert "torch==2.13.0" in ins["value"]
    entry = [json.loads(i["value"]) for i in df.structure if i["instruction"] == "ENTRYPOINT"]
    assert entry and all(e == ["llmsvc"] for e in entry)
    cuda_apt = [i["value"] for i in df.structure if i["instruction"] == "RUN" and "apt-get install" in i["value"]][-1]
    assert {"gcc", "python3-dev"} <= set(cuda_apt.split())  # Triton builds its driver module on first use
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".venv-vllm", ".git"} <= set(ignored)  # gigabytes the build context need not carry
    checks = [i["value"] for i in df.structure if i["instruction"] == "HEALTHCHECK"]
    assert checks and all('"llmsvc", "health"' in c for c in checks)
