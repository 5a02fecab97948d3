"""GGUF files as models (``model.name_or_path: model.gguf``, ``--from model.gguf``), on small GGUFs written here by
longrl's own exporter from a model built in code, so every value has a reference: the weights loaded back equal
the original's rounded to f16 (then to the run's dtype), the tokenizer read from the file's metadata tokenizes as
the original and renders the same chat template; a run on a GGUF base records the file, and export, generate and
eval find it again and refuse it once it changed. (The real quantized model is in test_real_model.py.)"""

import json
import shutil

import pytest
import torch

from export_tokenizers import FIXED_STRINGS, TOKENIZERS
from longrl.cli.main import main
from longrl.config import load_config
from longrl.config.demo import demo_config
from longrl.models import ModelLoadError, load_model

pytest.importorskip("gguf")

QUICK = ["train.max_steps=2", "train.prompts_per_step=2", "grpo.num_generations=2", "train.micro_batch_size=4",
         "output.progress_bar=false", "output.report_to=[none]", "output.save_steps=2"]
CHAT = [{"role": "user", "content": "What is 6 plus 7?"}, {"role": "assistant", "content": "13"},
        {"role": "user", "content": "And 12 + 30?"}]


def _small_model(tok):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, vocab_size=len(tok),
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).float().eval()


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    """(path of an f16 GGUF, the model it was written from, its tokenizer): a Llama with a ChatML BPE tokenizer."""
    from longrl.export.gguf_writer import write_gguf

    tok = TOKENIZERS["qwen2"]()
    model = _small_model(tok)
    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    write_gguf(path, model, tok, "f16")
    from longrl.models.gguf import GgufError, load_gguf_tokenizer

    try:
        load_gguf_tokenizer(path)
    except GgufError as e:  # transformers 5.17 reads the qwen2 vocabulary with GPT-2's split: refused, rightly
        if "read it as" in str(e):
            pytest.skip(str(e))
        raise
    return path, model, tok


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_gguf_loads_dequantized_to_the_run_dtype_with_its_tokenizer(small_gguf, dtype):
    path, original, tok = small_gguf
    model, loaded_tok = load_model(str(path), dtype=dtype, device="cpu")
    want_dtype = getattr(torch, dtype)
    assert getattr(model, "hf_quantizer", None) is None and model.dtype == want_dtype  # a plain model
    loaded = model.state_dict()
    for name, weight in original.state_dict().items():
        want = weight.half().to(want_dtype)  # the file holds f16 matrices; norms stay float32 in the file
        got = loaded[name]
        assert got.dtype == want_dtype, name
        assert torch.equal(got, want) or torch.equal(got, weight.to(want_dtype)), name
    for text in FIXED_STRINGS:
        assert loaded_tok(text)["input_ids"] == tok(text)["input_ids"], text
    assert loaded_tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == \
        tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert model.longrl_gguf["sha256"] and model.longrl_gguf["bytes"] == path.stat().st_size


def test_bad_gguf_references_fail_before_loading_naming_the_file(tmp_path, small_gguf):
    with pytest.raises(ModelLoadError, match="GGUF file not found: .*missing.gguf"):
        load_model(str(tmp_path / "missing.gguf"), device="cpu")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ModelLoadError, match="junk.gguf is not a GGUF file: it starts with b'PK"):
        load_model(str(junk), device="cpu")
    (tmp_path / "dir.gguf").mkdir()
    with pytest.raises(ModelLoadError, match="dir.gguf is not a file"):
        load_model(str(tmp_path / "dir.gguf"), device="cpu")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(small_gguf[0].read_bytes()[:4096])  # the header of a file cut short
    with pytest.raises(ModelLoadError, match="cut.gguf"):
        load_model(str(cut), device="cpu")


