"""The public Gateway service: parse and tokenize, hand the request to the scheduler, stream its
events back as GenerateResponse messages.

Nothing here blocks the event loop: a prompt is size-checked first (request_id at most 128 bytes,
the text no longer than max_model_len tokens could be) and then tokenized on a worker thread with
its own copy of the tokenizer (the step thread decodes with another, so neither waits for the
other). Validation is the Scheduler's (specsplit.request.validate, one place for every caller);
its RequestError kinds map to status codes here: INVALID_ARGUMENT, RESOURCE_EXHAUSTED (running +
queued full), UNAVAILABLE (verifier down, draining). A client that cancels, or whose deadline
passes, has its stream ended at once and its sequence released on both services after the step.
"""
from __future__ import annotations

import asyncio
import copy
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Awaitable, Callable, Sequence

import grpc
import numpy as np
from jinja2 import TemplateError

from specsplit.gateway.chat_prompt import ChatPrompt, loads_list
from specsplit.gateway.scheduler_thread import Event, SchedulerThread, status_of
from specsplit.gateway.tools import ToolError
from specsplit.gateway.token_bytes import TokenBytes
from specsplit.v1 import gateway_pb2, gateway_pb2_grpc
from specsplit.rpc.wire import ServiceError, grammar_from_pb, logprobs_to_pb
from specsplit.request import (MAX_CHOICES, MAX_REQUEST_ID_BYTES, GenerationRequest, Limits, RequestError, choice_seed,
                               validate)
from specsplit.sampling.grammar import GrammarCompiler, GrammarError
from specsplit.sampling.params import SamplingParams

log = logging.getLogger(__name__)

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
# A prompt longer than this many characters per token of max_model_len is refused before it is
# tokenized (no tokenizer in use here makes tokens that long; the gRPC limit caps bytes anyway).
MAX_PROMPT_CHARS_PER_TOKEN = 64
MAX_CHAT_MESSAGES = 256
MAX_ROLE_CHARS = 32

__all__ = ["Limits", "MAX_CHOICES", "SERVICE_NAME", "GatewayServicer", "Tokenizer", "build_request", "chat_of",
           "choices_of", "nth_choice", "request_from_pb", "response_pb"]


def _invalid(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message)


class Tokenizer:
    """The target's tokenizer, one copy for encoding (request handlers, on a worker thread) and one
    for decoding (the step thread): a long encode never stalls streaming."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.chat = ChatPrompt.of(tokenizer)  # how function tools reach the template (gateway/chat_prompt.py)
        try:
            self._encoder = copy.deepcopy(tokenizer)
            self._decode_lock = threading.Lock()
        except Exception:  # not copyable: share it, behind one lock
            self._encoder = tokenizer
            self._decode_lock = None
        self._encode_lock = threading.Lock()
        if self._decode_lock is None:
            self._decode_lock = self._encode_lock
        self._token_bytes = TokenBytes(tokenizer, tokenizer.decode)

    def encode(self, text: str) -> list[int]:
        with self._encode_lock:
            return list(self._encoder(text).input_ids)

    def _apply(self, messages: list[dict], tools: list | None, tokenize: bool, add_generation_prompt: bool = True,
               continue_final_message: bool = False):
        if not getattr(self._encoder, "chat_template", None):
            raise _invalid("the target's tokenizer has no chat template: send prompt text instead of messages")
        try:
            turns, template_tools = self.chat.inputs(messages, tools)
        except ToolError as e:
            raise _invalid(str(e)) from None
        try:
            return self._encoder.apply_chat_template(turns, tools=template_tools, add_generation_prompt=add_generation_prompt,
                                                     continue_final_message=continue_final_message,
                                                     tokenize=tokenize, return_dict=False)
        except (TemplateError, ValueError) as e:  # the template's own checks (roles, order, ...)
            raise _invalid(f"the model's chat template refused these messages: {e}") from None

    def encode_chat(self, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> list[int]:
        """Chat turns rendered with the model's template, plus the assistant's generation prompt
        (unless add_generation_prompt is false; continue_final_message: the last turn is left open,
        to be continued). messages: OpenAI's ({"role", "content", "tool_calls"?, "tool_call_id"?});
        tools: OpenAI tool specs (gateway/chat_prompt.py decides how both are rendered)."""
        with self._encode_lock:
            return list(self._apply(messages, tools, True, add_generation_prompt, continue_final_message))

    def chat_text(self, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = True,
                  continue_final_message: bool = False) -> str:
        """The prompt encode_chat tokenizes, as text."""
        with self._encode_lock:
            return self._apply(messages, tools, False, add_generation_prompt, continue_final_message)

    def encode_request(self, msg: gateway_pb2.GenerateRequest) -> list[int]:
        """The prompt ids of a request: its ids, its text, or its chat messages (and tools)."""
        if msg.prompt_token_ids:
            return list(msg.prompt_token_ids)
        if msg.prompt:
            return self.encode(msg.prompt)
        return self.encode_chat(*chat_of(msg), **chat_options(msg))

    def decode(self, ids: list[int]) -> str:
        with self._decode_lock:
            return self.tokenizer.decode(ids)

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes: a piece of a character split over several tokens included
        (gateway/token_bytes.py); what the HTTP API's logprobs name and count tokens by."""
        with self._decode_lock:
            return self._token_bytes(token_id)


