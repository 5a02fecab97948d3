"""``longrl export`` on the CPU: adapter and merged exports reproduce the trained model's logits, GGUF tensors
read back with the gguf reader equal the merged weights (f16 after fp16 rounding, q8_0 within 0.57 of a
quantization step), the tokenizer and chat template round-trip, a 4-bit base merges into its dequantized weights, and bad
inputs fail before any output appears."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from longrl.training.checkpoint import save_checkpoint
from longrl.config import Config, load_config
from longrl.config.demo import demo_config
from longrl.export import ExportError, export_checkpoint, read_checkpoint
from longrl.export.gguf_writer import unpermute_qk
from longrl.models import build_char_tokenizer
from longrl.compat.trl import GRPOTrainer

gguf = pytest.importorskip("gguf")

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64)
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
IDS = torch.tensor([[1, 5, 9, 14, 3, 7, 11, 2]])


def _bpe_tokenizer():
    """A byte-level BPE tokenizer trained in code, with ChatML special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(["the quick brown fox jumps over the lazy dog; 12 + 30 = 42"] * 20, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>")
    tok.chat_template = CHATML
    return tok


def _save_base(path, family):
    from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig, Qwen3Config

    tok = _bpe_tokenizer()
    cfg = {"llama": lambda: LlamaConfig(**SMALL), "qwen3": lambda: Qwen3Config(**SMALL, head_dim=16),
           "gemma2": lambda: Gemma2Config(**SMALL, head_dim=16)}[family]()
    cfg.vocab_size = len(tok) + 5  # padded embedding rows, as many hub models have
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _checkpoint_with_random_lora(tmp_path, family):
    """A checkpoint written by save_checkpoint for a LoRA model on a local base, with random nonzero adapters."""
    from longrl.config.schema import LoraConfig
    from longrl.models import load_model

    base = _save_base(tmp_path / f"base-{family}", family)
    model, _ = load_model(str(base), lora=LoraConfig(r=4, alpha=8), dtype="float32", device="cpu")
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.2)
    cfg = Config()
    cfg.model.name_or_path, cfg.model.dtype = str(base), "float32"
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    state = {"data_position": 0, "config": cfg.to_dict(), "model_dtype": "float32"}
    path = save_checkpoint(tmp_path / f"run-{family}", 1, model, opt, sched, state)
    return path, model.eval()


