#!/usr/bin/env bash
# speedrun.sh: the whole nanomuon pipeline in one command: data, tokenizer, pretraining, evaluation,
# samples, report.
#
#   bash speedrun.sh                # GPU node: nanochat's time-to-GPT-2 recipe on every GPU: d24 on
#                                   #           ClimbMix, 8 tokens per scaling param, 1M-token batches, then
#                                   #           CORE (docs/core.md); the report's line says when (or whether)
#                                   #           CORE passed GPT-2's 0.2565. fp8 matmuls (--fp8) where the GPU
#                                   #           has them (compute capability 8.9+), as nanochat.
#                                   # no GPU:   the same pipeline in miniature on the embedded corpus,
#                                   #           2 processes, a few minutes on 2 cores, no network needed;
#                                   #           CORE (100 items a task) only when an eval bundle is in place
#
# Knobs (environment variables): MODE=gpu|cpu (default: gpu when nvidia-smi sees a GPU), NPROC
# (processes; default: all GPUs, or 2 on CPU), DEPTH (default 24 on GPU, 12 on one GPU, 4 on CPU), RUN (run name),
# DATASET (default climbmix on GPU, embedded on CPU; fineweb-edu is the other hub dataset; embedded on GPU is
# an offline smoke test; any other --dataset value, e.g. a local folder or hf:owner/name, is your own data:
# docs/data.md, "Your own data"), CORE_ITEMS (CPU: CORE items per task, default 100),
# WANDB=off|online|offline, FP8=auto|on|off (GPU: default auto, on where compute capability is 8.9+),
# NANOMUON_BASE_DIR (data, tokenizer and runs; default ~/.cache/nanomuon).
# Extra arguments go to base_train, e.g. `bash speedrun.sh --num-iterations 100`, but for two of
# speedrun's own: --resume continues the run in runs/$RUN from its latest checkpoint (with the same
# knobs and arguments as before), and --start-over moves that run into runs/$RUN/previous.N and
# trains afresh. Without either, a run dir that holds an earlier run is refused before anything starts.
# A tokenizer already in $NANOMUON_BASE_DIR/tokenizer with the vocab size this mode trains is reused
# (delete it to retrain); so a machine without rustbpe can run on a tokenizer trained elsewhere.
set -euo pipefail
cd "$(dirname "$0")"
export NANOMUON_BASE_DIR="${NANOMUON_BASE_DIR:-$HOME/.cache/nanomuon}"
export PYTHONUNBUFFERED=1

if [ -z "${MODE:-}" ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then MODE=gpu; else MODE=cpu; fi
fi
# anything else would silently run the CPU miniature
if [ "$MODE" != gpu ] && [ "$MODE" != cpu ]; then
    echo "error: MODE=$MODE: use MODE=gpu or MODE=cpu (lowercase), or unset MODE to pick by" \
        "nvidia-smi" >&2
    exit 2
fi
case "${FP8:-auto}" in auto|on|off) ;; *)
    echo "error: FP8=$FP8: use FP8=auto (on where the GPU has fp8 tensor cores), on or off" >&2
    exit 2 ;;
esac
# find_spec, not import: importing torch alone takes 2 s, and the steps below import what they need
# anyway. Not matplotlib: plots are optional (the report says it skipped them), so an offline GPU
# image without it runs as is.
if ! python -c "import importlib.util as u, sys
sys.exit(any(u.find_spec(m) is None for m in ('nanomuon', 'torch', 'tiktoken', 'pyarrow')))"; then
    echo "== installing nanomuon and its dependencies"
    pip install -e .
fi
WANDB="${WANDB:-off}"
start=$(date +%s)
RESUME="" ARGS=() GIVEN=""  # GIVEN: whether base_train is told what to do with an earlier run
for arg in "$@"; do
    case "$arg" in
        --resume) RESUME=1 GIVEN=1 ;;
        --start-over|--resume-from-step|--resume-from-step=*) ARGS+=("$arg") GIVEN=1 ;;
        *) ARGS+=("$arg") ;;
    esac
done
if [ -n "$RESUME" ] && [[ " ${ARGS[*]-} " == *" --start-over "* ]]; then
    echo "error: --resume and --start-over: continue the earlier run, or move it aside and" \
        "train afresh; pass one" >&2
    exit 2
