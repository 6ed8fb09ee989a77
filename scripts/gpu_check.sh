#!/usr/bin/env bash
# gpu_check.sh: validate nanomuon on one GPU, offline, and write one summary file. GPUs are lent
# rarely and briefly (15 minutes of device time, 10 minutes a command), so everything a GPU must
# show runs from one command, or in pieces that each fit one command (--plan lists them):
#
#   bash scripts/gpu_check.sh --prepare   # on a CPU machine with rustbpe: the tokenizer (vocab
#                                         # 32768) and the embedded corpus, into .gpu_check/
#                                         # (carry that folder to the GPU)
#   NANOCHAT=~/nanochat bash scripts/gpu_check.sh --prepare  # the same, and a copy of that
#                                         # nanochat checkout's package and its commit, for h2h
#   bash scripts/gpu_check.sh --plan      # anywhere: the pieces for the device budget, most
#                                         # valuable first (--budget-min M, default 15)
#   bash scripts/gpu_check.sh             # on the GPU: torch >= 2.9, tiktoken, pyarrow, pytest
#   bash scripts/gpu_check.sh --only tests,bench_optim  # some steps: names, or prefixes before _
#   bash scripts/gpu_check.sh --dry-run   # anywhere: the plan, then checks imports and flags
#
# Steps, most valuable first, each under a time limit: about 1.5x what it takes on an H200 with a
# cold compile cache, 540 s at most. The plan counts each step's seconds as device time: "seen",
# what it took there (2026-11-26 and -28, docs/benchmarks.md); "est.", an estimate from those runs
# for a step never yet run on the speedrun's model (nanochat 92d63d4's arch, windows and all). A
# step that fails or times out is reported and the rest still run; a timeout reads "timed out
# after N s", a failure "FAILED (exit N): " and the line that says why (an out-of-memory, a kernel
# or compile error). A step's line also names the attention it ran (FA3 where it loads, else flex
# or SDPA):
#   h2h_d24_fp8      scripts.bench_nanochat: nanomuon and nanochat in one harness at the speedrun's
#                    d24 (2^18 tokens a step, nanochat's model on both sides, the same batch,
#                    sequence, vocab, compile, random tokens made on the device, each side's best
#                    attention for its windows), in fp8 as nanochat's 1.65-hour run (each project's
#                    own): tok/s, MFU, the optimizer's ms, peak memory and attention side by side,
#                    nanochat's commit, and the time to GPT-2 on 8xH100 that the ratio implies
#   h2h_d24_bf16     the same in bf16
#   ablate           scripts.ablate's default on the GPU: muon vs adamw, 64 seeds of 200 steps,
#                    each variant's seeds batched in one process; its verdict, detectable effect
#                    and wall time
#   tests            the CUDA tests: compiled vs eager on CUDA, the bf16 paths, recompile limits,
#                    the memory estimate of both archs
#   base_train_d12   base_train at d12 on one GPU, compiled: tok/s, MFU, the optimizer's share
#   fp8_d12          base_train_d12 with --fp8 (fp8 matmuls, as nanochat's speedrun)
#   h2h_d12          h2h_d24_* at d12 (2^19 tokens a step), bf16 then fp8
#   bench_optim_d12  bench_optim at d12 and d20, compiled, MuonAdamW vs torch.optim.Muon + AdamW
#   bench_optim_d20  (defaults on both sides, and the same update on both), Newton-Schulz in bf16
#                    and fp16 (standard vs Gram)
#   base_train_d20   the same as base_train_d12 at d20
#   speedrun         speedrun.sh in GPU mode on the embedded corpus (DATASET=embedded NPROC=1)
#   regime_*         the published-regime table: scripts.ablate --preset regime --published, 64
#                    seeds batched, each technique swept over lr-multiplier 0.5,1,2 and judged at
#                    its best against muon, with whether it agrees with track 3's published sign.
#                    One step a technique (regime_adamw first, with muon: the baseline), each
#                    reading the runs the others cached; regime_table writes the whole table
#                    from them (ablation.md), the same command as on a CPU. It needs
#                    more than one 15-minute budget (--plan --only regime says how much): each
#                    step returns the run cache in $OUT/regime-cache, and a later machine of the
#                    same GPU and code reads it back from .gpu_check/regime-cache
# Every call appends to one summary, .gpu_check.md (kept on the machine between calls while it
# stays warm), and copies the whole of it to $OUT/gpu_check.md when $OUT is set: the device, the
# date, each command with its status and seconds, the lines that carry numbers and, once
# h2h_d24_fp8 ran, the time to GPT-2 it implies (printed at the end too); the full logs lie in
# .gpu_check/logs. Copy it into docs/benchmarks.md with the device and date.
#
# nanochat's code is never part of nanomuon: the h2h steps import the copy --prepare made of the
# checkout NANOCHAT names (its nanochat/*.py and LICENSE, about 200 KB; its commit in
# .gpu_check/nanochat/COMMIT). PyPI's `nanochat` holds only its tokenizer (rustbpe), no model, so
# it cannot stand in. Without NANOCHAT the h2h steps fail in one line and the rest run.
set -uo pipefail
cd "$(dirname "$0")/.."
KIT="$PWD/.gpu_check"
OUTDIR="${OUT:-$KIT/logs}"  # the steps' full logs
export NANOMUON_BASE_DIR="$KIT/base"
export PYTHONUNBUFFERED=1
PIECE=540  # seconds one piece may take: a 10-minute allocation less the start and the summary
START=60   # seconds a lent machine took to start (30 s on 2026-11-26), counted against the budget
BUDGET_MIN=15
# the torchao release --prepare fetches for nanomuon's fp8 steps: 0.17 is the one for torch 2.11,
# which the lent H100/H200 image holds; name another for another torch (TORCHAO=torchao==X.Y.Z)
TORCHAO="${TORCHAO:-torchao==0.17.0}"
MODE=run
ONLY=""
ARGS="$*"
usage() {
    echo "usage: bash scripts/gpu_check.sh [--prepare | --plan [--budget-min M] | --dry-run]" \
         "[--only STEP[,STEP]]" >&2
    exit 2
}
# refuse: one line on stderr, exit 2, before anything runs
refuse() { echo "error: $*" >&2; exit 2; }
# set_mode MODE: one of --prepare, --plan, --dry-run, once
set_mode() {
    [ "$MODE" = run ] || [ "$MODE" = "$1" ] || refuse "--prepare, --plan and --dry-run go alone"
    MODE="$1"
}
while [ $# -gt 0 ]; do
    case "$1" in
        --prepare) set_mode prepare ;;
        --plan) set_mode plan ;;
        --dry-run) set_mode dry ;;
        --budget-min) [ $# -ge 2 ] || usage; BUDGET_MIN="$2"; shift ;;
        --only) [ $# -ge 2 ] || usage; ONLY="$2"; shift ;;
        --only=*) ONLY="${1#--only=}" ;;
        -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) usage ;;
    esac
    shift
