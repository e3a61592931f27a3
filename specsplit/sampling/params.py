"""Per-request sampling parameters."""
from __future__ import annotations

import math
from dataclasses import dataclass

MIN_TEMPERATURE = 1e-2  # below it: 0 (greedy) or an error; see SamplingParams.validate
MAX_TEMPERATURE = 1e4  # above it the distribution is uniform to float32 precision
# Penalties and biases (specsplit.sampling.penalties), OpenAI's ranges where it has one.
MAX_PENALTY = 2.0  # presence_penalty, frequency_penalty in [-2, 2]
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 10.0  # 1 = off
MAX_LOGIT_BIAS = 100.0  # each bias in [-100, 100]
MAX_LOGIT_BIAS_ENTRIES = 300  # token ids in one logit_bias (OpenAI's limit)
# min_tokens: the ids it holds back (the model's EOS ids and a request's stop_token_ids, <= 64).
MAX_MIN_TOKENS_STOP_IDS = 128
# The fields an engine of this version applies that older engines ignored on the wire (proto3
# drops unknown fields silently): a verifier lists them in ServiceInfo.sampling_features, and a
# gateway refuses a request that uses one its verifier does not list (SamplingParams.features).
# "logprob_ranks": the verifier fills in TokenLogprob.rank (vLLM's prompt_logprobs need it; the
# HTTP API checks it, since it is no SamplingParams field).
SAMPLING_FEATURES = ("min_tokens", "min_p", "logprob_ranks")
# Structured output (specsplit.sampling.grammar): the grammar text a request may send.
GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "ebnf")
MAX_GRAMMAR_CHARS = 64 * 1024


