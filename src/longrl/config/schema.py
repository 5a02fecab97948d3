"""One dataclass tree for a run; YAML files and ``dotted.key=value`` overrides; validation with clear errors.

Field names follow TRL's GRPOConfig where TRL has the same concept. Every value is checked before
any model loads: an unknown key, a wrong type or an out-of-range value raises :class:`ConfigError`
naming the key path, the bad value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

import yaml


class ConfigError(ValueError):
    """A configuration value is missing, unknown or invalid; the message names the key."""


DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?|mps|xpu(:\d+)?")


@dataclass
class ModelConfig:
    name_or_path: str = "builtin:tiny-arith"  # local directory, hub id, or builtin:tiny-arith
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    trust_remote_code: bool = False  # run the model repository's own Python code (transformers' trust_remote_code)
    revision: Optional[str] = None  # hub branch, tag or commit of the model; null: the default branch
    attn_implementation: Optional[str] = None  # None: transformers picks (sdpa where supported)
    sdpa_backends: list[str] = field(default_factory=list)  # CUDA: SDPA kernels tried first (cudnn, flash, efficient,
    #                                                          math), the others after; empty: PyTorch's order
    grouped_attention_backward: bool = False  # CUDA: the attention backward of calls of ≥ 65,536 tokens one key head
    #   group at a time on PyTorch's flash kernels (ops/grouped_attention.py; gradients as flash's): its transients
    #   1/heads_kv as large (8B: ~25 KB a token less), for the longest sequences; slower where SDPA's own choice is
    #   cuDNN (torch 2.11 on an H200: a 131,072-token SFT step 79 s against 54 s)
    gradient_checkpointing: Optional[bool] = None  # recompute layer activations in backward (transformers'
    #                                               checkpointing); null: the planner decides on CUDA, off on CPU
    offload_activations: Optional[bool] = None  # checkpoint every layer and keep its input in host memory; null: the
    #                                            planner decides on CUDA (memory/layout.py), off on CPU
    gpu_resident_layers: int = 0  # with offloading: layer inputs per forward kept on the GPU (the last ones); 0: the
    #                               planner's choice
    no_recompute_layers: Optional[int] = None  # with checkpointing (offloaded or plain): the last N decoder layers
    #   keep every activation from forward to backward and are not recomputed (memory for speed; gradients
    #   unchanged; more than the model has: all; without checkpointing no layer is recomputed anyway); null: as
    #   many as the planner fits in its share of GPU memory on CUDA, 0 on CPU
    reuse_attention: Optional[bool] = None  # with offloading: keep each layer's attention output with its input;
    #   backward skips the attention kernel in the recompute (one more activation per layer; gradients unchanged);
    #   null: on with offloading unless the planner finds it costs micro-batch tokens or a finer MLP tile
    fused_layers: bool = True  # CUDA + Triton: Llama-family RMSNorms, SiLU MLPs and rotary embeddings through fused
    #                            kernels (training and prefill; ops/rmsnorm.py, ops/swiglu.py, ops/rotary.py); false:
    #                            transformers' modules
    device: str = "auto"  # auto: cuda if available, else cpu
    load_in_4bit: bool = False  # NF4 base (bitsandbytes, double quant), computing in dtype; needs LoRA (QLoRA)
    quant_keep_modules: list[str] = field(default_factory=list)  # linear modules kept 16-bit (name or dotted suffix)
    quant_exception_budget: float = 0.10  # extra bytes over plain 4-bit for the most sensitive modules in 16-bit
    quant_calibration_text: Optional[str] = None  # text for the sensitivity scores; null: ids drawn from the vocab


@dataclass
class LoraConfig:
    enabled: bool = True  # train LoRA adapters on a frozen base; false: train every weight
    r: int = 16  # adapter rank
    alpha: float = 32.0  # adapter scale alpha (the update is alpha / r · B A)
    dropout: float = 0.0  # dropout on the adapter input
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])  # linear modules that get adapters
    #                                                                            (names or suffixes); all-linear:
    #                                                                            every linear but the LM head
    fused_training: bool = True  # CUDA: the policy update's adapters as one addmm each (scale and add inside the
    #                              B product, in place) with q/k/v and gate/up sharing one A product; over plain
    #                              16-bit bases each sibling group is one product whose backward sums the input
    #                              gradient inside the products (models/lora_training.py)


@dataclass
class DataConfig:
    source: str = "task:arithmetic"  # file (.jsonl/.json/.parquet/.csv), hf:NAME[:CONFIG], or task:NAME
    split: str = "train"  # split of an hf: dataset
    prompt_column: str = "prompt"  # column holding the prompt: a string or chat messages [{role, content}]
    max_prompt_length: int = 512  # longest prompt in tokens (after the chat template)
    overlong_prompt: Literal["error", "truncate_left", "skip"] = "error"  # a longer prompt: stop naming its row, keep
    #                                                                       its last tokens, or drop the row
    shuffle: bool = True  # visit rows in a seeded random order each epoch
    num_examples: Optional[int] = None  # rows used: the first N of a file or hf: dataset, N generated for task:
    #                                      sources; null: all rows (task: sources generate 2000)
    eval_source: Optional[str] = None  # held-out prompts for `longrl eval` and output.eval_steps (forms as source)
    eval_split: str = "test"  # split of an hf: eval_source
    eval_num_examples: int = 64  # eval prompts used: the first rows (rows generated for task:, another seed)


@dataclass
class GenerationConfig:
    max_completion_length: int = 256  # most tokens sampled per completion
    temperature: float = 1.0  # sampling temperature (the loss's log-probs use the same)
    top_p: float = 1.0  # nucleus sampling: the smallest set of tokens with this probability mass; 1: off
    top_k: int = 0  # sample among the k most likely tokens; 0: off
    min_p: float = 0.0  # drop tokens less likely than min_p × the most likely one; 0: off
    repetition_penalty: float = 1.0  # divide the logits of tokens already in the sequence by this; 1: off
    backend: Literal["longrl", "hf"] = "longrl"  # longrl: the batched sampler; hf: transformers' generate
    stop_token_ids: list[int] = field(default_factory=list)  # besides EOS
    stop_strings: list[str] = field(default_factory=list)  # a completion ends after any of these strings
    ignore_eos: bool = False  # generate exactly max_completion_length tokens (benchmarks)
    kv_cache_gib: float = 0.0  # sampler KV budget; 0: what the batch needs (capped by free GPU memory and the budget)
    kv_cache_dtype: Literal["bf16", "fp8"] = "bf16"  # bf16: the compute dtype; fp8: e4m3 keys/values with a
    #                                                  power-of-two scale per position and head (half the bytes)
    cuda_graphs: bool = True  # sampler decode steps as CUDA graphs (CUDA only)
    fast_decode: bool = True  # Llama/Mistral/Qwen2/Qwen3 decode steps with fused glue kernels (false: transformers')
    nf4_kernel: bool = True  # with fast_decode and a 4-bit base: decode products read the NF4 weights directly
    #                          (ops/nf4_matmul.py, grouped as the packed decode) instead of bitsandbytes' call
    #                          (1.57x its tokens/s in the 8B rollout; false: bitsandbytes' call)
    pack_projections: bool = True  # with fast_decode: q/k/v and gate/up (+ LoRA A rows) one product a group
    #                                during rollouts (weights moved into one buffer a group, back after it)
    fuse_lora: bool = True  # rollouts add LoRA deltas by fused products (false: PEFT's forward)
    sync_every: int = 16  # sampler decode steps between host checks for finished sequences


@dataclass
class GRPOLossConfig:
    num_generations: int = 8  # completions per prompt (the group G whose rewards are compared)
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"] = "dapo"  # policy loss
    #                                                                 and its normalisation (docs/losses.md)
    beta: float = 0.0  # weight of the k3 KL penalty to the reference (the base, adapters off); 0: no reference pass
    use_bias_correction_kl: bool = True  # the k3 term times the ratio π/π_old: its gradient is then ∇KL(π ‖ π_ref),
    #                                      the reverse KL that beta penalises (plain k3: the forward KL's); as TRL 1.15
    epsilon: float = 0.2  # clip range of the importance ratio: [1 − epsilon, 1 + epsilon_high]
    epsilon_high: Optional[float] = None  # upper clip (DAPO's clip-higher; the cap of cispo); null: epsilon
    delta: Optional[float] = None  # two-sided clipping: the ratio is capped at delta first; null: off
    importance_sampling_level: Literal["token", "sequence"] = "token"  # one ratio per token (GRPO) or per sequence
    #                                                                    (GSPO: the geometric mean over its tokens)
    sapo_temperature_neg: float = 1.05  # sapo: temperature of the soft gate where the advantage is <= 0
    sapo_temperature_pos: float = 1.0  # sapo: temperature of the soft gate where the advantage is > 0
    vespo_k_pos: float = 2.0  # vespo: sequence weight φ(W) = e^λ W^k e^(−λW); k where the advantage is >= 0
    vespo_lambda_pos: float = 3.0  # vespo: λ where the advantage is >= 0
    vespo_k_neg: float = 3.0  # vespo: k where the advantage is < 0
    vespo_lambda_neg: float = 2.0  # vespo: λ where the advantage is < 0
    entropy_coef: float = 0.0  # entropy bonus: the loss minus entropy_coef × the step's mean token entropy; 0: off
    top_entropy_quantile: float = 1.0  # policy loss only on the top ρ of the step's tokens by entropy; 1: all
    off_policy_mask_threshold: Optional[float] = None  # drop the policy loss of completions with advantage < 0 whose
    #                                                    mean log π_sampler − log π exceeds it; null: off
    num_iterations: int = 1  # optimizer steps per rollout batch (μ in the GRPO paper)
    steps_per_generation: int = 1  # optimizer steps sharing one rollout, each on prompts_per_step of its prompts
    #                                (TRL counts micro-batches: its steps_per_generation / gradient_accumulation_steps)
    scale_rewards: Literal["group", "batch", "none"] = "group"  # divide advantages by the reward std of the group, of
    #                                                             the batch, or not at all
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"  # several
    #   reward functions: advantages of their weighted sum, or each normalised in its group first (GDPO)
    mask_truncated_completions: bool = False  # completions cut at max_completion_length count nothing in the loss
    # importance-sampling correction for sampler/trainer mismatch (TRL: vllm_importance_sampling_correction):
    # weight w = π_trainer_old / π_sampler per token (or per sequence), truncated at the cap or masked above it
    rollout_correction: Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = \
        "token_truncate"
    rollout_correction_cap: float = 2.0  # cap (truncate) or threshold (mask) of that weight


@dataclass
class TrainConfig:
    max_steps: int = 100  # optimizer steps of the run
    prompts_per_step: int = 8  # each optimizer step sees prompts_per_step × num_generations completions
    micro_batch_size: int = 16  # completions per forward/backward; gradients accumulate over micro-batches
    micro_batch_tokens: int = 0  # >0: group completions by this token budget instead (packed, no padding)
    padding_free: Optional[bool] = None  # micro-batch layout (the loss is the same): true: sequences back to back in
    #                                      one row, false: right-padded rows; null: packed on CUDA, padded on CPU
    learning_rate: float = 1e-5  # AdamW learning rate
    weight_decay: float = 0.0  # AdamW weight decay
    adam_beta1: float = 0.9  # AdamW beta1
    adam_beta2: float = 0.999  # AdamW beta2
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = "constant"  # learning-rate schedule after warm-up
    warmup_steps: int = 0  # steps of linear learning-rate warm-up
    max_grad_norm: float = 1.0  # clip the gradient norm to this; 0: no clipping
    seed: int = 0  # seed of the data order, sampling and the builtin model
    logprob_chunk_size: int = 1024  # tokens per chunk of the LM-head log-prob op (no full logits tensor)
    mlp_tile_tokens: Optional[int] = None  # MLP in sequence tiles of this many tokens; 0: off, null: planner decides
    gpu_memory_gib: float = 0.0  # CUDA: GPU memory the run may use (planner, KV cache, allocator cap); 0: all free
    max_nonfinite_steps: int = 3  # steps in a row whose loss or gradient norm is NaN/inf (each makes no update)
    #                               before the run stops with a checkpoint
    max_no_signal_steps: int = 50  # rollout batches in a row without any learning signal (every reward failed or
    #                                None, or every group's rewards equal) before the run stops; 0: never


@dataclass
class RewardSpec:
    function: str = ""  # path/to/file.py:function or package.module:function
    weight: float = 1.0  # weight in the sum of rewards
    timeout_s: float = 300.0  # per call; a call that takes longer fails for that batch (0: no limit)
    isolation: Literal["none", "process"] = "none"  # process: in a worker process, killed and restarted on timeout
    #                                                  (for untrusted or model-written code)
    memory_limit_gib: float = 0.0  # isolation=process: address-space limit of the worker (0: none)
    cpu_limit_s: float = 0.0  # isolation=process: CPU seconds the worker may use in all (0: none)


@dataclass
class EnvironmentConfig:
    factory: Optional[str] = None  # multi-turn episodes: path/to/file.py:Class or package.module:Class, a
    #                                longrl.agents.Environment or a TRL environment_factory class; null: none
    max_turns: int = 4  # assistant turns per episode
    max_tokens: int = 0  # tokens after the prompt per trajectory (sampled + environment); 0: 2 × max_turns ×
    #                      generation.max_completion_length (each turn samples at most max_completion_length)
    turn_timeout_s: float = 60.0  # one environment step (or reset); past it the episode ends; 0: no limit
    episode_timeout_s: float = 600.0  # all environment steps of an episode; 0: no limit
    tool_timeout_s: float = 30.0  # one tool call (an error message to the model past it); 0: no limit
    tool_call_format: Literal["auto", "qwen", "llama3"] = "auto"  # auto: from the tokenizer's chat template
    workers: int = 8  # threads stepping environments while the other sequences decode


@dataclass
class OutputConfig:
    output_dir: str = "longrl-output"  # where checkpoints, metrics.jsonl, plots and logs go
    logging_steps: int = 1  # steps between log lines and completion samples
    save_steps: int = 0  # 0: save only at the end (and by save_minutes, and on a stop signal)
    save_minutes: float = 30.0  # also save when this long has passed since the last save (0: off)
    on_save_error: Literal["stop", "continue"] = "stop"  # a checkpoint write that fails (disk full): stop, or go on
    overwrite_output_dir: bool = False  # write into a directory that holds files other than a longrl run's
    resume_changed_data: bool = False  # resume although the data file differs from the one the checkpoint saw
    save_total_limit: int = 3  # checkpoints kept (the newest); 0: keep all
    resume: bool = False  # continue from the latest checkpoint in output_dir
    log_completions: int = 4  # completions written to completions.jsonl per logging step
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])  # tensorboard (output_dir/tensorboard),
    #                                                                        wandb (WANDB_MODE=offline works), none
    tensorboard: Optional[bool] = None  # deprecated alias: true adds tensorboard to report_to, false removes it
    eval_steps: int = 0  # evaluate on data.eval_source every this many steps and at the last; 0: never
    eval_num_generations: int = 4  # completions per eval prompt: the n of pass@k
    eval_pass_threshold: float = 1.0  # an eval completion passes a reward function when it scores at least this
    progress_bar: bool = True  # in a terminal, show a progress bar


@dataclass
class SFTSettings:
    max_length: int = 1024  # tokens a supervised example may have (TRL's max_length)
    overlong: Literal["truncate", "skip", "error"] = "truncate"  # rows over max_length: keep the first max_length
    #                                                              tokens, drop the row, or stop naming it
    assistant_only_loss: bool = True  # messages rows: train only the assistant turns' tokens (located via the
    #                                   chat template); false: every token
    completion_only_loss: bool = True  # prompt/completion rows: train only the completion's tokens
    text_column: str = "text"  # plain-text rows: the column holding the text (every token trained)
    examples_per_step: int = 8  # examples per optimizer step (TRL: per_device_train_batch_size ×
    #                             gradient_accumulation_steps); micro-batches follow train.micro_batch_tokens
    label_smoothing: float = 0.0  # ε of the label-smoothed cross-entropy (TRL: label_smoothing_factor)
    eval_examples: int = 64  # held-out examples scored at each output.eval_steps (0: none)
    num_train_epochs: Optional[float] = None  # passes over the training examples: the run's optimizer steps are
    #                                           ceil(epochs × examples / examples_per_step); null: train.max_steps


@dataclass
class DistributedConfig:
    timeout_s: float = 600.0  # several processes (torchrun): a collective waiting longer than this on a failed or
    #                           stuck rank raises, and the job ends with that error


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    grpo: GRPOLossConfig = field(default_factory=GRPOLossConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    rewards: list[RewardSpec] = field(default_factory=list)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    tools: list[str] = field(default_factory=list)  # tool functions (path/to/file.py:fn or package.module:fn):
    #                                                 multi-turn episodes that answer the model's tool calls
    output: OutputConfig = field(default_factory=OutputConfig)
    sft: SFTSettings = field(default_factory=SFTSettings)  # supervised fine-tuning (`longrl sft`)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def trajectory_tokens(cfg: "Config") -> int:
    """Tokens after the prompt a completion may hold: generation.max_completion_length, or for multi-turn episodes
    (environment.factory or tools) environment.max_tokens (0: 2 × max_turns × max_completion_length)."""
    env, n = cfg.environment, cfg.generation.max_completion_length
    if not (env.factory or cfg.tools):
        return n
    return env.max_tokens or 2 * env.max_turns * n


# ----------------------------------------------------------------------------- resuming

# keys a resumed run may change: how long it runs, where and how it reports, and how fast or in how much memory it
# computes the same steps; every other key decides the run's trajectory (data, model, adapters, optimizer, loss,
# sampling) and must stay what the checkpoint was trained with
RESUMABLE_CHANGES = ("train.max_steps", "sft.num_train_epochs", "output.", "generation.backend", "generation.cuda_graphs",
                     "generation.kv_cache_gib", "generation.kv_cache_dtype", "generation.sync_every",
                     "train.gpu_memory_gib", "generation.fast_decode",
                     "generation.fuse_lora", "generation.nf4_kernel", "generation.pack_projections",
                     "train.micro_batch_tokens", "train.micro_batch_size", "train.logprob_chunk_size",
                     "train.mlp_tile_tokens", "model.device", "model.offload_activations",
                     "model.gpu_resident_layers", "model.no_recompute_layers", "model.sdpa_backends",
                     "model.grouped_attention_backward", "model.reuse_attention", "model.attn_implementation",
                     "model.gradient_checkpointing",
                     "model.fused_layers", "lora.fused_training", "train.padding_free", "data.eval_source",
                     "data.eval_split", "data.eval_num_examples",
                     "train.max_nonfinite_steps", "train.max_no_signal_steps", "rewards[].timeout_s",
                     "rewards[].isolation", "rewards[].memory_limit_gib", "rewards[].cpu_limit_s",
                     "distributed.")


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):  # rewards: rewards[i].key
            for i, x in enumerate(v):
                out.update(_flat(x, f"{prefix}{k}[{i}]."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def resume_conflicts(saved: dict, cfg: "Config") -> list[str]:
    """'key: saved → now' for each key outside RESUMABLE_CHANGES whose value differs between the config a
    checkpoint was trained with (``saved``, as stored in its JSON state) and ``cfg``."""
    import json

    before, now = _flat(saved), _flat(json.loads(json.dumps(cfg.to_dict())))
    return [f"{k}: {before.get(k)!r} → {now.get(k)!r}" for k in sorted(set(before) | set(now))
            if before.get(k) != now.get(k) and not any(
                re.sub(r"\[\d+\]", "[]", k) == a or (a.endswith(".") and k.startswith(a)) for a in RESUMABLE_CHANGES)]


# ----------------------------------------------------------------------------- key names and suggestions

@functools.lru_cache(maxsize=None)
def config_keys(cls=None, prefix: str = "") -> tuple[str, ...]:
    """Every dotted key of the tree below ``cls`` (``Config``): its leaves, with ``rewards`` as one key."""
    out = []
    for f in dataclasses.fields(cls or Config):
        tp = typing.get_type_hints(cls or Config)[f.name]
        if dataclasses.is_dataclass(tp):
            out += config_keys(tp, f"{prefix}{f.name}.")
        else:
            out.append(f"{prefix}{f.name}")
    return tuple(out)


def trl_key(name: str, names: dict | None = None) -> str | None:
    """The dotted key TRL's flat field ``name`` sets in this tree (``names``: ``longrl.config.trl_names.TRL_NAMES``, or
    ``TRL_SFT_NAMES``), or None: the name is not TRL's, or its longrl key is not in this version (then found by its
    leaf name if that is unique)."""
    from .trl_names import TRL_NAMES

    entry = (TRL_NAMES if names is None else names).get(name)
    if entry is None or entry.key is None:
        return None
    keys = config_keys()
    if entry.key in keys:
        return entry.key
    leaf = entry.key.rsplit(".", 1)[-1]
    same = [k for k in keys if k.rsplit(".", 1)[-1] == leaf]
    return same[0] if len(same) == 1 else None


def suggest_key(path: str) -> str:
    """'did you mean train.learning_rate?' for an unknown key: a TRL flat name, a key of another section, or a
    near miss; '' when nothing is close."""
    from .trl_names import SFT_NAMES, TRL_NAMES

    leaf = path.rsplit(".", 1)[-1]
    keys = config_keys()
    table = TRL_NAMES if leaf in TRL_NAMES else SFT_NAMES
    if leaf in table:
        entry, key = table[leaf], trl_key(leaf, table)
        note = f": {entry.note}" if entry.note else ""
        if key is None:
            return f"TRL's {leaf} has no longrl key{note or ': not in this version of longrl'}"
        shown = "rewards[i].weight" if key == "rewards" else key
        return f"did you mean {shown}? (TRL's {leaf}{note})"
    elsewhere = [k for k in keys if k.rsplit(".", 1)[-1] == leaf and k != path]
    if elsewhere:
        return f"did you mean {' or '.join(elsewhere)}?"
    leaves = {k.rsplit(".", 1)[-1]: k for k in keys}
    close = difflib.get_close_matches(path, keys, n=1, cutoff=0.8) or \
        [leaves[m] for m in difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.8)]
    return f"did you mean {close[0]}?" if close else ""


# ----------------------------------------------------------------------------- parsing and validation

def _describe(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _describe(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_describe(typing.get_args(tp)[0])}"
    if dataclasses.is_dataclass(tp):
        return f"a mapping with keys {', '.join(f.name for f in dataclasses.fields(tp))}"
    return getattr(tp, "__name__", str(tp))


def _convert(value, tp, key: str):
    """Return ``value`` converted to type ``tp`` or raise ConfigError naming ``key``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, key)
            except ConfigError as e:
                errors.append(e)
        if len(errors) == 1 and "finite" in str(errors[0]):  # Optional[float] given inf/nan: say so
            raise errors[0]
        raise ConfigError(f"config key '{key}': got {value!r}; expected {_describe(tp)}")
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise ConfigError(f"config key '{key}': got {value!r}; allowed: {_describe(tp)[7:]}")
    if origin is list:
        if isinstance(value, (str, dict)) or not isinstance(value, (list, tuple)):
            if typing.get_args(tp)[0] is str and isinstance(value, str):
                return [value]
            raise ConfigError(f"config key '{key}': got {value!r}; expected {_describe(tp)}")
        return [_convert(v, typing.get_args(tp)[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}': got {value!r}; expected {_describe(tp)}")
        return _build(tp, value, key)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and math.isfinite(value) and value == int(value):  # 1e3 in YAML: a float
            return int(value)
        if isinstance(value, str):
            try:
                number = float(value)  # YAML 1.1 reads "1e10" as a string
            except ValueError:
                number = None
            if number is not None and math.isfinite(number) and number == int(number) and "." not in value:
                return int(number)
    elif tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):
                raise ConfigError(f"config key '{key}': got {value!r}; expected a finite number")
            return number
    elif tp is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"config key '{key}': got {value!r} ({type(value).__name__}); expected {_describe(tp)}")