def varied_reward(root) -> str:
    """A rewards override whose values differ within a group almost surely (the demo task's rewards are all
    zero for a random model's first steps, which would leave the adapter untrained)."""
    path = root / "varied_reward.py"
    path.write_text("def token_sum(completions, completion_ids, **kwargs):\n"
                    "    return [float(sum(ids) % 7) for ids in completion_ids]\n")
    return f"rewards=[{{function: '{path}:token_sum'}}]"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """Two real GRPO steps of the builtin demo model with LoRA (a high learning rate so the adapter matters)."""
    root = tmp_path_factory.mktemp("tiny-run")
    out = root / "run"  # the run's own directory: the reward file stays outside it
    cfg = load_config(None, ["train.max_steps=2", "train.prompts_per_step=2", "grpo.num_generations=4",
                             "train.micro_batch_size=8", "output.progress_bar=false", "output.tensorboard=false",
                             "lora.enabled=true", "lora.r=4", "train.learning_rate=0.05", varied_reward(root),
                             f"output.output_dir={out}"], base=demo_config())
    trainer = GRPOTrainer(cfg)
    trainer.train()
    return out / "checkpoint-2", trainer.model.eval()


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory):
    return _checkpoint_with_random_lora(tmp_path_factory.mktemp("llama"), "llama")


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def test_adapter_export_loads_with_peft_and_gives_trained_logits(tiny_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt, trained = tiny_run
    out = export_checkpoint(ckpt, tmp_path / "adapter", fmt="adapter")
    base = AutoModelForCausalLM.from_pretrained(out / "base_model")  # the builtin base ships beside its adapter
    loaded = PeftModel.from_pretrained(base, out).eval()
    assert torch.allclose(_logits(loaded), _logits(trained), atol=1e-5, rtol=0)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok("3+4=")["input_ids"] == build_char_tokenizer()("3+4=")["input_ids"]
    meta = json.loads((out / "longrl_export.json").read_text())
    assert meta["format"] == "adapter" and meta["base_model"] == "builtin:tiny-arith" and meta["step"] == 2
    assert (out / "README.md").is_file()


def test_builtin_base_is_saved_and_reloaded_exactly(tiny_run):
    """The checkpoint carries the builtin base, so export does not depend on the seed reproducing it."""
    from longrl.export.source import load_base

    ckpt, trained = tiny_run
    assert (ckpt / "base_model.safetensors").is_file()
    base = load_base(read_checkpoint(ckpt))
    want = {k.replace(".base_layer.", "."): v for k, v in trained.get_base_model().state_dict().items() if "lora_" not in k}
    assert set(base.state_dict()) == set(want)
    assert all(torch.equal(v, want[k]) for k, v in base.state_dict().items())


def test_merged_export_loads_with_transformers_and_gives_trained_logits(tiny_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt, trained = tiny_run
    want = _logits(trained)
    # the merge changed the weights: the adapter is not a no-op
    with trained.disable_adapter():
        assert (_logits(trained) - want).abs().max() > 1e-2
    exact = AutoModelForCausalLM.from_pretrained(export_checkpoint(ckpt, tmp_path / "f32", fmt="merged", dtype="float32"))
    assert torch.allclose(_logits(exact), want, atol=1e-4, rtol=0)  # float32: merge rounding only
    out = export_checkpoint(ckpt, tmp_path / "merged", fmt="merged")  # default: bfloat16
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert merged.dtype == torch.bfloat16 and not hasattr(merged, "peft_config")
    assert (_logits(merged) - want).abs().max() < 0.05  # bf16 weights (8-bit mantissa) on logits of size ~1
    assert AutoTokenizer.from_pretrained(out).chat_template == build_char_tokenizer().chat_template


def _read_gguf(path):
    reader = gguf.GGUFReader(path)
    tensors = {}
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF lists the fastest dimension first
        tensors[t.name] = (gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape), t.tensor_type)
    return reader, tensors


def _field(reader, key):
    return reader.fields[key].contents()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("quant", ["f16", "q8_0"])
def test_gguf_tensors_and_tokenizer_round_trip(tmp_path, family, quant):
    from longrl.export.source import merged_model

    ckpt, _ = _checkpoint_with_random_lora(tmp_path, family)
    out = export_checkpoint(ckpt, tmp_path / "gguf", fmt="gguf", quant=quant)
    merged = merged_model(read_checkpoint(ckpt))
    cfg, tok = merged.config, _bpe_tokenizer()
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA if family == "llama" else gguf.MODEL_ARCH.QWEN3, 2)
    reader, tensors = _read_gguf(out / "model.gguf")
    assert _field(reader, "general.architecture") == family
    assert _field(reader, f"{family}.attention.head_count_kv") == 2
    assert _field(reader, f"{family}.block_count") == 2
    state = merged.state_dict()
    assert len(tensors) == len(state)
    for hf_name, want in state.items():
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        got, qtype = tensors[gguf_name]
        got = torch.from_numpy(np.ascontiguousarray(got)).float()
        if family == "llama" and "q_proj" in hf_name:
            got = unpermute_qk(got, cfg.num_attention_heads)
        if family == "llama" and "k_proj" in hf_name:
            got = unpermute_qk(got, cfg.num_key_value_heads)
        if want.dim() == 1:  # norms stay float32
            assert qtype == gguf.GGMLQuantizationType.F32 and torch.equal(got, want), hf_name
        elif quant == "f16":
            assert qtype == gguf.GGMLQuantizationType.F16 and torch.equal(got, want.half().float()), hf_name
        else:  # q8_0: half a quantization step (block absmax / 127) plus the fp16 rounding of the block
            assert qtype == gguf.GGMLQuantizationType.Q8_0, hf_name  # scale (<= 127 * 2^-11 steps): 0.57 steps
            step = want.reshape(-1, 32).abs().amax(1, keepdim=True) / 127
            err = (got - want).reshape(-1, 32).abs()
            assert (err <= 0.57 * step + 1e-8).all() and err.max() > 0, hf_name
    if family == "llama":  # the permutation is real: q rows differ from the HF order
        q = torch.from_numpy(np.ascontiguousarray(tensors["blk.0.attn_q.weight"][0])).float()
        assert not torch.allclose(q, state["model.layers.0.self_attn.q_proj.weight"], atol=0.05)
    # tokenizer metadata
    vocab = {i: t for t, i in tok.get_vocab().items()}
    tokens = _field(reader, "tokenizer.ggml.tokens")
    assert len(tokens) == cfg.vocab_size and tokens[:len(tok)] == [vocab[i] for i in range(len(tok))]
    assert tokens[len(tok):] == [f"[PAD{i}]" for i in range(len(tok), cfg.vocab_size)]
    types = _field(reader, "tokenizer.ggml.token_type")
    assert types[tok.convert_tokens_to_ids("<|im_end|>")] == gguf.TokenType.CONTROL
    assert types[tok.convert_tokens_to_ids("the")] == gguf.TokenType.NORMAL
    assert _field(reader, "tokenizer.ggml.model") == "gpt2"
    assert len(_field(reader, "tokenizer.ggml.merges")) == len(json.loads(tok.backend_tokenizer.to_str())["model"]["merges"])
    assert _field(reader, "tokenizer.ggml.eos_token_id") == tok.eos_token_id
    assert _field(reader, "tokenizer.ggml.bos_token_id") == tok.bos_token_id
    assert _field(reader, "tokenizer.chat_template") == CHATML


