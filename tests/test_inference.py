"""Sampling from and scoring checkpoints (``longrl generate``, ``longrl eval``, :func:`longrl.training.evaluation.evaluate`),
the unbiased pass@k, the example dataset and rewards, and the micro-batch layouts giving the same loss."""

import itertools
import json
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from longrl.cli.main import main
from longrl.config import load_config
from longrl.config.demo import demo_config
from longrl.training.evaluation import evaluate, k_values, pass_at_k
from longrl.compat.trl import GRPOTrainer

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
QUICK = ["train.max_steps=2", "train.prompts_per_step=4", "grpo.num_generations=4", "train.micro_batch_size=8",
         "output.progress_bar=false", "output.report_to=[none]"]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """A run of the demo (2 steps; LoRA so that the checkpoint is an adapter on the builtin base) and its config."""
    out = tmp_path_factory.mktemp("run")
    cfg = load_config(None, QUICK + [f"output.output_dir={out / 'out'}", "lora.enabled=true"], base=demo_config())
    GRPOTrainer(cfg).train()
    config = out / "run.yaml"
    config.write_text(cfg.to_yaml())
    return out / "out", config


def test_pass_at_k_is_the_fraction_of_k_subsets_with_a_pass():
    """The closed form against its definition: over every k-subset of n samples, the share holding a pass."""
    for n in range(1, 7):
        for c in range(n + 1):
            for k in range(1, n + 1):
                subsets = list(itertools.combinations([1] * c + [0] * (n - c), k))
                expected = Fraction(sum(any(s) for s in subsets), len(subsets))
                assert abs(pass_at_k(n, c, k) - float(expected)) < 1e-12, (n, c, k)
    assert k_values(8) == [1, 2, 4, 8] and k_values(6) == [1, 2, 4, 6] and k_values(1) == [1]
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_evaluate_aggregates_what_it_sampled(demo_run):
    """evaluate()'s means and pass@k recomputed from the scored samples it returns (grouped n per prompt)."""
    from longrl.training.evaluation import load_eval_prompts, read_eval_rows
    from longrl.cli.inference import load_checkpoint_model
    from longrl.rewards import RewardScorer

    out, config = demo_run
    cfg = load_config(config, ["data.eval_source=task:arithmetic", "data.eval_num_examples=5"])
    model, tokenizer, _ = load_checkpoint_model(str(out), "cpu")
    data = load_eval_prompts(cfg, tokenizer, read_eval_rows(cfg))
    n, threshold = 4, 0.5
    result = evaluate(model, tokenizer, RewardScorer.from_specs(cfg.rewards), data, cfg.generation,
                      num_generations=n, pass_threshold=threshold, keep_samples=10_000, prompts_per_batch=2)
    assert len(result.samples) == 5 * n and result.metrics["eval/num_prompts"] == 5
    for f in ("format_reward", "answer_reward"):
        values = [s["rewards"][f] for s in result.samples]
        assert result.metrics[f"eval/rewards/{f}"] == pytest.approx(sum(values) / len(values))
        for k in (1, 2, 4):
            per_prompt = [pass_at_k(n, sum(v >= threshold for v in values[i:i + n]), k)
                          for i in range(0, len(values), n)]
            assert result.metrics[f"eval/pass@{k}/{f}"] == pytest.approx(sum(per_prompt) / 5)
    again = evaluate(model, tokenizer, RewardScorer.from_specs(cfg.rewards), data, cfg.generation,
                     num_generations=n, pass_threshold=threshold, prompts_per_batch=2)
    assert again.metrics == result.metrics  # fixed eval seeds: the same draws each time


