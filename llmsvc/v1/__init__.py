"""Generated gRPC/protobuf code for the llmsvc.v1 API (protos/llmsvc/v1/llmsvc.proto).

Do not edit the generated modules; regenerate with `make proto` (which runs
`python -m llmsvc.client.codegen`, as does `python protos/generate.py`). tests/test_proto.py fails
when they are stale.
"""
