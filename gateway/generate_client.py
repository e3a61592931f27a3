"""`specsplit generate --server HOST:PORT`: stream one generation from a gateway.

Prints text as it arrives (and a summary line on stderr), or with --json the same object as the
local mode: token_ids, text, finish_reason, usage (and logprobs with --logprobs N).

--n N (2..16): N choices (GenerateRequest.n), their messages interleaved on the one stream and told
apart by GenerateResponse.index. Each choice is printed whole when it ends, under a line
"--- choice I (finish=...) ---"; with --json a list of N objects (each the one-choice object with
its "index"), in index order. The local mode (specsplit/cli/generate.py) prints its N the same way.
"""
from __future__ import annotations

import json
import sys
import time
from typing import Iterator, Sequence

import grpc

from specsplit.v1 import gateway_pb2, gateway_pb2_grpc
from specsplit.rpc.health import error_text
from specsplit.rpc.wire import grammar_to_pb


def parse_ids(text: str, flag: str = "--prompt-token-ids") -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None


def grammar_from_args(args):
    """--json-schema / --json-object / --regex / --ebnf -> a Grammar (None: free text); @FILE reads it."""
    from specsplit.sampling.params import Grammar

    def text(value: str) -> str:
        if value.startswith("@"):
            with open(value[1:], encoding="utf-8") as f:
                return f.read()
        return value

    if getattr(args, "json_object", False):
        return Grammar("json_object")
    for kind in ("json_schema", "regex", "ebnf"):
        value = getattr(args, kind, None)
        if value is not None:
            return Grammar(kind, value if kind == "regex" else text(value))
    return None


def request_from_args(args) -> gateway_pb2.GenerateRequest:
    req = gateway_pb2.GenerateRequest(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        ignore_eos=args.ignore_eos,
    )
    if args.prompt_token_ids is not None:
        req.prompt_token_ids.extend(parse_ids(args.prompt_token_ids))
    elif getattr(args, "chat", False):  # the server renders it with the target's chat template
        req.messages.append(gateway_pb2.ChatMessage(role="user", content=args.prompt))
    else:
        req.prompt = args.prompt
    if args.seed is not None:
        req.seed = args.seed
    if getattr(args, "n", 1) > 1:
        req.n = args.n
    if getattr(args, "logprobs", None) is not None:
        req.logprobs = args.logprobs
    for s in getattr(args, "stop", None) or []:
        req.stop.append(s)
    req.stop_token_ids.extend(parse_ids(getattr(args, "stop_token_ids", None) or "", "--stop-token-ids"))
    req.min_tokens = getattr(args, "min_tokens", 0) or 0
    req.min_p = getattr(args, "min_p", 0.0) or 0.0
    req.include_stop_str_in_output = bool(getattr(args, "include_stop_str_in_output", False))
    req.presence_penalty = getattr(args, "presence_penalty", 0.0)
    req.frequency_penalty = getattr(args, "frequency_penalty", 0.0)
    if getattr(args, "repetition_penalty", 1.0) != 1.0:
        req.repetition_penalty = args.repetition_penalty
    g = grammar_from_args(args)
    if g is not None:
        req.grammar.CopyFrom(grammar_to_pb(g))
    k = args.num_speculative_tokens
    if k == 0:
        req.speculation.disable = True
    elif k:
        req.speculation.num_speculative_tokens = k
    return req


def stream(address: str, request: gateway_pb2.GenerateRequest, timeout: float | None = None,
           security=None) -> Iterator[gateway_pb2.GenerateResponse]:
    """`security`: a specsplit.rpc.security.ClientSecurity (TLS CA, client certificate, token)."""
    from specsplit.rpc.security import channel as make_channel

    with make_channel(address, security) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        yield from stub.Generate(request, timeout=timeout, wait_for_ready=False)


