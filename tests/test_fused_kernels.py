"""The fused training kernels (ops/rmsnorm.py, ops/swiglu.py, ops/rotary.py) against their PyTorch twins under Triton's
interpreter (forward and gradients, odd widths, several dtypes), and the module swap of models/fused_layers.py."""

from __future__ import annotations

import copy
import textwrap

import pytest
import torch
from interpreter import run_interpreted

KERNEL_CHECK = textwrap.dedent('''
    import sys
    import torch
    from longrl.ops.rmsnorm import RMSNormFunction, rmsnorm_reference
    from longrl.ops.swiglu import SiluMulFunction, silu_mul_reference, BLOCK

    torch.manual_seed(int(sys.argv[1]))

    def grads(fn, *inputs, dy):
        leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
        out = fn(*leaves)
        out.backward(dy)
        return out.detach(), [t.grad for t in leaves]

    # (the interpreter truncates float32 → 16-bit where a GPU rounds to nearest: 16-bit results within a unit of
    # the last place here; tests/test_memory_gpu.py checks the GPU's rounding against transformers' modules)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for shape in ((3, 5, 48), (7, 100), (1, 1, 1), (2, 257)):
            D = shape[-1]
            x = (torch.randn(shape) * 3).to(dtype)
            w = (1 + 0.3 * torch.randn(D)).to(dtype)
            dy = torch.randn(shape).to(dtype)
            y, (dx, dw) = grads(lambda a, b: RMSNormFunction.apply(a, b, 1e-6), x, w, dy=dy)
            # the twin in float64 for the gradients (autograd's own 16-bit roundings are not the reference)
            y_ref = rmsnorm_reference(x, w, 1e-6)
            _, (dx_ref, dw_ref) = grads(lambda a, b: rmsnorm_reference(a, b, 1e-6), x.double(), w.double(),
                                        dy=dy.double())
            assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
            torch.testing.assert_close(y.float(), y_ref.float(), atol=tol, rtol=tol)
            torch.testing.assert_close(dx.double(), dx_ref, atol=tol * 4, rtol=tol * 4)
            torch.testing.assert_close(dw.double(), dw_ref, atol=tol * 4 * shape[0], rtol=tol * 4)
        for shape in ((5, 37), (BLOCK + 3,), (2, 3, BLOCK // 2 + 1), (1,)):
            g, u = (torch.randn(shape) * 4).to(dtype), torch.randn(shape).to(dtype)
            dh = torch.randn(shape).to(dtype)
            h, (dg, du) = grads(SiluMulFunction.apply, g, u, dy=dh)
            h_ref = silu_mul_reference(g, u)
            _, (dg_ref, du_ref) = grads(silu_mul_reference, g.double(), u.double(), dy=dh.double())
            torch.testing.assert_close(h.float(), h_ref.float(), atol=tol, rtol=tol)
            torch.testing.assert_close(dg.double(), dg_ref, atol=tol * 4, rtol=tol * 4)
            torch.testing.assert_close(du.double(), du_ref, atol=tol * 4, rtol=tol * 4)
    print("fused kernels ok")
''')


