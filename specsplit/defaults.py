"""Server defaults (K per kind of draft, the speculation-off threshold) and the conversion of a
parsed command line (an argparse namespace, or anything with the same attributes) into config
objects.

They sit below the CLI on purpose: the engine services (specsplit.rpc.build) and the gateway need the same
defaults the parsers print, and must not import specsplit.cli (the layering contracts in
pyproject.toml forbid it). Nothing here imports torch at module level, so the parsers stay cheap.
"""
from __future__ import annotations

DEFAULT_K_MODEL = 2
DEFAULT_K_HYBRID = 3  # MODEL+ngram: lookup drafts up to 3, the model DEFAULT_DRAFT_MODEL_TOKENS
DEFAULT_DRAFT_MODEL_TOKENS = 1
DEFAULT_K_NGRAM = 4
DEFAULT_K_FEATURE = 3  # an EAGLE-3 head (alone or +ngram): the K policy picks K <= 3 per step
DEFAULT_K_SUFFIX = 6  # suffix drafting: at most 6 a step; it drafts fewer where its match is rare
DEFAULT_SUFFIX_CACHE_TOKENS = 1 << 18  # finished output tokens a suffix drafter keeps (~10 bytes each)
SUFFIX_SHARE_MODES = ("none", "finished")
DISABLE_BY_BATCH_SIZE_CPU = 1  # with --k-policy fixed; measured: `specsplit bench` concurrency sweep (README)
DISABLE_BY_BATCH_SIZE_OTHER = 0  # never: on a GPU the verify pass stays memory-bound far longer
K_POLICIES = ("auto", "fixed")
DEFAULT_K_POLICY = "auto"  # K per step from calibrated costs and acceptance (specsplit/k_policy.py)
# An EAGLE-3 head ends its greedy chain where the product of its top-1 probabilities falls below
# this (SpecConfig.draft_stop). Its top-1 probability is calibrated (accepted 0.22 of the time in
# [0, 0.2), 0.95 in [0.8, 1]); replayed teacher-forced on 32 held-out prompts with a verify row at
# 0.15 of a step and a draft at 0.07: K<=3 chains 1.27 tokens per step-cost, stopped at 0.15
# 1.43 (docs/feature-drafter.md).
DEFAULT_DRAFT_STOP = 0.15


def default_disable_by_batch_size(target_device: str | None, k_policy: str = DEFAULT_K_POLICY) -> int:
    """The threshold a server uses when --disable-by-batch-size is not given: none with the K
    policy (it turns speculation off where it cannot pay); with a fixed K, 1 on a CPU."""
    if k_policy == "auto":
        return 0
    return DISABLE_BY_BATCH_SIZE_CPU if (target_device or "cpu").startswith("cpu") else DISABLE_BY_BATCH_SIZE_OTHER


def disable_by_batch_size(args, target_device: str | None) -> int:
    value = getattr(args, "disable_by_batch_size", None)
    policy = getattr(args, "k_policy", None) or DEFAULT_K_POLICY
    return default_disable_by_batch_size(target_device, policy) if value is None else value


NO_DRAFT = "none"  # --draft none: target-only
# The best shipped draft per target alias (measured: README "Benchmarks"); a target not listed
# runs target-only unless --draft names one.
DEFAULT_DRAFTS = {"smollm2-135m": "smollm2-135m-eagle3+ngram"}
# A tensor-parallel target cannot capture features yet: its best model draft instead.
DEFAULT_DRAFTS_TP = {"smollm2-135m": "smollm2-135m-draft+ngram"}


def is_no_draft(draft: str | None) -> bool:
    """Whether a --draft argument asks for no draft (`--draft none`, any case)."""
    return draft is not None and draft.strip().lower() == NO_DRAFT


def resolve_draft(target: str | None, draft: str | None, tensor_parallel_size: int | None = 1) -> str | None:
    """The draft a command runs: --draft as given, 'none' for target-only, and when --draft is
    omitted the target's best shipped draft (DEFAULT_DRAFTS), else none."""
    if draft is None:
        table = DEFAULT_DRAFTS_TP if (tensor_parallel_size or 1) > 1 else DEFAULT_DRAFTS
        return table.get(target or "")
    return None if is_no_draft(draft) else draft


