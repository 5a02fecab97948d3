"""TRL ``GRPOConfig``'s and ``SFTConfig``'s flat field names → longrl's dotted config keys: tables read two ways.

``longrl.GRPOConfig(learning_rate=1e-5, ...)`` sets the dotted keys it names; an unknown key in a YAML file or a
``KEY=VALUE`` override gets "did you mean train.learning_rate?" from it. The tables hold every field of TRL 1.15's
``GRPOConfig`` and ``SFTConfig`` (``trl/trainer/grpo_config.py``, ``sft_config.py`` and the
``transformers.TrainingArguments`` fields they inherit; tests/trl_1_15_fields.json lists them), plus a few older
names scripts still use (``max_prompt_length``, ``warmup_ratio``, ``logging_dir``) and PEFT's adapter names.

Each name is one of three kinds:

- **mapped**: ``key`` is the dotted key it sets, through ``convert`` (TRL value → longrl value; ``UNSET``: sets
  nothing, e.g. TRL's None for "no change");
- **accepted**: no key, and ``convert`` accepts the values that describe what longrl does anyway (``use_vllm=False``,
  ``optim="adamw_torch"``, ``push_to_hub=False``) or that change no result (``dataloader_num_workers``), setting
  nothing; any other value is refused with the reason (``Accepts.values`` lists the accepted ones);
- a name whose ``key`` is not in this version's tree is refused, naming what to use.

A value a convert refuses raises :class:`FlatNameError` with the reason; ``longrl.GRPOConfig`` lists every refused
argument of one call together. Imports nothing heavy: ``longrl.config.keys`` reads it for its messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


class FlatNameError(ValueError):
    """A TRL flat name's value cannot be mapped; the message says why and what longrl has instead."""


UNSET = object()  # a convert's result: the name sets nothing (its value describes longrl's default)


@dataclass(frozen=True)
class FlatName:
    key: str | None  # longrl's dotted key (None: accepted values set nothing, ``note`` says why)
    note: str = ""  # how TRL's meaning maps onto longrl's (shown in messages and docs/api.md)
    convert: Callable[[object], object] | None = None  # TRL value → longrl value or UNSET (raises FlatNameError)


class Accepts:
    """A convert accepting ``values`` (compared with ==) and refusing the rest with ``why``."""

    def __init__(self, values: tuple, why: str):
        self.values, self.why = values, why

    def __call__(self, v):
        if not any(v == a and type(v) is type(a) or v is a for a in self.values):
            raise FlatNameError(self.why)
        return UNSET


def _any(v):
    return UNSET


def accepted(*values, why: str) -> FlatName:
    """A name without a key accepting ``values`` (which describe what longrl does); others refused with ``why``."""
    return FlatName(None, why, Accepts(values, why))


def ignored(note: str) -> FlatName:
    """A name without a key accepted with any value: it changes no result in longrl (``note`` says why)."""
    return FlatName(None, note, _any)


def _none_is(default):
    return lambda v: default if v is None else v


def _none_unset(v):
    return UNSET if v is None else v


def _dtype_from_bf16(v):
    return {True: "bfloat16", False: "float32", None: "auto"}[v]


def _dtype_from_fp16(v):
    return "float16" if v else UNSET  # False: leaves bf16's choice


def _scale_rewards(v):
    return {True: "group", False: "none"}.get(v, v)


def _whole_steps(v):
    if isinstance(v, float) and 0 < v < 1:
        raise FlatNameError("a fraction of the run is not supported; give a number of steps")
    return v


def _max_steps(v):
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v <= 0:
        if v != -1:
            raise FlatNameError("give max_steps >= 1 (optimizer steps), or -1 to let num_train_epochs decide")
        return UNSET  # num_train_epochs decides (compat.trl_config)
    return v


_SCHEDULES = ("constant", "linear", "cosine")


