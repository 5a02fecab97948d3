"""Offloaded checkpointing is lossless; packed micro-batches equal padded ones; token-budget grouping."""

import contextlib
import copy
import random

import pytest
import torch

from longrl.config.schema import LoraConfig
from torch.utils._python_dispatch import TorchDispatchMode

from longrl.memory import (ActivationOffloader, enable_offloaded_checkpointing, keep_last_layers_whole,
                           token_budget_groups)
from longrl.memory.attention_reuse import ATTENTION_OPS
from longrl.memory.offload import PinnedPool
from longrl.models import apply_lora
from longrl.models.lora_training import fused_lora_training
from longrl.models.policy import sequence_logprobs


def _base(seed=0, layers=3):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def _batch(seed, n=5):
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 61) for _ in range(rng.randint(1, 9))] for _ in range(n)]
    completions = [[rng.randrange(1, 61) for _ in range(rng.randint(1, 11))] for _ in range(n)]
    return prompts, completions


def _grads(base, mode, lora, dropout, packed, batch, gpu_resident=0, backward_mode=None, fused_lora=False,
           b_scale=1.0, fused_layers=False, whole=0):
    model = copy.deepcopy(base)
    if lora:
        torch.manual_seed(3)
        model = apply_lora(model, LoraConfig(r=4, dropout=dropout))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_().mul_(b_scale)
    model.train()
    inner = model.get_base_model() if lora else model
    if mode == "plain":
        inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        keep_last_layers_whole(model, whole)
    elif mode in ("offload", "reuse"):
        enable_offloaded_checkpointing(model, gpu_resident=gpu_resident, reuse_attention=mode == "reuse",
                                       no_recompute=whole)
    if fused_layers:  # as the trainer: after checkpointing (on the CPU the attention wrapper runs its own forward)
        from longrl.models.fused_layers import enable_fused_layers

        assert enable_fused_layers(model)["attention"] == len(base.model.layers)
    prompts, completions = batch
    torch.manual_seed(11)
    with fused_lora_training(model) if fused_lora else contextlib.nullcontext():  # forward and backward inside
        lp, ent = sequence_logprobs(model, prompts, completions, 11, pad_id=0, with_entropy=True, packed=packed)
        w = torch.randn(lp.shape, generator=torch.Generator().manual_seed(2), dtype=lp.dtype).to(lp.device)
        with backward_mode or contextlib.nullcontext():
            ((lp * w).sum() + ent.sum()).backward()
    return lp.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def bf16_gradient_errors(base, batch, fused_layers: bool) -> dict:
    """Relative error (‖g − g_fp32‖ / ‖g_fp32‖ over every LoRA gradient) of the bf16-autocast gradients of: PEFT's
    forward, the fused layers (if ``fused_layers``), and the fused layers + fused LoRA, against the float32 model's
    (offloaded checkpointing, packed batch)."""
    from longrl.models.fused_layers import disable_fused_layers, enable_fused_layers

    _, ref = _grads(base, "offload", True, 0.0, True, batch, b_scale=0.05)
    b16 = base.to(torch.bfloat16)
    out = {}
    with torch.autocast(b16.device.type, dtype=torch.bfloat16):
        for name, layers, lora in (("peft", False, False), ("fused_layers", True, False),
                                   ("fused_layers+lora", True, True)):
            if layers and fused_layers:
                enable_fused_layers(b16)
            _, g = _grads(b16, "offload", True, 0.0, True, batch, fused_lora=lora, b_scale=0.05)
            disable_fused_layers(b16)
            num = sum(float((g[k].float() - ref[k].float()).norm()) ** 2 for k in ref)
            out[name] = (num / sum(float(ref[k].float().norm()) ** 2 for k in ref)) ** 0.5
    return out


@pytest.mark.parametrize("lora, dropout", [(True, 0.0), (True, 0.2), (False, 0.0)])
@pytest.mark.parametrize("packed", [True, False])
def test_offloaded_equals_plain_checkpointing_exactly(lora, dropout, packed):
    base, batch = _base(), _batch(torch.seed() % 1000)
    lp_plain, g_plain = _grads(base, "plain", lora, dropout, packed, batch)
    lp_none, g_none = _grads(base, "none", lora, dropout, packed, batch)
    for resident in (0, 2):
        lp_off, g_off = _grads(base, "offload", lora, dropout, packed, batch, gpu_resident=resident)
        assert torch.equal(lp_off, lp_plain)
        assert g_off.keys() == g_plain.keys() and len(g_off) > 0
        for k in g_plain:
            assert torch.equal(g_off[k], g_plain[k]), k
    for k in g_plain:  # and plain checkpointing equals no checkpointing
        assert torch.equal(g_none[k], g_plain[k]), k


