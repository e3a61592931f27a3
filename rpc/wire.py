"""Proto <-> dataclass conversions shared by the servicers and the gRPC clients, and the one
table that turns engine exceptions into gRPC status codes.

Nothing here decides anything: it packs and unpacks. Float rows cross as little-endian float32
bytes, dense or sparse (indices + values) when most entries are zero.
"""
from __future__ import annotations

from typing import Sequence

import grpc
import numpy as np
import torch

from specsplit.v1 import common_pb2, drafter_pb2, verifier_pb2
from specsplit.engine import EngineError
from specsplit.protocols import (Proposal, ProposeRequest, QRow, RowRequest, SeqAdd, TokenLogprob, VerifyRequest,
                                 VerifyResult)
from specsplit.request import error_from_exception
from specsplit.sampling.params import Grammar, SamplingParams


# ---- errors -------------------------------------------------------------------------------
class ServiceError(Exception):
    """An error with the gRPC status code it should reach the client with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return self.message


def code_for_kind(kind: str) -> grpc.StatusCode:
    """A RequestError kind (a status name in lower case) -> its gRPC status; unknown -> INTERNAL."""
    try:
        return grpc.StatusCode[kind.upper()]
    except KeyError:
        return grpc.StatusCode.INTERNAL


def status_code_for(error: BaseException) -> grpc.StatusCode:
    """A ServiceError's own code; anything else as specsplit.request.error_from_exception
    classifies it (EngineError/ValueError -> INVALID_ARGUMENT, OutOfBlocks -> RESOURCE_EXHAUSTED,
    the rest INTERNAL): the one rule, shared with the gateway's scheduler."""
    if isinstance(error, ServiceError):
        return error.code
    return code_for_kind(error_from_exception(error).kind)


def status_message_for(error: BaseException) -> str:
    if isinstance(error, ServiceError):
        return error.message
    return error_from_exception(error).message


_CODES = {c.value[0]: c for c in grpc.StatusCode}


def code_from_int(value: int) -> grpc.StatusCode:
    return _CODES.get(value, grpc.StatusCode.UNKNOWN)


def status_pb(error: BaseException) -> common_pb2.Status:
    return common_pb2.Status(code=status_code_for(error).value[0], message=status_message_for(error))


# ---- sequences ------------------------------------------------------------------------------
def params_to_pb(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k)
    if p.seed is not None:
        msg.seed = p.seed
    if p.coupling is not None:
        msg.coupling = p.coupling
    msg.presence_penalty, msg.frequency_penalty = p.presence_penalty, p.frequency_penalty
    if p.repetition_penalty != 1.0:
        msg.repetition_penalty = p.repetition_penalty
    msg.logit_bias.extend(common_pb2.LogitBias(token_id=t, bias=b) for t, b in p.logit_bias)
    if p.grammar is not None:
        msg.grammar.CopyFrom(grammar_to_pb(p.grammar))
    msg.min_tokens = p.min_tokens
    msg.min_tokens_stop_ids.extend(p.min_tokens_stop_ids)
    msg.min_p = p.min_p
    return msg


def grammar_to_pb(g: Grammar) -> common_pb2.Grammar:
    if g.kind == "json_object":
        return common_pb2.Grammar(json_object=True)
    return common_pb2.Grammar(**{g.kind: g.text})


def grammar_from_pb(m: common_pb2.Grammar) -> Grammar | None:
    """The oneof's field -> Grammar; None when unset (or json_object false)."""
    kind = m.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not m.json_object):
        return None
    return Grammar(kind, "" if kind == "json_object" else getattr(m, kind))