fi
set -- ${RESUME:+--resume-from-step latest} ${ARGS[@]+"${ARGS[@]}"}

# base_train refuses a fresh run over an earlier one too, but only once torchrun has started
# (under its traceback, once per process) and in its own flags: say it here first, in speedrun's
check_run_dir() {
    [ -z "$GIVEN" ] || [ -n "$RESUME" ] || return 0
    python - "$NANOMUON_BASE_DIR/runs/$RUN" "$RESUME" <<'EOF'
import sys
from nanomuon.run import earlier_run, held_by, list_steps
try:
    earlier = earlier_run(sys.argv[1])
except ValueError as e:
    sys.exit(f"error: {e}")
if sys.argv[2] and not list_steps(sys.argv[1]):
    sys.exit(f"error: --resume, but {sys.argv[1]} holds no checkpoint to continue: drop --resume "
             "to train afresh" + (", with --start-over (it moves what is there into previous.N)"
                                  if earlier else ""))
if not sys.argv[2] and earlier:
    sys.exit(f"error: {sys.argv[1]} holds an earlier run ({held_by(sys.argv[1], earlier)}): "
             "continue it with `bash speedrun.sh --resume` (the same knobs and arguments as "
             "before), train afresh with `bash speedrun.sh --start-over` (it moves into "
             "previous.N), or pick another RUN")
EOF
}

if [ "$MODE" = gpu ]; then
    NPROC="${NPROC:-$(nvidia-smi -L | wc -l)}"
    if [ "$NPROC" = 1 ]; then
        # One GPU: a d12 (a d24 would take 8x the node's hours); the device batch fits the GPU's free memory
        # (base_train prints its choice) and gradient accumulation keeps the total batch.
        DEPTH="${DEPTH:-12}" EVAL_BATCH=8
    else
        DEPTH="${DEPTH:-24}" EVAL_BATCH=16  # nanochat's d24 eval batch on 80 GB GPUs
    fi
    RUN="${RUN:-d$DEPTH}"
    DATASET="${DATASET:-climbmix}"
    check_run_dir
    # fp8 matmuls (torchao's float8 training, nanochat's --fp8) where the GPU has fp8 tensor cores
    FP8_FLAG=()
    cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 || true)
    if [ "${FP8:-auto}" = off ]; then
        echo "== fp8 off: FP8=off; training in bf16"
    elif [ "${FP8:-auto}" = auto ] && ! awk -v c="$cap" 'BEGIN { exit !(c != "" && c + 0 >= 8.9) }'; then
        echo "== fp8 off: compute capability ${cap:-unknown (no nvidia-smi)} has no fp8 tensor cores" \
            "(8.9+: H100, H200, L4, RTX 40xx); training in bf16"
    elif python -c "import torchao.float8" 2>/dev/null || pip install -q torchao; then
        echo "== fp8 on: compute capability ${cap:-unknown}, torchao's float8 training (nanochat's --fp8)"
        FP8_FLAG=(--fp8)
    else
        echo "== fp8 off: torchao did not install (pip install torchao); training in bf16"
    fi
    echo "== speedrun (gpu): d$DEPTH on $DATASET, $NPROC GPUs, run $RUN, data in $NANOMUON_BASE_DIR"
    if [ "$DATASET" = climbmix ] || [ "$DATASET" = fineweb-edu ]; then
        # The first 8 shards (~2B characters) train the tokenizer; the val shard comes with them. The rest
        # of the ~6B tokens d24 at 8 tokens per scaling param needs (~110 shards; 170 as nanochat, for margin)
        # download while the tokenizer trains.
        python -m nanomuon.dataset -n 8 --dataset "$DATASET"
        python -m nanomuon.dataset -n 170 --dataset "$DATASET" > "$NANOMUON_BASE_DIR/download.log" 2>&1 &
        download=$!
        python -m scripts.tok_train --keep-existing --dataset "$DATASET" --vocab-size 32768 --max-chars 2000000000
        echo "== waiting for the data download (log: $NANOMUON_BASE_DIR/download.log)"
        wait "$download"
    elif [ "$DATASET" = embedded ]; then
        python -m nanomuon.dataset --embedded
        python -m scripts.tok_train --keep-existing --dataset embedded --vocab-size 32768 --max-chars 8000000
    else  # your own data: converted on first use by tok_train, reused by base_train
        python -m scripts.tok_train --keep-existing --dataset "$DATASET" --vocab-size 32768 --max-chars 2000000000
    fi
    # nanochat 92d63d4's model and recipe (--arch nanochat, docs/training.md): 8 tokens per scaling param (block matrices and lm_head, as it counts them); the batch
    # (2^20 tokens at d24, 2^19 at d12), lrs, weight decay and schedule follow from the horizon as in nanochat
    # (base_train prints each choice, docs/lr_rule.md); the device batch is the most rows that fit, gradient
    # accumulation makes up the rest
    torchrun --standalone --nproc_per_node="$NPROC" -m scripts.base_train -- --dataset "$DATASET" \
        --arch nanochat --depth "$DEPTH" --run "$RUN" --device-batch-size auto --target-param-data-ratio 8 \
        --save-every 2000 --wandb "$WANDB" ${FP8_FLAG[@]+"${FP8_FLAG[@]}"} "$@"
    # On the hub datasets CORE is asked for, so its eval bundle downloads once (docs/core.md); other data
    # (embedded: the offline smoke test) gets CORE only when a bundle is already in place
    EVAL_CORE=""
    if [ "$DATASET" = climbmix ] || [ "$DATASET" = fineweb-edu ]; then EVAL_CORE="--eval core,bpb,sample"; fi
    # shellcheck disable=SC2086  # EVAL_CORE is zero or two words
    torchrun --standalone --nproc_per_node="$NPROC" -m scripts.base_eval -- --run "$RUN" \
        --dataset "$DATASET" --device-batch-size "$EVAL_BATCH" --wandb "$WANDB" $EVAL_CORE
    python -m scripts.sample --run "$RUN" --prompt "The capital of France is" --prompt "Once upon a time" \
        --max-tokens 64
