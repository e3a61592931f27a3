"""The speculative step over the Drafter and Verifier protocols.

    propose (drafter) -> verify (target, rejection sampler) -> [fetch_rows + resolve, sampling only]

    decoder.py         SpecDecoder: add / step / release; the step in five phases
    track.py           Track: one running sequence as the step keeps it
    predraft.py        PreDrafter: the pre-draft thread and the branches that came true
    drafter_health.py  DrafterHealth: up or down (failed, late), the off-thread probe, bounded re-sync
    peer_checks.py     what the step checks in a drafter's proposals and q rows
"""
from specsplit.spec.decoder import SpecDecoder, StepOutput
from specsplit.spec.track import IDLE_FEATURE_ROWS, MAX_FEATURE_ROWS, Track

__all__ = ["IDLE_FEATURE_ROWS", "MAX_FEATURE_ROWS", "SpecDecoder", "StepOutput", "Track"]
