#!/usr/bin/env bash
# gpu_check.sh: validate nanomuon on one GPU, offline, and write one summary file. GPUs are lent
# rarely and briefly, so everything a GPU must show runs from one command, or in pieces of at most
# 9 minutes each (the dry run lists them):
#
#   bash scripts/gpu_check.sh --prepare   # on a CPU machine with rustbpe: the tokenizer (vocab
#                                         # 32768) and the embedded corpus, into .gpu_check/
#                                         # (carry that folder to the GPU)
#   bash scripts/gpu_check.sh             # on the GPU: torch >= 2.9, tiktoken, pyarrow, pytest
#   bash scripts/gpu_check.sh --only tests,bench_optim  # some steps: names, or prefixes before _
#   bash scripts/gpu_check.sh --dry-run   # anywhere: lists steps and pieces, checks imports, flags
#
# Steps, each under a time limit sized for a cold compile cache; a step that fails or times out is
# reported and the rest still run; a timeout reads "timed out after N s", a failure
# "FAILED (exit N)":
#   tests            the CUDA tests: compiled vs eager on CUDA, the bf16 paths, recompile limits
#   bench_optim_d12  bench_optim at d12 and d20, compiled, MuonAdamW vs torch.optim.Muon + AdamW
#   bench_optim_d20  (defaults on both sides, and the same update on both), Newton-Schulz in bf16
#                    and fp16 (standard vs Gram)
#   base_train_d12   base_train at d12 and d20 on one GPU, compiled: tok/s, MFU, the optimizer's
#   base_train_d20   share of a step
#   speedrun         speedrun.sh in GPU mode on the embedded corpus (DATASET=embedded NPROC=1)
# The summary ($OUT/gpu_check.md when $OUT is set, else .gpu_check/gpu_check.md; with --only,
# gpu_check-<steps>.md) holds the device, the date, each command with its status and seconds, and
# the lines that carry numbers; the full logs lie beside it. Copy it into docs/benchmarks.md.
set -uo pipefail
cd "$(dirname "$0")/.."
KIT="$PWD/.gpu_check"
OUTDIR="${OUT:-$KIT}"
export NANOMUON_BASE_DIR="$KIT/base"
export PYTHONUNBUFFERED=1
PIECE=540  # seconds one piece may take: a 10-minute allocation less the start and the summary
MODE=run
ONLY=""
ARGS="$*"
usage() {
    echo "usage: bash scripts/gpu_check.sh [--prepare | --dry-run] [--only STEP[,STEP]]" >&2
    exit 2
}
while [ $# -gt 0 ]; do
    case "$1" in
        --prepare) MODE=prepare ;;
        --dry-run) MODE=dry ;;
        --only) [ $# -ge 2 ] || usage; ONLY="$2"; shift ;;
        --only=*) ONLY="${1#--only=}" ;;
        -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) usage ;;
    esac
    shift
done

if [ "$MODE" = prepare ]; then
    set -e
    python -m nanomuon.dataset --embedded
    # the vocab of speedrun's GPU mode, so its step reuses this tokenizer
    python -m scripts.tok_train --keep-existing --dataset embedded --vocab-size 32768 \
        --max-chars 8000000
    du -sh "$KIT"
    echo "ready: carry .gpu_check (git ignores it: add '/.gpu_check/' to .git/info/exclude if" \
         "it does not)"
    exit 0
fi

# Every package a step imports, named before anything starts (plots are optional: no matplotlib).
if ! python - <<'EOF'
import importlib.util as u, sys
need = ("torch", "tiktoken", "pyarrow", "pytest")
missing = [m for m in need if u.find_spec(m) is None]
if missing:
    print(f"error: gpu_check needs the Python packages {', '.join(need)}; missing here: "
          f"{', '.join(missing)} (pip install {' '.join(missing)})", file=sys.stderr)
sys.exit(bool(missing))
EOF
then exit 1; fi

# name | seconds | command. Each limit: the work, plus a cold torch.compile cache (inductor's first
# compile of a graph: 30-120 s, longer with depth), plus ~30%.
TRAIN="--dataset embedded --device-type cuda --eval-every -1 --eval-tokens 262144 \
--sample-tokens 16 --save-every -1 --log-every 5 --max-seq-len 2048 --device-batch-size 32 \
--total-batch-size 524288"
STEPS=(
    # ~10 tests, 5 compiles: 3 small, then d12's and d20's model and optimizer for the memory tests
    "tests|300|python -m pytest -q --slow -m cuda tests"
    # 2 sides x 2 Newton-Schulz precisions compiled at d12, 5 timed steps each
    "bench_optim_d12|180|python -m scripts.bench_optim --depth 12 --compile --steps 5 \
--compare defaults same-math --ns-precision bf16 fp16"
    # 1 side, 1 precision at d20: fewer compiles, of bigger graphs
    "bench_optim_d20|150|python -m scripts.bench_optim --depth 20 --compile --steps 5 \
--compare defaults --ns-precision fp16"
    # model and optimizer compiles, 20 steps of 0.5M tokens, eval's second compile, a ~1.5 GB
    # final checkpoint
    "base_train_d12|240|python -m scripts.base_train --depth 12 --num-iterations 20 \
--run gpu-check-d12 $TRAIN"
    # the same at d20: longer compiles, ~4 s steps, a ~4 GB final checkpoint
    "base_train_d20|360|python -m scripts.base_train --depth 20 --num-iterations 10 \
--run gpu-check-d20 $TRAIN"
    # d4 through torchrun: train (two compiles), base_eval, sample; the tokenizer is reused
    "speedrun|200|MODE=gpu DATASET=embedded NPROC=1 DEPTH=4 RUN=gpu-check-speedrun \
bash speedrun.sh --num-iterations 20 --total-batch-size 65536 --device-batch-size 32 \
--max-seq-len 1024 --eval-tokens 65536"
)