else
    NPROC="${NPROC:-2}"
    DEPTH="${DEPTH:-4}"
    RUN="${RUN:-cpu-d$DEPTH}"
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # one thread per process; the processes share the cores
    DATASET="${DATASET:-embedded}"
    check_run_dir
    echo "== speedrun (cpu miniature): d$DEPTH on $DATASET, $NPROC processes, run $RUN"
    if [ "$DATASET" = embedded ]; then python -m nanomuon.dataset --embedded; fi
    python -m scripts.tok_train --keep-existing --dataset "$DATASET" --vocab-size 4096 --max-chars 8000000
    # each group's lr is the lr rule's at 4,096-token steps (nanomuon/recipe.py), where it was tuned
    torchrun --standalone --nproc_per_node="$NPROC" -m scripts.base_train -- --dataset "$DATASET" --device-type cpu \
        --depth "$DEPTH" --run "$RUN" --max-seq-len 256 --device-batch-size 8 --total-batch-size 4096 \
        --num-iterations 200 --eval-every 50 --eval-tokens 65536 --save-every 100 --warmdown-ratio 0.3 \
        --sample-tokens 24 --log-every 10 \
        --wandb "$WANDB" "$@"
    # CORE only with a bundle already in place (docs/core.md), else a one-line note: this stays offline
    torchrun --standalone --nproc_per_node="$NPROC" -m scripts.base_eval -- --run "$RUN" --device-type cpu \
        --dataset "$DATASET" --device-batch-size 8 --eval-tokens 65536 --sample-tokens 24 \
        --max-per-task "${CORE_ITEMS:-100}" --wandb "$WANDB"
    python -m scripts.sample --run "$RUN" --device-type cpu --prompt "def main(" --prompt "import" --max-tokens 32
fi

echo "== speedrun done in $(( ($(date +%s) - start) / 60 )) min $(( ($(date +%s) - start) % 60 )) s"
echo "== report: $NANOMUON_BASE_DIR/runs/$RUN/report.md"
# the headline first: base_eval's time-to-GPT-2 line, when CORE ran
grep -E '^(time to GPT-2|not reached):' "$NANOMUON_BASE_DIR/runs/$RUN/report.md" | tail -n 1 || true
cat "$NANOMUON_BASE_DIR/runs/$RUN/report.md"
