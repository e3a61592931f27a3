"""The drafter as the step sees it: up, or down since a failed call (a missed deadline included) and
probed every `retry_s` off the step thread; when it answers again the running sequences are given
to it again (re-sync), a bounded number of tokens a step. A drafter that
refuses one call's sequences (`refused`) is not down: only those sequences decode target-only."""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future

from specsplit.protocols import Drafter, SeqAdd
from specsplit.request import RequestError, error_from_exception
from specsplit.spec.track import Track

log = logging.getLogger("specsplit.spec")

# A probe asks the drafter's GetInfo on a thread of its own (Drafter.probe) and may take this
# long: no step waits for it, the steps go on target-only and look at it when it has answered.
PROBE_S = 2.0
# Token ids re-added to the drafter per step after a re-sync (at least one sequence a step): an
# add is ids only, the drafter computes them later in bounded catch-up pieces (spec/decoder.py).
RESYNC_TOKENS = 2048


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
        self._probe: Future | None = None  # the GetInfo in flight while down
        self._probe_at = 0.0  # when it began
        self.readds = 0  # add calls that re-synced sequences

    @property
    def up(self) -> bool:
        return self.drafter is not None and self.down_since is None

    def failed(self, error: Exception, tracks: dict[str, Track]) -> None:
        """A drafter call failed: every sequence goes on target-only until the re-sync."""
        late = getattr(error, "timed_out", False)
        if self.down_since is None:
            if late:  # slow or hung, not broken: no step waits for it again until a probe says it answers
                log.warning("drafter late (%s); its drafts are dropped, continuing target-only while it is probed "
                            "off the step thread", error)
            else:
                log.warning("drafter failed (%s); continuing target-only, retrying every %.1fs", error, self.retry_s)
            self.down_since = self._clock()
        # Late: probe at once (off the step thread), so it is back as soon as it answers; otherwise
        # (gone, or it answered wrongly) not before retry_s.
        self._next_try = self._clock() + (0.0 if late else self.retry_s)
        for t in tracks.values():
            if t.on_drafter:
                # A failed call may have failed only for us (a timeout, one bad reply): the drafter
                # may still hold the sequence. Remember it, so it is released there on re-sync even
                # if it finishes while the drafter is down.
                self._stale.add(t.seq_id)
            t.lose_drafter()

    def maybe_resync(self, tracks: dict[str, Track]) -> None:
        """Down: once the retry time has come, probe the drafter off the step thread; when the
        probe says it answers, release what it may still hold and take it back up. Up: re-add the
        sequences that speculate and are not on it (added while it was down, or lost with it),
        RESYNC_TOKENS a step; each then catches up in pieces before it drafts again."""
        if self.drafter is None:
            return
        if self.down_since is not None:
            if not self._probe_answered():
                return
            try:  # what it may still hold: sequences of the failed call, or finished while down
                self.drafter.release(sorted(self._stale))
                self._stale.clear()
            except Exception as e:
                self._next_try = self._clock() + self.retry_s
                log.debug("drafter still unavailable: %s", e)
                return
            log.info("drafter is back after %.1fs; speculation resumes as %d sequences are re-added (%d tokens a "
                     "step) and caught up", self._clock() - self.down_since,
                     sum(1 for t in tracks.values() if t.k > 0), RESYNC_TOKENS)
            self.down_since = None
        self._readd(tracks)

    def _probe_answered(self) -> bool:
        """Whether the probe in flight answered yes (starting one when the retry time has come);
        never waits."""
        if self._probe is None:
            if self._clock() < self._next_try:
                return False
            self._probe = self.drafter.probe(PROBE_S)
            self._probe_at = self._clock()
        if not self._probe.done():
            return False
        probe, self._probe = self._probe, None
        try:
            ok = bool(probe.result())
        except Exception:
            ok = False
        if not ok:  # retry_s after this probe began: a hung drafter is probed without a pause between
            self._next_try = self._probe_at + self.retry_s
        return ok

    def _readd(self, tracks: dict[str, Track]) -> None:
        limit = self.drafter.max_model_len
        # Not the sequences it would refuse (longer than its max_model_len): they go on target-only
        want = [t for t in tracks.values() if t.k > 0 and not t.on_drafter and (not limit or len(t.tokens) < limit)]
        batch, size = [], 0
        for t in want:
            if batch and size + len(t.tokens) > RESYNC_TOKENS:
                break
            batch.append(t)
            size += len(t.tokens)
        if not batch:
            return
        try:
            took = self._add_all(batch)
        except Exception as e:
            self.failed(e, tracks)
            return
        self.readds += 1
        log.info("re-synced %d of %d sequences to the drafter (%d tokens); they catch up in pieces",
                 len(took), len(want), size)
        # A model drafter recomputes each context (in catch-up pieces); a feature drafter reads the
        # target's features from the next verify on and skips what it never saw: nothing to catch up
        model = not self.drafter.feature_layers
        for t in took:
            t.on_drafter = True
            t.unsent = []
            t.behind = len(t.tokens) if model else 0
            t.catch_up = model

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
