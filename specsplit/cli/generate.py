"""`specsplit generate`: one generation, in-process (target-only or colocated speculative), or
streamed from a running gateway with --server. Prints one JSON object with --json. --n N: N
independent samples either way (choice i of a seeded request draws with seed + i), printed as
gateway/generate_client.py prints the server's choices."""
from __future__ import annotations

import dataclasses
import json
import re
import sys
import time

from specsplit.gateway.generate_client import grammar_from_args, parse_ids
from specsplit.cli.common import (add_deterministic_flag, add_engine_flags, add_spec_flags, engine_config, nonneg_int,
                                  positive_int, spec_config, validate_engine)


def add_arguments(p, name: str) -> None:
    p.add_argument("prompt", nargs="?", default=None, help="prompt text (tokenized like Hugging Face does by default)")
    p.add_argument("--prompt-token-ids", default=None, help="comma-separated prompt ids instead of text, e.g. 1,2,3")
    p.add_argument("--target", default="smollm2-135m", help="alias, Hugging Face directory or .gguf file")
    p.add_argument("--draft", default=None, help="draft model (alias/dir/.gguf), 'ngram', MODEL+ngram, or 'none' "
                   "(target-only); omitted: the target's best shipped draft (smollm2-135m: smollm2-135m-eagle3+ngram)")
    p.add_argument("--draft-device", default=None, help="device of the draft model (default: --device)")
    p.add_argument("--server", default=None, metavar="HOST:PORT", help="stream from a running gateway instead")
    p.add_argument("--max-tokens", type=positive_int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=nonneg_int, default=0, help="0 = off")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="keep tokens with probability >= MIN_P x the largest, after top-k / top-p (0 = off)")
    p.add_argument("--seed", type=nonneg_int, default=None)
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="a stop string: the output text ends before it (repeat for several, at most 16)")
    p.add_argument("--include-stop-str-in-output", action="store_true",
                   help="the text keeps the stop string it ends at (by default it ends just before it)")
    p.add_argument("--stop-token-ids", default=None, metavar="IDS",
                   help="comma-separated token ids that end the output, as EOS does (in its tokens; in its text "
                        "only with --include-stop-str-in-output)")
    p.add_argument("--min-tokens", type=nonneg_int, default=0, metavar="N",
                   help="no EOS, stop token or stop string ends the output before N tokens (0 = off)")
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template to the prompt")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.add_argument("--logprobs", type=nonneg_int, default=None, metavar="N",
                   help="with --json: each token's log-probability under the target and the N (0..20) most "
                        "likely alternatives at its position")
    p.add_argument("--n", type=int, default=1, metavar="N",
                   help="N independent samples of the prompt (1..16; a seeded request's choice i draws with "
                        "seed + i); each printed under its index, with --json a list of objects")
    p.add_argument("--timeout", type=float, default=None, help="--server: deadline in seconds")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2] (0 = off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2] (0 = off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="transformers' rule, in [0.01, 10] (1 = off)")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json-schema", default=None, metavar="SCHEMA",
                     help="structured output: the output is JSON matching this schema (JSON text, or @FILE)")
    fmt.add_argument("--json-object", action="store_true", help="structured output: the output is one JSON object")
    fmt.add_argument("--regex", default=None, help="structured output: the output matches this regular expression")
    fmt.add_argument("--ebnf", default=None, metavar="GRAMMAR",
                     help="structured output: an EBNF grammar with a root rule (text, or @FILE)")
    add_engine_flags(p)
    add_deterministic_flag(p)
    add_spec_flags(p)
    from specsplit.rpc.security import add_client_security_flags

    add_client_security_flags(p, "", "the --server gateway")


def validate(args) -> None:
    from specsplit.rpc.security import ClientSecurity
    from specsplit.defaults import resolve_draft

    args.draft = resolve_draft(args.target, args.draft, getattr(args, "tensor_parallel_size", 1))
    validate_engine(args)
    ClientSecurity.from_args(args).validate()
    if args.prompt is None and args.prompt_token_ids is None:
        raise ValueError("give a PROMPT or --prompt-token-ids")
    from specsplit.request import MAX_CHOICES

    if not 1 <= args.n <= MAX_CHOICES:
        raise ValueError(f"--n must be in [1, {MAX_CHOICES}], got {args.n}")
    if args.logprobs is not None and not args.json:
        raise ValueError("--logprobs are printed in the JSON output: add --json")
    if args.prompt_token_ids is not None:
        ids = parse_ids(args.prompt_token_ids)
        if not ids:
            raise ValueError("--prompt-token-ids is empty")
        if any(t < 0 for t in ids):
            raise ValueError(f"--prompt-token-ids has negative ids: {[t for t in ids if t < 0][:5]}")
    from specsplit.request import RequestError, validate as validate_request

    try:  # the request's own rules (specsplit.request.validate), before the model loads
        validate_request(_request(args, tuple(ids) if args.prompt_token_ids is not None else (0,)), None)
    except OSError as e:
        raise ValueError(f"cannot read the grammar file: {e}") from None
    except (ValueError, RequestError) as e:  # "stop_token_ids takes ..." -> "--stop-token-ids takes ..."
        raise ValueError(re.sub(r"^\w+", lambda m: "--" + m.group(0).replace("_", "-") if hasattr(args, m.group(0))
                                else m.group(0), str(e))) from None
    if args.server is None and args.prompt_token_ids is not None:
        n = len(parse_ids(args.prompt_token_ids))
        if n + args.max_tokens > args.max_model_len:
            raise ValueError(
                f"prompt ({n} tokens) + --max-tokens {args.max_tokens} exceeds --max-model-len {args.max_model_len}"
            )


