"""Range and consistency checks of a whole Config, beyond the types loading.py already enforces.

``validate`` runs one check function per section, in a fixed order, and stops at the first failure with a
:class:`ConfigError` of the form ``config key 'KEY': got VALUE; allowed: WHAT``. The grpo checks run first: the
train and output checks divide by grpo.num_iterations × grpo.steps_per_generation, which they guarantee is >= 1.
Host-memory floors (limits.py) come last.
"""

from __future__ import annotations

import math
import re
import urllib.parse

from .errors import ConfigError
from .limits import check_sizes
from .schema import Config

DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?|mps|xpu(:\d+)?")


def _check(cond: bool, key: str, value, allowed: str) -> None:
    if not cond:
        raise ConfigError(f"config key '{key}': got {value!r}; allowed: {allowed}")


def _steps_per_rollout(cfg: Config) -> tuple[int, str]:
    """Optimizer steps one rollout batch feeds (num_iterations × steps_per_generation), and how to name them."""
    g = cfg.grpo
    named = (f"grpo.num_iterations × grpo.steps_per_generation ({g.num_iterations} × {g.steps_per_generation})"
             if g.steps_per_generation > 1 else f"grpo.num_iterations ({g.num_iterations})")
    return g.num_iterations * g.steps_per_generation, named


def _check_grpo(cfg: Config) -> None:
    g = cfg.grpo
    _check(g.num_generations >= 2, "grpo.num_generations", g.num_generations, "an integer >= 2 (advantages compare a group)")
    _check(g.beta >= 0, "grpo.beta", g.beta, ">= 0")
    _check(0 <= g.epsilon < 1, "grpo.epsilon", g.epsilon, "0 <= epsilon < 1")
    _check(g.epsilon_high is None or g.epsilon_high > 0, "grpo.epsilon_high", g.epsilon_high, "null or > 0")
    _check(g.delta is None or g.delta > 1, "grpo.delta", g.delta, "null or > 1")
    _check(g.num_iterations >= 1, "grpo.num_iterations", g.num_iterations, "an integer >= 1")
    _check(g.steps_per_generation >= 1, "grpo.steps_per_generation", g.steps_per_generation, "an integer >= 1")
    _check(g.rollout_correction_cap >= 1, "grpo.rollout_correction_cap", g.rollout_correction_cap, ">= 1")
    _check(g.reference_placement == "auto" or not cfg.lora.enabled, "grpo.reference_placement",
           g.reference_placement, "auto with lora.enabled=true (the reference is then the base with the adapters "
           "disabled: no copy is kept to place)")


def _check_loss_options(cfg: Config) -> None:
    """The loss menu's hyper-parameters (docs/losses.md)."""
    g = cfg.grpo
    for key in ("sapo_temperature_neg", "sapo_temperature_pos", "vespo_lambda_pos", "vespo_lambda_neg"):
        _check(getattr(g, key) > 0, f"grpo.{key}", getattr(g, key), "> 0")
    for key in ("vespo_k_pos", "vespo_k_neg"):
        _check(getattr(g, key) >= 0, f"grpo.{key}", getattr(g, key), ">= 0")
    _check(math.isfinite(g.entropy_coef), "grpo.entropy_coef", g.entropy_coef,
           "a finite number (> 0 rewards entropy; 0 disables the bonus)")
    _check(0 <= g.top_entropy_quantile <= 1, "grpo.top_entropy_quantile", g.top_entropy_quantile,
           "0 <= ρ <= 1 (1 keeps every token; 0.2 the top fifth by entropy, as the paper recommends)")
    _check(g.off_policy_mask_threshold is None or g.off_policy_mask_threshold > 0, "grpo.off_policy_mask_threshold",
           g.off_policy_mask_threshold, "null (off) or > 0 (e.g. 0.5)")
    _check(g.loss_type != "vespo" or g.rollout_correction in ("none", "token_truncate", "token_mask")
           or cfg.generation.backend != "longrl", "grpo.rollout_correction", g.rollout_correction,
           "none, token_truncate or token_mask with loss_type=vespo (vespo folds the per-token sampler weights "
           "into its own sequence weight)")


