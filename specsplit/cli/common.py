"""Flags shared by several subcommands, and turning them into config objects."""
from __future__ import annotations

import argparse
import re

# The defaults and the namespace -> config conversions live one layer down, in specsplit.defaults,
# so the services and the gateway use them without importing the CLI; re-exported here for the parsers.
from specsplit.defaults import (DEFAULT_SUFFIX_CACHE_TOKENS, SUFFIX_SHARE_MODES, DEFAULT_DRAFT_MODEL_TOKENS, DEFAULT_K_HYBRID, DEFAULT_K_MODEL, DEFAULT_K_NGRAM,  # noqa: F401
                                DISABLE_BY_BATCH_SIZE_CPU, DISABLE_BY_BATCH_SIZE_OTHER, DEFAULT_K_POLICY, K_POLICIES, DEFAULT_DRAFT_STOP, default_disable_by_batch_size,
                                default_k_for, disable_by_batch_size, engine_config, spec_config)

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}


def parse_bytes(text: str) -> int:
    """'512MiB', '2GiB', '1.5GB', '123456' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"cannot read {text!r} as a size: use e.g. 512MiB, 2GiB or a byte count")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def positive_int(text: str) -> int:
    v = int(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return v


def nonneg_int(text: str) -> int:
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text}")
    return v


def unit_float(text: str) -> float:
    """A probability: a number in [0, 1]."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text}") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text}")
    return v


def port(text: str) -> int:
    v = int(text)
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in [0, 65535], got {text}")
    return v


def add_engine_flags(p: argparse.ArgumentParser, device_flag: str = "--device") -> None:
    g = p.add_argument_group("engine")
    g.add_argument(device_flag, dest=device_flag.lstrip("-").replace("-", "_"), default="cpu", help="cpu or cuda:N")
    g.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="weights and KV dtype")
    g.add_argument("--weights", default="native", choices=["native", "fp32", "bf16"],
                   help="how a GGUF model's weights are held: native keeps the file's Q4_0/Q4_1/Q8_0 blocks and "
                        "multiplies them with the quantized CPU kernel (same logits within fp32 rounding; needs "
                        "--dtype fp32 on the CPU, else dense); fp32 dequantizes them as before (to --dtype); bf16 "
                        "holds dense bf16 weights (implies --dtype bf16). Default %(default)s")
    g.add_argument("--max-model-len", type=positive_int, default=2048, help="prompt + generated tokens per sequence")
    g.add_argument("--max-num-seqs", type=positive_int, default=32, help="most sequences in one batch")
    g.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")
    g.add_argument("--max-prefill-tokens", type=positive_int, default=512, help="largest prefill chunk")
    g.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of a prompt prefix computed before (a shared system prompt, a "
                        "preempted request's resume): full blocks by content hash, reference-counted, the unused "
                        "ones evicted least recently used first (default on; docs/prefill.md)")
    g.add_argument("--num-blocks", type=nonneg_int, default=0, help="KV blocks (0 = size from the memory budget)")
    g.add_argument("--memory-utilization", type=float, default=0.9, help="fraction of device memory to use")
    g.add_argument("--memory-budget", type=parse_bytes, default=None, help="bytes to use instead, e.g. 2GiB")
    g.add_argument("--threads", type=nonneg_int, default=0, help="torch CPU threads (0 = torch default)")


def add_tensor_parallel_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel-size", type=positive_int, default=1, metavar="N",
                   help="split the target over N ranks (N-1 worker processes, torch.distributed: gloo on the CPU, "
                        "NCCL on cuda:base..base+N-1); default 1")


def add_deterministic_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant numerics for the target: a sequence's logits do not depend on its batch or "
                        "on K, so speculative greedy == target-only greedy bit for bit (slower; see README)")