def params_from_args(args):
    from specsplit.sampling.params import SamplingParams

    return SamplingParams(args.temperature, args.top_p, args.top_k, args.seed,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          repetition_penalty=args.repetition_penalty, grammar=grammar_from_args(args),
                          min_tokens=args.min_tokens, min_p=args.min_p)


def _request(args, ids: tuple[int, ...], i: int = 0):
    """Choice i of the request the flags ask for, on prompt ids `ids`."""
    from specsplit.request import GenerationRequest, choice_seed

    params = params_from_args(args)
    return GenerationRequest("cli" if args.n == 1 else f"cli-{i}", ids, args.max_tokens,
                             dataclasses.replace(params, seed=choice_seed(params.seed, i)), args.ignore_eos,
                             stop=tuple(args.stop or ()), include_stop_str_in_output=args.include_stop_str_in_output,
                             stop_token_ids=tuple(parse_ids(args.stop_token_ids or "", "--stop-token-ids")),
                             logprobs=args.logprobs)


def _prompt_ids(args, tokenizer) -> list[int]:
    if args.prompt_token_ids is not None:
        return parse_ids(args.prompt_token_ids)
    if args.chat:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=True, return_dict=False))
    return list(tokenizer(args.prompt).input_ids)


def run(args) -> int:
    if args.server:
        from specsplit.gateway.generate_client import generate_over_grpc

        return generate_over_grpc(args)
    return run_local(args)


def run_local(args) -> int:
    from specsplit.factory import build_colocated, set_threads
    from specsplit.gateway.generate_client import choice_text, logprobs_json
    from specsplit.scheduler import Scheduler
    set_threads(args.threads)
    # --n requests at once: size the profile run and the cache for them, not --max-num-seqs.
    n = args.max_num_seqs = args.n
    target = engine_config(args, args.target)
    draft = engine_config(args, args.draft, args.draft_device) if args.draft else None
    spec = spec_config(args, args.draft)
    t0 = time.perf_counter()
    colo = build_colocated(target, draft, spec, show_progress=not args.json)
    load_s = time.perf_counter() - t0
    ids = tuple(_prompt_ids(args, colo.tokenizer))
    requests = [_request(args, ids, i) for i in range(n)]
    # The same Scheduler as the gateway's: it validates the requests (vocabulary, max_model_len,
    # the KV cache, stop rules) and runs them, and its text is the gateway's (stop strings cut, the
    # token that ends the output left out: request.Request.take).
    gen = Scheduler(colo.decoder, colo.eos_token_ids, max_num_seqs=n, decode=colo.tokenizer.decode)

    def stream(state, kept):
        if not args.json and n == 1:
            sys.stdout.write(state.text.take())
            sys.stdout.flush()

    t1 = time.perf_counter()
    states = gen.run(requests, on_tokens=stream)
    gen_s = time.perf_counter() - t1
    results = []
    for state in states:
        result = {
            "token_ids": state.output,
            "text": state.text.text,
            "finish_reason": state.finish_reason,
            "usage": state.usage(),  # the same dict the gateway streams as Usage
        }
        if state.logprobs is not None:
            result["logprobs"] = logprobs_json(state.logprobs)
        results.append(result)
    if args.json:  # one object; with --n a list of them, each with its "index" (the server mode's)
        print(json.dumps(results[0] if n == 1 else [{"index": i, **r} for i, r in enumerate(results)]))
    elif n > 1:
        for i, r in enumerate(results):
            sys.stdout.write(choice_text(i, r["finish_reason"], r["text"]))
        tokens = sum(len(st.output) for st in states)
        rate = tokens / gen_s if gen_s > 0 else float("inf")
        print(f"[{n} choices, {tokens} tokens in {gen_s:.2f}s = {rate:.1f} tok/s; load {load_s:.1f}s]", file=sys.stderr)
    else:
        (state,) = states
        sys.stdout.write(state.text.take(final=True))  # what stop strings held back
        rate = len(state.output) / gen_s if gen_s > 0 else float("inf")
        acc = f", acceptance {state.accepted / state.proposed:.2f}" if state.proposed else ""
        print(f"\n[{len(state.output)} tokens in {gen_s:.2f}s = {rate:.1f} tok/s{acc}; load {load_s:.1f}s; finish={state.finish_reason}]",
              file=sys.stderr)
    colo.close()
    return 0