def _check_train(cfg: Config) -> None:
    t = cfg.train
    per_rollout, rollout_steps = _steps_per_rollout(cfg)
    _check(t.max_steps >= 1, "train.max_steps", t.max_steps, "an integer >= 1")
    _check(t.max_steps % per_rollout == 0, "train.max_steps", t.max_steps,
           f"a multiple of {rollout_steps}: the last step saves a checkpoint, which must fall between rollout batches")
    _check(0 <= t.adam_beta1 < 1, "train.adam_beta1", t.adam_beta1, "0 <= beta1 < 1")
    _check(0 <= t.adam_beta2 < 1, "train.adam_beta2", t.adam_beta2, "0 <= beta2 < 1")
    _check(t.weight_decay >= 0, "train.weight_decay", t.weight_decay, ">= 0")
    _check(t.prompts_per_step >= 1, "train.prompts_per_step", t.prompts_per_step, "an integer >= 1")
    _check(t.micro_batch_size >= 1, "train.micro_batch_size", t.micro_batch_size, "an integer >= 1")
    _check(0 < t.learning_rate <= 1, "train.learning_rate", t.learning_rate, "0 < learning_rate <= 1")
    _check(t.max_nonfinite_steps >= 1, "train.max_nonfinite_steps", t.max_nonfinite_steps, "an integer >= 1")
    _check(t.max_no_signal_steps >= 0, "train.max_no_signal_steps", t.max_no_signal_steps, "an integer >= 0 (0: never)")
    _check(t.warmup_steps >= 0, "train.warmup_steps", t.warmup_steps, ">= 0")
    _check(t.max_grad_norm >= 0, "train.max_grad_norm", t.max_grad_norm, ">= 0 (0 disables clipping)")
    _check(t.micro_batch_tokens >= 0, "train.micro_batch_tokens", t.micro_batch_tokens, ">= 0 (0: use micro_batch_size)")
    _check(t.logprob_chunk_size >= 1, "train.logprob_chunk_size", t.logprob_chunk_size, "an integer >= 1")
    _check(t.mlp_tile_tokens is None or t.mlp_tile_tokens >= 0, "train.mlp_tile_tokens", t.mlp_tile_tokens,
           "null (the planner decides), 0 (off) or a tile size >= 1")
    _check(t.shared_prompt is None or isinstance(t.shared_prompt, bool), "train.shared_prompt", t.shared_prompt,
           "null (the planner decides), true or false")
    _check(t.gpu_memory_gib >= 0, "train.gpu_memory_gib", t.gpu_memory_gib, ">= 0 (0: all free GPU memory)")
    _check(t.cpu_threads >= 0, "train.cpu_threads", t.cpu_threads, "an integer >= 0 (0: automatic)")


def _check_generation(cfg: Config) -> None:
    gen = cfg.generation
    _check(gen.max_completion_length >= 1, "generation.max_completion_length", gen.max_completion_length, ">= 1")
    _check(math.isfinite(gen.temperature) and gen.temperature >= 0, "generation.temperature", gen.temperature,
           "a finite number >= 0 (0: greedy decoding)")
    _check(0 < gen.top_p <= 1, "generation.top_p", gen.top_p, "0 < top_p <= 1")
    _check(gen.top_k >= 0, "generation.top_k", gen.top_k, ">= 0 (0 disables)")
    _check(0 <= gen.min_p < 1, "generation.min_p", gen.min_p, "0 <= min_p < 1")
    _check(gen.repetition_penalty > 0, "generation.repetition_penalty", gen.repetition_penalty, "> 0")
    _check(gen.kv_cache_gib >= 0, "generation.kv_cache_gib", gen.kv_cache_gib, ">= 0 (0: automatic)")
    _check(gen.sync_every >= 1, "generation.sync_every", gen.sync_every, ">= 1")
    _check(gen.min_decode_batch is None or gen.min_decode_batch >= 1, "generation.min_decode_batch",
           gen.min_decode_batch, ">= 1 or null")
    _check(all(isinstance(s, str) and s for s in gen.stop_strings), "generation.stop_strings", gen.stop_strings,
           "non-empty strings")
    _check(1 <= gen.max_draft_tokens <= 16, "generation.max_draft_tokens", gen.max_draft_tokens, "an integer 1-16")
    _check(not gen.nf4_halves or gen.nf4_kernel, "generation.nf4_halves", gen.nf4_halves,
           "false without generation.nf4_kernel (the halves layout is read by longrl's NF4 decode product only)")
    _check(gen.speculative == "off" or gen.backend == "longrl", "generation.speculative", gen.speculative,
           "off with generation.backend=hf (speculative rollouts verify drafts inside longrl's sampler; transformers' "
           "generate has no exact speculative sampling without a draft model)")


