"""On the GPU: the FP8 KV kernels against their PyTorch twins (bf16 queries, odd and block-crossing shapes), the
sampler's FP8 rollouts within their tolerance of the model, the budget's allocator cap, and a whole tiny run with
the auto layout, a budget and an FP8 cache."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


MMA = dict(fp8_mma=True, block=64, warps=4, fp8_prefetch=False)  # (the e4m3 products load exponents ahead anyway)


def test_fp8_store_and_decode_kernels_equal_their_twins_on_cuda():
    from longrl.rollout.attention import decode_attention_reference
    from longrl.rollout.decode_kernel import FP8_F16_LAUNCH, decode_attention_triton
    from longrl.rollout.kv_quant import FP8, quantize_reference, quantize_values, store_decode, value_capacity

    dev = torch.device("cuda")
    torch.manual_seed(0)
    for (B, S, H, T, D) in [(5, 7, 3, 11, 24), (16, 16, 8, 33, 128), (3, 4, 2, 5, 80)]:
        k = (torch.randn(B, H, D, device=dev) * torch.logspace(-6, 4, B * H, device=dev).view(B, H, 1)).bfloat16()
        v = torch.randn(B, H, D, device=dev).bfloat16()
        idx = torch.randint(0, T, (B,), device=dev)
        caches = [[torch.zeros(S, H, T, D, dtype=FP8, device=dev),
                   torch.zeros(S, H, D, value_capacity(T), dtype=FP8, device=dev),  # values position-minor
                   torch.zeros(S, H, T, dtype=torch.int8, device=dev), torch.zeros(S, H, T, dtype=torch.int8,
                                                                               device=dev)] for _ in range(2)]
        for c, tri in zip(caches, (False, True)):
            store_decode(k, v, *c, idx, tri)
        for a, b in zip(*caches):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    for (P, S, Hq, Hkv, Lp, T, D) in [(3, 7, 8, 2, 77, 1031, 64), (2, 16, 32, 8, 512, 4100, 128),
                                      (1, 3, 4, 4, 1, 1, 128), (2, 5, 6, 2, 1100, 65, 80)]:
        raw = [torch.randn(P, Hkv, Lp, D, device=dev), torch.randn(P, Hkv, Lp, D, device=dev),
               torch.randn(S, Hkv, T, D, device=dev) * 4, torch.randn(S, Hkv, T, D, device=dev)]
        (kp, kpe), (ks, kse) = quantize_reference(raw[0].bfloat16()), quantize_reference(raw[2].bfloat16())
        # values position-minor: whole blocks (value_capacity, finite codes in the padding: the unmasked 16-byte
        # loads) and a capacity of exactly the positions (masked), which must agree bit for bit
        (vp, vpe), (vs, vse) = quantize_values(raw[1].bfloat16()), quantize_values(raw[3].bfloat16())
        for whole, n in ((vp, Lp), (vs, T)):
            pad = torch.randint(0, 0x7F, whole[..., n:].shape, dtype=torch.uint8, device=dev)  # 0x7F is NaN
            whole[..., n:] = (pad | (torch.randint(0, 2, pad.shape, dtype=torch.uint8, device=dev) << 7)).view(FP8)
        vp_exact, vs_exact = quantize_values(raw[1].bfloat16(), Lp)[0], quantize_values(raw[3].bfloat16(), T)[0]
        q = torch.randn(S, Hq, D, device=dev).bfloat16()
        pidx = torch.randint(0, P, (S,), device=dev)
        slen = torch.randint(1, T + 1, (S,), device=dev)
        members = torch.full((P, S), -1, dtype=torch.long, device=dev)
        members[pidx, torch.arange(S, device=dev)] = torch.arange(S, device=dev)
        entry_len = torch.full((P,), Lp, device=dev)
        exp = (kpe, vpe, kse, vse)
        args = (q, kp, vp, pidx, entry_len[pidx], ks, vs, slen, D ** -0.5)
        ref = decode_attention_reference(*args, kv_exp=exp).float()
        bf16_products = dict(FP8_F16_LAUNCH, fp8_f16=False, fp8_prefetch=False)
        f16_products = dict(FP8_F16_LAUNCH, fp8_prefetch=False)
        for kw in (dict(launch=bf16_products), dict(members=members, prompt_len=entry_len, launch=bf16_products),
                   dict(members=members, prompt_len=entry_len, launch=f16_products),
                   dict(launch=dict(f16_products, block=64, warps=4)),  # float16 products
                   dict(launch=MMA), dict(members=members, prompt_len=entry_len, launch=MMA)):  # e4m3 products
            out = decode_attention_triton(*args, **kw, kv_exp=exp).float()
            err = float((out - ref).norm() / ref.norm())
            assert err < 1e-2, (P, S, T, D, err)  # bf16 operands, float32 accumulation
            # the exponents loaded one block ahead (launch fp8_prefetch; on by default, FP8_LAUNCH): the same
            # compiled arithmetic, bit for bit
            ahead = decode_attention_triton(*args, **{**kw, "launch": {**kw["launch"], "fp8_prefetch": True}},
                                            kv_exp=exp).float()
            assert torch.equal(ahead, out), (P, S, T, D, kw.keys())
            exact = decode_attention_triton(q, kp, vp_exact, pidx, entry_len[pidx], ks, vs_exact, slen, D ** -0.5,
                                            **kw, kv_exp=exp).float()
            assert torch.equal(exact, out), (P, S, T, D, kw.keys())


def test_fp8_decode_in_blocks_of_128_equals_its_twin_on_cuda():
    """The default launch (FP8_LAUNCH: e4m3 products in blocks of 128 keys), on value stores of whole 128-position
    blocks and on stores of 64-position blocks (where a kernel falls back to blocks of 64), against the twin; the
    shared-memory operand and 8-warp launches against it."""
    from longrl.rollout.attention import decode_attention_reference
    from longrl.rollout.decode_kernel import decode_attention_triton
    from longrl.rollout.kv_quant import quantize_reference, quantize_values

    dev = torch.device("cuda")
    torch.manual_seed(1)
    for (P, S, Hq, Hkv, Lp, T, D) in [(3, 7, 8, 2, 77, 1031, 64), (2, 16, 32, 8, 512, 4100, 128),
                                      (2, 5, 6, 2, 1100, 65, 80)]:
        raw = [torch.randn(P, Hkv, Lp, D, device=dev), torch.randn(P, Hkv, Lp, D, device=dev),
               torch.randn(S, Hkv, T, D, device=dev) * 4, torch.randn(S, Hkv, T, D, device=dev)]
        (kp, kpe), (ks, kse) = quantize_reference(raw[0].bfloat16()), quantize_reference(raw[2].bfloat16())
        q = torch.randn(S, Hq, D, device=dev).bfloat16()
        pidx = torch.randint(0, P, (S,), device=dev)
        slen = torch.randint(1, T + 1, (S,), device=dev)
        members = torch.full((P, S), -1, dtype=torch.long, device=dev)
        members[pidx, torch.arange(S, device=dev)] = torch.arange(S, device=dev)
        entry_len = torch.full((P,), Lp, device=dev)
        for align in (128, 64):
            cap = lambda n: -(-n // align) * align  # noqa: E731
            (vp, vpe), (vs, vse) = (quantize_values(raw[1].bfloat16(), cap(Lp)),
                                    quantize_values(raw[3].bfloat16(), cap(T)))
            args = (q, kp, vp, pidx, entry_len[pidx], ks, vs, slen, D ** -0.5)
            exp = (kpe, vpe, kse, vse)
            ref = decode_attention_reference(*args, kv_exp=exp).float()
            for kw in (dict(), dict(members=members, prompt_len=entry_len)):
                out = decode_attention_triton(*args, **kw, kv_exp=exp).float()
                assert float((out - ref).norm() / ref.norm()) < 1e-2, (P, S, T, D, align, kw.keys())
                # the same products from shared-memory tiles (fp8_ss) or over 8 warps: float32 summation order apart
                for other in (dict(fp8_ss=True), dict(warps=8), dict(fp8_ss=True, warps=8, stages=2),
                              dict(maxnreg=168)):
                    alt = decode_attention_triton(*args, **kw, kv_exp=exp, launch=other).float()
                    torch.testing.assert_close(alt, out, atol=2e-3, rtol=2e-3, msg=lambda m: f"{other}: {m}")


def test_budget_caps_the_allocator():
    from longrl.config import load_config
    from longrl.memory.layout import cap_allocator

    dev = torch.device("cuda")
    cfg = load_config(overrides=["train.gpu_memory_gib=2", "rewards=[{function: 'longrl.tasks.arithmetic:format_reward'}]"])
    try:
        torch.cuda.empty_cache()
        assert cap_allocator(cfg, dev) == pytest.approx(2 * 2 ** 30 / torch.cuda.get_device_properties(dev).total_memory)
        x = torch.empty(2 ** 30, dtype=torch.uint8, device=dev)  # 1 GiB fits
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(3 * 2 ** 30, dtype=torch.uint8, device=dev)  # past the budget
        del x
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, torch.cuda.current_device())
        torch.cuda.empty_cache()


def test_tiny_run_with_auto_layout_budget_and_fp8_cache(tmp_path):
    from longrl.config import load_config
    from longrl.config.demo import demo_config
    from longrl.compat.trl import GRPOTrainer

    cfg = load_config(None, ["model.device=cuda", "model.dtype=bfloat16", "lora.enabled=true", "grpo.beta=0.04",
                             "train.max_steps=2", "train.prompts_per_step=4", "grpo.num_generations=4",
                             "train.gpu_memory_gib=4", "generation.kv_cache_dtype=fp8", "output.progress_bar=false",
                             "output.tensorboard=false", f"output.output_dir={tmp_path}"], base=demo_config())
    try:
        trainer = GRPOTrainer(cfg)
        assert trainer.layout.plan is not None and trainer.layout.plan.budget_bytes == 4 * 2 ** 30
        history = trainer.train()
        assert trainer.sampler.cache_dtype == torch.float8_e4m3fn
        for m in history:
            assert m["sampler/is_weight_mean"] <= cfg.grpo.rollout_correction_cap
            assert max(m[k] for k in m if k.endswith("_peak_gib")) <= 4
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, torch.cuda.current_device())