class _CountAttention(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func in ATTENTION_OPS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("lora, dropout", [(True, 0.0), (True, 0.2), (False, 0.0)])
@pytest.mark.parametrize("packed", [True, False])
def test_reused_attention_equals_plain_checkpointing_exactly(lora, dropout, packed, monkeypatch):
    """Attention outputs recorded in forward and replayed in the recompute (every output through the host pool
    here): the same log-probs and gradients as plain checkpointing, bit for bit, and backward runs no attention
    kernel (only their backward)."""
    monkeypatch.setattr(ActivationOffloader, "EXTRA_MIN_BYTES", 0)
    base, batch = _base(), _batch(torch.seed() % 1000)
    lp_plain, g_plain = _grads(base, "plain", lora, dropout, packed, batch)
    plain_count = _CountAttention()
    _grads(base, "offload", lora, dropout, packed, batch, backward_mode=plain_count)
    assert plain_count.calls > 0  # the recompute runs the fused attention op: there is something to save
    for resident in (0, 2):
        count = _CountAttention()
        lp, g = _grads(base, "reuse", lora, dropout, packed, batch, gpu_resident=resident, backward_mode=count)
        assert count.calls == 0
        assert torch.equal(lp, lp_plain) and g.keys() == g_plain.keys()
        for k in g_plain:
            assert torch.equal(g[k], g_plain[k]), k


@pytest.mark.parametrize("fused_lora", [False, True])
def test_fused_layers_under_offloading_and_reuse_equal_plain_checkpointing_exactly(fused_lora, monkeypatch):
    """The training wrappers (models/fused_layers.py: the attention wrapper's own forward, on the CPU with the
    rotary twin) inside offloaded checkpointing with attention reuse, packed sequences and LoRA: the log-probs and
    gradients of plain checkpointing without the wrappers, bit for bit (the fused LoRA on both sides or neither)."""
    monkeypatch.setattr(ActivationOffloader, "EXTRA_MIN_BYTES", 0)
    base, batch = _base(), _batch(torch.seed() % 1000)
    lp_plain, g_plain = _grads(base, "plain", True, 0.0, True, batch, fused_lora=fused_lora)
    for mode in ("offload", "reuse"):
        lp, g = _grads(base, mode, True, 0.0, True, batch, fused_lora=fused_lora, fused_layers=True)
        assert torch.equal(lp, lp_plain) and g.keys() == g_plain.keys()
        for k in g_plain:
            assert torch.equal(g[k], g_plain[k]), (mode, k)


@pytest.mark.parametrize("mode, fused", [("plain", False), ("offload", False), ("reuse", False), ("reuse", True)])
def test_layers_kept_whole_equal_checkpointed_layers_exactly(mode, fused, monkeypatch):
    """model.no_recompute_layers: the last W layers out of checkpointing (plain or offloaded, with attention reuse,
    resident inputs or none; the fused layers and fused LoRA or not) give the log-probs and gradients of every
    layer checkpointed, bit for bit; each layer
    taken out removes its recompute from the backward, and with all of them out (or more) the backward runs the ops
    of no checkpointing at all."""
    monkeypatch.setattr(ActivationOffloader, "EXTRA_MIN_BYTES", 0)
    base, batch = _base(layers=4), _batch(torch.seed() % 1000)
    fused_kw = dict(fused_layers=fused, fused_lora=fused)
    lp_ref, g_ref = _grads(base, mode, True, 0.0, True, batch, **fused_kw)
    backward_ops = {}
    for whole, resident in ((0, 0), (1, 0), (3, 1), (4, 0), (9, 2)):
        count = _CountOps()
        lp, g = _grads(base, mode, True, 0.0, True, batch, whole=whole, gpu_resident=resident, backward_mode=count,
                       **fused_kw)
        assert torch.equal(lp, lp_ref) and g.keys() == g_ref.keys() and len(g) > 0
        for k in g_ref:
            assert torch.equal(g[k], g_ref[k]), (whole, k)
        backward_ops[whole] = count.calls
    unchecked = _CountOps()  # no checkpointing at all: backward alone
    _grads(base, "none", True, 0.0, True, batch, backward_mode=unchecked, **fused_kw)
    assert backward_ops[0] > backward_ops[1] > backward_ops[3] > backward_ops[4]
    assert backward_ops[4] == backward_ops[9]
    # (transformers' plain checkpointing also makes the embeddings' output require grad: a few more backward ops)
    assert backward_ops[4] == unchecked.calls if mode != "plain" else backward_ops[4] > unchecked.calls


def test_layers_kept_whole_leave_the_resident_inputs_to_the_checkpointed_layers():
    """With W layers kept whole the offloader counts only the L − W checkpointed ones: the last ``gpu_resident`` of
    those stay on the GPU and the rest go to the host pool, over two micro-batches."""
    base, batch = _base(layers=4), _batch(5)
    for whole, resident in ((2, 1), (1, 2), (3, 0), (4, 1)):
        model = apply_lora(copy.deepcopy(base), LoraConfig(r=4))
        model.train()
        off = enable_offloaded_checkpointing(model, gpu_resident=resident, no_recompute=whole)
        assert off.num_layers == 4 - whole
        prompts, completions = batch
        for _ in range(2):
            lp = sequence_logprobs(model, prompts, completions, 11, pad_id=0, packed=True)[0]
            saved = [s.input.host is not None for s in off.stack]
            assert saved == [True] * max(0, 4 - whole - resident) + [False] * min(resident, 4 - whole)
            lp.sum().backward()
            assert not off.stack


def test_a_model_given_again_gets_the_new_layout_of_layers_kept_whole(tmp_path):
    """Plain checkpointing on a model passed in twice: the second layout (none kept whole) replaces the first's flags."""
    from longrl.config import load_config
    from longrl.config.demo import demo_config
    from longrl.memory.planner import StepShape
    from longrl.training.model_setup import build_policy_model

    def layout(whole):
        return load_config(None, ["model.gradient_checkpointing=true", "model.offload_activations=false",
                                  f"model.no_recompute_layers={whole}", f"output.output_dir={tmp_path}"],
                           base=demo_config())

    from longrl.models import base_model

    model, tokenizer, *_ = build_policy_model(layout(1), StepShape.grpo(layout(1), 4))
    flags = [layer.gradient_checkpointing for layer in base_model(model).model.layers]
    assert len(flags) > 1 and flags == [True] * (len(flags) - 1) + [False]
    model, *_ = build_policy_model(layout(0), StepShape.grpo(layout(0), 4), model=model, tokenizer=tokenizer)
    assert all(layer.gradient_checkpointing for layer in base_model(model).model.layers)


class _CountOps(TorchDispatchMode):
    """Counts the ATen ops that run (used around backward: the recomputes and the backward itself)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_packed_equals_padded():
    """In float64, so that only a real difference (not summation order) can fail it."""
    base, batch = _base(1).double(), _batch(torch.seed() % 1000, n=6)
    lp_packed, g_packed = _grads(base, "none", True, 0.0, True, batch)
    lp_padded, g_padded = _grads(base, "none", True, 0.0, False, batch)
    assert torch.allclose(lp_packed, lp_padded, atol=1e-10)
    for k in g_padded:
        assert (g_packed[k] - g_padded[k]).norm() <= 1e-10 * g_padded[k].norm(), k


def test_reused_attention_outputs_share_the_pool(monkeypatch):
    monkeypatch.setattr(ActivationOffloader, "EXTRA_MIN_BYTES", 0)
    base, batch = _base(2), _batch(4)
    model = apply_lora(copy.deepcopy(base), LoraConfig(r=4))
    off = enable_offloaded_checkpointing(model, reuse_attention=True)
    for _ in range(2):
        lp, _ = sequence_logprobs(model, *batch, 11, pad_id=0)
        lp.sum().backward()
        assert off.stack == [] and off.host_bytes_in_use == 0
    total = sum(len(p) + len(c) for p, c in zip(*batch))
    inputs_bytes = 3 * total * 32 * 4
    # per layer also the attention output (tokens × heads × head dim, float32) and its log-sum-exp
    assert off.peak_host_bytes >= inputs_bytes + 3 * total * 32 * 4


def test_pool_reuses_host_buffers_and_stack_empties():
    base, batch = _base(2), _batch(4)
    model = apply_lora(copy.deepcopy(base), LoraConfig(r=4))
    off = enable_offloaded_checkpointing(model)
    for _ in range(3):
        lp, _ = sequence_logprobs(model, *batch, 11, pad_id=0)
        lp.sum().backward()
        assert off.stack == []
    total = sum(len(p) + len(c) for p, c in zip(*batch))
    one_layer_bytes = PinnedPool.class_bytes(total * 32 * 4)
    assert off.pool.allocated_bytes == 3 * one_layer_bytes  # 3 layers, buffers reused in later steps
    assert off.peak_host_bytes == 3 * one_layer_bytes


def test_pool_serves_other_lengths_from_its_size_classes():
    """Steps whose sequences change length (every GRPO step) reuse the pool's buffers: a request takes a free buffer
    of its size class or one up to twice as large, so steps a few tokens apart pin nothing new, a much longer step
    pins its own, and a shorter one after it reuses those; log-probs and gradients read back through the larger
    buffers are plain checkpointing's, exactly."""
    base = _base(2)
    models = {mode: copy.deepcopy(base).train() for mode in ("offload", "plain")}
    off = enable_offloaded_checkpointing(models["offload"])
    models["plain"].gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    prompts, completions = _batch(4)

    def step(extra: int, mode: str = "offload"):
        model = models[mode]
        model.zero_grad()
        lp, _ = sequence_logprobs(model, [p + [7] * extra for p in prompts], completions, 11, pad_id=0)
        lp.sum().backward()
        assert off.stack == [] and off.host_bytes_in_use == 0
        return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    step(3)
    first = off.pool.allocated_bytes
    for extra in (2, 1, 0, 3):  # up to 3 tokens shorter, of ~50: the same buffers
        step(extra)
        assert off.pool.allocated_bytes == first, extra
    step(40)  # more than twice as long: buffers of its own
    assert off.pool.allocated_bytes > first
    grown = off.pool.allocated_bytes
    lp, grads = step(25)  # between: served by the long step's buffers
    assert off.pool.allocated_bytes == grown
    lp_plain, grads_plain = step(25, "plain")
    assert torch.equal(lp, lp_plain)
    for n, g in grads_plain.items():
        assert torch.equal(grads[n], g), n


def test_gpu_resident_keeps_the_last_layers():
    off = ActivationOffloader("cpu", gpu_resident=2, num_layers=3)
    x = torch.randn(4, 5)
    saved = [off.save(x) for _ in range(3)]
    assert [s.host is None for s in saved] == [False, True, True]


@pytest.mark.parametrize("seed", range(5))
def test_token_budget_groups(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 40))]
    budget = rng.choice([50, 200, 600])
    groups = token_budget_groups(lengths, budget)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) == 1 or sum(lengths[i] for i in g) <= budget
    with pytest.raises(ValueError):
        token_budget_groups(lengths, 0)


