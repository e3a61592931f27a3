"""What the step checks in a drafter's answers before the verifier sees them: a peer's bad answer
costs its sequence one target-only step, never a stream."""
from __future__ import annotations

import logging
import math
from typing import Iterable, Sequence

import torch

from specsplit.draft_tree import parents_problem, tree_depths
from specsplit.protocols import Proposal, ProposeRequest, QRow, RowRequest
from specsplit.spec.track import Track

log = logging.getLogger("specsplit.spec")


def checked_proposals(reqs: Sequence[ProposeRequest], proposals: Iterable[Proposal], tracks: dict[str, Track],
                      vocab: int | None, skip: set[str]) -> dict[str, Proposal]:
    """The drafter's proposals that are safe to verify, by seq_id. A proposal is dropped (its
    sequence decodes target-only this step, and the drafter catches up next step) when it answers
    no request of ours, drafts more than the k asked for, has an id outside the vocabulary, or --
    for a sampled sequence -- lacks a q(x) per draft or has one that is not a finite number in
    (0, 1]. `skip`: sequences that verify no proposal this step (their last step was abandoned)."""
    asked = {r.seq_id: r for r in reqs}
    out = {}
    for p in proposals:
        if p.seq_id in skip:
            continue
        why = proposal_problem(p, asked, vocab, tracks)
        if why is None:
            out[p.seq_id] = p
        else:
            log.warning("drafter proposal for %r refused (%s); that sequence decodes target-only this step",
                        p.seq_id, why)
    return out


def proposal_problem(p: Proposal, asked: dict[str, ProposeRequest], vocab: int | None,
                     tracks: dict[str, Track]) -> str | None:
    """Why a drafter's proposal cannot be verified, or None. A tree (p.parents) must have been
    asked for (tree_nodes > 0), be well formed, hold at most k + tree_nodes nodes and be at most k
    deep."""
    if p.seq_id not in asked:
        return "no such request in this step"
    r = asked[p.seq_id]
    n, k = len(p.token_ids), r.k
    if p.parents is not None:
        if r.tree_nodes <= 0:
            return "a tree of drafts where a chain was asked for"
        why = parents_problem(p.parents, n)
        if why is not None:
            return f"bad tree: {why}"
        if n > k + r.tree_nodes or max(tree_depths(p.parents), default=0) > k:
            return f"a tree of {n} nodes and depth {max(tree_depths(p.parents), default=0)}, asked for depth {k} " \
                   f"and {r.tree_nodes} branch nodes"
    elif n > k:
        return f"{n} drafts, asked for {k}"
    if vocab is not None:
        bad = [t for t in p.token_ids if not 0 <= t < vocab]
        if bad:
            return f"token ids {bad[:3]} outside the vocabulary [0, {vocab})"
    params = tracks[p.seq_id].add.params
    if p.probs is not None or not params.accepts_by_match:
        if n and (p.probs is None or len(p.probs) != n) and not params.coupled:
            return f"{0 if p.probs is None else len(p.probs)} q(x) values for {n} drafts"
        if p.probs is not None and not all(math.isfinite(q) and 0.0 < q <= 1.0 for q in p.probs):
            return "q(x) values not all finite numbers in (0, 1]"
    return None


def rows_problem(fetch: Sequence[RowRequest], rows: Sequence[QRow], vocab: int | None) -> str | None:
    """Why fetch_rows's rows cannot resolve the pending sequences, or None."""
    if sorted(r.seq_id for r in rows) != sorted(f.seq_id for f in fetch):
        return f"rows for {sorted(r.seq_id for r in rows)[:3]}, asked for {sorted(f.seq_id for f in fetch)[:3]}"
    for r in rows:
        row = r.row
        if row.dim() != 1 or (vocab is not None and row.shape[0] != vocab):
            return f"q row of shape {tuple(row.shape)} for {r.seq_id!r}"
        if not bool(torch.isfinite(row).all()) or bool((row < 0).any()) or not float(row.sum()) > 0.0:
            return f"q row for {r.seq_id!r} is not a distribution"
    return None


# How far a drafter's q(x) may be from its own q row's x entry (both fp32 from one distribution;
# the row is normalized here, so a row sent unnormalized is no mismatch).
Q_CLAIM_REL_TOL = 1e-3
Q_CLAIM_ABS_TOL = 1e-6
# The share of sampled sequence-steps whose drafts were all accepted that have one draft's q(x)
# audited against its q row (one extra row in the fetch_rows call the step makes anyway).
Q_AUDIT_RATE = 1 / 16


def claims_q(p: Proposal) -> bool:
    """Whether a proposal carries q(x) to check: a sampled chain (a q(x) below 1; a deterministic
    drafter's one-hot q is no claim), whose rejections need the drafter's q rows."""
    return p.probs is not None and any(q != 1.0 for q in p.probs)


def audit_positions(results: Sequence, proposals: dict[str, Proposal], draw, rate: float = Q_AUDIT_RATE) -> dict[str, int]:
    """seq_id -> the draft index whose q(x) to audit this step. results: the step's VerifyResults;
    draw(): a uniform in [0, 1) (the decoder's own generator: nothing kept depends on it).

    Only sampled chains (claims_q) that were not left pending (those are checked at their rejected draft anyway), each with
    probability `rate`. A drafter that claims too little q(x) has its drafts accepted more
    often than the target allows, is never rejected there, and is caught only this way."""
    out = {}
    for r in results:
        p = proposals.get(r.seq_id)
        if r.pending_position is not None or p is None or p.parents is not None or not p.token_ids or not claims_q(p):
            continue
        if draw() < rate:
            out[r.seq_id] = min(int(draw() * len(p.token_ids)), len(p.token_ids) - 1)
    return out


def claims_problem(checked: dict[str, int], rows: Sequence[QRow], proposals: dict[str, Proposal]) -> str | None:
    """Why a q(x) the drafter claimed disagrees with the q row it sent for that draft, or None.
    checked: seq_id -> the draft index whose row was fetched (a rejected draft, or an audit).

    The rejection test accepted or rejected with min(1, p(x) / q(x)) on the claimed q(x); claims
    that are not the drafter's distribution bias the output. A drafter that claims too much is
    caught at its first rejection (every rejected draft is checked); one that claims too little is
    rarely rejected and is caught by the audits (audit_positions), after some steps; drafters sit
    behind the internal token."""
    by_id = {r.seq_id: r.row for r in rows}
    for seq_id, j in checked.items():
        p, row = proposals.get(seq_id), by_id.get(seq_id)
        if p is None or row is None or p.probs is None or j >= len(p.probs):
            continue
        x, claimed = p.token_ids[j], float(p.probs[j])
        actual = float(row[x]) / float(row.sum())
        if not math.isclose(claimed, actual, rel_tol=Q_CLAIM_REL_TOL, abs_tol=Q_CLAIM_ABS_TOL):
            return f"q(x) {claimed:.6g} claimed for draft {j} of {seq_id!r}, its q row says {actual:.6g}"
    return None