done
# numbers as numbers, before any arithmetic reads them (bash arithmetic would run a subscript)
if ! [[ "$BUDGET_MIN" =~ ^[0-9]{1,4}$ ]] || [ $((10#$BUDGET_MIN)) -lt 1 ]; then
    refuse "--budget-min takes whole minutes, 1 to 9999; got '$(printf %q "$BUDGET_MIN")'"
fi
BUDGET_MIN=$((10#$BUDGET_MIN))
# step names as names: letters, digits and _, comma-separated (matched exactly or by prefix later)
if [ -n "$ONLY" ] && ! [[ "$ONLY" =~ ^[a-z0-9_]+(,[a-z0-9_]+)*$ ]]; then
    refuse "--only takes step names separated by commas (a-z, 0-9, _); got" \
           "'$(printf %q "$ONLY")'"
fi

# `python` is the interpreter that holds torch; an image with torch in a venv's python3 alone (no
# `python` on the PATH) gets a shim: a script, since a link would lose the venv
if ! python -c 'import torch' 2>/dev/null && python3 -c 'import torch' 2>/dev/null; then
    mkdir -p "$KIT/bin" && printf '#!/bin/sh\nexec python3 "$@"\n' >"$KIT/bin/python"
    chmod +x "$KIT/bin/python" && export PATH="$KIT/bin:$PATH"
fi
# torchao goes into a folder of the kit's: the image's site-packages may not take installs
export PYTHONPATH="$KIT/site${PYTHONPATH:+:$PYTHONPATH}"

# safe_git DIR ARGS: git on another's checkout that runs nothing of it: no fsmonitor, no hooks
safe_git() {
    local dir="$1"; shift
    git -c core.fsmonitor=false -c core.hooksPath=/dev/null --no-optional-locks -C "$dir" "$@"
}

# checkout_commit SRC: its HEAD, +changes where its nanochat/*.py differ from HEAD's; compared by
# blob hashes (hash-object --no-filters), not git diff, whose filters and drivers the checkout sets
checkout_commit() {
    local src="$1" head f changed=""
    head="$(safe_git "$src" rev-parse --verify -q HEAD)" || return 1
    while IFS= read -r f; do
        # a tracked file that is no regular file now (gone, a link, a FIFO a read would hang on):
        # changed, unread; untracked ones count only when regular, the files the kit copies
        if [ ! -f "$src/$f" ] || [ -L "$src/$f" ] \
            || [ "$(safe_git "$src" rev-parse -q --verify "HEAD:$f" 2>/dev/null)" \
                 != "$(safe_git "$src" hash-object --no-filters -- "$f" 2>/dev/null)" ]; then
            changed=1
        fi
    done < <(safe_git "$src" ls-tree --name-only HEAD -- nanochat/ | grep '\.py$'; \
             cd "$src" && find nanochat -maxdepth 1 -name '*.py' -type f)
    echo "$head${changed:++changes}"
}

# clean_commit: a commit read from a file, as letters, digits and ._+- only, 64 at most
clean_commit() { LC_ALL=C tr -cd 'A-Za-z0-9._+-' | head -c 64; }

# prepare_nanochat: $NANOCHAT's package and license into the kit, with its commit (git's, when it
# is a checkout's top, else its COMMIT file's, else unknown: a downloaded zip); without NANOCHAT an
# earlier copy stays. It copies regular files only, and replaces the earlier copy only once the new
# one is whole.
prepare_nanochat() {
    local src="${NANOCHAT:-}" top commit new="$KIT/nanochat.new" f
    if [ -z "$src" ]; then
        if [ -f "$KIT/nanochat/nanochat/gpt.py" ]; then
            echo "nanochat: keeping the copy of $(clean_commit <"$KIT/nanochat/COMMIT") (NANOCHAT=path" \
                 "replaces it)"
        else
            echo "note: no NANOCHAT=path: the h2h steps will fail (PyPI's nanochat is only its" \
                 "tokenizer); NANOCHAT=path/to/nanochat bash scripts/gpu_check.sh --prepare"
        fi
        return 0
    fi
    src="$(cd "$src" && pwd -P)"
    top="$(safe_git "$src" rev-parse --show-toplevel 2>/dev/null || true)"
    if [ -n "$top" ] && [ "$(cd "$top" && pwd -P)" = "$src" ]; then
        commit="$(checkout_commit "$src" || echo unknown)"
    elif [ -f "$src/COMMIT" ]; then
        commit="$(head -c 256 "$src/COMMIT" 2>/dev/null | clean_commit || true)"
    fi
    rm -rf "$new"
    mkdir -p "$new/nanochat"
    # regular files only: a FIFO would hang cp, a link could lead out of the checkout
    while IFS= read -r -d '' f; do
        cp -- "$f" "$new/nanochat/" || { rm -rf "$new"; return 1; }
    done < <(find "$src/nanochat" -maxdepth 1 -name '*.py' -type f -print0)
    if [ ! -f "$new/nanochat/gpt.py" ]; then
        rm -rf "$new"
        echo "error: no regular nanochat/gpt.py copied from $(printf %q "$src")" >&2
        return 1
    fi
    if [ -f "$src/LICENSE" ] && [ ! -L "$src/LICENSE" ]; then cp -- "$src/LICENSE" "$new/"; fi
    echo "${commit:-unknown}" >"$new/COMMIT"
    rm -rf "$KIT/nanochat" && mv "$new" "$KIT/nanochat"
    echo "nanochat: ${commit:-unknown commit (no COMMIT file, not a git checkout)} from" \
         "$(printf %q "$src"), $(du -sk "$KIT/nanochat" | cut -f1) KB"
}

if [ "$MODE" = prepare ]; then
    # a NANOCHAT that names no checkout: said before any work
    if [ -n "${NANOCHAT:-}" ] && { [ ! -f "$NANOCHAT/nanochat/gpt.py" ] \
            || [ -L "$NANOCHAT/nanochat/gpt.py" ]; }; then
        refuse "NANOCHAT=$(printf %q "$NANOCHAT") holds no nanochat/gpt.py: name a nanochat" \
               "checkout"
    fi
    set -e
    mkdir -p "$KIT"  # a first --prepare: the kit's folder, before anything writes into it
    python -m nanomuon.dataset --embedded
    # the vocab of speedrun's GPU mode, so its step reuses this tokenizer
    python -m scripts.tok_train --keep-existing --dataset embedded --vocab-size 32768 \
        --max-chars 8000000
    # ablate's default shape has a 4,096-token vocab: a base dir of its own; its corpus is rebuilt
    # on the GPU (the carry holds 64 MiB)
    NANOMUON_BASE_DIR="$KIT/ablate" python -m scripts.tok_train --keep-existing --dataset \
        embedded --vocab-size 4096 --max-chars 8000000
    rm -rf "$KIT/ablate/data"
    # the regime preset's 320-token vocab, in the base dir ablate gives the preset
    NANOMUON_BASE_DIR="$KIT/ablate/presets/regime" python -m scripts.tok_train --keep-existing \
        --dataset embedded --vocab-size 320 --max-chars 8000000
    rm -rf "$KIT/ablate/presets/regime/data"
    # torchao for the fp8 steps, in case the GPU machine has no network (3 MB)
    rm -f "$KIT"/wheels/torchao-*.whl
    python -m pip download -q --no-deps -d "$KIT/wheels" "$TORCHAO" \
        || echo "warning: no $TORCHAO wheel: nanomuon's fp8 steps need torchao on the GPU machine"
    prepare_nanochat
    # the summary names the code that was carried (the GPU machine may see another .git)
    echo "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD \
        2>/dev/null || echo '+changes')" >"$KIT/commit"
    du -sh "$KIT"
    echo "ready: carry .gpu_check (git ignores it)"
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

# name | limit | seconds | seen or est. | command. seen: the longest the step took on an H200 with
# a cold compile cache (inductor's first compile of each graph; 2026-11-26 and 2026-11-28); est.:
# an estimate from those runs, for a step never yet run on the speedrun's model. The limit is about
# 1.5x, and more where an H100's slower memory or a deeper graph may add to it, 540 s at most.
TRAIN="--dataset embedded --device-type cuda --eval-every -1 --eval-tokens 262144 \
--sample-tokens 16 --save-every -1 --log-every 5 --max-seq-len 2048 --device-batch-size 32 \
--total-batch-size 524288"
# torchao for nanomuon's fp8: installed from the prepared wheel where the image lacks it
TORCHAO_READY="{ python -c 'import torchao.float8' 2>/dev/null \
|| python -m pip install -q --no-deps --target $KIT/site $KIT/wheels/torchao-*.whl; }"
# the head-to-head harness on the kit's nanochat: 5 timed steps after 2 that compile, both sides
# nanochat's model with its SSSL windows, each in its best attention; at d24, 16 rows of 2,048
# tokens a micro-batch, as each GPU of nanochat's speedrun
H2H="python -m scripts.bench_nanochat --nanochat $KIT/nanochat --max-seq-len 2048 --steps 5 \
--warmup 2 --attention auto"
H2H_D24="$H2H --depth 24 --device-batch-size 16 --total-batch-size 262144"
# The published-regime table: one ablate a technique against muon, each in the preset's own base
# dir and cache; the cache comes in from a carried .gpu_check/regime-cache (the runs of an earlier
# machine of the same GPU and code: the keys hold both) and goes back out in $OUTDIR/regime-cache
REGIME_BASE="$KIT/ablate/presets/regime"
REGIME_IN="NANOMUON_BASE_DIR=$REGIME_BASE python -m nanomuon.dataset --embedded \
&& mkdir -p $REGIME_BASE/ablations/cache && { [ ! -d $KIT/regime-cache ] \
|| cp -n $KIT/regime-cache/*.json $REGIME_BASE/ablations/cache/ 2>/dev/null || true; }"
REGIME="NANOMUON_BASE_DIR=$KIT/ablate python -m scripts.ablate --preset regime --device-type cuda \
--seeds 64"
REGIME_OUT="mkdir -p $OUTDIR/regime-cache && cp $REGIME_BASE/ablations/cache/*.json \
$OUTDIR/regime-cache/"
TECHNIQUES="adamw muon-soap muon-uw-floor muon-hyperball muon-powercool muon-contra muon-muown \
muon-newton"
STEPS=(  # most valuable first: the speedrun's model against nanochat, then what else only a GPU
         # can show, then speed, then the rest
    # 2 fp8 builds of d24, each compiled, and 7 steps of 2^18 tokens (~2.5 s) a side. At d12 (h2h,
    # 2026-11-28) nanochat's fp8 took 106 s to build, compile and warm up, nanomuon's 85 s; a
    # d24 graph compiles in about 1.8x (base_train's d20 took 1.5x d12's); nanochat's fp8 alone at
    # d24 took over 150 s outside the kit; nanomuon's windows add flex_attention's compile
    "h2h_d24_fp8|540|400|est.|$TORCHAO_READY; $H2H_D24 --precision fp8"
    # the same in bf16: nanochat's bf16 build took 74 s at d12, nanomuon's 16 s with a warm cache
    # (~60 s cold); steps ~3 s
    "h2h_d24_bf16|480|320|est.|$H2H_D24 --precision bf16"
    # two compiles of a 64-seed d4, 2 x 200 steps of 262,144 tokens, the evals; on 2026-11-28 it
    # failed at its first training step after 109 s (cuDNN's attention under batched seeds);
    # --baseline-lengths none: the verdict in bpb only
    "ablate|360|240|est.|NANOMUON_BASE_DIR=$KIT/ablate python -m nanomuon.dataset --embedded \
&& NANOMUON_BASE_DIR=$KIT/ablate python -m scripts.ablate --name gpu-check --device-type cuda \
--device-batch-size 16 --baseline-lengths none"
    # 150 s bounded the 8 tests of 2026-11-26 (cold, 7 had passed at 120 s; warm, all took 77 s);
    # the memory test now also compiles the speedrun's model at d12 and d20
    "tests|300|200|est.|python -m pytest -q --slow -m cuda tests"
    # model and optimizer compiles, 20 steps of 0.5M tokens, eval's second compile, a final
    # checkpoint: 95 and 122 s with the classic model; the speedrun's adds flex_attention's compile
    # and its value embeddings (~2.3 GB checkpoint)
    "base_train_d12|200|130|est.|python -m scripts.base_train --depth 12 --num-iterations 20 \
--run gpu-check-d12 $TRAIN"
    # base_train_d12 with --fp8 (torchao's float8 training, from the prepared wheel when not
    # installed): 117 s with the classic model
    "fp8_d12|240|150|est.|$TORCHAO_READY && python -m scripts.base_train --depth 12 \
--num-iterations 20 --run gpu-check-d12-fp8 --fp8 $TRAIN"
    # 4 builds (each side in bf16, then fp8): 327 s with the classic model on nanomuon's side;
    # nanomuon's fp8 without torchao is n/a and nanochat's still runs
    "h2h_d12|510|340|est.|$TORCHAO_READY; $H2H --depth 12 --device-batch-size 32 \
--total-batch-size 524288 --precision bf16 fp8"
    # 2 sides x 2 Newton-Schulz precisions compiled at d12, 5 timed steps each (44 s, then 80 s)
    "bench_optim_d12|120|80|seen|python -m scripts.bench_optim --depth 12 --compile --steps 5 \
--compare defaults same-math --ns-precision bf16 fp16"
    # 1 side, 1 precision at d20: fewer compiles, of bigger graphs (59 s, then 78 s)
    "bench_optim_d20|120|78|seen|python -m scripts.bench_optim --depth 20 --compile --steps 5 \
--compare defaults --ns-precision fp16"
    # the same as d12 at d20: longer compiles, ~4 s steps, a final checkpoint; 131 s classic
    "base_train_d20|270|170|est.|python -m scripts.base_train --depth 20 --num-iterations 10 \
--run gpu-check-d20 $TRAIN"
    # d4 through torchrun: train (two compiles), base_eval, sample; the tokenizer is reused; 115 s
    # with the classic model
    "speedrun|200|130|est.|MODE=gpu DATASET=embedded NPROC=1 DEPTH=4 RUN=gpu-check-speedrun \
bash speedrun.sh --num-iterations 20 --total-batch-size 65536 --device-batch-size 32 \
--max-seq-len 1024 --eval-tokens 65536"
)
# never run on a GPU: every regime limit is a guess, 1.5x its estimate. A run trains 64 seeds of
# the preset (0.57M params) as one batched model, 700 steps of 8,192 tokens each: about 30 s of steps
# (the d4 speedrun stepped 27 ms for 65,536 tokens), and a compile. The table is ablate's
# --published, in steps that fit a call: regime_adamw: muon and its runs at 0.8 of the steps, adamw
# at its 3 lr-multipliers, one cold compile each; a technique: its 3 runs, its optimizer compiled
# anew, muon read from the cache (on a fresh machine without it, muon runs first: rerun the step).
# Each step's runs are the table's own (the same keys); the table: every run cached, the write-up
REGIME_SWEEP="lr-multiplier=0.5,1,2"  # ablate's PUBLISHED_SWEEP
for t in $TECHNIQUES; do
    STEPS+=("regime_$(echo "${t#muon-}" | tr - _)|$([ $t = adamw ] && echo 450 || echo 300)|\
$([ $t = adamw ] && echo 300 || echo 200)|est.|$REGIME_IN && $REGIME --name gpu-regime-${t#muon-} \
--variants muon,$t --baseline muon --sweep $t:$REGIME_SWEEP; rc=\$?; $REGIME_OUT; exit \$rc")
done
STEPS+=("regime_table|120|60|est.|$REGIME_IN && $REGIME --name gpu-regime --published; rc=\$?; \
$REGIME_OUT; cp $REGIME_BASE/ablations/gpu-regime/ablation.md $OUTDIR/regime.md; exit \$rc")

# --only: the steps named, exactly or by a prefix before _ (bench_optim: both), in the kit's order
if [ -n "$ONLY" ]; then
    IFS=',' read -r -a wanted <<<"$ONLY"
    # names_step NAME WANTED: the step NAME is WANTED, or WANTED is its prefix before a _
    names_step() { [ "$1" = "$2" ] || [[ "$1" == "${2}_"* ]]; }
    for w in "${wanted[@]}"; do
        found=""
        for s in "${STEPS[@]}"; do names_step "${s%%|*}" "$w" && found=1; done
        if [ -z "$found" ]; then
            echo "error: --only names no step '$w'; the steps:" \
                 "$(printf '%s\n' "${STEPS[@]}" | cut -d'|' -f1 | paste -sd' ' -)" >&2
            exit 2
        fi
    done
    kept=()
    for s in "${STEPS[@]}"; do
        for w in "${wanted[@]}"; do
            if names_step "${s%%|*}" "$w"; then kept+=("$s"); break; fi
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
        status="FAILED (exit $rc): $(why_failed "$3")"
    fi
}

# why_failed LOG: the line that says why a step failed, at most 300 characters: the last that an
# error printed (a Python exception's own line, an "error:" line, a failed test or side), else the
# log's last line
why_failed() {
    { grep -E -e '^[A-Za-z_][A-Za-z0-9_.]*(Error|Exception|Failed|Unsupported)(: |$)' \
          -e '^error: |FAILED|Killed' "$1" || tail -n 1 "$1"; } | tail -n 1 | cut -c1-300 \
        | grep . || echo "no output"
}

# print_plan: the steps and their limits, then the calls, in order: each call's limits fit one
# command; the device budget is spent at the steps' seconds (limits would waste most of it). A
# call past what is left of the budget is listed as over it; a later one that fits is planned.
print_plan() {
    local all=0 budget=$((BUDGET_MIN * 60)) used=$START need=$START piece="" sum=0 took=0 n=0
    local s name secs seen basis cmd
    for s in "${STEPS[@]}"; do
        IFS='|' read -r name secs seen basis cmd <<<"$s"; all=$((all + secs))
    done
    echo "gpu_check plan: $BUDGET_MIN min of device time (--budget-min), one command at most" \
         "$PIECE s; steps most valuable first ($all s of limits in all):"
    for s in "${STEPS[@]}"; do
        IFS='|' read -r name secs seen basis cmd <<<"$s"
        printf '  %-16s %4ss  (%-4s %3s s)  %s\n' "$name" "$secs" "$basis" "$seen" "$cmd"
    done
    echo "  (seen: what the step took on an H200; est.: an estimate, never yet run on the" \
         "speedrun's model)"
    echo "calls, in order (the first starts the machine: about $START s; send each within the" \
         "machine's idle release, or the next starts a fresh one):"
    for s in "${STEPS[@]}" "end|$((PIECE + 1))|0|seen|"; do
        IFS='|' read -r name secs seen basis cmd <<<"$s"
        if [ -n "$piece" ] && [ $((sum + secs)) -gt "$PIECE" ]; then
            n=$((n + 1)); need=$((need + took))
            if [ $((used + took)) -le "$budget" ]; then
                used=$((used + took))
                printf '  call %d: %4ss (about %3s s)  bash scripts/gpu_check.sh --only %s\n' \
                    "$n" "$sum" "$took" "$piece"
            else
                printf '  over the budget (%d s with it): %4ss  --only %s\n' "$((used + took))" \
                    "$sum" "$piece"
            fi
            piece=""; sum=0; took=0
        fi
        piece="${piece:+$piece,}$name"; sum=$((sum + secs)); took=$((took + seen))
    done
    echo "left after the calls: $((budget - used)) s, if each step takes the seconds above: rerun" \
         "a step that timed out"
    # what all of these steps need, so a selection (--only regime) says its own device time
    echo "all $n calls need about $(( (need + 59) / 60 )) min of device time ($need s at the" \
         "steps' seconds, the start included): --budget-min $(( (need + 59) / 60 )) fits them"
    echo "carry: .gpu_check ($(du -sm "$KIT" 2>/dev/null | cut -f1 || echo 0) MiB of the 64 MiB;" \
         "made by --prepare). Every call appends to .gpu_check.md and returns it whole in" \
         "\$OUT/gpu_check.md: its numbers go into docs/benchmarks.md with the device and date"
}

# in a subshell: whatever fails in it, --plan and --dry-run stop here and start no step
if [ "$MODE" = plan ]; then
    (print_plan)
    exit
fi

if [ "$MODE" = dry ]; then
    (print_plan) || exit 1
    # how a step's end reads: a 1 s limit on a sleep, and a command that fails saying why
    probe=$(mktemp -d)
    run_step 1 "sleep 5" "$probe/log" probe; echo "a step past its limit: $status"
    run_step 5 "echo 'RuntimeError: no kernel' >&2; exit 3" "$probe/log" probe
    echo "a failing step: $status"
    rm -rf "$probe"
    python - <<'EOF' || exit 1
import importlib
for m in ("torch", "tiktoken", "pyarrow", "nanomuon.optim", "nanomuon.gpt",
          "nanomuon.dataloader", "scripts.bench_optim", "scripts.base_train", "scripts.base_eval",
          "scripts.sample", "scripts.bench_nanochat"):
    importlib.import_module(m)
print("imports: ok")
EOF
    # every step's `python -m MODULE ARGS` (speedrun.sh's ARGS: base_train's) names a module that
    # exists, and its own parser takes the args: its parse_args, else the flags its --help names
    python - "${STEPS[@]}" <<'EOF' || exit 1
import contextlib, functools, importlib, importlib.util, io, re, shlex, subprocess, sys

def calls(cmd):
    """(module, args) of each python -m call in a shell command line."""
    lex = shlex.shlex(cmd, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    out, words, target = [], [], False
    for w in [*lex, ";"]:
        if target:  # a redirection's file
            target = False
        elif w in (";", "&&", "||", "|", "&", "(", ")"):
            out.append(words)
            words = []
        elif set(w) <= set("<>&"):  # a redirection, and the file descriptor before it
            target = True
            if words and words[-1].isdigit():
                words.pop()
        elif words or not (w in ("{", "}") or re.match(r"\w+=", w)):  # braces, VAR=value: not
            words.append(w)
    for w in out:
        if w[:2] == ["python", "-m"] and len(w) > 2:
            yield w[2], w[3:]
        elif w[:2] == ["bash", "speedrun.sh"]:
            yield "scripts.base_train", w[2:]

@functools.cache
def help_flags(module, sub):
    """The flags `python -m module sub --help` names, or None if it fails."""
    r = subprocess.run([sys.executable, "-m", module, *sub, "--help"], capture_output=True,
                       text=True, timeout=600)
    return set(re.findall(r"(?<![\w-])--?[A-Za-z0-9][\w-]*", r.stdout)) if not r.returncode \
        else None

def refusal(module, args):
    """Why `python -m module args` would not start here, or None."""
    if importlib.util.find_spec(module) is None:
        return "there is no such module"
    parse = getattr(importlib.import_module(module), "parse_args", None)
    if parse:
        said = io.StringIO()
        try:
            with contextlib.redirect_stderr(said):
                parse(args)
        except SystemExit as e:
            return (said.getvalue().strip().splitlines() or [f"exit {e.code}"])[-1].split(
                "error: ", 1)[-1]
        return None
    sub = tuple(next((args[:i] for i, a in enumerate(args) if a.startswith("-")), args))
    known = help_flags(module, sub)
    if known is None:
        return f"python -m {module} {' '.join(sub)} --help fails"
    bad = [a for a in args if a[:1] == "-" and not a[1:2].isdigit()
           and a.split("=")[0] not in known]
    return f"its --help names no {', '.join(bad)}" if bad else None

wrong, checked = [], {}
for step in sys.argv[1:]:
    name, *_, cmd = step.split("|", 4)
    for module, args in calls(cmd):
        checked[module] = checked.get(module, 0) + 1
        if why := refusal(module, args):
            wrong.append(f"error: step {name}: python -m {module}: {why}")
if wrong:
    sys.exit("\n".join(wrong))
for module, n in checked.items():
    print(f"{module} flags: ok ({n} of the steps' calls)")
EOF
    if [ -f "$KIT/nanochat/nanochat/gpt.py" ]; then
        echo "nanochat in the kit: $(clean_commit <"$KIT/nanochat/COMMIT" 2>/dev/null \
            || echo 'no COMMIT')"
    else
        echo "nanochat: none in the kit, so the h2h steps will fail (NANOCHAT=path/to/nanochat" \
             "bash scripts/gpu_check.sh --prepare)"
    fi
    if printf '%s\n' "${STEPS[@]}" | grep -q '^tests|'; then
        python -m pytest -q --collect-only -m cuda tests >/dev/null && echo "cuda tests: collected"
    fi
    exit 0
fi

if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "error: torch sees no CUDA device here; gpu_check runs on a GPU machine (use --dry-run" \
         "to check this one)" >&2
    exit 1
fi
mkdir -p "$OUTDIR"
# one summary for the whole kit: every call (a piece: --only) appends its part
SUMMARY="$PWD/.gpu_check.md"
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
    echo "- code prepared at $(cat "$KIT/commit" 2>/dev/null || echo 'an unknown commit')," \
         "command: bash scripts/gpu_check.sh${ARGS:+ $ARGS}"
    echo
} >>"$SUMMARY"
total_start=$(date +%s)
for s in "${STEPS[@]}"; do
    IFS='|' read -r name secs seen basis cmd <<<"$s"
    log="$OUTDIR/$name.log"
    echo "== $name (limit ${secs}s): $cmd"
    run_step "$secs" "$cmd" "$log" "$name"
    # the attention it ran, as its first "attention:" line names it (fa3, flex, sdpa...)
    attention=$(sed -n 's/^attention: \([^(:]*\).*/\1/p' "$log" | head -n 1 | sed 's/ *$//')
    estimate=$(grep -m 1 '^time to GPT-2' "$log")
    echo "   $status, ${took} s${attention:+, attention $attention} (log: $log)"
    {
        echo "## $name: $status, ${took} s${attention:+; attention: $attention}"
        echo
        if [ -n "$estimate" ]; then printf '**%s**\n\n' "$estimate"; fi
        echo '```'
        echo "$cmd"
        # the lines that carry numbers: bench summaries (and each h2h side's, kept if the other
        # side runs past the limit), throughput, optimizer share, bpb
        grep -E -e "^(step d|NS d|Gram FLOPs|imbalance|matmul|h2h |  nano(muon|chat) )" \
            -e "throughput:" \
            -e "optimizer step:" \
            -e "final val bpb|passed|skipped|speedrun done|^\| (muon|adamw)[a-z-]* \||runs took" \
            "$log" | tail -n 12
        if [ $rc -ne 0 ]; then tail -n 4 "$log"; fi
        echo '```'
        echo
    } >>"$SUMMARY"
done
{ echo "- total: $(( $(date +%s) - total_start )) s"; echo; } >>"$SUMMARY"
if [ -n "${OUT:-}" ]; then cp "$SUMMARY" "$OUT/gpu_check.md"; fi
echo "summary: $SUMMARY${OUT:+ (and \$OUT/gpu_check.md)}"
cat "$SUMMARY"
# the headline, from this call or an earlier one: the last h2h_d24_fp8's time to GPT-2
headline=$(grep '^\*\*time to GPT-2' "$SUMMARY" | tail -n 1)
if [ -n "$headline" ]; then echo "${headline//\*\*/}"; fi