def logprobs_json(lps: Sequence) -> list[dict]:
    """TokenLogprobs -> JSON: [{token_id, logprob, top: [{token_id, logprob}, ...]}, ...]."""
    return [{"token_id": t.token_id, "logprob": t.logprob,
             "top": [{"token_id": i, "logprob": v} for i, v in t.top]} for t in lps]


def collect(responses) -> dict:
    """Responses -> the local mode's JSON object (logprobs only when the request asked)."""
    from specsplit.rpc.wire import logprobs_from_pb

    ids: list[int] = []
    text: list[str] = []
    lps: list = []
    finish, usage = None, None
    for r in responses:
        ids.extend(r.token_ids)
        text.append(r.text)
        lps.extend(logprobs_from_pb(r.logprobs))
        if r.finish_reason:
            finish = r.finish_reason
            usage = {
                "prompt_tokens": r.usage.prompt_tokens,
                "completion_tokens": r.usage.completion_tokens,
                "proposed_draft_tokens": r.usage.proposed_draft_tokens,
                "accepted_draft_tokens": r.usage.accepted_draft_tokens,
                "accepted_per_position": list(r.usage.accepted_per_position),
            }
    out = {"token_ids": ids, "text": "".join(text), "finish_reason": finish, "usage": usage}
    if lps:
        out["logprobs"] = logprobs_json(lps)
    return out


def collect_choices(responses, n: int) -> list[dict]:
    """The responses of an n-choice request -> one collect() object per choice, with its "index"."""
    by_index: list[list] = [[] for _ in range(n)]
    for r in responses:
        by_index[r.index].append(r)
    return [{"index": i, **collect(rs)} for i, rs in enumerate(by_index)]


def choice_text(index: int, finish: str, text: str) -> str:
    """One of n choices in text mode: a line naming it, then its text (the local mode's too)."""
    return f"--- choice {index} (finish={finish}) ---\n{text}\n"


def _print_choices(responses, n: int) -> list:
    """Text mode with n choices: each printed whole, under its index, when its last message comes."""
    held: list[list] = [[] for _ in range(n)]
    finals = []
    for r in responses:
        held[r.index].append(r)
        if r.finish_reason:
            finals.append(r)
            sys.stdout.write(choice_text(r.index, r.finish_reason, "".join(m.text for m in held[r.index])))
            sys.stdout.flush()
    return finals


def generate_over_grpc(args) -> int:
    from specsplit.rpc.security import ClientSecurity

    security = ClientSecurity.from_args(args)
    request = request_from_args(args)
    t0 = time.perf_counter()
    first = None
    n = request.n or 1
    try:
        if args.json:
            responses = stream(args.server, request, args.timeout, security)
            print(json.dumps(collect(responses) if n == 1 else collect_choices(responses, n)))
            return 0
        if n > 1:
            finals = _print_choices(stream(args.server, request, args.timeout, security), n)
            dt = time.perf_counter() - t0
            tokens = sum(r.usage.completion_tokens for r in finals)
            print(f"[{n} choices, {tokens} tokens in {dt:.2f}s = {tokens / dt:.1f} tok/s]", file=sys.stderr)
            return 0
        last = None
        for r in stream(args.server, request, args.timeout, security):
            if first is None:
                first = time.perf_counter() - t0
            sys.stdout.write(r.text)
            sys.stdout.flush()
            last = r
    except grpc.RpcError as e:
        print(f"\nspecsplit generate: {args.server}: {error_text(e)}", file=sys.stderr)
        return 1
    dt = time.perf_counter() - t0
    if last is not None and last.finish_reason:
        u = last.usage
        acc = (f", acceptance {u.accepted_draft_tokens / u.proposed_draft_tokens:.2f} "
               f"({u.accepted_draft_tokens}/{u.proposed_draft_tokens} drafts)") if u.proposed_draft_tokens else ""
        print(f"\n[{u.completion_tokens} tokens in {dt:.2f}s = {u.completion_tokens / dt:.1f} tok/s, first after "
              f"{first:.2f}s{acc}; finish={last.finish_reason}]", file=sys.stderr)
    return 0
