from specsplit.sampling.ngram import ngram_propose, ngram_q_rows
from specsplit.sampling.params import SamplingParams
from specsplit.sampling.probs import logits_to_probs, sampling_tensors
from specsplit.sampling.rejection import RejectionSampler
from specsplit.sampling.rng import SeqRandom, draw_step_uniforms
from specsplit.sampling.sample import sample_from_probs

__all__ = [
    "RejectionSampler",
    "SamplingParams",
    "SeqRandom",
    "draw_step_uniforms",
    "logits_to_probs",
    "ngram_propose",
    "ngram_q_rows",
    "sample_from_probs",
    "sampling_tensors",
]
