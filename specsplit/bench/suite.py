"""`specsplit bench`: arms side by side in one run on the same held-out ShareGPT prompts.

Suites:
  target  native target-only vs transformers generate, fp32 and bf16 (the foundation's ratio)
  spec    target-only baselines, HF assisted generation, specsplit colocated with the model draft
          and with n-gram for several K, specsplit split over gRPC (`specsplit up`: three local
          processes, same target/draft/dtype) for --split-ks, and a concurrency sweep with and
          without speculation
  all     both
Output: a table on stdout, a JSON file and a PNG plot under --out.
"""
from __future__ import annotations

import json
import logging
import platform
import time
from pathlib import Path

import torch
from tqdm import tqdm

from specsplit.bench.arms import ArmResult, colocated_arm, hf_arm, run_interleaved
from specsplit.bench.costs import measure_costs, predicted_speedup
from specsplit.config import EngineConfig, SpecConfig, parse_dtype
from specsplit.defaults import DEFAULT_DRAFT_STOP, bench_hybrid
from specsplit.factory import build_colocated
from specsplit.models.registry import ASSETS_DIR, DRAFT_ALIAS, LOOKUPS, is_eagle3, sharegpt_json_path

log = logging.getLogger(__name__)


def heldout_prompts(tokenizer, n: int, max_prompt_tokens: int, chat: bool = True) -> list[list[int]]:
    """The first n held-out ShareGPT prompts (ids written by the draft's training) that fit."""
    from specsplit.datasets.sharegpt import load_prompts

    ids_file = ASSETS_DIR / DRAFT_ALIAS / "heldout_ids.json"
    prompts = load_prompts(sharegpt_json_path())
    if ids_file.exists():
        wanted = json.loads(ids_file.read_text())
        by_id = dict(prompts)
        chosen = [by_id[i] for i in wanted if i in by_id]
    else:
        chosen = [p for _, p in prompts[-200:]]
    out = []
    for text in chosen:
        if chat:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
        else:
            ids = tokenizer(text).input_ids
        if 8 <= len(ids) <= max_prompt_tokens:
            out.append(list(ids))
        if len(out) == n:
            break
    return out


def model_draft_of(draft: str | None) -> str | None:
    """The spec suite's draft where it is a model (its costs measured, transformers arms beside
    it); None for none or a prompt lookup (ngram, suffix)."""
    return draft if draft is not None and draft not in LOOKUPS else None