def _build(cls, data: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in data:
        if k not in names:
            path = f"{prefix}.{k}" if prefix else k
            hint = suggest_key(path)
            raise ConfigError(f"unknown config key '{path}'{'; ' + hint if hint else ''}; allowed keys here: "
                              f"{', '.join(sorted(names))}")
    obj = cls()
    for k, v in data.items():
        path = f"{prefix}.{k}" if prefix else k
        setattr(obj, k, _convert(v, hints[k], path))
    return obj


def _set_dotted(tree: dict, dotted: str, value) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {} if node.get(part) is None else node[part]
            if not isinstance(node[part], dict):
                raise ConfigError(f"config key '{dotted}': '{part}' is not a section")
        node = node[part]
    node[parts[-1]] = value


def parse_overrides(overrides: list[str]) -> list[tuple[str, object]]:
    """``["train.max_steps=10", ...]`` → ``[("train.max_steps", 10), ...]`` (values parsed as YAML)."""
    pairs = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not KEY=VALUE (e.g. train.max_steps=10)")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: value is not valid YAML ({e})") from None
        pairs.append((key.strip(), value))
    return pairs


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                base: Config | None = None, recipe: str = "grpo") -> Config:
    """Config from ``base`` (or defaults), then the YAML file at ``path``, then KEY=VALUE overrides, validated for
    ``recipe`` (``grpo`` or ``sft``: supervised runs need no reward functions)."""
    tree = (base or Config()).to_dict()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        _paths_from_folder(loaded, path)
        _merge(tree, loaded)
    for key, value in parse_overrides(overrides or []):
        _set_dotted(tree, key, value)
    cfg = _build(Config, tree)
    validate(cfg, require_rewards=recipe != "sft")
    return cfg