def chat_options(msg: gateway_pb2.GenerateRequest) -> dict:
    """How the chat template renders a request's messages: add_generation_prompt (unset: true,
    unless continue_final_message) and continue_final_message."""
    cont = msg.continue_final_message
    add = msg.add_generation_prompt if msg.HasField("add_generation_prompt") else not cont
    return {"add_generation_prompt": add, "continue_final_message": cont}


def chat_of(msg: gateway_pb2.GenerateRequest) -> tuple[list[dict], list | None]:
    """A request's messages as OpenAI chat messages, and its tool specs (None: none); INVALID_ARGUMENT
    when tools_json or a message's tool_calls_json is not a JSON list."""
    try:
        tools = loads_list(msg.tools_json, "tools_json", "tools")
        messages = []
        for i, m in enumerate(msg.messages):
            turn = {"role": m.role, "content": m.content}
            calls = loads_list(m.tool_calls_json, f"messages[{i}].tool_calls_json", "messages")
            if calls:
                turn["tool_calls"] = calls
            if m.tool_call_id:
                turn["tool_call_id"] = m.tool_call_id
            messages.append(turn)
    except ToolError as e:
        raise _invalid(str(e)) from None
    return messages, tools


def _decimal(x: float) -> float:
    return float(str(np.float32(x)))