ROTARY_CHECK = textwrap.dedent('''
    import sys
    import torch
    from longrl.ops.rotary import RotaryFunction, fusable_rotary, rotary_reference, rotate_half

    swap = lambda x: torch.cat((x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]), -1)  # noqa: E731

    torch.manual_seed(int(sys.argv[1]))

    def run(fn, q, k, cos, sin, gq, gk):
        q, k = q.detach().clone().requires_grad_(True), k.detach().clone().requires_grad_(True)
        oq, ok = fn(q, k, cos, sin)
        torch.autograd.backward((oq, ok), (gq, gk))
        return oq.detach(), ok.detach(), q.grad, k.grad

    def cossin(b, T, D, dtype):
        pos = torch.randint(0, 4000, (b, T)).double()
        freqs = pos[..., None] / 10000 ** (torch.arange(0, D, 2).double() / D)
        emb = torch.cat((freqs, freqs), -1)
        if torch.rand(()) < 0.5:  # halves that differ: the formula's s1 vs s2 and c1 vs c2 are not interchangeable
            emb = emb + torch.randn(emb.shape, dtype=torch.double)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    cases = 0
    for qdtype, cdtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                           (torch.bfloat16, torch.float32), (torch.float16, torch.float16)):
        for B, T, HQ, HK, D, cb in ((2, 5, 6, 2, 8, 1), (1, 9, 4, 4, 128, 1), (3, 7, 5, 1, 10, 3), (1, 1, 1, 1, 2, 1)):
            packed = torch.randn(B, T, (HQ + 2 * HK) * D + 3) * 2  # q and k as views of one packed projection
            q = packed[..., :HQ * D].view(B, T, HQ, D).to(qdtype) if qdtype != torch.float32 else \\
                packed[..., :HQ * D].view(B, T, HQ, D)
            k = packed[..., HQ * D:(HQ + HK) * D].reshape(B, T, HK, D).to(qdtype)
            cos, sin = cossin(cb, T, D, cdtype)
            assert fusable_rotary(q, k, cos, sin)
            odt = torch.promote_types(qdtype, cdtype)
            gq = torch.randn(B, HQ, T, D).to(odt)
            gk = torch.randn(B, T, HK, D).to(odt).transpose(1, 2)  # a gradient in the other layout
            got = run(RotaryFunction.apply, q, k, cos, sin, gq, gk)
            want = run(rotary_reference, q, k, cos, sin, gq, gk)
            # each result's two products' magnitudes (float64): the scale of a 16-bit rounding error in their sum
            C, S = cos.double().abs().unsqueeze(1), sin.double().abs().unsqueeze(1)
            fwd = lambda x: x.abs() * C + rotate_half(x).abs() * S  # noqa: E731
            bwd = lambda g: g.abs() * C + swap(g.abs() * S)  # noqa: E731
            scales = (fwd(q.double().transpose(1, 2)), fwd(k.double().transpose(1, 2)),
                      bwd(gq.double()).transpose(1, 2), bwd(gk.double()).transpose(1, 2))
            for g, w, scale in zip(got, want, scales):
                assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, w.dtype, g.shape, w.shape)
                if qdtype == torch.float32:  # no 16-bit rounding: bit for bit
                    assert torch.equal(g, w), (g - w).abs().max()
                else:  # the interpreter truncates to 16 bits where torch rounds: within two units of the last place
                    err = (g.double() - w.double()).abs()
                    assert (err <= 2 * torch.finfo(qdtype).eps * scale + 1e-6).all(), err.max()
            assert got[0].stride() == want[0].stride() or qdtype != cdtype  # transformers' layout ([B, T, H, D] memory)
            cases += 1
    cos, sin = cossin(1, 4, 8, torch.float32)
    assert not fusable_rotary(torch.randn(1, 4, 2, 16), torch.randn(1, 4, 2, 16), cos, sin)  # partial rotary
    print("rotary ok", cases)
''')


@pytest.mark.parametrize("seed", [0, 1])
def test_rotary_kernel_matches_transformers_formula_under_the_interpreter(seed):
    """Forward and gradients of the fused rotary embedding against the twin (transformers' formula): float32 bit
    for bit, 16-bit within the interpreter's truncation; promoted dtypes, odd and non-power-of-two heads, a
    broadcast or per-row cos/sin, q and k as strided views of one projection, gradients in either layout."""
    pytest.importorskip("triton")
    assert "rotary ok 16" in run_interpreted(ROTARY_CHECK, str(seed))


@pytest.mark.parametrize("seed", [0, 1])
def test_fused_kernels_match_their_twins_under_the_interpreter(seed):
    pytest.importorskip("triton")
    assert "fused kernels ok" in run_interpreted(KERNEL_CHECK, str(seed))


