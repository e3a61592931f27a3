"""One running sequence as the speculative step keeps it (the step's only per-sequence state)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specsplit.k_policy import Acceptance
from specsplit.protocols import SeqAdd

MAX_FEATURE_ROWS = 2048  # per sequence, waiting for the drafter (a long prompt's prefill fits)
IDLE_FEATURE_ROWS = 64  # ... after a step that did not ask the drafter (speculation off)


@dataclass
class Track:
    add: SeqAdd
    k: int  # speculative tokens for this request (0 = none)
    tokens: list[int]  # prompt + every emitted token
    unsent: list[int] = field(default_factory=list)  # emitted, not yet sent to the drafter
    on_drafter: bool = False
    # Tokens the drafter holds for this sequence but has not computed: the prompt at add (less the
    # prompt pieces it computed), the whole context after a re-sync; 0 once it drafted. What its
    # next propose must compute beyond a step's own tokens (the step's deadline allows for it).
    behind: int = 0
    # Re-added by a re-sync: catching up in pieces, target-only, until `behind` is computed
    # (spec/decoder.py CATCH_UP_TOKENS).
    catch_up: bool = False
    acceptance: Acceptance = field(default_factory=Acceptance)  # per position, for the K policy
    asked: int = 0  # the k this step's drafter call asked for (0: none); counted with the step's acceptance
    # Chunked prefill: prompt tokens the verifier has not computed yet (the whole prompt at add).
    # The scheduler hands out pieces of it (SpecDecoder.step's `prefill`); 0 once a step emitted.
    prefill_left: int = 0
    # Feature drafters: the target's features [rows, F] of positions feat_start.., committed since
    # the drafter last heard; sent with `unsent`. Bounded (MAX_FEATURE_ROWS, newest kept): while
    # speculation is off nothing grows past it, and the drafter skips a gap it never saw.
    feats: torch.Tensor | None = None
    feat_start: int = 0

    @property
    def seq_id(self) -> str:
        return self.add.seq_id

    def add_features(self, start: int, rows: torch.Tensor, cap: int) -> None:
        rows = rows.to(torch.bfloat16)  # what crosses the wire too, and what the head was trained on
        if self.feats is not None and start == self.feat_start + self.feats.shape[0]:
            start, rows = self.feat_start, torch.cat([self.feats, rows])
        drop = max(0, rows.shape[0] - cap)
        self.feats, self.feat_start = rows[drop:], start + drop

    def take_features(self) -> tuple[torch.Tensor | None, int]:
        out = (self.feats, self.feat_start)
        self.feats = None
        return out

    def lose_drafter(self) -> None:
        """The drafter failed: it no longer knows this sequence (re-added on re-sync)."""
        self.on_drafter = False
        self.unsent = []
        self.behind = 0
        self.catch_up = False
        self.feats = None