def check_before_tokenizing(msg: gateway_pb2.GenerateRequest, limits: Limits) -> None:
    """The cheap checks that must come before any work: INVALID_ARGUMENT."""
    rid = len(msg.request_id.encode("utf-8", "surrogatepass"))
    if rid > MAX_REQUEST_ID_BYTES:
        raise _invalid(f"request_id is {rid} bytes; at most {MAX_REQUEST_ID_BYTES} are allowed")
    if not msg.prompt_token_ids and not msg.prompt and not msg.messages:
        raise _invalid("the prompt is empty: set prompt (text), prompt_token_ids or messages")
    if msg.max_tokens < 1 and not msg.HasField("prompt_logprobs"):
        raise _invalid("max_tokens must be >= 1 (0 only with prompt_logprobs: score the prompt)")
    if len(msg.messages) > MAX_CHAT_MESSAGES:
        raise _invalid(f"{len(msg.messages)} chat messages; at most {MAX_CHAT_MESSAGES} are allowed")
    for i, m in enumerate(msg.messages):
        if not m.role or len(m.role) > MAX_ROLE_CHARS:
            raise _invalid(f"messages[{i}].role must be a non-empty name of at most {MAX_ROLE_CHARS} characters")
    if msg.continue_final_message or msg.HasField("add_generation_prompt"):
        if msg.prompt or msg.prompt_token_ids or not msg.messages:
            raise _invalid("add_generation_prompt and continue_final_message apply to chat messages only")
        if msg.continue_final_message and msg.messages[-1].role != "assistant":
            raise _invalid("continue_final_message needs the last message to be the assistant's (the answer's "
                           f"start to continue), got {msg.messages[-1].role!r}")
        if msg.continue_final_message and msg.HasField("add_generation_prompt") and msg.add_generation_prompt:
            raise _invalid("continue_final_message cannot be combined with add_generation_prompt true: the output "
                           "continues the last message instead of starting a new one")
    limit = limits.max_model_len * MAX_PROMPT_CHARS_PER_TOKEN
    chars = len(msg.prompt) if msg.prompt else len(msg.tools_json) + sum(
        len(m.content) + len(m.tool_calls_json) for m in msg.messages)
    if not msg.prompt_token_ids and chars > limit:
        raise _invalid(f"the prompt is {chars} characters; max_model_len {limits.max_model_len} "
                       f"cannot hold it (refused above {limit} characters without tokenizing)")
    if not msg.prompt_token_ids and msg.max_tokens >= limits.max_model_len:
        # a text prompt is not tokenized yet (the exact check follows, with its count); it holds a token at least
        raise _invalid(f"max_tokens ({msg.max_tokens}) leaves no room for the prompt in max_model_len "
                       f"{limits.max_model_len}; lower max_tokens below {limits.max_model_len} less the prompt's tokens")
    k = msg.truncate_prompt_tokens
    if not -1 <= k <= limits.max_model_len:
        raise _invalid(f"truncate_prompt_tokens must be in [-1, max_model_len {limits.max_model_len}] (the last k "
                       f"prompt tokens; -1: the last max_model_len; 0: off), got {k}")
    if k and msg.HasField("prompt_logprobs"):
        raise _invalid("truncate_prompt_tokens cannot be combined with prompt_logprobs (echo): the scores would "
                       "be of another prompt than the one sent")
    n = len(truncated(msg.prompt_token_ids, k, limits))
    if n + msg.max_tokens > limits.max_model_len:
        raise _invalid(
            f"prompt ({n} tokens) + max_tokens ({msg.max_tokens}) = "
            f"{n + msg.max_tokens} exceeds max_model_len {limits.max_model_len}; "
            f"shorten the prompt or lower max_tokens"
        )


def truncated(ids: Sequence[int], k: int, limits: Limits) -> Sequence[int]:
    """A request's prompt ids after its truncate_prompt_tokens k: the last k (-1: the last
    max_model_len; 0: all of them)."""
    keep = limits.max_model_len if k == -1 else k
    return ids[len(ids) - keep:] if 0 < keep < len(ids) else ids


def choices_of(msg: gateway_pb2.GenerateRequest) -> int:
    """How many choices a request asks for (n; 0 = 1). INVALID_ARGUMENT above MAX_CHOICES."""
    n = msg.n or 1
    if n > MAX_CHOICES:
        raise _invalid(f"n must be in [1, {MAX_CHOICES}], got {n}")
    return n


def nth_choice(msg: gateway_pb2.GenerateRequest, i: int) -> gateway_pb2.GenerateRequest:
    """Choice i of a request's n: an independent sample of the same request (its own request to
    the scheduler; a seeded one draws with seed + i, so the n choices of a seed are reproducible
    and choice 0 is the seed's own stream). One choice: the request itself."""
    if (msg.n or 1) == 1:
        return msg
    out = gateway_pb2.GenerateRequest()
    out.CopyFrom(msg)
    if msg.request_id:  # none given: the logs name the seq id; else within the caller's bound, suffix and all
        suffix = f"-{i}"
        base = msg.request_id.encode("utf-8", "surrogatepass")[:MAX_REQUEST_ID_BYTES - len(suffix)]
        out.request_id = base.decode("utf-8", "ignore") + suffix
    if msg.HasField("seed"):
        out.seed = choice_seed(msg.seed, i)
    return out


