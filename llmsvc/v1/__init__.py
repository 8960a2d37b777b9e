"""Generated gRPC/protobuf code for the llmsvc.v1 API (protos/llmsvc/v1/llmsvc.proto).

Do not edit the generated modules; regenerate with `python protos/generate.py`
(or `python -m llmsvc.client.codegen`). tests/test_proto.py fails when they are stale.
"""
