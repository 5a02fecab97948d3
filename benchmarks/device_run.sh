#!/usr/bin/env bash
# One GPU-machine call that runs the named stages in order, each under its own time limit, and packs every
# result file and log into $OUT/results.tar.gz (the device tool returns at most 8 files). Run from the repo root
# with the wheels carried in .whl/ (trl, datasets, dill, multiprocess; bitsandbytes unpacked in
# .whl/bnb-0.50.2-slim for the 4-bit stage):
#
#   bash benchmarks/device_run.sh kernel rollout8b e2e8b_a      # e.g.; stages below, ~minutes each
#
# On a 2-GPU machine, two lists can run side by side (install once, then SKIP_INSTALL=1 and one GPU each):
#   CUDA_VISIBLE_DEVICES=0 OUT=$OUT/g0 SKIP_INSTALL=1 bash benchmarks/device_run.sh trl8b_a &
#   CUDA_VISIBLE_DEVICES=1 OUT=$OUT/g1 SKIP_INSTALL=1 bash benchmarks/device_run.sh e2e8b_b; wait
# A run longer than one call (TRL's whole step at 8B): start it in the background on the last GPU and collect it
# with a second call of the same kind made within the machine's 30 s warm period:
#   CUDA_VISIBLE_DEVICES=0 bash benchmarks/device_run.sh bg_trl8b_a e2e15_b e2e8b_b4   # call 1 (nvidia-h200-x2)
#   bash benchmarks/device_run.sh collect                                              # call 2, right after
#
# Stages:
#   kernel     decode attention Triton vs PyTorch twin on the GPU + the GPU test files (sampler, memory, NF4) (~1.5 min)
#   sampgpu    the sampler's GPU tests (CUDA graphs, free rows, the decode floor, whole-step graphs, the uniforms'
#              kernel; ~1 min)
#   uniforms   benchmarks/uniform_speed.py: the sampling uniforms' PyTorch twin against their one-launch kernel, host
#              and GPU µs a call, bit for bit checked (~20 s)
#   stepgraphs call_overhead.py with Sampler(step_graphs) off and on, plain calls of 8, 32, 128 sequences (OSEQ) on
#              SmolLM2's shape (SGSHAPE: another, e.g. llama-3.1-8b) (~1-2 min)
#   gpucheck   benchmarks/gpu_kernel_checks.py: sampling / decode attention / merge kernels at their edges (~1 min)
#   glue       decode glue kernels (SiLU·up, rotary/KV store), plain and with the packed decode's LoRA fold, and a
#              sweep of the folding SiLU·up kernel's launch choices (~2 min; GTAG names the file; rollout8b/rollout15
#              with GLUE_FROM=benchmarks/results/decode_glue_h200<GTAG>.json run its fastest choice)
#   nf4        the NF4 decode product: bitsandbytes vs longrl's 4-bit kernel vs bf16, 8B projection shapes (~1 min)
#   nf4sweep   the same, first the packed decode's NF4 groups under a sweep of launch choices (~2 min); rollout8b
#              with NF4_FROM=benchmarks/results/nf4_matmul_<card>_sweep.json runs its fastest (IMPLS=longrl,longrl-4bit,
#              longrl-4bit-bnb: bf16 vs 4-bit rollouts side by side); NF4SWEEP_ARGS adds arguments (--skip-table,
#              --sweep-rows 32,16)
#   nf4fast    nf4sweep (lut 3 and lut 4 choices), then the 8B rollout bf16 beside 4-bit on the sweep's fastest (~7 min;
#              carry .whl_bnb)
#   fp8fast    fp8sweep (default and f16 choices), then the 8B rollout bf16 beside the FP8 base, 4 x 8 x 512 after 512,
#              on the sweep's fastest (FP8_FROM does the same for rollout8b) (~8 min; carry .whl_bnb)
#   fp8sweep   nf4_matmul.py --fp8 --sweep: the FP8 decode product's launch choices (fp8_matmul.LAUNCH is unmeasured;
#              rollout_speed.py --fp8-launch benchmarks/results/fp8_matmul_h200_sweep.json runs the fastest) (~4 min)
#   nf4gpu     the NF4 GPU tests alone (~40 s)
#   mma        the few-row NF4 CUDA kernels (ops/nf4_mma.py, built by NVRTC): their GPU tests, then nf4_matmul.py
#              --sweep --mma --table-only --skip-table: LAUNCH's entry against both kernels' choices at 8, 16, 32 rows
#              (MMA_ROWS) (~5 min; carry .whl_bnb)
#   mmasweep   the mma stage's sweep alone, without its GPU tests (~2 min)
#   ncumma     Nsight Compute on one product (benchmarks/product_once.py) at 8 rows, gate/up + A: on the CUDA kernel
#              (MMA_LAUNCH), the staged CUDA kernel and Triton's; speed of light, memory, warp stalls, occupancy
#              (~2 min; NCU_ROWS another row count)
#   halvesgpu  the NF4 halves layout's GPU tests alone (~40 s)
#   halves     the NF4 halves layout (ops/nf4_halves.py): its GPU tests, then nf4_matmul.py --sweep --halves
#              --table-only --skip-table: LAUNCH's entry against the halves choices at 128, 32, 16 rows (~3 min;
#              carry .whl_bnb; HTAG names the file)
#   overhead   call_overhead.py: a short rollout call's fixed host costs (captures, set-up) beside its decode steps,
#              SmolLM2-135M shape, 8/32/128 sequences (OSEQ), min_decode_batch 1 and 16 (OMIN), plain and ngram
#   profile8b  GPU time per kernel of 8B decode steps alone (128 steps), fast path and transformers + PEFT (~2 min);
#              PVARIANTS=packed,fused,hf picks the paths (default packed,hf), PTAG=... the file's tag
#   profile8b4 profile8b's packed path on the 4-bit (NF4) model, decode products on the NF4 kernel (~2 min; both
#              profile 16 prompts x 8 = 128 rows; PPROMPTS=1: 8 rows; LAUNCH_FROM: decode attention launch choices,
#              as rollout8b's, e.g. '{"counters": true}')
#   profile8b_kv  profile8b's packed path at 16 sequences of their own 16,128-token prompt, bf16 then FP8 KV cache
#              (kv_fp8_speed's 16 x 1 whole-model case): where the decode step's time goes with each (~4 min;
#              PROFILE_KV=fp8: the FP8 cache alone)
#   profile15  the same for the Qwen2.5-1.5B shape, 64 prompts x 8 (its rollout runs at 20% of its roofline) (~2 min)
#   rollout8b  rollout_speed, Llama-3.1-8B shape, longrl: defaults, transformers' forward, PEFT's LoRA, no LoRA (~2 min); with
#              LAUNCH_FROM=<decode_attention json> the decode attention runs that sweep's fastest launch choice;
#              IMPLS=... (rollout8b, rollout15) replaces the list of implementations, TAG=... the files' tag
#   rollout15  rollout_speed, Qwen2.5-1.5B shape, longrl + transformers generate (~3 min)
#   multiturn8b multiturn_speed, 8B shape, 16 prompts x 8, 4 turns of 512 tokens + 200 tool tokens each: kept
#              caches vs single-turn of the same length vs the re-prefill-every-turn prefill (~3 min, 240 s cap)
#   e2e15      grpo_e2e 1.5B, 4 prompts x 8 x 4,096, 1 step (~1.5 min)
#   hfcb8b     transformers continuous batching alone, 8B shape, capped at 240 s
#   e2e8b_a    grpo_e2e 8B, 4 prompts x 8 x 4,096, 2 steps + CLI smoke (~4 min)
#   e2e8b_a1   e2e8b_a with 1 step (+ CLI smoke), files tagged ETAG (default _fused) (~2.5 min)
#   e2e8b_a1kv e2e8b_a1 without the CLI smoke, generation.kv_cache_dtype from E2E_KV (bf16 | fp8), tag ETAG
#   e2e8b_a8   the same with an FP8 base (e4m3, 128 x 128 block scales, the 16-bit exceptions), 1 step: beside
#              e2e8b_a1kv in one call, issue 43's FP8 training step against bf16's (~2.5 min each)
#   e2e8b_a4   the same with an NF4 4-bit base, 1 step (decode products on longrl's NF4 kernel, the default since
#              2026-12-01; e2e8b_a4b: through bitsandbytes' call, as before)
#   e2e8b_b    grpo_e2e 8B, 2 prompts x 8 x 16,384, 1 step (~5 min)
#   e2e8b_a4k  e2e8b_a4 with generation.nf4_kernel (decode products read the NF4 weight directly; compare e2e8b_a4)
#   trl8b_a    TRL GRPOTrainer.train() anchor for e2e8b_a (long: transformers generate)
#   bg_trl8b_a TRL's anchor started in the background on the LAST GPU (setsid: it outlives this call; give the
#              other stages the first GPU with CUDA_VISIBLE_DEVICES=0), writing to /tmp/bg
#   bg_probe400k  grpo_memory 8B, one 409,600-token sequence, the planner's layout (resident layers + MLP tile),
#              in the background likewise (~8-10 min by FLOP count; one background run at a time: each needs
#              most of a GPU)
#   collect    wait for the background runs (within the stage limit), then copy their files into results/ and logs
#   e2e15_b    grpo_e2e 1.5B, 2 prompts x 8 x 16,384, 1 step;  e2e15_a4 / e2e15_b4 / e2e8b_b4: 4-bit variants
#   attn8b     the first part of attn alone (8B heads, sweep + breakdown; ~2.5 min)
#   attnrows8  decode attention at the matrix's 8-row cell (8B heads, 1 prompt x 8, prompt 1,024, 256-position
#              slot store): each kernel's GPU time and a sweep down to few programs (fewer partial columns for the
#              fused merge to read: 2 to 8 suffix and 2 to 32 prompt columns at these sizes; ~3 min)
#   attn       decode attention alone (Triton vs SDPA, CUDA-graph timed) against its KV bytes: 8B heads 16 x 8 at
#              T=1,024, 1.5B heads 64 x 8 (both with a sweep of the kernels' launch choices at the shortest and longest
#              suffix, and each kernel's GPU time), 8B 2 x 8 at 16K (~4 min)
#   prof20k    grpo_memory 8B 20,480 x 8 (reuse, MLP tiles 4,096): one step + one profiled step (GPU time per
#              kernel, _profile.txt) + the GPU gradient check with each run's forward log-probs (~4 min)
#   prof20k_cudnn  the same step and profile with cuDNN attention first (~3 min)
#   lmhead     the LM-head product's layouts at decode batch sizes, 8B and 1.5B heads (~20 s)
#   probe262k  grpo_memory 8B, one 262,144-token sequence, MLP tiles 16,384 (~4 min)
#   mem20k     grpo_memory 8B 20,480 x 8: longrl, tiled, 4-bit, warmed (2 reps) (~6 min)
#   target20k  issue 3's configuration alone on the machine (run it on nvidia-h200, nothing else on the host):
#              reuse + fused layers + fused LoRA, MLP tiles of 4,096, 2 warmed reps; then the same with cuDNN
#              attention first (~7 min)
#   rope20k    issue 3's configuration with the fused rotary embedding (part of +fused since it exists): MLP tiles
#              of 4,096 and 8,192 (RTILES), 2 warmed reps each (~4 min; RTAG names the files)
#   side20k    issue 3's configuration and TRL's frugal layout alternately in one run, 20,480 x 8, warmed (~3 min;
#              STAG names the files)
#   prof20kf   issue 3's configuration (reuse + fused layers + fused LoRA, tiles 4,096) at 20,480 x 8: one step
#              under torch.profiler (~3 min)
#   fused20k   grpo_memory 8B 20,480 x 8, warmed (1 rep): attention reuse with the fused layers and fused LoRA vs
#              without, untiled and in MLP tiles of 4,096 (FIMPLS, FTILES, FTAG override) (~5 min)
#   sdpa20k    grpo_memory 8B 20,480 x 8, MLP tiles 4,096, longrl with cuDNN SDPA first (keys/values repeated to
#              the query heads so cuDNN takes the GQA call: longrl_sdpa_mha) (~3 min; compare reuse20k)
#   reuse20k   grpo_memory 8B 20,480 x 8, MLP tiles 4,096: offloaded vs offloaded + attention reuse, warmed, and
#              the GPU gradient check (offload and reuse vs plain) on the 1.5B shape (~5 min)
#   reusecheck attention reuse vs plain checkpointing per SDPA backend (PyTorch's order, flash, efficient, cuDNN),
#              stacked and packed rows: noise floor (plain vs plain), offload, reuse, and reuse with the host copies
#              made contiguous (the code before the fix) (benchmarks/reuse_gradient_check.py, 1.5B shape); then the
#              reuse GPU tests of tests/test_memory_gpu.py (~1.5 min)
#   groupedgpu the per-key-head attention backward's GPU tests (ops/grouped_attention.py) (~40 s)
#   fp8gpu     the FP8 KV and budget GPU tests, with the sampler's GPU tests (~1.5 min)
#   fp8kern    the FP8 KV kernels against their twins on the GPU alone (~3 min, compiles every launch)
#   fp8k128    the default FP8 launch (blocks of 128) against its twin on the GPU alone (~1 min)
#   newgpu     the GPU tests of the grouped rows, KL reference, FP8 base, vision sampler, fast verify, compiled
#              kernels and sampler (the 2026-12-05 list; ~3.5 min)
#   specverify speculative_rollout.py's (ii): the 8B verify step against a decode step, virtual rows, each also as a
#              whole-step CUDA graph (~2 min; SPEC_CONTEXTS, SPEC_ROWS narrow it, SPEC_LIMIT its seconds)
#   attnab     benchmarks/attention_ab.py: whole rollout calls under decode attention launch choices, interleaved in
#              one process (ABVARIANTS: the JSON variants separated by ";", the first the reference; ABROWS,
#              ABBASES, ABCTX the prompt length, ABREPS; ~3 min)
#   sharedwarm shared_prompt_speed.py, grouped rows vs separate, the issue's four cases, each way's second step
#              timed (--repeat 2: the pinned pool warm) (~8 min; SHCASES replaces the cases)
#   matrix     benchmarks/rollout_matrix.py: rollout tokens/s and roofline by base (bf16, NF4, FP8; nf4h: NF4 in the
#              halves layout, nf4m: NF4 with the few-row CUDA kernel, nf4t: NF4 on the table MNF4T, `auto` this
#              card's nf4sweep result; each beside nf4), rows (8, 32, 128), context (1K, 16K) and KV cache (bf16,
#              FP8), every pair in one run (issue 43's table; carry .whl_bnb, the bitsandbytes 0.50.2 wheel, for
#              the NF4 base; MBASES, MROWS, MCONTEXTS, MKV narrow it; MNF4: an NF4 launch table, e.g.
#              benchmarks/results/nf4_matmul_${CARD}_sweep.json; MMA_FROM: nf4m's launch, a JSON entry or a
#              --sweep --mma result, `auto` this card's (run mmasweep first); MATTN: decode attention launch
#              choices for every cell, e.g. '{"counters": true}'; MTAG the file's tag) (~10 min)
#   visiona / visionb / visionc  benchmarks/vision_grpo.py's modes (issue 44): (a) the whole 4-bit step in 15 GiB,
#              (b) the longest completions in 22 GiB, (c) longrl beside the per-completion layout and TRL 1.15 (bf16;
#              VARMS narrows the arms); carry .whl_bnb for (a) and (b), .whl (trl, datasets) for (c) (~9 min each);
#              VDEADLINE the program's deadline (500 s; (b) and (c); it must end inside the stage's limit, DEADLINE
#              less the install and 20 s), VSTATE an earlier probe's _probes.json for (b) to go on from
#   exactpin   shared_prompt_speed.py at 16,384:1,024 with the offloader's buffers from torch's pinned allocator, then
#              page-locked by whole pages (--exact-pinned): time and host bytes each (JSON `host`), and the exact
#              pinning's GPU tests (~5 min)
#   sharedlong shared_prompt_speed.py at 512:20480 in micro-batches of 82,432 tokens (a group cut into rows of 4
#              completions: one whole group, 164K tokens, offloads more than the H200 host's 125 GiB) (~5 min)
#   shared32k  shared_prompt_speed.py at 32,768:1024, each way's second step timed (~3 min)
#   vlayout    benchmarks/value_layout_bandwidth.py: the FP8 kernel's loads alone, by value layout (~1 min)
#   kvfp8      benchmarks/kv_fp8_speed.py --sweep: decode attention bf16 vs FP8 cache (2 x 8, to 16K; the FP8 kernel's
#              variants: bf16 or float16 products, exponents loaded ahead or not; all under each launch choice of
#              kv_fp8_speed.FP8_SWEEP at 16K), whole-model 8B decode at 16K-token sequences with each cache
#              (FP8 twice: the default launch, and LAUNCH's choices), 2 prompts x 8 and 16 x 1, warmed (~4 min; KTAG
#              names the files; KVFP8_ARGS replaces --sweep, e.g. KVFP8_ARGS= for no sweep; KVFP8_LIMIT seconds)
#   budget_small  grpo_e2e 8B 4-bit, train.gpu_memory_gib=22, FP8 KV, auto layout, 1 x 8 x 2,048, 1 step; then the
#              same with a bf16 cache (the sampler mismatch metrics of each) (~2.5 min)
#   budget20k  grpo_e2e 8B 4-bit, 20,480 x 8 (prompt 512), train.gpu_memory_gib=22, FP8 KV, auto layout, 1 step
#              (~7 min; B20K_ARGS=--nf4-halves: the NF4 codes in the halves layout during the rollout; --nf4-mma:
#              the products of up to 8 rows on the few-row CUDA kernel)
#   e2e20k4    budget20k without the budget: the same 4-bit, FP8-KV whole step uncapped, for the step time beside it
#              (~7 min)
#   e2e20k_cap40  grpo_e2e 8B bf16 base, 20,480 x 8, train.gpu_memory_gib=40 (bf16 KV), auto layout, 1 step (~5 min)
#   sft8b4     sft8b with an NF4 base (longrl's quantize_model; TRL trains the same Linear4bit layers through PEFT),
#              32K and 128K (SFT_LENGTHS) (~5 min)
#   sft8b4_us  the same lengths through Unsloth with its 4-bit base (benchmarks/sft_unsloth.py, its own process; run
#              it right after sft8b4) (~5 min)
#   sftcap40_trl  TRL 1.15's SFTTrainer step, bf16 base, allocator capped at 40 GiB, lengths rising to past its limit
#              (by its slope, 0.619 GiB per 1K tokens, about 39K) (~3 min)
#   sftcap4_trl  sftcap4 for TRL: NF4 base, allocator capped at 24 GiB, lengths rising to past its limit (~2 min)
#   sftslope   sft_memory 8B bf16, longrl (--offload-all: the longest lengths' layout) and TRL at 16K/32K/64K: peak
#              slope per token predicts the longest sequence a budget holds (~3 min; the sft*_us and sft*_trl stages,
#              like grpous, carry .whl and .whl_us, which install_us installs into /tmp/site_us)
#   sftslope_us  the same lengths through Unsloth (benchmarks/sft_unsloth.py, its own process) (~4 min)
#   sftslope4 / sftslope4_us  the same with an NF4 base (longrl / Unsloth) (~2.5 / ~3.5 min)
#   sftdefault longrl's SFT step in the planner's own layout (bf16; resident layer inputs where they fit), for time
#              per token beside sftslope_us (~1.5 min)
#   sftprof    longrl's SFT step (planner's layout) and Unsloth's at 24,576 tokens, each timed then once under
#              torch.profiler: GPU time by kernel kind and per kernel (sft_memory_*_prof*_profile_*.txt) (~4 min)
#   sftcmp     longrl's SFT step (planner's layout) then Unsloth's, 12,288 and 24,576 tokens (SFT_LENGTHS), in one
#              call: time per token side by side (SFTTAG names the files) (~3.5 min)
#   sftcap4 / sftcap4_us  NF4 base, allocator capped at 24 GiB, lengths rising to past the slope's predicted limit,
#              one run each (the first length twice: a warm-up); longrl with the planner's own layout (~3.5 / ~3 min)
#   sftsnap    longrl's SFT step, bf16, offload-all layout, 49,152 and 131,072 tokens (SNAP_LENGTHS), each once
#              more with the allocator's history recorded: what is live at its peak, by the code that allocated it
#              (sft_memory_*_snap_snapshot_<length>.md; the planner's attention term) (~4 min)
#   sftcap40 / sftcap40_us  bf16 base, allocator capped at 40 GiB (a 40/48 GB card), lengths rising to past each
#              tool's limit: longrl in the planner's own layout, then Unsloth (~5.5 / ~3.5 min; run _us first;
#              SFT_ARGS=--grouped-attention: longrl's attention backward per key head, CAPTAG names the files)
#   memgpu     tests/test_memory_gpu.py: offloading and attention reuse on the GPU's kernels, the planner's attention
#              kernel against the one that runs (~1.5 min)
#   sftplan    `longrl plan --sft` for the 8B shape, LoRA r=32, one sequence of each of PLAN_LENGTHS tokens in
#              PLAN_GIB (40) GiB (PLAN_ARGS: more overrides): what the product admits on this GPU (~1 min)
#   scale1     benchmarks/grpo_scale.py --phases train,rollout, 8B LoRA: the 20,480 x 8 training step alone (reference
#              + update on fixed completions, grpo_memory's figure) and the 16 x 8 x 1,024 rollout alone (rollout_speed's
#              figure), each warmed up once and measured once, the distributed path at world size 1 (torchrun, DDP)
#              beside the one-process path, one model load per path (~6 min; SCTAG names the files)
#   scale1s    the training step of scale1 alone, one-process path only, SCREPS measured reps (default 2), SCNR layers
#              not recomputed (model.no_recompute_layers; default -1: the planner's choice), SCLAYOUT=qlora for the
#              4-bit base (~2 min)
#   grpous     issue 43: longrl's default trainer step (grpo_scale.py --phases train: the trainer's own reference
#              pass and update, the planner's layout) then Unsloth 2026.10.9's GRPO step
#              (benchmarks/grpo_unsloth.py, its own process: reference + policy through its UnslothGRPOTrainer), 8B
#              shape, 20,480 x 8 (random ids, each benchmark its own), GUREPS (1) warmed reps each; ULAYOUTS
#              (unsloth,frugal) the Unsloth layouts (its GRPOConfig defaults 4 x 2; 1 x 8), ULEN the lengths. Carry
#              .whl (trl, dill, multiprocess) and .whl_us:
#              unsloth (its wheel without the studio/ and unsloth_cli/ folders, which it never imports), unsloth_zoo,
#              datasets 4.8.5 (unsloth wants < 5), and in .whl_us/opt pillow and requests (+ urllib3, idna, certifi,
#              charset_normalizer), installed only where they do not import; and .whl_bnb (Unsloth's model
#              patching imports bitsandbytes for a 16-bit base too) (~6 min; files
#              grpo_scale_phases_llama-3.1-8b_gpu_side_unsloth.md and grpo_memory_llama-3.1-8b_unsloth.md)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/logs"
[ -n "${SKIP_INSTALL:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed (continuing)"
export PYTHONPATH=/tmp/site:$PWD/.whl/bnb-0.50.2-slim:$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
python3 -c "import torch, transformers, peft, triton; print(torch.__version__, transformers.__version__, peft.__version__, triton.__version__)"

DEADLINE=${DEADLINE:-570}  # seconds for all stages together (the device's per-call limit is 600): a stage gets
                           # at most what is left minus 20 s, so the results are always packed
stage() {  # stage NAME LIMIT_SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    local left=$((DEADLINE - SECONDS - 20))
    if [ "$left" -lt 30 ]; then echo "=== $name: skipped (deadline)"; return 1; fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "=== $name (limit ${limit}s): $*"
    local start=$SECONDS
    timeout "$limit" bash -c '"$@"' _ "$@" >"$OUT/logs/$name.log" 2>&1  # bash -c: a command may be a function
    local rc=$?
    echo "=== $name: rc=$rc after $((SECONDS - start)) s"
    grep -v -i "warn" "$OUT/logs/$name.log" | tail -25
}

background() {  # background NAME COMMAND...: on the last GPU, in its own session (it outlives this call), files
    local name=$1  # and log to /tmp/bg; `collect` in a later call of the same machine waits for it
    shift
    mkdir -p /tmp/bg
    local last=$(( $(nvidia-smi -L | wc -l) - 1 ))
    CUDA_VISIBLE_DEVICES=$last LONGRL_RESULTS_DIR=/tmp/bg setsid nohup bash -c '"$@"' _ "$@" >"/tmp/bg/$name.log" \
        2>&1 </dev/null &
    echo $! >"/tmp/bg/$name.pid"
    echo "=== $name: started in the background on GPU $last"
}

with_tf524() {  # run a command on transformers 5.24 (carried in .whl/tf524 with tokenizers 0.23.3, huggingface-hub
    # 2.4.0 with its httpx2 stack, safetensors 0.8.0, and peft 0.21.2 + accelerate 1.15.0: the combination tested with
    # TRL 1.15 on the CPU, also in a bare virtual environment):
    # (benchmarks/grpo_e2e.py checks before TRL trains that generate, called TRL's way, reuses its KV cache)
    [ -d /tmp/site_tf524 ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target /tmp/site_tf524 .whl/tf524/*.whl >/dev/null 2>&1 || echo "tf524 install failed"
    PYTHONPATH=/tmp/site_tf524:$PYTHONPATH "$@"
}

export -f with_tf524

install_bnb() {  # the bitsandbytes wheel carried in .whl_bnb (for the NF4 base), once a machine
    [ -d /tmp/site/bitsandbytes ] || [ ! -d .whl_bnb ] || python3 -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --target /tmp/site .whl_bnb/*.whl
}

install_us() {  # Unsloth and what it imports that the GPU image lacks, into /tmp/site_us (ahead of /tmp/site), once
    [ -d /tmp/site_us/unsloth ] && return
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_us .whl_us/*.whl \
        .whl/trl-*.whl .whl/dill-*.whl .whl/multiprocess-*.whl >/dev/null 2>&1 || echo "unsloth wheel install failed"
    local w name
    for w in $(ls .whl_us/opt/*.whl 2>/dev/null); do  # (optional: the GPU image has them)
        name=${w##*/}; name=${name%%-*}; [ "$name" = pillow ] && name=PIL
        python3 -c "import $name" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile \
            --no-cache-dir --target /tmp/site_us "$w" >/dev/null 2>&1 || echo "$name wheel install failed"
    done
}

ncu_product() {  # ncu_product GROUP ROWS LAUNCH_JSON KERNEL_REGEX: one product under Nsight Compute (its 4th call)
    ncu --kernel-name "regex:$4" --launch-skip 3 --launch-count 1 --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats \
        --section SchedulerStats --section InstructionStats python3 benchmarks/product_once.py --group "$1" \
        --rows "$2" ${3:+--launch "$3"}
}

ncu_mma() {
    local rows=${NCU_ROWS:-8} mma
    mma=$(python3 -c "import json; from longrl.ops import nf4_matmul as nm; print(json.dumps(nm.MMA_LAUNCH))")
    ncu_product "gate/up + A" "$rows" "$mma" nf4_mma
    ncu_product "gate/up + A" "$rows" '{"mma": true, "staged": true, "min_blocks": 16}' nf4_mma_staged
    ncu_product "gate/up + A" "$rows" "" _group_kernel
}

export -f ncu_product ncu_mma

PLAN_LENGTHS=${PLAN_LENGTHS:-196608,202220,204800}
export PLAN_LENGTHS

install_bnb  # whatever the stages: a carried .whl_bnb means the call wants bitsandbytes (the 4-bit stages, NF4 tests)
CARD=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import results_io; print(results_io.card_tag())")

for s in "$@"; do
    case $s in
        kernel) stage kernel 60 python3 -c "import sys, torch; sys.path.insert(0, 'benchmarks'); import rollout_speed as r; \
print('triton vs twin on the GPU, max abs err', r.check_kernel(torch.device('cuda')))" \
            && stage sampler_gpu 200 python3 -m pytest -q tests/test_sampler_gpu.py tests/test_memory_gpu.py \
            tests/test_nf4_matmul.py ;;
        gpucheck) stage gpucheck 120 python3 benchmarks/gpu_kernel_checks.py ;;
        glue) stage glue 200 python3 benchmarks/decode_glue_speed.py --tag "${GTAG:-}" ;;
        nf4) stage nf4 120 python3 benchmarks/nf4_matmul.py ;;
        nf4sweep) stage nf4sweep 240 python3 benchmarks/nf4_matmul.py --sweep ${NF4SWEEP_ARGS:-} ;;
        fp8sweep) stage fp8sweep 300 python3 benchmarks/nf4_matmul.py --fp8 --sweep ;;
        nf4gpu) stage nf4gpu 90 python3 -m pytest -q -m gpu tests/test_nf4_matmul.py ;;
        mma) stage mmagpu 240 python3 -m pytest -q -m gpu tests/test_nf4_mma.py
            stage mma 240 python3 benchmarks/nf4_matmul.py --sweep --mma --table-only --skip-table \
                --sweep-rows "${MMA_ROWS:-8,16,32}" ;;
        mmasweep) stage mma 240 python3 benchmarks/nf4_matmul.py --sweep --mma --table-only --skip-table \
                --sweep-rows "${MMA_ROWS:-8,16,32}" ;;
        ncumma) stage ncumma 200 ncu_mma ;;
        halvesgpu) stage halvesgpu 90 python3 -m pytest -q -m gpu tests/test_nf4_halves.py ;;
        halves) stage halvesgpu 90 python3 -m pytest -q -m gpu tests/test_nf4_halves.py
            stage halves 240 python3 benchmarks/nf4_matmul.py --sweep --halves --table-only --skip-table ;;
        sampgpu) stage sampgpu 150 python3 -m pytest -q -m gpu tests/test_sampler_gpu.py ;;
        profile8b) stage profile8b 200 python3 benchmarks/rollout_speed.py --shape llama-3.1-8b --profile 129 \
            --profile-variants "${PVARIANTS:-packed,hf}" ${PPROMPTS:+--prompts "$PPROMPTS"} \
            --tag "${PTAG:-_fast}" ;;
        profile8b4) stage profile8b4 240 python3 benchmarks/rollout_speed.py --shape llama-3.1-8b --profile 129 \
            --profile-variants packed --profile-4bit ${PPROMPTS:+--prompts "$PPROMPTS"} \
            ${LAUNCH_FROM:+--launch "$LAUNCH_FROM"} --tag "${PTAG:-_fast}_4bit" ;;
        profile8b_kv) for kv in ${PROFILE_KV:-bf16 fp8}; do stage profile8b_$kv 210 python3 benchmarks/rollout_speed.py \
            --shape llama-3.1-8b --prompts 16 --G 1 --prompt-len 16128 --profile 65 --profile-variants packed --impls longrl \
            --kv-cache-dtype $kv --tag _16k_$kv; done ;;
        profile15) stage profile15 200 python3 benchmarks/rollout_speed.py --shape qwen2.5-1.5b --prompts 64 \
            --profile 129 --tag _fast ;;
        rollout8b) stage rollout8b 300 python3 benchmarks/rollout_speed.py --shape llama-3.1-8b \
            --impls "${IMPLS:-longrl,longrl-hf,longrl-peft,longrl-nolora}" --tag "${TAG:-_fast}" \
            ${LAUNCH_FROM:+--launch "$LAUNCH_FROM"} ${GLUE_FROM:+--glue-launch "$GLUE_FROM"} \
            ${NF4_FROM:+--nf4-launch "$NF4_FROM"} ${FP8_FROM:+--fp8-launch "$FP8_FROM"} ;;
        nf4fast) stage nf4sweep 240 python3 benchmarks/nf4_matmul.py --sweep
            stage rollout8b_nf4 300 python3 benchmarks/rollout_speed.py --shape llama-3.1-8b --impls longrl,longrl-4bit \
                --tag "${TAG:-_nf4fast}" --nf4-launch "benchmarks/results/nf4_matmul_${CARD}_sweep.json" ;;
        fp8fast) stage fp8sweep 300 python3 benchmarks/nf4_matmul.py --fp8 --sweep
            stage rollout8b_fp8 240 python3 benchmarks/rollout_speed.py --shape llama-3.1-8b --impls longrl,longrl-fp8 \
                --prompts 4 --new-tokens 512 --tag "${TAG:-_fp8fast}" \
                --fp8-launch "benchmarks/results/fp8_matmul_${CARD}_sweep.json" ;;
        rollout15) stage rollout15 300 python3 benchmarks/rollout_speed.py --shape qwen2.5-1.5b --prompts 64 \
            --impls "${IMPLS:-longrl,longrl-hf,longrl-nolora,hf-generate}" --tag "${TAG:-_fast}" \
            ${GLUE_FROM:+--glue-launch "$GLUE_FROM"} ;;
        e2e15) stage e2e15 120 python3 benchmarks/grpo_e2e.py --shape qwen2.5-1.5b --prompts 4 --completion 4096 \
            --steps 1 --no-cli-smoke ;;
        hfcb8b) stage hfcb8b 300 python3 benchmarks/rollout_speed.py --shape llama-3.1-8b --impls hf-continuous --tag _hfcb ;;
        e2e8b_a) stage e2e8b_a 420 python3 benchmarks/grpo_e2e.py --shape llama-3.1-8b --prompts 4 --completion 4096 --steps 2 ;;
        e2e8b_a1) stage e2e8b_a1 300 python3 benchmarks/grpo_e2e.py --shape llama-3.1-8b --prompts 4 --completion 4096 \
            --steps 1 --tag "${ETAG:-_fused}" ;;
        e2e8b_a1kv) stage e2e8b_a1kv_${E2E_KV:-bf16} 300 python3 benchmarks/grpo_e2e.py --shape llama-3.1-8b --prompts 4 \
            --completion 4096 --steps 1 --no-cli-smoke --kv-cache-dtype "${E2E_KV:-bf16}" --tag "${ETAG:-}" ;;
        e2e8b_a4) stage e2e8b_a4 420 python3 benchmarks/grpo_e2e.py --shape llama-3.1-8b --prompts 4 --completion 4096 \
            --steps 1 --no-cli-smoke --load-in-4bit --tag "${ETAG:-}" ;;
        e2e8b_a8) stage e2e8b_a8 420 python3 benchmarks/grpo_e2e.py --shape llama-3.1-8b --prompts 4 --completion 4096 \
            --steps 1 --no-cli-smoke --load-in-fp8 --tag "${ETAG:-}" ;;
        e2e8b_a4b) stage e2e8b_a4b 420 python3 benchmarks/grpo_e2e.py --shape llama-3.1-8b --prompts 4 --completion 4096 \
            --steps 1 --no-cli-smoke --load-in-4bit --bnb-decode ;;
        e2e8b_b) stage e2e8b_b 480 python3 benchmarks/grpo_e2e.py --shape llama-3.1-8b --prompts 2 --completion 16384 \
            --steps 1 --no-cli-smoke ;;
        trl8b_a) stage trl8b_a 560 with_tf524 python3 benchmarks/grpo_e2e.py --shape llama-3.1-8b --prompts 4 \
            --completion 4096 --steps 1 --no-cli-smoke --impl trl --tag _tf524 ;;
        bg_trl8b_a) stage trl_imports 90 with_tf524 python3 -c "import transformers, trl, peft, huggingface_hub; \
print('TRL stack', transformers.__version__, trl.__version__, peft.__version__, huggingface_hub.__version__)"
            background trl8b_a with_tf524 python3 benchmarks/grpo_e2e.py --shape llama-3.1-8b --prompts 4 \
            --completion 4096 --steps 1 --no-cli-smoke --impl trl --tag _tf524 ;;
        bg_probe400k) background probe400k python3 benchmarks/grpo_memory.py --shape llama-3.1-8b --lengths 409600 \
            --G 1 --impls longrl-planned --reps 0 --tag probe_400k --out /tmp/bg ;;
        collect) stage collect 560 bash -c 'for f in /tmp/bg/*.pid; do while kill -0 "$(cat "$f")" 2>/dev/null; do
            sleep 5; done; done'
            cp /tmp/bg/*.json /tmp/bg/*.md benchmarks/results/ 2>/dev/null; cp /tmp/bg/*.log "$OUT/logs/" 2>/dev/null
            tail -n 5 /tmp/bg/*.log ;;
        e2e15_b) stage e2e15_b 300 python3 benchmarks/grpo_e2e.py --shape qwen2.5-1.5b --prompts 2 --completion 16384 \
            --steps 1 --no-cli-smoke ;;
        e2e15_a4) stage e2e15_a4 200 python3 benchmarks/grpo_e2e.py --shape qwen2.5-1.5b --prompts 4 --completion 4096 \
            --steps 1 --no-cli-smoke --load-in-4bit --tag "${ETAG:-}" ;;
        e2e15_b4) stage e2e15_b4 300 python3 benchmarks/grpo_e2e.py --shape qwen2.5-1.5b --prompts 2 --completion 16384 \
            --steps 1 --no-cli-smoke --load-in-4bit --tag "${ETAG:-}" ;;
        e2e8b_a4k) stage e2e8b_a4k 420 python3 benchmarks/grpo_e2e.py --shape llama-3.1-8b --prompts 4 --completion 4096 \
            --steps 1 --no-cli-smoke --load-in-4bit --nf4-kernel ;;
        e2e8b_b4) stage e2e8b_b4 480 python3 benchmarks/grpo_e2e.py --shape llama-3.1-8b --prompts 2 --completion 16384 \
            --steps 1 --no-cli-smoke --load-in-4bit --tag "${ETAG:-}" ;;
        attn8b) stage attn 180 python3 benchmarks/decode_attention_speed.py --sweep --breakdown --tag _graph ;;
        attnrows8) stage attnrows8 240 python3 benchmarks/decode_attention_speed.py --prompts 1 --prompt-len 1024 \
            --max-suffix 256 --suffix 1,128,256 --sweep --breakdown --sweep-programs 128,256,512 \
            --sweep-prefix-programs 16,32,64,128,512 --tag _rows8 ;;
        attn) stage attn 180 python3 benchmarks/decode_attention_speed.py --sweep --breakdown --tag _graph \
            && stage attn15 150 python3 benchmarks/decode_attention_speed.py --prompts 64 --heads 12,2,128 --sweep \
            --breakdown --tag _qwen15_graph \
            && stage attn16k 90 python3 benchmarks/decode_attention_speed.py --prompts 2 --max-suffix 16384 \
            --suffix 1024,8192,16384 --tag _graph ;;
        prof20k) stage prof20k 360 python3 benchmarks/grpo_memory.py --shape llama-3.1-8b --lengths 20480 \
            --impls longrl-reuse --mlp-tile 4096 --reps 0 --profile --check-equality --tag prof_20k ;;
        rope20k) stage rope20k 300 python3 benchmarks/grpo_memory.py --shape llama-3.1-8b --lengths 20480 \
            --impls longrl-reuse+fused+flora --mlp-tile "${RTILES:-4096,8192}" --reps 2 --tag "${RTAG:-target_rope_20k}" ;;
        grpous) install_us; install_bnb  # (Unsloth's model patching imports bitsandbytes even for a 16-bit base)
            stage grpous_longrl 300 python3 benchmarks/grpo_scale.py --layouts lora --gpus "" --with-single --phases train \
                --prompts-per-gpu 1 --completion $((${ULEN:-20480} - 512)) --reps "${GUREPS:-1}" --timeout 280 \
                --no-recompute -1 --tag _side_unsloth
            PYTHONPATH=/tmp/site_us:$PYTHONPATH stage grpous_unsloth 360 python3 benchmarks/grpo_unsloth.py \
                --shape llama-3.1-8b --lengths "${ULEN:-20480}" --layouts "${ULAYOUTS:-unsloth,frugal}" \
                --reps "${GUREPS:-1}" ${UARGS:-} ;;
        side20k) stage side20k 420 python3 benchmarks/grpo_memory.py --shape llama-3.1-8b --lengths 20480 \
            --impls longrl-reuse+fused+flora,trl-frugal --mlp-tile 4096 --reps 1 --tag "${STAG:-side_20k}" ;;
        prof20kf) stage prof20kf 300 python3 benchmarks/grpo_memory.py --shape llama-3.1-8b --lengths 20480 \
            --impls longrl-reuse+fused+flora --mlp-tile 4096 --reps 0 --profile --tag "${PFTAG:-prof_fused_20k}" ;;
        prof20k_cudnn) stage prof20k_cudnn 300 python3 benchmarks/grpo_memory.py --shape llama-3.1-8b --lengths 20480 \
            --impls longrl-reuse --mlp-tile 4096 --reps 0 --profile --sdpa cudnn --tag prof_cudnn_20k ;;
        lmhead) stage lmhead 60 python3 benchmarks/lm_head_gemm.py --vocab 128256 --hidden 4096 \
            && stage lmhead15 60 python3 benchmarks/lm_head_gemm.py --vocab 151936 --hidden 1536 ;;
        probe262k) stage probe262k 420 python3 benchmarks/grpo_memory.py --shape llama-3.1-8b --lengths 262144 --G 1 \
            --impls longrl --mlp-tile 16384 --reps 0 --tag probe_262k ;;
        sft8b) python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_trl \
            .whl_trl/*.whl >/dev/null 2>&1 || echo "trl wheel install failed"
            PYTHONPATH=/tmp/site_trl:$PYTHONPATH stage sft8b 480 python3 benchmarks/sft_memory.py --shape llama-3.1-8b \
            --lengths "${SFT_LENGTHS:-32768,131072}" --impls longrl,trl --reps 1 ;;
        sft8b4) install_us; PYTHONPATH=/tmp/site_us:$PYTHONPATH stage sft8b4 480 python3 benchmarks/sft_memory.py --shape llama-3.1-8b --load-in-4bit \
            --lengths "${SFT_LENGTHS:-32768,131072}" --impls longrl,trl --reps 1 --tag "${SFTTAG:-}" ;;
        sft8b4_us) install_us; PYTHONPATH=/tmp/site_us:$PYTHONPATH stage sft8b4_us 330 python3 benchmarks/sft_unsloth.py \
            --shape llama-3.1-8b --load-in-4bit --lengths "${SFT_LENGTHS:-32768,131072}" --reps 1 --tag "${SFTTAG:-}" ;;
        sftcap40_trl) install_us; PYTHONPATH=/tmp/site_us:$PYTHONPATH stage sft_cap40_trl 230 python3 benchmarks/sft_memory.py \
            --shape llama-3.1-8b --cap-gib 40 --lengths "${CAP40_LENGTHS_TRL:-12288,32768,36864,40960,49152}" \
            --impls trl --reps 0 --tag _cap40_trl ;;
        sftcap4_trl) install_us; PYTHONPATH=/tmp/site_us:$PYTHONPATH stage sft_cap4_trl 230 python3 benchmarks/sft_memory.py --shape llama-3.1-8b --load-in-4bit \
            --cap-gib 24 --lengths "${CAP_LENGTHS_TRL:-12288,12288,24576,32768,40960,49152}" --impls trl --reps 0 \
            --tag _cap24_trl ;;
        sftslope) install_us; PYTHONPATH=/tmp/site_us:$PYTHONPATH stage sft_slope 200 python3 benchmarks/sft_memory.py \
            --shape llama-3.1-8b --lengths "${SFT_LENGTHS:-16384,32768,65536}" --impls longrl,trl --offload-all \
            --reps 1 --tag _slope ;;
        sftslope_us) install_us; PYTHONPATH=/tmp/site_us:$PYTHONPATH stage sft_slope_us 260 python3 benchmarks/sft_unsloth.py \
            --shape llama-3.1-8b --lengths "${SFT_LENGTHS:-16384,32768,65536}" --reps 1 --tag _slope ;;
        sftslope4) stage sft_slope4 160 python3 benchmarks/sft_memory.py --shape llama-3.1-8b --load-in-4bit \
            --lengths "${SFT_LENGTHS:-16384,32768,65536}" --impls longrl --offload-all --reps 1 --tag _slope ;;
        sftslope4_us) install_us; PYTHONPATH=/tmp/site_us:$PYTHONPATH stage sft_slope4_us 220 python3 benchmarks/sft_unsloth.py \
            --shape llama-3.1-8b --load-in-4bit --lengths "${SFT_LENGTHS:-16384,32768,65536}" --reps 1 --tag _slope ;;
        sftdefault) stage sft_default 120 python3 benchmarks/sft_memory.py --shape llama-3.1-8b --impls longrl \
            --lengths "${SFT_LENGTHS:-12288,24576,49152}" --reps 1 --tag _default ;;
        sftprof) stage sft_prof 150 python3 benchmarks/sft_memory.py --shape llama-3.1-8b --impls longrl \
            --lengths "${SFT_LENGTHS:-24576}" --reps 1 --profile --tag _prof
            install_us; PYTHONPATH=/tmp/site_us:$PYTHONPATH stage sft_prof_us 200 python3 benchmarks/sft_unsloth.py \
            --shape llama-3.1-8b --lengths "${SFT_LENGTHS:-24576}" --reps 1 --profile --tag _prof ;;
        sftcmp) stage sft_cmp 280 python3 benchmarks/sft_memory.py --shape llama-3.1-8b --impls longrl \
            --lengths "${SFT_LENGTHS:-12288,24576}" --reps 1 --tag "${SFTTAG:-_cmp}"
            install_us; PYTHONPATH=/tmp/site_us:$PYTHONPATH stage sft_cmp_us 300 python3 benchmarks/sft_unsloth.py \
            --shape llama-3.1-8b --lengths "${SFT_LENGTHS:-12288,24576}" --reps 1 --tag "${SFTTAG:-_cmp}" ;;
        sftcap4) stage sft_cap4 230 python3 benchmarks/sft_memory.py --shape llama-3.1-8b --load-in-4bit --cap-gib 24 \
            --lengths "${CAP_LENGTHS:-12288,12288,49152,98304,131072,147456}" --impls longrl --reps 0 --tag "_cap24${CAPTAG:-}" ;;
        sftcap4_us) install_us; PYTHONPATH=/tmp/site_us:$PYTHONPATH stage sft_cap4_us 230 python3 benchmarks/sft_unsloth.py \
            --shape llama-3.1-8b --load-in-4bit --cap-gib 24 --reps 0 --tag _cap24 \
            --lengths "${CAP_LENGTHS_US:-12288,12288,24576,49152,65536,81920,98304}" ;;
        sftsnap) stage sft_snap 300 python3 benchmarks/sft_memory.py --shape llama-3.1-8b --impls longrl --offload-all \
            --lengths "${SNAP_LENGTHS:-49152,131072}" --reps 0 --memory-snapshot --tag _snap ${SFT_ARGS:-} ;;
        sftcap40) stage sft_cap40 330 python3 benchmarks/sft_memory.py --shape llama-3.1-8b --cap-gib 40 \
            --lengths "${CAP40_LENGTHS:-12288,131072,180224,196608}" --impls longrl --reps 0 --tag "_cap40${CAPTAG:-}" \
            ${SFT_ARGS:-} ;;
        sftcap40_us) install_us; PYTHONPATH=/tmp/site_us:$PYTHONPATH stage sft_cap40_us 230 python3 benchmarks/sft_unsloth.py \
            --shape llama-3.1-8b --cap-gib 40 --reps 0 --tag _cap40 \
            --lengths "${CAP40_LENGTHS_US:-12288,12288,65536,81920,90112,98304,106496}" ;;
        memgpu) stage memgpu 150 python3 -m pytest -q tests/test_memory_gpu.py ;;
        sftplan) stage sftplan 60 bash -c 'python3 -c "from transformers import LlamaConfig; LlamaConfig(
            hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
            num_key_value_heads=8, vocab_size=128256, max_position_embeddings=262144).save_pretrained(\"/tmp/l8b\")" &&
            python3 -m longrl.cli.main init --sft --model /tmp/l8b >/tmp/l8b_sft.yaml &&
            for L in ${PLAN_LENGTHS//,/ }; do python3 -m longrl.cli.main plan /tmp/l8b_sft.yaml sft.max_length=$L \
            sft.examples_per_step=1 lora.r=32 ${PLAN_ARGS:-} --sft --gpu-memory-gib ${PLAN_GIB:-40} 2>&1; done' ;;
        groupedgpu) stage groupedgpu 120 python3 -m pytest -q tests/test_grouped_attention_gpu.py ;;
        fp8gpu) stage fp8gpu 300 python3 -m pytest -q tests/test_kv_fp8_gpu.py tests/test_sampler_gpu.py ;;
        fp8kern) stage fp8kern 300 python3 -m pytest -q tests/test_kv_fp8_gpu.py -k "kernels_equal or blocks_of_128" ;;
        fp8k128) stage fp8k128 200 python3 -m pytest -q tests/test_kv_fp8_gpu.py -k blocks_of_128 ;;
        vlayout) stage vlayout 120 python3 benchmarks/value_layout_bandwidth.py --tag "${KTAG:-}" ;;
        kvfp8) stage kvfp8 "${KVFP8_LIMIT:-330}" python3 benchmarks/kv_fp8_speed.py ${KVFP8_ARGS---sweep} --tag "${KTAG:-}" ;;
        multiturn8b) stage multiturn8b 240 python3 benchmarks/multiturn_speed.py --shape llama-3.1-8b --prompts 16 \
            --G 8 --turns 4 --tool-tokens 200 --new-tokens 512 --prompt-len 512 ;;
        budget_small) stage budget_small 120 python3 benchmarks/grpo_e2e.py --shape llama-3.1-8b --prompts 1 \
            --completion 1536 --steps 1 --no-cli-smoke --load-in-4bit --gpu-memory-gib 22 --kv-cache-dtype fp8 \
            --auto-layout && stage budget_small_bf16kv 120 python3 benchmarks/grpo_e2e.py --shape llama-3.1-8b \
            --prompts 1 --completion 1536 --steps 1 --no-cli-smoke --load-in-4bit --gpu-memory-gib 22 --auto-layout ;;
        budget20k) stage budget20k 560 python3 benchmarks/grpo_e2e.py --shape llama-3.1-8b --prompts 1 \
            --completion 19968 --steps 1 --no-cli-smoke --load-in-4bit --gpu-memory-gib 22 --kv-cache-dtype fp8 \
            --auto-layout ${B20K_ARGS:-} ;;
        e2e20k4) stage e2e20k4 560 python3 benchmarks/grpo_e2e.py --shape llama-3.1-8b --prompts 1 \
            --completion 19968 --steps 1 --no-cli-smoke --load-in-4bit --kv-cache-dtype fp8 --auto-layout ;;
        e2e20k_cap40) stage e2e20k_cap40 560 python3 benchmarks/grpo_e2e.py --shape llama-3.1-8b --prompts 1 \
            --completion 19968 --steps 1 --no-cli-smoke --gpu-memory-gib 40 --auto-layout ;;
        reusecheck) stage reusecheck 150 python3 benchmarks/reuse_gradient_check.py --tag "${RCTAG:-h200}"
            stage reuse_gpu 120 python3 -m pytest -q tests/test_memory_gpu.py -k reused ;;
        reuse20k) stage reuse20k 420 python3 benchmarks/grpo_memory.py --shape llama-3.1-8b --lengths 20480 \
            --impls longrl,longrl-reuse --mlp-tile 4096 --reps 1 --check-equality --tag reuse_20k ;;
        sdpa20k) stage sdpa20k 300 python3 benchmarks/grpo_memory.py --shape llama-3.1-8b --lengths 20480 \
            --impls longrl,longrl-reuse --mlp-tile 4096 --reps 1 --sdpa cudnn --tag sdpa_cudnn_20k ;;
        fused20k) stage fused20k 400 python3 benchmarks/grpo_memory.py --shape llama-3.1-8b --lengths 20480 \
            --impls "${FIMPLS:-longrl-reuse+fused+flora,longrl-reuse}" --mlp-tile "${FTILES:-0,4096}" --reps 1 \
            --tag "${FTAG:-fused_20k}" ;;
        target20k) stage target20k 280 python3 benchmarks/grpo_memory.py --shape llama-3.1-8b --lengths 20480 \
            --impls longrl-reuse+fused+flora --mlp-tile 4096 --reps 2 --tag target_20k \
            && stage target20k_cudnn 260 python3 benchmarks/grpo_memory.py --shape llama-3.1-8b --lengths 20480 \
            --impls longrl-reuse+fused+flora --mlp-tile 4096 --reps 2 --sdpa cudnn --tag target_cudnn_20k ;;
        mem20k) stage mem20k 560 python3 benchmarks/grpo_memory.py --shape llama-3.1-8b --lengths 20480 \
            --impls longrl --mlp-tile 0,4096 --reps 2 --tag warm_20k ;;
        scale1) stage scale1 480 python3 benchmarks/grpo_scale.py --layouts lora --gpus 1 --with-single \
            --phases train,rollout --prompts-per-gpu 1 --completion 19968 --rollout-prompts 16 \
            --rollout-completion 1024 --reps 1 --timeout 240 --tag "${SCTAG:-_ws1_phases}" ;;
        scale1s) stage scale1s 300 python3 benchmarks/grpo_scale.py --layouts "${SCLAYOUT:-lora}" --gpus "" --with-single \
            --phases train --prompts-per-gpu 1 --completion 19968 --reps "${SCREPS:-2}" --timeout 280 --no-recompute "${SCNR:--1}" \
            --tag "${SCTAG:-_ws1_train}" ;;
        newgpu) stage newgpu 300 python3 -m pytest -q tests/test_shared_prompt_gpu.py tests/test_kl_reference_gpu.py \
            tests/test_fp8_gpu.py tests/test_vision_sampler_gpu.py tests/test_fast_verify.py tests/test_kernels_compile.py \
            tests/test_fp8_matmul.py tests/test_sampler_gpu.py ;;
        specverify) stage specverify "${SPEC_LIMIT:-200}" python3 benchmarks/speculative_rollout.py --parts ii --reps 5 \
            --contexts ${SPEC_CONTEXTS:-1024 16384} --rows ${SPEC_ROWS:-8 16 32} ;;
        attnab) IFS=';' read -ra variants <<< "${ABVARIANTS:-{\};{\"counters\": true\}}"
            stage attnab "${AB_LIMIT:-240}" python3 benchmarks/attention_ab.py --bases "${ABBASES:-bf16,nf4}" \
            --rows "${ABROWS:-8,32}" --context "${ABCTX:-1024}" --reps "${ABREPS:-3}" --variants "${variants[@]}" \
            --tag "${ABTAG:-}" ;;
        sharedwarm) stage sharedwarm 560 python3 benchmarks/shared_prompt_speed.py --repeat 2 --tag _warm \
            --cases "${SHCASES:-16384:1024,4096:1024,512:20480,32768:1024}" ;;
        uniforms) stage uniforms 60 python3 benchmarks/uniform_speed.py --tag "${UTAG:-}" ;;
        stepgraphs) stage stepgraphs 240 python3 benchmarks/call_overhead.py --shape "${SGSHAPE:-smollm2-135m}" \
                --sequences ${OSEQ:-8 32 128} --min-batch 16 --speculative off --step-graphs off on --calls 5 \
                --tag "_stepgraphs${OTAG:-}" ;;
        overhead) stage overhead 200 python3 benchmarks/call_overhead.py --shape smollm2-135m \
                --sequences ${OSEQ:-8 32 128} --min-batch ${OMIN:-1 16} --tag "${OTAG:-}" ;;
        matrix) stage matrix 560 python3 benchmarks/rollout_matrix.py --bases "${MBASES:-bf16,nf4,fp8}" \
                --rows "${MROWS:-8,32,128}" --contexts "${MCONTEXTS:-1024,16384}" --kv "${MKV:-bf16,fp8}" \
                ${MNF4:+--nf4-launch "$MNF4"} --tag "${MTAG:-}" \
                ${MNF4T:+--nf4t-launch "${MNF4T/#auto/benchmarks/results/nf4_matmul_${CARD}_sweep.json}"} \
                ${MMA_FROM:+--mma-launch "${MMA_FROM/#auto/benchmarks/results/nf4_matmul_${CARD}_mma.json}"} \
                ${MATTN:+--attention-launch "$MATTN"} ;;
        visiona|visionb) if [ "$s" = visiona ]; then
                stage visiona 560 python3 benchmarks/vision_grpo.py --budget-gib 15 --load-in-4bit --completion 2048 \
                    --deadline 500
            else
                stage visionb 580 python3 benchmarks/vision_grpo.py --budget-gib 22 --load-in-4bit --probe \
                    --deadline "${VDEADLINE:-500}" ${VSTATE:+--probe-state "$VSTATE"}
            fi ;;
        visionc) stage visionc 560 python3 benchmarks/vision_grpo.py --arms "${VARMS:-longrl,per-completion,trl}" \
                --prompts 4 --completion 2048 --deadline "${VDEADLINE:-500}" ;;
        exactpin) stage exactpin 400 bash -c 'for x in "" --exact-pinned; do python3 benchmarks/shared_prompt_speed.py \
                --repeat 2 --longest-for-gib "" --cases 16384:1024 --tag "_pin${x:+exact}" $x; done; \
                python3 -m pytest -q tests/test_memory_gpu.py -k exact' ;;
        sharedlong) stage sharedlong 400 python3 benchmarks/shared_prompt_speed.py --repeat 2 --tag _long --budget 82432 \
            --longest-for-gib "" --cases 512:20480 ;;
        shared32k) stage shared32k 300 python3 benchmarks/shared_prompt_speed.py --repeat 2 --tag _32k \
            --longest-for-gib "" --cases 32768:1024 ;;
        *) echo "unknown stage $s" ;;
    esac
done
tar -czf "$OUT/results.tar.gz" benchmarks/results "$OUT/logs" 2>/dev/null
ls -la "$OUT"
