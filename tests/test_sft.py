"""Supervised fine-tuning: chunked cross-entropy against full logits, trained-token masks per format and chat
template family, packed = unpacked, split invariance, and a short run that lowers held-out loss and resumes."""

import pytest
import torch

from longrl.config import Config, SFTSettings, load_config
from longrl.data.prompts import DataError
from longrl.ops.cross_entropy import chunked_cross_entropy, reference_cross_entropy
from longrl.data.sft_rows import build_examples, row_example

CE_CASES = [  # (N, H, V, chunk, smoothing, multiplier, bias, softcap)
    (1, 3, 5, 1, 0.0, 1.0, False, None),
    (7, 16, 33, 3, 0.1, 1.0, True, None),  # chunk does not divide N
    (65, 8, 101, 64, 0.2, 0.0625, False, None),  # crosses a chunk boundary by one row, a logit multiplier
    (33, 5, 17, 100, 0.0, 1.0, True, 4.0),  # chunk larger than N, softcapped logits
]


@pytest.mark.parametrize("case", CE_CASES)
def test_chunked_cross_entropy_matches_full_logits_float64(case):
    n, h, v, chunk, eps, mult, bias, cap = case
    seed = torch.seed() % 2**31
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64)
    b = torch.randn(v, generator=g, dtype=torch.float64) if bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    upstream = torch.randn(n, generator=g, dtype=torch.float64)

    def run(fn, **kw):
        hid, W = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        B = b.clone().requires_grad_(True) if b is not None else None
        loss = fn(hid, W, targets, bias=B, label_smoothing=eps, multiplier=mult, softcap=cap, **kw)
        (loss * upstream).sum().backward()
        return [loss.detach(), hid.grad, W.grad] + ([B.grad] if B is not None else [])

    for a, r in zip(run(chunked_cross_entropy, chunk_size=chunk), run(reference_cross_entropy)):
        assert torch.allclose(a, r, rtol=1e-9, atol=1e-10), f"seed {seed}"


def test_label_smoothing_with_softcap_is_refused():
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match="softcap"):
        chunked_cross_entropy(x, torch.randn(5, 4), torch.tensor([0, 1, 2]), label_smoothing=0.1, softcap=3.0)


# ------------------------------------------------------------------------------------- masks per format

