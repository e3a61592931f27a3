"""A split stack (three processes, as `specsplit up`) of SmolLM2-135M with the EAGLE-3 head + prompt
lookup, greedy, with a JSON schema: drafts accepted and tokens/s per round, and the drafter
service's start-up time alone. docs/structured-output.md ("The drafter"):

    PYTHONPATH=. python tools/structured_split_speed.py [rounds] [draft]

The processes come from tests/services/procs.py of the checkout on PYTHONPATH (their PYTHONPATH is
that checkout), so `PYTHONPATH=/path/to/other/checkout python tools/structured_split_speed.py` runs
another version's services with the same requests."""
import json
import tempfile
import time
from pathlib import Path

from specsplit.models.loader import hf_dir_for, load_tokenizer
from specsplit.v1 import common_pb2
from tests.services import procs

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
          "required": ["name", "age", "city"]}
PROMPTS = ["Describe a person named Alice who is 30 and lives in Paris, as JSON.",
           "Give me a JSON record for Bob, 42 years old, from Berlin.",
           "Write JSON for Carol (age 25, city Rome)."]
TARGET, DRAFT = "smollm2-135m", "smollm2-135m-eagle3+ngram"
K = ("--num-speculative-tokens", "3")


def drafter_startup(root: Path, draft: str) -> float:
    """Seconds from launching `specsplit drafter --model draft` alone to SERVING."""
    port = procs.free_port()
    t0 = time.perf_counter()
    p = procs.ServiceProcess("drafter-alone", ["drafter", "--model", draft, "--port", str(port), "--max-num-seqs", "1",
                                               *procs.TINY_ENGINE, *K], root, port)
    p.serving(300)
    seconds = time.perf_counter() - t0
    p.stop()
    return seconds


def main(rounds: int = 3, draft: str = DRAFT) -> None:
    root = Path(tempfile.mkdtemp(prefix="structured-split-"))
    print(f"services from {procs.REPO}; logs in {root}", flush=True)
    print(f"{draft}: drafter start-up alone {drafter_startup(root, draft):.2f} s, {drafter_startup(root, draft):.2f} s",
          flush=True)
    tok = load_tokenizer(hf_dir_for(TARGET, show_progress=False))
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                   return_dict=False) for p in PROMPTS]
    stack = procs.start_split(root, TARGET, draft, max_num_seqs=1, gateway_extra=K, service_extra=K).ready()
    try:
        grammar = common_pb2.Grammar(json_schema=json.dumps(SCHEMA))
        for rnd in range(rounds + 1):  # round 0: the first grammar (compiles), not counted
            tokens = proposed = accepted = 0
            t0 = time.perf_counter()
            for p in ids:
                out = procs.generate(stack.gateway, procs.request(list(p), max_tokens=48, grammar=grammar), timeout=300)
                tokens += len(out["token_ids"])
                proposed += out["usage"]["proposed_draft_tokens"]
                accepted += out["usage"]["accepted_draft_tokens"]
            secs = time.perf_counter() - t0
            print(f"round {rnd}: {tokens} tokens {secs:.2f} s {tokens / secs:.1f} tok/s, drafts accepted {accepted}/{proposed}"
                  + (f"   e.g. {out['text']!r}" if rnd == 0 else ""), flush=True)
    finally:
        stack.stop()
    late = (root / "gateway.log").read_text(errors="replace").count("drafter late")
    print(f"gateway: {late} 'drafter late' warnings", flush=True)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rounds", nargs="?", type=int, default=3, help="timed rounds after the first (default 3)")
    ap.add_argument("draft", nargs="?", default=DRAFT, help=f"the drafter service's --model (default {DRAFT})")
    args = ap.parse_args()
    main(args.rounds, args.draft)
