"""A gateway on another machine has no copy of the model: SMG without --model-path, in front of a
replica whose model directory it cannot read, takes the tokenizer and chat template from the
replica (VllmEngine/GetTokenizer) and serves chat. This is how deploy/k8s/smg.yaml and the
compose `gateway` profile run it. (Only unconstrained requests here: the replica itself reads
its model directory again for its first constrained one.)"""
from __future__ import annotations

import os
import shutil

from tests.ascii_model import make_ascii_served_model_dir
from tests.smg_utils import smg_fleet

FETCHED = 'llmsvc_grpc_requests_total{code="OK",method="GetTokenizer",service="vllm.grpc.engine.VllmEngine"}'


def test_gateway_without_the_model_takes_the_tokenizer_from_the_worker(tmp_path):
    d = make_ascii_served_model_dir(tmp_path / "m", max_position_embeddings=4096)

    def hide_model():  # the replica has loaded it; the path it reports now leads nowhere here
        shutil.move(d, d + ".elsewhere")

    with smg_fleet(d, replicas=1, after_load=hide_model) as fleet:
        assert not os.path.exists(d)
        status, toks = fleet.get("/v1/tokenizers")
        assert status == 200 and toks["tokenizers"][0]["vocab_size"] == 259
        status, got = fleet.post("/v1/chat/completions", {
            "model": fleet.model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6,
            "temperature": 0, "ignore_eos": True})
        assert status == 200, got
        assert got["usage"]["completion_tokens"] == 6 and got["choices"][0]["message"]["content"]
        # the template came along: the prompt is the rendered conversation, not the bare text
        assert got["usage"]["prompt_tokens"] > len("hello") + 4
        assert fleet.replicas[0].metrics().get(FETCHED, 0) >= 1
