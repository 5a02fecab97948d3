"""Programmatic dependent launch (ops/dependent_launch.py): every kernel that may start before the kernel ahead of it
has completed waits for it before touching memory; on the CPU the launches stay plain; on a GPU whole rollouts give
the same bits with and without."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from longrl.ops import dependent_launch as dl

SRC = Path(__file__).resolve().parents[1] / "src" / "longrl"


def _jit_kernels(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any(ast.unparse(d).endswith("jit") for d in node.decorator_list):
            out[node.name] = node
    return out


def _takes_pdl(fn: ast.FunctionDef) -> bool:
    return any(a.arg == "PDL" for a in fn.args.args + fn.args.kwonlyargs)


def _first_statement(fn: ast.FunctionDef) -> ast.stmt:
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return body[0]


def _dependent_launches(tree: ast.Module):
    """(kernel name, line) of each launch ``kernel[grid](..., **dependent_launch.options(t))``."""
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                and any(k.arg is None and "dependent_launch.options" in ast.unparse(k.value) for k in node.keywords)):
            yield ast.unparse(node.func.value), node.lineno


# the decode step's kernels: glue (o's and down's LoRA fold too), attention, the FP8 cache's store, the NF4 and FP8
# products and their split sums
DECODE_KERNELS = {"_add_rmsnorm_kernel", "_add_lora_rmsnorm_kernel", "_rotary_kv_kernel", "_silu_mul_kernel", "_silu_mul_lora_kernel",
                  "_prefix_kernel", "_chunk_kernel", "_merge_kernel", "_store_kernel", "_nf4_group_kernel",
                  "_split_sum_kernel", "_fp8_group_kernel"}
MODULES = sorted(p for p in SRC.rglob("*.py") if "dependent_launch.options" in p.read_text() or "PDL" in p.read_text())


def test_kernels_that_take_pdl_wait_before_anything_else():
    """The rule of ops/dependent_launch.py: a kernel with the PDL switch calls wait_for_inputs(PDL) first, so no
    load or store of any program runs before the kernel ahead has completed."""
    checked = set()
    for path in MODULES:
        for name, fn in _jit_kernels(ast.parse(path.read_text())).items():
            if not _takes_pdl(fn) or name == "wait_for_inputs":
                continue
            first = _first_statement(fn)
            assert ast.unparse(first) == "wait_for_inputs(PDL)", \
                f"{path.name}:{fn.lineno} {name} starts with {ast.unparse(first)!r}"
            checked.add(name)
    assert checked == DECODE_KERNELS, checked ^ DECODE_KERNELS


def test_each_dependent_launch_is_of_a_kernel_that_waits():
    launched = set()
    for path in MODULES:
        tree = ast.parse(path.read_text())
        kernels = _jit_kernels(tree)
        for kernel, line in _dependent_launches(tree):
            assert kernel in kernels, f"{path.name}:{line}: {kernel} is not a Triton kernel of this module"
            assert _takes_pdl(kernels[kernel]), f"{path.name}:{line}: {kernel} launched dependently has no PDL switch"
            launched.add(kernel)
    assert launched == DECODE_KERNELS, launched ^ DECODE_KERNELS


def test_launches_stay_plain_on_the_cpu_and_when_switched_off(monkeypatch):
    assert dl.options(torch.zeros(2)) == {"PDL": False}

    class OnAGpu:  # a tensor's two attributes options() reads, on a device that supports dependent launches
        is_cuda = True
        device = torch.device("cuda", 0)

    monkeypatch.setattr(dl, "supported", lambda device: True)
    default = dl.options(OnAGpu())
    assert default in ({"PDL": True, "launch_pdl": True}, {"PDL": False})
    with dl.dependent_launches(True):
        assert dl.options(OnAGpu()) == {"PDL": True, "launch_pdl": True}
        with dl.dependent_launches(False):
            assert dl.options(OnAGpu()) == {"PDL": False}
            assert dl.options(torch.zeros(2)) == {"PDL": False}
        assert dl.options(OnAGpu())["PDL"]
        monkeypatch.setattr(dl, "supported", lambda device: False)
        assert dl.options(OnAGpu()) == {"PDL": False}
    monkeypatch.setattr(dl, "supported", lambda device: True)
    assert dl.options(OnAGpu()) == default  # the default back after the contexts


def test_the_wait_compiles_to_griddepcontrol_for_sm90():
    """With PDL the kernel's PTX waits for the kernel ahead and lets the next one launch; without, neither."""
    pytest.importorskip("triton")
    from test_kernels_compile import compile_for_sm90

    from longrl.rollout import fused_ops as fo

    sig = dict(H="*bf16", DELTA="*bf16", W="*bf16", X="*bf16", d="i32", eps="fp32", stride_delta="i32")
    ptx = {}
    for pdl in (False, True):
        kernel = compile_for_sm90(fo._add_rmsnorm_kernel, sig, dict(HAS_DELTA=True, BLOCK=4096, PDL=pdl),
                                  num_warps=8, **({"launch_pdl": True} if pdl else {}))
        ptx[pdl] = kernel.asm["ptx"]
    assert "griddepcontrol.wait" in ptx[True] and "griddepcontrol.launch_dependents" in ptx[True]
    assert ptx[True].index("griddepcontrol.wait") < ptx[True].index("ld.global")  # before the first load
    assert "griddepcontrol" not in ptx[False]
    # o's and down's LoRA fold (rank 32, an 8B row of 4,096 in blocks of 256) builds for sm_90 too, waiting first
    fold = compile_for_sm90(fo._add_lora_rmsnorm_kernel, dict(sig, XA="*bf16", B_T="*bf16", COUNT="*i32",
                                                              stride_xa="i32"),
                            dict(R=32, RP=32, BC=fo.ADD_LORA_BLOCK, BLOCK=4096, PDL=True), num_warps=4, launch_pdl=True)
    assert "griddepcontrol.wait" in fold.asm["ptx"] and "atom.global.gpu.acq_rel.add" in fold.asm["ptx"]


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _rollouts(model, tok, step_graphs: bool):
    from longrl.rollout import Sampler, SamplingParams

    params = SamplingParams(max_new_tokens=24, temperature=0.9, seed=7, stop_token_ids=(3,))
    runs = []
    for on in (False, True, True):  # (twice on: a race would show as runs that differ)
        with dl.dependent_launches(on):
            sampler = Sampler(model, tok, min_decode_batch=1, step_graphs=step_graphs)
            runs.append(sampler.generate([[5, 6, 7, 8, 9], [10, 11, 12], [4, 4, 4, 4]], 3, params))
    return runs


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("step_graphs", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rollouts_with_dependent_launches_equal_those_without(step_graphs, dtype):
    """A LoRA model's rollouts (fused glue, decode attention, CUDA graphs) give the same tokens and log-probs, bit
    for bit, with the decode kernels launched dependently and without."""
    from test_sampler import tiny_model

    assert dl.supported(torch.device("cuda")) == (torch.cuda.get_device_capability()[0] >= 9)
    model, tok = tiny_model(seed=4, lora=True)
    runs = _rollouts(model.to(dtype).cuda(), tok, step_graphs)
    for r in runs[1:]:
        assert r.completion_ids == runs[0].completion_ids
        assert r.logprobs == runs[0].logprobs


@pytest.mark.gpu
@needs_gpu
def test_nf4_rollouts_with_dependent_launches_equal_those_without():
    """The same for a QLoRA model whose decode products are the grouped NF4 kernel (each layer's four products,
    their split sums in the kernel's last programs)."""
    from test_nf4_matmul import tiny_qlora

    from longrl.rollout import Sampler, SamplingParams

    model = tiny_qlora().cuda()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    params = SamplingParams(max_new_tokens=24, temperature=0.9, seed=3)
    runs, stats = [], []
    for on in (False, True, True):
        with dl.dependent_launches(on):
            sampler = Sampler(model, None, nf4_kernel=True, step_graphs=True)
            runs.append(sampler.generate([[5, 6, 7, 8, 9], [10, 11, 12]], 4, params))
            stats.append(sampler.last_stats)
    assert stats[1]["nf4_projections"] == 7 * 2 and stats[1]["fast_decode"]
    for r in runs[1:]:
        assert r.completion_ids == runs[0].completion_ids
        assert r.logprobs == runs[0].logprobs
