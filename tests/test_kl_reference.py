"""The KL reference of full-weight runs (models/reference.py): a frozen copy of the initial weights whose log-probs
equal a deep copy of the initial model's bit for bit, before and after optimizer steps, in every exact placement (the
host placement's layer prefetch path forced on the CPU); the int8 placement equal to its plain dequantized twin; the
GRPO loss with beta > 0 equal to a hand computation with a separate reference model; resume rebuilding the same
reference (and refusing other initial weights); the planner counting the copy where it lives."""

import copy
import json
import re

import pytest
import torch

from longrl.config import ConfigError, load_config
from longrl.config.demo import demo_config
from longrl.models import build_tiny_model
from longrl.models.policy import sequence_logprobs
from longrl.models.reference import PREFETCH_LAYERS, ReferenceModel, int8_dequantized, int8_rows
from longrl.models.structure import decoder_layers
from test_planner import _llama_config, _llama_dir  # the 8B shape's config, and a model directory of it

QUICK = ["train.max_steps=2", "train.prompts_per_step=4", "grpo.num_generations=4", "train.micro_batch_size=5",
         "output.progress_bar=false", "output.tensorboard=false", "output.save_steps=0", "output.log_completions=0",
         "lora.enabled=false", "grpo.beta=0.1", "train.learning_rate=5e-3"]  # steps that move the policy

PROMPTS = [[1, 5, 6, 7], [1, 8, 9], [1, 4, 4, 4, 4, 5]]
COMPLETIONS = [[4, 5, 6], [7, 8, 9, 10, 11], [12, 13]]


def deep_model(seed: int, layers: int = 7, dtype=torch.float32):
    """(model, tokenizer): a small Llama of more decoder layers than the host placement's buffers (7 over 3: the
    buffers are reused, layers l and l + 3 alias), on the demo's character tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from longrl.models import build_char_tokenizer

    tok = build_char_tokenizer()
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=128,
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(dtype), tok


def _cfg(out, *overrides):
    return load_config(None, QUICK + [f"output.output_dir={out}", *overrides], base=demo_config())


def _logps(model, micro_batches, prompts=PROMPTS, completions=COMPLETIONS, width=5):
    """The plain path: sequence_logprobs of ``model`` over the same micro-batches, in float32 on its device."""
    out = torch.zeros(len(prompts), width, device=next(model.parameters()).device)
    with torch.no_grad():
        for idx in micro_batches:
            lp, _ = sequence_logprobs(model, [prompts[i] for i in idx], [completions[i] for i in idx], width,
                                      pad_id=0, packed=False)
            out[idx] = lp.float()
    return out


def _train_steps(model, steps=3):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        lp, _ = sequence_logprobs(model, PROMPTS, COMPLETIONS, 5, pad_id=0, packed=False)
        lp.sum().backward()
        opt.step()
        opt.zero_grad()


# ----------------------------------------------------------------------------------------------- the copy itself

@pytest.mark.parametrize("placement", ["gpu", "host"])
def test_reference_equals_a_deep_copy_of_the_initial_model_before_and_after_steps(placement):
    model, _ = deep_model(seed=3)
    initial = copy.deepcopy(model)
    reference = ReferenceModel(model, placement)
    splits = ([[0, 1, 2]], [[0], [1, 2]], [[2], [0], [1]])
    for split in splits:
        assert torch.equal(reference.logprobs(PROMPTS, COMPLETIONS, 5, split, pad_id=0, packed=False),
                           _logps(initial, split))
    _train_steps(model)
    assert not torch.equal(_logps(model, splits[0]), _logps(initial, splits[0]))  # the policy moved
    for split in splits:
        assert torch.equal(reference.logprobs(PROMPTS, COMPLETIONS, 5, split, pad_id=0, packed=False),
                           _logps(initial, split))
    assert all(not p.requires_grad for p in reference.model.parameters())


def test_host_placement_streams_each_layer_through_its_buffer_bit_identically():
    """The host placement on the CPU runs the prefetch path (buffers, hooks, copies from the host tensors): the
    streamed layers' weights are views into S = PREFETCH_LAYERS + 1 buffers (layers l and l + S alias), filled
    layer by layer, and the log-probs equal the in-place copy's bit for bit (packed and padded)."""
    model, _ = deep_model(seed=4)
    gpu, host = ReferenceModel(model, "gpu"), ReferenceModel(model, "host")
    layers = decoder_layers(host.model)
    slots = PREFETCH_LAYERS + 1
    assert len(layers) > slots and host.slots == slots and len(host._buffers) == slots
    pointers = [layer.self_attn.q_proj.weight.data_ptr() for layer in layers]
    assert len(set(pointers)) == slots and all(pointers[l] == pointers[l % slots] for l in range(len(layers)))
    assert len(gpu._buffers) == 0 and len({l.self_attn.q_proj.weight.data_ptr() for l in decoder_layers(gpu.model)}) \
        == len(layers)
    for packed in (False, True):
        for split in ([[0, 1, 2]], [[1], [0, 2]]):
            kw = dict(pad_id=0, packed=packed)
            assert torch.equal(host.logprobs(PROMPTS, COMPLETIONS, 5, split, **kw),
                               gpu.logprobs(PROMPTS, COMPLETIONS, 5, split, **kw))
    # a layer's buffer holds the last layer that used it, in that layer's weights
    last = len(layers) - 1
    assert torch.equal(layers[last].mlp.down_proj.weight, decoder_layers(model)[last].mlp.down_proj.weight)


