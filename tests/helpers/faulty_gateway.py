"""`python -m tests.helpers.faulty_gateway serve|gateway ...`: the real CLI with a fault in the
gateway armed from the environment (read once, at start-up). Test-only: production code carries
no hook.

    SPECSPLIT_FAULT_STALL_AFTER_STEPS=N   after N scheduler steps with work (a request running or
                                          waiting), the next one blocks forever (a stuck engine
                                          call, as the step thread sees it)
    SPECSPLIT_FAULT_TOKENIZE_SECONDS=T    every prompt text takes T more seconds to tokenize; the
                                          log says "TEST FAULT: tokenizing" when one starts
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time

from specsplit.cli import main
from specsplit.gateway.service import Tokenizer
from specsplit.scheduler import Scheduler

log = logging.getLogger("tests.faulty_gateway")


def stall_after(steps: int) -> None:
    step = Scheduler.step
    count = [0]
    never = threading.Event()

    def stalling_step(self, *args, **kw):
        if not (self.running or self.waiting):  # idle polls do not count
            return step(self, *args, **kw)
        count[0] += 1
        if count[0] > steps:
            log.warning("TEST FAULT: scheduler step %d blocks forever", count[0])
            never.wait()
        return step(self, *args, **kw)

    Scheduler.step = stalling_step


def slow_tokenizer(seconds: float) -> None:
    encode_request = Tokenizer.encode_request

    def slow(self, msg):
        log.warning("TEST FAULT: tokenizing (%.1fs more)", seconds)
        time.sleep(seconds)
        return encode_request(self, msg)

    Tokenizer.encode_request = slow


if __name__ == "__main__":
    if os.environ.get("SPECSPLIT_FAULT_STALL_AFTER_STEPS"):
        stall_after(int(os.environ["SPECSPLIT_FAULT_STALL_AFTER_STEPS"]))
    if os.environ.get("SPECSPLIT_FAULT_TOKENIZE_SECONDS"):
        slow_tokenizer(float(os.environ["SPECSPLIT_FAULT_TOKENIZE_SECONDS"]))
    sys.exit(main(sys.argv[1:]))