def _relative_file(value: str) -> bool:
    """A relative file path (not task:, hf: or memory:, not absolute or ~)."""
    return (isinstance(value, str) and value != "" and not value.startswith(("task:", "hf:", "memory:", "~"))
            and not os.path.isabs(value))


def _from_folder(value: str, key: str, config_file: Path) -> str:
    """``value`` (relative) as read from the config file's folder; refused when only the working directory has it
    (where such paths were read before), so a run never reads another file than the one its config names."""
    joined = os.path.join(os.path.dirname(os.path.abspath(config_file)), value)
    if not os.path.exists(joined) and os.path.exists(value):
        raise ConfigError(f"config key '{key}' in {config_file}: {value!r} is read relative to the config file's "
                          f"folder, as {joined}, which does not exist; ./{value} exists in the working directory: "
                          "write its path relative to the config file, or absolute")
    return joined


def _paths_from_folder(loaded: dict, config_file: Path) -> None:
    """Relative data and reward-file paths of a YAML file, resolved against the file's folder (in place)."""
    data = loaded.get("data")
    if isinstance(data, dict) and _relative_file(data.get("source")):
        data["source"] = _from_folder(data["source"], "data.source", config_file)
    for i, spec in enumerate(loaded.get("rewards") or []):
        ref = spec.get("function") if isinstance(spec, dict) else None
        if isinstance(ref, str) and ":" in ref:
            target, name = ref.rsplit(":", 1)
            if (target.endswith(".py") or "/" in target) and _relative_file(target):
                spec["function"] = f"{_from_folder(target, f'rewards[{i}].function', config_file)}:{name}"


