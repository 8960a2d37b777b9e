"""LlmService: the llmsvc.v1 RPCs over an AsyncEngine. Runs on the event loop; never computes.

Generate: id (body | x-request-id | uuid4) -> validation -> initial metadata (x-request-id, before
prefill) -> AsyncEngine.generate -> messages. Cancel, disconnect and deadline expiry raise
CancelledError here, which closes the engine generator and aborts the request.
The request id and labels are put in `request_id_var` / `request_labels_var` so every log line of
the call carries them; each output feeds the per-request Prometheus series (`metrics`, a
ServerMetrics, when set), labelled by the allow-listed label keys.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

import grpc

from executors import registry as executor_registry
from llmsvc.server import errors
from llmsvc.server.door_outputs import door_outputs
from llmsvc.server.logging_setup import request_id_var, request_labels_var
from llmsvc.server.prompt import has_chat_template
from llmsvc.server.tokenize_rpc import detokenize, tokenize
from llmsvc.server.responses import ResponseBuilder
from llmsvc.server.rpc_wrap import deadline_passed, final_code
from llmsvc.server.v1_request import to_engine_request
from llmsvc.server.validation import (ModelLimits, check_abort_ids, check_abort_reason, check_labels,
                                      check_request_id)
from llmsvc.v1 import llmsvc_pb2 as pb
from llmsvc.v1 import llmsvc_pb2_grpc as pb_grpc
from llmsvc.version import installed_version

logger = logging.getLogger(__name__)
API_VERSION = "llmsvc.v1"
# requests bigger than this are tokenized/validated on a worker thread: a multi-MiB prompt takes
# seconds to tokenize and must not stall the event loop (every other stream, health checks)
INLINE_PROMPT_BYTES = 64 << 10
MAX_ABORT_IDS = 128 + 4096  # Abort's id limit before the model is loaded: the default request capacity


async def off_loop_if_large(request, fn, *args):
    """fn(*args), on a worker thread when `request` is large (the tokenizer releases the GIL)."""
    if request.ByteSize() > INLINE_PROMPT_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


@dataclass
class ServerState:
    """What the server knows about itself (shared by servicer, health and shutdown)."""

    ready: bool = False  # model loaded and warmed up
    draining: bool = False
    start_time: float = field(default_factory=time.time)
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    device: str = "cpu"


def log_finished(rid: str, tracker, num_prompt_tokens: int, lora_name: str | None = None) -> None:
    """The one INFO line a finished Generate leaves (every door): its reasons and token counts."""
    logger.info("request %s finished: %s; %d prompt tokens, %d generated%s", rid,
                ",".join(tracker.reasons[i] for i in sorted(tracker.reasons)) or "-", num_prompt_tokens,
                tracker.num_generated, f"; LoRA {lora_name}" if lora_name else "")


def log_cancelled(rid: str, draining: bool = False) -> None:
    """The INFO line of a Generate whose call ended early: while the server drains, the stop at
    the end of the grace period may be what cancelled it, not the client."""
    why = "the client, its deadline or the end of the shutdown grace" if draining else "the client or its deadline"
    logger.info("request %s cancelled by %s", rid, why)


class LlmService(pb_grpc.LlmServiceServicer):
    """Registered before the model loads (answers UNAVAILABLE until `attach`)."""

    def __init__(self, state: ServerState | None = None) -> None:
        self.state = state or ServerState()
        self.engine = self.tokenizer = self.config = self.limits = None
        self.metrics = None  # llmsvc.server.metrics.ServerMetrics: per-request series
        self.tracer = None  # llmsvc.server.tracing.RequestTracer: a span per Generate, when tracing is on
        self.log_requests = True  # one INFO line per finished or cancelled Generate

    def attach(self, async_engine, tokenizer, config) -> None:
        """Serve from this (started, warmed-up) engine; `config` is the resolved EngineConfig."""
        self.engine, self.tokenizer, self.config = async_engine, tokenizer, config
        # the length requests are held to: the model's context, or the KV pool's when smaller
        self.limits = ModelLimits.from_config(config, getattr(async_engine.engine, "request_limits", None))

    def _require_model(self) -> None:
        if self.engine is None:
            raise errors.unavailable("model is loading; retry shortly", reason="LOADING")

    # ---- Generate --------------------------------------------------------------------
    def _check_serving(self) -> None:
        self._require_model()
        if self.engine.dead_error is not None:
            raise errors.unavailable("the engine loop died; retry on another replica", reason="ENGINE_DEAD")
        if self.state.draining:
            raise errors.unavailable("server is draining; retry on another replica", reason="DRAINING")
        if not self.state.ready:
            raise errors.unavailable("model is loading; retry shortly", reason="LOADING")

    @staticmethod
    def _request_id(request, context) -> str:
        if request.request_id:
            return request.request_id
        for k, v in context.invocation_metadata() or ():
            if k == "x-request-id" and v:
                return v
        return uuid.uuid4().hex

    async def Generate(self, request, context):
        start_ns = time.time_ns()
        rid = self._request_id(request, context)
        tracker = params = ids = None
        code, message = grpc.StatusCode.OK, ""
        rid_ok = False  # a refused id is not echoed (logs, error details): it may be huge or hold control characters
        try:
            self._check_serving()
            check_request_id(rid)
            rid_ok = True
            request_id_var.set(rid)  # this RPC's task only
            request_labels_var.set(dict(request.labels) or None)
            remaining = context.time_remaining()
            if remaining is not None and remaining <= 0:
                raise errors.ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline expired before admission")
            check_labels(request.labels)
            req = await off_loop_if_large(request, to_engine_request, request, rid, self.tokenizer, self.limits)
            params, ids, lora_name = req.sampling_params, req.prompt_token_ids, req.lora_name
            builder = ResponseBuilder(rid, request, params, self.tokenizer)
            logger.debug("request %s admitted: %d prompt tokens, traceparent=%s", rid, len(ids),
                         dict(context.invocation_metadata() or ()).get("traceparent"))
            # headers (the id, before prefill) once the engine took it: a refusal before then
            # is headers-free, so a client's retry policy can retry it (gRFC A6)
            if self.metrics is not None:  # the key lora_name carries the adapter ("": the base model)
                tracker = self.metrics.track(params.n, {**request.labels, "lora_name": lora_name or ""})

            async def on_admitted():
                if tracker is not None:
                    tracker.admitted = True
                await context.send_initial_metadata((("x-request-id", rid),))
            gen = self.engine.generate(req, on_admitted=on_admitted)  # admission validates it, once
            try:
                async for msg in self._messages(gen, request.stream, builder, tracker):
                    yield msg
            finally:
                await gen.aclose()
            if tracker is not None and self.log_requests:
                log_finished(rid, tracker, len(ids), lora_name)
        except (asyncio.CancelledError, GeneratorExit):
            code = grpc.StatusCode.CANCELLED
            if tracker is not None:
                tracker.cancelled()
            if self.log_requests:
                log_cancelled(rid, self.state.draining)
            raise
        except Exception as e:  # noqa: BLE001 - every failure becomes a status
            # a constraint that fails to compile is refused after admission (the compile runs
            # beside the queue); like a refusal before it, it finished no completion
            if tracker is not None and (tracker.started or
                                        errors.to_service_error(e).code != grpc.StatusCode.INVALID_ARGUMENT):
                tracker.cancelled()
            if isinstance(e, grpc.aio.AbortError):
                code = final_code(context, e)
                raise
            if self.tracer is not None:  # the span's status; abort() maps it again for the call
                err = errors.to_service_error(e)
                code, message = err.code, err.message
            await errors.abort(context, e, rid if rid_ok else None)
        finally:
            if self.tracer is not None:
                # usage only for a request the engine admitted (admission validates inside generate)
                self._trace(rid if rid_ok else "", context, start_ns, code, message, params, ids,
                            tracker if tracker is not None and tracker.admitted else None)

    @staticmethod
    async def _messages(gen, stream: bool, builder: ResponseBuilder, tracker):
        """The response messages of the engine's outputs: each delta as it comes (stream), or
        one message per index once the request finished (unary)."""
        async for out in door_outputs(gen, stream, tracker.observe if tracker is not None else None):
            if stream:
                for msg in builder.stream_messages(out):
                    yield msg
            else:
                for comp in sorted(out.outputs, key=lambda c: c.index):
                    yield builder.message(out, comp)

    def _trace(self, rid, context, start_ns, code, message, params, ids, tracker) -> None:
        if code == grpc.StatusCode.CANCELLED and deadline_passed(context):
            code = grpc.StatusCode.DEADLINE_EXCEEDED
        try:
            self.tracer.record(request_id=rid, metadata=context.invocation_metadata(), start_ns=start_ns,
                               end_ns=time.time_ns(), code=code, message=message,
                               model=self.config.model_config.served_model_name if self.config else "",
                               params=params, prompt_tokens=len(ids) if ids is not None else None,
                               tracker=tracker)
        except Exception:  # noqa: BLE001 - tracing never fails a request
            logger.warning("tracing: could not record request %s", rid, exc_info=True)

    # ---- small RPCs ---------------------------------------------------------------------
    async def Abort(self, request, context):
        try:
            check_abort_reason(request.reason)  # every aborted stream gets it back
            sc = self.config.scheduler_config if self.config is not None else None
            check_abort_ids(request.request_ids, sc.max_num_seqs + sc.max_waiting_requests if sc else MAX_ABORT_IDS)
        except Exception as e:  # noqa: BLE001
            await errors.abort(context, e)
        if self.engine is None:
            return pb.AbortResponse(not_found=list(request.request_ids))
        not_found = set(self.engine.abort(list(request.request_ids), reason=request.reason or "aborted by client"))
        return pb.AbortResponse(aborted=[r for r in request.request_ids if r not in not_found],
                                not_found=[r for r in request.request_ids if r in not_found])

    async def Tokenize(self, request, context):
        try:
            self._require_model()
            return await off_loop_if_large(request, tokenize, request, self.tokenizer, self.limits)
        except Exception as e:  # noqa: BLE001
            await errors.abort(context, e)

    async def Detokenize(self, request, context):
        try:
            self._require_model()
            return await off_loop_if_large(request, detokenize, request, self.tokenizer, self.limits)
        except Exception as e:  # noqa: BLE001
            await errors.abort(context, e)

    async def GetModelInfo(self, request, context):
        if self.engine is None:
            await errors.abort(context, errors.unavailable("model is loading; retry shortly", reason="LOADING"))
        mc = self.config.model_config
        resp = pb.GetModelInfoResponse(
            model_id=mc.model_source or mc.model_dir or "", served_model_name=mc.served_model_name,
            architecture=mc.architecture, dtype=mc.dtype, quantization=mc.quantization,
            max_model_len=self.limits.max_model_len,
            vocab_size=mc.vocab_size, eos_token_ids=list(self.engine.engine.eos_token_ids),
            has_chat_template=has_chat_template(self.tokenizer),
            supported_constraints=list(self.limits.supported_constraints))
        if mc.bos_token_id is not None:
            resp.bos_token_id = mc.bos_token_id
        if mc.pad_token_id is not None:
            resp.pad_token_id = mc.pad_token_id
        d = self.limits.default_sampling()
        resp.default_sampling.CopyFrom(pb.SamplingParams(n=1, **d))
        default_max = self.limits.generation_defaults.get("max_tokens")
        if default_max:
            resp.default_stopping.max_tokens = int(default_max)
        for entry in self.engine.lora_entries():
            resp.lora_adapters.add(name=entry.name, path=entry.path, rank=entry.rank)
        return resp

    async def GetServerInfo(self, request, context):
        resp = pb.GetServerInfoResponse(version=installed_version(), api_version=API_VERSION,
                                        instance_id=self.state.instance_id,
                                        uptime_seconds=time.time() - self.state.start_time,
                                        device=self.state.device, draining=self.state.draining)
        if self.engine is None:
            return resp
        st = self.engine.get_stats()
        c = self.config
        resp.MergeFrom(pb.GetServerInfoResponse(
            tensor_parallel_size=c.parallel_config.tensor_parallel_size,
            executor=executor_registry.wire_name(c.parallel_config),
            kv_block_size=c.cache_config.block_size, num_kv_blocks=st.num_kv_blocks,
            num_free_kv_blocks=st.num_free_kv_blocks, max_num_seqs=c.scheduler_config.max_num_seqs,
            max_num_batched_tokens=c.scheduler_config.max_num_batched_tokens, num_running=st.num_running,
            num_waiting=st.num_waiting, kv_cache_usage=st.kv_cache_usage,
            prefix_cache_hit_rate=st.prefix_cache_hit_rate, draining=self.state.draining))
        if "num_swap_blocks" in st.extra:  # a swap space (llmsvc/core/swap.py)
            resp.num_swapped, resp.num_swap_blocks = st.extra["num_swapped"], st.extra["num_swap_blocks"]
            resp.num_free_swap_blocks = st.extra["num_free_swap_blocks"]
        resp.preemption_mode = st.extra.get("preemption_mode", "recompute")
        if c.lora_config is not None:
            resp.max_loras, resp.max_lora_rank = c.lora_config.max_loras, c.lora_config.max_lora_rank
        if c.speculative_config is not None:
            resp.speculative_method = c.speculative_config.method
            resp.num_speculative_tokens = c.speculative_config.num_speculative_tokens
            if st.spec_decode is not None:
                resp.spec_decode_acceptance_rate = st.spec_decode.acceptance_rate
                resp.spec_decode_mean_acceptance_length = st.spec_decode.mean_acceptance_length
        return resp