def _tiny_llama():
    from longrl.config.schema import LoraConfig
    from longrl.models import apply_lora, build_tiny_model

    return apply_lora(build_tiny_model(seed=0)[0], LoraConfig(r=4, alpha=8, dropout=0.0))


def test_fused_layers_swap_keeps_names_results_and_composes_with_tiling():
    from longrl.memory.tiling import TiledMLP, disable_mlp_tiling, enable_mlp_tiling
    from longrl.models.fused_layers import FusedRMSNorm, FusedSwiGLU, disable_fused_layers, enable_fused_layers

    model = _tiny_llama()
    layers = model.base_model.model.model.layers
    n_layers = len(layers)
    keys = list(model.state_dict())
    ids = torch.randint(0, 20, (2, 9))
    before = model(ids).logits
    originals = [layers[0].mlp, layers[0].input_layernorm]

    assert enable_mlp_tiling(model, 4) == n_layers  # tiling first, fusing second: the tile runs the fused MLP
    tiled = model(ids).logits  # (tiles may round apart from the whole MLP: GEMMs block rows differently)
    counts = enable_fused_layers(model)
    assert counts == {"rmsnorm": 2 * n_layers + 1, "swiglu": n_layers, "attention": n_layers}
    assert enable_fused_layers(model) == {"rmsnorm": 0, "swiglu": 0, "attention": 0}  # idempotent
    assert isinstance(layers[0].mlp, TiledMLP) and isinstance(layers[0].mlp.inner, FusedSwiGLU)
    assert isinstance(layers[0].input_layernorm, FusedRMSNorm)
    assert layers[0].input_layernorm.weight is originals[1].weight
    # other attributes read through the wrapper (SharedWrapper), also in a copy
    assert copy.deepcopy(layers[0]).input_layernorm.variance_epsilon == originals[1].variance_epsilon
    assert list(model.state_dict()) == keys
    assert torch.equal(model(ids).logits, tiled)  # CPU: the wrapped modules' own forward
    # LoRA parameters reached through the wrapper are the adapters' own
    assert layers[0].mlp.gate_proj is originals[0].gate_proj

    assert disable_mlp_tiling(model) == n_layers and isinstance(layers[0].mlp, FusedSwiGLU)
    assert disable_fused_layers(model) == 2 * n_layers + 1 + 2 * n_layers
    assert layers[0].mlp is originals[0] and layers[0].input_layernorm is originals[1]
    assert torch.equal(model(ids).logits, before)


def test_fused_layers_leave_other_norms_and_activations_alone():
    from longrl.models.fused_layers import enable_fused_layers
    from torch import nn

    class GeluMLP(nn.Module):  # a SwiGLU-shaped MLP with another activation is not fused
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(8, 4)
            self.act_fn = nn.GELU()

    GeluMLP.__name__ = "LlamaMLP"
    model = nn.Sequential(GeluMLP(), nn.LayerNorm(4))
    assert enable_fused_layers(model) == {"rmsnorm": 0, "swiglu": 0, "attention": 0}