def test_generate_prints_each_prompts_samples(demo_run, capsys, tmp_path):
    out, _ = demo_run
    assert main(["generate", "--from", str(out), "--prompt", "3+4=", "--n", "3", "--max-new-tokens", "4"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("=== prompt 1/1: 3+4=\n") and text.count("--- sample ") == 3
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "1+1="}\n{"prompt": "2+2="}\n{"prompt": "0+1="}\n')
    assert main(["generate", "--from", str(out / "checkpoint-2"), "--data", str(data), "--limit", "2", "--n", "2",
                 "--jsonl", "--temperature", "0"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(r["prompt"], r["sample"]) for r in rows] == [("1+1=", 1), ("1+1=", 2), ("2+2=", 1), ("2+2=", 2)]
    assert rows[0]["completion"] == rows[1]["completion"]  # temperature 0: greedy
    assert all(1 <= r["tokens"] <= 256 for r in rows)


def test_generate_and_eval_refuse_bad_requests_clearly(demo_run, capsys, tmp_path):
    out, config = demo_run
    assert main(["generate", "--from", str(tmp_path / "nothing"), "--prompt", "1+1="]) == 2
    assert "nothing: not found (a run, a checkpoint-STEP directory, a model directory" in capsys.readouterr().err
    assert main(["generate", "--from", str(out)]) == 2
    assert "one of --prompt TEXT or --data FILE" in capsys.readouterr().err
    assert main(["eval", str(config), "--from", str(out)]) == 2
    assert "no held-out prompts: pass --data FILE or set data.eval_source" in capsys.readouterr().err
    assert main(["eval", str(config), "--from", str(out), "--data", str(tmp_path / "missing.jsonl")]) == 2
    assert "--data: dataset file not found" in capsys.readouterr().err


def test_eval_cli_reports_mean_reward_and_pass_at_k(demo_run, capsys, tmp_path):
    out, config = demo_run
    data = tmp_path / "held_out.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": a + b}) + "\n"
                            for a in range(3) for b in (1, 4)))
    report = tmp_path / "eval.json"
    assert main(["eval", str(config), "--from", str(out), "--data", str(data), "--n", "4",
                 "--output", str(report)]) == 0
    text = capsys.readouterr().out
    assert "on 6 prompts × 4 samples" in text and "pass: reward >= 1" in text and "eval/pass@4/answer_reward" in text
    metrics = json.loads(report.read_text())
    assert metrics["eval/num_prompts"] == 6 and metrics["checkpoint"].endswith("checkpoint-2")
    for f in ("format_reward", "answer_reward"):
        assert 0.0 <= metrics[f"eval/pass@1/{f}"] <= metrics[f"eval/pass@4/{f}"] <= 1.0


def test_chat_prompts_follow_the_run_and_the_template():
    from longrl.cli.inference import as_prompt
    from longrl.models import build_char_tokenizer

    tok = build_char_tokenizer()  # has a chat template
    assert as_prompt("1+1=", tok, chat=True) == [{"role": "user", "content": "1+1="}]
    assert as_prompt("1+1=", tok, chat=False) == "1+1="
    messages = [{"role": "user", "content": "2+2="}]
    assert as_prompt(messages, tok, chat=False) is messages
    tok.chat_template = None
    assert as_prompt("1+1=", tok, chat=True) == "1+1="  # no template: the text as it is


def test_example_dataset_and_rewards_load_and_score():
    from longrl.config.schema import DataConfig, RewardSpec
    from longrl.data.prompts import read_prompt_rows
    from longrl.rewards import RewardScorer

    rows = read_prompt_rows(DataConfig(source=str(EXAMPLES / "prompts.jsonl")))
    assert len(rows) >= 8 and all(isinstance(r["prompt"], list) and r["prompt"][-1]["role"] == "user" for r in rows)
    scorer = RewardScorer.from_specs([RewardSpec(f"{EXAMPLES / 'rewards.py'}:correct_answer", 1.0),
                                      RewardSpec(f"{EXAMPLES / 'rewards.py'}:number_only", 0.2)])
    completions = [[{"role": "assistant", "content": "7"}], [{"role": "assistant", "content": "It is 8."}]]
    per_function, total, failures = scorer.score([rows[0]["prompt"]] * 2, completions,
                                                 {"answer": ["7", "7"], "truncated": [False, False]})
    assert not failures and per_function.tolist() == [[1.0, 1.0], [0.0, 0.0]]
    assert total.tolist() == pytest.approx([1.2, 0.0])


