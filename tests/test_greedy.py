"""``generation.temperature: 0`` is greedy decoding everywhere: longrl's sampler and transformers' generate path
give the argmax continuation of a plain forward loop (the reference), the config accepts 0 and refuses negative
and non-finite temperatures, and a run at temperature 0 trains (log-probs at temperature 1, as the sampler reports
them) and evaluates greedily (every sample of a prompt the same, so pass@1 = pass@n)."""

import pytest
import torch

from longrl.config import ConfigError, load_config
from longrl.config.demo import demo_config
from longrl.config.schema import GenerationConfig
from longrl.models import build_tiny_model
from longrl.rollout import Sampler, SamplingParams
from longrl.rollout.completions import sample, sampling_params

PROMPTS = ["3+4=", "12+30=", "7*8=", "1"]
STEPS = 6


def _argmax_reference(model, ids: list[int], steps: int) -> list[int]:
    """The plain twin: the whole sequence through the model each step, the most likely next token appended."""
    ids = list(ids)
    out = []
    with torch.no_grad():
        for _ in range(steps):
            nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            out.append(nxt)
            ids.append(nxt)
    return out


@pytest.mark.parametrize("backend", ["longrl", "hf"])
def test_temperature_zero_is_argmax_decoding(backend):
    model, tok = build_tiny_model(seed=3)
    model.eval()
    prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    gen = GenerationConfig(temperature=0.0, max_completion_length=STEPS, ignore_eos=True, backend=backend)
    params = sampling_params(gen, tok, seed=11)
    assert params.greedy and params.stop_token_ids == ()
    sampler = Sampler(model, tok) if backend == "longrl" else None
    rollout = sample(model, tok, prompt_ids, 2, gen, params, sampler, torch.device("cpu"))
    want = [_argmax_reference(model, ids, STEPS) for ids in prompt_ids for _ in range(2)]
    assert rollout.completion_ids == want
    again = sample(model, tok, prompt_ids, 2, gen, sampling_params(gen, tok, seed=99), sampler, torch.device("cpu"))
    assert again.completion_ids == want  # the seed plays no part


def test_the_sampler_reports_greedy_log_probs_at_temperature_one():
    from longrl.rollout.sampling import logprob_temperature

    model, tok = build_tiny_model(seed=3)
    ids = tok("3+4=", add_special_tokens=False)["input_ids"]
    rollout = Sampler(model, tok).generate([ids], 1, SamplingParams(max_new_tokens=3, temperature=0))
    with torch.no_grad():
        full = torch.tensor([ids + rollout.completion_ids[0]])
        logp = torch.log_softmax(model(input_ids=full).logits[0].double(), -1)
    want = [float(logp[len(ids) - 1 + i, t]) for i, t in enumerate(rollout.completion_ids[0])]
    assert [float(x) for x in rollout.logprobs[0]] == pytest.approx(want, abs=1e-4)
    assert logprob_temperature(0.0) == 1.0 and logprob_temperature(0.7) == 0.7


def test_the_config_takes_zero_and_refuses_negative_or_non_finite_temperatures():
    assert load_config(None, ["generation.temperature=0"], base=demo_config()).generation.temperature == 0
    with pytest.raises(ConfigError, match=r"'generation.temperature': got -1.0; allowed: a finite number >= 0 \(0: gr"):
        load_config(None, ["generation.temperature=-1"], base=demo_config())
    for value in (".nan", ".inf"):  # refused as the value is read
        with pytest.raises(ConfigError, match=r"'generation.temperature': got (nan|inf).*a finite number"):
            load_config(None, [f"generation.temperature={value}"], base=demo_config())


def test_a_run_at_temperature_zero_trains_and_evaluates_greedily(tmp_path):
    from longrl.recipes.grpo import GRPOTrainer

    cfg = load_config(None, ["generation.temperature=0", "train.max_steps=1", "train.prompts_per_step=4",
                             "grpo.num_generations=2", "output.progress_bar=false", "output.report_to=[none]",
                             "data.eval_source=task:arithmetic", "data.eval_num_examples=6",
                             "output.eval_num_generations=3", f"output.output_dir={tmp_path / 'out'}"],
                      base=demo_config())
    trainer = GRPOTrainer(cfg)
    history = trainer.train()
    assert len(history) == 1 and all(v == v for v in history[0].values() if isinstance(v, float))  # no NaN
    metrics = trainer.evaluate().metrics
    for f in ("format_reward", "answer_reward"):  # a prompt's 3 samples are one: c is 0 or 3
        assert metrics[f"eval/pass@1/{f}"] == pytest.approx(metrics[f"eval/pass@3/{f}"])