def params_from_pb(m: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=float(m.temperature), top_p=float(m.top_p), top_k=int(m.top_k),
        seed=int(m.seed) if m.HasField("seed") else None,
        coupling=bool(m.coupling) if m.HasField("coupling") else None,
        presence_penalty=float(m.presence_penalty), frequency_penalty=float(m.frequency_penalty),
        repetition_penalty=float(m.repetition_penalty) if m.HasField("repetition_penalty") else 1.0,
        logit_bias=tuple((int(b.token_id), float(b.bias)) for b in m.logit_bias),
        grammar=grammar_from_pb(m.grammar) if m.HasField("grammar") else None,
        min_tokens=int(m.min_tokens), min_tokens_stop_ids=tuple(int(t) for t in m.min_tokens_stop_ids),
        min_p=float(m.min_p),
    )


def seq_adds_to_pb(seqs: Sequence[SeqAdd]) -> common_pb2.AddSeqs:
    return common_pb2.AddSeqs(seqs=[
        common_pb2.SeqAdd(seq_id=s.seq_id, prompt_token_ids=s.prompt_token_ids, params=params_to_pb(s.params),
                          logprobs=s.logprobs,  # None: the optional field stays unset
                          feature_layers=s.feature_layers, generated=s.generated,
                          prompt_logprobs=s.prompt_logprobs)
        for s in seqs
    ])


def seq_adds_from_pb(m: common_pb2.AddSeqs, rename=lambda s: s) -> list[SeqAdd]:
    return [SeqAdd(rename(s.seq_id), tuple(s.prompt_token_ids), params_from_pb(s.params),
                   int(s.logprobs) if s.HasField("logprobs") else None, tuple(s.feature_layers),
                   int(s.generated), int(s.prompt_logprobs) if s.HasField("prompt_logprobs") else None)
            for s in m.seqs]


# ---- target features (feature drafters) --------------------------------------------------------
def features_to_pb(rows: torch.Tensor | None, start: int) -> common_pb2.Features | None:
    """[rows, width] -> bf16 bytes (what the head was trained on; half the bytes of fp32)."""
    if rows is None:
        return None
    b = rows.detach().to(device="cpu", dtype=torch.bfloat16).contiguous()
    return common_pb2.Features(start=start, rows=b.shape[0], width=b.shape[1],
                               bf16=b.view(torch.int16).numpy().tobytes())


def features_from_pb(m, has: bool) -> tuple[torch.Tensor | None, int]:
    if not has:
        return None, 0
    if len(m.bf16) != 2 * m.rows * m.width:
        raise ValueError(f"features message holds {len(m.bf16)} bytes for {m.rows} x {m.width} bf16 values")
    flat = torch.frombuffer(bytearray(m.bf16), dtype=torch.int16) if m.bf16 else torch.empty(0, dtype=torch.int16)
    return flat.view(torch.bfloat16).reshape(int(m.rows), int(m.width)), int(m.start)


# ---- log-probabilities (also the public API's GenerateResponse.logprobs) ------------------------
def logprobs_to_pb(lps: Sequence[TokenLogprob]) -> list[common_pb2.TokenLogprob]:
    return [common_pb2.TokenLogprob(token_id=t.token_id, logprob=t.logprob,
                                    top=[common_pb2.TopLogprob(token_id=i, logprob=v) for i, v in t.top], rank=t.rank)
            for t in lps]


def logprobs_from_pb(msgs) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob(int(m.token_id), float(m.logprob), tuple((int(a.token_id), float(a.logprob)) for a in m.top),
                              int(m.rank))
                 for m in msgs)


# ---- probabilities ---------------------------------------------------------------------------
def _probs_to_pb(probs: tuple[float, ...] | None) -> tuple[list[float], bool]:
    """q(x) per draft -> (numbers, all_one flag). None (greedy) sends nothing."""
    if probs is None:
        return [], False
    if all(q == 1.0 for q in probs):
        return [], True
    return list(probs), False


def _probs_from_pb(values, all_one: bool, n: int) -> tuple[float, ...] | None:
    if len(values):
        return tuple(float(v) for v in values)
    if all_one:
        return (1.0,) * n
    return None