def bench_draft(target: str | None) -> str:
    """The model draft `specsplit bench` measures when --draft is omitted: the target's default
    draft (resolve_draft) without its prompt-lookup front, which the bench adds itself as the
    DRAFT+ngram arms (its policy arm then runs the served default); ngram for a target without
    a default draft."""
    served = resolve_draft(target, None)
    if served is None:
        return "ngram"
    return served.removesuffix("+ngram")


def bench_hybrid(draft: str | None) -> str | None:
    """The draft of `specsplit bench`'s MODEL+ngram arms for its --draft: MODEL+ngram for a model
    draft, the draft itself where it names its lookup already (MODEL+ngram, MODEL+suffix: a
    served --draft, not to be given a second '+ngram'), None where there is no model (a lookup
    alone, or no draft)."""
    from specsplit.models.registry import LOOKUPS, split_draft_name

    if draft is None or draft in LOOKUPS:
        return None
    return draft if split_draft_name(draft)[1] else f"{draft}+ngram"


def default_k_for(draft: str | None) -> int:
    """The K a server uses for this draft when --num-speculative-tokens is not given."""
    if draft is None:
        return 0
    if draft == "ngram":
        return DEFAULT_K_NGRAM
    if draft == "suffix" or draft.endswith("+suffix"):
        return DEFAULT_K_SUFFIX
    if "eagle3" in draft:
        return DEFAULT_K_FEATURE
    return DEFAULT_K_HYBRID if draft.endswith("+ngram") else DEFAULT_K_MODEL


def spec_config(args, draft: str | None, device: str | None = None, split: bool = False):
    """The SpecConfig of a server or command from its flags: the one place (serve, generate,
    profile, the split gateway). draft: the draft's name (None: no draft, K 0); device: where the
    target runs (default args.device); split: the drafter has its own process, so pre-drafting is
    on unless --no-async-draft (in one process it is off unless --async-draft)."""
    from specsplit.config import SpecConfig

    k = args.num_speculative_tokens
    if k is None:
        k = default_k_for(draft)
    asked = getattr(args, "async_draft", None)
    tree = getattr(args, "tree_nodes", 0) or 0  # trees need lockstep: pre-drafting only when asked for
    return SpecConfig(num_speculative_tokens=k,
                      disable_by_batch_size=disable_by_batch_size(args, device or getattr(args, "device", None)),
                      draft_model_tokens=getattr(args, "draft_model_tokens", DEFAULT_DRAFT_MODEL_TOKENS),
                      k_policy=getattr(args, "k_policy", None) or DEFAULT_K_POLICY,
                      suffix_cache_tokens=getattr(args, "suffix_cache_tokens", DEFAULT_SUFFIX_CACHE_TOKENS),
                      suffix_share=getattr(args, "suffix_share", "finished"),
                      tree_nodes=tree,
                      draft_stop=getattr(args, "draft_stop", DEFAULT_DRAFT_STOP),
                      async_draft=(bool(asked) if tree else asked is not False) if split else bool(asked))


def engine_config(args, model: str, device: str | None = None):
    # Imported here: the parser (and `specsplit health`, a container healthcheck) must not pay
    # for importing torch.
    from specsplit.config import EngineConfig, parse_dtype

    weights = getattr(args, "weights", "native")
    if weights == "native" and getattr(args, "tensor_parallel_size", 1) > 1:
        weights = "fp32"  # the tensor-parallel shards are cut from dense weights (parallel/tensor_parallel.py)
    return EngineConfig(
        model=model,
        device=device or args.device,
        dtype=parse_dtype("bf16" if weights == "bf16" else args.dtype),
        weights=weights,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_prefill_tokens=args.max_prefill_tokens,
        prefix_caching=getattr(args, "prefix_caching", True),
        num_blocks=args.num_blocks,
        memory_budget_bytes=args.memory_budget,
        memory_utilization=args.memory_utilization,
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1) or 1,
        # the target's numerics; a draft's do not change the output
        deterministic=bool(getattr(args, "deterministic", False)) and model != getattr(args, "draft", None),
    )