def _merge(tree: dict, new: dict, prefix: str = "") -> None:
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(tree.get(k), dict):
            _merge(tree[k], v, f"{prefix}{k}.")
        else:
            tree[k] = v


def _check(cond: bool, key: str, value, allowed: str) -> None:
    if not cond:
        raise ConfigError(f"config key '{key}': got {value!r}; allowed: {allowed}")


def validate(cfg: Config, require_rewards: bool = True) -> None:
    """Range and consistency checks beyond types (``require_rewards=False``: the reward functions come later, as
    ``GRPOTrainer(reward_funcs=...)``, or the run is supervised)."""
    g, t, gen, o = cfg.grpo, cfg.train, cfg.generation, cfg.output
    _check(g.num_generations >= 2, "grpo.num_generations", g.num_generations, "an integer >= 2 (advantages compare a group)")
    _check(g.beta >= 0, "grpo.beta", g.beta, ">= 0")
    _check(0 <= g.epsilon < 1, "grpo.epsilon", g.epsilon, "0 <= epsilon < 1")
    _check(g.epsilon_high is None or g.epsilon_high > 0, "grpo.epsilon_high", g.epsilon_high, "null or > 0")
    _check(g.delta is None or g.delta > 1, "grpo.delta", g.delta, "null or > 1")
    _check(g.num_iterations >= 1, "grpo.num_iterations", g.num_iterations, "an integer >= 1")
    _check(g.steps_per_generation >= 1, "grpo.steps_per_generation", g.steps_per_generation, "an integer >= 1")
    _check_loss_options(cfg)
    per_rollout = g.num_iterations * g.steps_per_generation
    rollout_steps = (f"grpo.num_iterations × grpo.steps_per_generation ({g.num_iterations} × "
                     f"{g.steps_per_generation})" if g.steps_per_generation > 1 else f"grpo.num_iterations ({g.num_iterations})")
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
    _check(gen.max_completion_length >= 1, "generation.max_completion_length", gen.max_completion_length, ">= 1")
    _check(gen.temperature > 0, "generation.temperature", gen.temperature, "> 0")
    _check(0 < gen.top_p <= 1, "generation.top_p", gen.top_p, "0 < top_p <= 1")
    _check(gen.top_k >= 0, "generation.top_k", gen.top_k, ">= 0 (0 disables)")
    _check(0 <= gen.min_p < 1, "generation.min_p", gen.min_p, "0 <= min_p < 1")
    _check(gen.repetition_penalty > 0, "generation.repetition_penalty", gen.repetition_penalty, "> 0")
    _check(gen.kv_cache_gib >= 0, "generation.kv_cache_gib", gen.kv_cache_gib, ">= 0 (0: automatic)")
    _check(gen.sync_every >= 1, "generation.sync_every", gen.sync_every, ">= 1")
    _check(all(isinstance(s, str) and s for s in gen.stop_strings), "generation.stop_strings", gen.stop_strings,
           "non-empty strings")
    _check(g.rollout_correction_cap >= 1, "grpo.rollout_correction_cap", g.rollout_correction_cap, ">= 1")
    _check(cfg.data.max_prompt_length >= 1, "data.max_prompt_length", cfg.data.max_prompt_length, ">= 1")
    _check(cfg.data.num_examples is None or cfg.data.num_examples >= 1, "data.num_examples", cfg.data.num_examples,
           "null (all rows) or an integer >= 1")
    _check(cfg.lora.r >= 1, "lora.r", cfg.lora.r, "an integer >= 1")
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
    _check(t.gpu_memory_gib >= 0, "train.gpu_memory_gib", t.gpu_memory_gib, ">= 0 (0: all free GPU memory)")
    _check(cfg.grpo.beta == 0 or cfg.lora.enabled, "grpo.beta", cfg.grpo.beta,
           "0 with lora.enabled=false (the reference policy is the base with the adapters disabled: without "
           "adapters it would be the policy itself, a KL of 0; no second copy of the weights is kept)")
    _check(not m.load_in_4bit or cfg.lora.enabled, "model.load_in_4bit", m.load_in_4bit,
           "true only with lora.enabled=true (4-bit weights cannot be trained; QLoRA trains adapters on them)")
    _check(m.quant_exception_budget >= 0, "model.quant_exception_budget", m.quant_exception_budget,
           ">= 0 (a fraction of the plain 4-bit weight bytes; 0: no exceptions beyond the keep-list)")
    _check(m.quant_calibration_text is None or m.quant_calibration_text.strip() != "", "model.quant_calibration_text",
           m.quant_calibration_text, "null (token ids drawn from the vocabulary) or a non-empty text")
    _check(0 <= cfg.lora.dropout < 1, "lora.dropout", cfg.lora.dropout, "0 <= dropout < 1")
    _check(cfg.distributed.timeout_s > 0, "distributed.timeout_s", cfg.distributed.timeout_s, "> 0 seconds")
    _check(o.logging_steps >= 1, "output.logging_steps", o.logging_steps, "an integer >= 1")
    _check(all(t in ("tensorboard", "wandb", "none") for t in o.report_to), "output.report_to", o.report_to,
           "a list of tensorboard, wandb, none")
    _check(o.save_total_limit >= 0, "output.save_total_limit", o.save_total_limit, "an integer >= 0 (0: keep all)")
    _check(o.eval_steps >= 0, "output.eval_steps", o.eval_steps, "an integer >= 0 (0: no evaluation in training)")
    _check(o.eval_num_generations >= 1, "output.eval_num_generations", o.eval_num_generations, "an integer >= 1")
    _check(math.isfinite(o.eval_pass_threshold), "output.eval_pass_threshold", o.eval_pass_threshold,
           "a finite number")
    _check(cfg.data.eval_num_examples >= 1, "data.eval_num_examples", cfg.data.eval_num_examples, "an integer >= 1")
    _check(o.save_steps >= 0, "output.save_steps", o.save_steps, "an integer >= 0")
    _check(o.save_steps % per_rollout == 0, "output.save_steps", o.save_steps,
           f"a multiple of {rollout_steps}: checkpoints fall between rollout batches")
    _check(o.save_minutes >= 0, "output.save_minutes", o.save_minutes, ">= 0 (0: no saves by time)")
    _check(o.output_dir.strip() != "", "output.output_dir", o.output_dir, "a directory path")
    env = cfg.environment
    agentic = bool(env.factory or cfg.tools)
    _check(bool(cfg.rewards) or bool(env.factory) or not require_rewards, "rewards", cfg.rewards,
           "at least one reward function (with environment.factory: none means the environment's own rewards)")
    _check(env.max_turns >= 1, "environment.max_turns", env.max_turns, "an integer >= 1")
    _check(env.max_tokens == 0 or env.max_tokens > gen.max_completion_length, "environment.max_tokens",
           env.max_tokens, f"0 (automatic) or more than generation.max_completion_length ({gen.max_completion_length})")
    for key in ("turn_timeout_s", "episode_timeout_s", "tool_timeout_s"):
        _check(getattr(env, key) >= 0, f"environment.{key}", getattr(env, key), ">= 0 (0: no limit)")
    _check(env.workers >= 1, "environment.workers", env.workers, "an integer >= 1")
    _check(env.factory is None or ":" in env.factory, "environment.factory", env.factory,
           "'path/to/file.py:Class' or 'package.module:Class'")
    for i, ref in enumerate(cfg.tools):
        _check(":" in ref, f"tools[{i}]", ref, "'path/to/file.py:function' or 'package.module:function'")
    _check(not agentic or gen.backend == "longrl", "generation.backend", gen.backend,
           "longrl with environment.factory or tools (multi-turn episodes run inside longrl's sampler)")
    s = cfg.sft
    _check(s.max_length >= 2, "sft.max_length", s.max_length, "an integer >= 2")
    _check(s.examples_per_step >= 1, "sft.examples_per_step", s.examples_per_step, "an integer >= 1")
    _check(0 <= s.label_smoothing < 1, "sft.label_smoothing", s.label_smoothing, "0 <= label_smoothing < 1")
    _check(s.eval_examples >= 0, "sft.eval_examples", s.eval_examples, "an integer >= 0")
    _check(s.num_train_epochs is None or s.num_train_epochs > 0, "sft.num_train_epochs", s.num_train_epochs,
           "null (train.max_steps decides) or > 0")
    for i, r in enumerate(cfg.rewards):
        _check(":" in r.function or not require_rewards, f"rewards[{i}].function", r.function,
               "'path/to/file.py:function' or 'package.module:function'")
        _check(math.isfinite(r.weight), f"rewards[{i}].weight", r.weight, "a finite number")
        _check(r.timeout_s >= 0, f"rewards[{i}].timeout_s", r.timeout_s, ">= 0 (0: no limit)")
        _check(r.memory_limit_gib >= 0, f"rewards[{i}].memory_limit_gib", r.memory_limit_gib, ">= 0 (0: none)")
        _check(r.cpu_limit_s >= 0, f"rewards[{i}].cpu_limit_s", r.cpu_limit_s, ">= 0 (0: none)")
        _check(r.isolation == "process" or (r.memory_limit_gib == 0 and r.cpu_limit_s == 0),
               f"rewards[{i}].isolation", r.isolation, "'process' when memory_limit_gib or cpu_limit_s is set "
               "(limits apply to a worker process)")
    _check(DEVICE_PATTERN.fullmatch(m.device) is not None, "model.device", m.device,
           "auto, cpu, cuda, cuda:N, mps, xpu or xpu:N")
    from .limits import check_sizes

    check_sizes(cfg)


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