def _check_data(cfg: Config) -> None:
    d = cfg.data
    _check(d.max_prompt_length >= 1, "data.max_prompt_length", d.max_prompt_length, ">= 1")
    _check(d.num_examples is None or d.num_examples >= 1, "data.num_examples", d.num_examples,
           "null (all rows) or an integer >= 1")
    _check(d.eval_num_examples >= 1, "data.eval_num_examples", d.eval_num_examples, "an integer >= 1")
    _check(d.max_image_pixels >= 1, "data.max_image_pixels", d.max_image_pixels, "an integer >= 1")


def _check_lora(cfg: Config) -> None:
    _check(cfg.lora.r >= 1, "lora.r", cfg.lora.r, "an integer >= 1")
    _check(0 <= cfg.lora.dropout < 1, "lora.dropout", cfg.lora.dropout, "0 <= dropout < 1")
    _check(cfg.lora.vision_modules in ("none", "projector", "tower_and_projector"), "lora.vision_modules",
           cfg.lora.vision_modules, "none, projector or tower_and_projector")
    _check(cfg.lora.vision_modules == "none" or cfg.lora.enabled, "lora.vision_modules", cfg.lora.vision_modules,
           "none with lora.enabled=false (it chooses where adapters go)")


def _check_model_layout(cfg: Config) -> None:
    """Attention kernels, recomputation and offloading."""
    m = cfg.model
    _check(all(b in ("cudnn", "flash", "efficient", "math") for b in m.sdpa_backends), "model.sdpa_backends",
           m.sdpa_backends, "a list of cudnn, flash, efficient, math")
    _check(m.no_recompute_layers is None or (isinstance(m.no_recompute_layers, int) and m.no_recompute_layers >= 0),
           "model.no_recompute_layers", m.no_recompute_layers, "null (the planner's choice) or an integer >= 0")
    _check(not m.grouped_attention_backward or ((not m.sdpa_backends or m.sdpa_backends[0] == "flash")
                                                and m.attn_implementation in (None, "sdpa")),
           "model.grouped_attention_backward", m.grouped_attention_backward,
           "false unless attention is SDPA (model.attn_implementation null or sdpa) with flash first or nothing in "
           "model.sdpa_backends (it runs flash's kernels)")
    _check(not m.reuse_attention or m.offload_activations is True, "model.reuse_attention", m.reuse_attention,
           "true only with model.offload_activations=true (it keeps attention outputs beside the offloaded inputs)")
    _check(not (m.offload_activations and m.gradient_checkpointing is False), "model.gradient_checkpointing",
           m.gradient_checkpointing, "true or null with model.offload_activations=true (offloading recomputes layers)")


def _check_model_weights(cfg: Config) -> None:
    """4-bit and FP8 quantization and the device."""
    m = cfg.model
    _check(not (m.load_in_fp8 and m.load_in_4bit), "model.load_in_fp8", m.load_in_fp8,
           "false with model.load_in_4bit=true (a base is quantized one way: NF4 or FP8)")
    _check(not m.load_in_4bit or cfg.lora.enabled, "model.load_in_4bit", m.load_in_4bit,
           "true only with lora.enabled=true (4-bit weights cannot be trained; QLoRA trains adapters on them)")
    _check(not m.load_in_fp8 or cfg.lora.enabled, "model.load_in_fp8", m.load_in_fp8,
           "true only with lora.enabled=true (FP8 base weights are frozen; LoRA trains adapters on them)")
    _check(m.quant_exception_budget >= 0, "model.quant_exception_budget", m.quant_exception_budget,
           ">= 0 (a fraction of the plain 4-bit weight bytes; 0: no exceptions beyond the keep-list)")
    _check(m.quant_calibration_text is None or m.quant_calibration_text.strip() != "", "model.quant_calibration_text",
           m.quant_calibration_text, "null (token ids drawn from the vocabulary) or a non-empty text")
    _check(DEVICE_PATTERN.fullmatch(m.device) is not None, "model.device", m.device,
           "auto, cpu, cuda, cuda:N, mps, xpu or xpu:N")


