"""Requests, their stop rules, and a synchronous continuous-batching loop over a SpecDecoder.

`specsplit generate` (local) and the benchmarks use `Generator`; the gateway's async scheduler
reuses `GenerationRequest` / `RequestState` so the stop rules are written once.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

from specsplit.protocols import SeqAdd
from specsplit.sampling.params import SamplingParams
from specsplit.spec import SpecDecoder


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    params: SamplingParams = SamplingParams()
    ignore_eos: bool = False
    num_speculative_tokens: int = 0  # 0 = the server's default
    disable_speculation: bool = False

    def seq_add(self) -> SeqAdd:
        return SeqAdd(self.request_id, tuple(self.prompt_token_ids), self.params)


@dataclass
class RequestState:
    request: GenerationRequest
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "length" | "stop" | "abort"
    proposed: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # steps that accepted draft j
    speculative_steps: int = 0  # steps that verified at least one draft token

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def budget(self) -> int:
        return self.request.max_tokens - len(self.output)

    def take(self, tokens: list[int], eos_ids: Iterable[int]) -> list[int]:
        """Append a step's tokens up to max_tokens or EOS; returns the tokens actually kept."""
        eos = set() if self.request.ignore_eos else set(eos_ids)
        kept: list[int] = []
        for t in tokens:
            if self.budget <= 0:
                break
            kept.append(t)
            self.output.append(t)
            if t in eos:
                self.finish_reason = "stop"
                return kept
        if self.budget <= 0:
            self.finish_reason = "length"
        return kept


class Generator:
    """Runs requests to completion; requests join between steps when a slot is free."""

    def __init__(self, decoder: SpecDecoder, eos_token_ids: Iterable[int], max_num_seqs: int = 32):
        self.decoder = decoder
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[RequestState] = deque()
        self.running: dict[str, RequestState] = {}
        self.steps = 0
        self.speculative_steps = 0

    def submit(self, request: GenerationRequest) -> RequestState:
        if request.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {request.max_tokens}")
        state = RequestState(request)
        self.waiting.append(state)
        return state

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            state = self.waiting.popleft()
            r = state.request
            self.decoder.add(r.seq_add(), r.num_speculative_tokens or None, r.disable_speculation)
            self.running[r.request_id] = state

    def step(self) -> list[tuple[RequestState, list[int]]]:
        """One step; returns (request, tokens kept this step) for every running request."""
        self._admit()
        if not self.running:
            return []
        out = self.decoder.step({rid: st.budget for rid, st in self.running.items()})
        self.steps += 1
        self.speculative_steps += int(out.speculated)
        events = []
        done = []
        for rid, tokens in out.tokens.items():
            state = self.running[rid]
            kept = state.take(tokens, self.eos_token_ids)
            events.append((state, kept))
            if state.finished:
                done.append(rid)
        self._count(out)
        if done:
            self.decoder.release(done)
            for rid in done:
                del self.running[rid]
        return events

    def _count(self, out) -> None:
        for rid, (proposed, accepted) in out.drafts.items():
            state = self.running[rid]
            state.proposed += proposed
            state.accepted += accepted
            if proposed:
                state.speculative_steps += 1
                per_pos = state.accepted_per_position
                per_pos.extend([0] * (proposed - len(per_pos)))
                for j in range(accepted):
                    per_pos[j] += 1

    def run(
        self,
        requests: Iterable[GenerationRequest],
        on_tokens: Callable[[RequestState, list[int]], None] | None = None,
    ) -> list[RequestState]:
        states = [self.submit(r) for r in requests]
        while self.waiting or self.running:
            for state, kept in self.step():
                if on_tokens is not None and kept:
                    on_tokens(state, kept)
        return states