def test_trainer_token_budget_and_offload_match_default(tmp_path):
    """A run split by token budget, offloaded, matches the plain run's metrics (float tolerance); with attention
    reuse, and with its last layer not recomputed, the offloaded run's exactly."""
    from longrl.config import load_config
    from longrl.config.demo import demo_config
    from longrl.compat.trl import GRPOTrainer

    common = ["train.max_steps=3", "train.prompts_per_step=4", "grpo.num_generations=4", "lora.enabled=true",
              "output.progress_bar=false", "output.tensorboard=false", "grpo.beta=0.04", "grpo.num_iterations=1"]
    a = GRPOTrainer(load_config(None, common + [f"output.output_dir={tmp_path / 'a'}", "train.micro_batch_size=16"],
                                base=demo_config())).train()
    b = GRPOTrainer(load_config(None, common + [f"output.output_dir={tmp_path / 'b'}", "train.micro_batch_tokens=20",
                                                "model.offload_activations=true", "model.reuse_attention=false"],
                                base=demo_config())).train()
    c = GRPOTrainer(load_config(None, common + [f"output.output_dir={tmp_path / 'c'}", "train.micro_batch_tokens=20",
                                                "model.offload_activations=true", "model.reuse_attention=true"],
                                base=demo_config())).train()
    d = GRPOTrainer(load_config(None, common + [f"output.output_dir={tmp_path / 'd'}", "train.micro_batch_tokens=20",
                                                "model.offload_activations=true", "model.reuse_attention=true",
                                                "model.no_recompute_layers=1"], base=demo_config())).train()
    load_config(tmp_path / "d" / "config.yaml", ["output.resume=true"])  # the layout it recorded loads again
    for ma, mb, mc, md in zip(a, b, c, d):
        for k in ("reward", "loss", "kl", "grad_norm", "entropy"):
            assert ma[k] == pytest.approx(mb[k], rel=1e-4, abs=1e-6), k
            assert mc[k] == mb[k], k  # attention reuse is exact
            assert md[k] == mc[k], k  # so is a layer kept whole


