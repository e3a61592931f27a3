"""Fault injection around a real Drafter: subclasses override one call and delegate the rest."""
from __future__ import annotations

from specsplit.protocols import DrafterTraits


class DrafterWrapper(DrafterTraits):
    """Delegates every Drafter call to a real engine (DraftEngine, HybridDrafter, NgramDrafter)."""

    def __init__(self, engine):
        self.engine = engine
        self.calls = 0
        self.failures = 0

    def add(self, seqs):
        return self.engine.add(seqs)

    def propose(self, reqs):
        return self.engine.propose(reqs)

    def fetch_rows(self, fetch):
        return self.engine.fetch_rows(fetch)

    def release(self, ids, finished=False):
        return self.engine.release(ids, finished=finished)


class LosesRows(DrafterWrapper):
    """fetch_rows fails all but one call in `every` (a drafter lost after it proposed): a
    failure pattern that does not look at the step's outcome."""

    def __init__(self, engine, every: int = 3):
        super().__init__(engine)
        self.every = every

    def fetch_rows(self, fetch):
        self.calls += 1
        if self.calls % self.every:
            self.failures += 1
            raise ConnectionError("drafter lost before it sent its q rows")
        return self.engine.fetch_rows(fetch)


class FailsAhead(DrafterWrapper):
    """Pre-draft calls (ProposeRequest.pre_draft) fail one in two: the drafter lost mid-pre-draft."""

    def propose(self, reqs):
        if any(r.pre_draft for r in reqs):
            self.calls += 1
            if self.calls % 2:
                self.failures += 1
                raise ConnectionError("drafter lost while pre-drafting")
        return self.engine.propose(reqs)
