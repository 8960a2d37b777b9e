"""`llmsvc bench --json-schema FILE` on a tiny model: the constrained rerun in each mode, the
ratio to the unconstrained run, and the schema's compile time."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_json_schema_option(tmp_path):
    from tests.server_harness import make_tiny_served_model_dir

    d = make_tiny_served_model_dir(tmp_path / "m")
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"note": {"type": "string", "maxLength": 8}},
                                  "required": ["note"], "additionalProperties": False}))
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "llmsvc", "bench", str(d), "--num-requests", "3", "--input-len", "12",
                        "--output-len", "6", "--mode", "both", "--json-schema", str(schema), "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())["workloads"]["custom"]
    for kind in ("offline", "serve"):
        s = res[f"{kind}_json_schema"]
        assert s["completed"] == 3 and s["failed"] == 0 and s["output_tok_s"] > 0
        assert res["json_schema"][f"{kind}_ratio"] > 0
    assert 0 < res["json_schema"]["cached_compile_s"] < res["json_schema"]["compile_s"]
    assert res["serve_after_json_schema"]["completed"] == 3
    assert "JSON Schema" in r.stdout and "compiles in" in r.stdout