def _tiny(arch: str):
    import transformers

    common = dict(vocab_size=50, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    extra = {"Qwen2": dict(use_sliding_window=False), "Qwen3": dict(head_dim=16), "Mistral": dict(sliding_window=6),
             "Llama": dict(attention_bias=True)}[arch]
    cfg = getattr(transformers, f"{arch}Config")(**common, **extra)
    torch.manual_seed(0)
    return getattr(transformers, f"{arch}ForCausalLM")(cfg).float()


@pytest.mark.parametrize("arch", ["Llama", "Qwen2", "Qwen3", "Mistral"])
def test_fused_rotary_attention_forward_is_transformers_own(arch):
    """The attention wrapper's own forward (on the CPU: the rotary twin) gives transformers' logits and gradients
    bit for bit: padded batches with a mask, packed sequences (position ids restarting, no mask), with PEFT
    adapters, Qwen3's per-head norms, Mistral's sliding window; a call with a KV cache (generation) runs the
    wrapped module, and greedy generation is unchanged."""
    from peft import LoraConfig as PeftLora
    from peft import get_peft_model

    from longrl.models.fused_layers import FusedRotaryAttention, disable_fused_layers, enable_fused_layers

    lora = PeftLora(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False)
    model = get_peft_model(_tiny(arch), lora)
    ids = torch.randint(1, 50, (3, 11))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    packed = dict(input_ids=torch.randint(1, 50, (1, 12)), position_ids=torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1,
                                                                                      2, 3]]))

    def run():
        out = []
        for kw in (dict(input_ids=ids, attention_mask=mask), packed):
            model.zero_grad()
            logits = model(**kw, use_cache=False).logits
            (logits.float() * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
            out += [logits.detach()] + [p.grad.clone() for p in model.parameters() if p.requires_grad]
        return out

    want = run()
    gen_want = model.generate(input_ids=ids[:1, :5], max_new_tokens=6, do_sample=False)
    counts = enable_fused_layers(model)
    assert counts["attention"] == 2
    attn = model.base_model.model.model.layers[0].self_attn
    assert isinstance(attn, FusedRotaryAttention)
    got = run()
    assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))
    assert torch.equal(model.generate(input_ids=ids[:1, :5], max_new_tokens=6, do_sample=False), gen_want)
    assert disable_fused_layers(model) == sum(counts.values())


@pytest.mark.parametrize("dtype", ["*bf16", "*fp32"])
def test_fused_kernels_build_for_sm90(dtype):
    """The six kernels compile for an H100/H200 with the launch options rmsnorm()/silu_mul()/rotary() use (ahead of
    time, no GPU: tests/test_kernels_compile.py's helper)."""
    pytest.importorskip("triton")
    from test_kernels_compile import compile_for_sm90

    from longrl.ops import rmsnorm as rn
    from longrl.ops import rotary as ro
    from longrl.ops import swiglu as sw

    for D in (4096, 128, 1000):
        launch = rn._launch(D)
        warps = launch.pop("num_warps")
        compile_for_sm90(rn._rmsnorm_fwd, {"X": dtype, "W": dtype, "Y": dtype, "RSTD": "*fp32", "stride_x": "i64",
                                           "stride_y": "i64", "D": "i32", "eps": "fp32"}, launch, num_warps=warps)
        compile_for_sm90(rn._rmsnorm_bwd, {"DY": dtype, "X": dtype, "W": dtype, "RSTD": "*fp32", "DX": dtype,
                                           "stride_dy": "i64", "stride_x": "i64", "stride_dx": "i64", "D": "i32"},
                         launch, num_warps=warps)
    compile_for_sm90(sw._silu_mul_fwd, {"G": dtype, "U": dtype, "H": dtype, "N": "i64"}, {"BLOCK": sw.BLOCK},
                     num_warps=8)
    compile_for_sm90(sw._silu_mul_bwd, {"DH": dtype, "G": dtype, "U": dtype, "DG": dtype, "DU": dtype, "N": "i64"},
                     {"BLOCK": sw.BLOCK}, num_warps=8)
    ints = ("T", "HQ", "HK", "sq_b", "sq_t", "sq_h", "sk_b", "sk_t", "sk_h", "sqo_b", "sqo_t", "sqo_h", "sko_b",
            "sko_t", "sko_h", "sc_b", "sc_t", "ss_b", "ss_t")
    for backward in (False, True):  # the 8B shape's heads; no product contracted into the sum (exact rounding)
        kernel = compile_for_sm90(
            ro._rotary_kernel, {**{n: dtype for n in ("Q", "K", "COS", "SIN", "QO", "KO")}, **{n: "i32" for n in ints}},
            dict(HALF=64, HALF_P2=64, HQ_P2=32, HK_P2=8, BACKWARD=backward), num_warps=4, enable_fp_fusion=False)
        assert "fma.rn.f32" not in kernel.asm["ptx"]