def add_spec_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculation")
    g.add_argument("--num-speculative-tokens", type=nonneg_int, default=None,
                   help="draft tokens per step; with --k-policy auto the most per step (default: 2 for a model "
                        "draft, 3 for MODEL+ngram, 4 for n-gram)")
    g.add_argument("--k-policy", choices=K_POLICIES, default=DEFAULT_K_POLICY,
                   help="auto: each step drafts the K (0 included) that maximizes expected tokens/s from the "
                        "engines' calibrated step costs and each request's acceptance; fixed: always "
                        "--num-speculative-tokens (default %(default)s)")
    g.add_argument("--draft-model-tokens", type=nonneg_int, default=DEFAULT_DRAFT_MODEL_TOKENS,
                   help="with --draft MODEL+ngram: the model drafts at most N of the K tokens, prompt lookup up "
                        "to K (0 = K; default %(default)s)")
    g.add_argument("--draft-stop", type=unit_float, default=DEFAULT_DRAFT_STOP, metavar="P",
                   help="an EAGLE-3 draft ends a greedy chain where the product of its top-1 probabilities falls "
                        "below P (it drafts at least one; 0 = always K; default %(default)s)")
    g.add_argument("--suffix-cache-tokens", type=nonneg_int, default=DEFAULT_SUFFIX_CACHE_TOKENS,
                   help="--draft suffix / MODEL+suffix: finished output tokens the drafter keeps to draft from, "
                        "oldest dropped first (default %(default)s, about 10 bytes each; 0 = none)")
    g.add_argument("--suffix-share", choices=SUFFIX_SHARE_MODES, default="finished",
                   help="--draft suffix / MODEL+suffix: 'finished' lets every request draft from the outputs of "
                        "requests that finished (across sessions, so across gateways of one drafter); 'none' keeps "
                        "lookups inside each request (default %(default)s; docs/security.md)")
    g.add_argument("--async-draft", action=argparse.BooleanOptionalAction, default=None,
                   help="pre-draft the next step's likeliest branch while the verifier verifies this one "
                        "(default: on for the split gateway, off in one process, where it needs the drafter on "
                        "its own core: one torch thread each)")
    g.add_argument("--tree-nodes", type=nonneg_int, default=0,
                   help="tree verification (docs/tree-verification.md): greedy requests' drafts may add up to N "
                        "branch nodes to their chain each step, verified in the same forward (0 = chains only, "
                        "the default); with --k-policy auto the calibrated verify cost sizes the tree, 0 "
                        "included. Needs lockstep drafting: the split gateway then pre-drafts only with "
                        "--async-draft, which turns trees off")
    g.add_argument("--disable-by-batch-size", type=nonneg_int, default=None,
                   help="decode target-only while more than N sequences run (0 = never), an operator's hard "
                        "limit; default 0 with --k-policy auto; with --k-policy fixed, 1 when the target runs on "
                        "a CPU (there a fixed K stopped paying from 2 concurrent sequences, README 'Benchmarks')")


def add_server_flags(p: argparse.ArgumentParser, default_port: int) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind")
    g.add_argument("--port", type=port, default=default_port, help="port to bind (0 = any free port)")
    g.add_argument("--metrics-port", type=port, default=None, help="serve Prometheus metrics on this port")
    g.add_argument("--port-file", default=None, metavar="PATH",
                   help="once serving, write the bound port (one line) to PATH: with --port 0, how a supervisor "
                        "learns the port the kernel gave (written whole: beside PATH, then renamed; give a fresh "
                        "path, since an old file there is replaced only once this process serves)")
    from specsplit.rpc.security import add_server_security_flags

    add_server_security_flags(p)


