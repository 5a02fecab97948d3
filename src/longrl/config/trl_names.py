"""TRL ``GRPOConfig``'s and ``SFTConfig``'s flat field names → longrl's dotted config keys: tables read two ways.

``longrl.GRPOConfig(learning_rate=1e-5, ...)`` sets the dotted keys it names; an unknown key in a YAML file or a
``KEY=VALUE`` override gets "did you mean train.learning_rate?" from it. Names are TRL 1.x's (``trl/trainer/
grpo_config.py`` and the ``transformers.TrainingArguments`` fields it inherits); ``max_prompt_length`` is TRL's
older name, kept because scripts still use it. A name whose longrl key is not in the config tree (a feature of
another version) is refused naming that; an entry without a key but with a ``convert`` is accepted and sets nothing
(a value that changes no result, e.g. ``dataset_num_proc``), its ``convert`` refusing the values longrl cannot honour.
``TRL_SFT_NAMES`` (``longrl.SFTConfig``) is TRL_NAMES without GRPO's own names, with ``SFT_NAMES`` over it.
Imports nothing heavy: ``longrl.config.keys`` reads it for its messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


class FlatNameError(ValueError):
    """A TRL flat name cannot be mapped; the message says what longrl has instead."""


@dataclass(frozen=True)
class FlatName:
    key: str | None  # longrl's dotted key (None: no equivalent; ``note`` says what to use)
    note: str = ""  # how TRL's meaning maps onto longrl's (shown in messages and docs/api.md)
    convert: Callable[[object], object] | None = None  # TRL value → longrl value (raises FlatNameError)


def _dtype_from_bf16(v):
    return {True: "bfloat16", False: "float32", None: "auto"}[v]


def _dtype_from_fp16(v):
    return "float16" if v else "auto"


def _scale_rewards(v):
    return {True: "group", False: "none"}.get(v, v)


def _positive_int(name):
    def convert(v):
        if isinstance(v, float) and 0 < v < 1:
            raise FlatNameError(f"{name}={v}: a fraction of the run is not supported; give a number of steps")
        return v
    return convert


def _max_steps(v):
    if isinstance(v, int) and v < 1:
        raise FlatNameError(f"max_steps={v}: longrl counts optimizer steps, not epochs; give max_steps >= 1")
    return v


def _none_is(default):
    return lambda v: default if v is None else v


def _lr_scheduler(v):
    return {"constant_with_warmup": "constant"}.get(v, v)  # longrl's constant schedule warms up too


def _progress_bar(v):
    return not v


def _report_to(v):
    if v == "all" or v == ["all"]:
        import importlib.util

        return ["tensorboard"] + (["wandb"] if importlib.util.find_spec("wandb") else [])
    return [v] if isinstance(v, str) else ["none"] if v is None else v


_BATCH_NOTE = ("completions per optimizer step = per_device_train_batch_size × gradient_accumulation_steps = "
               "train.prompts_per_step × grpo.num_generations; per_device_train_batch_size is "
               "train.micro_batch_size (completions per forward/backward)")

TRL_NAMES: dict[str, FlatName] = {
    # the optimizer and its schedule (transformers.TrainingArguments)
    "learning_rate": FlatName("train.learning_rate"),
    "weight_decay": FlatName("train.weight_decay"),
    "adam_beta1": FlatName("train.adam_beta1"),
    "adam_beta2": FlatName("train.adam_beta2"),
    "max_grad_norm": FlatName("train.max_grad_norm"),
    "lr_scheduler_type": FlatName("train.lr_scheduler_type", "constant, linear or cosine, each after warmup_steps; "
                                  "TRL's constant_with_warmup is longrl's constant", _lr_scheduler),
    "warmup_steps": FlatName("train.warmup_steps", "a number of steps (no fraction)", _positive_int("warmup_steps")),
    "warmup_ratio": FlatName("train.warmup_steps", "warmup_steps = round(warmup_ratio × max_steps)"),
    "max_steps": FlatName("train.max_steps", "optimizer steps (longrl has no epochs)", _max_steps),
    "seed": FlatName("train.seed"),
    # the batch (see longrl.compat.trl_config.batch_arithmetic)
    "per_device_train_batch_size": FlatName("train.micro_batch_size", _BATCH_NOTE),
    "gradient_accumulation_steps": FlatName("train.prompts_per_step", _BATCH_NOTE),
    "generation_batch_size": FlatName("grpo.steps_per_generation", "optimizer steps a rollout serves = "
                                      "generation_batch_size / (per_device_train_batch_size × "
                                      "gradient_accumulation_steps)"),
    "steps_per_generation": FlatName("grpo.steps_per_generation", "optimizer steps a rollout serves = TRL's "
                                     "steps_per_generation (micro-batches) / gradient_accumulation_steps"),
    # the GRPO objective
    "num_generations": FlatName("grpo.num_generations"),
    "beta": FlatName("grpo.beta", "KL coefficient; the reference is the base with the adapters disabled"),
    "epsilon": FlatName("grpo.epsilon"),
    "epsilon_high": FlatName("grpo.epsilon_high"),
    "delta": FlatName("grpo.delta"),
    "loss_type": FlatName("grpo.loss_type"),
    "num_iterations": FlatName("grpo.num_iterations"),
    "importance_sampling_level": FlatName("grpo.importance_sampling_level"),
    "scale_rewards": FlatName("grpo.scale_rewards", "group, batch or none (True: group, False: none)",
                              _scale_rewards),
    "mask_truncated_completions": FlatName("grpo.mask_truncated_completions"),
    "reward_weights": FlatName("rewards", "rewards[i].weight, in the order of reward_funcs"),
    "vllm_importance_sampling_correction": FlatName("grpo.rollout_correction", "False: rollout_correction=none; "
                                                    "longrl corrects for its own sampler, not vLLM's"),
    "vllm_importance_sampling_mode": FlatName("grpo.rollout_correction", "the same four modes"),
    "vllm_importance_sampling_clip_max": FlatName("grpo.rollout_correction_cap"),
    "vllm_importance_sampling_cap": FlatName("grpo.rollout_correction_cap", "TRL's older name of the cap"),
    # loss options of TRL 1.15 that later longrl versions name the same (mapped where this tree has them)
    **{name: FlatName(f"grpo.{name}") for name in (
        "use_bias_correction_kl", "top_entropy_quantile", "entropy_coef", "off_policy_mask_threshold",
        "multi_objective_aggregation", "sapo_temperature_neg", "sapo_temperature_pos", "vespo_k_pos",
        "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")},
    # prompts and sampling
    "max_prompt_length": FlatName("data.max_prompt_length", "longer prompts follow data.overlong_prompt "
                                  "(error by default; TRL used to cut them silently)"),
    "shuffle_dataset": FlatName("data.shuffle"),
    "max_completion_length": FlatName("generation.max_completion_length"),
    "temperature": FlatName("generation.temperature"),
    "top_p": FlatName("generation.top_p"),
    "top_k": FlatName("generation.top_k", "0 disables", _none_is(0)),
    "min_p": FlatName("generation.min_p", "0 disables (TRL: None)", _none_is(0.0)),
    "repetition_penalty": FlatName("generation.repetition_penalty"),
    # the model
    "bf16": FlatName("model.dtype", "True: bfloat16, False: float32, None: auto (bf16 on CUDA)", _dtype_from_bf16),
    "fp16": FlatName("model.dtype", "True: float16", _dtype_from_fp16),
    "gradient_checkpointing": FlatName("model.gradient_checkpointing"),
    "trust_remote_code": FlatName("model.trust_remote_code"),
    # outputs
    "output_dir": FlatName("output.output_dir", "", _none_is("longrl-output")),
    "logging_steps": FlatName("output.logging_steps", "a number of steps (no fraction)",
                              _positive_int("logging_steps")),
    "save_steps": FlatName("output.save_steps", "a number of steps; 0: at the end only",
                           _positive_int("save_steps")),
    "save_total_limit": FlatName("output.save_total_limit", "0 or None: keep all", _none_is(0)),
    "report_to": FlatName("output.report_to", "tensorboard, wandb or none, a name or a list (all: those installed)",
                          _report_to),
    "eval_steps": FlatName("output.eval_steps", "on eval_dataset (data.eval_source)"),
    "num_generations_eval": FlatName("output.eval_num_generations", "the n of pass@k"),
    "log_completions": FlatName("output.log_completions", "completions written to completions.jsonl per logging "
                                "step (False: 0)"),
    "num_completions_to_print": FlatName("output.log_completions"),
    "disable_tqdm": FlatName("output.progress_bar", "progress_bar = not disable_tqdm", _progress_bar),
    "resume_from_checkpoint": FlatName("output.resume", "True or a checkpoint of output_dir: resume from its latest"),
    # TRL names without a longrl equivalent: the message says what to use
    "num_train_epochs": FlatName(None, "longrl counts optimizer steps: set max_steps (train.max_steps)"),
    "use_vllm": FlatName(None, "rollouts run on the training weights through longrl's sampler "
                         "(generation.backend: longrl or hf); no vLLM and no weight sync"),
    "vllm_mode": FlatName(None, "rollouts run on the training weights (generation.backend)"),
    "vllm_gpu_memory_utilization": FlatName(None, "the sampler's KV cache is generation.kv_cache_gib"),
    "optim": FlatName(None, "AdamW (torch) only: train.adam_beta1, train.adam_beta2, train.weight_decay"),
    "logging_dir": FlatName(None, "TensorBoard logs go to output.output_dir/tensorboard"),
    "save_strategy": FlatName(None, "checkpoints every output.save_steps steps and at the end"),
    "push_to_hub": FlatName(None, "export a checkpoint with `longrl export` (adapter, merged or gguf), then upload it"),
    "use_liger_kernel": FlatName(None, "longrl's chunked linear→log-prob loss is always on "
                                 "(train.logprob_chunk_size)"),
    "model_init_kwargs": FlatName(None, "model.dtype, model.attn_implementation, model.revision, "
                                  "model.trust_remote_code"),
    # PEFT's names of the adapter settings (peft.LoraConfig)
    "lora_alpha": FlatName("lora.alpha", "PEFT's name"),
    "lora_dropout": FlatName("lora.dropout", "PEFT's name"),
}


# ------------------------------------------------------------------------------ SFTConfig (TRL 1.15 trl/trainer/sft_config.py)

def _only(name, allowed, why):
    def convert(v):
        if v not in allowed:
            raise FlatNameError(f"{name}={v!r}: {why}")
        return v
    return convert


def _any(v):
    return v


def _truncation_mode(v):
    if v not in ("keep_start", "truncate", "skip", "error"):
        raise FlatNameError(f"truncation_mode={v!r}: longrl keeps the start of a row (keep_start), or skips the row, "
                            "or stops naming it (sft.overlong: truncate, skip, error)")
    return "truncate" if v == "keep_start" else v


def _max_length(v):
    if v is None:
        raise FlatNameError("max_length=None: longrl plans memory for the longest example; give a number of tokens "
                            "(longer rows follow sft.overlong)")
    return v


SFT_BATCH_NOTE = ("examples per optimizer step = per_device_train_batch_size × gradient_accumulation_steps = "
                   "sft.examples_per_step; per_device_train_batch_size is train.micro_batch_size (examples per "
                   "forward/backward; with packing, train.micro_batch_tokens = per_device_train_batch_size × max_length)")

SFT_NAMES: dict[str, FlatName] = {
    "max_length": FlatName("sft.max_length", "tokens an example may have; longer rows follow sft.overlong (truncate "
                           "by default, as TRL)", _max_length),
    "max_seq_length": FlatName("sft.max_length", "TRL's older name of max_length", _max_length),
    "truncation_mode": FlatName("sft.overlong", "keep_start: truncate (the first max_length tokens); longrl also has "
                                "skip and error", _truncation_mode),
    "packing": FlatName("train.micro_batch_tokens", "True: micro-batches of per_device_train_batch_size × max_length "
                        "tokens in one row, positions restarting per example (train.padding_free=true); no row is cut; "
                        "the optimizer step still counts examples"),
    "packing_strategy": FlatName(None, "bfd only: longrl packs whole examples; none is cut or wrapped",
                                 _only("packing_strategy", ("bfd",), "longrl packs whole examples (bfd); it never "
                                       "cuts or wraps one across packs")),
    "padding_free": FlatName("train.padding_free", "the micro-batch layout (one packed row or padded rows); the loss "
                             "is the same"),
    "eval_packing": FlatName(None, "evaluation is split as training is (the loss does not depend on it)", _any),
    "completion_only_loss": FlatName("sft.completion_only_loss", "prompt/completion rows; None: True (as TRL for "
                                     "those rows)", _none_is(True)),
    "assistant_only_loss": FlatName("sft.assistant_only_loss", "messages rows; located through the chat template"),
    "dataset_text_field": FlatName("sft.text_column"),
    "label_smoothing_factor": FlatName("sft.label_smoothing"),
    "loss_type": FlatName(None, "nll only (longrl's cross-entropy is always chunked: TRL's chunked_nll)",
                          _only("loss_type", ("nll", "chunked_nll"), "longrl's SFT loss is the token-mean "
                                "cross-entropy (nll); dft is not implemented")),
    "activation_offloading": FlatName("model.offload_activations", "layer inputs in host memory, layers recomputed "
                                      "in backward"),
    "num_train_epochs": FlatName("sft.num_train_epochs", "optimizer steps = ceil(epochs × examples / "
                                 "examples_per_step); max_steps > 0 overrides it, as in TRL"),
    "max_steps": FlatName("train.max_steps", "optimizer steps; -1 (TRL's default): num_train_epochs decides"),
    "per_device_train_batch_size": FlatName("train.micro_batch_size", SFT_BATCH_NOTE),
    "gradient_accumulation_steps": FlatName("sft.examples_per_step", SFT_BATCH_NOTE),
    "per_device_eval_batch_size": FlatName(None, "evaluation is split as training is (the loss does not depend on "
                                           "it)", _any),
    "dataset_num_proc": FlatName(None, "longrl tokenizes in the trainer's process", _any),
    "dataset_kwargs": FlatName(None, "longrl always prepares the rows itself (longrl.data.sft_rows)"),
    "chat_template_path": FlatName(None, "set tokenizer.chat_template and pass the tokenizer as processing_class"),
    "eos_token": FlatName(None, "set it on the tokenizer passed as processing_class"),
    "pad_token": FlatName(None, "set it on the tokenizer passed as processing_class"),
    "router_aux_loss_coef": FlatName(None, "not in this version of longrl (the model's own MoE loss is not added)"),
}

# TRL_NAMES entries that are GRPO's own (the objective, sampling, rewards, rollout batching): SFTConfig refuses them
GRPO_ONLY = frozenset(name for name, entry in TRL_NAMES.items()
                      if (entry.key or "").split(".")[0] in ("grpo", "generation", "rewards")
                      or name in ("max_prompt_length", "num_generations_eval", "log_completions",
                                  "num_completions_to_print", "use_vllm", "vllm_mode", "vllm_gpu_memory_utilization"))

TRL_SFT_NAMES: dict[str, FlatName] = {**{n: e for n, e in TRL_NAMES.items() if n not in GRPO_ONLY}, **SFT_NAMES}
