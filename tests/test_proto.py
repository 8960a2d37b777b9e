"""The API contract: shipped stubs match protos/ (not stale), buf lint passes, docs/api.md rules hold."""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from llmsvc.v1 import llmsvc_pb2, llmsvc_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
PROTO = ROOT / "protos" / "llmsvc" / "v1" / "llmsvc.proto"
GENERATED = ROOT / "llmsvc" / "v1"


def serialized_descriptor(pb2_source: str) -> descriptor_pb2.FileDescriptorProto:
    """The FileDescriptorProto embedded in a generated *_pb2.py (its AddSerializedFile(b'...'))."""
    for node in ast.walk(ast.parse(pb2_source)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "AddSerializedFile":
            return descriptor_pb2.FileDescriptorProto.FromString(ast.literal_eval(node.args[0]))
    raise AssertionError("no AddSerializedFile call in generated module")


def rpc_paths(grpc_source: str) -> dict[str, str]:
    """'/pkg.Service/Method' -> 'unary_unary' | 'unary_stream' | ... from a *_pb2_grpc.py stub class."""
    found = {}
    for node in ast.walk(ast.parse(grpc_source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and getattr(node.func.value, "id", "") == "channel" and node.args
                and isinstance(node.args[0], ast.Constant)):
            found[node.args[0].value] = node.func.attr
    return found


def summary(fd: descriptor_pb2.FileDescriptorProto) -> dict:
    """What matters to clients: services/methods (streaming flags), messages (fields: number,
    type, label, type name, oneof, proto3 optional; reserved ranges), enums (values)."""
    out: dict = {"package": fd.package, "dependencies": sorted(fd.dependency)}

    def enum(prefix, e):
        out[f"enum {prefix}{e.name}"] = sorted((v.name, v.number) for v in e.value)

    def message(prefix, m):
        name = f"{prefix}{m.name}"
        oneofs = [o.name for o in m.oneof_decl]
        out[f"message {name}"] = {
            "fields": sorted((f.name, f.number, f.type, f.label, f.type_name,
                              oneofs[f.oneof_index] if f.HasField("oneof_index") else None,
                              f.proto3_optional) for f in m.field),
            "reserved": sorted((r.start, r.end) for r in m.reserved_range),
            "map_entry": m.options.map_entry,
        }
        for nested in m.nested_type:
            message(name + ".", nested)
        for e in m.enum_type:
            enum(name + ".", e)

    for m in fd.message_type:
        message("", m)
    for e in fd.enum_type:
        enum("", e)
    for s in fd.service:
        out[f"service {s.name}"] = sorted((m.name, m.input_type, m.output_type, m.client_streaming,
                                           m.server_streaming) for m in s.method)
    return out


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """protos/ compiled now, into a temp dir, with the same command as `make proto`."""
    pytest.importorskip("grpc_tools")
    from llmsvc.client.codegen import compile_protos

    out = tmp_path_factory.mktemp("gen")
    compile_protos(out)
    return out / "llmsvc" / "v1"


def test_generated_messages_and_services_match_the_proto(fresh):
    shipped = descriptor_pb2.FileDescriptorProto()
    llmsvc_pb2.DESCRIPTOR.CopyToProto(shipped)
    new = serialized_descriptor((fresh / "llmsvc_pb2.py").read_text())
    want, got = summary(new), summary(shipped)
    stale = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
    assert not stale, f"llmsvc/v1 is stale for {stale}: run `python protos/generate.py`"
    assert new == shipped, "descriptor options differ: run `python protos/generate.py`"


def test_generated_grpc_methods_match_the_proto(fresh):
    want = rpc_paths((fresh / "llmsvc_pb2_grpc.py").read_text())
    assert want == rpc_paths((GENERATED / "llmsvc_pb2_grpc.py").read_text())
    # and the imported module really builds those multi-callables
    calls = {}

    class Recorder:
        def __getattr__(self, kind):
            return lambda path, **kw: calls.setdefault(path, kind)

    llmsvc_pb2_grpc.LlmServiceStub(Recorder())
    llmsvc_pb2_grpc.AdminServiceStub(Recorder())
    assert calls == want


def test_summary_detects_changes_that_matter():
    fd = descriptor_pb2.FileDescriptorProto()
    llmsvc_pb2.DESCRIPTOR.CopyToProto(fd)
    base = summary(fd)
    mutations = [
        lambda d: setattr(d.message_type[0].field[0], "number", 99),
        lambda d: setattr(d.service[0].method[0], "server_streaming", False),
        lambda d: d.message_type[0].field[4].ClearField("proto3_optional"),
        lambda d: setattr(d.message_type[0].field[1], "name", "prompt_text"),
        lambda d: next(m for m in d.message_type if m.name == "GetServerInfoResponse").field.pop(),
    ]
    for mutate in mutations:
        changed = descriptor_pb2.FileDescriptorProto()
        changed.CopyFrom(fd)
        mutate(changed)
        assert summary(changed) != base


def test_api_md_rules():
    d = llmsvc_pb2.DESCRIPTOR
    assert d.package == "llmsvc.v1"
    svc = d.services_by_name["LlmService"]
    assert {m.name: m.server_streaming for m in svc.methods} == {
        "Generate": True, "Abort": False, "Tokenize": False, "Detokenize": False,
        "GetModelInfo": False, "GetServerInfo": False}
    admin = d.services_by_name["AdminService"]  # apart, so its authorization differs
    assert {m.name: m.server_streaming for m in admin.methods} == {
        "Drain": False, "FlushCache": False, "LoadLoraAdapter": False, "UnloadLoraAdapter": False}
    assert d.message_types_by_name["DrainRequest"].fields_by_name["grace_seconds"].has_presence
    # every tunable is optional (explicit presence) so zero never silently changes sampling;
    # a repeated field's zero value, the empty list, means "no restriction"
    sampling = d.message_types_by_name["SamplingParams"]
    for f in sampling.fields:
        if f.containing_oneof is None or f.containing_oneof.name != "constraint":
            assert f.has_presence or f.message_type is not None or f.is_repeated, f.name
    assert d.message_types_by_name["StoppingCriteria"].fields_by_name["max_tokens"].has_presence
    req = d.message_types_by_name["GenerateRequest"]
    assert [o.name for o in req.oneofs if not o.name.startswith("_")] == ["prompt"]
    fd = descriptor_pb2.FileDescriptorProto()
    d.CopyToProto(fd)
    gen = next(m for m in fd.message_type if m.name == "GenerateRequest")
    assert [(r.start, r.end) for r in gen.reserved_range] == [(13, 20)]  # 13 to 19 inclusive
    reasons = d.message_types_by_name["FinishInfo"].enum_types_by_name["Reason"]
    assert [v.name for v in reasons.values] == ["REASON_UNSPECIFIED", "REASON_STOP", "REASON_LENGTH",
                                                "REASON_CONTEXT", "REASON_ABORTED", "REASON_TIME_LIMIT"]


@pytest.fixture
def buf() -> str:
    """The buf binary of this environment (PyPI buf-bin, in the test extra); skipped only outside CI."""
    local = Path(sys.executable).parent / "buf"
    path = str(local) if local.exists() else shutil.which("buf")
    if path is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("buf is missing in CI: pip install -e '.[test]' (buf-bin)")
        pytest.skip("buf not installed: pip install -e '.[test]' (buf-bin); required in CI")
    return path


def test_buf_lint(buf):
    r = subprocess.run([buf, "lint"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"buf lint failed:\n{r.stdout}{r.stderr}"


def _in_head(path: str) -> bool:
    r = subprocess.run(["git", "cat-file", "-e", f"HEAD:{path}"], cwd=ROOT, capture_output=True)
    return r.returncode == 0


def test_buf_breaking_against_head(buf):
    """Uncommitted proto edits must not renumber, retype or drop shipped fields (use `reserved`)."""
    if shutil.which("git") is None or not (_in_head("buf.yaml") and _in_head("protos/llmsvc/v1/llmsvc.proto")):
        pytest.skip("no committed proto to compare with")
    r = subprocess.run([buf, "breaking", "--against", ".git#ref=HEAD"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, f"buf breaking:\n{r.stdout}{r.stderr}"