def add_http_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("OpenAI-compatible HTTP API")
    g.add_argument("--http-port", type=port, default=None,
                   help="also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                        "/v1/models, /health, /metrics) on this port, with the same bearer token and TLS "
                        "certificate as the gRPC API (0 or unset = off)")
    g.add_argument("--http-host", default=None, help="address the HTTP API binds (default: --host)")
    g.add_argument("--http-limit-concurrency", type=positive_int, default=DEFAULT_HTTP_LIMIT_CONCURRENCY, metavar="N",
                   help="most HTTP connections and requests open at once; past it uvicorn answers 503 "
                        "(default %(default)s)")
    g.add_argument("--tool-call-stream", choices=("decided", "eager"), default="decided",
                   help="when a streamed answer with tools sends a tool call: decided (default) once nothing "
                        "after it can make it content (its </tool_call>, or the answer's end for a bare JSON "
                        "call), header and arguments together, so the stream always equals the non-streamed "
                        "answer; eager as soon as its name and arguments begin, the arguments in pieces, "
                        "never taken back if the text then stops being a call")


def validate_http(args) -> None:
    if getattr(args, "http_port", None) and args.http_port == args.port and (args.http_host or args.host) == args.host:
        raise ValueError(f"--http-port {args.http_port} is the gRPC --port: give the HTTP API a port of its own")


def add_request_size_flag(p: argparse.ArgumentParser) -> None:
    from specsplit.rpc.security import MAX_REQUEST_BYTES

    p.add_argument("--max-request-bytes", type=parse_bytes, default=MAX_REQUEST_BYTES,
                   help="largest GenerateRequest accepted; larger ones get RESOURCE_EXHAUSTED (default 4MiB)")


def add_grammar_flag(p: argparse.ArgumentParser) -> None:
    from specsplit.sampling.grammar import DEFAULT_COMPILE_TIMEOUT_S

    p.add_argument("--grammar-timeout", type=float, default=DEFAULT_COMPILE_TIMEOUT_S,
                   help="seconds a structured-output grammar (JSON schema, regex, EBNF) may take to compile; "
                        f"slower ones are refused with INVALID_ARGUMENT (default {DEFAULT_COMPILE_TIMEOUT_S:g})")


def check_grammar_timeout(args) -> None:
    t = getattr(args, "grammar_timeout", None)
    if t is not None and not t > 0:
        raise ValueError(f"--grammar-timeout must be positive, got {t}")
DEFAULT_STALL_TIMEOUT_S = 300.0  # gateway/app.py's default too
DEFAULT_MAX_CONCURRENT_RPCS = 256  # the gateway's gRPC API: RPCs open at once
DEFAULT_MAX_NUM_BATCHED_TOKENS = 128  # the scheduler's per-step token budget (chunked prefill; docs/prefill.md)
DEFAULT_HTTP_LIMIT_CONCURRENCY = 256  # the HTTP API: connections and requests open at once


def add_gateway_limit_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-concurrent-rpcs", type=positive_int, default=DEFAULT_MAX_CONCURRENT_RPCS, metavar="N",
                   help="most gRPC calls open at once on the public API (streams, health and info included); past "
                        "it a call is RESOURCE_EXHAUSTED before any work (default %(default)s; running + queued "
                        "requests are bounded by --max-num-seqs + --max-queue first)")
    p.add_argument("--max-num-batched-tokens", type=nonneg_int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS, metavar="N",
                   help="chunked prefill: most tokens one step computes on the verifier; running sequences' decodes "
                        "(K+1 each) first, then pieces of new prompts (at least N/4 a step), so a long prompt is "
                        "prefilled over several steps while the others keep decoding (default %(default)s, sized "
                        "for a CPU target: SmolLM2-135M on 2 shared cores keeps a running stream's gaps under 1 s; "
                        "raise it on a GPU; 0 = each prompt whole in its first step)")
    p.add_argument("--stall-timeout", type=float, default=DEFAULT_STALL_TIMEOUT_S, metavar="S",
                   help="health turns NOT_SERVING while one scheduler step has run longer than S seconds (a stuck "
                        "engine or peer call; default %(default)g)")


