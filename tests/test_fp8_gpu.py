"""On the GPU: the FP8 kernels in bfloat16 against their twins (the dequantization bit for bit, the grouped decode
product within float32 summation order and one bfloat16 rounding), an FP8 base's forward and backward against the
twin, and a QLoRA-style FP8 rollout equal to the FP8 layers' own forward."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_dequantize_and_group_product_in_bfloat16():
    from longrl.ops import fp8_blocks as fb
    from longrl.ops import fp8_matmul as fm

    dev = torch.device("cuda")
    torch.manual_seed(0)
    for N, K in [(3, 200), (130, 129), (4096, 4096), (1024, 14336)]:
        q, s = fb.quantize_fp8_blocks(torch.randn(N, K, device=dev, dtype=torch.bfloat16))
        assert torch.equal(fb.dequantize_fp8(q, s, torch.bfloat16), fb.dequantize_fp8_reference(q, s, torch.bfloat16))
    for rows, K, M, R in [([4096, 1024, 1024], 4096, 1, 96), ([14336, 14336], 4096, 17, 64), ([4096], 14336, 32, 0),
                          ([130], 129, 3, 5)]:
        ws = [fb.quantize_fp8_blocks(torch.randn(n, K, device=dev) * 0.02) for n in rows]
        dense = torch.randn(R, K, device=dev, dtype=torch.bfloat16) if R else None
        g = fm.fp8_group([q for q, _ in ws], [s for _, s in ws], dense)
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        got = fm.fp8_group_linear(x, g).float()
        exact = x.double() @ fm.fp8_group_weight(g, torch.bfloat16).double().t()
        scale = (x.double().abs() @ fm.fp8_group_weight(g, torch.bfloat16).double().abs().t())
        assert ((got - exact).abs() <= 2 ** -8 * exact.abs() + 2 ** -12 * scale + 1e-3).all(), (rows, K, M)


def test_f16_group_product_with_activations_far_outside_float16():
    """The f16 launch choice on float16 tensor cores: rows of x up to 3·10⁶ and down to 10⁻⁶ (float16's range is
    6·10⁻⁵ … 65504) give the product with the unrounded weights q · s, within float32 summation order and one bf16
    rounding, as the default does with its rounded ones."""
    from longrl.ops import fp8_blocks as fb
    from longrl.ops import fp8_matmul as fm

    dev = torch.device("cuda")
    torch.manual_seed(1)
    for rows, K, M, R in [([4096, 1024, 1024], 4096, 8, 96), ([4096], 14336, 32, 0), ([130], 129, 3, 5)]:
        ws = [fb.quantize_fp8_blocks(torch.randn(n, K, device=dev) * 0.02) for n in rows]
        dense = torch.randn(R, K, device=dev, dtype=torch.bfloat16) if R else None
        g = fm.fp8_group([q for q, _ in ws], [s for _, s in ws], dense)
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        x[0] *= 1e6
        x[-1] *= 1e-6
        got = fm.fp8_group_linear(x, g, launch=dict(f16=True)).float()
        assert torch.isfinite(got).all()
        W = fm.fp8_group_weight(g, torch.float32).double()
        exact = x.double() @ W.t()
        scale = x.double().abs() @ W.abs().t()
        assert ((got - exact).abs() <= 2 ** -8 * exact.abs() + 2 ** -12 * scale).all(), (rows, K, M)


def test_fp8_linear_forward_and_backward_on_cuda():
    from longrl.models.fp8_linear import FP8Linear, fp8_linear_reference

    torch.manual_seed(1)
    lin = torch.nn.Linear(4100, 1030, bias=True, device="cuda", dtype=torch.bfloat16)
    layer = FP8Linear.from_linear(lin, torch.bfloat16)
    x = torch.randn(3, 17, 4100, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y, y_ref = layer(x), fp8_linear_reference(x_ref, layer)
    assert torch.equal(y, y_ref)
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref.backward(dy)
    assert torch.equal(x.grad, x_ref.grad)
