"""Issue #25's two structured-output goals, measured through real servers and the official openai client.

  (a) schema-valid JSON for 20 held-out schemas (none of them used by the tests) with speculation on,
      and the same tokens as target-only with the same schema (greedy): every answer is parsed and
      validated (jsonschema), and its text and its tokens (the chat logprobs' token strings and
      bytes) are compared with a target-only server's;
  (b) speculation with a grammar keeps >= 0.9x of its speed without one on the same prompts: decode
      tokens/s of each streamed answer, (tokens - 1) / (last chunk - first chunk) (the prefill is
      left out: the JSON answers are shorter, so it would weigh more in them), with and without
      response_format, the arms interleaved request by request, medians over the prompts and rounds.

Run (two servers on loopback, 1 torch thread each, started and stopped here):
  PYTHONPATH=. OMP_NUM_THREADS=1 python tools/structured_goals.py [--rounds 3] [--draft DRAFT] [--max-tokens 96]
  [--validity-only]  (goal (a) alone, e.g. with a larger --max-tokens)
The speculative server's draft is the target's default (smollm2-135m: smollm2-135m-eagle3+ngram).
Draft acceptance per arm comes from the speculative server's /metrics, read around each request.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import openai

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.services.procs import HOST, ServiceProcess, free_port  # noqa: E402

MODEL = "smollm2-135m"
S, I, N, B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def obj(required=None, **props) -> dict:
    return {"type": "object", "properties": props, "required": list(required if required is not None else props)}


# 20 held-out (schema, prompt) pairs: none appears in the tests or the earlier measurements.
HELD_OUT = [
    (obj(title=S, author=S, year=I), "Give the title, author and year of a famous novel as JSON."),
    (obj(city=S, country=S, population=I), "Describe the city of Tokyo as JSON."),
    (obj(name=S, price=N, in_stock=B), "A product listing for a coffee mug, as JSON."),
    (obj(ingredients={"type": "array", "items": S, "maxItems": 5}, minutes=I), "A short pancake recipe as JSON."),
    (obj(temperature=N, unit={"enum": ["C", "F"]}, sky=S), "Today's weather report as JSON."),
    (obj(language=S, paradigm={"enum": ["functional", "object-oriented", "procedural"]}, typed=B),
     "Describe the Python programming language as JSON."),
    (obj(from_={"type": "string"}, to=S, departure=S), "A train ticket from Paris to Lyon as JSON."),
    (obj(question=S, answer=S), "Write one trivia question and its answer as JSON."),
    (obj(animal=S, legs=I, can_fly=B), "Describe a penguin as JSON."),
    (obj(planet=S, moons=I, gas_giant=B), "Describe the planet Mars as JSON."),
    (obj(sender=S, subject=S, urgent=B), "An email notification about a meeting, as JSON."),
    (obj(team=S, wins=I, losses=I), "A football team's season record as JSON."),
    (obj(word=S, part_of_speech={"enum": ["noun", "verb", "adjective", "adverb"]}, definition=S),
     "Define the word 'happy' as JSON."),
    (obj(tasks={"type": "array", "items": obj(task=S, done=B), "maxItems": 3}), "A to-do list with three tasks, as JSON."),
    (obj(movie=S, rating={"type": "integer", "minimum": 1, "maximum": 5}, review=S), "Review a movie you like, as JSON."),
    (obj(required=["name", "email"], name=S, email=S, phone=S), "A contact card for Jane Doe, as JSON."),
    (obj(currency=S, symbol=S, code={"type": "string", "pattern": "^[A-Z]{3}$"}), "Describe the euro currency as JSON."),
    (obj(x=N, y=N, label=S), "A point on a map labeled 'home', as JSON."),
    (obj(song=S, artist=S, duration_seconds=I), "Describe a popular song as JSON."),
    (obj(mood={"enum": ["happy", "sad", "neutral"]}, reason=S), "How do you feel today? Answer as JSON."),
]
# "from" is a keyword in Python's kwargs only: the schema's property is "from"
HELD_OUT[6] = (obj(**{"from": S, "to": S, "departure": S}), HELD_OUT[6][1])
MAX_TOKENS = 96  # --max-tokens
FREQUENCY_PENALTY = 0.0  # --frequency-penalty (the same for every arm)


def drafts(port: int) -> tuple[float, float]:
    """The server's (proposed, accepted) draft tokens so far (its /metrics)."""
    from specsplit.rpc.metrics import read_metrics

    out = read_metrics(port, HOST, timeout=30)
    return out.get("specsplit_draft_tokens_proposed_total", 0.0), out.get("specsplit_draft_tokens_accepted_total", 0.0)


def serve(root: Path, draft: str | None, name: str) -> ServiceProcess:
    port, http_port = free_port(), free_port()
    argv = ["serve", "--target", MODEL, "--port", str(port), "--http-port", str(http_port), "--max-model-len", "1024",
            "--max-num-seqs", "1", "--threads", "1", "--grammar-timeout", "30"]
    if draft is not None:
        argv += ["--draft", draft]
    proc = ServiceProcess(name, argv, root, port)
    proc.http_port = http_port
    return proc


