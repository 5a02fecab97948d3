"""4-bit NF4 bases (bitsandbytes on the CPU): QLoRA learns, the dynamic 16-bit exceptions keep a damaged module
within the budget and deterministically, the keep-list is honoured, the reference pass is the 4-bit base, config
errors name the key, checkpoints resume, and the planner counts NF4 bytes."""

import importlib.util

import pytest
import torch

pytest.importorskip("bitsandbytes")
import bitsandbytes as bnb  # noqa: E402

from longrl.config import ConfigError, LoraConfig, load_config  # noqa: E402
from longrl.config.demo import demo_config  # noqa: E402
from longrl.models import ModelLoadError, base_model, build_tiny_model, calibration_ids, load_model  # noqa: E402
from longrl.models.quantize import NF4_BYTES_PER_PARAM, nf4_bytes, quantize_model  # noqa: E402
from longrl.models.policy import reference_mode, sequence_logprobs  # noqa: E402
from longrl.training.reporting import read_metrics  # noqa: E402
from longrl.compat.trl import GRPOTrainer  # noqa: E402

DAMAGED = "model.layers.1.self_attn.v_proj"


def _plant_outliers(model, name=DAMAGED, k=20.0):
    """One outlier of k·std in every block of 64 weights: NF4 scales each block by its absmax, so the other 63
    weights fall onto the few codes near zero."""
    w = model.get_submodule(name).weight
    with torch.no_grad():
        w.view(-1)[::64] = k * w.std()


def _saved_tiny(tmp_path, damaged=True):
    model, tok = build_tiny_model(seed=0)
    if damaged:
        _plant_outliers(model)
    path = tmp_path / "tiny"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _load4(path, **kw):
    kw = {"dtype": "bfloat16", "device": "cpu", "load_in_4bit": True, **kw}
    return load_model(str(path), **kw)


def test_nf4_bytes_match_bitsandbytes_storage():
    layer = torch.nn.Linear(256, 96, bias=False)
    w4 = bnb.nn.Params4bit(layer.weight.data, requires_grad=False, quant_type="nf4", compress_statistics=True).to("cpu")
    st = w4.quant_state
    stored = w4.numel() * w4.element_size() + st.absmax.numel() * st.absmax.element_size() \
        + st.state2.absmax.numel() * st.state2.absmax.element_size()
    assert st.nested and st.blocksize == 64
    assert nf4_bytes(256 * 96) == stored
    assert abs(nf4_bytes(2 ** 20) / 2 ** 20 - NF4_BYTES_PER_PARAM) < 1e-6


def test_damaged_module_kept_within_budget(tmp_path, caplog):
    path = _saved_tiny(tmp_path)
    with caplog.at_level("INFO", logger="longrl.models.quantize"):
        model, _ = _load4(path)
    report = model.longrl_quant_report
    assert report.scores[0].name == DAMAGED
    assert report.scores[0].score > 1.5 * report.scores[1].score  # the outliers stand out
    assert report.kept[DAMAGED].startswith("rank 1/")
    assert report.kept["lm_head"] == "always: LM head"
    assert 0 < report.exception_bytes <= report.budget_bytes == int(0.10 * report.plain_4bit_bytes)
    assert set(report.kept) == {DAMAGED, "lm_head"}  # one 64×64 module fits 10% here; a second would not
    assert type(model.get_submodule(DAMAGED)) is torch.nn.Linear
    assert model.get_submodule(DAMAGED).weight.dtype == torch.bfloat16
    assert isinstance(model.get_submodule("model.layers.1.self_attn.q_proj"), bnb.nn.Linear4bit)
    assert any(DAMAGED in r.message and "rank 1/" in r.message for r in caplog.records)
    # no budget: the damaged module goes to 4-bit like the rest
    plain, _ = _load4(path, quant_exception_budget=0.0)
    assert set(plain.longrl_quant_report.kept) == {"lm_head"}
    assert isinstance(plain.get_submodule(DAMAGED), bnb.nn.Linear4bit)
    # a larger budget keeps more, never over it
    wide = _load4(path, quant_exception_budget=0.5)[0].longrl_quant_report
    assert DAMAGED in wide.kept and len(wide.kept) > 2 and wide.exception_bytes <= wide.budget_bytes


def test_selection_is_deterministic_and_in_memory_path_agrees(tmp_path):
    path = _saved_tiny(tmp_path)
    a = _load4(path)[0].longrl_quant_report
    b = _load4(path)[0].longrl_quant_report
    assert [(s.name, s.weight_error, s.output_error) for s in a.scores] == \
        [(s.name, s.weight_error, s.output_error) for s in b.scores]
    assert a.kept == b.kept
    # quantizing the same weights in memory (the builtin model's and the benchmark's path) chooses the same
    model, tok = build_tiny_model(seed=0, dtype=torch.bfloat16)
    _plant_outliers(model)
    c = quantize_model(model, calibration_ids(tok))
    assert set(c.kept) == set(a.kept) and [s.name for s in c.scores] == [s.name for s in a.scores]


