"""`python -m tests.helpers.stuck_gateway serve ...`: the real CLI with the gateway's scheduler
made to hang, armed from the environment (read once, at start-up). Test-only: production code
carries no hook.

    SPECSPLIT_FAULT_STALL_AFTER_STEPS=N   after N scheduler steps with work (a request running or
                                          waiting), the next one blocks forever (a stuck engine
                                          call, as the step thread sees it)
"""
from __future__ import annotations

import logging
import os
import sys
import threading

from specsplit.cli import main
from specsplit.scheduler import Scheduler

log = logging.getLogger("tests.stuck_gateway")


def arm(after_steps: int) -> None:
    step = Scheduler.step
    count = [0]
    never = threading.Event()

    def stalling_step(self, *args, **kw):
        if not (self.running or self.waiting):  # idle polls do not count
            return step(self, *args, **kw)
        count[0] += 1
        if count[0] > after_steps:
            log.warning("TEST FAULT: scheduler step %d blocks forever", count[0])
            never.wait()
        return step(self, *args, **kw)

    Scheduler.step = stalling_step


if __name__ == "__main__":
    after = os.environ.get("SPECSPLIT_FAULT_STALL_AFTER_STEPS")
    if after:
        arm(int(after))
    sys.exit(main(sys.argv[1:]))