def ask(client, prompt: str, schema: dict | None) -> dict:
    """One streamed greedy answer: its text, token strings, bytes and decode speed."""
    kw = {"frequency_penalty": FREQUENCY_PENALTY} if FREQUENCY_PENALTY else {}
    if schema is not None:
        kw["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    stamps, text, tokens, nbytes, usage, finish = [], [], [], [], None, None
    head = 0  # tokens in the first chunk that has any: they come with the prefill, not timed
    for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                temperature=0, max_tokens=MAX_TOKENS, stream=True, logprobs=True,
                                                stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            finish = c.finish_reason or finish
            if c.logprobs and c.logprobs.content:
                stamps.append(time.perf_counter())
                if len(stamps) == 1:
                    head = len(c.logprobs.content)
                tokens += [t.token for t in c.logprobs.content]
                nbytes += [tuple(t.bytes or ()) for t in c.logprobs.content]
            text.append(c.delta.content or "")
    span = stamps[-1] - stamps[0] if len(stamps) > 1 else 0.0
    return {"text": "".join(text), "tokens": tokens, "bytes": nbytes, "n": usage.completion_tokens, "finish": finish,
            "decode_tps": (len(tokens) - head) / span if span > 0 else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--draft", default=None, help="the speculative server's --draft (default: the target's default)")
    ap.add_argument("--limit", type=int, default=len(HELD_OUT))
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--validity-only", action="store_true",
                    help="goal (a) alone: only the requests with response_format (no speed figures)")
    ap.add_argument("--frequency-penalty", type=float, default=0.0,
                    help="sent with every request of every arm (lossless with speculation: the penalized target)")
    args = ap.parse_args()
    global MAX_TOKENS, FREQUENCY_PENALTY
    MAX_TOKENS, FREQUENCY_PENALTY = args.max_tokens, args.frequency_penalty
    root = Path("/tmp") / f"structured_goals_{int(time.time())}"
    root.mkdir(parents=True)
    spec, target = serve(root, args.draft, "spec"), serve(root, "none", "target")
    try:
        spec.serving(600)
        target.serving(600)
        cpu = subprocess.run(["grep", "-m1", "model name", "/proc/cpuinfo"], capture_output=True, text=True).stdout.strip()
        print(f"cpu: {cpu}; load: {open('/proc/loadavg').read().split()[:3]}", flush=True)
        clients = {name: openai.OpenAI(base_url=f"http://{HOST}:{p.http_port}/v1", api_key="x", max_retries=0, timeout=600)
                   for name, p in (("spec", spec), ("target", target))}
        cases = HELD_OUT[: args.limit]
        for schema, _ in cases:
            jsonschema.Draft202012Validator.check_schema(schema)
        results: dict[tuple, list[dict]] = {}
        for rnd in range(args.rounds):
            for i, (schema, prompt) in enumerate(cases):
                # interleaved: both arms of both servers back to back, the order turned each round
                arms = [("spec", True), ("spec", False), ("target", True), ("target", False)]
                if args.validity_only:
                    arms = [a for a in arms if a[1]]
                if rnd % 2:
                    arms.reverse()
                for server, constrained in arms:
                    before = drafts(spec.http_port) if server == "spec" else (0.0, 0.0)
                    r = ask(clients[server], prompt, schema if constrained else None)
                    after = drafts(spec.http_port) if server == "spec" else (0.0, 0.0)
                    r["proposed"], r["accepted"] = after[0] - before[0], after[1] - before[1]
                    results.setdefault((server, constrained, i), []).append(r)
            print(f"round {rnd + 1}/{args.rounds} done; load {open('/proc/loadavg').read().split()[:3]}", flush=True)
        # (a) validity and equality
        valid = same = 0
        for i, (schema, prompt) in enumerate(cases):
            s, t = results[("spec", True, i)][0], results[("target", True, i)][0]
            try:
                jsonschema.validate(json.loads(s["text"]), schema)
                valid += 1
            except (ValueError, jsonschema.ValidationError) as e:
                print(f"  schema {i}: INVALID ({s['finish']}): {e!s:.120} text={s['text'][:120]!r}")
            if s["tokens"] == t["tokens"] and s["bytes"] == t["bytes"] and s["text"] == t["text"]:
                same += 1
            else:
                print(f"  schema {i}: differs from target-only: {s['text'][:100]!r} vs {t['text'][:100]!r}")
        print(f"max_tokens {MAX_TOKENS}, frequency_penalty {FREQUENCY_PENALTY}, {args.rounds} rounds, "
              f"draft {args.draft or 'the default'}")
        print(f"(a) {valid}/{len(cases)} schema-valid with speculation on; {same}/{len(cases)} token-identical to target-only")
        # (b) speed
        for server in () if args.validity_only else ("spec", "target"):
            g = [r["decode_tps"] for i in range(len(cases)) for r in results[(server, True, i)]]
            f = [r["decode_tps"] for i in range(len(cases)) for r in results[(server, False, i)]]
            ratios = [statistics.median([r["decode_tps"] for r in results[(server, True, i)]])
                      / statistics.median([r["decode_tps"] for r in results[(server, False, i)]]) for i in range(len(cases))]
            gt = sum(r["n"] for i in range(len(cases)) for r in results[(server, True, i)])
            ft = sum(r["n"] for i in range(len(cases)) for r in results[(server, False, i)])
            acc = {c: (sum(r["accepted"] for i in range(len(cases)) for r in results[(server, c, i)]),
                       sum(r["proposed"] for i in range(len(cases)) for r in results[(server, c, i)])) for c in (True, False)}
            print(f"(b) {server}: decode tok/s median with grammar {statistics.median(g):.1f} ({gt} tokens, drafts "
                  f"accepted {acc[True][0]:.0f}/{acc[True][1]:.0f}), without {statistics.median(f):.1f} ({ft} tokens, "
                  f"{acc[False][0]:.0f}/{acc[False][1]:.0f}): ratio of medians {statistics.median(g) / statistics.median(f):.2f}, "
                  f"median per-prompt ratio {statistics.median(ratios):.2f}")
        print(f"load at the end: {open('/proc/loadavg').read().split()[:3]}")
    finally:
        spec.stop()
        target.stop()


if __name__ == "__main__":
    main()