def test_keep_list_honoured(tmp_path):
    path = _saved_tiny(tmp_path, damaged=False)
    model, _ = _load4(path, quant_keep_modules=["model.layers.0.mlp.down_proj", "k_proj"], quant_exception_budget=0.0)
    kept = model.longrl_quant_report.kept
    assert kept["model.layers.0.mlp.down_proj"].startswith("keep-list")
    assert {n for n in kept if n.endswith("k_proj")} == {f"model.layers.{i}.self_attn.k_proj" for i in (0, 1)}
    for name in kept:
        assert type(model.get_submodule(name)) is torch.nn.Linear
    assert isinstance(model.get_submodule("model.layers.1.mlp.down_proj"), bnb.nn.Linear4bit)
    with pytest.raises(ModelLoadError, match="model.quant_keep_modules.*no_such_proj"):
        _load4(path, quant_keep_modules=["no_such_proj"])


def test_reference_pass_is_the_4bit_base(tmp_path):
    path = _saved_tiny(tmp_path, damaged=False)
    model, tok = _load4(path, lora=LoraConfig(r=4), dtype="float32")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()
    args = ([[5, 6, 7]], [[8, 9, 10]], 3)
    pol, _ = sequence_logprobs(model, *args, pad_id=0)
    with reference_mode(model):
        ref, _ = sequence_logprobs(model, *args, pad_id=0)
    plain, _ = _load4(path, lora=None, dtype="float32")  # the same quantization (deterministic), no adapters
    base_lp, _ = sequence_logprobs(plain, *args, pad_id=0)
    assert torch.equal(ref, base_lp) and not torch.allclose(pol, ref, atol=1e-3)


def test_qlora_learns_and_gradients_match_dequantized_base():
    """Supervised steps on the demo task's answers through the 4-bit base: the NLL falls, and the LoRA gradients
    equal those of the same model with each NF4 weight replaced by its dequantized 32-bit copy, also after an
    eval-mode no-grad pass (generation) that would make bitsandbytes repack the CPU weights."""
    from longrl.rollout.hf_generate import generate_completions
    from longrl.config.schema import GenerationConfig

    model, tok = load_model("builtin:tiny-arith", lora=LoraConfig(r=8, alpha=16), device="cpu", load_in_4bit=True)
    assert isinstance(base_model(model).model.layers[0].mlp.up_proj.base_layer, bnb.nn.Linear4bit)
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    pairs = [(f"{a}+{b}=", f"{a + b}") for a, b in [(1, 2), (3, 4), (2, 5), (6, 1), (4, 4), (0, 7)]]
    prompts = [[tok.bos_token_id] + enc(p) for p, _ in pairs]
    answers = [enc(c) + [tok.eos_token_id] for _, c in pairs]
    width = max(len(a) for a in answers)
    generate_completions(model, tok, prompts[:2], 2, GenerationConfig(max_completion_length=3), torch.device("cpu"))

    def nll():
        lp, _ = sequence_logprobs(model, prompts, answers, width, pad_id=tok.pad_token_id)
        return -lp.sum() / sum(len(a) for a in answers)

    params = [p for p in model.parameters() if p.requires_grad]
    loss = nll()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    reference = _dequantized_copy(model)
    lp, _ = sequence_logprobs(reference, prompts, answers, width, pad_id=tok.pad_token_id)
    (-lp.sum() / sum(len(a) for a in answers)).backward()
    for n, p in reference.named_parameters():
        if p.requires_grad:
            assert torch.allclose(grads[n], p.grad, rtol=1e-4, atol=1e-6), n
    opt = torch.optim.Adam(params, lr=3e-3)
    first = float(loss.detach())
    for _ in range(30):
        opt.zero_grad()
        loss = nll()
        loss.backward()
        opt.step()
    last = float(nll().detach())
    assert last < 0.7 * first, (first, last)  # 2.92 → 1.83 (the frozen random LM head bounds it: ~1.8 in 16-bit)


def _dequantized_copy(model):
    import copy

    import bitsandbytes.functional as bnbF

    ref = copy.deepcopy(model)
    for name, m in list(ref.named_modules()):
        if isinstance(m, bnb.nn.Linear4bit):
            lin = torch.nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
            weight = bnbF.dequantize_4bit(m.weight.data, m.weight.quant_state)
            lin.weight = torch.nn.Parameter(weight, requires_grad=False)
            parent, _, child = name.rpartition(".")
            setattr(ref.get_submodule(parent), child, lin)
    return ref


QUICK = ["train.prompts_per_step=4", "grpo.num_generations=4", "train.micro_batch_size=8", "output.progress_bar=false",
         "output.tensorboard=false", "model.load_in_4bit=true", "lora.enabled=true", "model.quant_exception_budget=0.3",
         "grpo.beta=0.05", "model.offload_activations=true"]