# --only: the steps named, exactly or by a prefix before _ (bench_optim: both), in the kit's order
if [ -n "$ONLY" ]; then
    IFS=',' read -r -a wanted <<<"$ONLY"
    for w in "${wanted[@]}"; do
        if ! printf '%s\n' "${STEPS[@]}" | cut -d'|' -f1 | grep -qx -e "$w" -e "${w}_.*"; then
            echo "error: --only names no step '$w'; the steps:" \
                 "$(printf '%s\n' "${STEPS[@]}" | cut -d'|' -f1 | paste -sd' ' -)" >&2
            exit 2
        fi
    done
    kept=()
    for s in "${STEPS[@]}"; do
        for w in "${wanted[@]}"; do
            if [ "${s%%|*}" = "$w" ] || [[ "${s%%|*}" == "${w}_"* ]]; then kept+=("$s"); break; fi
        done
    done
    STEPS=("${kept[@]}")
fi

# run_step LIMIT COMMAND LOG NAME: the command under its limit; sets rc, took and status
run_step() {
    local start
    start=$(date +%s)
    timeout --kill-after=10 "$1" bash -c "$2" >"$3" 2>&1
    rc=$?
    took=$(( $(date +%s) - start ))
    status=ok
    # 124: timeout's TERM; 137: its KILL 10 s on (a KILL before the limit is something else: OOM)
    if [ $rc -eq 124 ] || { [ $rc -eq 137 ] && [ "$took" -ge "$1" ]; }; then
        status="timed out after $1 s (its limit: not a failure; rerun it alone: --only $4)"
    elif [ $rc -ne 0 ]; then
        status="FAILED (exit $rc)"
    fi
}

if [ "$MODE" = dry ]; then
    all=0
    for s in "${STEPS[@]}"; do IFS='|' read -r name secs cmd <<<"$s"; all=$((all + secs)); done
    echo "gpu_check --dry-run: steps and time limits ($all s in all; one call may take $PIECE s)"
    for s in "${STEPS[@]}"; do
        IFS='|' read -r name secs cmd <<<"$s"; printf '  %-16s %4ss  %s\n' "$name" "$secs" "$cmd"
    done
    # the steps in order, cut into calls of at most $PIECE s
    echo "in pieces of at most $PIECE s:"
    piece=""; sum=0
    for s in "${STEPS[@]}" "end|$((PIECE + 1))|"; do
        IFS='|' read -r name secs cmd <<<"$s"
        if [ -n "$piece" ] && [ $((sum + secs)) -gt "$PIECE" ]; then
            printf '  %4ss  bash scripts/gpu_check.sh --only %s\n' "$sum" "$piece"
            piece=""; sum=0
        fi
        piece="${piece:+$piece,}$name"; sum=$((sum + secs))
    done
    # how a step's end reads: a 1 s limit on a sleep, and a command that exits 3
    probe=$(mktemp -d)
    run_step 1 "sleep 5" "$probe/log" probe; echo "a step past its limit: $status"
    run_step 5 "exit 3" "$probe/log" probe; echo "a failing step: $status"
    rm -rf "$probe"
    python - <<'EOF' || exit 1
import importlib
for m in ("torch", "tiktoken", "pyarrow", "nanomuon.optim", "nanomuon.gpt",
          "nanomuon.dataloader", "scripts.bench_optim", "scripts.base_train", "scripts.base_eval",
          "scripts.sample"):
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
    echo "error: torch sees no CUDA device here; gpu_check runs on a GPU machine (use --dry-run" \
         "to check this one)" >&2
    exit 1
fi
mkdir -p "$OUTDIR"
# a piece (--only) writes its own summary, so the pieces of one kit do not overwrite each other
SUMMARY="$OUTDIR/gpu_check${ONLY:+-${ONLY//,/-}}.md"
if [ ! -f "$NANOMUON_BASE_DIR/tokenizer/tokenizer.json" ] \
        || [ ! -d "$NANOMUON_BASE_DIR/data/embedded" ]; then
    echo "error: $KIT has no tokenizer or embedded corpus: run 'bash scripts/gpu_check.sh" \
         "--prepare' on a CPU machine with rustbpe and carry .gpu_check to the GPU" >&2
    exit 1
fi
{
    echo "# gpu_check $(date -u +%Y-%m-%d\ %H:%M) UTC"
    echo
    echo "- device: $(nvidia-smi --query-gpu=name,memory.total,driver_version \
        --format=csv,noheader 2>/dev/null || echo none)"
    versions=$(python -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)')
    echo "- torch $versions, python $(python -V 2>&1)"
    echo "- commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), command:" \
         "bash scripts/gpu_check.sh${ARGS:+ $ARGS}"
    echo
} >"$SUMMARY"
total_start=$(date +%s)
for s in "${STEPS[@]}"; do
    IFS='|' read -r name secs cmd <<<"$s"
    log="$OUTDIR/$name.log"
    echo "== $name (limit ${secs}s): $cmd"
    run_step "$secs" "$cmd" "$log" "$name"
    echo "   $status, ${took} s (log: $log)"
    {
        echo "## $name: $status, ${took} s"
        echo
        echo '```'
        echo "$cmd"
        # the lines that carry numbers: bench summaries, throughput, optimizer share, bpb
        if [ $rc -eq 0 ]; then
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
