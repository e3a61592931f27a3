"""The OpenAI-compatible HTTP API of the gateway (`specsplit gateway` and `specsplit serve` with
--http-port): FastAPI on uvicorn, in the gateway's own asyncio loop, beside the gRPC server.

It is a second front door to the same path, not a second path: a JSON body becomes the
GenerateRequest the gRPC API takes, and goes through the gRPC servicer's own steps (the cheap
checks before tokenizing, tokenization on its worker thread, build_request, the Scheduler's
validation and admission); the scheduler's Events stream back as OpenAI objects or SSE chunks.

  GET  /v1/models                    the served target
  POST /v1/completions               prompt: a string, a list of one string, or token ids
  POST /v1/chat/completions          messages, rendered with the target's chat template
  POST /tokenize, /detokenize        vLLM's: a prompt's (or chat's) ids as generation would see them; ids -> text
  GET  /version                      the server's version
  GET  /health                       200 while serving; 503 while the verifier is down or draining
  GET  /metrics                      Prometheus text, the process's registry (specsplit.rpc.metrics); token

Defaults follow OpenAI: temperature 1.0 and top_p 1.0 when unset (the gRPC API's default is
greedy: send temperature 0 for greedy here); max_tokens 16 for completions and the rest of
max_model_len for chat. Extensions: top_k, ignore_eos. n (1..16) choices: independent samples, each a
request of its own to the scheduler (a seeded request's choice i draws with seed + i). Completions
take echo: the prompt's text, and with logprobs its tokens' (the first null), from the verifier's
prefill (GenerateRequest.prompt_logprobs); max_tokens 0 with echo scores the prompt only.
Chat takes OpenAI's function calling: tools and tool_choice (none, auto, required, a named
function; the last two forced through the structured-output grammar), assistant tool_calls and
tool messages in the conversation, rendered by the model's chat template when it takes tools,
else as a Hermes-style system block (gateway/chat_prompt.py decides, in the servicer's Tokenizer);
the answer parsed back into tool_calls (gateway/tools.py); streamed, as the text decides it
(gateway/tool_stream.py ToolCallStream: content deltas, and each call once nothing after it can change it,
or with --tool-call-stream eager its header at once and then its arguments in pieces).

Errors are OpenAI's JSON, {"error": {"message", "type", "param", "code"}}, with the HTTP status
of the RequestError kind (invalid_argument 400, resource_exhausted 429, unavailable 503, other
500), 401 without the server's bearer token (--auth-token-file, the gRPC API's token; only /health
stays open, like gRPC health; /metrics needs the token, --metrics-port serves it without), 413 for
a body over --max-request-bytes (counted as it arrives, chunked bodies too), 404 for an unknown
model or route. The token is checked before any of the body is read (_Guard).
A client that disconnects has its request aborted: nothing stays allocated.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import socket
import ssl
import time
import uuid
from contextlib import contextmanager
from typing import Any, Callable, Sequence

import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

from specsplit.gateway.scheduler_thread import status_of
from specsplit import __version__
from specsplit.detokenizer import TextStream
from specsplit.gateway.service import MAX_CHOICES, GatewayServicer
from specsplit.gateway.token_bytes import token_name
from specsplit.gateway.tool_stream import ToolCallStream
from specsplit.gateway.tools import (ToolError, ToolPlan, finish_reason, message_calls, parse_calls,
                                     plan_tools)
from specsplit.v1 import common_pb2, gateway_pb2
from specsplit.rpc.security import ServerSecurity
from specsplit.rpc.wire import ServiceError
from specsplit.request import MAX_LOGPROBS, Event, TokenLogprob
from specsplit.sampling.params import MAX_LOGIT_BIAS_ENTRIES

log = logging.getLogger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# /v1/completions with a batch of prompts: prompts x n at most (each choice is a request; lm-eval's
# local-completions sends its batch_size prompts in one request)
MAX_BATCH_CHOICES = 64
MAX_DETOKENIZE_PER_CONTEXT = 4  # /detokenize takes at most this many x max_model_len ids
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default (the gRPC API's is 0, greedy)
SHUTDOWN_GRACE_S = 5.0

# gRPC status (what the shared helpers raise) -> HTTP status, OpenAI error type, code
_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", None),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error", "invalid_api_key"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", None),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_exceeded", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error", "timeout"),
}
# Request fields a validation message may start with, as a whole word: the error's `param`.
_PARAMS = ("max_tokens", "min_tokens", "min_p", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "stop", "logprobs", "prompt",
           "messages", "request_id", "continue_final_message", "add_generation_prompt", "truncate_prompt_tokens",
           "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "ignore_eos", "prompt_logprobs", "n")
# a grammar the engines refuse ("the json_schema grammar does not compile: ...") came from this field
_GRAMMAR_PARAM = "response_format"


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def api_error(e: ServiceError) -> ApiError:
    status, type_, code = _HTTP.get(e.code, (500, "server_error", None))
    param = next((p for p in _PARAMS if e.message.startswith(p) and not e.message[len(p):len(p) + 1].isidentifier()), None)
    if param is None and e.message.startswith("the ") and " grammar " in e.message:
        param = _GRAMMAR_PARAM
    if param == "prompt" and "max_model_len" in e.message:
        param = None
    if status >= 500 and code is None:
        code = e.code.name.lower()
    return ApiError(status, e.message, type_, param, code)


def _invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


# ---- request bodies (unknown fields are accepted and ignored, as OpenAI-compatible servers do,
# except the extensions in UNSUPPORTED_EXTENSIONS) --
class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension: 0 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension (vLLM's): token ids that end the output, kept in it
    min_tokens: int | None = None  # extension (vLLM's): no EOS / stop before this many tokens; 0 = off
    min_p: float | None = None  # extension (vLLM's): keep tokens with probability >= min_p x the largest; 0 = off
    include_stop_str_in_output: bool | None = False  # extension (vLLM's): the text keeps the stop string
    truncate_prompt_tokens: int | None = None  # extension (vLLM's): keep the last k prompt tokens (-1: max_model_len)
    prompt_logprobs: int | None = None  # extension (vLLM's): each prompt token's logprob and rank, + the n most likely
    stream: bool | None = False
    stream_options: dict | None = None
    n: int | None = None
    ignore_eos: bool | None = False  # extension
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    repetition_penalty: float | None = None  # extension: transformers' rule, 1 = off
    response_format: dict | None = None  # chat (and, as an extension, completions): structured output
    user: str | None = None


class CompletionBody(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessageBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict] | None = None
    tool_calls: list | None = None  # an assistant's calls (rendered as gateway/chat_prompt.py decides)
    tool_call_id: str | None = None  # a tool message's answer to that call


class ChatBody(_Body):
    messages: list[ChatMessageBody]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list | None = None  # function tools (gateway/tools.py)
    tool_choice: str | dict | None = None  # "none" | "auto" | "required" | {"type": "function", "function": {"name"}}
    add_generation_prompt: bool | None = None  # extension (vLLM's): unset = true unless continue_final_message
    continue_final_message: bool | None = None  # extension (vLLM's): the output continues the last (assistant) message


class TokenizeBody(BaseModel):
    """vLLM's /tokenize: a prompt text, or chat messages (with tools) rendered by the template."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageBody] | None = None
    tools: list | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    add_special_tokens: bool | None = None  # only its default: the ids a generation request would use
    return_token_strs: bool | None = False


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[int]


