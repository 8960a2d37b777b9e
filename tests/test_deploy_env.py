"""Configuration surface used by the deploy files: every `llmsvc serve` flag has an LLMSVC_* twin
shown in --help, and every LLMSVC_* setting / command in docker-compose.yml and the Dockerfile
is one the program actually reads."""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import yaml
from dockerfile_parse import DockerfileParser

from llmsvc.server import cli

ROOT = Path(__file__).resolve().parents[1]
# read outside the serve flags: the model cache (llmsvc.models.resolve) and the token list (llmsvc.server.auth)
NON_FLAG_ENV = {"LLMSVC_CACHE", "LLMSVC_AUTH_TOKENS"}


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llmsvc serve")
    cli.add_arguments(p)
    return p


def help_env_names() -> set[str]:
    return set(re.findall(r"LLMSVC_[A-Z_]+", serve_parser().format_help()))


def test_every_flag_has_an_env_twin_in_help():
    p = serve_parser()
    text = p.format_help()
    for action in p._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        env = "LLMSVC_" + action.dest.upper()
        assert f"[{env}]" in text, action.dest  # argparse wraps on spaces: the tag stays whole
    assert "LLMSVC_AUTH_TOKENS" in text
    for flag in ("--metrics-port", "--tls-cert", "--tls-key", "--tls-client-ca", "--auth-token-file",
                 "--log-format", "--shutdown-grace"):
        assert flag in text


def _compose_env() -> dict[str, str]:
    text = (ROOT / "docker-compose.yml").read_text()
    env = {}
    for svc in yaml.safe_load(text)["services"].values():
        env.update(svc.get("environment") or {})
    # commented-out examples must be real settings too
    env.update({m: "" for m in re.findall(r"#\s*(LLMSVC_[A-Z_]+):", text)})
    return env


def test_compose_and_dockerfile_settings_exist():
    known = help_env_names() | NON_FLAG_ENV
    env = _compose_env()
    assert env and set(env) <= known, set(env) - known
    df = DockerfileParser(path=str(ROOT / "Dockerfile"))
    df_env = {k for i in df.structure if i["instruction"] == "ENV" for k in re.findall(r"(LLMSVC_[A-Z_]+)=",
                                                                                        i["value"])}
    assert df_env and df_env <= known, df_env - known
    args = serve_parser().parse_args([])  # the values compose sets parse with the flag's own type
    for k, v in env.items():
        if v and k not in NON_FLAG_ENV:
            action = next(a for a in serve_parser()._actions if "LLMSVC_" + a.dest.upper() == k)
            if action.type is not None:
                action.type(v)
            if action.choices:
                assert v in action.choices
    assert args.metrics_port == 0  # off unless configured


def test_commands_in_deploy_files_parse():
    df = DockerfileParser(path=str(ROOT / "Dockerfile"))
    cmds = [json.loads(i["value"]) for i in df.structure if i["instruction"] == "CMD"]
    cmds += [s["command"] for s in yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"].values()
             if isinstance(s.get("command"), list) and s["command"][:1] == ["serve"]]
    assert cmds
    for cmd in cmds:
        assert cmd[0] == "serve"
        serve_parser().parse_args(cmd[1:])  # exits (SystemExit) on an unknown flag
    assert any("--metrics-port" in c for c in cmds) or _compose_env().get("LLMSVC_METRICS_PORT")