def test_padded_and_packed_micro_batches_give_the_same_loss_and_gradients(tmp_path):
    """The CPU default (padded rows) and CUDA's (one packed row) on one rollout batch of unequal lengths: the same
    loss and gradients to float64 rounding (relative 1e-12), micro-batches of 3 completions, KL and clipping on."""
    from longrl.models import build_tiny_model

    model, tok = build_tiny_model(seed=0, dtype=torch.float64)
    from longrl.models import apply_lora
    from longrl.config.schema import LoraConfig

    model = apply_lora(model, LoraConfig(r=4))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    cfg = load_config(None, QUICK + [f"output.output_dir={tmp_path}", "lora.enabled=true", "grpo.beta=0.1",
                                     "train.micro_batch_size=3", "generation.max_completion_length=6",
                                     "grpo.num_iterations=2", "train.max_steps=2", "generation.backend=hf"],
                      base=demo_config())  # hf: the sampler runs 16- and 32-bit models, not float64
    trainer = GRPOTrainer(cfg, model=model, tokenizer=tok)
    batch = trainer._rollout_batch()
    assert len({len(c) for c in batch.completion_ids}) > 1  # unequal lengths: packing and padding differ
    trainer.optimizer.step = trainer.scheduler.step = lambda *a, **k: None  # the weights stay where they are
    results = {}
    for packed in (True, False):
        trainer.padding_free = packed
        stats = trainer._policy_update(batch)
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        results[packed] = (stats, grads)
    (s1, g1), (s0, g0) = results[True], results[False]
    assert s1["loss"] == pytest.approx(s0["loss"], rel=1e-12, abs=1e-15)
    assert s1["kl"] == pytest.approx(s0["kl"], rel=1e-12, abs=1e-15)
    assert g1.keys() == g0.keys() and g1
    for n in g1:
        assert torch.allclose(g1[n], g0[n], rtol=1e-12, atol=1e-15), n
    assert GRPOTrainer(cfg, model=model, tokenizer=tok).padding_free is False  # the CPU default: padded rows


def test_train_generate_and_eval_build_the_same_sampler(tmp_path, monkeypatch, capsys):
    """Every generation.* key the trainer's sampler takes reaches the samplers of ``longrl generate`` and ``longrl
    eval`` (all three go through rollout.completions.build_sampler): the Sampler arguments recorded on the three
    paths, with non-default keys and a GPU budget, are equal and are the config's."""
    import longrl.rollout.completions as completions

    built = []

    class RecordingSampler(completions.Sampler):
        def __init__(self, model, tokenizer=None, **kwargs):
            built.append(kwargs)
            super().__init__(model, tokenizer, **kwargs)

    monkeypatch.setattr(completions, "Sampler", RecordingSampler)
    keys = ["generation.kv_cache_dtype=fp8", "generation.kv_cache_gib=0.25", "generation.sync_every=3",
            "generation.cuda_graphs=false", "generation.fast_decode=false", "generation.fuse_lora=false",
            "generation.nf4_kernel=false", "generation.pack_projections=false", "train.gpu_memory_gib=7",
            "generation.speculative=ngram", "generation.max_draft_tokens=3", "generation.speculative_schedule=bytes",
            "generation.min_decode_batch=4"]
    out = tmp_path / "out"
    cfg = load_config(None, QUICK + ["train.max_steps=1", f"output.output_dir={out}", "lora.enabled=true"] + keys,
                      base=demo_config())
    GRPOTrainer(cfg).train()
    config = tmp_path / "run.yaml"
    config.write_text(cfg.to_yaml())
    assert main(["generate", "--from", str(out), "--prompt", "1+1=", "--n", "2", "--max-new-tokens", "3"]) == 0
    data = tmp_path / "held_out.jsonl"
    data.write_text('{"prompt": "1+2=", "answer": 3}\n')
    assert main(["eval", str(config), "--from", str(out), "--data", str(data), "--n", "2"]) == 0
    capsys.readouterr()
    expected = dict(kv_cache_bytes=2**28, memory_cap_bytes=7 * 2**30, kv_cache_dtype="fp8", cuda_graphs=False,
                    sync_every=3, min_decode_batch=4, fast_decode=False, fuse_lora=False, nf4_kernel=False,
                    nf4_halves=False, pack_projections=False, speculative="ngram", max_draft_tokens=3,
                    speculative_schedule="bytes")
    assert built == [expected] * 3  # the trainer's, generate's and eval's