def test_int8_placement_equals_its_plain_dequantized_twin():
    """int8: every decoder layer matrix as codes and a float32 scale per row, dequantized layer by layer through the
    buffers: the log-probs equal those of a plain copy whose matrices were replaced by q · s, bit for bit, and stay
    close to the exact reference (each weight within half a step of its row's scale)."""
    model, _ = deep_model(seed=5)
    initial = copy.deepcopy(model)
    reference = ReferenceModel(model, "int8")
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for layer in decoder_layers(twin):
            for p in layer.parameters():
                if p.dim() == 2:
                    codes, scale = int8_rows(p)
                    assert (p.float() - codes.float() * scale[:, None]).abs().max() <= scale.max() / 2 + 1e-7
                    p.copy_(int8_dequantized(codes, scale, p.dtype))
    _train_steps(model)
    split = [[0, 2], [1]]
    got = reference.logprobs(PROMPTS, COMPLETIONS, 5, split, pad_id=0, packed=False)
    assert torch.equal(got, _logps(twin, split))
    exact = _logps(initial, split)
    assert not torch.equal(got, exact) and torch.allclose(got, exact, atol=0.05)


def test_int8_rows_keeps_zero_rows_and_the_extremes():
    w = torch.tensor([[0.0, 0.0, 0.0], [1.0, -0.5, 0.25], [-3.0, 1.5, 0.0]])
    codes, scale = int8_rows(w)
    assert codes.dtype == torch.int8 and scale.tolist()[0] == 1.0 and codes[0].tolist() == [0, 0, 0]
    assert codes[1].tolist() == [127, -64, 32] and codes[2, 0].item() == -127
    assert torch.equal(int8_dequantized(codes, scale, torch.float32)[0], torch.zeros(3))


def test_reference_refuses_a_lora_model_and_an_unknown_placement():
    from longrl.config.schema import LoraConfig
    from longrl.models import apply_lora

    model, _ = build_tiny_model(seed=0)
    with pytest.raises(ValueError, match="placement"):
        ReferenceModel(model, "disk")
    with pytest.raises(ValueError, match="adapters disabled"):
        ReferenceModel(apply_lora(model, LoraConfig(r=2)), "gpu")


def test_fingerprint_follows_the_weights_and_a_resume_check_names_the_source():
    model, _ = build_tiny_model(seed=6)
    a, b = ReferenceModel(model, "gpu"), ReferenceModel(copy.deepcopy(model), "host")
    assert a.fingerprint == b.fingerprint and a.fingerprint.startswith("sha256:")
    a.check_resumed(b.state(), "x")
    a.check_resumed(None, "x")  # a checkpoint that recorded no reference (none was kept then)
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] += 1e-3
    other = ReferenceModel(model, "gpu")
    assert other.fingerprint != a.fingerprint
    with pytest.raises(ConfigError, match="model.name_or_path.*other initial weights.*model.revision"):
        other.check_resumed(a.state(), "config key 'model.name_or_path': m")
    with pytest.raises(ConfigError, match="set model.dtype=bfloat16"):
        other.check_resumed({**a.state(), "dtype": "bfloat16"}, "the model passed in")


# ----------------------------------------------------------------------------------------------- in the trainer

def test_config_accepts_full_weights_with_beta_and_checks_the_placement(tmp_path):
    cfg = _cfg(tmp_path, "grpo.reference_placement=int8")
    assert cfg.grpo.beta == 0.1 and not cfg.lora.enabled and cfg.grpo.reference_placement == "int8"
    with pytest.raises(ConfigError, match=r"'grpo\.reference_placement'.*lora\.enabled=true"):
        _cfg(tmp_path, "lora.enabled=true", "grpo.reference_placement=host")
    with pytest.raises(ConfigError, match=r"grpo\.reference_placement"):
        _cfg(tmp_path, "grpo.reference_placement=disk")