def test_modelfile_template_and_stops(llama_ckpt, tmp_path):
    from longrl.export.go_template import render
    from longrl.export.modelfile import ollama_data

    ckpt, _ = llama_ckpt
    out = export_checkpoint(ckpt, tmp_path / "gguf", fmt="gguf")
    text = (out / "Modelfile").read_text()
    assert text.startswith("FROM ./model.gguf\n")
    assert 'PARAMETER stop "<|im_end|>"' in text and "PARAMETER temperature 0\n" in text  # the base decodes greedily
    template = text.split('TEMPLATE """', 1)[1].split('"""', 1)[0]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "6+7?"},
            {"role": "assistant", "content": "13"}, {"role": "user", "content": "2*3?"}]
    want = _bpe_tokenizer().apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert render(template, ollama_data(chat)) == want  # rendered with Go semantics, as Ollama feeds a chat
    assert want.endswith("<|im_end|>\n<|im_start|>user\n2*3?<|im_end|>\n<|im_start|>assistant\n")


def test_gguf_of_the_builtin_model_writes_its_characters_as_byte_level_tokens(tiny_run, tmp_path):
    ckpt, _ = tiny_run
    out = export_checkpoint(ckpt, tmp_path / "gguf", fmt="gguf", quant="q8_0")
    reader, tensors = _read_gguf(out / "model.gguf")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    assert tokens[:4] == ["<pad>", "<bos>", "<eos>", "<unk>"] and "Ġ" in tokens and "7" in tokens
    assert tensors["token_embd.weight"][1] == gguf.GGMLQuantizationType.Q8_0
    assert 'PARAMETER stop "<eos>"' in (out / "Modelfile").read_text()


def test_gguf_of_a_trained_demo_checkpoint_runs_in_llama_cpp(tiny_run, tmp_path):
    """`longrl demo`'s checkpoint as a GGUF: llama.cpp loads it (it refused the vocabulary before), tokenizes the
    prompt as the demo does and computes the trained model's logits within f16 rounding."""
    llama_cpp = pytest.importorskip("llama_cpp")
    ckpt, trained = tiny_run
    out = export_checkpoint(ckpt, tmp_path / "gguf", fmt="gguf")
    llm = llama_cpp.Llama(model_path=str(out / "model.gguf"), n_ctx=64, logits_all=True, verbose=False, n_threads=1)
    prompt = "12+30= "
    ids = build_char_tokenizer()(prompt)["input_ids"]
    assert llm.tokenize(prompt.encode(), add_bos=True, special=True) == ids
    llm.eval(ids)
    want = _logits(trained, torch.tensor([ids]))[0].numpy()
    got = np.asarray(llm.scores[:len(ids)])
    assert np.abs(got - want).max() < 2e-3 * max(np.abs(want).max(), 1.0)


def test_unsupported_architecture_is_refused_before_any_output(tmp_path):
    ckpt, _ = _checkpoint_with_random_lora(tmp_path, "gemma2")
    with pytest.raises(ExportError, match="architecture 'gemma2'"):
        export_checkpoint(ckpt, tmp_path / "out", fmt="gguf")
    assert not (tmp_path / "out").exists()


def test_missing_or_invalid_checkpoint_names_the_path(tmp_path):
    with pytest.raises(ExportError, match=f"checkpoint not found: {tmp_path / 'nope'}"):
        export_checkpoint(tmp_path / "nope", tmp_path / "out", fmt="merged")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExportError, match="is not a longrl checkpoint"):
        export_checkpoint(tmp_path / "empty", tmp_path / "out", fmt="merged")
    broken = tmp_path / "run" / "checkpoint-3"
    broken.mkdir(parents=True)
    (broken / "trainer_state.json").write_text(json.dumps({"step": 3, "config": Config().to_dict()}))
    with pytest.raises(ExportError, match=f"checkpoint {broken} is incomplete: missing config.json"):
        export_checkpoint(broken, tmp_path / "out", fmt="merged")
    assert not (tmp_path / "out").exists()


