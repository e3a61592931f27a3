"""`specsplit token PATH` (specsplit/cli/token.py): a 0600 token written once and kept; rotate
replaces it; the temporary file has an unpredictable name, so a planted link is never followed."""
from __future__ import annotations

import os
import stat

from specsplit.cli.token import ensure_token


def test_written_once_0600_kept_and_rotated(tmp_path):
    path = tmp_path / "sub" / "token"
    assert ensure_token(str(path)) is True
    first = path.read_text()
    assert len(first.strip()) == 64 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ensure_token(str(path)) is False and path.read_text() == first
    assert ensure_token(str(path), rotate=True) is True and path.read_text() != first
    assert sorted(p.name for p in path.parent.iterdir()) == ["token"]  # no temporary left behind


def test_a_planted_link_at_the_old_temporary_name_is_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("do not touch\n")
    path = tmp_path / "token"
    os.symlink(victim, tmp_path / "token.tmp")  # the name the old code wrote through
    assert ensure_token(str(path)) is True
    assert victim.read_text() == "do not touch\n" and not path.is_symlink()