@dataclass(frozen=True)
class Grammar:
    """A request's output grammar: `kind` one of GRAMMAR_KINDS; `text` the JSON schema (json_schema),
    the regular expression (regex), the EBNF grammar with a `root` rule (ebnf, xgrammar's GBNF
    dialect), or "" (json_object: any JSON object). Compiled by specsplit.sampling.grammar."""

    kind: str
    text: str = ""

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.text)

    def validate(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}")
        if len(self.text) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"the {self.kind} grammar is {len(self.text)} characters; at most "
                             f"{MAX_GRAMMAR_CHARS} are allowed (simplify the schema)")
        if self.kind == "json_object" and self.text:
            raise ValueError("a json_object grammar takes no text (send a json_schema to constrain the object)")
        if self.kind in ("json_schema", "regex", "ebnf") and not self.text.strip():
            raise ValueError(f"the {self.kind} grammar is empty")


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns logits into tokens.

    temperature == 0 means greedy (argmax); top_k <= 0 and top_p == 1 switch those filters off.
    The same transform is applied to the target's p and the draft's q, so rejection sampling
    reproduces the distribution the target alone would sample from.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    # How a seeded sampled request speculates. None (the default): coupled -- the drafter and the
    # target share per-position Gumbel noise (specsplit.sampling.coupled), so the tokens are the
    # target-only tokens of that seed whatever the speculation does. False: rejection sampling
    # (highest acceptance; reproducible only under the same speculation schedule). Unseeded
    # requests always use rejection sampling.
    coupling: bool | None = None
    # Applied to the target's logits at every verified position, from the tokens before it
    # (specsplit.sampling.penalties): OpenAI's presence / frequency penalties over the generated
    # tokens, the repetition penalty (as transformers: logit / r if > 0 else logit * r) over prompt
    # and generated tokens, then logit_bias ((token_id, bias), ...) added; 0 / 1 / () = off.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's min_tokens: while fewer than min_tokens tokens are generated, the ids that would end
    # the output (min_tokens_stop_ids: the model's EOS ids unless ignore_eos, and the request's
    # stop_token_ids; the scheduler fills them in at submit) get logit -inf at that position, on
    # the target's rows as on the drafter's (specsplit.sampling.penalties). 0 = off.
    min_tokens: int = 0
    min_tokens_stop_ids: tuple[int, ...] = ()
    # Structured output: tokens the grammar does not allow next get probability 0 (None: free text).
    grammar: Grammar | None = None
    # min-p (vLLM's and transformers'): keep the tokens with probability >= min_p times the largest,
    # after top-k / top-p (specsplit.sampling.probs), on p and q alike; 0 = off. Last, so that the
    # fields callers pass by position keep their places.
    min_p: float = 0.0

    @property
    def penalized(self) -> bool:
        """Any penalty or bias: the target's logits are changed before sampling."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    @property
    def features(self) -> tuple[str, ...]:
        """The SAMPLING_FEATURES this request uses (min_p only when it samples: greedy ignores it)."""
        return tuple(f for f, on in (("min_tokens", self.min_tokens > 0),
                                     ("min_p", self.min_p > 0.0 and not self.greedy)) if on)

    def holds_stops_at(self, generated: int) -> bool:
        """min_tokens bans the stop ids at the position after `generated` generated tokens."""
        return generated < self.min_tokens and bool(self.min_tokens_stop_ids)

    def penalized_at(self, generated: int) -> bool:
        """specsplit.sampling.penalties changes the logits at the position after `generated`
        generated tokens (and at the rows after it, in one verify)."""
        return self.penalized or self.holds_stops_at(generated)

    def processed_at(self, generated: int) -> bool:
        """The logits at the position after `generated` generated tokens go through
        specsplit.sampling.penalties / .grammar before sampling."""
        return self.penalized_at(generated) or self.grammar is not None

    @property
    def processed(self) -> bool:
        """The logits may go through specsplit.sampling.penalties / .grammar at some position."""
        return self.processed_at(0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def coupled(self) -> bool:
        """Sampled with shared noise: the verifier needs no q(x) and no q rows."""
        return self.temperature != 0.0 and self.seed is not None and self.coupling is not False

    @property
    def accepts_by_match(self) -> bool:
        """Greedy or coupled: the verifier accepts a draft when it equals the target's own token at
        that position (no q(x), no q rows cross); otherwise the rejection sampler runs on q."""
        return self.greedy or self.coupled

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError with a message a client can act on. The one place these rules live:
        the gateway, `specsplit generate` and the engines (for what peers send) all call it.

        temperature: 0 (greedy) or in [MIN_TEMPERATURE, MAX_TEMPERATURE]. Sampling divides the
        logits by it in float32; below 1e-2 a logit of a few hundred becomes an overflow (1e-40
        turned every logit into inf, the probabilities into NaN and the output into token 0), and
        it is already greedy in effect: a runner-up 0.2 logits behind has probability < e**-20.
        NaN and inf are refused in every float.
        """
        t, p = self.temperature, self.top_p
        if not math.isfinite(t) or t < 0.0 or 0.0 < t < MIN_TEMPERATURE or t > MAX_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], got {t:g}")
        if not math.isfinite(p) or not (0.0 < p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {p:g}")
        if not math.isfinite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p:g}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if vocab_size is not None and self.top_k > vocab_size:
            raise ValueError(f"top_k must be <= the vocabulary size {vocab_size} (0 = off), got {self.top_k}")
        if self.seed is not None and not (0 <= self.seed < 2**64):
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not math.isfinite(v) or abs(v) > MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 = off), got {v:g}")
        r = self.repetition_penalty
        if not math.isfinite(r) or not MIN_REPETITION_PENALTY <= r <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
                             f"{MAX_REPETITION_PENALTY:g}] (1 = off), got {r:g}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} "
                             f"token ids are allowed")
        seen = set()
        for token, bias in self.logit_bias:
            if token < 0 or (vocab_size is not None and token >= vocab_size):
                raise ValueError(f"logit_bias token id {token} is outside the vocabulary "
                                 f"[0, {vocab_size if vocab_size is not None else 'vocab_size'})")
            if token in seen:
                raise ValueError(f"logit_bias names token id {token} twice")
            seen.add(token)
            if not math.isfinite(bias) or abs(bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias of token {token} must be in [-{MAX_LOGIT_BIAS:g}, "
                                 f"{MAX_LOGIT_BIAS:g}], got {bias:g}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0 (0 = off), got {self.min_tokens}")
        if len(self.min_tokens_stop_ids) > MAX_MIN_TOKENS_STOP_IDS:
            raise ValueError(f"min_tokens holds back at most {MAX_MIN_TOKENS_STOP_IDS} stop ids, "
                             f"got {len(self.min_tokens_stop_ids)}")
        out = [t for t in self.min_tokens_stop_ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
        if out:
            raise ValueError(f"min_tokens stop ids {out[:5]} are outside the vocabulary "
                             f"[0, {vocab_size if vocab_size is not None else 'vocab_size'})")
        if self.grammar is not None:
            self.grammar.validate()
