"""One Request per generation, from the API boundary to the stream.

`GenerationRequest` is what a caller asks for (prompt ids, sampling parameters, stop rules,
speculation); `validate` is the one place it is checked. `Request` is the live object the
scheduler runs: the request, its output, the detokenizer with its stop strings, usage and
acceptance (counted once, per position too), and the sink its stream events go to.

Errors are plain exceptions with a kind (`RequestError.kind`, named like the gRPC status codes
so the gateway maps them one to one); the engine library never imports grpc.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Sequence

from specsplit.detokenizer import TextStream
from specsplit.protocols import SeqAdd, TokenLogprob  # TokenLogprob: defined beside VerifyResult, named here
from specsplit.sampling.logprobs import MAX_LOGPROBS
from specsplit.sampling.params import SamplingParams

MAX_REQUEST_ID_BYTES = 128
MAX_SPECULATIVE_TOKENS = 32
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 64
MAX_CHOICES = 16  # n (gRPC GenerateRequest.n, the HTTP API, `specsplit generate --n`) at most: each choice is a request


def choice_seed(seed: int | None, i: int) -> int | None:
    """Choice i of a seeded request's n draws with seed + i (mod 2**64): the n choices of a seed are
    reproducible and choice 0 is the seed's own stream (the gateway's nth_choice, `specsplit
    generate --n` without --server). None: unseeded."""
    return None if seed is None else (seed + i) % 2**64


class RequestError(Exception):
    """A request that cannot run, or stopped running. kind: invalid_argument | resource_exhausted |
    unavailable | internal | (any other gRPC status name, lower case, from a peer's error)."""

    INVALID = "invalid_argument"
    EXHAUSTED = "resource_exhausted"
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal"

    def __init__(self, kind: str, message: str, cause: BaseException | None = None, broken: bool = False):
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.cause = cause
        self.broken = broken  # the verifier is gone: every request, queued ones too, ends

    def __str__(self) -> str:
        return self.message


def invalid(message: str) -> RequestError:
    return RequestError(RequestError.INVALID, message)


def error_from_exception(e: BaseException) -> RequestError:
    """The library's default classification of an engine/decoder exception."""
    from specsplit.engine import EngineError
    from specsplit.kv.block_manager import OutOfBlocks

    if isinstance(e, RequestError):
        return e
    broken = bool(getattr(e, "broken", False))
    if isinstance(e, OutOfBlocks):
        return RequestError(RequestError.EXHAUSTED, str(e), e, broken)
    if isinstance(e, (EngineError, ValueError)):
        return RequestError(RequestError.INVALID, str(e), e, broken)
    return RequestError(RequestError.INTERNAL, f"internal error: {type(e).__name__}: {e}", e, broken)


@dataclass(frozen=True)
class GenerationRequest:
    """What a caller asks for. request_id is the caller's (bounded); engines see a short internal id."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    params: SamplingParams = SamplingParams()
    ignore_eos: bool = False
    num_speculative_tokens: int = 0  # 0 = the server's default
    disable_speculation: bool = False
    stop: tuple[str, ...] = ()
    # vLLM's: the text keeps the stop string it ends at, or the text of the stop_token_ids token
    include_stop_str_in_output: bool = False
    # token ids that end the output when generated, as EOS does (kept in token_ids; their text only
    # with include_stop_str_in_output; ignore_eos does not lift them)
    stop_token_ids: tuple[int, ...] = ()
    # None: no log-probabilities. n in 0..MAX_LOGPROBS: each emitted token carries its
    # log-probability under the target and the n most likely alternatives (TokenLogprob).
    logprobs: int | None = None
    # None: the prompt is not scored. n in 0..MAX_LOGPROBS: the first event carries the
    # log-probability of every prompt token after the first and the n most likely alternatives at
    # each prompt position (from the target's prefill). With it max_tokens may be 0: score only.
    prompt_logprobs: int | None = None


def stop_ids(request: GenerationRequest, eos_ids: Iterable[int]) -> frozenset[int]:
    """The token ids that end `request`'s output: the model's EOS ids unless ignore_eos, and its
    stop_token_ids."""
    return frozenset(() if request.ignore_eos else eos_ids) | frozenset(request.stop_token_ids)


def with_min_tokens_stops(request: GenerationRequest, eos_ids: Iterable[int]) -> GenerationRequest:
    """`request` with the ids its min_tokens holds back (stop_ids) in its sampling parameters, for
    the engines to ban (specsplit.sampling.penalties); unchanged without min_tokens."""
    if not request.params.min_tokens:
        return request
    held = tuple(sorted(stop_ids(request, eos_ids)))
    return replace(request, params=replace(request.params, min_tokens_stop_ids=held))


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_model_len: int
    # The SamplingParams features (SAMPLING_FEATURES) the verifier applies; None: all of this
    # version's (an in-process engine).
    sampling_features: frozenset[str] | None = None


def validate(req: GenerationRequest, limits: Limits | None) -> None:
    """Every check a request gets before anything is allocated; RequestError(invalid_argument)."""
    if len(req.request_id.encode("utf-8", "surrogatepass")) > MAX_REQUEST_ID_BYTES:
        raise invalid(f"request_id is {len(req.request_id.encode('utf-8', 'surrogatepass'))} bytes; "
                      f"at most {MAX_REQUEST_ID_BYTES} are allowed")
    if req.max_tokens < (0 if req.prompt_logprobs is not None else 1):
        raise invalid(f"max_tokens must be >= 1 (0 only with prompt_logprobs: score the prompt), got {req.max_tokens}")
    if not req.prompt_token_ids:
        raise invalid("the prompt is empty (or tokenizes to no tokens)")
    try:
        req.params.validate()
    except ValueError as e:
        hint = " (1, or unset in the API, = no nucleus filtering)" if str(e).startswith("top_p") else ""
        raise invalid(f"{e}{hint}") from None
    k = req.num_speculative_tokens
    if not 0 <= k <= MAX_SPECULATIVE_TOKENS:
        raise invalid(f"speculation.num_speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}], got {k}")
    if len(req.stop) > MAX_STOP_STRINGS or any(not s for s in req.stop):
        raise invalid(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings")
    if len(req.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise invalid(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} token ids, got {len(req.stop_token_ids)}")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise invalid(f"logprobs must be in [0, {MAX_LOGPROBS}] (alternatives per token; unset = no "
                      f"log-probabilities), got {req.logprobs}")
    if req.prompt_logprobs is not None and not 0 <= req.prompt_logprobs <= MAX_LOGPROBS:
        raise invalid(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}] (alternatives per prompt position; unset = "
                      f"none), got {req.prompt_logprobs}")
    if req.params.min_tokens > req.max_tokens:
        raise invalid(f"min_tokens ({req.params.min_tokens}) must be <= max_tokens ({req.max_tokens})")
    if req.params.min_tokens and req.params.grammar is not None:
        raise invalid("min_tokens cannot be combined with a grammar (response_format): the output ends where "
                      "the grammar does; unset min_tokens")
    if req.params.grammar is not None and req.ignore_eos:
        raise invalid("ignore_eos cannot be combined with a grammar (response_format): the output ends where "
                      "the grammar does; unset ignore_eos")
    if limits is None:
        return
    if limits.sampling_features is not None:
        dropped = [f for f in req.params.features if f not in limits.sampling_features]
        if dropped:
            raise invalid(f"{dropped[0]} is not applied by this server's verifier (an older version, which would "
                          f"ignore it); upgrade the verifier or leave {' and '.join(dropped)} out")
    bias_out = [t for t, _ in req.params.logit_bias if not 0 <= t < limits.vocab_size]
    if bias_out:
        raise invalid(f"logit_bias token ids {bias_out[:5]} are outside the vocabulary [0, {limits.vocab_size})")
    stop_out = [t for t in req.stop_token_ids if not 0 <= t < limits.vocab_size]
    if stop_out:
        raise invalid(f"stop_token_ids {stop_out[:5]} are outside the vocabulary [0, {limits.vocab_size})")
    bad = [i for i in req.prompt_token_ids if not 0 <= i < limits.vocab_size]
    if bad:
        raise invalid(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {limits.vocab_size})")
    n = len(req.prompt_token_ids)
    if n + max(req.max_tokens, 1) > limits.max_model_len:  # the prefill computes one token past the prompt
        raise invalid(
            f"prompt ({n} tokens) + max_tokens ({req.max_tokens}) = {n + req.max_tokens} "
            f"exceeds max_model_len {limits.max_model_len}; shorten the prompt or lower max_tokens"
        )


@dataclass
class Event:
    """What one request's stream gets: new tokens, the end (finish_reason + usage), or an error."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    usage: dict | None = None
    error: RequestError | None = None
    # One per token in token_ids when the request asked for logprobs; else None.
    logprobs: list[TokenLogprob] | None = None
    # On the first event of a request that asked for prompt_logprobs: one per prompt token after
    # the first (len(prompt) - 1); else None.
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    # The speculative step(s) behind this event: drafts proposed and accepted for this request.
    proposed: int = 0
    accepted: int = 0


class Request:
    """The live request. The scheduler's step thread feeds it; `finish` may come from any thread
    (a client cancel) and is idempotent: the first finish wins, later events are dropped."""

    def __init__(self, request: GenerationRequest, seq_id: str, arrival: int,
                 decode: Callable[[list[int]], str] | None = None, sink: Callable[[Event], None] | None = None):
        self.request = request  # kept under this name: the bench and tests read state.request
        self.seq_id = seq_id  # the short id the engines see (a new one after each preemption)
        self.arrival = arrival
        self.sink = sink
        self.text = TextStream(decode, request.stop, request.include_stop_str_in_output) if decode is not None else None
        self.output: list[int] = []
        self.finish_reason: str | None = None  # "length" | "stop" | "abort"
        self.error: RequestError | None = None
        self.proposed = 0
        self.accepted = 0
        self.accepted_per_position: list[int] = []  # steps that accepted draft j
        # One per token in output when the request asked for logprobs (None otherwise).
        self.logprobs: list[TokenLogprob] | None = [] if request.logprobs is not None else None
        self._sent = (0, 0, 0)  # (logprobs, proposed, accepted) already streamed
        # The prompt's TokenLogprobs once the verifier scored it (request.prompt_logprobs set);
        # they go with the next event.
        self.prompt_logprobs: tuple[TokenLogprob, ...] | None = None
        self._prompt_sent = False
        self.speculative_steps = 0  # steps that verified at least one draft token
        self.preemptions = 0
        # Why it decodes target-only although it asked to speculate (the scheduler found that the
        # drafter's whole KV cache can never hold it), or None.
        self.target_only: str | None = None
        self.closed = False
        self._lock = threading.Lock()

    # ---- what the request is -----------------------------------------------------------
    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        return self.request.prompt_token_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    @property
    def budget(self) -> int:
        return self.request.max_tokens - len(self.output)

    @property
    def num_tokens(self) -> int:
        """Prompt + output: what the engines hold (or recompute on resume)."""
        return len(self.request.prompt_token_ids) + len(self.output)

    def seq_add(self) -> SeqAdd:
        """The engines' view: on resume after a preemption, the prompt is prompt + output."""
        scored = self.prompt_logprobs is not None  # a resumed request is not scored again
        return SeqAdd(self.seq_id, tuple(self.request.prompt_token_ids) + tuple(self.output), self.request.params,
                      self.request.logprobs, generated=len(self.output),
                      prompt_logprobs=None if scored else self.request.prompt_logprobs)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Asked for the prompt's log-probabilities and not given them yet."""
        return self.request.prompt_logprobs is not None and self.prompt_logprobs is None

    def take_prompt_logprobs(self, lps: Sequence[TokenLogprob]) -> None:
        """The verifier scored the prompt (the first one counts: a resumed request is not scored again)."""
        if self.prompt_logprobs is None:
            self.prompt_logprobs = tuple(lps[: len(self.request.prompt_token_ids) - 1])

    def usage(self) -> dict:
        return {
            "prompt_tokens": len(self.request.prompt_token_ids),
            "completion_tokens": len(self.output),
            "proposed_draft_tokens": self.proposed,
            "accepted_draft_tokens": self.accepted,
            "accepted_per_position": list(self.accepted_per_position),
        }

    # ---- the step thread ----------------------------------------------------------------
    def take(self, tokens: Iterable[int], eos_ids: Iterable[int],
             logprobs: Sequence[TokenLogprob] | None = None) -> list[int]:
        """Append a step's tokens up to max_tokens, EOS, a stop token or a stop string (those from
        the (min_tokens + 1)-th token on); returns those kept. logprobs: one per token when the
        request asked for them; cut where the tokens are. The token that ends the output stays in
        the tokens but not in the text (vLLM's rule): EOS's never, a stop_token_ids token's unless
        include_stop_str_in_output."""
        eos = stop_ids(self.request, eos_ids)
        min_tokens = self.request.params.min_tokens
        silent = eos if not self.request.include_stop_str_in_output else eos - set(self.request.stop_token_ids)
        kept: list[int] = []
        for j, t in enumerate(tokens):
            if self.budget <= 0 or self.finished:
                break
            kept.append(t)
            self.output.append(t)
            if self.logprobs is not None and logprobs is not None:
                self.logprobs.append(logprobs[j])
            ends = t in eos and len(self.output) > min_tokens
            if self.text is not None and not (ends and t in silent):
                self.text.add(t, stops=len(self.output) > min_tokens)
                if self.text.stopped:
                    self.finish_reason = "stop"
                    break
            if ends:
                self.finish_reason = "stop"
                break
        if self.finish_reason is None and self.budget <= 0:
            self.finish_reason = "length"
        return kept

    def count_drafts(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        if proposed:
            self.speculative_steps += 1
            per_pos = self.accepted_per_position
            per_pos.extend([0] * (proposed - len(per_pos)))
            for j in range(accepted):
                per_pos[j] += 1

    def _event(self, tokens: list[int], text: str, **kw) -> Event:
        """An event for `tokens` (the newest kept ones): their logprobs and the drafts proposed and
        accepted since the last event, so that the events' counts add up to usage. Under _lock."""
        lp, proposed, accepted = self._sent
        logprobs = None
        if self.logprobs is not None:
            logprobs = self.logprobs[lp: lp + len(tokens)]
            lp += len(logprobs)
        self._sent = (lp, self.proposed, self.accepted)
        prompt = None
        if self.prompt_logprobs is not None and not self._prompt_sent:
            prompt, self._prompt_sent = self.prompt_logprobs, True
        return Event(tokens, text, logprobs=logprobs, proposed=self.proposed - proposed,
                     accepted=self.accepted - accepted, prompt_logprobs=prompt, **kw)

    def emit(self, kept: list[int]) -> None:
        """Stream this step's kept tokens (nothing once the request is closed)."""
        with self._lock:
            if self.closed or self.sink is None:
                return
            self.sink(self._event(list(kept), self.text.take() if self.text is not None else ""))

    # ---- any thread ---------------------------------------------------------------------
    def finish(self, reason: str | None = None, tokens: list[int] | None = None,
               error: RequestError | None = None) -> bool:
        """End the stream: the final event (tokens, text, reason, usage) or the error. Returns
        whether this call ended it (False: it had already ended)."""
        with self._lock:
            if self.closed:
                return False
            self.closed = True
            if error is not None:
                self.error = error
                ev = Event(error=error)
            else:
                self.finish_reason = self.finish_reason or reason
                text = self.text.take(final=True) if self.text is not None else ""
                ev = self._event(list(tokens or []), text, finish_reason=self.finish_reason, usage=self.usage())
            if self.sink is not None:
                self.sink(ev)
            return True

