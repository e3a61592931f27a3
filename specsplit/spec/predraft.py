"""Asynchronous pre-drafting: while the verifier verifies step t's drafts D, one thread asks the
drafter for the branch "every draft of D accepted": its guess b of the bonus token, then k drafts
after D + b. When the step emits exactly D + b (a hit) those k drafts are step t+1's (`ready`);
otherwise (a miss) the drafter drafts just in time, as in lockstep.

Lossless by construction: a branch's drafts (and q(x), q rows) are drawn from q given that
branch's prefix, and used only when the emitted tokens equal it; whether they are used depends on
b and the verifier's draws, never on the branch's own draws (the keyed random numbers of the
positions after b are used by nothing else)."""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

from specsplit.protocols import Drafter, Proposal, ProposeRequest, VerifyRequest


class PreDrafter:
    def __init__(self, drafter: Drafter):
        self.drafter = drafter
        self.ready: dict[str, Proposal] = {}  # next step's drafts of the branches that came true
        self._pool: ThreadPoolExecutor | None = None  # the thread that calls the drafter while the verifier runs

    def take_ready(self) -> dict[str, Proposal]:
        """The branches that came true last step (this step uses them or drops them)."""
        ready, self.ready = self.ready, {}
        return ready

    def start(self, asks: Sequence[ProposeRequest]) -> Future:
        """Send the branch requests on the pre-draft thread; join with `.result()`."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="predraft")
        return self._pool.submit(self.drafter.propose, list(asks))

    def came_true(self, req: VerifyRequest, emitted: Sequence[int], branch: Proposal) -> bool:
        """Whether the step emitted the branch's prefix (every draft, then the guessed bonus); if
        so, keep the branch's remaining drafts for the next step."""
        if len(branch.token_ids) < 2 or tuple(emitted) != tuple(req.draft_token_ids) + branch.token_ids[:1]:
            return False
        self.ready[req.seq_id] = Proposal(req.seq_id, branch.token_ids[1:],
                                          None if branch.probs is None else branch.probs[1:])
        return True