def _hf_models(colo, draft_name: str | None, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(colo.target_model.hf_dir, dtype=dtype).eval()
    assistant = None
    if draft_name and draft_name != "ngram" and colo.draft_model is not None:
        assistant = hf_draft_model(colo.draft_model, target, dtype)
    return target, assistant


def hf_draft_model(draft_loaded, hf_target, dtype):
    """The same draft as a transformers model (for assisted generation): its own layers from the
    native model, embedding from the target; the head is the full tied embedding (transformers has
    no sub-vocabulary head), so HF's draft may also propose tokens outside the FR-Spec subset."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from specsplit.models.loader import hf_dir_for

    native = draft_loaded.model
    cfg = AutoConfig.from_pretrained(hf_dir_for(draft_loaded.name, show_progress=False))
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    sd = model.state_dict()
    with torch.no_grad():
        sd["model.embed_tokens.weight"].copy_(native.embed_tokens.weight)
        sd["model.norm.weight"].copy_(native.norm.weight)
        for i, layer in enumerate(native.layers):
            p = f"model.layers.{i}."
            q, k, v = layer.qkv_proj.dense_weight().split([layer.q_size, layer.kv_size, layer.kv_size])
            sd[p + "self_attn.q_proj.weight"].copy_(q)
            sd[p + "self_attn.k_proj.weight"].copy_(k)
            sd[p + "self_attn.v_proj.weight"].copy_(v)
            sd[p + "self_attn.o_proj.weight"].copy_(layer.o_proj.dense_weight())
            gate, up = layer.gate_up_proj.dense_weight().chunk(2)
            sd[p + "mlp.gate_proj.weight"].copy_(gate)
            sd[p + "mlp.up_proj.weight"].copy_(up)
            sd[p + "mlp.down_proj.weight"].copy_(layer.down_proj.dense_weight())
            sd[p + "input_layernorm.weight"].copy_(layer.input_norm.weight)
            sd[p + "post_attention_layernorm.weight"].copy_(layer.post_attn_norm.weight)
    model.tie_weights()
    return model


class Bench:
    def __init__(self, args):
        self.args = args
        self.results: list[dict] = []
        self._outputs: dict[str, list[list[int]]] = {}  # arm -> each prompt's generated ids
        self.costs: dict = {}
        self.quick = args.quick
        self.new_tokens = args.new_tokens or (24 if self.quick else 96)
        self.repeats = args.repeats or (1 if self.quick else 3)
        self.num_prompts = args.num_prompts or (2 if self.quick else 6)
        self.ks = [int(k) for k in (args.ks or ("2,4" if self.quick else "1,2,3,4,6")).split(",")]
        self.concurrency = [int(c) for c in (args.concurrency or ("1,4" if self.quick else "1,4,16,32")).split(",")]
        self.split_ks = [] if getattr(args, "no_split", False) else self._split_ks(args)
        draft = getattr(args, "draft", None)
        # MODEL+ngram arms beside the model draft's (unless --no-hybrid, the draft is a lookup alone
        # or it names its lookup already)
        hybrid = None if getattr(args, "no_hybrid", False) else bench_hybrid(draft)
        self.hybrid_draft = hybrid if hybrid != draft else None
        # the draft a server would run: the split arm and the concurrency sweep use it
        self.served_draft = self.hybrid_draft or draft or "ngram"
        self.bar = None
        self.partial_path: Path | None = None
        if getattr(args, "out", None):
            Path(args.out).mkdir(parents=True, exist_ok=True)
            self.partial_path = Path(args.out) / "bench.partial.json"

    def _split_ks(self, args) -> list[int]:
        if getattr(args, "split_ks", None):
            return [int(k) for k in args.split_ks.split(",")]
        if self.quick:
            return self.ks[:1]
        from specsplit.defaults import default_k_for

        return [default_k_for(args.draft)]

    def _weights(self) -> list[str]:
        return str(getattr(self.args, "weights", None) or "native").split(",")

    def _cfg(self, model: str, dtype: str, max_num_seqs: int = 1, weights: str | None = None) -> EngineConfig:
        weights = weights or self._weights()[0]
        return EngineConfig(model=model, dtype=parse_dtype(dtype), device=getattr(self.args, "device", "cpu"),
                            weights=weights,
                            max_model_len=self.args.max_model_len,
                            max_num_seqs=max_num_seqs, max_prefill_tokens=min(512, self.args.max_model_len // 2),
                            prefix_caching=False)  # every arm computes its prompts (no reuse across repeats)

    def _add(self, result: ArmResult, **extra) -> dict:
        self._outputs[result.name] = [t.output for t in result.timings]
        row = result.summary()
        row.update(extra)
        self.results.append(row)
        if self.partial_path is not None:  # a long run leaves what it measured so far
            self.partial_path.write_text(json.dumps({"costs": self.costs, "arms": self.results}, indent=2))
        return row

    def _tick(self):
        if self.bar is not None:
            self.bar.update(1)

    def _prompts(self, colo) -> list[list[int]]:
        if self.args.prompt_token_ids:
            return [[int(t) for t in self.args.prompt_token_ids.split(",")]] * self.num_prompts
        return heldout_prompts(colo.tokenizer, self.num_prompts, self.args.max_prompt_tokens, chat=True)

    # ---- suites ------------------------------------------------------------------------------
    def target_suite(self, dtypes=("fp32", "bf16")) -> None:
        """Native target-only vs transformers generate, interleaved run by run, per dtype."""
        modes = self._weights()
        for dtype in dtypes:
            colos = [build_colocated(self._cfg(self.args.target, dtype, weights=w), None,
                                     SpecConfig(num_speculative_tokens=0), show_progress=False) for w in modes]
            colo = colos[0]
            prompts = self._prompts(colo)
            # one arm per --weights mode (the first is the one compared with transformers)
            arms = [colocated_arm(f"native target-only {dtype}" + (f" weights={w}" if len(modes) > 1 else ""), c,
                                  self.new_tokens) for w, c in zip(modes, colos)]
            hf = None
            if not self.args.no_hf:
                hf, _ = _hf_models(colo, None, parse_dtype(dtype))
                arms.append(hf_arm(f"transformers generate {dtype}", hf, self.new_tokens))
            rows = [self._add(r, dtype=dtype, suite="target") for r in run_interleaved(arms, prompts, self.repeats,
                                                                                      self._tick)]
            for row in rows[1:len(modes)]:
                row["same_tokens_as_first_weights"] = self._same_tokens(row, rows[0])
            if hf is not None:
                rows[0]["ratio_vs_hf_generate"] = rows[0]["tokens_per_s"] / rows[len(modes)]["tokens_per_s"]
                rows[0]["same_tokens_as_hf"] = self._same_tokens(rows[0], rows[len(modes)])
            del hf
            for c in colos:
                c.close()

    def _same_tokens(self, a: dict, b: dict) -> bool:
        return self._outputs.get(a["arm"]) == self._outputs.get(b["arm"])

    def spec_suite(self) -> None:
        """Batch 1, interleaved run by run: target-only, each draft at each K, transformers generate
        and assisted generation with the same model draft. Then the split arm (paired with a
        colocated engine) and the concurrency sweep."""
        a = self.args
        dtype = a.dtype
        draft = a.draft
        base = build_colocated(self._cfg(a.target, dtype), None, SpecConfig(num_speculative_tokens=0), show_progress=False)
        prompts = self._prompts(base)
        drafts = self._spec_drafts()
        colos = {name: build_colocated(self._cfg(a.target, dtype), self._cfg(name, dtype),
                                       SpecConfig(num_speculative_tokens=max(self.ks), k_policy="fixed"),
                                       show_progress=False)
                 for name in drafts}
        # --tree-nodes: the same drafts and K with draft trees (fixed K: the tree is always asked for)
        tree = getattr(a, "tree_nodes", 0) or 0
        tree_colos = {name: build_colocated(self._cfg(a.target, dtype), self._cfg(name, dtype),
                                            SpecConfig(num_speculative_tokens=max(self.ks), k_policy="fixed",
                                                       tree_nodes=tree), show_progress=False)
                      for name in drafts} if tree else {}
        # The default configuration: the served draft with the K policy (K <= its default maximum).
        from specsplit.defaults import default_k_for

        policies: dict[str, object] = {}  # policy arm name -> its colocated engines

        def policy_arm(name: str, tree_nodes: int = 0):
            """A draft's default configuration (the K policy, K <= its default maximum), with trees the
            calibrated verify cost sizes when tree_nodes > 0."""
            k = default_k_for(name)
            arm = f"specsplit colocated {name} policy K<={k}" + (f" tree<={tree_nodes}" if tree_nodes else "")
            policies[arm] = build_colocated(self._cfg(a.target, dtype), self._cfg(name, dtype),
                                            SpecConfig(num_speculative_tokens=k, k_policy="auto", tree_nodes=tree_nodes,
                                                       draft_stop=DEFAULT_DRAFT_STOP), show_progress=False)
            return colocated_arm(arm, policies[arm], self.new_tokens, None, draft=name, role="policy")

        model_draft = model_draft_of(draft)
        if model_draft is not None:
            self.costs = measure_costs(colos[model_draft], prompts[0], self.ks)
        arms = [colocated_arm(f"native target-only {dtype}", base, self.new_tokens, role="baseline")]
        for name in drafts:
            arms += [colocated_arm(f"specsplit colocated {name} K={k}", colos[name], self.new_tokens, k, draft=name)
                     for k in self.ks]
            if name in tree_colos:
                arms += [colocated_arm(f"specsplit colocated {name} K={k} tree<={tree}", tree_colos[name],
                                       self.new_tokens, k, draft=name, tree_nodes=tree) for k in self.ks]
        arms.append(policy_arm(self.served_draft))
        if tree:  # --tree-nodes: the default configuration with sized trees too
            arms.append(policy_arm(self.served_draft, tree))
        arms += [policy_arm(other) for other in getattr(a, "also_draft", [])]  # their default configuration too
        hf = assistant = None
        if model_draft is not None and not a.no_hf:
            # no assistant where the draft has no causal LM (an EAGLE-3 head): the generate arm alone
            hf, assistant = _hf_models(colos[model_draft], model_draft, parse_dtype(dtype))
            arms.append(hf_arm(f"transformers generate {dtype}", hf, self.new_tokens, role="hf_generate"))
            if assistant is not None:
                arms += [hf_arm(f"HF assisted {mode} K={k}", hf, self.new_tokens, assistant=assistant,
                                assistant_mode=mode, k=k, draft=model_draft) for mode, k in (("constant", 3), ("heuristic", 5))]
        results = run_interleaved(arms, prompts, self.repeats, self._tick)
        for r in results:
            if r.name in policies:
                dec = policies[r.name].decoder
                r.extra["k_chosen"] = dict(sorted(dec.k_chosen.items()))
                r.extra["calibration"] = dec.policy.costs.describe() if dec.policy else None
        rows = [self._add(r, dtype=dtype, suite="spec") for r in results]
        baseline = rows[0]
        hf_ref = next((r for r in rows if r.get("role") == "hf_generate"), None)
        by_k: dict[str, dict[int, tuple[ArmResult, dict]]] = {}
        for result, row in zip(results, rows):
            name = row.get("draft")
            if row.get("tree_nodes") or row.get("role") == "policy":  # no fixed chain: no prediction
                row["speedup_vs_target_only"] = row["tokens_per_s"] / baseline["tokens_per_s"]
                row["same_tokens_as_target_only"] = self._same_tokens(row, baseline)
            elif row["arm"].startswith("specsplit colocated"):
                by_k.setdefault(name, {})[row["k"]] = (result, row)
                row["speedup_vs_target_only"] = row["tokens_per_s"] / baseline["tokens_per_s"]
                row["same_tokens_as_target_only"] = self._same_tokens(row, baseline)
                if name != "ngram" and row["mean_accepted_length"] is not None and self.costs:
                    # c of the model draft; a lookup step costs no draft forward, so for the
                    # hybrid this is the prediction's lower bound
                    row["predicted_speedup"] = predicted_speedup(row["mean_accepted_length"] + 1, row["k"], self.costs)
            elif row["arm"].startswith("HF assisted"):
                row["speedup_vs_target_only"] = row["tokens_per_s"] / baseline["tokens_per_s"]
        if hf_ref is not None:
            baseline["ratio_vs_hf_generate"] = baseline["tokens_per_s"] / hf_ref["tokens_per_s"]
            assisted = [r for r in rows if r["arm"].startswith("HF assisted")]
            best_hf = max(assisted, key=lambda r: r["tokens_per_s"]) if assisted else None
            for row in rows:
                if best_hf and row["arm"].startswith("specsplit colocated") and row.get("draft") == model_draft:
                    row["ratio_vs_best_hf_assisted"] = row["tokens_per_s"] / best_hf["tokens_per_s"]
        del hf, assistant
        for colo in (base, *policies.values(), *colos.values(), *tree_colos.values()):
            colo.close()
        del base, colos
        if self.split_ks:
            self.split_arms(self.served_draft, dtype, prompts, baseline, by_k.get(self.served_draft, {}))
        self.concurrency_sweep(self.served_draft, dtype, prompts)

    def split_arms(self, draft: str, dtype: str, prompts, baseline: dict, colocated: dict) -> None:
        """specsplit split over gRPC: `specsplit up` (three local processes) with the colocated
        arms' target, draft, dtype, threads and engine sizes, one stream at a time, interleaved
        run by run with a colocated engine of the same configuration (ratio_vs_colocated)."""
        from specsplit.bench.split_arm import UP_FLAGS, run_split_paired
        from specsplit.gateway.launch import specsplit_up

        a = self.args
        cfg = self._cfg(a.target, dtype)
        colo = build_colocated(cfg, self._cfg(draft, dtype), SpecConfig(num_speculative_tokens=max(self.split_ks)),
                               show_progress=False)
        try:
            with specsplit_up(a.target, draft, dtype=dtype, max_model_len=cfg.max_model_len,
                              max_num_seqs=cfg.max_num_seqs, num_speculative_tokens=max(self.split_ks),
                              threads=a.threads, extra=["--max-prefill-tokens", str(cfg.max_prefill_tokens),
                                                          "--k-policy", "fixed", *UP_FLAGS]) as up:
                for k in self.split_ks:
                    split, paired = run_split_paired(
                        f"specsplit split grpc {draft} K={k}", f"specsplit colocated {draft} K={k} (paired with split)",
                        up.address, colo, prompts, self.new_tokens, self.repeats, k, progress=self._tick)
                    pair_row = self._add(paired, dtype=dtype, suite="spec", draft=draft, mode="colocated-paired")
                    row = self._add(split, dtype=dtype, suite="spec", draft=draft, mode="split")
                    for r in (pair_row, row):
                        r["speedup_vs_target_only"] = r["tokens_per_s"] / baseline["tokens_per_s"]
                    if pair_row["mean_accepted_length"] is not None and self.costs:
                        pair_row["predicted_speedup"] = predicted_speedup(pair_row["mean_accepted_length"] + 1, k,
                                                                          self.costs)
                    row["ratio_vs_colocated"] = row["tokens_per_s"] / pair_row["tokens_per_s"]
                    row["same_tokens_as_colocated"] = ([t.output for t in split.timings]
                                                       == [t.output for t in paired.timings])
                    if k in colocated:  # and the colocated arm of the K sweep, minutes earlier
                        row["same_tokens_as_colocated"] &= ([t.output for t in split.timings]
                                                            == [t.output for t in colocated[k][0].timings])
        finally:
            colo.close()

    def concurrency_sweep(self, draft: str, dtype: str, prompts) -> None:
        """Aggregate throughput at each concurrency, target-only and with speculation as a server
        runs it by default (the served draft, the K policy, the default --disable-by-batch-size),
        the two alternating batch by batch (interleaved) so drift hits both alike. Each repeat
        covers every prompt: ceil(prompts / c) batches of c (at c = 1 the prompts one at a time,
        as the engine arms run them; one prompt alone read 0.96x where the six read 1.0x)."""
        from specsplit.bench.arms import ArmResult, generate_timed
        from specsplit.defaults import default_k_for, disable_by_batch_size

        a = self.args
        top = max(self.concurrency)
        k = default_k_for(draft)
        threshold = disable_by_batch_size(a, self._cfg(a.target, dtype).device)
        colos = {
            False: build_colocated(self._cfg(a.target, dtype, top), None, SpecConfig(num_speculative_tokens=0),
                                   show_progress=False),
            True: build_colocated(self._cfg(a.target, dtype, top), self._cfg(draft, dtype, top),
                                  SpecConfig(num_speculative_tokens=k, disable_by_batch_size=threshold, k_policy="auto", draft_stop=DEFAULT_DRAFT_STOP),
                                  show_progress=False),
        }
        for spec_on, colo in colos.items():
            generate_timed(colo, prompts[:1], self.new_tokens, None, "warm")
        for c in self.concurrency:
            runs = {False: [], True: []}
            walls = {False: 0.0, True: 0.0}
            colos[True].decoder.k_chosen.clear()
            n_batches = self._batches(c, len(prompts))
            for j in range(self.repeats):
                for b in range(n_batches):
                    nth = j * n_batches + b  # this batch's place in the sweep at c
                    batch = [prompts[(nth * c + i) % len(prompts)] for i in range(c)]
                    for spec_on in ((False, True) if nth % 2 == 0 else (True, False)):
                        t = generate_timed(colos[spec_on], batch, self.new_tokens, None, f"c{c}r{j}b{b}", max(c, 1))
                        walls[spec_on] += max(x.total_s for x in t)
                        runs[spec_on].extend(t)
                    self._tick()
            rows = {}
            for spec_on in (False, True):
                extra = {"concurrency": c, "k": k if spec_on else 0, "wall_s": walls[spec_on], "interleaved": 2}
                if spec_on:
                    extra["k_chosen"] = dict(sorted(colos[True].decoder.k_chosen.items()))
                name = f"concurrency {c} {'spec ' + draft + ' policy' if spec_on else 'target-only'}"
                rows[spec_on] = self._add(ArmResult(name, runs[spec_on], extra), dtype=dtype, suite="concurrency",
                                          speculation=spec_on, disable_by_batch_size=threshold if spec_on else None)
            rows[True]["speedup_vs_target_only"] = rows[True]["tokens_per_s"] / rows[False]["tokens_per_s"]
        for colo in colos.values():
            colo.close()

    @staticmethod
    def _batches(concurrency: int, num_prompts: int) -> int:
        """Batches of `concurrency` requests per repeat of the sweep: enough to cover every prompt."""
        return max(1, -(-num_prompts // max(concurrency, 1)))

    def _spec_drafts(self) -> list[str]:
        """The drafts whose fixed-K arms the spec suite runs: the draft, its hybrid, ngram and each
        --also-draft, once each."""
        a = self.args
        return list(dict.fromkeys(d for d in (a.draft, self.hybrid_draft, "ngram", *getattr(a, "also_draft", []))
                                  if d is not None))

    def total_ticks(self) -> int:
        per_arm = self.num_prompts
        n = 0
        if self.args.suite in ("target", "all"):
            n += (1 if self.quick else 2) * per_arm * (len(self._weights()) + (0 if self.args.no_hf else 1))
        if self.args.suite in ("spec", "all"):
            has_model = model_draft_of(self.args.draft) is not None
            n_drafts = len(self._spec_drafts())
            trees = 2 if getattr(self.args, "tree_nodes", 0) else 1  # --tree-nodes: a tree arm per chain arm
            hf_arms = 0 if self.args.no_hf or not has_model else 1 if is_eagle3(self.args.draft) else 3
            n += per_arm * (2 + trees * n_drafts * len(self.ks) + hf_arms)
            n += 2 * per_arm * len(self.split_ks)  # split and its paired colocated arm
            n += self.repeats * sum(self._batches(c, per_arm) for c in self.concurrency)  # target-only and spec batches, interleaved
        return n

    def run(self) -> dict:
        t0 = time.time()
        with tqdm(total=self.total_ticks(), desc="bench", unit="arm-prompt", disable=self.args.no_progress) as bar:
            self.bar = bar
            if self.args.suite in ("target", "all"):
                self.target_suite(("fp32", "bf16") if not self.quick else (self.args.dtype,))
            if self.args.suite in ("spec", "all"):
                self.spec_suite()
        return {
            "machine": {"platform": platform.platform(), "threads": torch.get_num_threads(),
                        "torch": torch.__version__},
            "settings": {"target": self.args.target, "draft": self.args.draft, "new_tokens": self.new_tokens,
                         "repeats": self.repeats, "num_prompts": self.num_prompts, "ks": self.ks,
                         "concurrency": self.concurrency, "split_ks": self.split_ks, "quick": self.quick,
                         "dtype": self.args.dtype, "weights": self._weights()},
            "costs": self.costs,
            "arms": self.results,
            "wall_s": time.time() - t0,
        }


def format_table(report: dict) -> str:
    cols = [("arm", 56, "{}"), ("tokens_per_s", 9, "{:.1f}"), ("ttft_ms", 8, "{:.0f}"), ("tpot_ms", 8, "{:.1f}"),
            ("acceptance_rate", 6, "{:.2f}"), ("mean_accepted_length", 6, "{:.2f}"),
            ("speedup_vs_target_only", 7, "{:.2f}x"), ("predicted_speedup", 7, "{:.2f}x"),
            ("ratio_vs_hf_generate", 7, "{:.2f}x"), ("ratio_vs_best_hf_assisted", 7, "{:.2f}x"),
            ("ratio_vs_colocated", 7, "{:.2f}x")]
    heads = ["arm", "tok/s", "TTFT ms", "TPOT ms", "accept", "acc/st", "speedup", "pred", "vs HF", "vs HFa", "vs colo"]
    lines = ["  ".join(h.ljust(w) for h, (_, w, _) in zip(heads, cols))]
    for row in report["arms"]:
        cells = []
        for key, w, fmt in cols:
            v = row.get(key)
            cells.append(("-" if v is None else fmt.format(v)).ljust(w))
        lines.append("  ".join(cells))
    for row in report["arms"]:
        if row.get("k_chosen"):
            total = sum(row["k_chosen"].values())
            lines.append(f"K chosen by the policy, {row['arm']}: "
                         + ", ".join(f"K={k} {100 * n / total:.0f}%" for k, n in row["k_chosen"].items()))
    if report.get("costs"):
        c = report["costs"]
        lines.append(f"draft cost c = {c['c']:.3f} of a target step; verify cost v(k) = "
                     + ", ".join(f"v({k})={v:.2f}" for k, v in c["v"].items()))
    return "\n".join(lines)


def plot(report: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for draft in sorted({r.get("draft") for r in report["arms"] if r.get("speedup_vs_target_only")
                         and r.get("suite") == "spec" and r.get("draft")}):
        rows = [r for r in report["arms"] if r.get("draft") == draft and r.get("speedup_vs_target_only")
                and r.get("mode") != "split" and r.get("role") != "policy" and r.get("suite") == "spec"]
        axes[0].plot([r["k"] for r in rows], [r["speedup_vs_target_only"] for r in rows], marker="o", label=str(draft))
        split = [r for r in report["arms"] if r.get("draft") == draft and r.get("mode") == "split"]
        if split:
            axes[0].plot([r["k"] for r in split], [r["speedup_vs_target_only"] for r in split], "s",
                         label=f"{draft} split gRPC")
        pred = [r for r in rows if r.get("predicted_speedup")]
        if pred:
            axes[0].plot([r["k"] for r in pred], [r["predicted_speedup"] for r in pred], "--", label=f"{draft} predicted")
    axes[0].axhline(1.0, color="gray", lw=0.8)
    axes[0].set(xlabel="K (speculative tokens)", ylabel="speedup vs target-only", title="batch 1")
    axes[0].legend()
    for spec_on in (False, True):
        rows = [r for r in report["arms"] if r.get("suite") == "concurrency" and r.get("speculation") == spec_on]
        axes[1].plot([r["concurrency"] for r in rows], [r["tokens_per_s"] for r in rows], marker="o",
                     label="speculative" if spec_on else "target-only")
    axes[1].set(xlabel="concurrent requests", ylabel="tokens/s (all requests)", title="concurrency", xscale="log")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