def test_reuse_attention_needs_offloading():
    from longrl.config import ConfigError, load_config
    from longrl.config.demo import demo_config

    with pytest.raises(ConfigError, match="model.reuse_attention"):
        load_config(None, ["model.reuse_attention=true"], base=demo_config())


def test_no_grad_forward_saves_nothing():
    """A forward without autograd (reference / old-policy pass) must not offload or keep anything."""
    base, batch = _base(5), _batch(6)
    model = apply_lora(copy.deepcopy(base), LoraConfig(r=4))
    off = enable_offloaded_checkpointing(model)
    model.train()
    with torch.no_grad():
        sequence_logprobs(model, *batch, 11, pad_id=0)
    assert off.stack == [] and off.pool.allocated_bytes == 0


def test_equal_length_sequences_are_stacked_and_match_padded():
    base = _base(7).double()
    prompts, completions = [[1, 2, 3], [4, 5, 6]], [[7, 8], [9, 10]]
    lp_stacked, g_stacked = _grads(base, "none", True, 0.0, True, (prompts, completions))
    lp_padded, g_padded = _grads(base, "none", True, 0.0, False, (prompts, completions))
    assert torch.allclose(lp_stacked, lp_padded, atol=1e-12)


def test_sdpa_backend_order_and_config():
    """model.sdpa_backends: the listed backends first, the rest after (so nothing is disabled); bad names refused."""
    from torch.nn.attention import SDPBackend

    from longrl.config import ConfigError, load_config
    from longrl.config.demo import demo_config
    from longrl.ops.attention_backend import backend_order, sdpa_priority

    assert backend_order(["cudnn"]) == [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                        SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    # with nothing listed first, PyTorch's own order (torch._C._get_sdp_priority_order: flash, efficient, math, cudnn)
    order = {int(b): i for i, b in enumerate(torch._C._get_sdp_priority_order())}
    assert sorted(backend_order([]), key=lambda b: order[int(b)]) == backend_order([])
    assert backend_order(["efficient", "cudnn"])[:2] == [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    assert len(backend_order([])) == 4
    before = torch._C._get_sdp_priority_order()
    with sdpa_priority(["cudnn"], "cpu"):  # nothing changes on the CPU
        assert torch._C._get_sdp_priority_order() == before
    assert load_config(None, ["model.sdpa_backends=[cudnn, flash]"], base=demo_config()).model.sdpa_backends == [
        "cudnn", "flash"]
    with pytest.raises(ConfigError, match="model.sdpa_backends"):
        load_config(None, ["model.sdpa_backends=[fa3]"], base=demo_config())
    # the per-head attention backward runs flash's kernels: refused beside another kernel first or another attention
    for other in ("model.sdpa_backends=[cudnn]", "model.attn_implementation=eager"):
        with pytest.raises(ConfigError, match="model.grouped_attention_backward"):
            load_config(None, ["model.grouped_attention_backward=true", other], base=demo_config())
    assert load_config(None, ["model.grouped_attention_backward=true", "model.sdpa_backends=[flash]"],
                       base=demo_config()).model.grouped_attention_backward


def test_recorded_efficient_and_cudnn_calls_ask_for_the_log_sumexp():
    """Without autograd PyTorch asks the efficient and cuDNN kernels for no log-sum-exp; the record forces it (their
    backward in the recompute needs it) and the forced flag is not part of the call's identity."""
    from longrl.memory.attention_reuse import _signature, _with_log_sumexp

    q = torch.zeros(1, 2, 3, 4)
    for name in ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"):
        op = getattr(torch.ops.aten, name).default
        args = (q, q, q, None, False, 0.0, True)
        forced, kwargs = _with_log_sumexp(op, args, {})
        assert forced[4] is True and all(a is b for a, b in zip(forced[:4], args[:4])) and forced[5:] == args[5:]
        assert _signature(op, args, {}) == _signature(op, forced, {})
        assert _signature(op, args, {}) != _signature(op, args[:6] + (False,), {})  # other arguments count
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert _with_log_sumexp(flash, (q, q, q), {})[0][0] is q


@torch.library.custom_op("longrl_test::noisy_attention", mutates_args=())
def _noisy_attention(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Stands for a fused attention kernel with dropout: it draws from the generator (as CUDA SDPA advances its
    Philox offset) and returns its mask among its outputs (as SDPA returns its seed and offset)."""
    mask = (torch.rand_like(x) >= p).to(x.dtype) / (1 - p)
    return x * mask, mask


@_noisy_attention.register_fake
def _(x, p):
    return torch.empty_like(x), torch.empty_like(x)


_noisy_attention.register_autograd(lambda ctx, gy, gm: (gy * ctx.saved_tensors[0], None),
                                   setup_context=lambda ctx, inputs, output: ctx.save_for_backward(output[1]))


def test_reused_attention_keeps_the_random_stream_of_the_layer(monkeypatch):
    """An attention op that draws random numbers, then a dropout later in the same layer: replaying the op's
    recorded outputs must leave the generator where running it would, or the recompute's dropout mask (and so
    the gradients) would differ from the forward's."""
    from longrl.memory import attention_reuse
    from longrl.memory.offload import offloaded_checkpoint

    monkeypatch.setattr(attention_reuse, "ATTENTION_OPS",
                        attention_reuse.ATTENTION_OPS | {torch.ops.longrl_test.noisy_attention.default})
    torch.manual_seed(0)
    w1, w2, x = torch.randn(16, 16, requires_grad=True), torch.randn(16, 16, requires_grad=True), torch.randn(4, 16)

    def layer(h):
        y, _ = _noisy_attention(h @ w1, 0.1)
        return torch.nn.functional.dropout(y @ w2, 0.3, training=True)

    def run(checkpoint_fn):
        w1.grad = w2.grad = None
        torch.manual_seed(123)
        out = layer(x) if checkpoint_fn is None else checkpoint_fn(layer, x)
        out.square().sum().backward()
        return out.detach(), w1.grad.clone(), w2.grad.clone()

    want = run(None)
    for reuse in (False, True):
        got = run(offloaded_checkpoint(ActivationOffloader("cpu", reuse_attention=reuse)))
        assert all(torch.equal(a, b) for a, b in zip(got, want)), reuse


def _causal_scores(q, k):
    T = q.shape[2]
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    return s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))


