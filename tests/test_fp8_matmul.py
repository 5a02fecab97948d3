"""The FP8 kernels against their twins through Triton's interpreter (a subprocess: TRITON_INTERPRET must be set before
triton is imported): the block dequantization bit for bit, the grouped decode product (rows 1 to 33, K and N not
multiples of 128, three weights with 16-bit rows and biases, K splits) against the exact product of the dequantized
weights, and the sampler's decode steps with the FP8 product against the FP8 layers' own forward. The interpreter's
bfloat16 products are wrong (it runs them on raw bits), so products are checked in float16; bfloat16 runs on the GPU
(benchmarks/nf4_matmul.py --fp8)."""

import textwrap

import pytest
import torch
from interpreter import run_interpreted

from longrl.ops.fp8_blocks import quantize_fp8_blocks
from longrl.ops.fp8_matmul import fp8_group, fp8_group_linear, fp8_group_weight, fp8_groupable

DEQUANTIZE_CHECK = textwrap.dedent('''
    import torch
    from longrl.ops import fp8_blocks as fb

    for N, K in [(1, 1), (3, 200), (130, 129), (257, 384), (128, 256)]:
        torch.manual_seed(N + K)
        q, s = fb.quantize_fp8_blocks(torch.randn(N, K) * 3)
        for dtype in (torch.float32, torch.float16):
            got = fb.dequantize_fp8(q, s, dtype, use_triton=True)
            assert got.dtype == dtype and torch.equal(got, fb.dequantize_fp8_reference(q, s, dtype)), (N, K, dtype)
        # the interpreter casts float32 to bfloat16 by truncation (the GPU and torch round to nearest: bit for bit
        # in tests/test_fp8_gpu.py): within one bfloat16 ulp here
        got, want = fb.dequantize_fp8(q, s, torch.bfloat16, use_triton=True), fb.dequantize_fp8_reference(q, s,
                                                                                                        torch.bfloat16)
        assert ((got.float() - want.float()).abs() <= 2 ** -7 * want.float().abs()).all(), (N, K)
    print("dequantize ok")
''')


def test_dequantize_kernel_equals_its_twin_bit_for_bit():
    """float32 and float16 bit for bit through the interpreter (bfloat16 on the GPU: tests/test_fp8_gpu.py)."""
    assert "dequantize ok" in run_interpreted(DEQUANTIZE_CHECK)


PRODUCT_CHECK = textwrap.dedent('''
    import torch
    from longrl.ops import fp8_blocks as fb, fp8_matmul as fm

    worst = 0.0
    # (rows of each FP8 weight, K, rows of x, 16-bit rows after them, biases, launch override): q/k/v-like groups
    # whose row tiles shrink to the weights' boundaries (48 rows), K not a multiple of 128 (masked chunks), K splits
    # (few programs: several chunks a split; many: one split a chunk), one weight alone, rows 1, 3, 17, 33
    cases = [([48, 32, 70], 300, 3, 5, True, None),
             ([130], 129, 17, 0, False, None),
             ([64, 64], 1280, 1, 3, False, dict(programs=4)),
             ([96], 700, 33, 0, True, dict(bn=32, programs=64)),
             ([128, 16, 16], 257, 17, 7, True, dict(bn=128, programs=1000)),
             ([200], 384, 1, 0, False, None),
             # f16: float16 codes times float16(x · p), the scales after: the product with the unrounded weights
             ([48, 32, 70], 300, 3, 5, True, dict(f16=True)),
             ([64, 64], 1280, 17, 3, False, dict(f16=True, programs=4)),
             ([200], 384, 1, 0, False, dict(f16=True, bn=32))]
    for rows, K, M, R, bias, launch in cases:
        torch.manual_seed(K + M)
        ws = [fb.quantize_fp8_blocks(torch.randn(n, K) * 0.1) for n in rows]
        dense = torch.randn(R, K, dtype=torch.float16) if R else None
        biases = [torch.randn(n, dtype=torch.float16) if i != 1 else None for i, n in enumerate(rows)] if bias else None
        g = fm.fp8_group([q for q, _ in ws], [s for _, s in ws], dense, biases)
        x = torch.randn(2, M, K, dtype=torch.float16)
        f16 = bool(launch and launch.get("f16"))
        if f16:
            x[0, 0] *= 2 ** -8  # a row far below the others: its own power of two
        got = fm.fp8_group_linear(x, g, launch=launch)
        assert got.shape == (2, M, sum(rows) + R) and got.dtype == torch.float16
        weights = torch.float32 if f16 else torch.float16  # f16: the weights unrounded
        exact = x.double() @ fm.fp8_group_weight(g, weights).double().t()
        if bias:
            exact += g.bias.double()
        floor = torch.full_like(exact, 1e-2)
        if f16 and not bias:
            floor[0, 0] *= 2 ** -8  # the small row to its own scale
        err = ((got.double() - exact).abs() / (exact.abs() + floor)).max().item()
        worst = max(worst, err)
        assert err <= 2 ** -9, (rows, K, M, err)  # float32 sums, one float16 rounding at the end
        twin = fm.fp8_group_reference(x.float(), g)  # the twin itself in float32 (weights not rounded to float16)
        exact32 = x.double() @ fm.fp8_group_weight(g, torch.float32).double().t()
        if bias:
            exact32 += g.bias.double()
        assert ((twin.double() - exact32).abs() <= 1e-5 * (1 + exact32.abs())).all()
    print("product ok", worst)
''')