def test_failure_mid_write_leaves_no_output(llama_ckpt, tmp_path, monkeypatch):
    import longrl.export.gguf_writer as writer

    def failing(path, *args, **kwargs):
        path.write_bytes(b"GGUF half")
        raise RuntimeError("disk full")

    monkeypatch.setattr(writer, "write_gguf", failing)
    with pytest.raises(RuntimeError, match="disk full"):
        export_checkpoint(llama_ckpt[0], tmp_path / "out", fmt="gguf")
    assert list(tmp_path.iterdir()) == []  # neither the output nor the staging directory


def test_non_empty_output_needs_overwrite_and_a_previous_export(llama_ckpt, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    for overwrite in (False, True):  # a user's files are never replaced (tests/test_export_destination.py: runs)
        with pytest.raises(ExportError, match="not empty and is not a longrl export"):
            export_checkpoint(llama_ckpt[0], out, fmt="adapter", overwrite=overwrite)
    assert (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    export_checkpoint(llama_ckpt[0], out, fmt="adapter")
    with pytest.raises(ExportError, match="not empty \\(a previous export\\); pass --overwrite"):
        export_checkpoint(llama_ckpt[0], out, fmt="adapter")
    export_checkpoint(llama_ckpt[0], out, fmt="merged", overwrite=True)
    assert not (out / "adapter_model.safetensors").exists() and (out / "model.safetensors").is_file()
    ckpt = Path(llama_ckpt[0])
    for inside in (ckpt, ckpt.parent):  # the checkpoint itself or its run directory: refused, nothing removed
        with pytest.raises(ExportError, match="holds the checkpoint"):
            export_checkpoint(ckpt, inside, fmt="adapter", overwrite=True)
    assert (ckpt / "trainer_state.json").is_file()


def test_output_that_holds_the_current_directory_is_refused(llama_ckpt, tmp_path, monkeypatch):
    """`longrl export .` inside the target (it raised a raw OSError when renaming over the working directory)."""
    target = tmp_path / "target"
    (target / "sub").mkdir(parents=True)
    (target / "keep.txt").write_text("mine")
    for cwd in (target, target / "sub"):
        monkeypatch.chdir(cwd)
        for name in (".", str(target), ".." if cwd != target else "."):
            with pytest.raises(ExportError, match="current directory"):
                export_checkpoint(llama_ckpt[0], name, fmt="adapter", overwrite=True)
    assert (target / "keep.txt").read_text() == "mine" and not list(tmp_path.glob(".*tmp*"))
    monkeypatch.chdir(tmp_path)
    out = export_checkpoint(llama_ckpt[0], "target/sub/../exported", fmt="adapter")  # a relative name: fine
    assert (target / "exported" / "adapter_model.safetensors").is_file() and out.is_absolute()



def test_output_named_through_a_parent_is_the_parent(llama_ckpt, tmp_path):
    """`runs/new/..` names runs: the export goes there (its name was "..", and the rename raised a raw OSError)."""
    out = export_checkpoint(llama_ckpt[0], str(tmp_path / "exported" / "sub" / ".."), fmt="adapter")
    assert out == tmp_path / "exported" and (out / "adapter_model.safetensors").is_file()
    assert not (out / "sub").exists() and not list(tmp_path.glob(".*tmp*"))

def test_full_weight_checkpoint_merges_and_refuses_adapter(tmp_path):
    from transformers import AutoModelForCausalLM

    from longrl.models import build_tiny_model

    model, _ = build_tiny_model(seed=3)
    cfg = load_config(None, ["lora.enabled=false"], base=demo_config())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = save_checkpoint(tmp_path / "run", 1, model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0),
                           {"data_position": 0, "config": cfg.to_dict(), "model_dtype": "float32"})
    with pytest.raises(ExportError, match="holds full weights"):
        export_checkpoint(ckpt, tmp_path / "a", fmt="adapter")
    out = export_checkpoint(tmp_path / "run", tmp_path / "m", fmt="merged", dtype="float32")  # run dir: latest
    assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(out)), _logits(model.eval()))


def test_cli_export(llama_ckpt, tmp_path, capsys):
    from longrl.cli.main import main

    assert main(["export", str(tmp_path / "out"), "--from", str(llama_ckpt[0]), "--format", "gguf",
                 "--quant", "q8_0"]) == 0
    assert (tmp_path / "out" / "model.gguf").is_file() and (tmp_path / "out" / "Modelfile").is_file()
    assert main(["export", str(tmp_path / "x"), "--from", str(tmp_path / "missing"), "--format", "merged"]) == 2
    assert f"checkpoint not found: {tmp_path / 'missing'}" in capsys.readouterr().err