def pack_row(seq_id: str, row: torch.Tensor) -> common_pb2.PackedRow:
    arr = row.detach().to(device="cpu", dtype=torch.float32).numpy().reshape(-1)
    nz = np.flatnonzero(arr)
    if 2 * len(nz) < arr.size:  # sparse is smaller: 8 bytes per entry instead of 4 per element
        return common_pb2.PackedRow(
            seq_id=seq_id, size=arr.size, sparse=True,
            values=arr[nz].astype("<f4").tobytes(), indices=nz.astype("<i4").tobytes(),
        )
    return common_pb2.PackedRow(seq_id=seq_id, size=arr.size, values=arr.astype("<f4").tobytes())


MAX_ROW_SIZE = 1 << 22  # no vocabulary is larger (4,194,304 entries = 16 MiB of float32)


def unpack_row(m: common_pb2.PackedRow, expected_size: int | None = None) -> torch.Tensor:
    """PackedRow -> [size] float32. The peer's `size` is checked (against the vocabulary when the
    caller knows it, else MAX_ROW_SIZE) before anything is allocated for it."""
    limit = MAX_ROW_SIZE if expected_size is None else expected_size
    if expected_size is not None and m.size != expected_size:
        raise EngineError(f"sequence {m.seq_id!r}: q row of size {m.size}, expected the vocabulary size {expected_size}")
    if not 0 < m.size <= limit:
        raise EngineError(f"sequence {m.seq_id!r}: q row of size {m.size} (must be in [1, {limit}])")
    if len(m.values) % 4 or len(m.indices) % 4:
        raise EngineError(f"sequence {m.seq_id!r}: malformed q row (values and indices are 4-byte numbers)")
    values = np.frombuffer(m.values, dtype="<f4")
    if m.sparse:
        idx = np.frombuffer(m.indices, dtype="<i4")
        if len(idx) != len(values) or len(idx) > m.size or (len(idx) and (idx.min() < 0 or idx.max() >= m.size)):
            raise EngineError(f"sequence {m.seq_id!r}: malformed sparse q row")
        dense = np.zeros(m.size, dtype=np.float32)
        dense[idx] = values
        return torch.from_numpy(dense)
    if len(values) != m.size:
        raise EngineError(f"sequence {m.seq_id!r}: q row has {len(values)} values, expected {m.size}")
    return torch.from_numpy(values.astype(np.float32))


# ---- drafter ---------------------------------------------------------------------------------
def propose_to_pb(reqs: Sequence[ProposeRequest]) -> drafter_pb2.ProposeBatch:
    return drafter_pb2.ProposeBatch(items=[
        drafter_pb2.ProposeItem(seq_id=r.seq_id, new_token_ids=r.new_token_ids, k=r.k, pending_drafts=r.pending_drafts, pre_draft=r.pre_draft,
                                features=features_to_pb(r.features, r.features_start), tree_nodes=r.tree_nodes,
                                prefill_tokens=r.prefill_tokens)
        for r in reqs
    ])


def propose_from_pb(m: drafter_pb2.ProposeBatch, rename=lambda s: s) -> list[ProposeRequest]:
    out = []
    for i in m.items:
        feats, start = features_from_pb(i.features, i.HasField("features"))
        out.append(ProposeRequest(rename(i.seq_id), tuple(i.new_token_ids), int(i.k), tuple(i.pending_drafts), bool(i.pre_draft),
                                  features=feats, features_start=start, tree_nodes=int(i.tree_nodes),
                                  prefill_tokens=int(i.prefill_tokens)))
    return out


def proposals_to_pb(props: Sequence[Proposal], rename=lambda s: s) -> drafter_pb2.Proposals:
    out = []
    for p in props:
        values, one = _probs_to_pb(p.probs)
        out.append(drafter_pb2.Proposal(seq_id=rename(p.seq_id), token_ids=p.token_ids, probs=values, probs_one=one,
                                        parents=p.parents or ()))
    return drafter_pb2.Proposals(proposals=out)