def test_group_product_equals_its_twin_on_odd_and_block_crossing_shapes():
    assert "product ok" in run_interpreted(PRODUCT_CHECK)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_float16_rows_keep_every_value_a_row_holds_above_2_to_the_minus_28_of_its_largest(dtype):
    """The f16 choice's x: float16(x · p) with p a power of two a row (pow2_scale_reference): no overflow for rows up
    to 10³⁰ (bf16, float32), rows of zeros and of 10⁻³⁰ kept, and x · p / p = x exactly for every value ≥ 2⁻²⁸ of
    its row's largest (bf16 and float16 values have at most 11 significant bits; the float32 row's values are
    rounded to 11, as float16 does)."""
    from longrl.ops.fp8_matmul import float16_rows_reference

    torch.manual_seed(0)
    x = torch.randn(6, 300).to(dtype)
    big = 1e30 if dtype != torch.float16 else 1e4
    x[0] *= big
    x[1] = 0
    x[2] *= 1e-30 if dtype != torch.float16 else 1e-3
    x[3, :5] = torch.tensor([1.0, 2.0 ** -28, 1.25 * 2.0 ** -28, 1.234375 * 2.0 ** -35, -3.0]).to(dtype)
    x16, inv_p = float16_rows_reference(x)
    assert x16.dtype == torch.float16 and torch.isfinite(x16).all() and x16.abs().max() < 2 ** 15
    back = x16.double() * inv_p.double()[:, None]
    keep = x.double().abs() >= 2.0 ** -28 * x.double().abs().amax(1, keepdim=True)
    want = x.double()
    if dtype == torch.float32:  # its values rounded to float16's significand at their row's scale
        want = (x.double() / inv_p.double()[:, None]).to(torch.float16).double() * inv_p.double()[:, None]
    assert torch.equal(back[keep], want[keep])
    assert torch.equal(back[1], torch.zeros(300, dtype=torch.float64))
    if dtype != torch.float16:  # (in float16 itself that value is 0)
        assert back[3, 3] != x[3, 3].double()  # 8 significant bits at 2⁻³⁶ of the row's largest: some lost


