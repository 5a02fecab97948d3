"""Loading causal LMs of several families from local directories, LoRA defaults, logit specs, and that
the model's own logits agree with the chunked log-prob path (softcapping, scaling, temperature)."""

import pytest
import torch

from longrl.config.schema import LoraConfig
from longrl.models import ModelLoadError, build_char_tokenizer, load_model, model_parts
from longrl.models.policy import sequence_logprobs

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64)


def _configs():
    from transformers import Gemma2Config, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config

    return {
        "llama": LlamaConfig(**SMALL),
        "qwen2": Qwen2Config(**SMALL),
        "qwen3": Qwen3Config(**SMALL, head_dim=8),
        "mistral": MistralConfig(**SMALL),
        "phi3": Phi3Config(**SMALL),
        "gemma2": Gemma2Config(**SMALL, head_dim=8, final_logit_softcapping=3.0, query_pre_attn_scalar=8),
    }


def _save_tiny(tmp_path, name, cfg):
    from transformers import AutoModelForCausalLM

    tok = build_char_tokenizer()
    cfg.vocab_size = len(tok)
    cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id = tok.pad_token_id, tok.eos_token_id, tok.bos_token_id
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    path = tmp_path / name
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2"])
def test_load_with_lora_and_logprobs_match_model_logits(tmp_path, family):
    path = _save_tiny(tmp_path, family, _configs()[family])
    model, tok = load_model(str(path), lora=LoraConfig(r=4, alpha=8), dtype="float32", device="cpu")
    assert hasattr(model, "peft_config")
    wrapped = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if hasattr(m, "lora_A")}
    plain, _ = load_model(str(path), lora=None, dtype="float32", device="cpu")
    linear = {name.rsplit(".", 1)[-1] for name, m in plain.model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert wrapped == linear and "lm_head" not in wrapped  # default: every linear projection of the decoder
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # the chunked path on the backbone equals log_softmax of the model's own (softcapped) logits at temperature T
    prompts, completions = [[5, 6, 14], [7]], [[8, 9, 2], [10, 11, 12, 13]]
    temp = 0.7
    got, _ = sequence_logprobs(model, prompts, completions, 4, pad_id=tok.pad_token_id, temperature=temp, chunk_size=3)
    model.eval()
    for i, (p, c) in enumerate(zip(prompts, completions)):
        logits = model(input_ids=torch.tensor([p + c])).logits[0].double() / temp
        want = torch.log_softmax(logits, -1)[len(p) - 1:len(p) + len(c) - 1].gather(1, torch.tensor(c)[:, None])[:, 0]
        assert torch.allclose(got[i, :len(c)].double(), want, atol=1e-5), family
        assert torch.all(got[i, len(c):] == 0)
    if family == "gemma2":
        assert model_parts(model)[2].softcap == 3.0


def test_missing_model_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="model directory not found"):
        load_model(str(tmp_path / "nope"), device="cpu")


def test_directory_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path / "empty"), device="cpu")


def test_unknown_lora_target(tmp_path):
    path = _save_tiny(tmp_path, "llama", _configs()["llama"])
    with pytest.raises(ModelLoadError, match="lora.target_modules"):
        load_model(str(path), lora=LoraConfig(target_modules=["no_such_proj"]), device="cpu")


def test_reference_mode_disables_adapters(tmp_path):
    from longrl.models.policy import reference_mode

    path = _save_tiny(tmp_path, "llama", _configs()["llama"])
    model, tok = load_model(str(path), lora=LoraConfig(r=4), dtype="float32", device="cpu")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()
    args = ([[5, 6]], [[7, 8]], 2)
    pol, _ = sequence_logprobs(model, *args, pad_id=0)
    with reference_mode(model):
        ref, _ = sequence_logprobs(model, *args, pad_id=0)
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    base_lp, _ = sequence_logprobs(base, *args, pad_id=0)
    assert torch.allclose(ref, base_lp, atol=1e-6) and not torch.allclose(pol, ref, atol=1e-3)


def test_lora_on_a_bf16_base_casts_inputs_only_outside_autocast(tmp_path):
    """float32 adapters on a bf16 base: under autocast (longrl's forwards) PEFT's float32 copy of each LoRA input is
    skipped; outside it (a user's model.generate after training) the cast is on, as a plain PEFT model has it."""
    import peft
    from transformers import AutoModelForCausalLM

    from longrl.models import set_lora_input_casting
    from longrl.models.policy import compute_context

    path = _save_tiny(tmp_path, "llama", _configs()["llama"])
    model, tok = load_model(str(path), lora=LoraConfig(r=4, alpha=8), dtype="bfloat16", device="cpu")
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.float32}
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()
    ids = torch.tensor([[5, 6, 14, 7, 8, 9]])
    # outside autocast: runs, and equals PEFT's own model (its cast always on) exactly
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    plain = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, plain(input_ids=ids).logits)
        out = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 9)
    # under autocast: the adapters' A products receive the bf16 input itself (no float32 copy), as with the cast
    # always off; with PEFT's default (always on) they receive float32 copies
    seen = []
    hooks = [m.register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype))
             for n, m in model.named_modules() if n.endswith("lora_A.default")]
    assert len(hooks) == 14  # 7 projections x 2 decoder layers
    dtypes, logits = {}, {}
    for mode in (None, False, True):
        set_lora_input_casting(model, mode)
        seen.clear()
        with torch.no_grad(), compute_context(model):
            logits[mode] = model(input_ids=ids).logits
        dtypes[mode] = set(seen)
    assert dtypes == {None: {torch.bfloat16}, False: {torch.bfloat16}, True: {torch.float32}}
    assert torch.equal(logits[None], logits[False])
    set_lora_input_casting(model, None)
    seen.clear()
    with torch.no_grad():
        model(input_ids=ids)
    assert set(seen) == {torch.float32}  # outside autocast again: cast