@pytest.mark.parametrize("argv, named", [
    (["generate", "--from", "RUN", "--prompt", "1+1=", "--temperature", "-1"], "argument --temperature: expected a finite number >= 0"),
    (["generate", "--from", "RUN", "--prompt", "1+1=", "--temperature", "nan"], "argument --temperature: expected a finite number >= 0"),
    (["generate", "--from", "RUN", "--prompt", ""], "argument --prompt: expected a non-empty prompt"),
    (["generate", "--from", "RUN", "--data", "p.jsonl", "--limit", "-5"], "argument --limit: expected an integer >= 0"),
    (["generate", "--from", "RUN", "--prompt", "x", "--n", "0"], "argument --n: expected an integer >= 1"),
    (["eval", "run.yaml", "--from", "RUN", "--pass-threshold", "nan"], "argument --pass-threshold: expected a finite number"),
    (["eval", "run.yaml", "--from", "RUN", "--output", "."], "argument --output: . is a directory; give the JSON file"),
    (["eval", "run.yaml", "--from", "RUN", "--output", "no/such/folder/m.json"], "argument --output: the folder of"),
    (["generate", "--from", "RUN", "--prompt", "x", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_argument_errors_exit_2_naming_the_argument(argv, named, capsys):
    """Refused as the command line is read: before a config, a checkpoint or a model is touched."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2 and named in capsys.readouterr().err


def test_overrides_go_anywhere_on_the_command_line(demo_run, capsys, tmp_path):
    out, config = demo_run
    data = tmp_path / "held_out.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": a + 1}) + "\n" for a in range(5)))
    assert main(["eval", str(config), "--from", str(out), "--data", str(data), "--n", "1",
                 "data.eval_num_examples=2", "generation.temperature=0"]) == 0
    assert "on 2 prompts × 1 samples" in (text := capsys.readouterr().out) and "; greedy)" in text
    assert main(["generate", "--from", str(out), "--prompt", "2+2=", "--jsonl", "generation.max_completion_length=2",
                 "--n", "2", "generation.temperature=0"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert all(r["tokens"] <= 2 for r in rows) and rows[0]["completion"] == rows[1]["completion"]
    assert main(["generate", "--from", str(out), "--prompt", "2+2=", "train.max_steps=3"]) == 2
    assert "generate takes generation.* overrides (a run's model is rebuilt as it trained)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["export", "x", "--from", str(out), "--format", "adapter", "train.max_steps=3"])
    assert "`longrl export` takes no KEY=VALUE overrides" in capsys.readouterr().err


def test_generate_and_eval_score_a_plain_model_directory(demo_run, capsys, tmp_path):
    """``--from`` a model that is not a run: the demo run exported merged, scored on the prompts its run's config
    names, and a directory that is neither refused naming both readings."""
    out, config = demo_run
    merged = tmp_path / "merged"
    assert main(["export", str(merged), "--from", str(out), "--format", "merged", "--dtype", "float32"]) == 0
    data = tmp_path / "held_out.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+2=", "answer": a + 2}) + "\n" for a in range(4)))
    report = tmp_path / "m.json"
    assert main(["eval", str(config), "--from", str(merged), "--data", str(data), "--n", "2",
                 "--output", str(report)]) == 0
    assert f"eval of {merged} on 4 prompts × 2 samples" in capsys.readouterr().out
    assert json.loads(report.read_text())["model"] == str(merged)
    assert main(["generate", "--from", str(merged), "--prompt", "3+4=", "--n", "2", "--jsonl",
                 "model.dtype=float32", "generation.max_completion_length=3"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2
    (tmp_path / "neither").mkdir()
    (tmp_path / "neither" / "notes.txt").write_text("hi")
    assert main(["generate", "--from", str(tmp_path / "neither"), "--prompt", "1+1="]) == 2
    err = capsys.readouterr().err
    assert "has no config.json: not a Hugging Face model directory and not a longrl run" in err