def test_qlora_grpo_resume_reproduces_uninterrupted_run(tmp_path):
    """GRPO on a 4-bit base with the reference pass (beta > 0) and offloaded checkpointing; a run resumed from its
    step-2 checkpoint logs the same metrics as an uninterrupted one."""
    def cfg(out, *extra):
        overrides = QUICK + [f"output.output_dir={out}", "output.save_steps=2", *extra]
        return load_config(None, overrides, base=demo_config())

    full = GRPOTrainer(cfg(tmp_path / "full", "train.max_steps=4")).train()
    assert all(m["kl"] is not None and m["grad_norm"] > 0 for m in full)
    GRPOTrainer(cfg(tmp_path / "cut", "train.max_steps=2")).train()
    GRPOTrainer(cfg(tmp_path / "cut", "train.max_steps=4", "output.resume=true")).train()
    strip = lambda ms: [{k: v for k, v in m.items() if not k.endswith("time_s")} for m in ms]  # noqa: E731
    assert strip(read_metrics(tmp_path / "cut")) == strip(full)
    assert (tmp_path / "cut" / "checkpoint-4" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("overrides, key", [
    (["model.load_in_4bit=true", "lora.enabled=false"], "model.load_in_4bit"),
    (["model.quant_exception_budget=-0.1"], "model.quant_exception_budget"),
    (["model.load_in_4bit=maybe"], "model.load_in_4bit"),
    (["model.quant_calibration_text=' '"], "model.quant_calibration_text"),
])
def test_config_errors_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, overrides, base=demo_config())


def test_missing_bitsandbytes_names_the_key(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(ModelLoadError, match=r"model\.load_in_4bit.*bitsandbytes"):
        load_model("builtin:tiny-arith", device="cpu", load_in_4bit=True)


def test_planner_counts_nf4_weights():
    from transformers import LlamaConfig

    from longrl.memory.planner import GIB, ModelShape, plan_for_config

    llama8b = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)
    over = ["data.max_prompt_length=512", "generation.max_completion_length=19968", "train.prompts_per_step=1",
            "grpo.num_generations=8", "model.offload_activations=true", "model.dtype=bfloat16", "lora.enabled=true",
            "model.no_recompute_layers=0"]  # (else both fill the planner's share with layers kept whole)
    bf16 = plan_for_config(load_config(None, over, base=demo_config()), llama8b, 139 * GIB, 500 * GIB)
    q = plan_for_config(load_config(None, over + ["model.load_in_4bit=true"], base=demo_config()), llama8b,
                        139 * GIB, 500 * GIB)
    shape = ModelShape.from_config(llama8b)
    plain = shape.linear_params() * NF4_BYTES_PER_PARAM + (shape.base_params() - shape.linear_params()) * 2
    weights = q.parts_gpu_bytes["base weights (NF4 4-bit)"]
    assert weights == int(plain * 1.10) and 5.5 < weights / GIB < 6.0  # ≤ 10% exceptions over 5.3 GiB plain 4-bit
    assert bf16.parts_gpu_bytes["base weights"] / GIB > 14.9
    # the weights' ~9.1 GiB less, minus what only the 4-bit step holds (a dequantized weight, the block scales)
    assert bf16.predicted_gpu_bytes - q.predicted_gpu_bytes > 8.5 * GIB


def test_bf16_qlora_keeps_activations_in_the_compute_dtype():
    """A bf16-compute 4-bit base runs under autocast: the LoRA layers see and return bf16 activations (no float32
    copy of each input), while the adapter weights and their gradients stay float32."""
    model, tok = load_model("builtin:tiny-arith", lora=LoraConfig(r=4), device="cpu", load_in_4bit=True,
                            dtype="bfloat16", quant_exception_budget=0.5)
    seen = set()
    for name, m in model.named_modules():
        if name.endswith("lora_A.default"):
            m.register_forward_hook(lambda m, a, o: seen.add((a[0].dtype, o.dtype, m.weight.dtype)))
    kinds = {type(m.base_layer).__name__ for m in model.modules() if hasattr(m, "lora_A")}
    assert kinds == {"Linear4bit", "Linear"}  # NF4 layers and 16-bit exceptions both carry adapters
    lp, _ = sequence_logprobs(model, [[1, 5, 14, 6, 17]], [[11, 2]], 2, pad_id=0)
    lp.sum().backward()
    assert seen == {(torch.bfloat16, torch.bfloat16, torch.float32)}
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads.values())
    assert all(g.abs().sum() > 0 for n, g in grads.items() if "lora_B" in n)  # lora_A's is 0 while B is 0


def test_calibration_batch_from_text_or_vocabulary():
    tok = build_tiny_model()[1]
    drawn = calibration_ids(tok)
    assert drawn.shape == (8, 64) and torch.equal(drawn, calibration_ids(tok))  # fixed seed
    assert not set(drawn.unique().tolist()) & set(tok.all_special_ids)
    text = calibration_ids(tok, "12+30=42 ")
    assert tok.decode(text[0, :9].tolist()) == "12+30=42 " and text.shape == (8, 64)
    with pytest.raises(ModelLoadError, match="model.quant_calibration_text"):
        load_model("builtin:tiny-arith", device="cpu", load_in_4bit=True, quant_calibration_text="")