def _completion_prompts(p) -> list[str | list[int]]:
    """/v1/completions' prompt -> its prompts: one string, one list of token ids, or a batch of
    either (OpenAI's four forms); each is its own n choices."""
    if isinstance(p, str) or (p and all(isinstance(t, int) for t in p)):
        prompts = [p]
    elif p and all(isinstance(x, str) for x in p) or p and all(isinstance(x, list) for x in p):
        prompts = list(p)
    else:
        raise _invalid("the prompt is empty" if not p else "prompt must be a string, a list of token ids, or a "
                       "list of either", "prompt")
    for i, x in enumerate(prompts):
        if not x:
            raise _invalid("the prompt is empty" if len(prompts) == 1 else f"prompt {i} of the batch is empty", "prompt")
    return prompts


# vLLM's request extensions this server does not implement: refused when set to anything but their
# neutral value, since ignoring them as unknown fields are ignored would change the answer
# silently. field -> (its neutral values, what to send instead or None).
UNSUPPORTED_EXTENSIONS: dict[str, tuple[tuple, str | None]] = {
    "use_beam_search": ((None, False), None),
}


def _check_unsupported(body: _Body) -> None:
    if body.n is not None and not 1 <= body.n <= MAX_CHOICES:
        raise _invalid(f"n must be in [1, {MAX_CHOICES}], got {body.n}", "n")
    for name, value in (body.model_extra or {}).items():
        if name in UNSUPPORTED_EXTENSIONS and value not in UNSUPPORTED_EXTENSIONS[name][0]:
            instead = UNSUPPORTED_EXTENSIONS[name][1]
            raise _invalid(f"{name} is not supported by this server{f'; use {instead}' if instead else ''} "
                           f"(or leave it out)", name)
    if isinstance(body, CompletionBody):
        if body.suffix:
            raise _invalid("suffix is not supported", "suffix")
        if body.best_of not in (None, 1):
            raise _invalid("best_of must be 1", "best_of")


def _chat_into(msg, body: "ChatBody | TokenizeBody", plan: ToolPlan | None) -> None:
    """A chat body's messages, the tools its template renders, and its template options into `msg`
    (a GenerateRequest or a TokenizeRequest: the same fields; rendered by the servicer's Tokenizer:
    gateway/chat_prompt.py)."""
    if plan is not None and plan.renders:
        msg.tools_json = _utf8(json.dumps([f.spec() for f in plan.functions], ensure_ascii=False), "tools", "tools")
    for i, m in enumerate(body.messages):
        try:
            calls = message_calls({"role": m.role, "tool_calls": m.tool_calls}, i)
        except ToolError as e:
            raise _invalid(str(e), e.param) from None
        msg.messages.append(gateway_pb2.ChatMessage(
            role=_utf8(m.role, f"messages[{i}].role", "messages"),
            content=_utf8(_content(m, i), f"messages[{i}].content", "messages"),
            tool_calls_json=_utf8(json.dumps(calls, ensure_ascii=False), f"messages[{i}].tool_calls",
                                  "messages") if calls else "",
            tool_call_id=_utf8(m.tool_call_id or "", f"messages[{i}].tool_call_id", "messages")))
    if body.add_generation_prompt is not None:
        msg.add_generation_prompt = body.add_generation_prompt
    msg.continue_final_message = bool(body.continue_final_message)


def _tool_plan(body: ChatBody) -> ToolPlan | None:
    """tools + tool_choice, checked; a forced call (required, a named function) cannot take a
    response_format too (it is its own grammar)."""
    try:
        plan = plan_tools(body.tools, body.tool_choice)
    except ToolError as e:
        raise _invalid(str(e), e.param) from None
    if plan is not None and plan.forced and _output_grammar(body) is not None:
        raise _invalid(f"response_format (or vLLM's guided_* / structured_outputs) cannot be combined with tool_choice "
                       f"{plan.mode!r}: the call's own schema constrains the output (send one of them)", "response_format")
    return plan


RESPONSE_FORMATS = ("text", "json_object", "json_schema", "regex", "ebnf")


def _grammar(fmt: dict | None) -> common_pb2.Grammar | None:
    """OpenAI's response_format -> the gRPC API's Grammar (None: free text). {"type": "json_object"};
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}; and, as
    extensions, {"type": "regex", "regex": "..."} and {"type": "ebnf", "ebnf": "..."}."""
    if fmt is None:
        return None
    kind = fmt.get("type", "text")
    if kind not in RESPONSE_FORMATS:
        raise _invalid(f"response_format.type must be one of {', '.join(RESPONSE_FORMATS)}, got {kind!r}",
                       "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return common_pb2.Grammar(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise _invalid('response_format json_schema needs "json_schema": {"name": ..., "schema": {...}} with '
                           "the schema as a JSON object", "response_format")
        return common_pb2.Grammar(json_schema=json.dumps(schema))
    text = fmt.get(kind)
    if not isinstance(text, str) or not text:
        raise _invalid(f'response_format {kind} needs "{kind}": "<the {kind} text>"', "response_format")
    return common_pb2.Grammar(**{kind: text})