def _check_distributed(cfg: Config) -> None:
    _check(cfg.distributed.timeout_s > 0, "distributed.timeout_s", cfg.distributed.timeout_s, "> 0 seconds")


def _check_output(cfg: Config) -> None:
    o = cfg.output
    per_rollout, rollout_steps = _steps_per_rollout(cfg)
    _check(o.logging_steps >= 1, "output.logging_steps", o.logging_steps, "an integer >= 1")
    _check(all(r in ("tensorboard", "wandb", "none") for r in o.report_to), "output.report_to", o.report_to,
           "a list of tensorboard, wandb, none")
    _check(o.save_total_limit >= 0, "output.save_total_limit", o.save_total_limit, "an integer >= 0 (0: keep all)")
    _check(o.eval_steps >= 0, "output.eval_steps", o.eval_steps, "an integer >= 0 (0: no evaluation in training)")
    _check(o.eval_num_generations >= 1, "output.eval_num_generations", o.eval_num_generations, "an integer >= 1")
    _check(math.isfinite(o.eval_pass_threshold), "output.eval_pass_threshold", o.eval_pass_threshold,
           "a finite number")
    _check(o.save_steps >= 0, "output.save_steps", o.save_steps, "an integer >= 0")
    _check(o.save_steps % per_rollout == 0, "output.save_steps", o.save_steps,
           f"a multiple of {rollout_steps}: checkpoints fall between rollout batches")
    _check(o.save_minutes >= 0, "output.save_minutes", o.save_minutes, ">= 0 (0: no saves by time)")
    _check(o.output_dir.strip() != "", "output.output_dir", o.output_dir, "a directory path")


def _check_environment(cfg: Config) -> None:
    """Multi-turn episodes: the environment section, the tools list, and the sampler they need."""
    env, gen = cfg.environment, cfg.generation
    _check(env.max_turns >= 1, "environment.max_turns", env.max_turns, "an integer >= 1")
    _check(env.max_tokens == 0 or env.max_tokens > gen.max_completion_length, "environment.max_tokens",
           env.max_tokens, f"0 (automatic) or more than generation.max_completion_length ({gen.max_completion_length})")
    for key in ("turn_timeout_s", "episode_timeout_s", "tool_timeout_s"):
        _check(getattr(env, key) >= 0, f"environment.{key}", getattr(env, key), ">= 0 (0: no limit)")
    _check(env.workers >= 1, "environment.workers", env.workers, "an integer >= 1")
    _check(env.max_message_chars >= 64, "environment.max_message_chars", env.max_message_chars,
           "an integer >= 64 (room for the truncation marker)")
    _check(0 <= env.max_reset_failure_share <= 1, "environment.max_reset_failure_share",
           env.max_reset_failure_share, "a share in [0, 1] (1: never stop for failed resets)")
    _check(env.factory is None or ":" in env.factory, "environment.factory", env.factory,
           "'path/to/file.py:Class' or 'package.module:Class'")
    for i, ref in enumerate(cfg.tools):
        _check(":" in ref, f"tools[{i}]", ref, "'path/to/file.py:function' or 'package.module:function'")
    _check(not (env.factory or cfg.tools) or gen.backend == "longrl", "generation.backend", gen.backend,
           "longrl with environment.factory or tools (multi-turn episodes run inside longrl's sampler)")