@pytest.mark.parametrize("warm", [False, True])
def test_4bit_base_merges_into_dequantized_weights(llama_ckpt, monkeypatch, warm):
    """A base whose linear layers are bitsandbytes NF4: the merge adds the adapter to the dequantized weights,
    so the merged float model reproduces the 4-bit model's logits (PEFT's own merge re-quantizes: worse).
    ``warm``: the base has already run a forward on the CPU (as a calibrating loader does), which repacks it."""
    bnb = pytest.importorskip("bitsandbytes")
    import peft

    import longrl.export.source as source

    ckpt_path, _ = llama_ckpt
    ckpt = read_checkpoint(ckpt_path)

    def base_4bit(ckpt, device="cpu"):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(ckpt.base_name)
        for name, mod in list(model.model.named_modules()):
            if isinstance(mod, torch.nn.Linear):
                q = bnb.nn.Linear4bit(mod.in_features, mod.out_features, bias=False, compute_dtype=torch.float32,
                                      quant_type="nf4")
                q.weight = bnb.nn.Params4bit(mod.weight.data.clone(), requires_grad=False, quant_type="nf4")
                parent, _, child = name.rpartition(".")
                setattr(model.model.get_submodule(parent), child, q.to("cpu"))
        model.is_loaded_in_4bit = True
        if warm:
            _logits(model)
        return model

    monkeypatch.setattr(source, "load_base", base_4bit)
    trained_4bit = peft.PeftModel.from_pretrained(base_4bit(ckpt), str(ckpt_path)).eval()
    assert type(trained_4bit.base_model.model.model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"
    want = _logits(trained_4bit)
    merged = source.merged_model(ckpt)
    assert not any(isinstance(m, bnb.nn.Linear4bit) for m in merged.modules())
    # exact: merged weight = dequantized NF4 weight + the LoRA delta (scaling * B @ A)
    layer = trained_4bit.base_model.model.model.layers[0].self_attn.q_proj
    delta = layer.scaling["default"] * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    fresh = base_4bit(ckpt).model.layers[0].self_attn.q_proj.weight  # (the CPU kernel repacks a layer it has run)
    if not warm:
        dequantized = bnb.functional.dequantize_4bit(fresh.data, fresh.quant_state)
        assert torch.allclose(merged.model.layers[0].self_attn.q_proj.weight, dequantized + delta, atol=1e-6,
                              rtol=0)
    # logits: bitsandbytes' CPU 4-bit kernel computes in bfloat16, hence 1e-2 on logits of size ~0.7; PEFT's own
    # merge into a 4-bit layer re-quantizes the sum and is off by far more
    err = (_logits(merged) - want).abs().max()
    assert err < 1e-2
    requantized = trained_4bit.merge_and_unload()
    assert (_logits(requantized) - want).abs().max() > 10 * err


def test_qlora_checkpoint_exports_merged_with_trained_logits(tmp_path):
    """End to end: one QLoRA step of the demo model (4-bit base) and a float32 merged export of it."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM

    from longrl.models import base_model

    cfg = load_config(None, ["train.max_steps=1", "train.prompts_per_step=2", "grpo.num_generations=4",
                             "train.micro_batch_size=8", "output.progress_bar=false", "output.tensorboard=false",
                             "lora.enabled=true", "lora.r=4", "train.learning_rate=0.05", "model.load_in_4bit=true",
                             varied_reward(tmp_path), f"output.output_dir={tmp_path / 'run'}"], base=demo_config())
    trainer = GRPOTrainer(cfg)
    trainer.train()
    trained = trainer.model.eval()
    want = _logits(trained)
    with trained.disable_adapter():
        assert (_logits(trained) - want).abs().max() > 1e-2
    state = json.loads((tmp_path / "run" / "checkpoint-1" / "trainer_state.json").read_text())
    assert state["quant_kept"] == sorted(base_model(trained).longrl_quant_report.kept)  # export rebuilds this set
    merged = AutoModelForCausalLM.from_pretrained(
        export_checkpoint(tmp_path / "run", tmp_path / "merged", fmt="merged", dtype="float32"))
    assert torch.allclose(_logits(merged), want, atol=1e-4, rtol=0)


def test_missing_gguf_package_is_named(llama_ckpt, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf now raises ImportError
    with pytest.raises(ExportError, match=r'pip install -e "\.\[export\]" in a longrl checkout, or pip install "longrl\[export\]"'):
        export_checkpoint(llama_ckpt[0], tmp_path / "out", fmt="gguf")
    assert not (tmp_path / "out").exists()
