"""On the GPU: grouped rows (train.shared_prompt) on PyTorch's CUDA flash kernels, the 8B shape's heads: the kernel
against the float32 masked twin on odd and block-crossing shapes, within the error of plain bf16 flash attention on
the repeated layout; and a bf16 model's log-probs and gradients, grouped against repeated, with offloaded
checkpointing and attention reuse (the CUDA flash calls recorded and replayed)."""

import pytest
import torch

from longrl.ops.shared_prompt_attention import PromptGroup, SharedPromptLayout, reference_attention, \
    shared_prompt_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# (groups, rows, length): odd lengths crossing the flash kernels' 64/128-token blocks, a one-token prompt, padding
LAYOUTS = [
    ([(0, 0, 4099, (1, 127, 1025, 300))], 1, 5652),
    ([(0, 0, 1, (129, 63)), (0, 193, 777, (2, 511))], 1, 1483),
    ([(0, 0, 300, (65, 257)), (1, 0, 129, (700,))], 2, 830),
]


def _layout(spec):
    groups, rows, length = spec
    return SharedPromptLayout(tuple(PromptGroup(*g) for g in groups), rows, length)


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("spec", LAYOUTS, ids=lambda s: f"L{s[2]}")
def test_kernel_within_bf16_flash_error_of_the_float32_twin(spec):
    layout = _layout(spec)
    g = torch.Generator(device="cuda").manual_seed(spec[2])
    mk = lambda h: torch.randn(layout.rows, layout.length, h, 128, generator=g, device="cuda",  # noqa: E731
                               dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    q, k, v = mk(32), mk(8), mk(8)
    do = torch.randn(layout.rows, layout.length, 32, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    scale = 128 ** -0.5

    def run(fn, *tensors):
        out = fn(*tensors, layout, scale)
        return (out, *torch.autograd.grad(out, tensors, do))

    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    want = run(reference_attention, q32, k32, v32)
    got = run(shared_prompt_attention, q, k, v)
    # the floor: plain bf16 flash attention of one prompt + completion sequence against float32 on the same inputs
    grp = layout.groups[0]
    idx = torch.tensor(list(range(grp.start, grp.start + grp.prompt + grp.completions[0])), device="cuda")
    seq = [t[grp.row:grp.row + 1, :, idx].detach().requires_grad_() for t in (q, k, v)]
    flash = torch.nn.functional.scaled_dot_product_attention(*seq, is_causal=True, enable_gqa=True, scale=scale)
    seq32 = [t.detach().float().requires_grad_() for t in seq]
    exact = torch.nn.functional.scaled_dot_product_attention(*seq32, is_causal=True, enable_gqa=True, scale=scale)
    floor = _rel(flash, exact)
    assert got[0].dtype == torch.bfloat16
    for name, a, b in zip(["out", "dq", "dk", "dv"], got, want):
        assert _rel(a, b) < max(4 * floor, 1e-2), (name, _rel(a, b), floor)


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, initializer_range=0.05, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)


@pytest.mark.parametrize("reuse", [False, True])
def test_bf16_model_grouped_against_repeated(reuse):
    from longrl.memory.offload import enable_offloaded_checkpointing
    from longrl.models.policy import sequence_logprobs

    g = torch.Generator().manual_seed(1)
    tok = lambda n: torch.randint(1, 512, (n,), generator=g).tolist()  # noqa: E731
    prompts = [tok(3001), tok(257)]
    prompt_ids = [prompts[0]] * 5 + [prompts[1]] * 3
    completion_ids = [tok(n) for n in (1, 300, 129, 64, 511, 700, 3, 64)]
    width = 700
    results = {}
    for shared in (False, True):
        model = _model()
        model.train()
        enable_offloaded_checkpointing(model, reuse_attention=reuse)
        logps, _ = sequence_logprobs(model, prompt_ids, completion_ids, width, pad_id=0, shared_prompt=shared)
        w = torch.randn(logps.shape, generator=g.manual_seed(2)).to("cuda")
        (logps * w).sum().backward()
        results[shared] = (logps.detach(), [p.grad.float() for p in model.parameters()])
    (lp_a, gr_a), (lp_b, gr_b) = results[False], results[True]
    assert float((lp_a - lp_b).abs().max()) < 0.1  # bf16 activations, rounded in another order
    for a, b in zip(gr_a, gr_b):
        assert _rel(b, a) < 3e-2


def test_grpo_run_on_cuda_takes_grouped_rows_where_prompts_dominate(tmp_path):
    """train.shared_prompt null on CUDA: a prompt-heavy step (P = 512, R = 8, G = 4: P + G·R is 0.26 of G·(P + R))
    is planned with grouped rows, and the trainer's steps run on them with finite losses."""
    import math

    from longrl.compat.trl import GRPOTrainer
    from longrl.config import load_config
    from longrl.config.demo import demo_config

    cfg = load_config(None, [f"output.output_dir={tmp_path}", "model.device=cuda", "model.dtype=bfloat16",
                             "train.max_steps=2", "train.prompts_per_step=4", "grpo.num_generations=4",
                             "data.max_prompt_length=512", "generation.max_completion_length=8",
                             "output.progress_bar=false", "output.tensorboard=false", "output.save_steps=0"],
                      base=demo_config())
    trainer = GRPOTrainer(cfg)
    assert trainer.shared_prompt and trainer.layout.plan.shared_prompt
    history = trainer.train()
    assert len(history) == 2 and all(math.isfinite(h["loss"]) for h in history)