def add_keepalive_flags(p: argparse.ArgumentParser) -> None:
    from specsplit.rpc.security import DEFAULT_KEEPALIVE_TIME_S, DEFAULT_KEEPALIVE_TIMEOUT_S, MIN_PING_INTERVAL_S

    p.add_argument("--keepalive-time", type=float, default=DEFAULT_KEEPALIVE_TIME_S,
                   help=f"seconds between keepalive pings to the drafter and verifier (>= {MIN_PING_INTERVAL_S:g}, "
                        f"default {DEFAULT_KEEPALIVE_TIME_S:g})")
    p.add_argument("--keepalive-timeout", type=float, default=DEFAULT_KEEPALIVE_TIMEOUT_S,
                   help=f"seconds to wait for a ping's answer before the peer counts as gone (default {DEFAULT_KEEPALIVE_TIMEOUT_S:g})")


def validate_security(args) -> None:
    from specsplit.rpc.security import MIN_PING_INTERVAL_S, ClientSecurity, ServerSecurity

    ServerSecurity.from_args(args).validate()
    if hasattr(args, "internal_tls_ca"):
        ClientSecurity.from_args(args, "internal_").validate("--internal-")
    if hasattr(args, "keepalive_time"):
        if args.keepalive_time < MIN_PING_INTERVAL_S:
            raise ValueError(f"--keepalive-time must be >= {MIN_PING_INTERVAL_S:g}s (servers refuse pings more often)")
        if args.keepalive_timeout <= 0:
            raise ValueError("--keepalive-timeout must be positive")


def check_device(flag: str, dev: str | None) -> None:
    if dev is not None and not (dev == "cpu" or re.fullmatch(r"cuda(:\d+)?", dev)):
        raise ValueError(f"{flag} must be cpu or cuda:N, got {dev!r}")


def check_address(flag: str, address: str | None) -> None:
    """HOST:PORT with a non-empty host and a port in [1, 65535] ([v6]:port accepted)."""
    if address is None:
        return
    m = re.fullmatch(r"(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})", address)
    if not m or not 1 <= int(m.group(2)) <= 65535:
        raise ValueError(f"{flag} must be HOST:PORT (e.g. 127.0.0.1:50051), got {address!r}")


def check_models(args) -> None:
    """The command's model arguments name models (registry.check_model_argument), checked before
    anything loads: a drafter's or verifier's --model, a target's --target and --draft. A
    misspelt --draft was found only once the target had loaded. --check checks aliases and leaves
    paths (they may name files on the machine that runs the command: compose's /models)."""
    from specsplit.models.registry import check_model_argument

    paths = not getattr(args, "check", False)

    command = getattr(args, "command", None)
    named = ([("--model", args.model, command == "drafter")] if command in ("drafter", "verifier") else
             [("--target", getattr(args, "target", None), False), ("--draft", getattr(args, "draft", None), True)])
    for flag, name, draft in named:
        if name:
            try:
                check_model_argument(name, draft, paths)
            except ValueError as e:
                raise ValueError(f"{flag}: {e}") from None


def validate_engine(args) -> None:
    check_models(args)
    if not 0.0 < args.memory_utilization <= 1.0:
        raise ValueError(f"--memory-utilization must be in (0, 1], got {args.memory_utilization}")
    check_device("--device", getattr(args, "device", "cpu"))
    check_device("--draft-device", getattr(args, "draft_device", None))
    # Before any model loads (the memory plan says it again). Not for a lone drafter: one without a
    # paged cache (prompt lookup, an EAGLE-3 head) ignores --num-blocks.
    blocks = getattr(args, "num_blocks", 0) if getattr(args, "command", None) != "drafter" else 0
    if blocks:
        from specsplit.kv.block_manager import too_few_blocks

        why = too_few_blocks(blocks, args.block_size, args.max_model_len)
        if why:
            raise ValueError(why)
    if args.max_prefill_tokens > args.max_model_len:
        args.max_prefill_tokens = args.max_model_len