POW2_CHECK = textwrap.dedent('''
    import torch, triton, triton.language as tl
    from longrl.ops import fp8_matmul as fm

    @triton.jit
    def scale_kernel(A, P, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(P + i, fm._pow2_scale(tl.load(A + i, mask=i < n, other=0.0)), mask=i < n)

    torch.manual_seed(0)
    amax = torch.cat([torch.tensor([0.0, 1e-45, 1e-40, 2.0 ** -126, 2.0 ** -100, 0.5, 0.75, 1.0, 2.0, 65504.0, 1e30,
                                    3.4e38]), torch.rand(100) * 10.0 ** torch.randint(-30, 30, (100,)).float()])
    got = torch.empty_like(amax)
    scale_kernel[(1,)](amax, got, amax.numel(), BLOCK=128)
    want = fm.pow2_scale_reference(amax)
    assert torch.equal(got, want), (amax[got != want], got[got != want], want[got != want])
    assert ((amax * want) < 2 ** 15).all() and ((1 / want) > 0).all()
    print("pow2 ok")
''')


def test_in_kernel_power_of_two_equals_its_twin():
    """The f16 choice's p from the float's bits in the kernel equals pow2_scale_reference, for 0, subnormals, the
    ends of float32's range and random magnitudes (Triton's interpreter)."""
    assert "pow2 ok" in run_interpreted(POW2_CHECK)


def test_groupable_reasons_and_the_twin_without_triton():
    q, s = quantize_fp8_blocks(torch.randn(40, 64))
    q2, s2 = quantize_fp8_blocks(torch.randn(32, 64))
    assert fp8_groupable([q, q2], [s, s2]) is not None  # 40 rows: not a multiple of 16 before the last
    assert fp8_groupable([q2, q], [s2, s]) is None
    assert "float8" in fp8_groupable([q.float()], [s])
    assert "scales" in fp8_groupable([q], [s.t().contiguous().repeat(1, 2)])
    with pytest.raises(ValueError, match="fp8_group"):
        fp8_group([q, q2], [s, s2])
    g = fp8_group([q2, q], [s2, s], torch.randn(3, 64), [None, torch.randn(40)])
    x = torch.randn(5, 64)
    want = torch.nn.functional.linear(x, fp8_group_weight(g, torch.float32), g.bias)
    assert torch.equal(fp8_group_linear(x, g, use_triton=False), want)
    assert torch.equal(fp8_group_linear(x, g), want)  # float32 input: the twin


SAMPLER_CHECK = textwrap.dedent('''
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from longrl.config.schema import LoraConfig
    from longrl.models import apply_lora
    from longrl.models.fp8 import quantize_model_fp8
    from longrl.rollout import Sampler, SamplingParams

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=128, intermediate_size=208, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg).to(torch.float16).eval()
    quantize_model_fp8(model, torch.randint(0, 97, (2, 16)), exception_budget=0.0)
    model = apply_lora(model, LoraConfig(r=4, alpha=8.0))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    runs = []
    for fp8 in (False, True):
        sampler = Sampler(model, None, fp8_kernel=fp8)
        sampler.use_triton = True  # the fused decode kernels through the interpreter
        r = sampler.generate(prompts, 2, SamplingParams(max_new_tokens=6, temperature=0))
        runs.append((r, sampler.last_stats))
    (plain, s0), (fast, s1) = runs
    assert s0["fp8_projections"] == 0 and s1["fp8_projections"] == 7 * 2, (s0, s1)
    assert s1["nf4_projections"] == 0 and s1["packed_groups"] == 4 * 2, s1  # q/k/v + A, o + A, gate/up + A, down + A
    assert s1["lora_fused"] and s1["fast_decode"]
    assert fast.completion_ids == plain.completion_ids, (fast.completion_ids, plain.completion_ids)
    a = torch.tensor(sum(fast.logprobs, [])); b = torch.tensor(sum(plain.logprobs, []))
    assert (a - b).abs().max() < 2e-2, (a - b).abs().max()
    print("sampler ok")
''')


def test_sampler_with_the_fp8_product_equals_the_layers_forward():
    """A LoRA model on an FP8 base: decode steps through the grouped FP8 products (each layer's q/k/v, o, gate/up
    (208 rows: K of down_proj not a multiple of 128) and down with their LoRA A rows, the B products folded into the
    glue kernels) give the tokens (greedy) and log-probs of the FP8 layers' own forward (dequantize, then multiply:
    the fallback), float16 through the interpreter."""
    assert "sampler ok" in run_interpreted(SAMPLER_CHECK)