@pytest.fixture(scope="module")
def gguf_run(small_gguf, tmp_path_factory):
    """A 2-step LoRA GRPO run (`longrl train`) whose base is the GGUF file, and its config."""
    path = small_gguf[0]
    root = tmp_path_factory.mktemp("run")
    config = root / "run.yaml"
    cfg = load_config(None, QUICK + [f"model.name_or_path={path}", "lora.enabled=true",
                                     f"output.output_dir={root / 'out'}"], base=demo_config())
    config.write_text(cfg.to_yaml())
    assert main(["train", str(config)]) == 0
    return root / "out", config


def test_a_checkpoint_records_its_gguf_base(gguf_run, small_gguf):
    from longrl.models.files import file_sha256

    out, _ = gguf_run
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    path = small_gguf[0]
    assert state["base_gguf"] == {"path": str(path.resolve()), "bytes": path.stat().st_size,
                                  "sha256": file_sha256(path)}


def test_generate_and_eval_take_the_gguf_or_the_run_trained_on_it(gguf_run, small_gguf, capsys, tmp_path):
    out, config = gguf_run
    path = small_gguf[0]
    for source in (str(path), str(out)):
        assert main(["generate", "--from", source, "--prompt", "3+4=", "--n", "2", "--max-new-tokens", "3",
                     "--chat", "no", "--jsonl", "--device", "cpu"]) == 0
        rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
        assert [r["sample"] for r in rows] == [1, 2] and all(1 <= r["tokens"] <= 3 for r in rows)
    data = tmp_path / "held_out.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": a + 1}) + "\n" for a in range(3)))
    report = tmp_path / "base.json"
    assert main(["eval", str(config), "--from", str(path), "--data", str(data), "--n", "2", "--output",
                 str(report), "generation.max_completion_length=3"]) == 0  # an override after the flags
    assert f"eval of {path} on 3 prompts × 2 samples" in capsys.readouterr().out
    metrics = json.loads(report.read_text())
    assert metrics["model"] == str(path) and metrics["eval/num_prompts"] == 3


def test_a_changed_or_moved_gguf_base_is_found_or_refused(gguf_run, small_gguf, tmp_path, monkeypatch, capsys):
    from longrl.export import read_checkpoint

    out, _ = gguf_run
    path = small_gguf[0]
    copy = tmp_path / "run-copy"
    shutil.copytree(out, copy)
    state_file = copy / "checkpoint-2" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["config"]["model"]["name_or_path"] = "small.gguf"  # as written relative to another working directory
    state_file.write_text(json.dumps(state))
    from longrl.training.checkpoint import write_manifest

    write_manifest(copy / "checkpoint-2")
    monkeypatch.chdir(tmp_path)
    assert read_checkpoint(copy).base_name == str(path.resolve())  # the recorded absolute path
    saved = path.read_bytes()
    try:
        path.write_bytes(saved[:-1] + bytes([saved[-1] ^ 1]))  # one bit of the file changed
        assert main(["generate", "--from", str(out), "--prompt", "1+1=", "--device", "cpu"]) == 2
        assert "is not the file it trained on" in capsys.readouterr().err
    finally:
        path.write_bytes(saved)


