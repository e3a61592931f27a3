"""`specsplit up --verifier-cpus/--drafter-cpus/--gateway-cpus`: CPU lists parsed and checked
before anything starts (specsplit/cli/up.py)."""
from __future__ import annotations

import os

import pytest

from specsplit.cli.up import cpu_list


def test_cpu_lists_parse():
    first = min(os.sched_getaffinity(0))
    assert cpu_list(None) is None
    assert cpu_list(str(first)) == {first}
    cpus = sorted(os.sched_getaffinity(0))
    assert cpu_list(f"{cpus[0]}-{cpus[-1]}") == set(range(cpus[0], cpus[-1] + 1)) & set(range(cpus[0], cpus[-1] + 1))


@pytest.mark.parametrize("text", ["", "a", "1-x", "99999", "0,99999"])
def test_bad_cpu_lists_name_the_flag(text):
    with pytest.raises(ValueError, match="--drafter-cpus"):
        cpu_list(text, "--drafter-cpus")


def test_up_check_refuses_a_bad_cpu_list():
    from specsplit.cli import main

    rc = main(["up", "--target", "smollm2-135m", "--draft", "ngram", "--drafter-cpus", "99999", "--check"])
    assert rc != 0


def test_pinned_child_runs_on_its_cpus_under_its_own_pid():
    """The child sets its affinity and execs the command: same pid (signals and poll() reach the
    service), the CPUs asked for, and the command's own arguments and exit code."""
    import subprocess
    import sys

    from specsplit.cli.up import pinned

    first = min(os.sched_getaffinity(0))
    cmd = [sys.executable, "-c", "import os, sys; print(os.getpid(), sorted(os.sched_getaffinity(0)), sys.argv[1:]); "
           "sys.exit(3)", "a b", "c"]
    proc = subprocess.Popen(pinned(cmd, {first}), stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 3
    assert out.strip() == f"{proc.pid} [{first}] ['a b', 'c']"
    assert pinned(cmd, None) == cmd

