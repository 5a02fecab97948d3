"""Multi-turn rollout speed: turns continued on their own KV caches vs single-turn rollouts of the same total length,
and the history re-prefill that a re-prefill-every-turn rollout (peers' external inference servers) pays.

Random-weight model of a real shape in bf16 with LoRA r=32 (unmerged, as in training), P prompts × G episodes of
``--turns`` turns: each turn samples exactly ``--new-tokens`` tokens (EOS ignored), then its environment (instant,
no tool latency) answers with ``--tool-tokens`` random tokens, which the sampler prefills onto the sequence's own
cache before the next turn. Three measurements in one run:

- multi-turn: longrl's sampler with MultiTurn (after a warm-up run of the same call: compiles and captures);
- single-turn: every sequence samples the whole trajectory's length (turns × new + (turns − 1) × tool tokens);
- re-prefill baseline: the prefill of each later turn's whole history (prompt + earlier turns + tool outputs) as a
  new prompt, as a rollout that re-prefills every turn must do (timed as prefill + first token, max_new_tokens=1);
  the continuation re-prefills no history (0 s) and prefills only the tool tokens (its ``resume_s``).

    python benchmarks/multiturn_speed.py --shape llama-3.1-8b --prompts 16 --G 8 --turns 4 --tool-tokens 200 \\
        --new-tokens 512 --prompt-len 512
    python benchmarks/multiturn_speed.py --shape tiny --prompts 2 --G 2 --turns 3 --tool-tokens 5 --new-tokens 8 \\
        --prompt-len 16          # CPU smoke run
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from bench_setup import add_shape_args, random_model, random_prompts, sync  # noqa: E402
from results_io import card_tag, run_meta, write_result  # noqa: E402

from longrl.rollout import Sampler, SamplingParams  # noqa: E402
from longrl.rollout.sampler import MultiTurn  # noqa: E402

class InstantTools:
    """Answers each of the first turns − 1 turns with ``tokens`` random ids (seeded by sequence and turn)."""

    def __init__(self, turns: int, tokens: int, vocab: int):
        self.turns, self.tokens, self.vocab, self.count = turns, tokens, vocab, {}

    def reply(self, seq: int, k: int) -> list[int]:
        g = torch.Generator().manual_seed(1000 * seq + k)
        return torch.randint(3, self.vocab, (self.tokens,), generator=g).tolist()

    def step(self, seq, tokens, room):
        k = self.count.get(seq, 0) + 1
        self.count[seq] = k
        return None if k >= self.turns else self.reply(seq, k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_args(ap, prompts=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--tool-tokens", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = random_model(args.shape, dev, lora=True)
    vocab = model.config.vocab_size
    prompts = random_prompts(args.prompts, args.prompt_len, vocab)
    P, G, K, N, E = args.prompts, args.G, args.turns, args.new_tokens, args.tool_tokens
    total = K * N + (K - 1) * E  # tokens after the prompt per trajectory
    sampler = Sampler(model, None)
    params = SamplingParams(max_new_tokens=N, temperature=1.0, seed=0)
    results: dict = {}

    def multi_turn():
        tools = InstantTools(K, E, vocab)
        sync()
        t = time.perf_counter()
        out = sampler.generate(prompts, G, params, MultiTurn(tools, max_tokens=total, workers=8))
        sync()
        return out, time.perf_counter() - t, dict(sampler.last_stats), tools

    multi_turn()  # warm-up: the same call (Triton compiles specialise on the slot store's length and the batch)
    out, seconds, stats, tools = multi_turn()
    assert all(len(c) == total for c in out.completion_ids), "every trajectory runs its turns in full"
    sampled = sum(sum(m) for m in out.env_mask)
    results["multi-turn"] = dict(seconds=seconds, trajectory_tokens_per_s=P * G * total / seconds,
                                 sampled_tokens_per_s=sampled / seconds, resume_s=stats["resume_s"],
                                 resumes=stats["resumes"], resume_forwards=stats["resume_forwards"],
                                 resume_tokens=stats["resume_tokens"], env_wait_s=stats["env_wait_s"],
                                 history_reprefill_s=0.0, decode_steps=stats["decode_steps"],
                                 kv_cache_gib=stats["kv_cache_bytes"] / 2**30)
    print("multi-turn", results["multi-turn"], flush=True)
    sync()
    t = time.perf_counter()
    single = sampler.generate(prompts, G, SamplingParams(max_new_tokens=total, temperature=1.0, seed=0))
    sync()
    s = time.perf_counter() - t
    assert all(len(c) == total for c in single.completion_ids)
    results["single-turn"] = dict(seconds=s, trajectory_tokens_per_s=P * G * total / s,
                                  sampled_tokens_per_s=P * G * total / s)
    print("single-turn", results["single-turn"], flush=True)
    # re-prefill baseline: before turn k (k ≥ 2) each sequence's whole history is a new prompt
    reprefill = []
    for k in range(2, K + 1):
        histories = []
        for seq in range(P * G):
            upto = (k - 1) * N + (k - 1) * E  # the history: k − 1 turns and their tool outputs
            histories.append(out.prompt_ids[seq] + out.completion_ids[seq][:upto])
        sync()
        t = time.perf_counter()
        sampler.generate(histories, 1, SamplingParams(max_new_tokens=1, temperature=1.0, seed=0))
        sync()
        reprefill.append(dict(turn=k, history_tokens=len(histories[0]), seconds=time.perf_counter() - t))
        print("re-prefill before turn", reprefill[-1], flush=True)
    results["re-prefill baseline"] = dict(per_turn=reprefill, history_reprefill_s=sum(r["seconds"] for r in reprefill),
                                          history_tokens=sum(r["history_tokens"] for r in reprefill) * P * G)
    write_tables(args, results, total)


def write_tables(args, results, total) -> None:
    meta = run_meta(shape=args.shape, prompts=args.prompts, G=args.G, prompt_len=args.prompt_len, turns=args.turns,
                    tool_tokens=args.tool_tokens, new_tokens=args.new_tokens, trajectory_tokens=total)
    stem = f"multiturn_speed_{args.shape}_{card_tag()}{args.tag}"
    m, s, b = results["multi-turn"], results["single-turn"], results["re-prefill baseline"]
    lines = [f"# Multi-turn rollout speed, {args.shape} shape (random weights, bf16, LoRA r=32 unmerged), {meta['gpu']}",
             "", f"{meta['date']}; torch {meta['torch']}, transformers {meta['transformers']}.  ", f"`{meta['command']}`",
             "", f"{args.prompts} prompts × {args.G} episodes, prompt {args.prompt_len} tokens, {args.turns} turns of "
             f"exactly {args.new_tokens} sampled tokens, {args.tool_tokens} tool tokens after each but the last "
             f"({total} tokens after the prompt), temperature 1, instant environment.", "",
             "| rollout | seconds | trajectory tokens/s | sampled tokens/s | history re-prefilled (s) | tool tokens "
             "prefilled (s) |", "|---|---|---|---|---|---|",
             f"| multi-turn, caches kept | {m['seconds']:.2f} | {m['trajectory_tokens_per_s']:,.0f} | "
             f"{m['sampled_tokens_per_s']:,.0f} | 0 | {m['resume_s']:.2f} ({m['resume_forwards']} forwards) |",
             f"| single-turn, same length | {s['seconds']:.2f} | {s['trajectory_tokens_per_s']:,.0f} | "
             f"{s['sampled_tokens_per_s']:,.0f} | – | – |",
             f"| re-prefill every turn (prefill only) | – | – | – | {b['history_reprefill_s']:.2f} "
             f"({b['history_tokens']:,} tokens) | – |", "",
             "Re-prefill baseline: before each later turn, every sequence's whole history (prompt + earlier turns + "
             "tool outputs) prefilled as a new prompt by the same sampler (prefill + first token, max_new_tokens=1), "
             "as a rollout through an external inference server re-prefills it; per turn: "
             + ", ".join(f"turn {r['turn']}: {r['history_tokens']} tokens, {r['seconds']:.2f} s" for r in b["per_turn"])
             + ". Its decoding would equal the multi-turn row's. multi-turn: after a warm-up run of the same call; "
             f"time waiting on environments {m['env_wait_s']:.3f} s; KV cache {m['kv_cache_gib']:.2f} GiB."]
    write_result(stem, {**meta, "results": results}, lines)


if __name__ == "__main__":
    main()
