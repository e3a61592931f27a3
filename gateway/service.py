"""The public Gateway service: validate and tokenize, hand the request to the scheduler, stream
its events back as GenerateResponse messages.

A request is checked completely before anything is allocated: an empty prompt, prompt +
max_tokens past max_model_len, temperature < 0, top_p outside (0, 1], top_k < 0 and token ids
outside the vocabulary get INVALID_ARGUMENT; a full server RESOURCE_EXHAUSTED; a draining one
UNAVAILABLE. A client that cancels, or whose deadline passes, has its sequence released on
both services between steps.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from dataclasses import dataclass
from typing import Awaitable, Callable

import grpc
import numpy as np

from gateway.scheduler import Event, Scheduler
from rpc.wire import ServiceError
from protos.specsplit.v1 import gateway_pb2, gateway_pb2_grpc
from specsplit.generation import GenerationRequest
from specsplit.sampling.params import SamplingParams

log = logging.getLogger(__name__)

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
MAX_SPECULATIVE_TOKENS = 32
MAX_STOP_STRINGS = 16


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_model_len: int


def _invalid(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message)


class Tokenizer:
    """The target's tokenizer behind a lock (the step thread decodes while handlers encode)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        with self._lock:
            return list(self.tokenizer(text).input_ids)

    def decode(self, ids: list[int]) -> str:
        with self._lock:
            return self.tokenizer.decode(ids)


def _decimal(x: float) -> float:
    return float(str(np.float32(x)))


def build_request(msg: gateway_pb2.GenerateRequest, tokenizer: Tokenizer, limits: Limits) -> tuple[GenerationRequest, list[str]]:
    """GenerateRequest -> (GenerationRequest, stop strings), or INVALID_ARGUMENT."""
    if not msg.prompt_token_ids and not msg.prompt:
        raise _invalid("the prompt is empty: set prompt (text) or prompt_token_ids")
    if msg.max_tokens < 1:
        raise _invalid("max_tokens must be >= 1")
    # top_p is optional: unset (or 0, what a proto3 client without `optional` sends) means 1.0
    t, k = msg.temperature, msg.top_k
    p = msg.top_p if msg.HasField("top_p") and msg.top_p != 0.0 else 1.0
    # The API's floats are float32: take the shortest decimal they stand for (0.7, not 0.69999999),
    # the value `specsplit generate` uses locally, so seeded samples match the local mode.
    params = SamplingParams(_decimal(t), _decimal(p), int(k), int(msg.seed) if msg.HasField("seed") else None)
    try:
        params.validate()  # the one place the sampling rules live (NaN / inf, temperature bounds, ...)
    except ValueError as e:
        hint = " (leave it unset for no nucleus filtering)" if str(e).startswith("top_p") else ""
        raise _invalid(f"{e}{hint}") from None
    spec = msg.speculation
    if spec.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
        raise _invalid(f"speculation.num_speculative_tokens must be <= {MAX_SPECULATIVE_TOKENS}, got {spec.num_speculative_tokens}")
    stop = list(msg.stop)
    if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
        raise _invalid(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings")
    ids = list(msg.prompt_token_ids) if msg.prompt_token_ids else tokenizer.encode(msg.prompt)
    if not ids:
        raise _invalid("the prompt tokenizes to no tokens")
    bad = [i for i in ids if not 0 <= i < limits.vocab_size]
    if bad:
        raise _invalid(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {limits.vocab_size})")
    if len(ids) + msg.max_tokens > limits.max_model_len:
        raise _invalid(
            f"prompt ({len(ids)} tokens) + max_tokens ({msg.max_tokens}) = {len(ids) + msg.max_tokens} "
            f"exceeds max_model_len {limits.max_model_len}; shorten the prompt or lower max_tokens"
        )
    seq_id = f"{msg.request_id or 'req'}-{uuid.uuid4().hex[:12]}"
    req = GenerationRequest(
        request_id=seq_id,
        prompt_token_ids=tuple(ids),
        max_tokens=int(msg.max_tokens),
        params=params,
        ignore_eos=msg.ignore_eos,
        num_speculative_tokens=int(spec.num_speculative_tokens),
        disable_speculation=spec.disable,
    )
    return req, stop


def response_pb(ev: Event) -> gateway_pb2.GenerateResponse:
    msg = gateway_pb2.GenerateResponse(token_ids=ev.token_ids, text=ev.text, finish_reason=ev.finish_reason or "")
    if ev.usage is not None:
        msg.usage.CopyFrom(gateway_pb2.Usage(**ev.usage))
    return msg


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, scheduler: Scheduler, tokenizer: Tokenizer, limits: Limits,
                 server_info: Callable[[], Awaitable[gateway_pb2.ServerInfo]]):
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.limits = limits
        self.server_info = server_info
        self.draining = False

    async def Generate(self, request, context):
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down; send the request to another one")
        try:
            req, stop = build_request(request, self.tokenizer, self.limits)
        except ServiceError as e:
            await context.abort(e.code, e.message)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def sink(ev: Event) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, ev)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

        try:
            self.scheduler.submit(req, stop, sink)
        except ServiceError as e:
            await context.abort(e.code, e.message)
        finished = False
        try:
            while True:
                ev = await events.get()
                if ev.error is not None:
                    finished = True
                    await context.abort(ev.error.code, ev.error.message)
                if ev.finish_reason is not None:
                    finished = True
                yield response_pb(ev)
                if finished:
                    return
        finally:
            if not finished:  # cancelled, deadline, or the client went away
                self.scheduler.abort(req.request_id)

    async def GetServerInfo(self, request, context):
        return await self.server_info()