def build_request(msg: gateway_pb2.GenerateRequest, ids: list[int]) -> GenerationRequest:
    """GenerateRequest + its prompt ids -> GenerationRequest (the Scheduler validates it)."""
    # top_p is optional: unset (or 0, what a proto3 client without `optional` sends) means 1.0
    t, k = msg.temperature, msg.top_k
    p = msg.top_p if msg.HasField("top_p") and msg.top_p != 0.0 else 1.0
    # The API's floats are float32: take the shortest decimal they stand for (0.7, not 0.69999999),
    # the value `specsplit generate` uses locally, so seeded samples match the local mode.
    params = SamplingParams(
        _decimal(t), _decimal(p), int(k), int(msg.seed) if msg.HasField("seed") else None,
        presence_penalty=_decimal(msg.presence_penalty), frequency_penalty=_decimal(msg.frequency_penalty),
        repetition_penalty=_decimal(msg.repetition_penalty) if msg.HasField("repetition_penalty") else 1.0,
        logit_bias=tuple(sorted((int(t), _decimal(b)) for t, b in msg.logit_bias.items())),
        grammar=grammar_from_pb(msg.grammar) if msg.HasField("grammar") else None,
        min_tokens=int(msg.min_tokens), min_p=_decimal(msg.min_p),
    )
    return GenerationRequest(
        request_id=msg.request_id,
        prompt_token_ids=tuple(ids),
        max_tokens=int(msg.max_tokens),
        params=params,
        ignore_eos=msg.ignore_eos,
        num_speculative_tokens=int(msg.speculation.num_speculative_tokens),
        disable_speculation=msg.speculation.disable,
        stop=tuple(msg.stop),
        include_stop_str_in_output=msg.include_stop_str_in_output,
        stop_token_ids=tuple(int(t) for t in msg.stop_token_ids),
        logprobs=int(msg.logprobs) if msg.HasField("logprobs") else None,
        prompt_logprobs=int(msg.prompt_logprobs) if msg.HasField("prompt_logprobs") else None,
    )


def request_from_pb(msg: gateway_pb2.GenerateRequest, encode: Callable[[gateway_pb2.GenerateRequest], list[int]],
                    limits: Limits) -> GenerationRequest:
    """The whole path a GenerateRequest takes before the scheduler, on one thread (tests, tools):
    the cheap checks, tokenization (`encode`: e.g. Tokenizer.encode_request), conversion,
    validation. ServiceError(INVALID_ARGUMENT)."""
    check_before_tokenizing(msg, limits)
    return checked_request(msg, encode(msg), limits)


def checked_request(msg: gateway_pb2.GenerateRequest, ids: list[int], limits: Limits) -> GenerationRequest:
    """build_request on the ids its truncate_prompt_tokens leaves, then the request's bounds
    (specsplit.request.validate) as a ServiceError."""
    req = build_request(msg, list(truncated(ids, msg.truncate_prompt_tokens, limits)))
    try:
        validate(req, limits)
    except RequestError as e:
        raise status_of(e) from None
    return req


def response_pb(ev: Event, index: int = 0) -> gateway_pb2.GenerateResponse:
    msg = gateway_pb2.GenerateResponse(token_ids=ev.token_ids, text=ev.text, finish_reason=ev.finish_reason or "",
                                       proposed_draft_tokens=ev.proposed, accepted_draft_tokens=ev.accepted, index=index)
    if ev.logprobs:
        msg.logprobs.extend(logprobs_to_pb(ev.logprobs))
    if ev.prompt_logprobs:
        msg.prompt_logprobs.extend(logprobs_to_pb(ev.prompt_logprobs))
    if ev.usage is not None:
        msg.usage.CopyFrom(gateway_pb2.Usage(**ev.usage))
    return msg


