"""Tokens/s of SmolLM2-135M colocated (fp32, CPU), greedy, with and without a JSON schema."""
"""Run: PYTHONPATH=. OMP_NUM_THREADS=1 python tools/structured_speed.py (docs/structured-output.md, Measured)."""
import json, time
import torch
from specsplit.config import EngineConfig, SpecConfig
from specsplit.factory import build_colocated
from specsplit.request import GenerationRequest
from specsplit.sampling.params import Grammar, SamplingParams
from specsplit.scheduler import Scheduler
torch.set_num_threads(1)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
          "required": ["name", "age", "city"]}
PROMPTS = ["Describe a person named Alice who is 30 and lives in Paris, as JSON.",
           "Give me a JSON record for Bob, 42 years old, from Berlin.",
           "Write JSON for Carol (age 25, city Rome)."]
E = dict(max_model_len=256, max_prefill_tokens=128, max_num_seqs=1)
for draft, k in ((None, 0), ("ngram", 4), ("smollm2-135m", 4)):
    colo = build_colocated(EngineConfig(model="smollm2-135m", **E), None if draft is None else EngineConfig(model=draft, **E),
                           SpecConfig(num_speculative_tokens=k, k_policy="fixed", disable_by_batch_size=0), show_progress=False)
    for name, params in (("free", SamplingParams()), ("json_schema", SamplingParams(grammar=Grammar("json_schema", json.dumps(SCHEMA))))):
        if params.grammar: colo.target.grammars.compile(params.grammar)
        toks = secs = prop = acc = 0
        for rep in range(2):
            for p in PROMPTS:
                ids = tuple(colo.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=False))
                t0 = time.perf_counter()
                (s,) = Scheduler(colo.decoder, colo.eos_token_ids, 1).run([GenerationRequest("r", ids, 48, params=params)])
                if rep: secs += time.perf_counter() - t0; toks += len(s.output); prop += s.proposed; acc += s.accepted
        print(f"draft={draft} {name}: {toks} tokens {secs:.2f}s {toks/secs:.1f} tok/s accepted {acc}/{prop}", flush=True)
    colo.close()