# vLLM's ways to ask for structured output besides response_format: its older guided_* fields and
# its newer structured_outputs object (the key each maps to).
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_grammar": "grammar", "guided_choice": "choice"}
STRUCTURED_OUTPUTS_KEYS = ("json", "regex", "grammar", "choice", "json_object")
MAX_CHOICES_IN_GUIDED_CHOICE = 1024


def _ebnf_literal(text: str) -> str:
    """text as a quoted string of xgrammar's EBNF dialect."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
    return f'"{escaped}"'


def _vllm_grammar(key: str, value, param: str) -> common_pb2.Grammar | None:
    """One of vLLM's structured-output values -> the Grammar response_format would give: json (a
    schema object or its JSON text) -> json_schema; regex -> regex; grammar (EBNF, xgrammar's dialect,
    as vLLM's xgrammar backend reads it) -> ebnf; choice (a list of strings) -> ebnf `root ::= "a" |
    "b"`: the output is exactly one of them; json_object true -> json_object. None: unset."""
    if value is None or (key == "json_object" and value is False):
        return None
    if key == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise _invalid(f"{param} is not valid JSON: {e}", param) from None
        if not isinstance(value, dict):
            raise _invalid(f"{param} must be a JSON schema object (or its JSON text)", param)
        return common_pb2.Grammar(json_schema=json.dumps(value))
    if key == "json_object":
        if value is not True:
            raise _invalid(f"{param} must be true or false", param)
        return common_pb2.Grammar(json_object=True)
    if key == "choice":
        if (not isinstance(value, list) or not value or len(value) > MAX_CHOICES_IN_GUIDED_CHOICE
                or not all(isinstance(c, str) and c for c in value)):
            raise _invalid(f"{param} must be a list of 1 to {MAX_CHOICES_IN_GUIDED_CHOICE} non-empty strings", param)
        return common_pb2.Grammar(ebnf="root ::= " + " | ".join(_ebnf_literal(c) for c in value))
    if not isinstance(value, str) or not value:
        raise _invalid(f"{param} must be a non-empty string", param)
    return common_pb2.Grammar(**{"regex" if key == "regex" else "ebnf": value})


def _output_grammar(body: _Body) -> common_pb2.Grammar | None:
    """The request's structured output, from whichever one way it was asked for: response_format,
    vLLM's guided_json / guided_regex / guided_grammar / guided_choice, or vLLM's structured_outputs
    {"json" | "regex" | "grammar" | "choice" | "json_object": ...}; more than one is a 400."""
    extra = body.model_extra or {}
    found: list[tuple[str, common_pb2.Grammar]] = []
    g = _grammar(body.response_format)
    if g is not None:
        found.append(("response_format", g))
    for field, key in GUIDED_FIELDS.items():
        g = _vllm_grammar(key, extra.get(field), field)
        if g is not None:
            found.append((field, g))
    so = extra.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict) or set(so) - set(STRUCTURED_OUTPUTS_KEYS):
            raise _invalid(f"structured_outputs takes one of {', '.join(STRUCTURED_OUTPUTS_KEYS)}", "structured_outputs")
        for key in STRUCTURED_OUTPUTS_KEYS:
            g = _vllm_grammar(key, so.get(key), f"structured_outputs.{key}")
            if g is not None:
                found.append((f"structured_outputs.{key}", g))
    if len(found) > 1:
        raise _invalid(f"{' and '.join(name for name, _ in found)} each ask for structured output: send one of them",
                       found[1][0].split(".")[0])
    return found[0][1] if found else None


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias (token id as a string -> bias); ids and bounds are checked by validate."""
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise _invalid(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} token ids are allowed",
                       "logit_bias")
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise _invalid(f"logit_bias keys must be token ids (integers as strings), got {key!r}", "logit_bias") from None
        if not -2**31 <= token < 2**31:
            raise _invalid(f"logit_bias token id {token} is outside the vocabulary", "logit_bias")
        out[token] = value
    return out


def _utf8(text: str, where: str, param: str) -> str:
    """Text that protobuf can carry: JSON may hold lone surrogates (\\ud800), which are no UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _invalid(f"{where} is not valid UTF-8 text: {e.reason} at character {e.start}", param) from None
    return text


def _content(m: ChatMessageBody, i: int) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    parts = []
    for part in m.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise _invalid(f"messages[{i}].content: only text parts are supported", "messages")
        parts.append(part["text"])
    return "".join(parts)


def _generate_request(body: _Body, request_id: str, max_tokens: int, score_only: bool = False) -> gateway_pb2.GenerateRequest:
    """The sampling and stop fields of a GenerateRequest, as the gRPC API takes them. score_only:
    max_tokens 0 is allowed (completions with echo: the prompt alone, scored)."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if max_tokens < (0 if score_only else 1):
        raise _invalid(f"max_tokens must be >= {0 if score_only else 1}{' (0 only with echo)' if not score_only else ''}, "
                       f"got {max_tokens}", "max_tokens")
    try:
        msg = gateway_pb2.GenerateRequest(
            request_id=request_id, max_tokens=max_tokens,
            temperature=DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
            top_k=body.top_k or 0, ignore_eos=bool(body.ignore_eos), stop=stop, stop_token_ids=body.stop_token_ids or [],
            presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
            min_p=body.min_p or 0.0, include_stop_str_in_output=bool(body.include_stop_str_in_output),
        )
        if body.truncate_prompt_tokens is not None:
            if score_only and body.truncate_prompt_tokens:
                raise _invalid("truncate_prompt_tokens cannot be combined with echo: the echo would show another "
                               "prompt than the one the model saw", "truncate_prompt_tokens")
            msg.truncate_prompt_tokens = body.truncate_prompt_tokens
        if body.min_tokens is not None:
            msg.min_tokens = body.min_tokens  # a negative one is refused by SamplingParams.validate
        if body.repetition_penalty is not None:
            msg.repetition_penalty = body.repetition_penalty
        if body.logit_bias:
            for token, bias in _logit_bias(body.logit_bias).items():
                msg.logit_bias[token] = bias
        grammar = _output_grammar(body)
        if grammar is not None:
            msg.grammar.CopyFrom(grammar)
        if body.top_p is not None:
            if body.top_p == 0.0:  # the proto reads an explicit 0 as unset (1.0): refuse it here instead
                raise _invalid("top_p must be in (0, 1], got 0.0", "top_p")
            msg.top_p = body.top_p
        if body.seed is not None:
            msg.seed = body.seed % 2**64  # OpenAI's seeds are signed 64-bit; the same seed, the same stream
    except (ValueError, TypeError) as e:
        raise _invalid(f"a request field is out of range: {e}") from None
    return msg


# ---- responses ------------------------------------------------------------------------------
class _Tokens:
    """Token id -> its name and its bytes (gateway/token_bytes.py: a piece of a character split over
    several tokens is named `bytes:\\xNN..` and keeps its own bytes), cached (logprobs name every
    token and its alternatives; at most the vocabulary). tokenizer: decode(ids) and token_bytes(id)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, tuple[str, bytes]] = {}

    def _entry(self, token_id: int) -> tuple[str, bytes]:
        e = self.cache.get(token_id)
        if e is None:
            raw = self.tokenizer.token_bytes(token_id)
            e = self.cache[token_id] = (token_name(self.tokenizer.decode([token_id]), raw), raw)
        return e

    def __call__(self, token_id: int) -> str:
        return self._entry(token_id)[0]

    def bytes(self, token_id: int) -> bytes:
        return self._entry(token_id)[1]


class _TextCursor:
    """Where each of a text's tokens starts in it, in characters (text_offset), as the server's own
    incremental decode finds it (detokenizer.TextStream.next_offset): a token that continues a
    character split over several tokens starts where that character does. at: the text before."""

    def __init__(self, decode: Callable[[list[int]], str], at: int = 0):
        self.at = at
        self._text = TextStream(decode)

    def place(self, token_id: int) -> int:
        offset = self.at + self._text.next_offset()
        self._text.add(token_id)
        return offset


def _completion_logprobs(lps: list[TokenLogprob], tok: _Tokens, cursor: _TextCursor) -> dict:
    """text_offset: where each token starts in the choice's text (cursor: the choice's, across its
    events)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for lp in lps:
        out["tokens"].append(tok(lp.token_id))
        out["token_logprobs"].append(lp.logprob)
        out["top_logprobs"].append({tok(t): v for t, v in lp.top})
        out["text_offset"].append(cursor.place(lp.token_id))
    return out


def _echo_logprobs(prompt_ids: Sequence[int], lps: Sequence[TokenLogprob], n: int, tok: _Tokens) -> dict:
    """The prompt's part of an echoed completion's logprobs (OpenAI's legacy format, as vLLM
    gives it): every prompt token, the first with no logprob (null: nothing comes before it), its
    n most likely alternatives, text_offset from 0 in the prompt's decoded text."""
    out = {"tokens": [], "token_logprobs": [None], "top_logprobs": [None], "text_offset": []}
    cursor = _TextCursor(tok.tokenizer.decode)
    for t in prompt_ids:
        out["tokens"].append(tok(t))
        out["text_offset"].append(cursor.place(t))
    for lp in lps:
        out["token_logprobs"].append(lp.logprob)
        out["top_logprobs"].append({tok(t): v for t, v in lp.top[:n]})
    return out


def _prompt_logprobs_asked(body: _Body, limits) -> int | None:
    """vLLM's `prompt_logprobs` extension, checked: the alternatives wanted per prompt position
    (None: not asked). Scored by the verifier's prefill (GenerateRequest.prompt_logprobs) with
    each token's rank, which a verifier older than TokenLogprob.rank leaves out."""
    n = body.prompt_logprobs
    if n is None:
        return None
    if not 0 <= n <= MAX_LOGPROBS:
        raise _invalid(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}] (the most likely tokens listed beside each "
                       f"prompt token), got {n}", "prompt_logprobs")
    if body.stream:
        raise _invalid("prompt_logprobs is not available with stream (as in vLLM): send the request without "
                       "stream", "prompt_logprobs")
    if body.truncate_prompt_tokens:
        raise _invalid("prompt_logprobs cannot be combined with truncate_prompt_tokens: the scores would be of a "
                       "prompt other than the one sent", "prompt_logprobs")
    if limits.sampling_features is not None and "logprob_ranks" not in limits.sampling_features:
        raise _invalid("prompt_logprobs needs each prompt token's rank, which this server's verifier does not "
                       "compute (an older version); upgrade the verifier, or score the prompt with echo and "
                       "logprobs on /v1/completions", "prompt_logprobs")
    return n


def _vllm_prompt_logprobs(lps: Sequence[TokenLogprob], n: int, tok: _Tokens) -> list[dict | None]:
    """vLLM's prompt_logprobs: null for the first prompt token (nothing comes before it), then per
    prompt token {token id: {logprob, rank, decoded_token}}: the prompt's token with its rank
    (tokens at least as likely, itself included), and the n most likely with ranks 1..n."""
    out: list[dict | None] = [None]
    for lp in lps:
        d = {str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": tok(lp.token_id)}}
        for i, (t, v) in enumerate(lp.top[:n]):
            d.setdefault(str(t), {"logprob": v, "rank": i + 1, "decoded_token": tok(t)})
        out.append(d)
    return out


def _chat_logprobs(lps: list[TokenLogprob], tok: _Tokens) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        return {"token": tok(token_id), "logprob": logprob, "bytes": list(tok.bytes(token_id))}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in lps], "refusal": None}


def _usage(usage: dict | None) -> dict | None:
    if usage is None:
        return None
    p, c = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


# ---- one live request -----------------------------------------------------------------------
class _Live:
    """A request submitted to the scheduler and its event queue; `close()` aborts it unless it
    finished (client disconnect, cancellation, server error)."""

    def __init__(self, scheduler, http_request: Request):
        self.scheduler = scheduler
        self.http = http_request
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.request = None
        self.finished = False
        self._getter: asyncio.Future | None = None
        self._gone: asyncio.Future | None = None

    def sink(self, ev: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, ev)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    async def next(self, watch_disconnect: bool) -> Event:
        """The next event; with watch_disconnect, ClientGone as soon as the client goes away."""
        if self._getter is None:
            self._getter = asyncio.ensure_future(self.events.get())
        waiting = {self._getter}
        if watch_disconnect:
            if self._gone is None:
                self._gone = asyncio.ensure_future(self._disconnect())
            waiting.add(self._gone)
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if self._getter.done():
            ev = self._getter.result()
            self._getter = None
            if ev.error is not None or ev.finish_reason is not None:
                self.finished = True
            return ev
        raise ClientGone()

    async def _disconnect(self) -> None:
        """Returns when the client disconnects (the body is read: the next ASGI message is that)."""
        while (await self.http.receive())["type"] != "http.disconnect":
            pass

    def stop_watching(self) -> None:
        """A stream's response listens for the disconnect itself (and cancels the body)."""
        if self._gone is not None:
            self._gone.cancel()
            self._gone = None

    def close(self) -> None:
        for task in (self._getter, self._gone):
            if task is not None:
                task.cancel()
        self._getter = self._gone = None
        if self.request is not None and not self.finished:
            self.finished = True
            self.scheduler.abort(self.request)


class ClientGone(Exception):
    pass


class _EventStream(StreamingResponse):
    """An SSE response that aborts its request however it ends, even if the client is gone
    before the body is ever iterated."""

    def __init__(self, lives: list[_Live], content, **kw):
        super().__init__(content, **kw)
        self.lives = lives

    async def __call__(self, scope, receive, send) -> None:
        with _aborting(self.lives):
            await super().__call__(scope, receive, send)


def _close(lives: list[_Live]) -> None:
    """Abort every choice's request (a no-op for one already finished)."""
    for live in lives:
        live.close()


@contextmanager
def _aborting(lives: list[_Live]):
    try:
        yield lives
    finally:
        _close(lives)


def _usage_of(usages: list[dict | None], n: int | None = None) -> dict | None:
    """The choices' usage: each prompt once (as OpenAI counts it; a batch of prompts holds n
    choices per prompt, in order; n None: one prompt), the completions' tokens summed."""
    if any(u is None for u in usages):
        return None
    return {"prompt_tokens": sum(int(u.get("prompt_tokens", 0)) for u in usages[::n or len(usages) or 1]),
            "completion_tokens": sum(int(u.get("completion_tokens", 0)) for u in usages)}


# ---- before the body: the token, then the body's size -----------------------------------------
OPEN_PATHS = frozenset({"/health"})  # answered without the token (load balancers, healthchecks)


class _TooLarge(Exception):
    pass


class _Guard:
    """ASGI middleware, the one place for both rules that come before any work on a request:

    1. the bearer token, from the headers alone: a request without it is answered 401 before a
       byte of its body is read (a client without the token never makes the server buffer or
       parse anything);
    2. the body size (--max-request-bytes): a Content-Length above it is refused at once, and the
       body itself (chunked ones too, which have no Content-Length) is read here, counted as it
       arrives and refused with 413 as soon as it passes the limit. What the app then reads is the
       counted body, so nothing larger than the limit is ever held."""

    def __init__(self, app, backend: "HttpBackend"):
        self.app = app
        self.backend = backend
        self.expected = f"Bearer {backend.token}".encode() if backend.token else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.expected is not None and scope["path"] not in OPEN_PATHS:
            got = headers.get(b"authorization")
            if got is None:
                return await _refuse(scope, receive, send, ApiError(
                    401, "missing bearer token: send the header 'Authorization: Bearer <token>' (the server's "
                    "--auth-token-file)", code="invalid_api_key"))
            if not hmac.compare_digest(got, self.expected):
                return await _refuse(scope, receive, send, ApiError(401, "wrong bearer token", code="invalid_api_key"))
        limit = self.backend.max_request_bytes
        if not limit or scope["method"] in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        n = headers.get(b"content-length", b"")
        if n.isdigit() and int(n) > limit:
            return await _refuse(scope, receive, send, _too_large(f"is {int(n)} bytes", limit))
        try:
            body = await _read_body(receive, limit)
        except _TooLarge:
            return await _refuse(scope, receive, send, _too_large("passed the limit", limit))
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: only http.disconnect (a client that goes away)

        return await self.app(scope, replay, send)


async def _read_body(receive, limit: int) -> bytes:
    chunks, size = [], 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            break
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _TooLarge()
        chunks.append(chunk)
        if not msg.get("more_body", False):
            break
    return b"".join(chunks)


def _too_large(what: str, limit: int) -> ApiError:
    return ApiError(413, f"the request body {what}; at most {limit} bytes are allowed (--max-request-bytes)",
                    code="request_too_large")


async def _refuse(scope, receive, send, e: ApiError) -> None:
    """Answer without reading the rest of the body; the server closes the connection after it."""
    response = e.response()
    response.headers["connection"] = "close"
    await response(scope, receive, send)


# ---- the app --------------------------------------------------------------------------------
@dataclasses.dataclass
class HttpBackend:
    """What the HTTP API needs from the gateway: its gRPC servicer (scheduler, tokenizer, limits,
    draining), the served model's name, the bearer token, why it cannot serve (None: it can), and
    its HTTP-only flags."""

    servicer: GatewayServicer
    model: str
    token: str | None = None
    unhealthy: Callable[[], str | None] = lambda: None
    max_request_bytes: int | None = None
    tool_call_stream: str = "decided"  # --tool-call-stream: ToolCallStream's mode


def create_app(backend: HttpBackend) -> FastAPI:
    servicer = backend.servicer
    scheduler, limits = servicer.scheduler, servicer.limits
    tok = _Tokens(servicer.tokenizer)
    created = int(time.time())

    app = FastAPI(title="specsplit", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.backend = backend

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return _invalid("the request body is not valid JSON").response()
        where = ".".join(loc) or "body"
        return _invalid(f"{where}: {first.get('msg', 'invalid value')}", loc[0] if loc else None).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        message = (f"Invalid URL ({request.method} {request.url.path})" if e.status_code in (404, 405)
                   else str(e.detail))
        return ApiError(e.status_code, message, code="not_found" if e.status_code == 404 else None).response()

    app.add_middleware(_Guard, backend=backend)

    def check_model(model: str) -> None:
        if model != backend.model:
            raise ApiError(404, f"The model `{model}` does not exist: this server serves `{backend.model}` "
                           "(GET /v1/models)", param="model", code="model_not_found")

    def model_card() -> dict:
        return {"id": backend.model, "object": "model", "created": created, "owned_by": "specsplit",
                "max_model_len": limits.max_model_len}

    @app.get("/health")
    async def health():
        why = "draining" if servicer.draining else backend.unhealthy()
        if why:
            return JSONResponse({"status": why}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        check_model(model)
        return model_card()

    # ---- vLLM's /tokenize, /detokenize and /version -----------------------------------------
    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody):
        """The ids a generation request with this prompt (or these messages) would start from: the
        same tokenizer, chat template and checks, on the same worker thread."""
        if body.model is not None:
            check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise _invalid("send a prompt (text) or messages (chat), one of the two", "prompt")
        chat = body.messages is not None
        if body.add_special_tokens is not None and body.add_special_tokens != (not chat):
            raise _invalid(f"add_special_tokens {str(body.add_special_tokens).lower()} is not supported: the ids are "
                           "those a generation request would use (special tokens added to a text prompt, none added "
                           "to the rendered chat template); leave it out", "add_special_tokens")
        request = gateway_pb2.TokenizeRequest()  # a GenerateRequest's prompt fields, the same names
        if chat:
            if not body.messages:
                raise _invalid("messages must hold at least one message", "messages")
            try:
                plan = plan_tools(body.tools, None)
            except ToolError as e:
                raise _invalid(str(e), e.param) from None
            _chat_into(request, body, plan)
        else:
            if not body.prompt:
                raise _invalid("the prompt is empty", "prompt")
            request.prompt = _utf8(body.prompt, "prompt", "prompt")
        try:
            ids = await servicer.tokenize(request)
        except ServiceError as e:
            raise api_error(e) from None
        return {"count": len(ids), "max_model_len": servicer.limits.max_model_len, "tokens": ids,
                "token_strs": [tok(t) for t in ids] if body.return_token_strs else None}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeBody):
        if body.model is not None:
            check_model(body.model)
        most = MAX_DETOKENIZE_PER_CONTEXT * servicer.limits.max_model_len
        if len(body.tokens) > most:
            raise _invalid(f"{len(body.tokens)} tokens; at most {most} ({MAX_DETOKENIZE_PER_CONTEXT} x max_model_len) "
                           "a request", "tokens")
        vocab = servicer.limits.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise _invalid(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": await servicer.decode_ids(body.tokens)}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    async def submit(body: _Body, msg: gateway_pb2.GenerateRequest, logprobs: int | None, default_max: bool,
                     http_request: Request) -> list[_Live]:
        """The gRPC servicer's n choices (GenerateRequest.n, GatewayServicer.submit_choices: checks,
        tokenization, build_request, the scheduler), one _Live each. A choice refused (a full
        server) aborts the ones submitted before it."""
        check_model(body.model)
        _check_unsupported(body)
        if logprobs is not None:
            msg.logprobs = logprobs
        msg.n = body.n or 1

        def prepare(msg: gateway_pb2.GenerateRequest, ids: list[int]) -> None:
            if default_max:  # chat without max_tokens: the rest of the context
                msg.max_tokens = max(1, limits.max_model_len - len(ids))

        lives = [_Live(scheduler, http_request) for _ in range(msg.n)]
        try:
            requests = await servicer.submit_choices(msg, [live.sink for live in lives], prepare)
        except ServiceError as e:
            raise api_error(e) from None
        for live, req in zip(lives, requests):
            live.request = req
        return lives

    async def first_events(lives: list[_Live]) -> list[Event]:
        """Wait for each choice's first event before answering: an error before any token is a
        status code (and the other choices are aborted)."""
        out = []
        try:
            for live in lives:
                ev = await live.next(watch_disconnect=True)
                live.stop_watching()
                if ev.error is not None:
                    raise api_error(status_of(ev.error))
                out.append(ev)
        except BaseException:
            _close(lives)
            raise
        return out

    async def events(live: _Live, first: Event):
        """The request's events, from the first one on; raises ApiError on a stream error."""
        ev = first
        while True:
            if ev.error is not None:
                raise api_error(status_of(ev.error))
            yield ev
            if ev.finish_reason is not None:
                return
            ev = await live.next(watch_disconnect=False)  # streamed: Starlette listens, and cancels us

    def stream(lives: list[_Live], firsts: list[Event], chunks, include_usage: bool,
               usage_chunk: Callable[[dict], dict], n: int | None = None):
        """SSE of the choices' events as they come (chunks(i, ev): choice i's chunks for ev; n: a
        batch of prompts' choices per prompt, for the usage)."""
        for live in lives:
            live.stop_watching()

        async def body():
            with _aborting(lives):
                queue: asyncio.Queue = asyncio.Queue()

                async def pump(i: int) -> None:
                    try:
                        async for ev in events(lives[i], firsts[i]):
                            queue.put_nowait((i, ev, None))
                    except ApiError as e:
                        queue.put_nowait((i, None, e))
                        return
                    queue.put_nowait((i, None, None))

                tasks = [asyncio.ensure_future(pump(i)) for i in range(len(lives))]
                try:
                    usages: list[dict | None] = [None] * len(lives)
                    left = len(lives)
                    while left:
                        i, ev, err = await queue.get()
                        if err is not None:
                            yield _sse(err.body())
                            yield SSE_DONE
                            return
                        if ev is None:
                            left -= 1
                            continue
                        for c in chunks(i, ev):
                            if include_usage:
                                c["usage"] = None
                            yield _sse(c)
                        if ev.finish_reason is not None:
                            usages[i] = ev.usage
                    if include_usage:
                        yield _sse(usage_chunk(_usage(_usage_of(usages, n))))
                    yield SSE_DONE
                finally:
                    for t in tasks:
                        t.cancel()

        return _EventStream(lives, body(), media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def collect(lives: list[_Live], firsts: list[Event]) -> list[list[Event]]:
        """Each choice's events to its last (one at a time; the others queue meanwhile)."""
        with _aborting(lives):
            out = []
            for live, first in zip(lives, firsts):
                evs, ev = [first], first
                while ev.finish_reason is None and ev.error is None:
                    try:
                        ev = await live.next(watch_disconnect=True)
                    except ClientGone:
                        log.info("http: %s: the client went away; request aborted", live.request.request_id)
                        raise
                    evs.append(ev)
                live.stop_watching()
                if ev.error is not None:
                    raise api_error(status_of(ev.error))
                out.append(evs)
            return out

    # ---- /v1/completions ---------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http_request: Request):
        rid = f"cmpl-{uuid.uuid4().hex}"
        if body.logprobs is not None and not 0 <= body.logprobs <= MAX_LOGPROBS:
            raise _invalid(f"logprobs must be in [0, {MAX_LOGPROBS}], got {body.logprobs}", "logprobs")
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        echo = bool(body.echo)
        msg = _generate_request(body, rid, max_tokens, score_only=echo)
        if echo and (body.logprobs is not None or max_tokens == 0):
            # The prompt's logprobs come from the verifier's prefill (GenerateRequest.prompt_logprobs)
            msg.prompt_logprobs = body.logprobs or 0
        prompt_n = _prompt_logprobs_asked(body, servicer.limits)
        if prompt_n is not None:  # vLLM's field: the same scores, as many alternatives as either wants
            msg.prompt_logprobs = max(prompt_n, msg.prompt_logprobs)
        prompts = _completion_prompts(body.prompt)
        n = body.n or 1
        if len(prompts) * n > MAX_BATCH_CHOICES:
            raise _invalid(f"{len(prompts)} prompts x n {n} = {len(prompts) * n} choices; at most {MAX_BATCH_CHOICES} "
                           f"a request (send the batch in smaller requests)", "prompt")
        lives: list[_Live] = []  # choice i = prompt i // n, its sample i % n (OpenAI's order)
        try:
            for i, p in enumerate(prompts):
                one = gateway_pb2.GenerateRequest()
                one.CopyFrom(msg)
                if len(prompts) > 1:
                    one.request_id = f"{rid}-{i}"
                if isinstance(p, str):
                    one.prompt = _utf8(p, "prompt", "prompt")
                else:
                    try:
                        one.prompt_token_ids.extend(p)
                    except ValueError as e:
                        raise _invalid(f"prompt token ids: {e}", "prompt") from None
                lives += await submit(body, one, body.logprobs, False, http_request)
        except BaseException:
            _close(lives)  # the prompts submitted before the one refused
            raise
        firsts = await first_events(lives)
        prompt_ids = [list(lives[i * n].request.prompt_token_ids) for i in range(len(prompts))]
        # echo: the prompt's text first (as sent, or its ids decoded), then the completion's
        echoed = [(p if isinstance(p, str) else servicer.tokenizer.decode(ids)) if echo else ""
                  for p, ids in zip(prompts, prompt_ids)]
        states = [{"echo": echo, "cursor": _TextCursor(servicer.tokenizer.decode, len(echoed[i // n]))}
                  for i in range(len(lives))]

        def choice(i: int, ev: Event) -> dict:
            state = states[i]
            lp = None
            if body.logprobs is not None and ev.logprobs is not None:
                lp = _completion_logprobs(ev.logprobs, tok, state["cursor"])
            text = ev.text
            if state["echo"]:  # the first chunk (or the whole answer) starts with the prompt
                state["echo"] = False
                text = echoed[i // n] + text
                if body.logprobs is not None:
                    head = _echo_logprobs(prompt_ids[i // n], ev.prompt_logprobs or (), body.logprobs, tok)
                    lp = {k: head[k] + (lp[k] if lp else []) for k in head}
            return {"index": i, "text": text, "logprobs": lp, "finish_reason": ev.finish_reason}

        def envelope(choices: list, usage=None, chunk: bool = False) -> dict:
            out = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": backend.model,
                   "choices": choices, "system_fingerprint": None}
            if not chunk or usage is not None:
                out["usage"] = usage
            return out

        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            return stream(lives, firsts, lambda i, ev: [envelope([choice(i, ev)], chunk=True)], include_usage,
                          lambda u: envelope([], u, chunk=True), n)
        choices, collected = [], await collect(lives, firsts)
        for i, evs in enumerate(collected):
            merged = [choice(i, ev) for ev in evs]
            lp = None
            if body.logprobs is not None and (echo or any(ev.logprobs is not None for ev in evs)):
                lp = {k: [x for c in merged if c["logprobs"] for x in c["logprobs"][k]]
                      for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
            text = "".join(c["text"] for c in merged)
            choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": evs[-1].finish_reason})
            if prompt_n is not None:  # vLLM puts them in the choice
                choices[-1]["prompt_logprobs"] = _vllm_prompt_logprobs(evs[0].prompt_logprobs or (), prompt_n, tok)
        return envelope(choices, _usage(_usage_of([evs[-1].usage for evs in collected], n)))

    # ---- /v1/chat/completions ----------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, http_request: Request):
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        logprobs = None
        if body.top_logprobs is not None:
            if not body.logprobs:
                raise _invalid("top_logprobs needs logprobs: true", "top_logprobs")
            if not 0 <= body.top_logprobs <= MAX_LOGPROBS:
                raise _invalid(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {body.top_logprobs}", "top_logprobs")
        if body.logprobs:
            logprobs = body.top_logprobs or 0
        if not body.messages:
            raise _invalid("messages must hold at least one message", "messages")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        plan = _tool_plan(body)
        msg = _generate_request(body, rid, 1 if max_tokens is None else max_tokens)
        if plan is not None and plan.forced:  # the call through the structured-output grammar
            try:
                msg.grammar.CopyFrom(common_pb2.Grammar(json_schema=plan.grammar_text()))
            except ToolError as e:
                raise _invalid(str(e), e.param) from None
        _chat_into(msg, body, plan)
        prompt_n = _prompt_logprobs_asked(body, servicer.limits)
        if prompt_n is not None:
            msg.prompt_logprobs = prompt_n
        lives = await submit(body, msg, logprobs, max_tokens is None, http_request)
        firsts = await first_events(lives)

        def envelope(choices: list, usage=None, chunk: bool = False) -> dict:
            out = {"id": rid, "object": "chat.completion.chunk" if chunk else "chat.completion",
                   "created": int(time.time()), "model": backend.model, "choices": choices, "system_fingerprint": None}
            if not chunk or usage is not None:
                out["usage"] = usage
            return out

        def lp_of(ev: Event):
            return _chat_logprobs(ev.logprobs, tok) if logprobs is not None and ev.logprobs is not None else None

        def answer(text: str, finish: str | None) -> tuple[dict, str | None]:
            """A choice's text -> its message's content / tool_calls, and its finish_reason."""
            if plan is None:
                return {"content": text}, finish
            content, calls = parse_calls(text, plan)
            if not calls:
                return {"content": content}, finish
            return {"content": content, "tool_calls": calls}, finish_reason(calls, finish)

        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            started = [False] * len(lives)
            tools = [ToolCallStream(plan, backend.tool_call_stream) for _ in lives] if plan is not None and plan.renders else []

            def tool_chunks(i: int, ev: Event) -> list[dict]:
                """With tools: the deltas ToolCallStream gives for the text so far (content, or each
                call's header and then its arguments in pieces; nothing while the text is undecided),
                this event's logprobs on the first (an empty delta when there is none), then the finish."""
                deltas = tools[i].feed(ev.text) if ev.finish_reason is None else tools[i].finish(ev.text)
                lp = lp_of(ev)
                if lp is not None and not deltas:
                    deltas = [{}]
                out = [envelope([{"index": i, "delta": d, "logprobs": lp if j == 0 else None, "finish_reason": None}],
                                chunk=True) for j, d in enumerate(deltas)]
                if ev.finish_reason is not None:
                    finish = finish_reason(tools[i].final[1], ev.finish_reason)
                    out.append(envelope([{"index": i, "delta": {}, "logprobs": None, "finish_reason": finish}], chunk=True))
                return out

            def chunks(i: int, ev: Event) -> list[dict]:
                out = []
                if not started[i]:
                    started[i] = True
                    out.append(envelope([{"index": i, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}], chunk=True))
                if tools:
                    return out + tool_chunks(i, ev)
                if ev.text or ev.token_ids:
                    out.append(envelope([{"index": i, "delta": {"content": ev.text}, "logprobs": lp_of(ev),
                                          "finish_reason": None}], chunk=True))
                if ev.finish_reason is not None:
                    out.append(envelope([{"index": i, "delta": {}, "logprobs": None,
                                          "finish_reason": ev.finish_reason}], chunk=True))
                return out

            return stream(lives, firsts, chunks, include_usage, lambda u: envelope([], u, chunk=True))
        choices, collected = [], await collect(lives, firsts)
        for i, evs in enumerate(collected):
            lp = None
            if logprobs is not None and any(ev.logprobs is not None for ev in evs):
                lp = {"content": [c for ev in evs if (x := lp_of(ev)) for c in x["content"]], "refusal": None}
            fields, finish = answer("".join(ev.text for ev in evs), evs[-1].finish_reason)
            message = {"role": "assistant", **fields, "refusal": None}
            choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": finish})
        out = envelope(choices, _usage(_usage_of([evs[-1].usage for evs in collected])))
        if prompt_n is not None:  # vLLM puts them beside the choices: the one prompt's
            out["prompt_logprobs"] = _vllm_prompt_logprobs(collected[0][0].prompt_logprobs or (), prompt_n, tok)
        return out

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, e: ClientGone):
        return Response(status_code=499)  # nobody reads it

    return app


# ---- the server -----------------------------------------------------------------------------
class _Uvicorn(uvicorn.Server):
    """uvicorn inside the gateway's loop: the gateway's own signal handling drains both servers."""

    @contextmanager
    def capture_signals(self):
        yield


class HttpServer:
    def __init__(self, app: FastAPI, host: str, port: int, security: ServerSecurity | None = None,
                 limit_concurrency: int | None = None):
        self.app, self.host, self.port = app, host, port
        self.limit_concurrency = limit_concurrency  # uvicorn: connections + requests open at once, then 503
        self.security = security or ServerSecurity()
        self.server: _Uvicorn | None = None
        self.task: asyncio.Task | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.security.tls_cert else "http"

    async def start(self) -> int:
        family = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as e:
            sock.close()
            raise RuntimeError(f"http: cannot listen on {self.host}:{self.port} ({e.strerror}); is the port in use?") from None
        sock.listen(2048)
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        sec = self.security
        kw = {}
        if sec.tls_cert:
            kw = dict(ssl_certfile=sec.tls_cert, ssl_keyfile=sec.tls_key)
            if sec.tls_ca:
                kw.update(ssl_ca_certs=sec.tls_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        config = uvicorn.Config(self.app, log_config=None, access_log=False, lifespan="off",
                                timeout_graceful_shutdown=SHUTDOWN_GRACE_S, limit_concurrency=self.limit_concurrency,
                                **kw)
        if not log.isEnabledFor(logging.DEBUG):
            logging.getLogger("uvicorn.error").setLevel(logging.WARNING)  # its start/stop lines: ours say it
        self.server = _Uvicorn(config)
        self.task = asyncio.ensure_future(self.server.serve(sockets=[sock]))
        while not self.server.started:
            if self.task.done():
                exc = self.task.exception() if not self.task.cancelled() else None
                raise RuntimeError(f"http: the server on {self.host}:{self.port} did not start: {exc!r}")
            await asyncio.sleep(0.01)
        auth = "bearer token" if sec.auth_token_file or sec.auth_token_env else "no token"
        log.info("OpenAI-compatible HTTP API on %s://%s:%d/v1 (%s; /health, /metrics)", self.scheme, self.host,
                 self.port, auth)
        return self.port

    async def stop(self) -> None:
        if self.server is None or self.task is None:
            return
        self.server.should_exit = True
        try:
            await asyncio.wait_for(self.task, SHUTDOWN_GRACE_S + 5.0)
        except (asyncio.TimeoutError, Exception) as e:  # noqa: BLE001: stopping anyway
            log.warning("http: stopping: %r", e)
            self.task.cancel()
        log.info("http: stopped")


def build_http_server(servicer: GatewayServicer, model: str, args,
                      unhealthy: Callable[[], str | None]) -> HttpServer | None:
    """The HTTP API the flags ask for (--http-port; 0 or unset = none), with the gRPC API's bearer
    token and TLS certificate."""
    port = getattr(args, "http_port", None)
    if not port:
        return None
    security = ServerSecurity.from_args(args)
    backend = HttpBackend(servicer, model, security.token(), unhealthy,
                          getattr(args, "max_request_bytes", None), getattr(args, "tool_call_stream", "decided"))
    return HttpServer(create_app(backend), getattr(args, "http_host", None) or args.host, port, security,
                      getattr(args, "http_limit_concurrency", None))


__all__ = ["ApiError", "HttpBackend", "HttpServer", "build_http_server", "create_app"]
