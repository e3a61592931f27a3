"""specsplit/cli/up.py RestartPause: the pause before a dead drafter is started again (the restart
itself, end to end: tests/e2e/test_up_split.py::test_a_drafter_that_dies_is_started_again)."""
from __future__ import annotations

from specsplit.cli.up import RESTART_FIRST_S, RESTART_MAX_S, RESTART_STEADY_S, RestartPause


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_crash_loop_waits_longer_each_time_up_to_the_cap():
    clock = _Clock()
    pause = RestartPause(clock)
    waits = []
    for _ in range(8):
        clock.now += 0.5  # dies half a second after each start
        waits.append(pause.died())
        clock.now += waits[-1]
        pause.restarted()
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, RESTART_MAX_S, RESTART_MAX_S, RESTART_MAX_S]


def test_a_drafter_that_lived_a_while_is_restarted_at_once():
    clock = _Clock()
    pause = RestartPause(clock)
    for _ in range(4):  # a crash loop: the pause has grown to 16 s
        clock.now += 1
        pause.died()
        pause.restarted()
    clock.now += RESTART_STEADY_S  # then a start that lives a minute
    assert pause.died() == RESTART_FIRST_S
