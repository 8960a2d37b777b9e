"""Offline inference: `LLM(...).generate(prompts, SamplingParams(...))`, as in vLLM."""
from __future__ import annotations

import dataclasses
import itertools
import os
import threading
import time
from collections.abc import Sequence

from llmsvc.chat_content import joined_text
from llmsvc.config import EngineConfig, parse_memory  # noqa: F401 - parse_memory: public here too
from llmsvc.engine.chat_roles import developer_as_system
from llmsvc.engine.chat_rules import check_chat_dicts, parsed_tool_calls
from llmsvc.engine.validation import default_max_tokens
from llmsvc.extras import require_server_extra
from llmsvc.outputs import CONTEXT, LENGTH, RequestOutput
from llmsvc.sampling_params import GENERATION_DEFAULTS, RequestOutputKind, SamplingParams

_GEN_DEFAULT_KEYS = (*GENERATION_DEFAULTS, "max_tokens")  # max_tokens: generation_config's max_new_tokens


class LLM:
    """An engine in this process, driven to completion by `generate`.

    `executor`: a name of executors/registry.py or an `executors.base.Executor` subclass, which
    is built with the EngineConfig (as vLLM's distributed_executor_backend takes a class).
    Extra keyword arguments go to the config sections that have such a field
    (e.g. block_size, num_kv_blocks_override, policy, enable_chunked_prefill, device,
    async_scheduling=True: schedule the next step while the model runs this one)."""

    def __init__(self, model: str | None = None, dtype: str = "auto", executor: str | type = "uniproc",
                 tensor_parallel_size: int = 1, max_model_len: int | None = None, max_num_seqs: int = 128,
                 max_num_batched_tokens: int = 1024, kv_cache_memory: int | str | None = None,
                 enable_prefix_caching: bool = True, seed: int = 0, **kw) -> None:
        require_server_extra("llmsvc.LLM")
        try:
            config = EngineConfig.from_options(
                model=model, dtype=dtype, max_model_len=max_model_len, seed=seed, executor=executor,
                tensor_parallel_size=tensor_parallel_size, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens, kv_cache_memory=kv_cache_memory,
                enable_prefix_caching=enable_prefix_caching, log_stats_interval_s=0.0, **kw)
        except TypeError as e:
            raise TypeError(f"LLM() got an unexpected keyword argument: {e}") from None
        from llmsvc.engine.llm_engine import LLMEngine

        self.llm_engine = LLMEngine.from_config(config)
        self._closed = False
        self._lock = threading.Lock()
        self._counter = itertools.count()
        self._lora_use: list[str] = []  # adapter names, least recently used first

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (vLLM's name); False while requests hold KV blocks."""
        self._check_open()
        with self._lock:
            return self.llm_engine.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation_config defaults, as vLLM does."""
        defaults = self.llm_engine.config.model_config.generation_defaults or {}
        return SamplingParams(**{k: defaults[k] for k in _GEN_DEFAULT_KEYS if defaults.get(k) is not None})

    def generate(self, prompts: str | list[int] | dict | Sequence[str | list[int] | dict],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm=True, priority: int | Sequence[int] | None = None,
                 lora_request=None) -> list[RequestOutput]:
        """Generate for every prompt (a str, a list of token ids, or vLLM's prompt dicts
        {"prompt": str} / {"prompt_token_ids": [int, ...]}, either with an optional "cache_salt");
        outputs in input order. lora_request: the adapter (of LLM(lora_modules={name: path}))
        every prompt runs with, by name or as a LoRARequest, or a list of those (None: the base
        model), one per prompt. priority: one for all prompts or one each. use_tqdm: a bool, or
        a tqdm-like class to build the progress bar with. An output that reached max_model_len
        finishes "length", as in vLLM (the engine's own reason is "context")."""
        self._check_open()
        if (isinstance(prompts, (str, dict))
                or (isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int))):
            prompts = [prompts]
        if not isinstance(prompts, Sequence):
            raise TypeError(f"prompts must be a str, token ids, a prompt dict or a list of them, "
                            f"got {type(prompts).__name__}")
        prompts = list(prompts)
        defaulted = sampling_params is None
        if defaulted:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if not all(isinstance(p, SamplingParams) for p in sampling_params):
            raise TypeError("sampling_params must be a SamplingParams or a list of them")
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        if isinstance(priority, int):
            priority = [priority] * len(prompts)
        if priority is not None and (isinstance(priority, str) or not all(isinstance(p, int) for p in priority)):
            raise TypeError("priority must be an int or a list of ints, one per prompt")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(priority)} priorities")
        loras = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(loras)} LoRA requests")
        # one engine, stepped (and its adapters loaded) by one call at a time: calls from other
        # threads wait their turn
        with self._lock:
            loras = self._resolve_loras(loras)
            tok = self.get_tokenizer()
            engine = self.llm_engine
            self._compile_constraints(sampling_params)
            ids = []
            try:
                for i, (prompt, params) in enumerate(zip(prompts, sampling_params)):
                    text, token_ids = _prompt_parts(prompt, tok)
                    params = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
                    if defaulted:  # a default that does not fit runs to the context, as over gRPC
                        params.max_tokens = default_max_tokens(params.max_tokens, len(token_ids), params,
                                                               engine.max_model_len)
                    rid = str(next(self._counter))
                    engine.add_request(rid, token_ids, params, prompt=text,
                                       priority=0 if priority is None else priority[i],
                                       cache_salt=prompt.get("cache_salt") if isinstance(prompt, dict) else None,
                                       lora_name=loras[i])
                    ids.append(rid)
                return self._run(ids, use_tqdm)
            except BaseException:
                engine.abort_request(ids)
                while engine.has_unfinished_requests():  # drain the abort outputs; frees every block
                    engine.step()
                raise

    def _resolve_loras(self, requests: list) -> list[str | None]:
        """Adapter names for the prompts. A LoRARequest of an adapter not loaded yet loads it, as
        vLLM's LLM does (LLM(enable_lora=True, max_loras=N)); when the slots are full, the adapter
        used longest ago that this call does not need is unloaded first. A LoRARequest naming a
        loaded adapter with another path is refused."""
        names = []
        for r in requests:
            if r is not None and not isinstance(r, str) and not hasattr(r, "lora_name"):
                raise TypeError(f"lora_request must be a name, a LoRARequest or None, got {type(r).__name__}")
            names.append(r if r is None or isinstance(r, str) else r.lora_name)
        engine, needed = self.llm_engine, {n for n in names if n is not None}
        for r in requests:
            if r is None or isinstance(r, str) or not getattr(r, "lora_path", ""):
                continue
            loaded = {e.name: e for e in engine.loras.entries()}
            if r.lora_name in loaded:
                if os.path.realpath(r.lora_path) != os.path.realpath(loaded[r.lora_name].path):
                    raise ValueError(f"LoRA adapter {r.lora_name!r} is loaded from {loaded[r.lora_name].path}, "
                                     f"not {r.lora_path}")
                continue
            cfg = engine.config.lora_config
            if cfg is not None and len(loaded) >= cfg.max_loras:
                idle = [n for n in self._lora_use if n in loaded and n not in needed]
                if not idle:
                    raise ValueError(f"this call needs {len(needed)} LoRA adapters; max_loras is {cfg.max_loras}")
                engine.remove_lora(idle[0])
                self._lora_use.remove(idle[0])
            engine.add_lora(r.lora_name, r.lora_path)
        for n in needed:  # most recently used last
            if n in self._lora_use:
                self._lora_use.remove(n)
            self._lora_use.append(n)
        return names

    def _compile_constraints(self, sampling_params: Sequence[SamplingParams]) -> None:
        """Compile every distinct structured-output constraint (in parallel, in the engine's
        pool) before queueing anything, so a bad one raises ConstraintError (a ValueError)
        here rather than aborting its request mid-run."""
        manager = self.llm_engine.structured_output_manager
        specs = {p.structured_outputs.key(): p.structured_outputs
                 for p in sampling_params if p.structured_outputs is not None}
        if not specs or manager is None:
            return  # no constraint, or add_request refuses them (no grammar engine)
        for so in specs.values():
            manager.submit(so)
        for so in specs.values():
            manager.wait(so)

    def _run(self, ids: list[str], use_tqdm) -> list[RequestOutput]:
        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        bar, n_out, start = None, 0, time.perf_counter()
        if use_tqdm and len(ids) > 1:
            if callable(use_tqdm):
                tqdm = use_tqdm
            else:
                from tqdm.auto import tqdm
            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        for c in out.outputs:
                            if c.finish_reason == CONTEXT:  # vLLM has no reason of its own for it
                                c.finish_reason = LENGTH
                        done[out.request_id] = out
                        if bar is not None:  # as vLLM's bar: the output rate of the run so far
                            n_out += sum(len(o.token_ids) for o in out.outputs)
                            bar.update(1)
                            rate = n_out / max(time.perf_counter() - start, 1e-9)
                            bar.set_postfix_str(f"output: {rate:.1f} toks/s", refresh=False)
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params=None, use_tqdm: bool = True,
             add_generation_prompt: bool | None = None, continue_final_message: bool = False,
             tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
             lora_request=None, **template_kwargs) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate (vLLM's
        arguments: add_generation_prompt defaults to not continue_final_message; tools and
        chat_template_kwargs reach the template; lora_request as for generate)."""
        self._check_open()
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message cannot be combined with add_generation_prompt=True")
        add_gen = not continue_final_message if add_generation_prompt is None else add_generation_prompt
        extra = {**(chat_template_kwargs or {}), **template_kwargs}
        for own in ("add_generation_prompt", "tokenize", "conversation"):  # this method's, as in vLLM
            extra.pop(own, None)
        convs = [messages] if not messages or isinstance(messages[0], dict) else list(messages)
        convs = [check_chat_dicts(conv, extra, tools) for conv in convs]  # the gRPC doors' rules
        if tools:
            extra["tools"] = tools
        if continue_final_message:
            extra["continue_final_message"] = True
        tok = self.get_tokenizer()
        prompts = []
        for conv in convs:
            conv = developer_as_system([parsed_tool_calls({**m, "content": joined_text(m["content"])}) for m in conv],
                                      tok.chat_template)
            text = tok.apply_chat_template(conv, add_generation_prompt=add_gen, tokenize=False, **extra)
            # the template writes the special tokens itself (as the server and vLLM encode it)
            ids = tok(text, add_special_tokens=False)["input_ids"]
            prompts.append({"prompt": text, "prompt_token_ids": list(ids)})  # RequestOutput.prompt: the text
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def shutdown(self) -> None:
        self._closed = True
        self.llm_engine.shutdown()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this LLM has been shut down (shutdown() or the end of its with block); "
                               "build a new LLM to generate again")

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """vLLM's LoRARequest: the adapter called lora_name, loaded from lora_path when the LLM does
    not serve it yet (lora_int_id is accepted for compatibility; the engine numbers adapters)."""
    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""


def _prompt_parts(prompt, tok) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of one prompt: a str, token ids, or a vLLM prompt dict."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), _token_ids(prompt["prompt_token_ids"])
        if isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], tok.encode(prompt["prompt"])
        raise ValueError(f"a prompt dict needs 'prompt' (str) or 'prompt_token_ids'; got keys {sorted(prompt)}")
    if isinstance(prompt, str):
        return prompt, tok.encode(prompt)
    return None, _token_ids(prompt)


def _token_ids(ids) -> list[int]:
    if not isinstance(ids, Sequence):
        raise TypeError(f"a prompt must be a str, token ids or a prompt dict, got {type(ids).__name__}")
    if isinstance(ids, (str, bytes)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise TypeError("token ids must be a sequence of ints")
    return list(ids)
