"""Regenerate llmsvc/v1/*_pb2*.py from the protos in this folder.

Run from anywhere: `python protos/generate.py`. Same as `python -m llmsvc.client.codegen`.
"""
import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    runpy.run_module("llmsvc.client.codegen", run_name="__main__")