@torch.library.custom_op("longrl_test::bshd_attention", mutates_args=())
def _bshd_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stands for a fused CUDA attention kernel: q, k, v [B, H, T, D] → causal softmax(q kᵀ/√D) v as [B, H, T, D]
    laid out in memory as [B, T, H, D] (as the flash, memory-efficient and cuDNN kernels write it), and the
    log-sum-exp [B, H, T]."""
    s = _causal_scores(q, k)
    lse = s.logsumexp(-1)
    return ((s - lse[..., None]).exp() @ v).transpose(1, 2).contiguous().transpose(1, 2), lse


@_bshd_attention.register_fake
def _(q, k, v):
    return torch.empty_like(q), q.new_empty(q.shape[:3])


def _bshd_attention_backward(ctx, d_out, d_lse):
    """As the memory-efficient kernel's backward: it reads the output by the [B, T, H, D] strides its forward wrote
    (PyTorch hands it the output's batch and head strides only; the token stride is H·D, hard-coded)."""
    q, k, v, out, lse = ctx.saved_tensors
    B, H, T, D = out.shape
    out_as_written = out.as_strided(out.shape, (T * H * D, D, H * D, 1), out.storage_offset())
    p = (_causal_scores(q, k) - lse[..., None]).exp()  # [B, H, T, T]
    ds = p * (d_out @ v.transpose(-1, -2) - (d_out * out_as_written).sum(-1, keepdim=True)) / D ** 0.5
    return ds @ k, ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ d_out


_bshd_attention.register_autograd(_bshd_attention_backward,
                                  setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs, *output))