def test_export_merges_an_adapter_into_the_gguf_base(gguf_run, tmp_path):
    from transformers import AutoModelForCausalLM

    from longrl.cli.inference import load_checkpoint_model

    out, _ = gguf_run
    assert main(["export", str(tmp_path / "merged"), "--from", str(out), "--format", "merged",
                 "--dtype", "float32"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    trained, tok, _ = load_checkpoint_model(str(out), "cpu")
    ids = torch.tensor([tok("What is 6 plus 7?")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, trained(input_ids=ids).logits, atol=1e-4, rtol=1e-4)


def test_plan_reads_a_gguf_config_and_refuses_a_missing_file(small_gguf, tmp_path, capsys):
    path = small_gguf[0]
    for name, code in ((path, 0), (tmp_path / "missing.gguf", 2)):
        config = tmp_path / "run.yaml"
        config.write_text(load_config(None, [f"model.name_or_path={name}"], base=demo_config()).to_yaml())
        assert main(["plan", str(config), "--gpu-memory-gib", "24"]) == code
    captured = capsys.readouterr()
    assert f"plan for {path}" in captured.out and "GGUF file not found" in captured.err


def test_a_gguf_without_the_gguf_package_names_the_extra(small_gguf, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf now raises ImportError
    with pytest.raises(ModelLoadError, match=r'needs the gguf package: pip install -e "\.\[export\]"'):
        load_model(str(small_gguf[0]), device="cpu")


def test_special_tokens_follow_the_files_ids():
    """The tokenizer's special tokens are the ones the file's metadata names, whatever transformers made of them
    (transformers 5.17 gave SmolLM2's GGUF the EOS <|im_start|>; its file says id 2, <|im_end|>); ids outside the
    vocabulary are left alone."""
    from longrl.models import build_char_tokenizer
    from longrl.models.gguf import _set_special_tokens

    tok = build_char_tokenizer()
    assert (tok.eos_token, tok.pad_token) == ("<eos>", "<pad>")
    _set_special_tokens(tok, {"eos": tok.convert_tokens_to_ids("="), "pad": 1, "unk": 10_000})
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token_id, tok.unk_token) == ("=", tok.convert_tokens_to_ids("="),
                                                                                  1, "<unk>")


def test_a_vocabulary_read_with_another_split_than_its_file_names_is_refused():
    """A byte-level vocabulary is checked against the llama.cpp pre-tokenizer its file names: the Qwen 2 tokenizer
    passes as qwen2, is refused as llama-bpe, and so is the same vocabulary with GPT-2's split (how transformers
    5.17 reads a qwen2 GGUF); files of other vocabularies or unknown pre-tokenizers are not judged."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from longrl.models.gguf import GgufError, check_pre_tokenizer

    tok = TOKENIZERS["qwen2"]()
    check_pre_tokenizer("q.gguf", "gpt2", "qwen2", tok)
    check_pre_tokenizer("q.gguf", "llama", "llama-bpe", tok)  # a SentencePiece-style file: not this check's
    check_pre_tokenizer("q.gguf", "gpt2", "smollm", tok)  # a name this check does not know
    with pytest.raises(GgufError, match=r"q.gguf: .*'llama-bpe' pre-tokenizer .* read it as 'qwen2'"):
        check_pre_tokenizer("q.gguf", "gpt2", "llama-bpe", tok)
    state = json.loads(tok.backend_tokenizer.to_str())
    state["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                              "use_regex": True}
    as_gpt2 = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(state)))
    with pytest.raises(GgufError, match=r"'qwen2' pre-tokenizer .* read it as 'gpt-2'"):
        check_pre_tokenizer("q.gguf", "gpt2", "qwen2", as_gpt2)


def test_a_metadata_copy_holds_every_key_with_the_ones_set(small_gguf, tmp_path):
    """The tokenizer-only copy read where transformers needs a BOS id the file does not name: every metadata key
    and value of the file, the set keys changed, no tensors."""
    import gguf

    from longrl.models.gguf import _metadata_copy

    path, _, _ = small_gguf
    out = tmp_path / "copy.gguf"
    _metadata_copy(path, out, {"tokenizer.ggml.bos_token_id": 5})
    src, dst = gguf.GGUFReader(str(path)), gguf.GGUFReader(str(out))
    assert len(dst.tensors) == 0 and len(src.tensors) > 0
    want = {k: f.contents() for k, f in src.fields.items() if not k.startswith("GGUF.")}
    got = {k: f.contents() for k, f in dst.fields.items() if not k.startswith("GGUF.")}
    assert got.pop("tokenizer.ggml.bos_token_id") == 5
    want.pop("tokenizer.ggml.bos_token_id", None)
    assert got == want and "tokenizer.ggml.tokens" in got
