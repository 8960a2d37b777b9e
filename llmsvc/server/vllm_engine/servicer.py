"""VllmEngineService: vLLM's engine gRPC protocol (vllm.grpc.engine.VllmEngine) over the same
AsyncEngine as llmsvc.v1. Runs on the event loop; never computes.

Generate maps its request onto one EngineRequest (mapper.py) and hands it to
AsyncEngine.generate, whose admission validates it; errors come back on this proto's field
paths. Cancel, disconnect and deadline expiry close the engine generator, which aborts the
request. The other RPCs read the engine's stats and configuration (docs/vllm-engine.md lists
what each one maps to).
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid

import grpc

from llmsvc.sampling_fields import declared
from llmsvc.sampling_params import SamplingParams
from llmsvc.server import errors
from llmsvc.server.door_outputs import door_outputs
from llmsvc.server.logging_setup import request_id_var
from llmsvc.server.servicer import (MAX_ABORT_IDS, ServerState, log_cancelled, log_finished,
                                     off_loop_if_large)
from llmsvc.server.validation import ModelLimits, check_abort_ids, check_request_id
from llmsvc.server.vllm_engine.kv_events import CursorError, KVEventRelay, StreamEnded
from llmsvc.server.vllm_engine.loads import LoadTracker
from llmsvc.server.vllm_engine.mapper import input_field, to_engine_request, vllm_error
from llmsvc.server.vllm_engine.proto import common_pb2 as cpb
from llmsvc.server.vllm_engine.proto import vllm_engine_pb2 as pb
from llmsvc.server.vllm_engine.proto import vllm_engine_pb2_grpc as pb_grpc
from llmsvc.server.vllm_engine.responses import ResponseBuilder
from llmsvc.server.vllm_engine.tokenizer_bundle import TokenizerBundle, chunks
from llmsvc.version import installed_version

logger = logging.getLogger(__name__)
SERVER_TYPE = "llmsvc-grpc"
# generation_config keys a gateway may fill into requests that leave them unset: the sampling
# fields declared to take generation_config's default that this proto carries
GATEWAY_DEFAULT_KEYS = tuple(f.name for f, facts in declared(SamplingParams)
                             if facts.generation_config and f.name in pb.SamplingParams.DESCRIPTOR.fields_by_name)


class VllmEngineService(pb_grpc.VllmEngineServicer):
    """Registered before the model loads (UNAVAILABLE / unhealthy until `attach`)."""

    def __init__(self, state: ServerState | None = None) -> None:
        self.state = state or ServerState()
        self.engine = self.tokenizer = self.config = self.limits = None
        self.metrics = None  # llmsvc.server.metrics.ServerMetrics: per-request series (as llmsvc.v1's)
        self.log_requests = True  # one INFO line per finished or cancelled Generate (as llmsvc.v1's)
        self.loads = LoadTracker()
        self.kv_events: KVEventRelay | None = None
        self.bundle: TokenizerBundle | None = None
        self.last_receive_time = 0.0

    async def attach(self, async_engine, tokenizer, config) -> None:
        """Serve from this (started, warmed-up) engine; starts the KV-event relay, which turns the
        engine's event recording on."""
        self.engine, self.tokenizer, self.config = async_engine, tokenizer, config
        self.limits = ModelLimits.from_config(config, getattr(async_engine.engine, "request_limits", None))
        self.bundle = TokenizerBundle(tokenizer, config.model_config.model_dir)
        relay = KVEventRelay(async_engine.follow_kv_events, async_engine.wait_dead,
                             lambda full: self.loads.engine_load(async_engine.get_stats(), config, full))
        try:
            await relay.start()
        except Exception as e:  # noqa: BLE001 - an engine without an event journal: no KV events
            logger.warning("KV events unavailable (%s: %s); SubscribeKvEvents answers UNIMPLEMENTED",
                           type(e).__name__, e)
            return
        self.kv_events = relay

    async def close(self, why: str = "the server is stopping") -> None:
        """End every SubscribeKvEvents stream (a gateway then stops routing here)."""
        if self.kv_events is not None:
            await self.kv_events.stop(why)

    # ---- state --------------------------------------------------------------------------------
    def _not_serving_reason(self) -> str | None:
        if self.engine is None or not self.state.ready:
            return "model is loading"
        if self.engine.dead_error is not None:
            return "the engine loop died"
        if self.state.draining:
            return "server is draining"
        return None

    def _check_serving(self) -> None:
        why = self._not_serving_reason()
        if why is not None:
            reason = {"model is loading": "LOADING", "server is draining": "DRAINING"}.get(why, "ENGINE_DEAD")
            raise errors.unavailable(f"{why}; retry on another replica", reason=reason)

    # ---- Generate ---------------------------------------------------------------------------
    async def Generate(self, request, context):
        rid = request.request_id or uuid.uuid4().hex
        self.last_receive_time = time.time()
        tracker = None
        rid_ok = False  # a refused id is not echoed in error details (it may be huge)
        try:
            self._check_serving()
            check_request_id(rid)
            rid_ok = True
            request_id_var.set(rid)
            req = await off_loop_if_large(request, to_engine_request, request, rid, self.tokenizer, self.limits)
            params = req.sampling_params
            if self.metrics is not None:
                tracker = self.metrics.track(params.n, {"lora_name": ""})

            async def on_admitted():
                if tracker is not None:
                    tracker.admitted = True
                await context.send_initial_metadata((("x-request-id", rid),))
            self.loads.submitted(rid, len(req.prompt_token_ids))
            gen = self.engine.generate(req, on_admitted=on_admitted)
            try:
                async for msg in self._responses(gen, request.stream, params, rid, tracker):
                    yield msg
            finally:
                self.loads.finished(rid)
                await gen.aclose()
            if tracker is not None and self.log_requests:
                log_finished(rid, tracker, len(req.prompt_token_ids))
        except (asyncio.CancelledError, GeneratorExit):
            if tracker is not None:
                tracker.cancelled()
            if self.log_requests:
                log_cancelled(rid, self.state.draining)
            raise
        except Exception as e:  # noqa: BLE001 - every failure becomes a status
            if tracker is not None:
                tracker.cancelled()
            if isinstance(e, grpc.aio.AbortError):
                raise
            await errors.abort(context, vllm_error(e, input_field(request)), rid if rid_ok else None)

    async def _responses(self, gen, stream: bool, params, rid: str, tracker):
        """The messages of one request's engine outputs (responses.py has the shapes)."""
        builder = ResponseBuilder(params.logprobs, params.prompt_logprobs)

        def observe(out) -> None:
            self.loads.started(rid)
            if tracker is not None:
                tracker.observe(out)

        async for out in door_outputs(gen, stream, observe):
            for msg in builder.stream_messages(out) if stream else builder.final_messages(out):
                yield msg

    # ---- small RPCs -------------------------------------------------------------------------
    async def Abort(self, request, context):
        try:
            sc = self.config.scheduler_config if self.config is not None else None
            check_abort_ids(request.request_ids, sc.max_num_seqs + sc.max_waiting_requests if sc else MAX_ABORT_IDS)
        except Exception as e:  # noqa: BLE001
            await errors.abort(context, e)
        if self.engine is not None and request.request_ids:
            self.engine.abort(list(request.request_ids), reason="aborted by client")
        return pb.AbortResponse()

    async def HealthCheck(self, request, context):
        why = self._not_serving_reason()
        if why is None:
            return pb.HealthCheckResponse(healthy=True, message="serving")
        return pb.HealthCheckResponse(healthy=False, message=why)

    async def Embed(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            "Embed is not served: llmsvc runs generative models only (no pooling / embedding "
                            "head); use Generate")

    async def StartProfile(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "StartProfile is not served: llmsvc has no profiler "
                                                           "to start over gRPC")

    async def StopProfile(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "StopProfile is not served: llmsvc has no profiler "
                                                          "to stop over gRPC")

    async def FlushCache(self, request, context):
        """Forget the prefix cache. It can only be flushed while no request holds KV blocks: with
        timeout_s > 0 this retries until the engine is idle or the time is up (or the call's
        deadline). Open to any caller the server admits, as vLLM's worker has it: a gateway's
        cache flush reaches its workers through here (docs/vllm-engine.md)."""
        if not (math.isfinite(request.timeout_s) and request.timeout_s >= 0):
            await errors.abort(context, errors.invalid("timeout_s", f"must be a finite number of seconds >= 0, "
                                                                    f"got {request.timeout_s}"))
        if self.engine is None:
            return cpb.FlushCacheResponse(success=False, message="model is loading")
        deadline = time.monotonic() + request.timeout_s
        while True:
            try:
                if await self.engine.reset_prefix_cache():  # its `cleared` went out before this
                    return cpb.FlushCacheResponse(success=True, message="prefix cache flushed")
            except Exception as e:  # noqa: BLE001 - engine dead or stopping
                return cpb.FlushCacheResponse(success=False, message=f"engine not running: {type(e).__name__}")
            if time.monotonic() >= deadline:
                return cpb.FlushCacheResponse(success=False, message="requests in flight hold KV blocks; "
                                              "retry when idle, or pass timeout_s to wait for it")
            await asyncio.sleep(0.05)

    async def GetModelInfo(self, request, context):
        if self.engine is None:
            await errors.abort(context, errors.unavailable("model is loading; retry shortly", reason="LOADING"))
        mc = self.config.model_config
        defaults = {k: mc.generation_defaults[k] for k in GATEWAY_DEFAULT_KEYS
                    if isinstance((mc.generation_defaults or {}).get(k), (int, float))}
        resp = pb.GetModelInfoResponse(
            model_path=mc.model_source or mc.model_dir or "", is_generation=True,
            max_context_length=self.limits.max_model_len, vocab_size=mc.vocab_size, supports_vision=False,
            served_model_name=mc.served_model_name, tokenizer_path=mc.tokenizer_dir or "",
            model_type=getattr(mc.hf_config, "model_type", "") or "",
            architectures=[mc.architecture] if mc.architecture else [],
            eos_token_ids=list(self.engine.engine.eos_token_ids),
            max_req_input_len=self.limits.max_model_len - 1,
            default_sampling_params_json=json.dumps(defaults) if defaults else "")
        if mc.pad_token_id is not None:
            resp.pad_token_id = mc.pad_token_id
        if mc.bos_token_id is not None:
            resp.bos_token_id = mc.bos_token_id
        return resp

    async def GetServerInfo(self, request, context):
        resp = pb.GetServerInfoResponse(
            is_paused=self.state.draining, last_receive_timestamp=self.last_receive_time,
            uptime_seconds=time.time() - self.state.start_time, server_type=SERVER_TYPE, data_parallel_size=1)
        if self.engine is not None:
            st, c = self.engine.get_stats(), self.config
            resp.active_requests = st.num_running + st.num_waiting
            resp.block_size = c.cache_config.block_size
            resp.model_dtype = f"torch.{c.model_config.dtype}"  # vLLM's spelling, model_config.dtype's repr
            resp.kv_cache_dtype = "auto"  # vLLM's cache_dtype for "the model's dtype", which the KV cache takes
            resp.max_num_seqs = c.scheduler_config.max_num_seqs
            resp.constrained_decoding_start = "first_token"
        return resp

    async def GetLoads(self, request, context):
        if request.HasField("dp_rank") and request.dp_rank != 0:
            await errors.abort(context, errors.invalid("dp_rank", f"this server is one rank (0), got {request.dp_rank}"))
        stats = self.engine.get_stats() if self.engine is not None else None
        return self.loads.response(stats, self.config, installed_version())

    async def GetTokenizer(self, request, context):
        if self.bundle is None:
            await errors.abort(context, errors.unavailable("model is loading; retry shortly", reason="LOADING"))
        data, sha256 = await self.bundle.archive()
        for chunk in chunks(data, sha256):
            yield chunk

    async def SubscribeKvEvents(self, request, context):
        # headers at once: a gateway gives up on a subscription that sends none within seconds
        await context.send_initial_metadata(())
        if self.kv_events is None:
            if self.engine is None:
                await errors.abort(context, errors.unavailable("model is loading; retry shortly", reason="LOADING"))
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this engine records no prefix-cache events "
                                "(SubscribeKvEvents needs its KV-event journal)")
        try:
            sub = await self.kv_events.subscribe(request.start_sequence_number)
        except CursorError as e:
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, str(e))
        except StreamEnded as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        try:
            while True:
                try:
                    batch = await sub.next()
                except StreamEnded as e:
                    code = grpc.StatusCode.DATA_LOSS if e.data_loss else grpc.StatusCode.UNAVAILABLE
                    await context.abort(code, str(e))
                yield batch
        finally:
            self.kv_events.unsubscribe(sub)