def test_reused_attention_output_keeps_the_kernels_memory_layout(monkeypatch):
    """The cause of attention reuse's wrong GPU gradients: the host round trip handed the kept attention output back
    contiguous ([B, H, T, D]) while the CUDA kernels write it as [B, T, H, D] and their backward reads it so. With
    such a kernel (stood for on the CPU, float64, every output through the host pool) the reused layer's output
    and gradients equal the unchecked layer's bit for bit (they differed in the q and k projections' gradients)."""
    from longrl.memory import attention_reuse
    from longrl.memory.offload import offloaded_checkpoint

    monkeypatch.setattr(attention_reuse, "ATTENTION_OPS",
                        attention_reuse.ATTENTION_OPS | {torch.ops.longrl_test.bshd_attention.default})
    monkeypatch.setattr(ActivationOffloader, "EXTRA_MIN_BYTES", 0)
    B, T, H, D = 2, 7, 3, 4
    torch.manual_seed(0)
    w = [torch.randn(H * D, H * D, dtype=torch.float64, requires_grad=True) for _ in range(4)]
    x = torch.randn(B, T, H * D, dtype=torch.float64)

    def layer(h):
        q, k, v = ((h @ wi).view(B, T, H, D).transpose(1, 2) for wi in w[:3])
        out, _ = _bshd_attention(q, k, v)
        return out.transpose(1, 2).reshape(B, T, H * D) @ w[3]

    def run(checkpoint_fn):
        for wi in w:
            wi.grad = None
        out = layer(x) if checkpoint_fn is None else checkpoint_fn(layer, x)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)).sum().backward()
        return [out.detach()] + [wi.grad.clone() for wi in w]

    want = run(None)
    for reuse in (False, True):
        got = run(offloaded_checkpoint(ActivationOffloader("cpu", reuse_attention=reuse)))
        assert all(torch.equal(a, b) for a, b in zip(got, want)), reuse