def _bpe_tokenizer(template: str):
    """A byte-level BPE tokenizer trained in code on a few sentences, with ``template`` as its chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|pad|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|eot_id|>", "<s>", "</s>", "[INST]", "[/INST]"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["You are a helpful assistant.", "What is 2 plus 3? It is 5.", "system user assistant tool",
            "The capital of France is Paris. Hello there, how are you?"] * 20
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|im_end|>")
    out.chat_template = template
    return out


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = ("<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
MISTRAL = ("<s>{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
           "{% elif m['role'] == 'system' %}{{ m['content'] }}\n\n{% else %}{{ m['content'] }}</s>{% endif %}"
           "{% endfor %}")
CONVERSATION = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is 2 plus 3?"},
                {"role": "assistant", "content": "It is 5."},
                {"role": "user", "content": "The capital of France?"},
                {"role": "assistant", "content": "Paris."}]
CLOSERS = {"chatml": "<|im_end|>\n", "llama3": "<|eot_id|>", "mistral": "</s>"}


def _trained_text(tok, ex):
    return tok.decode([t for t, m in zip(ex.input_ids, ex.loss_mask) if m])


@pytest.mark.parametrize("family,template", [("chatml", CHATML), ("llama3", LLAMA3), ("mistral", MISTRAL)])
def test_assistant_only_mask_multi_turn(family, template):
    tok = _bpe_tokenizer(template)
    ex = row_example(tok, {"messages": CONVERSATION}, SFTSettings(), "row 1")
    full = tok.apply_chat_template(CONVERSATION, tokenize=False)
    assert tok.decode(ex.input_ids) == full  # the one tokenization of the rendered conversation
    closer = CLOSERS[family]
    assert _trained_text(tok, ex) == f"It is 5.{closer}Paris.{closer}"
    everything = row_example(tok, {"messages": CONVERSATION}, SFTSettings(assistant_only_loss=False), "row 1")
    assert all(everything.loss_mask) and everything.input_ids == ex.input_ids


def test_prompt_completion_and_text_rows():
    tok = _bpe_tokenizer(CHATML)
    s = SFTSettings()
    ex = row_example(tok, {"prompt": "What is 2 plus 3?", "completion": " It is 5."}, s, "row 1")
    assert _trained_text(tok, ex) == " It is 5.<|im_end|>"  # the completion and EOS
    chat = row_example(tok, {"prompt": CONVERSATION[:2], "completion": [CONVERSATION[2]]}, s, "row 1")
    assert _trained_text(tok, chat) == "It is 5.<|im_end|>\n"
    all_tokens = row_example(tok, {"prompt": "Hello", "completion": " there"}, SFTSettings(completion_only_loss=False),
                             "row 1")
    assert all(all_tokens.loss_mask)
    text = row_example(tok, {"text": "Hello there"}, s, "row 1")
    assert all(text.loss_mask) and text.input_ids[-1] == tok.eos_token_id


def test_template_that_rewrites_earlier_turns_is_refused():
    # drops every assistant turn but the last (as reasoning templates do with their thoughts)
    rewriting = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}<|im_start|>{{ m['role'] }}\n"
                 "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = _bpe_tokenizer(rewriting)
    with pytest.raises(DataError, match="row 7.*assistant_only_loss=false"):
        row_example(tok, {"messages": CONVERSATION}, SFTSettings(), "row 7")


def test_bad_rows_name_the_row_and_overlong_policy():
    tok = _bpe_tokenizer(CHATML)
    with pytest.raises(DataError, match="row 2: expected a 'messages' column"):
        build_examples(tok, [{"text": "Hello"}, {"other": 1}], SFTSettings(), "d.jsonl")
    long_row = [{"text": "Hello there, how are you? " * 20}]
    with pytest.raises(DataError, match="row 1: .* more than sft.max_length=8"):
        build_examples(tok, long_row, SFTSettings(max_length=8, overlong="error"), "d.jsonl")
    (cut,) = build_examples(tok, long_row, SFTSettings(max_length=8), "d.jsonl")
    assert len(cut.input_ids) == 8
    with pytest.raises(DataError, match="no row with a token to train on"):
        build_examples(tok, long_row, SFTSettings(max_length=8, overlong="skip"), "d.jsonl")


# ------------------------------------------------------------------------------------- the loss on a model

def _tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).double()


def _random_examples(n, seed):
    from longrl.data.sft_rows import SFTExample

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(3, 30, (1,), generator=g))
        ids = torch.randint(0, 50, (length,), generator=g).tolist()
        mask = (torch.rand(length, generator=g) < 0.6).tolist()
        mask[0], mask[-1] = False, True
        out.append(SFTExample(ids, mask))
    return out


def _loss_and_grads(model, examples, groups, packed):
    from longrl.recipes.sft import step_loss

    model.zero_grad(set_to_none=True)
    loss, _ = step_loss(model, examples, groups, pad_id=0, label_smoothing=0.1, chunk_size=7, packed=packed,
                        backward=True)
    return loss, [p.grad.clone() for p in model.parameters()]


def test_packed_equals_padded_and_split_invariance_float64():
    model = _tiny_llama()
    examples = _random_examples(5, seed=torch.seed() % 2**31)
    one = [list(range(5))]
    ref_loss, ref_grads = _loss_and_grads(model, examples, one, packed=False)
    # the reference: full logits, torch's label-smoothed cross-entropy, one padded batch
    for groups, packed in [(one, True), ([[0, 3], [1, 2, 4]], True), ([[i] for i in range(5)], False)]:
        loss, grads = _loss_and_grads(model, examples, groups, packed)
        assert abs(loss - ref_loss) < 1e-10
        for a, b in zip(grads, ref_grads):
            assert torch.allclose(a, b, rtol=1e-8, atol=1e-11)
    # and the whole-step mean equals torch's cross-entropy over every trained token of full logits
    with torch.no_grad():
        total, count = 0.0, 0
        for e in examples:
            logits = model(torch.tensor([e.input_ids])).logits[0, :-1].double()
            ce = torch.nn.functional.cross_entropy(logits, torch.tensor(e.input_ids[1:]), reduction="none",
                                                   label_smoothing=0.1)
            keep = torch.tensor(e.loss_mask[1:])
            total, count = total + float(ce[keep].sum()), count + int(keep.sum())
    assert abs(ref_loss - total / count) < 1e-10


def _sft_config(tmp_path, **over):
    cfg = load_config(None, [f"output.output_dir={tmp_path / 'run'}", "model.device=cpu", "model.dtype=float32",
                             "lora.enabled=false", "data.source=task:arithmetic_sft", "data.num_examples=400",
                             "sft.max_length=16", "sft.examples_per_step=16", "train.max_steps=16",
                             "train.learning_rate=3e-3", "train.micro_batch_size=64", "output.save_steps=8",
                             "output.progress_bar=false", "output.tensorboard=false",
                             *[f"{k}={v}" for k, v in over.items()]], recipe="sft")
    return cfg


def test_sft_run_lowers_held_out_loss_and_resume_reproduces(tmp_path):
    from longrl.compat.trl import SFTTrainer

    trainer = SFTTrainer(_sft_config(tmp_path))
    before = trainer.evaluate()["eval/loss"]
    history = trainer.train()
    after = history[-1]["eval/loss"]
    assert after < 0.5 * before  # answers of "a+b=" are learnable: held-out loss falls far
    # resume from the step-8 checkpoint: the same losses as the uninterrupted run
    import shutil

    shutil.rmtree(tmp_path / "run" / "checkpoint-16")
    resumed = SFTTrainer(_sft_config(tmp_path, **{"output.resume": "true"})).train()
    assert [m["loss"] for m in resumed] == [m["loss"] for m in history[8:]]


def test_sft_config_needs_no_rewards_and_validates():
    assert load_config(None, ["sft.max_length=64"], recipe="sft").sft.max_length == 64
    from longrl.config import ConfigError

    with pytest.raises(ConfigError, match="sft.label_smoothing"):
        load_config(None, ["sft.label_smoothing=1.5"], recipe="sft")
    assert isinstance(Config().sft, SFTSettings)


def test_sft_stops_with_a_checkpoint_on_a_signal_and_on_non_finite_steps(tmp_path, monkeypatch):
    """SFT runs under GRPO's guards: a SIGTERM during a step ends the run after it with a checkpoint, exit code
    143 and the command that resumes it; steps whose gradient norm is not finite make no update, and
    train.max_nonfinite_steps of them in a row stop the run (EXIT_GUARD) with the untouched weights saved."""
    import os
    import signal

    from longrl.training.checkpoint import latest_checkpoint, verify_checkpoint
    from longrl.training.guards import EXIT_GUARD
    from longrl.compat.trl import SFTTrainer
    from longrl.training.signals import TrainingStopped

    trainer = SFTTrainer(_sft_config(tmp_path, **{"train.max_steps": 50}))

    class TermAtStep2:
        def on_step_end(self, step, metrics):
            if step == 2:
                os.kill(os.getpid(), signal.SIGTERM)

    trainer.callbacks = [TermAtStep2()]
    with pytest.raises(TrainingStopped, match=r"stopped by SIGTERM after step 2: .*checkpoint-2; resume with: "
                                              r"longrl sft .*config.yaml output.resume=true") as stop:
        trainer.train()
    assert stop.value.exit_code == 128 + signal.SIGTERM
    assert latest_checkpoint(tmp_path / "run").name == "checkpoint-2"
    assert verify_checkpoint(tmp_path / "run" / "checkpoint-2") is None

    guarded = SFTTrainer(_sft_config(tmp_path / "g", **{"train.max_nonfinite_steps": 2}))
    before = {k: v.clone() for k, v in guarded.model.state_dict().items()}
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda params, clip: torch.tensor(float("nan")))
    with pytest.raises(TrainingStopped, match="2 steps in a row .* non-finite gradient norm") as stop:
        guarded.train()
    assert stop.value.exit_code == EXIT_GUARD
    after = guarded.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # no update from a non-finite step
    assert latest_checkpoint(tmp_path / "g" / "run").name == "checkpoint-2"
