"""The drafter as the step sees it: up, or down since a failed call and retried every `retry_s`;
when it answers again every running sequence is given to it again (re-sync). A drafter that
refuses one call's sequences (`refused`) is not down: only those sequences decode target-only."""
from __future__ import annotations

import logging
import time

from specsplit.protocols import Drafter, SeqAdd
from specsplit.request import RequestError, error_from_exception
from specsplit.spec.track import Track

log = logging.getLogger("specsplit.spec")

PROBE_S = 0.25  # a re-sync first asks the drafter whether it answers, for at most this long


def refused(error: BaseException) -> bool:
    """Whether the drafter refused the sequences of one call and is otherwise well: it answered
    that they are invalid for it or that it has no room for them (nothing was added), rather than
    failing, timing out or going away. The one rule for "this sequence, not the drafter"."""
    if getattr(error, "broken", False):
        return False
    kind = getattr(error, "kind", None) or error_from_exception(error).kind  # a peer's status, or ours
    return kind in (RequestError.INVALID, RequestError.EXHAUSTED)


class DrafterHealth:
    def __init__(self, drafter: Drafter | None, retry_s: float = 1.0, clock=time.monotonic):
        self.drafter = drafter
        self.retry_s = retry_s
        self._clock = clock
        self.down_since: float | None = None
        self._next_try = 0.0
        self._stale: set[str] = set()  # may still be on the drafter since it failed

    @property
    def up(self) -> bool:
        return self.drafter is not None and self.down_since is None

    def failed(self, error: Exception, tracks: dict[str, Track]) -> None:
        """A drafter call failed: every sequence goes on target-only until the re-sync."""
        if self.down_since is None:
            log.warning("drafter failed (%s); continuing target-only, retrying every %.1fs", error, self.retry_s)
            self.down_since = self._clock()
        self._next_try = self._clock() + self.retry_s
        for t in tracks.values():
            if t.on_drafter:
                # A failed call may have failed only for us (a timeout, one bad reply): the drafter
                # may still hold the sequence. Remember it, so it is released there on re-sync even
                # if it finishes while the drafter is down.
                self._stale.add(t.seq_id)
            t.lose_drafter()

    def maybe_resync(self, tracks: dict[str, Track]) -> None:
        """After a failure, once the retry time has come, give the drafter every running sequence
        that speculates again (releasing first what it may still hold)."""
        if self.drafter is None or self.down_since is None or self._clock() < self._next_try:
            return
        if not self.drafter.reachable(PROBE_S):  # still down (or hung): no re-sync at its full timeout
            self._next_try = self._clock() + self.retry_s
            return
        limit = self.drafter.max_model_len
        # Not the sequences it would refuse (longer than its max_model_len): they go on target-only
        want = [t for t in tracks.values() if t.k > 0 and (not limit or len(t.tokens) < limit)]
        # Release what it may still hold: the sequences to re-add, and those that finished while it
        # was down (their release was never sent).
        stale = sorted(self._stale | {t.seq_id for t in want})
        try:
            self.drafter.release(stale)
            self._stale.clear()
            want = self._add_all(want)
        except Exception as e:
            self._next_try = self._clock() + self.retry_s
            log.debug("drafter still unavailable: %s", e)
            return
        log.info("drafter is back after %.1fs; re-synced %d sequences, speculation resumes",
                 self._clock() - self.down_since, len(want))
        self.down_since = None
        for t in want:
            t.on_drafter = True
            t.unsent = []
            t.fresh = True

    def _add_all(self, tracks: list[Track]) -> list[Track]:
        """Give the drafter these sequences in one call; if it refuses that call, one by one, and
        those it refuses alone decode target-only from now on. The tracks it took."""
        try:
            self.drafter.add([SeqAdd(t.seq_id, tuple(t.tokens), t.add.params) for t in tracks])
            return tracks
        except Exception as e:
            if not refused(e):
                raise
        took = []
        for t in tracks:
            try:
                self.drafter.add([SeqAdd(t.seq_id, tuple(t.tokens), t.add.params)])
                took.append(t)
            except Exception as e:
                if not refused(e):
                    raise
                target_only(t, e)
        return took


def target_only(t: Track, why: BaseException) -> None:
    """The drafter refused this sequence: it decodes target-only from now on (re-syncs skip it)."""
    log.info("sequence %s decodes target-only: the drafter refused it (%s)", t.seq_id, why)
    t.k = 0