def test_host_copies_keep_the_layout_and_the_replay_refuses_another(monkeypatch):
    """The offloader's host round trip returns a permuted tensor with its strides; a round trip that loses them
    (contiguous, as before the fix) makes the replay of the CPU flash kernel's outputs (the log-sum-exp is laid
    out [B, T, H]) raise instead of feeding the backward another layout."""
    from longrl.memory import offload

    off = ActivationOffloader("cpu")
    t = torch.randn(2, 5, 3, 4).transpose(1, 2)  # [B, H, T, D] laid out as [B, T, H, D]
    back = off._take(off._put(t, offload=True))
    assert back.stride() == t.stride() and torch.equal(back, t) and back.data_ptr() != t.data_ptr()
    monkeypatch.setattr(ActivationOffloader, "EXTRA_MIN_BYTES", 0)
    monkeypatch.setattr(offload, "dense_strides", lambda t: torch.empty(t.shape, device="meta").stride())
    with pytest.raises(RuntimeError, match="laid out"):
        _grads(_base(layers=1), "reuse", True, 0.0, True, _batch(3, n=2))


def test_a_failing_layer_leaves_nothing_on_the_offload_stack():
    from longrl.memory.offload import offloaded_checkpoint

    offloader = ActivationOffloader("cpu", num_layers=2)
    checkpoint_fn = offloaded_checkpoint(offloader)
    x = torch.randn(3, 8, requires_grad=True)

    def failing(h):
        raise torch.OutOfMemoryError("simulated")

    with pytest.raises(torch.OutOfMemoryError):
        checkpoint_fn(failing, x)
    assert offloader.stack == [] and offloader.host_bytes_in_use == 0
    y = checkpoint_fn(lambda h: h * 2, x)  # the next layer still saves, and backward still finds it
    y.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0)) and offloader.stack == []