DRAINING_MESSAGE = "the server is shutting down; send the request to another one"


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, scheduler: SchedulerThread, tokenizer: Tokenizer, limits: Limits,
                 server_info: Callable[[], Awaitable[gateway_pb2.ServerInfo]],
                 grammars: GrammarCompiler | None = None, capacity: tuple[int, int] | None = None):
        """grammars: compiles structured-output grammars at admission (None: they are refused).
        capacity: (max_num_seqs, max_queue): requests running, queued and being tokenized at once
        (None: unbounded); past their sum a request is RESOURCE_EXHAUSTED before any work on it."""
        self.scheduler = scheduler
        self.grammars = grammars  # colocated: the verifier's own, so its step thread finds them cached
        self.tokenizer = tokenizer
        self.limits = limits
        self.server_info = server_info
        self.capacity = capacity
        self.draining = False
        self.admitting = 0  # requests past admission, not yet handed to the scheduler (tokenizing)
        self._tokenize = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    @property
    def busy(self) -> bool:
        """Requests live anywhere: being tokenized or in the scheduler (the drain waits for none)."""
        return self.admitting > 0 or self.scheduler.inflight > 0

    @contextmanager
    def _admission(self):
        """A place for one request, counted from before it is tokenized until the scheduler has it."""
        live = self.scheduler.inflight + self.admitting
        if self.capacity is not None and live >= sum(self.capacity):
            max_num_seqs, max_queue = self.capacity
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"the server is full: {live} requests running, queued or being tokenized (max_num_seqs "
                               f"{max_num_seqs} + max_queue {max_queue}); retry later or send it to another server")
        self.admitting += 1
        try:
            yield
        finally:
            self.admitting -= 1

    async def prompt_ids(self, msg) -> list[int]:
        """The prompt's ids, tokenized on the worker thread; INVALID_ARGUMENT when the tokenizer refuses."""
        if msg.prompt_token_ids:
            return list(msg.prompt_token_ids)
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._tokenize, self.tokenizer.encode_request, msg)
        except ServiceError:
            raise
        except Exception as e:  # e.g. a chat template that refuses these roles
            raise _invalid(f"cannot tokenize the {'messages' if msg.messages else 'prompt'}: {e}") from None

    async def decode_ids(self, ids: list[int]) -> str:
        """Token ids -> text, on the tokenizer's worker thread (the HTTP API's /detokenize)."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize, self.tokenizer.decode, ids)

    async def submit(self, msg: gateway_pb2.GenerateRequest, sink: Callable[[Event], None],
                     prepare: Callable[[gateway_pb2.GenerateRequest, list[int]], None] | None = None):
        """The one path from a GenerateRequest to the scheduler, for the gRPC and the HTTP API alike:
        draining, the cheap checks, admission (before tokenizing: a full server does no work on a
        request), tokenization on the worker thread, `prepare(msg, ids)` (the HTTP API's defaults
        that depend on the prompt's length), build_request and its bounds, the grammar's compile
        (`admit`), the Scheduler. Returns its Request; ServiceError otherwise (UNAVAILABLE when the
        drain began while it was being tokenized or compiled)."""
        if self.draining:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, DRAINING_MESSAGE)
        check_before_tokenizing(msg, self.limits)
        with self._admission():
            ids = await self.prompt_ids(msg)
            if self.draining:
                raise ServiceError(grpc.StatusCode.UNAVAILABLE, DRAINING_MESSAGE)
            if prepare is not None:
                prepare(msg, ids)
            req = checked_request(msg, ids, self.limits)  # before compiling: a cheap refusal comes first
            await self.admit(req)
            if self.draining:
                raise ServiceError(grpc.StatusCode.UNAVAILABLE, DRAINING_MESSAGE)
            return self.scheduler.submit(req, sink)

    async def submit_choices(self, msg: gateway_pb2.GenerateRequest, sinks: list[Callable[[Event], None]],
                             prepare: Callable[[gateway_pb2.GenerateRequest, list[int]], None] | None = None) -> list:
        """The n choices of a request (one sink each, len(sinks) == choices_of(msg)), each through
        `submit`, the one place both APIs build them. A choice refused (a full server, a drain) or a
        caller that goes away aborts the ones submitted before it. Returns their Requests."""
        n = choices_of(msg)
        assert len(sinks) == n, (len(sinks), n)
        if n > 1:  # the caller's request, before its choices' ids are derived (one choice is the request)
            check_before_tokenizing(msg, self.limits)
        live: list = []
        try:
            for i, sink in enumerate(sinks):
                live.append(await self.submit(nth_choice(msg, i), sink, prepare))
        except BaseException:
            for req in live:
                self.scheduler.abort(req)
            raise
        return live

    async def admit(self, req: GenerationRequest) -> None:
        """Admission work before the scheduler: compile the request's grammar (cached by its text,
        on the compiler's threads, at most --grammar-timeout seconds). ServiceError(INVALID_ARGUMENT)."""
        g = req.params.grammar
        if g is None:
            return
        if self.grammars is None:
            raise _invalid("structured output (a grammar / response_format) is not available on this server")
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, self.grammars.compile, g)
        except GrammarError as e:
            raise _invalid(str(e)) from None

    async def Generate(self, request, context):
        """One stream for the request's n choices, their messages interleaved as they come (each
        names its choice: GenerateResponse.index); it ends when every choice has finished. An error
        in any choice aborts the others and ends the stream with its status."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

        def sink_of(i: int) -> Callable[[Event], None]:
            def sink(ev: Event) -> None:
                try:
                    loop.call_soon_threadsafe(events.put_nowait, (i, ev))
                except RuntimeError:  # the loop is closed: nobody is listening any more
                    pass
            return sink

        try:
            lives = await self.submit_choices(request, [sink_of(i) for i in range(choices_of(request))])
        except ServiceError as e:
            await context.abort(e.code, e.message)
        finished = [False] * len(lives)
        try:
            while not all(finished):
                i, ev = await events.get()
                if ev.error is not None:
                    finished[i] = True
                    err = status_of(ev.error)
                    await context.abort(err.code, err.message)
                if ev.finish_reason is not None:
                    finished[i] = True
                yield response_pb(ev, i)
        finally:
            for live, done in zip(lives, finished):
                if not done:  # cancelled, deadline, the client went away, or another choice failed
                    self.scheduler.abort(live)

    async def GetServerInfo(self, request, context):
        return await self.server_info()

    async def tokenize(self, msg: gateway_pb2.TokenizeRequest) -> list[int]:
        """The ids a Generate with `msg`'s prompt would start from: its fields in a GenerateRequest,
        the cheap checks, the tokenizer's worker thread. ServiceError(INVALID_ARGUMENT)."""
        if bool(msg.prompt) == bool(msg.messages):
            raise _invalid("send a prompt (text) or messages (chat), one of the two")
        req = gateway_pb2.GenerateRequest(prompt=msg.prompt, messages=msg.messages, tools_json=msg.tools_json,
                                          continue_final_message=msg.continue_final_message, max_tokens=1)
        if msg.HasField("add_generation_prompt"):
            req.add_generation_prompt = msg.add_generation_prompt
        check_before_tokenizing(req, self.limits)
        return await self.prompt_ids(req)

    async def Tokenize(self, request, context):
        try:
            ids = await self.tokenize(request)
        except ServiceError as e:
            await context.abort(e.code, e.message)
        return gateway_pb2.TokenizeResponse(token_ids=ids, max_model_len=self.limits.max_model_len)
