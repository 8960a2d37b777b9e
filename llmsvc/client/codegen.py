"""Regenerate the Python stubs in llmsvc/v1/ from protos/ (`make proto`).

Needs grpcio-tools (a test/dev dependency); the client library itself never imports this
module. `compile_protos(out_dir)` is also used by tests/test_proto.py to compile a fresh
copy and compare its descriptors with the shipped ones.
"""
from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "protos"
PROTO_FILES = ("llmsvc/v1/llmsvc.proto",)


def compile_protos(out_dir: Path | str = REPO_ROOT, proto_root: Path | str = PROTO_ROOT) -> None:
    """Run protoc (from grpcio-tools) writing *_pb2.py, *_pb2.pyi and *_pb2_grpc.py under out_dir.

    Raises RuntimeError with protoc's exit code when compilation fails.
    """
    from grpc_tools import protoc  # deferred: dev-only dependency

    well_known = resources.files("grpc_tools") / "_proto"  # google/protobuf/*.proto
    out = str(out_dir)
    for proto in PROTO_FILES:
        argv = [
            "grpc_tools.protoc",
            f"-I{proto_root}",
            f"-I{well_known}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            str(Path(proto_root) / proto),
        ]
        rc = protoc.main(argv)
        if rc != 0:
            raise RuntimeError(f"protoc failed on {proto} (exit {rc})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO_ROOT), help="output root (default: the repo root)")
    args = parser.parse_args(argv)
    compile_protos(args.out)
    print(f"generated {', '.join(PROTO_FILES)} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