@pytest.mark.parametrize("padded", [False, True])
def test_repeated_kv_attention_equals_transformers_sdpa(padded):
    """longrl_sdpa_mha (keys/values repeated to the query heads, so backends without grouped-query support take
    the call) = transformers' SDPA attention: logits and LoRA gradients of a GQA model, with and without a mask."""
    from longrl.ops.attention_backend import MHA_SDPA, register_mha_sdpa

    register_mha_sdpa()
    base = _base(5)
    assert base.config.num_key_value_heads < base.config.num_attention_heads
    runs = []
    for impl in ("sdpa", MHA_SDPA):
        model = copy.deepcopy(base)
        model.set_attn_implementation(impl)
        torch.manual_seed(3)
        model = apply_lora(model, LoraConfig(r=4))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_()
        ids = torch.randint(1, 61, (3, 13))
        mask = torch.ones_like(ids)
        if padded:
            mask[0, :4] = 0
            mask[2, :7] = 0
        out = model(input_ids=ids, attention_mask=mask if padded else None).logits
        out.square().mean().backward()
        runs.append((out.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (lo_a, g_a), (lo_b, g_b) = runs
    torch.testing.assert_close(lo_b, lo_a, atol=1e-6, rtol=1e-6)
    assert g_a.keys() == g_b.keys() and len(g_a) > 0
    for k in g_a:
        torch.testing.assert_close(g_b[k], g_a[k], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("names, grouped, inside", [(["cudnn"], False, "mha"), (["efficient"], True, "mha"),
                                                   (["flash"], False, "sdpa"), ([], False, "sdpa"),
                                                   (["flash"], True, "grouped"), ([], True, "grouped"),
                                                   (["math"], True, "sdpa")])
def test_backends_without_gqa_get_repeated_kv_attention(names, grouped, inside):
    """With cuDNN or memory-efficient listed first, a grouped-query model's attention becomes longrl_sdpa_mha
    inside the context (so that those kernels take the call); with model.grouped_attention_backward and flash first
    or nothing listed, longrl_sdpa_grouped (the per-key-head backward); else SDPA. Back to SDPA after it."""
    from longrl.ops.attention_backend import MHA_SDPA, sdpa_priority
    from longrl.ops.grouped_attention import GROUPED_SDPA

    model = apply_lora(_base(6), LoraConfig(r=2))
    inner = model.get_base_model()
    assert inner.config._attn_implementation == "sdpa"
    with sdpa_priority(names, "cuda", model, grouped):
        assert inner.config._attn_implementation == {"mha": MHA_SDPA, "grouped": GROUPED_SDPA, "sdpa": "sdpa"}[inside]
    assert inner.config._attn_implementation == "sdpa"


def test_repeated_kv_attention_in_packed_offloaded_training():
    """The training path (packed micro-batches: transformers' packing mask; offloaded checkpointing) on
    longrl_sdpa_mha = on SDPA."""
    from longrl.ops.attention_backend import MHA_SDPA, register_mha_sdpa

    register_mha_sdpa()
    base, batch = _base(8), _batch(9)
    lp_a, g_a = _grads(base, "offload", True, 0.0, True, batch)
    base.set_attn_implementation(MHA_SDPA)
    lp_b, g_b = _grads(base, "offload", True, 0.0, True, batch)
    torch.testing.assert_close(lp_b, lp_a, atol=1e-6, rtol=1e-6)
    for k in g_a:
        torch.testing.assert_close(g_b[k], g_a[k], atol=1e-6, rtol=1e-5)


def test_the_recomputed_output_is_released_only_where_no_backward_reads_it():
    from longrl.memory.offload import release_unread_output

    a = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    g = torch.randn(5, 7, dtype=torch.float64)
    cases = {"residual add": lambda: (a * b) + a, "tanh keeps its result": lambda: torch.tanh(a * b),
             "view of a larger sum": lambda: (a.repeat(1, 2) + b.repeat(1, 2))[:, :7]}
    released = {}
    for name, f in cases.items():
        ref = torch.autograd.grad(f(), (a, b), g)
        out = f()
        released[name] = release_unread_output(out)
        assert (out.untyped_storage().nbytes() == 0) == released[name]
        got = torch.autograd.grad(out, (a, b), g)
        assert all(torch.equal(x, y) for x, y in zip(got, ref)), name
    assert released == {"residual add": True, "tanh keeps its result": False, "view of a larger sum": False}


def test_an_output_that_does_not_own_its_storage_is_kept(monkeypatch):
    """Even from an op on the list, a tensor that is part of a larger storage (others may read the rest) is kept."""
    import longrl.memory.offload as offload

    monkeypatch.setattr(offload, "OUTPUT_UNREAD_OPS", ("AddBackward0", "SliceBackward0"))
    a = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    part = (a.repeat(1, 2) + 1)[:, :7]
    assert part.grad_fn.name() == "SliceBackward0" and not offload.release_unread_output(part)
    assert part.untyped_storage().nbytes() == 2 * part.numel() * part.element_size()
    whole = a + 1
    assert offload.release_unread_output(whole) and whole.untyped_storage().nbytes() == 0


def test_offloaded_backward_releases_every_layers_recomputed_output(monkeypatch):
    import longrl.memory.offload as offload

    results = []
    real = offload.release_unread_output
    monkeypatch.setattr(offload, "release_unread_output", lambda out: results.append(real(out)) or results[-1])
    base, batch = _base(layers=3), _batch(5)
    _grads(base, "offload", True, 0.0, True, batch)
    assert results == [True] * 3  # each decoder layer ends in its residual add


class _FakeCudart:
    """Test double of torch.cuda.cudart(): records registrations, succeeds."""

    class cudaError:  # noqa: N801 - the name the real module gives it
        success = 0

    def __init__(self):
        self.registered, self.unregistered = [], []

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802
        self.registered.append((ptr, size, flags))
        return 0

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.unregistered.append(ptr)
        return 0


@pytest.mark.parametrize("nbytes", [1, 4095, 4096, 4097, 3 * 2 ** 20 + 5])
def test_exact_pinned_registers_whole_pages_around_the_buffer_and_unregisters_them(nbytes, monkeypatch):
    """memory/pinned.exact_pinned (CUDA replaced by a recording double): the buffer is the bytes asked for, inside
    the registered range, which starts on a page boundary and spans whole pages (not a power of two); the range is
    unregistered when the buffer is collected."""
    import gc

    from longrl.memory import pinned

    fake = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    buf = pinned.exact_pinned(nbytes)
    (ptr, size, flags), = fake.registered
    assert buf.numel() == nbytes and buf.dtype == torch.uint8 and flags == 0
    assert ptr % pinned.PAGE == 0 and size % pinned.PAGE == 0 and size == -(-nbytes // pinned.PAGE) * pinned.PAGE
    assert ptr == buf.data_ptr() and buf.data_ptr() + nbytes <= ptr + size
    buf[:] = 7  # the memory is the caller's
    assert fake.unregistered == []
    del buf
    gc.collect()
    assert fake.unregistered == [ptr]