def _check_sft(cfg: Config) -> None:
    s = cfg.sft
    _check(s.max_length >= 2, "sft.max_length", s.max_length, "an integer >= 2")
    _check(s.examples_per_step >= 1, "sft.examples_per_step", s.examples_per_step, "an integer >= 1")
    _check(0 <= s.label_smoothing < 1, "sft.label_smoothing", s.label_smoothing, "0 <= label_smoothing < 1")
    _check(s.eval_examples >= 0, "sft.eval_examples", s.eval_examples, "an integer >= 0")
    _check(s.num_train_epochs is None or s.num_train_epochs > 0, "sft.num_train_epochs", s.num_train_epochs,
           "null (train.max_steps decides) or > 0")


def reward_url_problem(url: str) -> str | None:
    """Why ``url`` cannot be a reward server's address (None: it can): http or https with a host, no credentials."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "an http:// or https:// URL with a host"
    if parts.username or parts.password:
        return ("a URL without credentials: put the Authorization header's value in an environment variable and "
                "name it in auth_env (the config is saved with every checkpoint)")
    return None


def _check_reward_server(r, i: int) -> None:
    """A reward entry with ``url``: no function beside it, a usable URL, positive request settings."""
    key = f"rewards[{i}]"
    _check(not r.function, f"{key}.function", r.function, "empty with url (an entry is a function or a server)")
    problem = reward_url_problem(r.url)
    _check(problem is None, f"{key}.url", r.url, problem or "")
    _check(r.isolation == "none", f"{key}.isolation", r.isolation, "none with url (the server is its own process)")
    _check(r.batch_size >= 0, f"{key}.batch_size", r.batch_size, "an integer >= 0 (0: one request a batch)")
    _check(r.max_concurrency >= 1, f"{key}.max_concurrency", r.max_concurrency, "an integer >= 1")
    _check(r.max_retries >= 0, f"{key}.max_retries", r.max_retries, "an integer >= 0")
    _check(r.retry_backoff_s >= 0, f"{key}.retry_backoff_s", r.retry_backoff_s, ">= 0")
    _check(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", r.auth_env) is not None or not r.auth_env, f"{key}.auth_env",
           r.auth_env, "the name of an environment variable (its value is the header; never the token itself)")


def _check_rewards(cfg: Config, require_rewards: bool) -> None:
    _check(bool(cfg.rewards) or bool(cfg.environment.factory) or not require_rewards, "rewards", cfg.rewards,
           "at least one reward function (with environment.factory: none means the environment's own rewards)")
    for i, r in enumerate(cfg.rewards):
        if r.url:
            _check_reward_server(r, i)
        else:
            _check(":" in r.function or not require_rewards, f"rewards[{i}].function", r.function,
                   "'path/to/file.py:function' or 'package.module:function' (or url: a reward server)")
        _check(math.isfinite(r.weight), f"rewards[{i}].weight", r.weight, "a finite number")
        _check(r.timeout_s >= 0, f"rewards[{i}].timeout_s", r.timeout_s, ">= 0 (0: no limit)")
        _check(r.memory_limit_gib >= 0, f"rewards[{i}].memory_limit_gib", r.memory_limit_gib, ">= 0 (0: none)")
        _check(r.cpu_limit_s >= 0, f"rewards[{i}].cpu_limit_s", r.cpu_limit_s, ">= 0 (0: none)")
        _check(r.isolation == "process" or (r.memory_limit_gib == 0 and r.cpu_limit_s == 0),
               f"rewards[{i}].isolation", r.isolation, "'process' when memory_limit_gib or cpu_limit_s is set "
               "(limits apply to a worker process)")


# grpo first: _check_train and _check_output divide by the steps a rollout feeds, which _check_grpo keeps >= 1
SECTION_CHECKS = (_check_grpo, _check_loss_options, _check_train, _check_generation, _check_data, _check_lora,
                  _check_model_layout, _check_model_weights, _check_distributed, _check_output, _check_environment,
                  _check_sft)


def validate(cfg: Config, require_rewards: bool = True) -> None:
    """Range and consistency checks beyond types (``require_rewards=False``: the reward functions come later, as
    ``GRPOTrainer(reward_funcs=...)``, or the run is supervised)."""
    for check_section in SECTION_CHECKS:
        check_section(cfg)
    _check_rewards(cfg, require_rewards)
    check_sizes(cfg)
