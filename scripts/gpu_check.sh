#!/usr/bin/env bash
# gpu_check.sh: validate nanomuon on one GPU in one call, offline, in at most 9 minutes, and write one
# summary file. GPUs are lent rarely and briefly, so everything a GPU must show runs from one command:
#
#   bash scripts/gpu_check.sh --prepare   # on a CPU machine with rustbpe: the tokenizer (vocab 32768) and the
#                                         # embedded corpus, into .gpu_check/ (carry that folder to the GPU)
#   bash scripts/gpu_check.sh             # on the GPU machine: needs only torch >= 2.9, tiktoken, pyarrow
#   bash scripts/gpu_check.sh --dry-run   # anywhere: lists the steps, checks imports and flags, exits 0
#
# Steps (each under its own time limit; a step that fails or times out is reported, the rest still run):
#   1. the CUDA tests: compiled vs eager on CUDA, the bf16 paths, recompile limits (pytest -m cuda)
#   2. bench_optim at d12 and d20, compiled, MuonAdamW vs torch.optim.Muon + AdamW (defaults on both sides, and
#      the same update on both), Newton-Schulz in bf16 and fp16 (standard vs Gram)
#   3. base_train at d12 and d20 on one GPU, compiled: tok/s, MFU, the optimizer's share of a step
#   4. speedrun.sh in GPU mode on the embedded corpus (DATASET=embedded NPROC=1), short
# The summary ($OUT/gpu_check.md when $OUT is set, else .gpu_check/gpu_check.md) holds the device, the
# date, each command with its status and seconds, and the lines that carry numbers; the full logs lie
# beside it. Copy it into docs/benchmarks.md.
set -uo pipefail
cd "$(dirname "$0")/.."
KIT="$PWD/.gpu_check"
OUTDIR="${OUT:-$KIT}"
export NANOMUON_BASE_DIR="$KIT/base"
export PYTHONUNBUFFERED=1
MODE=run
case "${1:-}" in
    --prepare) MODE=prepare ;;
    --dry-run) MODE=dry ;;
    "") ;;
    *) echo "usage: bash scripts/gpu_check.sh [--prepare | --dry-run]" >&2; exit 2 ;;
esac

if [ "$MODE" = prepare ]; then
    set -e
    python -m nanomuon.dataset --embedded
    # the vocab of speedrun's GPU mode, so its step reuses this tokenizer
    python -m scripts.tok_train --keep-existing --dataset embedded --vocab-size 32768 --max-chars 8000000
    du -sh "$KIT"
    echo "ready: carry .gpu_check (git ignores it: add '/.gpu_check/' to .git/info/exclude if it does not)"
    exit 0
fi

# name | seconds | command. Budget: 540 s in all, including torch.compile warm-up in every step.
TRAIN="--dataset embedded --device-type cuda --eval-every -1 --eval-tokens 262144 --sample-tokens 16 \
--save-every -1 --log-every 5 --max-seq-len 2048 --device-batch-size 32 --total-batch-size 524288"
STEPS=(
    "tests|80|python -m pytest -q --slow -m cuda tests"
    "bench_optim d12|80|python -m scripts.bench_optim --depth 12 --compile --steps 5 --compare defaults same-math \
--ns-precision bf16 fp16"
    "bench_optim d20|70|python -m scripts.bench_optim --depth 20 --compile --steps 5 --compare defaults \
--ns-precision fp16"
    "base_train d12|100|python -m scripts.base_train --depth 12 --num-iterations 20 --run gpu-check-d12 $TRAIN"
    "base_train d20|130|python -m scripts.base_train --depth 20 --num-iterations 10 --run gpu-check-d20 $TRAIN"
    "speedrun|80|MODE=gpu DATASET=embedded NPROC=1 DEPTH=4 RUN=gpu-check-speedrun bash speedrun.sh --num-iterations 20 \
--total-batch-size 65536 --device-batch-size 32 --max-seq-len 1024 --eval-tokens 65536"
)

if [ "$MODE" = dry ]; then
    echo "gpu_check --dry-run: steps and time limits (540 s budget)"
    for s in "${STEPS[@]}"; do
        IFS='|' read -r name secs cmd <<<"$s"; printf '  %-16s %4ss  %s\n' "$name" "$secs" "$cmd"
    done
    python - <<'EOF' || exit 1
import importlib
for m in ("torch", "tiktoken", "pyarrow", "nanomuon.optim", "nanomuon.gpt", "nanomuon.dataloader",
          "scripts.bench_optim", "scripts.base_train", "scripts.base_eval", "scripts.sample"):
    importlib.import_module(m)
print("imports: ok")
EOF
    # every base_train command line parses (argparse errors exit 2 and name the flag)
    python - "$TRAIN" <<'EOF' || exit 1
import shlex, sys
from scripts.base_train import parse_args
for depth, n in ((12, 20), (20, 10)):
    parse_args(["--depth", str(depth), "--num-iterations", str(n), *shlex.split(sys.argv[1])])
print("base_train flags: ok")
EOF
    python -m pytest -q --collect-only -m cuda tests >/dev/null && echo "cuda tests: collected"
    exit 0
fi

if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "error: torch sees no CUDA device here; gpu_check runs on a GPU machine (use --dry-run to check this one)" >&2
    exit 1
fi
mkdir -p "$OUTDIR"
SUMMARY="$OUTDIR/gpu_check.md"
if [ ! -f "$NANOMUON_BASE_DIR/tokenizer/tokenizer.json" ] || [ ! -d "$NANOMUON_BASE_DIR/data/embedded" ]; then
    echo "error: $KIT has no tokenizer or embedded corpus: run 'bash scripts/gpu_check.sh --prepare' on a CPU machine" \
         "with rustbpe and carry .gpu_check to the GPU" >&2
    exit 1
fi
{
    echo "# gpu_check $(date -u +%Y-%m-%d\ %H:%M) UTC"
    echo
    echo "- device: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
        2>/dev/null || echo none)"
    echo "- torch $(python -c \
        'import torch; print(torch.__version__, "cuda", torch.version.cuda)'), python $(python -V 2>&1)"
    echo "- commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), command: bash scripts/gpu_check.sh"
    echo
} >"$SUMMARY"
total_start=$(date +%s)
for s in "${STEPS[@]}"; do
    IFS='|' read -r name secs cmd <<<"$s"
    log="$OUTDIR/$(echo "$name" | tr ' ' '_').log"
    echo "== $name (limit ${secs}s): $cmd"
    start=$(date +%s)
    timeout --kill-after=10 "$secs" bash -c "$cmd" >"$log" 2>&1
    rc=$?
    took=$(( $(date +%s) - start ))
    status=ok; [ $rc -ne 0 ] && status="FAILED (exit $rc)"; [ $rc -eq 124 ] && status="TIMED OUT"
    echo "   $status in ${took}s (log: $log)"
    {
        echo "## $name: $status, ${took} s"
        echo
        echo '```'
        echo "$cmd"
        if [ $rc -eq 0 ]; then  # the lines that carry numbers: bench summaries, throughput, optimizer share, bpb
            grep -E -e "^(step d|NS d|Gram FLOPs|imbalance|matmul)|throughput:|optimizer step:" \
                -e "final val bpb|passed|skipped|speedrun done" "$log" | tail -n 12
        else
            tail -n 8 "$log"
        fi
        echo '```'
        echo
    } >>"$SUMMARY"
done
echo "- total: $(( $(date +%s) - total_start )) s" >>"$SUMMARY"
echo "summary: $SUMMARY"
cat "$SUMMARY"
