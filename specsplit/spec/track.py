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
    # Feature drafters: the target's features of positions feat_start.., committed since the
    # drafter last heard, as the steps brought them (pieces [rows, F], joined when taken: no copy
    # of the kept rows per step); sent with `unsent`. Bounded (MAX_FEATURE_ROWS, newest kept):
    # while speculation is off nothing grows past it, and the drafter skips a gap it never saw.
    feat_pieces: list[torch.Tensor] = field(default_factory=list)
    feat_start: int = 0
    feature_rows: int = 0  # rows in feat_pieces

    @property
    def seq_id(self) -> str:
        return self.add.seq_id

    def add_features(self, start: int, rows: torch.Tensor, cap: int) -> None:
        """Rows [n, F] of positions start..; kept after the ones held where they follow them
        (else they replace them), the oldest dropped past `cap` rows."""
        rows = rows.to(torch.bfloat16)  # what crosses the wire too, and what the head was trained on
        if not self.feat_pieces or start != self.feat_start + self.feature_rows:
            self.feat_pieces, self.feat_start, self.feature_rows = [], start, 0
        self.feat_pieces.append(rows)
        self.feature_rows += rows.shape[0]
        drop = self.feature_rows - cap
        while drop > 0:
            first = self.feat_pieces[0]
            n = min(drop, first.shape[0])
            if n == first.shape[0]:
                self.feat_pieces.pop(0)
            else:
                self.feat_pieces[0] = first[n:]
            self.feat_start += n
            self.feature_rows -= n
            drop -= n

    def take_features(self) -> tuple[torch.Tensor | None, int]:
        """The rows held [rows, F] (None: none) and their first position; held no more."""
        pieces, start = self.feat_pieces, self.feat_start
        self.feat_pieces, self.feature_rows = [], 0
        if not pieces:
            return None, start
        return (pieces[0] if len(pieces) == 1 else torch.cat(pieces)), start

    def lose_drafter(self) -> None:
        """The drafter failed: it no longer knows this sequence (re-added on re-sync)."""
        self.on_drafter = False
        self.unsent = []
        self.behind = 0
        self.catch_up = False
        self.feat_pieces, self.feature_rows = [], 0