def _lr_scheduler(v):
    v = {"constant_with_warmup": "constant"}.get(v, v)  # longrl's constant schedule warms up too
    if v not in _SCHEDULES:
        raise FlatNameError(f"longrl's schedules are {', '.join(_SCHEDULES)} (each after warmup_steps of linear "
                            "warm-up; TRL's constant_with_warmup is constant)")
    return v


def _progress_bar(v):
    return UNSET if v is None else not v


_REPORTERS = ("tensorboard", "wandb", "none")


def _report_to(v):
    if v == "all" or v == ["all"]:
        import importlib.util

        return ["tensorboard"] + (["wandb"] if importlib.util.find_spec("wandb") else [])
    names = [v] if isinstance(v, str) else ["none"] if v is None else list(v)
    unknown = [n for n in names if n not in _REPORTERS]
    if unknown:
        raise FlatNameError(f"longrl reports to {', '.join(_REPORTERS)} (output.report_to); not {', '.join(unknown)}")
    return names


def _sampling_strategy(v):
    if v not in ("random", "sequential"):
        raise FlatNameError("random (data.shuffle=true) or sequential (data.shuffle=false); group_by_length is not "
                            "supported (micro-batches are packed by token budget: train.micro_batch_tokens)")
    return v == "random"


def _use_cpu(v):
    return "cpu" if v else UNSET


def _tool_iterations(v):
    return UNSET if v is None else int(v) + 1  # tool-calling turns + the answering turn


_BATCH_NOTE = ("completions per optimizer step = per_device_train_batch_size × gradient_accumulation_steps = "
               "train.prompts_per_step × grpo.num_generations; per_device_train_batch_size is "
               "train.micro_batch_size (completions per forward/backward)")
_NO_VLLM = "vLLM is not used (rollouts run on the training weights through generation.backend); ignored, as TRL " \
           "ignores it without use_vllm"

