"""Run an LlmServer on 127.0.0.1 (free port) in a background event-loop thread, for tests.

`tiny_tokenizer()` is a real HF fast tokenizer (byte-level, id == byte value, no merges) with a
chat template, built in milliseconds. `fake_engine_factory()` is the real LLMEngine over the
FakeExecutor of tests/engine_fakes.py (no model compute), generating lowercase letters.
"""
from __future__ import annotations

import asyncio
import threading
import time

import grpc

from llmsvc.server.app import LlmServer
from llmsvc.v1 import llmsvc_pb2_grpc as pb_grpc

EOS, IM_START, IM_END = 256, 257, 258
TINY_VOCAB = 259
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_tokenizer(chat_template: bool = True):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from llmsvc.server.responses import _byte_decoder
    vocab = {ch: b for ch, b in _byte_decoder().items()}
    vocab.update({"<|endoftext|>": EOS, "<|im_start|>": IM_START, "<|im_end|>": IM_END})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    return fast


def letters(tokens: list[int]) -> int:
    from tests.engine_fakes import next_token
    return 97 + next_token(tokens, 26)  # 'a'..'z'


def make_tiny_served_model_dir(path, **cfg) -> str:
    """A tiny random Llama whose vocabulary is tiny_tokenizer()'s, saved with that tokenizer:
    a model directory `llmsvc serve` can load. `cfg` overrides config fields."""
    from tests.model_utils import make_tiny_model_dir

    d = make_tiny_model_dir(path, **{"vocab_size": TINY_VOCAB, "eos_token_id": EOS,
                                     "bos_token_id": IM_START, "pad_token_id": 0, **cfg})
    tiny_tokenizer().save_pretrained(d)
    return d


def fake_engine_factory(*, num_blocks: int = 64, block_size: int = 4, max_model_len: int = 256,
                        max_num_seqs: int = 8, max_waiting_requests: int = 4096, step_delay: float = 0.0,
                        chat_template: bool = True, token_fn=letters, fail_after: int | None = None,
                        policy: str = "fcfs", stream_interval: int = 1, num_host_blocks: int = 0,
                        speculative_config=None):
    """A factory (as LlmServer wants) of real LLMEngines over the FakeExecutor (num_host_blocks:
    a swap space of that many blocks, preemption by swap; speculative_config: a SpeculativeConfig,
    drafts the fake verifies against token_fn)."""
    from llmsvc.engine.llm_engine import LLMEngine
    from tests.engine_fakes import FakeExecutor, make_config

    def make():
        config = make_config(num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len,
                             max_num_seqs=max_num_seqs, max_num_batched_tokens=64, policy=policy)
        config.model_config.vocab_size = TINY_VOCAB
        config.model_config.eos_token_ids = [EOS]
        config.model_config.architecture = "FakeForCausalLM"
        config.scheduler_config.max_waiting_requests = max_waiting_requests
        config.scheduler_config.stream_interval = stream_interval
        config.cache_config.swap_space_bytes = 1 if num_host_blocks else 0
        config.speculative_config = speculative_config
        ex = FakeExecutor(config, num_blocks=num_blocks, token_fn=token_fn, fail_after=fail_after,
                          num_host_blocks=num_host_blocks)
        if step_delay:
            inner = ex.execute_model

            def slow(so):
                time.sleep(step_delay)
                return inner(so)
            ex.execute_model = slow
        engine = LLMEngine(config, ex, tiny_tokenizer(chat_template))
        engine.fake_executor = ex
        return engine
    return make


class ServerThread:
    """LlmServer in its own thread + loop. Use as a context manager; always stops the server."""

    def __init__(self, engine_factory, load: bool = True, **server_kw) -> None:
        self.server = LlmServer(engine_factory, host="127.0.0.1", port=0, **server_kw)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-server", daemon=True)
        self._thread.start()
        self.port = self.call(self.server.start())
        self.address = f"127.0.0.1:{self.port}"
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.LlmServiceStub(self.channel)
        if load:
            self.load()

    def call(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def load(self) -> None:
        self.call(self.server.load(), timeout=600)

    @property
    def engine(self):
        return self.server.async_engine.engine

    def stop(self, grace: float = 0.0) -> None:
        try:
            self.channel.close()
            self.call(self.server.shutdown(grace))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)

    def __enter__(self) -> "ServerThread":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