def test_trainer_reference_is_the_initial_model_and_the_loss_is_trls_formula(tmp_path):
    """Full weights, beta > 0: at the first step the reference's log-probs are the policy's (KL 0 exactly); after
    two steps the reference pass equals a deep copy of the initial model run on its own, and the update's loss and KL
    equal a hand computation from that separate model: per token −A + β k3 with k3 = exp(ref − logp) − (ref − logp)
    − 1 (the ratio is 1 at its value), averaged over the step's completion tokens (dapo)."""
    from longrl.compat.trl import GRPOTrainer

    model, tok = build_tiny_model(seed=7)
    initial = copy.deepcopy(model)
    trainer = GRPOTrainer(_cfg(tmp_path, "generation.backend=hf"), model=model, tokenizer=tok)
    assert trainer.reference.placement == "gpu"  # on the CPU, auto keeps it on the training device
    first = trainer.train_on_batch(trainer.generate_batch())
    assert first["kl"] == 0.0
    trainer.train_on_batch(trainer.generate_batch())
    batch = trainer.generate_batch()
    split = trainer._micro_batches(batch.prompt_ids, batch.completion_ids)
    width = batch.mask.shape[1]
    ref = _logps(initial, split, batch.prompt_ids, batch.completion_ids, width)
    assert torch.equal(batch.ref_logps, ref)
    policy = _logps(trainer.model, split, batch.prompt_ids, batch.completion_ids, width)
    mask, beta = batch.mask, 0.1
    d = ref - policy
    k3 = torch.exp(d) - d - 1.0
    per_token = -batch.advantages[:, None] + beta * k3
    loss = float((per_token * mask).sum() / mask.sum())
    stats = trainer.train_on_batch(batch)
    assert stats["kl"] > 1e-5  # the policy has moved away from the reference
    assert stats["kl"] == pytest.approx(float((k3 * mask).sum() / mask.sum()), rel=1e-5)
    assert stats["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-7)


def test_host_placement_trains_as_the_gpu_placement(tmp_path):
    """The same run with the reference in place and through the host prefetch path (7 layers through 3 buffers):
    identical metrics."""
    from longrl.compat.trl import GRPOTrainer

    runs = [GRPOTrainer(_cfg(tmp_path / p, f"grpo.reference_placement={p}"), *deep_model(seed=10)).train()
            for p in ("gpu", "host")]
    strip = [[{k: v for k, v in m.items() if not k.endswith("time_s")} for m in run] for run in runs]
    assert strip[0] == strip[1] and strip[0][-1]["kl"] > 0


def _strip_time(metrics):
    return [{k: v for k, v in m.items() if not k.endswith("time_s")} for m in metrics]


def test_resume_rebuilds_the_same_reference(tmp_path):
    """Interrupted after step 4 and resumed: the metrics (KL included) of the uninterrupted run; the checkpoints
    record the reference's fingerprint."""
    from longrl.compat.trl import GRPOTrainer
    from longrl.training.reporting import read_metrics

    extra = ["train.max_steps=6", "output.save_steps=2", "grpo.num_iterations=2", "grpo.beta=0.05"]
    full = GRPOTrainer(_cfg(tmp_path / "full", *extra)).train()
    assert full[-1]["kl"] > 0
    GRPOTrainer(_cfg(tmp_path / "cut", *extra, "train.max_steps=4")).train()
    (tmp_path / "cut" / "checkpoint-4").rename(tmp_path / "cut" / "checkpoint-4-ignored")
    state = json.loads((tmp_path / "cut" / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["kl_reference"]["fingerprint"].startswith("sha256:") and state["kl_reference"]["placement"] == "gpu"
    GRPOTrainer(_cfg(tmp_path / "cut", *extra, "output.resume=true", "grpo.reference_placement=host")).train()
    assert _strip_time(read_metrics(tmp_path / "cut")) == _strip_time(full)


def test_resume_refuses_other_initial_weights(tmp_path):
    from longrl.compat.trl import GRPOTrainer

    model, tok = build_tiny_model(seed=8)
    GRPOTrainer(_cfg(tmp_path, "generation.backend=hf"), model=model, tokenizer=tok).train()
    other, tok = build_tiny_model(seed=9)
    resumed = GRPOTrainer(_cfg(tmp_path, "generation.backend=hf", "output.resume=true", "train.max_steps=4"),
                          model=other, tokenizer=tok)
    with pytest.raises(ConfigError, match="the model passed in now loads other initial weights"):
        resumed.train()


# ----------------------------------------------------------------------------------------------- the planner

def _plan(gib, *overrides, host_gib=500, world_size=1):
    from longrl.memory.planner import GIB, plan_for_config

    cfg = load_config(overrides=["lora.enabled=false", "grpo.beta=0.04", "model.dtype=bfloat16",
                                 "model.offload_activations=true", "train.micro_batch_tokens=8192",
                                 "model.no_recompute_layers=0", "generation.max_completion_length=1024",
                                 "train.prompts_per_step=2",
                                 "rewards=[{function: 'longrl.tasks.arithmetic:format_reward'}]", *overrides])
    return plan_for_config(cfg, _llama_config(), int(gib * GIB), int(host_gib * GIB), world_size=world_size)


def test_planner_counts_the_copy_where_it_is_kept():
    """Against the same layout without a reference (beta 0): the whole copy on the GPU; host: embeddings + head and
    S layer buffers on the GPU, every layer pinned on the host; int8: a byte a matrix weight, a float32 scale per
    row, the norms in bf16, and S buffers of a layer's matrices — in both phases."""
    from longrl.memory.planner import ModelShape

    shape = ModelShape.from_config(_llama_config())
    layer, h = shape.layer_params(), shape.hidden
    root = shape.base_params() - 32 * layer
    s = PREFETCH_LAYERS + 1
    none = _plan(139, "grpo.beta=0")
    assert none.reference is None and not any("reference" in k for k in none.parts_gpu_bytes)
    lora = _plan(139, "lora.enabled=true")
    assert lora.reference is None  # the base with the adapters disabled: no copy
    rows = 4096 + 2 * 1024 + 2 * 4096 + 2 * 14336
    expected = {"gpu": (shape.base_params() * 2, 0),
                "host": (root * 2 + s * layer * 2, 32 * layer * 2),
                "int8": (root * 2 + 32 * ((layer - 2 * h) + 4 * rows + 2 * h * 2) + s * (layer - 2 * h) * 2, 0)}
    for placement, (gpu, host) in expected.items():
        plan = _plan(139, f"grpo.reference_placement={placement}")
        assert plan.reference.placement == placement and plan.reference.gpu_bytes == gpu
        assert plan.predicted_gpu_bytes == none.predicted_gpu_bytes + gpu
        assert plan.predicted_host_bytes == none.predicted_host_bytes + host
        assert plan.rollout.predicted_gpu_bytes == none.rollout.predicted_gpu_bytes + gpu
        assert plan.micro_batch_tokens == none.micro_batch_tokens and plan.budget_bytes == none.budget_bytes
        assert re.search(rf"\nKL reference\s+{placement} \(grpo.reference_placement\)", plan.table())
    assert expected["gpu"][0] == pytest.approx(16.06e9, rel=0.01)  # the 8B model in bf16


def test_auto_keeps_the_copy_on_the_gpu_when_the_step_fits_else_on_the_host():
    from longrl.memory.planner import PlanError, reference_placement

    assert _plan(139).reference.placement == "gpu"
    tight = _plan(75)
    assert tight.reference.placement == "host"
    with pytest.raises(PlanError, match="KL reference copy's .* GiB: grpo.reference_placement=gpu.*host or int8"):
        _plan(75, "grpo.reference_placement=gpu")
    with pytest.raises(PlanError, match="KL reference copy in host memory takes 26.0 GiB .*2 processes.*int8"):
        _plan(139, "grpo.reference_placement=host", host_gib=20, world_size=2)
    cfg = load_config(overrides=["lora.enabled=false", "grpo.beta=0.04",
                                 "rewards=[{function: 'longrl.tasks.arithmetic:format_reward'}]"])
    assert reference_placement(cfg, None) == "gpu" and reference_placement(cfg, tight) == "host"
    assert reference_placement(load_config(overrides=["lora.enabled=false", "grpo.beta=0.04",
                                                      "grpo.reference_placement=int8", "rewards=[{function: "
                                                      "'longrl.tasks.arithmetic:format_reward'}]"]), tight) == "int8"


def test_cli_plan_shows_the_reference(tmp_path, capsys):
    """`longrl plan` prints where the copy goes and its bytes among the GPU parts (the config as a user writes it)."""
    import yaml

    from longrl.cli.main import main

    settings = {"model": {"name_or_path": str(_llama_dir(tmp_path)), "dtype": "bfloat16"}, "lora": {"enabled": False},
                "grpo": {"beta": 0.04, "reference_placement": "host"}, "generation": {"max_completion_length": 1024},
                "data": {"max_prompt_length": 512}, "train": {"prompts_per_step": 2},
                "rewards": [{"function": "longrl.tasks.arithmetic:format_reward"}]}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(settings))
    assert main(["plan", str(tmp_path / "c.yaml"), "--gpu-memory-gib", "139"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"KL reference\s+host \(grpo.reference_placement\): 3\.\d\d GiB GPU, 13\.00 GiB pinned host", out)
    assert re.search(r"GPU: KL reference layer buffers\s+1\.22 GiB", out)