TRL_NAMES: dict[str, FlatName] = {
    # ------------------------------------------------------------------ the optimizer and its schedule
    "learning_rate": FlatName("train.learning_rate"),
    "weight_decay": FlatName("train.weight_decay"),
    "adam_beta1": FlatName("train.adam_beta1"),
    "adam_beta2": FlatName("train.adam_beta2"),
    "adam_epsilon": accepted(1e-8, why="longrl's AdamW uses eps=1e-8"),
    "max_grad_norm": FlatName("train.max_grad_norm"),
    "optim": accepted("adamw_torch", "adamw_torch_fused",
                      why="longrl's optimizer is torch's AdamW: train.adam_beta1, train.adam_beta2, "
                          "train.weight_decay"),
    "optim_args": accepted(None, why="longrl's AdamW takes train.adam_beta1, train.adam_beta2, train.weight_decay"),
    "optim_target_modules": accepted(None, why="AdamW updates every trainable parameter (lora.target_modules picks "
                                               "the adapters)"),
    "lr_scheduler_type": FlatName("train.lr_scheduler_type", "constant, linear or cosine, each after warmup_steps; "
                                  "TRL's constant_with_warmup is longrl's constant", _lr_scheduler),
    "lr_scheduler_kwargs": accepted(None, {}, why="longrl's schedules take no arguments beyond train.warmup_steps"),
    "warmup_steps": FlatName("train.warmup_steps", "a number of steps; a fraction below 1 is a share of max_steps"),
    "warmup_ratio": FlatName("train.warmup_steps", "warmup_steps = round(warmup_ratio × max_steps)"),
    "max_steps": FlatName("train.max_steps", "optimizer steps; -1 (TRL's default): num_train_epochs decides",
                          _max_steps),
    "num_train_epochs": FlatName("train.max_steps", "passes over the prompts: max_steps = ceil(epochs × rollout "
                                 "batches an epoch × steps a rollout), set when the trainer reads the data, as TRL "
                                 "counts them; max_steps > 0 wins over it, as in TRL"),
    "seed": FlatName("train.seed"),
    "data_seed": accepted(None, why="the data order is seeded by train.seed"),
    "full_determinism": accepted(False, why="longrl seeds every generator from train.seed but does not force "
                                            "deterministic kernels"),
    # ------------------------------------------------------------------ the batch (compat.trl_config.batch_arithmetic)
    "per_device_train_batch_size": FlatName("train.micro_batch_size", _BATCH_NOTE),
    "gradient_accumulation_steps": FlatName("train.prompts_per_step", _BATCH_NOTE),
    "generation_batch_size": FlatName("grpo.steps_per_generation", "optimizer steps a rollout serves = "
                                      "generation_batch_size / (per_device_train_batch_size × "
                                      "gradient_accumulation_steps)"),
    "steps_per_generation": FlatName("grpo.steps_per_generation", "optimizer steps a rollout serves = TRL's "
                                     "steps_per_generation (micro-batches) / gradient_accumulation_steps"),
    "auto_find_batch_size": ignored("the planner sizes micro-batches by a token budget on CUDA (`longrl plan`)"),
    "average_tokens_across_devices": accepted(True, why="longrl normalises the loss over every rank's tokens"),
    # ------------------------------------------------------------------ the GRPO objective
    "num_generations": FlatName("grpo.num_generations"),
    "beta": FlatName("grpo.beta", "KL coefficient; the reference is the base with the adapters disabled "
                                  "(LoRA) or a frozen copy of the initial weights (full weights)"),
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
    "vllm_importance_sampling_cap": FlatName("grpo.rollout_correction_cap", "TRL's older name of the cap",
                                             _none_unset),
    "vllm_importance_sampling_clip_min": accepted(None, why="the sampler correction is capped from above only "
                                                            "(grpo.rollout_correction_cap)"),
    **{name: FlatName(f"grpo.{name}") for name in (
        "use_bias_correction_kl", "top_entropy_quantile", "entropy_coef", "off_policy_mask_threshold",
        "multi_objective_aggregation", "sapo_temperature_neg", "sapo_temperature_pos", "vespo_k_pos",
        "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")},
    "use_adaptive_entropy": accepted(False, why="the entropy bonus has a fixed coefficient (grpo.entropy_coef)"),
    **{name: ignored("read only with use_adaptive_entropy=True") for name in (
        "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target")},
    "sync_ref_model": accepted(False, why="the reference is the initial model (the base with the adapters "
                                          "disabled, or a frozen copy of the initial weights), never synced"),
    "ref_model_mixup_alpha": ignored("read only with sync_ref_model=True"),
    "ref_model_sync_steps": ignored("read only with sync_ref_model=True"),
    "disable_dropout": accepted(False, why="longrl keeps the model's own dropout (0 in most LLM configs); the "
                                           "adapters' is lora.dropout"),
    "cast_lm_head_to_fp32": ignored("the log-prob op computes its logits and log-softmax in float32 anyway"),
    "label_smoothing_factor": accepted(0.0, why="the GRPO loss has no label smoothing (SFT: sft.label_smoothing)"),
    "router_aux_loss_coef": accepted(None, 0.0, why="the model's own MoE auxiliary loss is not added"),
    # ------------------------------------------------------------------ prompts and sampling
    "max_prompt_length": FlatName("data.max_prompt_length", "TRL's older name; longer prompts follow "
                                  "data.overlong_prompt (error by default; TRL used to cut them silently)"),
    "shuffle_dataset": FlatName("data.shuffle"),
    "train_sampling_strategy": FlatName("data.shuffle", "random: true; sequential: false", _sampling_strategy),
    "max_completion_length": FlatName("generation.max_completion_length"),
    "temperature": FlatName("generation.temperature"),
    "top_p": FlatName("generation.top_p"),
    "top_k": FlatName("generation.top_k", "0 disables", _none_is(0)),
    "min_p": FlatName("generation.min_p", "0 disables (TRL: None)", _none_is(0.0)),
    "repetition_penalty": FlatName("generation.repetition_penalty"),
    "generation_kwargs": accepted(None, {}, why="set the generation.* keys (temperature, top_p, top_k, min_p, "
                                                "repetition_penalty, stop_strings, stop_token_ids)"),
    "chat_template_kwargs": accepted(None, {}, why="longrl renders prompts with the tokenizer's chat template as "
                                                   "it is: edit tokenizer.chat_template and pass the tokenizer"),
    "cache_implementation": accepted(None, why="the sampler keeps its own KV cache (generation.kv_cache_gib, "
                                               "generation.kv_cache_dtype)"),
    "use_transformers_continuous_batching": ignored("longrl's sampler batches continuously (generation.backend: "
                                                    "longrl); hf: transformers' generate"),
    "use_transformers_paged": ignored("the sampler's KV cache is its own"),
    "transformers_continuous_batching_config": accepted(None, why="the sampler is configured by generation.*"),
    "pad_to_multiple_of": ignored("padding changes no result; longrl packs or pads micro-batches itself"),
    "max_tool_calling_iterations": FlatName("environment.max_turns", "max_turns = iterations + 1 (the answering "
                                            "turn); None: environment.max_turns' own limit", _tool_iterations),
    "ds3_gather_for_generation": ignored("no DeepSpeed: the sampler runs on the training weights"),
    # vLLM: not used
    "use_vllm": accepted(False, why="rollouts run on the training weights through longrl's sampler "
                                    "(generation.backend: longrl or hf); no vLLM and no weight sync"),
    **{name: ignored(_NO_VLLM) for name in (
        "vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode", "vllm_server_base_url", "vllm_server_host",
        "vllm_server_port", "vllm_server_timeout", "vllm_group_port", "vllm_gpu_memory_utilization",
        "vllm_max_model_length", "vllm_tensor_parallel_size")},
    "vllm_structured_outputs_regex": accepted(None, why="the sampler does not constrain completions to a regex"),
    # ------------------------------------------------------------------ the model and its precision
    "bf16": FlatName("model.dtype", "True: bfloat16, False: float32, None: auto (bf16 on CUDA)", _dtype_from_bf16),
    "fp16": FlatName("model.dtype", "True: float16", _dtype_from_fp16),
    "bf16_full_eval": accepted(False, why="evaluation runs in model.dtype"),
    "fp16_full_eval": accepted(False, why="evaluation runs in model.dtype"),
    "tf32": accepted(None, False, why="longrl leaves TF32 off for float32 matmuls; set "
                                      "torch.backends.cuda.matmul.allow_tf32 yourself"),
    "gradient_checkpointing": FlatName("model.gradient_checkpointing"),
    "activation_checkpointing": FlatName("model.gradient_checkpointing", "transformers 5's name; None: the planner "
                                         "decides", _none_unset),
    **{name: accepted(None, {}, {"use_reentrant": False}, why="longrl checkpoints with use_reentrant=False and no "
                                                             "other options")
       for name in ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")},
    "trust_remote_code": FlatName("model.trust_remote_code"),
    "model_init_kwargs": FlatName(None, "model.dtype, model.attn_implementation, model.revision, "
                                  "model.trust_remote_code"),
    "torch_compile": accepted(False, why="longrl runs its own fused kernels; torch.compile is not applied to the "
                                         "model"),
    "torch_compile_backend": accepted(None, why="torch.compile is not applied"),
    "torch_compile_mode": accepted(None, why="torch.compile is not applied"),
    "use_liger_kernel": ignored("longrl's chunked linear→log-prob op and fused layers are always on "
                                "(train.logprob_chunk_size, model.fused_layers)"),
    "liger_kernel_config": accepted(None, why="longrl's own kernels take no Liger options"),
    "use_cache": ignored("the sampler keeps its own KV cache; training forwards use none"),
    "neftune_noise_alpha": accepted(None, why="NEFTune noise is not implemented"),
    "torch_empty_cache_steps": accepted(None, why="the planner bounds GPU memory (train.gpu_memory_gib)"),
    "use_cpu": FlatName("model.device", "True: cpu", _use_cpu),
    # ------------------------------------------------------------------ several processes
    "ddp_timeout": FlatName("distributed.timeout_s", "seconds a collective may wait"),
    "ddp_backend": accepted(None, why="nccl on CUDA, gloo on the CPU, chosen by longrl"),
    **{name: accepted(None, why="longrl wraps the model in DDP or FSDP2 itself") for name in (
        "ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers", "ddp_static_graph")},
    "fsdp": accepted(None, "", [], why="several processes (torchrun, --nproc-per-node) shard full-weight runs with "
                                      "FSDP2 and replicate LoRA runs with DDP by themselves"),
    "fsdp_config": accepted(None, why="longrl configures FSDP2 itself"),
    "deepspeed": accepted(None, why="DeepSpeed is not supported; several GPUs run under torchrun (DDP or FSDP2)"),
    "accelerator_config": accepted(None, why="longrl does not use Accelerate"),
    "parallelism_config": accepted(None, why="data parallel only (torchrun)"),
    "local_rank": ignored("longrl reads LOCAL_RANK from torchrun"),
    # ------------------------------------------------------------------ data loading
    "remove_unused_columns": ignored("every column reaches the reward functions (GRPO); SFT reads the columns it "
                                     "trains on"),
    **{name: ignored("longrl reads and tokenizes rows in the trainer's process (no DataLoader)") for name in (
        "dataloader_drop_last", "dataloader_num_workers", "dataloader_pin_memory", "dataloader_persistent_workers",
        "dataloader_prefetch_factor", "dataloader_multiprocessing_context", "dataloader_in_order",
        "length_column_name")},
    "label_names": accepted(None, why="longrl computes its own labels"),
    # ------------------------------------------------------------------ logging
    "output_dir": FlatName("output.output_dir", "", _none_is("longrl-output")),
    "logging_steps": FlatName("output.logging_steps", "a number of steps (no fraction)", _whole_steps),
    "logging_strategy": accepted("steps", why="a line every output.logging_steps steps"),
    "logging_first_step": ignored("the first step is always logged"),
    "logging_nan_inf_filter": ignored("non-finite values are logged as null and counted by "
                                      "train.max_nonfinite_steps"),
    "log_on_each_node": ignored("rank 0 alone writes the logs"),
    "log_level": accepted("passive", why="longrl logs through Python's logging: "
                                         "logging.getLogger('longrl').setLevel(...)"),
    "log_level_replica": accepted("warning", "passive", why="ranks other than 0 write no logs of their own"),
    "logging_dir": FlatName(None, "TRL's older name; TensorBoard logs go to output.output_dir/tensorboard"),
    "include_num_input_tokens_seen": accepted("no", False, why="metrics.jsonl has each step's token counts"),
    "disable_tqdm": FlatName("output.progress_bar", "progress_bar = not disable_tqdm", _progress_bar),
    "report_to": FlatName("output.report_to", "tensorboard, wandb or none, a name or a list (all: those installed)",
                          _report_to),
    "run_name": accepted(None, why="the Weights & Biases run is named after output.output_dir"),
    "project": accepted("huggingface", "longrl", why="the Weights & Biases project is longrl"),
    **{name: accepted(None, why="trackio is not supported (output.report_to: tensorboard, wandb)") for name in (
        "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id")},
    "skip_memory_metrics": ignored("on CUDA each phase's peak memory is in metrics.jsonl"),
    "log_completions": FlatName("output.log_completions", "completions written to completions.jsonl per logging "
                                "step (False: 0)"),
    "num_completions_to_print": FlatName("output.log_completions", "", _none_unset),
    "log_unique_prompts": ignored("completions.jsonl holds each sampled completion with its prompt"),
    "log_multimodal": ignored("no images: text models only"),
    "log_completions_hub_repo": accepted(None, why="completions go to output_dir/completions.jsonl"),
    # ------------------------------------------------------------------ evaluation
    "eval_strategy": FlatName("output.eval_steps", "no: eval_steps 0; steps: every eval_steps steps"),
    "eval_steps": FlatName("output.eval_steps", "on eval_dataset (data.eval_source); None: no change",
                           _none_unset),
    "num_generations_eval": FlatName("output.eval_num_generations", "the n of pass@k", _none_unset),
    "per_device_eval_batch_size": ignored("evaluation is split as training is (no result depends on it)"),
    "eval_delay": accepted(0, 0.0, why="evaluation runs every output.eval_steps steps from the start"),
    "eval_on_start": accepted(False, why="evaluate before training with `longrl eval CONFIG --from MODEL`"),
    "prediction_loss_only": ignored("evaluation computes its own figures (GRPO: reward and pass@k; SFT: loss)"),
    "eval_do_concat_batches": ignored("evaluation figures do not depend on it"),
    "eval_use_gather_object": ignored("evaluation figures do not depend on it"),
    "eval_accumulation_steps": ignored("evaluation figures do not depend on it"),
    "include_for_metrics": accepted([], why="longrl computes its own evaluation figures"),
    "batch_eval_metrics": accepted(False, why="longrl computes its own evaluation figures"),
    "load_best_model_at_end": accepted(False, why="longrl keeps the newest checkpoints (output.save_total_limit); "
                                                  "pick one by its eval figures in metrics.jsonl"),
    "metric_for_best_model": accepted(None, why="no best-model selection"),
    "greater_is_better": accepted(None, why="no best-model selection"),
    # ------------------------------------------------------------------ checkpoints and the hub
    "save_strategy": accepted("steps", why="checkpoints every output.save_steps steps, at the end and on a stop "
                                           "signal"),
    "save_steps": FlatName("output.save_steps", "a number of steps; 0: at the end only", _whole_steps),
    "save_total_limit": FlatName("output.save_total_limit", "0 or None: keep all", _none_is(0)),
    "save_only_model": accepted(False, why="checkpoints hold the optimizer for resume; `longrl export` writes the "
                                           "model alone"),
    "save_on_each_node": accepted(False, why="rank 0 writes the checkpoints"),
    "enable_jit_checkpoint": ignored("longrl saves a checkpoint on SIGTERM, SIGINT, SIGHUP and SIGUSR1 anyway"),
    "resume_from_checkpoint": FlatName("output.resume", "True or a checkpoint of output_dir: resume from its latest"),
    "ignore_data_skip": accepted(False, why="a resume continues at the checkpoint's data position"),
    "restore_callback_states_from_checkpoint": accepted(False, why="callbacks keep no state in checkpoints"),
    "push_to_hub": accepted(False, why="export a checkpoint with `longrl export` (adapter, merged or gguf), then "
                                       "upload it"),
    **{name: accepted(None, why="nothing is pushed to the hub (push_to_hub)") for name in (
        "hub_token", "hub_private_repo", "hub_model_id", "hub_revision")},
    "hub_strategy": accepted("every_save", why="nothing is pushed to the hub (push_to_hub)"),
    "hub_always_push": accepted(False, why="nothing is pushed to the hub (push_to_hub)"),
    # ------------------------------------------------------------------ what example scripts read
    **{name: ignored("read by example scripts, not by the trainer") for name in ("do_train", "do_eval",
                                                                                 "do_predict")},
    "debug": accepted("", None, [], why="no debug modes"),
    # ------------------------------------------------------------------ PEFT's names of the adapter settings
    "lora_alpha": FlatName("lora.alpha", "PEFT's name"),
    "lora_dropout": FlatName("lora.dropout", "PEFT's name"),
}


# ------------------------------------------------------------------------------ SFTConfig (TRL 1.15 trl/trainer/sft_config.py)

def _truncation_mode(v):
    if v not in ("keep_start", "truncate", "skip", "error"):
        raise FlatNameError("longrl keeps the start of a row (keep_start), or skips the row, or stops naming it "
                            "(sft.overlong: truncate, skip, error)")
    return "truncate" if v == "keep_start" else v


def _max_length(v):
    if v is None:
        raise FlatNameError("longrl plans memory for the longest example; give a number of tokens (longer rows "
                            "follow sft.overlong)")
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
    "packing_strategy": accepted("bfd", why="longrl packs whole examples (bfd); it never cuts or wraps one across "
                                            "packs"),
    "padding_free": FlatName("train.padding_free", "the micro-batch layout (one packed row or padded rows); the loss "
                             "is the same"),
    "eval_packing": ignored("evaluation is split as training is (the loss does not depend on it)"),
    "completion_only_loss": FlatName("sft.completion_only_loss", "prompt/completion rows; None: True (as TRL for "
                                     "those rows)", _none_is(True)),
    "assistant_only_loss": FlatName("sft.assistant_only_loss", "messages rows; located through the chat template"),
    "dataset_text_field": FlatName("sft.text_column"),
    "label_smoothing_factor": FlatName("sft.label_smoothing"),
    "loss_type": accepted("nll", "chunked_nll", why="longrl's SFT loss is the token-mean cross-entropy (nll, always "
                                                    "chunked); dft is not implemented"),
    "activation_offloading": FlatName("model.offload_activations", "layer inputs in host memory, layers recomputed "
                                      "in backward"),
    "num_train_epochs": FlatName("sft.num_train_epochs", "optimizer steps = ceil(epochs × examples / "
                                 "examples_per_step); max_steps > 0 overrides it, as in TRL"),
    "max_steps": FlatName("train.max_steps", "optimizer steps; -1 (TRL's default): num_train_epochs decides"),
    "per_device_train_batch_size": FlatName("train.micro_batch_size", SFT_BATCH_NOTE),
    "gradient_accumulation_steps": FlatName("sft.examples_per_step", SFT_BATCH_NOTE),
    "shuffle_dataset": ignored("examples are drawn in a seeded random order each epoch (data.shuffle), as TRL's "
                               "sampler draws them whatever shuffle_dataset says"),
    "dataset_num_proc": ignored("longrl tokenizes in the trainer's process"),
    "dataset_kwargs": accepted(None, {}, why="longrl always prepares the rows itself (longrl.data.sft_rows)"),
    "chat_template_path": accepted(None, why="set tokenizer.chat_template and pass the tokenizer as "
                                             "processing_class"),
    "eos_token": accepted(None, why="set it on the tokenizer passed as processing_class"),
    "pad_token": accepted(None, why="set it on the tokenizer passed as processing_class"),
}

# TRL_NAMES entries that are GRPO's own (the objective, sampling, rewards, rollout batching): SFTConfig refuses them
GRPO_ONLY = frozenset(name for name, entry in TRL_NAMES.items()
                      if (entry.key or "").split(".")[0] in ("grpo", "generation", "rewards", "environment")
                      or name in ("max_prompt_length", "num_generations_eval", "log_completions",
                                  "num_completions_to_print", "use_vllm", "generation_kwargs", "use_adaptive_entropy",
                                  "sync_ref_model", "vllm_structured_outputs_regex", "vllm_importance_sampling_clip_min")
                      or name.startswith("vllm_") or name.startswith("entropy_coef_"))

TRL_SFT_NAMES: dict[str, FlatName] = {**{n: e for n, e in TRL_NAMES.items() if n not in GRPO_ONLY}, **SFT_NAMES}
