"""`python -m tests.helpers.faulty_verifier verifier ...`: the real verifier CLI with a fault armed
from the environment (read once, at start-up). Test-only: production code carries no hook.

    SPECSPLIT_FAULT_VERIFY_AFTER_STEPS=N   after N verify steps, every verify raises
                                           (UNAVAILABLE "injected fault") ...
    SPECSPLIT_FAULT_VERIFY_SECONDS=T       ... for T seconds, then the verifier recovers
                                           (unset or 0: it never recovers)

Used by tests/reliability to check that a failing forward ends every stream with an error status,
that new requests fail until it recovers, and that nothing hangs.
"""
from __future__ import annotations

import logging
import os
import sys
import time

import grpc

from specsplit.cli import main
from specsplit.rpc import wire
from specsplit.verifier_svc.service import VerifierServicer

log = logging.getLogger("tests.faulty_verifier")


class VerifyFault:
    def __init__(self, after_steps: int | None, seconds: float = 0.0):
        self.after_steps = after_steps
        self.seconds = seconds
        self.steps = 0
        self.failing_since: float | None = None

    @classmethod
    def from_env(cls) -> "VerifyFault":
        after = os.environ.get("SPECSPLIT_FAULT_VERIFY_AFTER_STEPS")
        return cls(int(after) if after else None, float(os.environ.get("SPECSPLIT_FAULT_VERIFY_SECONDS") or 0))

    def check(self) -> None:
        if self.after_steps is None:
            return
        self.steps += 1
        if self.steps <= self.after_steps:
            return
        now = time.monotonic()
        if self.failing_since is None:
            self.failing_since = now
            log.warning("TEST FAULT: verify fails from step %d", self.steps)
        if self.seconds and now - self.failing_since >= self.seconds:
            log.warning("TEST FAULT: recovered after %.1fs", now - self.failing_since)
            self.after_steps = None
            return
        raise wire.ServiceError(grpc.StatusCode.UNAVAILABLE, "injected fault (SPECSPLIT_FAULT_VERIFY_AFTER_STEPS): "
                                                             "the target forward failed")


def arm(fault: VerifyFault) -> None:
    """Every verify request the servicer handles passes the fault first."""
    handle_one = VerifierServicer._handle_one

    def faulty(self, session, req):
        if req.WhichOneof("kind") == "verify":
            fault.check()
        return handle_one(self, session, req)

    VerifierServicer._handle_one = faulty
    log.warning("TEST FAULT armed: verify fails after %s steps%s", fault.after_steps,
                f" for {fault.seconds:g}s" if fault.seconds else " for good")


if __name__ == "__main__":
    arm(VerifyFault.from_env())
    sys.exit(main(sys.argv[1:]))
