"""Old names for the one Request and the one Scheduler (kept so callers written against them run).

    GenerationRequest -> specsplit.request.GenerationRequest (unchanged)
    RequestState      -> specsplit.request.Request
    Generator         -> specsplit.scheduler.Scheduler (same arguments: decoder, eos_token_ids, max_num_seqs)
"""
from __future__ import annotations

from specsplit.request import GenerationRequest, Request, RequestState
from specsplit.scheduler import Scheduler

Generator = Scheduler

__all__ = ["GenerationRequest", "Generator", "Request", "RequestState", "Scheduler"]
