"""The dataclass tree of a run's settings: one section a class, every field with its type, default and meaning.

Field names follow TRL's GRPOConfig where TRL has the same concept. The ``# ...`` comment after each field is its
documentation: ``python -m longrl.config.docs`` renders docs/config.md from this file's source. Loading and checking
values live beside it (loading.py, validation.py); this module holds the tree alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, Optional

import yaml


@dataclass
class ModelConfig:
    name_or_path: str = "builtin:tiny-arith"  # local directory, hub id, builtin:tiny-arith, a longrl run or
    #   checkpoint-STEP directory (its trained model, merged at load: docs/sft.md), or a .gguf file (llama.cpp /
    #   Ollama: loaded through transformers' GGUF support, every tensor dequantized to model.dtype, tokenizer and chat
    #   template from its metadata; needs the gguf package, the export extra; docs/models.md)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    trust_remote_code: bool = False  # run the model repository's own Python code (transformers' trust_remote_code)
    revision: Optional[str] = None  # hub branch, tag or commit of the model; null: the default branch
    attn_implementation: Optional[str] = None  # None: transformers picks (sdpa where supported)
    sdpa_backends: list[str] = field(default_factory=list)  # CUDA: SDPA kernels tried first (cudnn, flash, efficient,
    #                                                          math), the others after; empty: PyTorch's order
    grouped_attention_backward: bool = False  # CUDA: the attention backward of calls of ≥ 65,536 tokens one key head
    #   group at a time on PyTorch's flash kernels (ops/grouped_attention.py; gradients as flash's): its transients
    #   1/heads_kv as large (8B: ~25 KB a token less), for the longest sequences; slower where SDPA's own choice is
    #   cuDNN, as on Hopper GPUs (docs/memory.md has the timings)
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
    load_in_fp8: bool = False  # FP8 base: the same linear layers in e4m3 with a scale per 128x128 block (1 byte a
    #   weight), the same 16-bit exceptions, computing in dtype; needs LoRA; not with load_in_4bit (docs/models.md)
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
    vision_modules: Literal["none", "projector", "tower_and_projector"] = "none"  # vision-language models: adapters
    #   on the language model's linear layers (target_modules), plus none, the projector (image features to the
    #   language model's width), or every linear layer of the vision tower and projector
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
    max_image_pixels: int = 50_000_000  # a row's image of more pixels (width × height) is refused before it is
    #                                     decoded (decompression bombs); images come from an image/images column


@dataclass
class GenerationConfig:
    max_completion_length: int = 256  # most tokens sampled per completion
    temperature: float = 1.0  # sampling temperature (the loss's log-probs use the same); 0: greedy decoding (argmax,
    #   log-probs at temperature 1), for evaluation and generate: GRPO's completions of a prompt would all be alike
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
    fast_decode: bool = True  # Llama/Mistral/Qwen2/Qwen3 decode steps with fused glue kernels, also the language
    #                           model of the vision families (docs/vision.md) (false: transformers' forward)
    nf4_kernel: bool = True  # with fast_decode and a 4-bit base: decode products read the NF4 weights directly
    #                          (ops/nf4_matmul.py, grouped as the packed decode) instead of bitsandbytes' call
    #                          (1.57x its tokens/s in the 8B rollout; false: bitsandbytes' call)
    nf4_halves: bool = False  # with nf4_kernel: the NF4 codes re-paired in place into the halves layout during a
    #   rollout (ops/nf4_halves.py; back in bitsandbytes' order around prefill and after it): faster decode steps
    #   (+15% at 8 rows on an H100), each rollout paying the layout change; off until its whole calls are measured
    pack_projections: bool = True  # with fast_decode: q/k/v and gate/up (+ LoRA A rows) one product a group
    #                                during rollouts (weights moved into one buffer a group, back after it)
    fuse_lora: bool = True  # rollouts add LoRA deltas by fused products (false: PEFT's forward)
    sync_every: int = 16  # sampler decode steps between host checks for finished sequences
    min_decode_batch: int | None = None  # the fewest rows a sampler decode step runs: finished sequences' slots
    #   compact into smaller batches (powers of two) only down to it; each batch size a call runs captures its own
    #   CUDA graphs, which short calls do not win back; null: 16 with CUDA graphs (an H100, SmolLM2-135M's shape:
    #   1.16-1.20x the tokens/s of 1 at 8-128 sequences), 1 without
    speculative: Literal["off", "ngram"] = "off"  # ngram: speculative rollouts (longrl backend): each step drafts up to
    #   max_draft_tokens tokens a sequence from its prompt, its group's completions and the prompt's earlier completions
    #   (no draft model, on the device) and checks them in one forward; exact: plain sampling's distribution; chunks
    #   of plain steps while acceptance misses the break-even (docs/rollouts.md). Off: measured on an H200
    #   (2026-12-05) with SmolLM2-135M it was slower (0.19-0.93x) while drafts were built on the host every step
    max_draft_tokens: int = 4  # speculative: most drafted tokens a sequence checks in one verify step (1-16; each
    #                            sequence's draft length adapts below it to its acceptance)
    speculative_schedule: Literal["measured", "bytes"] = "measured"  # speculative: how a verify step's cost is
    #   judged against the tokens it gains: measured, the run's own verify and plain step times (plain chunks run
    #   where speculation is slower on this GPU and model, the back-off carried from call to call; the choices
    #   follow timings, so a seed's tokens can differ
    #   between runs, their distribution exact either way); bytes, a byte model (the same tokens on every run with a
    #   seed; it leaves out launches and host work, which set small models' steps)


@dataclass
class GRPOLossConfig:
    num_generations: int = 8  # completions per prompt (the group G whose rewards are compared)
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"] = "dapo"  # policy loss
    #                                                                 and its normalisation (docs/losses.md)
    beta: float = 0.0  # weight of the k3 KL penalty to the reference: with LoRA the base, adapters off; with full
    #                    weights a frozen copy of the initial weights (grpo.reference_placement); 0: no reference pass
    reference_placement: Literal["auto", "gpu", "host", "int8"] = "auto"  # full weights with beta > 0: where the
    #   frozen copy of the initial weights is kept: gpu (the training device); host (pinned host memory, each decoder
    #   layer copied to the GPU just ahead of its forward); int8 (on the GPU, the layers' matrices as int8 with a
    #   scale per row: an approximate reference, its layers in half the bytes); auto: gpu when the step fits with it
    #   there, else host (the planner decides; gpu on the CPU). Counted in `longrl plan` (docs/memory.md); each rank
    #   of a data-parallel job keeps its own copy
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
    shared_prompt: Optional[bool] = None  # reference and policy passes on grouped rows: each prompt computed once for
    #                                      its completions (exact; docs/memory.md); null: the planner's choice on
    #                                      CUDA, on where a group's P + G·R tokens are ≤ 0.35 of G·(P + R) (an H200:
    #                                      4.04× faster at 16K-token prompts with 1K answers, 2.71× at 4K), off on
    #                                      the CPU and with float32 compute; true or false pins it
    gpu_memory_gib: float = 0.0  # CUDA: GPU memory the run may use (planner, KV cache, allocator cap); 0: all free
    max_nonfinite_steps: int = 3  # steps in a row whose loss or gradient norm is NaN/inf (each makes no update)
    #                               before the run stops with a checkpoint
    max_no_signal_steps: int = 50  # rollout batches in a row without any learning signal (every reward failed or
    #                                None, or every group's rewards equal) before the run stops; 0: never
    cpu_threads: int = 0  # threads of torch's CPU operations; 0: OMP_NUM_THREADS when set, else the CPUs this process
    #                       may use (affinity, cgroup quota) less those busy with other processes (load average), >= 1


@dataclass
class RewardSpec:
    function: str = ""  # path/to/file.py:function or package.module:function (or url instead)
    weight: float = 1.0  # weight in the sum of rewards
    timeout_s: float = 300.0  # per call; a call that takes longer fails for that batch (0: no limit); with url: per
    #                           HTTP request
    isolation: Literal["none", "process"] = "none"  # process: in a worker process, killed and restarted on timeout
    #                                                  (for untrusted or model-written code)
    memory_limit_gib: float = 0.0  # isolation=process: address-space limit of the worker (0: none)
    cpu_limit_s: float = 0.0  # isolation=process: CPU seconds the worker may use in all (0: none)
    url: str = ""  # http(s)://host/path of a reward server instead of a function: a JSON POST of {prompts,
    #                completions, columns} answered by {"rewards": [number or null, ...]} (docs/robustness.md)
    auth_env: str = ""  # url: the environment variable whose value is sent as the Authorization header (e.g.
    #                     "Bearer ..."); the value itself never goes in the config
    batch_size: int = 0  # url: completions per request (0: the step's whole batch in one request)
    max_concurrency: int = 4  # url: requests in flight at once
    max_retries: int = 3  # url: retries of a request that failed by a connection error, a timeout, HTTP 429 or 5xx
    retry_backoff_s: float = 1.0  # url: wait before the first retry, doubled for each next one (or Retry-After)


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
    max_message_chars: int = 16384  # characters of a tool result or environment message (reset or step) the model
    #                                 sees; longer ones keep their head and end with "... [truncated N characters]"
    #                                 (capped before tokenization, so a huge result costs no memory); >= 64
    max_reset_failure_share: float = 0.5  # a row whose Environment.reset raises (or times out) is skipped (no
    #                                       learning signal; agent/reset_errors counts them); when more than this
    #                                       share of a rollout batch's rows fail, the run stops (exit 2); 1: never


@dataclass
class OutputConfig:
    output_dir: str = "longrl-output"  # where checkpoints, metrics.jsonl, plots and logs go
    logging_steps: int = 1  # steps between log lines and completion samples
    save_steps: int = 0  # 0: save only at the end (and by save_minutes, and on a stop signal)
    save_minutes: float = 30.0  # also save when this long has passed since the last save (0: off)
    on_save_error: Literal["stop", "continue"] = "stop"  # a checkpoint write that fails (disk full): stop, or go on
    overwrite_output_dir: bool = False  # write into a directory that holds files other than a longrl run's
    resume_changed_data: bool = False  # resume although the data file differs from the one the checkpoint saw
    resume_changed_rewards: bool = False  # resume although a reward file (rewards[i].function as a path) differs from
    #                                       the one the checkpoint trained with
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


def trajectory_tokens(cfg: Config) -> int:
    """Tokens after the prompt a completion may hold: generation.max_completion_length, or for multi-turn episodes
    (environment.factory or tools) environment.max_tokens (0: 2 × max_turns × max_completion_length)."""
    env, n = cfg.environment, cfg.generation.max_completion_length
    if not (env.factory or cfg.tools):
        return n
    return env.max_tokens or 2 * env.max_turns * n

