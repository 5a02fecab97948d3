"""The fused training kernels (ops/rmsnorm.py, ops/swiglu.py) against their PyTorch twins under Triton's
interpreter (forward and gradients, odd widths, several dtypes), and the module swap of models/fused_layers.py."""

from __future__ import annotations

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


@pytest.mark.parametrize("seed", [0, 1])
def test_fused_kernels_match_their_twins_under_the_interpreter(seed):
    pytest.importorskip("triton")
    assert "fused kernels ok" in run_interpreted(KERNEL_CHECK, str(seed))


def _tiny_llama():
    from longrl.config import LoraConfig
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
    assert counts == {"rmsnorm": 2 * n_layers + 1, "swiglu": n_layers}
    assert enable_fused_layers(model) == {"rmsnorm": 0, "swiglu": 0}  # idempotent
    assert isinstance(layers[0].mlp, TiledMLP) and isinstance(layers[0].mlp.inner, FusedSwiGLU)
    assert isinstance(layers[0].input_layernorm, FusedRMSNorm)
    assert layers[0].input_layernorm.weight is originals[1].weight
    assert list(model.state_dict()) == keys
    assert torch.equal(model(ids).logits, tiled)  # CPU: the wrapped modules' own forward
    # LoRA parameters reached through the wrapper are the adapters' own
    assert layers[0].mlp.gate_proj is originals[0].gate_proj

    assert disable_mlp_tiling(model) == n_layers and isinstance(layers[0].mlp, FusedSwiGLU)
    assert disable_fused_layers(model) == 2 * n_layers + 1 + n_layers
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
    assert enable_fused_layers(model) == {"rmsnorm": 0, "swiglu": 0}


@pytest.mark.parametrize("dtype", ["*bf16", "*fp32"])
def test_fused_kernels_build_for_sm90(dtype):
    """The four kernels compile for an H100/H200 with the launch options rmsnorm()/silu_mul() use (ahead of time,
    no GPU: tests/test_kernels_compile.py's helper)."""
    pytest.importorskip("triton")
    from test_kernels_compile import compile_for_sm90

    from longrl.ops import rmsnorm as rn
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