def proposals_from_pb(m: drafter_pb2.Proposals) -> list[Proposal]:
    return [
        Proposal(p.seq_id, tuple(p.token_ids), _probs_from_pb(p.probs, p.probs_one, len(p.token_ids)),
                 tuple(p.parents) or None)
        for p in m.proposals
    ]


def fetch_rows_to_pb(fetch: Sequence[RowRequest]) -> drafter_pb2.FetchRows:
    return drafter_pb2.FetchRows(fetch=[drafter_pb2.RowRequest(seq_id=r.seq_id, position=r.position) for r in fetch])


def fetch_rows_from_pb(m: drafter_pb2.FetchRows, rename=lambda s: s) -> list[RowRequest]:
    return [RowRequest(rename(r.seq_id), int(r.position)) for r in m.fetch]


def rows_to_pb(rows: Sequence[QRow], rename=lambda s: s) -> list[common_pb2.PackedRow]:
    return [pack_row(rename(r.seq_id), r.row) for r in rows]


def rows_from_pb(rows, rename=lambda s: s, expected_size: int | None = None) -> list[QRow]:
    return [QRow(rename(r.seq_id), unpack_row(r, expected_size)) for r in rows]


# ---- verifier --------------------------------------------------------------------------------
def verify_to_pb(reqs: Sequence[VerifyRequest]) -> verifier_pb2.VerifyBatch:
    items = []
    for r in reqs:
        values, one = _probs_to_pb(r.draft_probs)
        items.append(verifier_pb2.VerifyItem(
            seq_id=r.seq_id, draft_token_ids=r.draft_token_ids, draft_probs=values, draft_probs_one=one,
            draft_parents=r.draft_parents or (),
            prefill_tokens=r.prefill_tokens,
        ))
    return verifier_pb2.VerifyBatch(items=items)


def verify_from_pb(m: verifier_pb2.VerifyBatch, rename=lambda s: s) -> list[VerifyRequest]:
    return [
        VerifyRequest(
            rename(i.seq_id), tuple(i.draft_token_ids),
            _probs_from_pb(i.draft_probs, i.draft_probs_one, len(i.draft_token_ids)),
            tuple(i.draft_parents) or None, prefill_tokens=int(i.prefill_tokens),
        )
        for i in m.items
    ]


def results_to_pb(results: Sequence[VerifyResult], rename=lambda s: s) -> verifier_pb2.VerifyResults:
    out = []
    for r in results:
        msg = verifier_pb2.VerifyResult(seq_id=rename(r.seq_id), num_accepted=r.num_accepted, token_ids=r.token_ids)
        if r.pending_position is not None:
            msg.pending_position = r.pending_position
        if r.logprobs:
            msg.logprobs.extend(logprobs_to_pb(r.logprobs))
        if r.features is not None:
            msg.features.CopyFrom(features_to_pb(r.features, r.features_start))
        if r.prompt_logprobs is not None:
            msg.prompt_logprobs.CopyFrom(common_pb2.PromptLogprobs(tokens=logprobs_to_pb(r.prompt_logprobs)))
        out.append(msg)
    return verifier_pb2.VerifyResults(results=out)


def results_from_pb(m: verifier_pb2.VerifyResults) -> list[VerifyResult]:
    out = []
    for r in m.results:
        feats, start = features_from_pb(r.features, r.HasField("features"))
        out.append(VerifyResult(
            r.seq_id, int(r.num_accepted), tuple(r.token_ids),
            int(r.pending_position) if r.HasField("pending_position") else None,
            logprobs_from_pb(r.logprobs) if len(r.logprobs) else None,
            features=feats, features_start=start,
            prompt_logprobs=logprobs_from_pb(r.prompt_logprobs.tokens) if r.HasField("prompt_logprobs") else None,
        ))
    return out
