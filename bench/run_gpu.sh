#!/usr/bin/env bash
# usage: [OUT=DIR] bash bench/run_gpu.sh [STEP ...]
#
# GPU evidence in one call: GPU tests, kernel sweep, capture/dispatch bench, ladder tune,
# TPOT per policy, and the demo's GPU path. Run it on a CUDA machine.
# steps: any of tests gputests balancedtests sweep fisweep capture tune tunefp8 tunemtp tunesparse
#        tpot tpotfp8 tpotmtp ragged demo tp fp8 mtp sparse sparseab tpotsparse l2 tpotdp hostphases
#        selectcost oracle stepahead splitflip
#        balancedseesaw tpotbatches tpothf stepkernels stepvariants seesawverify seesawrows ncurows fp8seesaw mergetiles mergesweep rows32 ncu ncuspread ncumerge
#        (seesawrows: q_len 1, 2 and 4 on the same 16-head seesaw programs; ncurows: under ncu)
#        (gputests: the GPU-marked tests; GPU_TESTS="tests/test_x.py ..." picks files)
#        (tpotdp: TPOT of the 128-head deepseek-v3-dp preset, the compute-bound decode)
#        (balancedtests: the balanced kernels per capture size, the ragged switch and the
#        oracle's host logic, on the GPU)
#        (tune: 16-, 128- and 12-head ladders (TUNE_HEADS) tuned at every capture size, each copied
#        into graphbucket/ladders/ so that the TPOT steps after it run it, and checked by
#        bench/ladder_oracle.py; TUNE_MIX_LENGTHS=2 times the ragged mixes at two lengths;
#        TUNE_BALANCED_FROM=N times them from N tokens (tune_ladder.py's default otherwise);
#        TUNE_KERNEL_NEIGHBOURS=N|auto passes --kernel-neighbours to the tuner;
#        TUNE_KERNEL_AB=1 also re-chooses the switch with --kernel-neighbours 0 from the same
#        report and runs its oracle into own-range/;
#        TUNE_LIMIT caps the tuning and the oracle, each (seconds; 330, sparse 450);
#        tunefp8: ladders over fp8-tensor and fp8-v32 (TUNE_FP8)
#        caches at 16 heads (TUNE_FP8_HEADS), likewise; tunemtp: 16- and 128-head ladders for q_len 2 and 4
#        (TUNE_MTP="heads:q ..." picks some); retime: a saved report's split-KV table with
#        its ragged mixes timed again (RETIME="heads:report ...", bf16), then the oracle; tunesparse: the 16-head sparse decoder's ladder
#        (tune_ladder.py --sparse, top-k 2048), copied in as h200-h16-sparse.json (tpotsparse
#        after it runs it) and checked by ladder_oracle.py --sparse into
#        h200-ladder-oracle-sparse.*; tpotfp8: TPOT of bf16, fp8-tensor and fp8-v32 caches in
#        one table, fixed-1 and the ladder, after tunefp8)
#        (tpotmtp: TPOT of verify steps at q_len 1, 2, 4 on fewer contexts)
#        (l2: decode time with the KV in HBM against L2-resident, 16 and 128 heads)
#        (hostphases: where a BlockTable host step's time goes, batch 1 and 64 x 128K)
#        (stepahead: steps issued after the last one finished against one ahead: the host
#        step, the step period and the GPU idle issuing ahead removes; its GPU test first)
#        (splitflip: 32 against 64 splits at 128 heads, batch 1, 11K-23K tokens, by the
#        tuner's timer and the oracle's, alternating: do the two disagree by construction?)
#        (oracle: bench/ladder_oracle.py on each ladder of ORACLE_LADDERS="a.json b.json" in
#        one call, each into oracle-<name>/, at ORACLE_HEADS (16) heads, ORACLE_KV (bf16),
#        ORACLE_Q (1) and, where set, ORACLE_BATCHES="4 32" only; TUNE_LIMIT caps each: the
#        A/B of two ladders chosen from one report)
#        (selectcost: the selector's host cost with the shipped ladders' second balanced
#        graphs against one, bench/experiments/select_cost.py; host only)
#        (stepkernels: fixed-max, the ladder and a fixed-max control at 32-128 x 32K-128K,
#        16 heads: interleaved step rounds, each kernel's time inside the step, the plans
#        alone, the clocks; STEPKERNELS_ARGS="--preset deepseek-v3-dp --cells 8:131072
#        32:131072" for 128 heads)
#        (tpotbatches: TPOT at batch 1, 8, 32, 64 and 128 with fixed-1, fixed-max,
#        balanced-only and the ladder, 16 heads then 128 (2 layers), each into its
#        own folder)
#        (tpothf: transformers' DeepSeek-V3 through graphbucket: the bf16 equivalence test at
#        TP8 attention shapes, then TPOT of fixed-1, fixed-max and the ladder on it, batch 1
#        and 8; a transformers wheel in .whl/hf/ is installed first where present)
#        (balancedseesaw: the seesaw's GPU tests, then the seesaw (split-KV and balanced)
#        against the Triton stage 1 on ragged mixes and uniform batches, 128 heads, then 16
#        heads on 64-row programs; SEESAW_HEADS="16" picks)
#        (stepvariants: the seesaw's step options (lazy rescale, the default over bf16; eager
#        rescale; one-rescale order; 64-column PVs) against float64, then the split-KV
#        seesaw with each variant against the default, bench/experiments/seesaw_variant_ab.py,
#        and the balanced kernels likewise, bench/experiments/balanced_variant_ab.py;
#        STEP_VARIANTS="eager-rescale one-rescale pv-cols-64" and
#        STEP_VARIANT_TESTS="step_variants" pick (the tests default to the lazy step's);
#        STEP_BALANCED=0 skips the balanced A/B)
#        (ncuspread: Nsight Compute over a 128-head batch spread over 1..8K, kernel by kernel)
#        (ncumerge: the same batch's balanced merge alone: memory, warp stalls, occupancy)
#        (mergesweep: merge tiles at MERGE_HEADS (128) heads, MERGE_TILES='s4-h8-dv128-w4 ...')
#        (rows32: 32 query rows on 32-row against 64-row programs, per cache format)
#        (seesawverify: verify steps on the seesaw against float64, then timed against the
#        Triton verify step and the q_len 1 step, bench/experiments/seesaw_verify.py)
#        (fp8seesaw: the seesaw over fp8 caches (per-tensor, V3.2) against float64, then
#        timed against the bf16 seesaw and the Triton fp8 kernels,
#        bench/experiments/seesaw_fp8_ab.py; FP8_SEESAW_TESTS="fp8_seesaw_matches" picks
#        the split-KV tests alone)
#        (mergetiles: the balanced merge's tests and every balanced path's GPU tests, then
#        whole balanced steps with the plan's merge tile against units of several heads,
#        bench/experiments/merge_tiles.py)
#        (ncu: Nsight Compute over bench/ncu_ragged.py, then the fp8 seesaw in bench/ncu_stage1.py;
#        ncuseesaw: the bf16 seesaw at 128 heads, its warp stalls and pipes, every stall
#        reason's share and the stalls per SASS instruction as CSV)
#        (fp8: FP8_AB="float-32x4 ..." adds stage-1 variants, bench/fp8_sweep.py --ab)
#        (fisweep: the sweep with FlashInfer rows, wheels installed from .whl/ if present)
#        (threeway: the sweep with FlashInfer and FlashMLA rows: wheels from .whl/, FlashMLA
#        built from its kit copied into .flashmla-kit/ (git-ignored; carry both). The two
#        wheels (36 MB) and the checkout can pass a 64 MiB carry limit: unzip them into one
#        folder (`python3 -m zipfile -e WHEEL DIR` each) and carry `tar cJf
#        .whl/site.tar.xz -C DIR .` alone (13 MB))
#        (sparseab: the indexer and sparse-attention A/Bs, each checked against float64)
#        (ragged: batches whose lengths differ, against the bytes they read)
#        (tp needs 2 GPUs: TP=2 decode, numerics vs TP=1, TPOT ladder vs fixed-1)
#        (default: tests sweep capture tune tpot).
# Every step has a time limit so one hang cannot eat the rest. Everything is written under
# $OUT/r and packed into $OUT/gpu-results.tgz after every step (the device tool returns at
# most 8 files);
# OUT defaults to a new temporary folder, printed first. Besides $OUT, only the tune
# steps write into the checkout (graphbucket/ladders/).
# TPOT_LAYERS sets the tpot model's layer count (default 4). On the device tool, work outside
# its $OUT and pack into it: `PACK_TO="$OUT" OUT=/tmp/w bash bench/run_gpu.sh ...` (in this
# order: `OUT=/tmp/w PACK_TO=$OUT` would expand $OUT after it was reassigned).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
STEPS="tests gputests balancedtests sweep fisweep capture tune tunefp8 tunemtp tunesparse retime tpot tpotfp8 tpotmtp
       ragged demo tp fp8 mtp sparse sparseab tpotsparse l2 tpotdp hostphases selectcost oracle balancedseesaw tpotbatches
       tpothf stepkernels stepvariants seesawverify seesawrows ncurows threeway fp8seesaw mergetiles mergesweep rows32 ncu ncuspread ncumerge ncuseesaw stepahead splitflip"
usage() { sed -n '2,/^set /{/^set /d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"; }
for arg in "$@"; do
  case $arg in
    -h|--help) usage; exit 0 ;;
    *) [[ " $(echo $STEPS) " == *" $arg "* ]] || {
         echo "run_gpu.sh: unknown step '$arg'; steps: $(echo $STEPS) (--help says more)" >&2
         exit 2; } ;;
  esac
done
OUT=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/graphbucket-gpu.XXXXXX")}
echo "results: $OUT"
R="$OUT/r"
mkdir -p "$R"
export PYTHONUNBUFFERED=1
# Triton's compile cache in the checkout: carry .triton-cache/ from one call to the next
# and the tests and benches skip the compiles an earlier call made.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton-cache}
steps=${*:-tests sweep capture tune tpot}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$R/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# One tuned ladder, every capture size: tune, copy into graphbucket/ladders/ (so that the
# TPOT steps after it run it), then its out-of-sample oracle, appended to one file (the
# sparse decoder's, with a 4th argument --sparse, to its own).
tune_one() {
  local heads=$1 fmt=$2 q=$3 sparse=${4:-} name oracle=h200-ladder-oracle limit=${TUNE_LIMIT:-330}
  # The grid's GPU time: tune_ladder.py --dry-run and ladder_oracle.py --dry-run (16 heads:
  # about 190 s each; the sparse layer's grid more).
  [ -n "$sparse" ] && oracle=h200-ladder-oracle-sparse limit=${TUNE_LIMIT:-450}
  # Dense ladders re-rank their near-ties of long, wide cells in a decode step.
  local ties=--step-ties; [ -n "$sparse" ] && ties=""
  # Named after the GPU it runs on ('h200', 'h100'), so that the runner there finds it.
  name=$(python3 -c "import torch; from graphbucket.tuning.shipped import device_slugs, ladder_file_name as n
print(n(device_slugs(torch.cuda.get_device_name())[-1], $heads, '$fmt', q_len=$q, sparse=bool('$sparse')))")
  timeout $limit python3 scripts/tune_ladder.py --heads "$heads" --kv-cache "$fmt" --q-len "$q" \
    $sparse ${TUNE_FROM:+--from-times "$TUNE_FROM" --retime-ragged} $ties \
    ${TUNE_MIX_LENGTHS:+--mix-lengths "$TUNE_MIX_LENGTHS"} \
    ${TUNE_BALANCED_FROM:+--balanced-from "$TUNE_BALANCED_FROM"} \
    ${TUNE_KERNEL_NEIGHBOURS:+--kernel-neighbours "$TUNE_KERNEL_NEIGHBOURS"} --max-buckets 16 \
    --max-model-len 131072 --out "$R/$name" \
    --report "$R/tune-${name%.json}.json" --plot "$R/tune-${name%.json}.png" --force \
    > "$R/tune-${name%.json}.log" 2>&1; tail -2 "$R/tune-${name%.json}.log"
  cp "$R/$name" "graphbucket/ladders/$name" 2>/dev/null || return
  pack
  local append=""; [ -f "$R/$oracle.json" ] && append=--append
  timeout $limit python3 bench/ladder_oracle.py --heads "$heads" --kv-cache "$fmt" --q-len "$q" \
    $sparse --ladder "$R/$name" --out "$R" $append > "$R/oracle-${name%.json}.log" 2>&1
  grep -A12 "^Worst" "$R/oracle-${name%.json}.log" | tail -10
  pack
  [ -n "${TUNE_KERNEL_AB:-}" ] && [ -z "$sparse" ] || return 0
  # The same report's switch with each range's kernel from its own mixes alone, and its
  # oracle beside (into own-range/): the A/B of --kernel-neighbours.
  local ab="$R/own-range"; mkdir -p "$ab"
  python3 scripts/tune_ladder.py --heads "$heads" --kv-cache "$fmt" --q-len "$q" \
    --from-times "$R/tune-${name%.json}.json" --kernel-neighbours 0 --max-buckets 16 \
    --max-model-len 131072 --out "$ab/$name" --force > "$ab/tune-${name%.json}.log" 2>&1
  append=""; [ -f "$ab/$oracle.json" ] && append=--append
  timeout $limit python3 bench/ladder_oracle.py --heads "$heads" --kv-cache "$fmt" --q-len "$q" \
    --ladder "$ab/$name" --out "$ab" $append > "$ab/oracle-${name%.json}.log" 2>&1
  grep -A12 "^Worst" "$ab/oracle-${name%.json}.log" | tail -10
  pack
}
# Packed after every step (to a temporary name, then moved), so that a call stopped at its
# limit still returns what the steps before it wrote. PACK_TO names a second folder that
# gets the same archive (the device tool's $OUT when OUT is a work folder outside it).
pack() {
  tar czf "$OUT/.gpu-results.tgz" -C "$R" . && mv "$OUT/.gpu-results.tgz" "$OUT/gpu-results.tgz"
  [ -n "${PACK_TO:-}" ] && cp "$OUT/gpu-results.tgz" "$PACK_TO/.gpu-results.tgz" \
    && mv "$PACK_TO/.gpu-results.tgz" "$PACK_TO/gpu-results.tgz"
  return 0
}
for step in $steps; do
  echo "== $step $(date -u +%H:%M:%S)"
  case $step in
    tests) # Spread over worker processes where pytest-xdist is importable (the compiles are
           # CPU-bound); the test that fills the device then skips and runs alone after.
           workers=(); python3 -c "import xdist" 2>/dev/null && workers=(-n "${TEST_WORKERS:-14}")
           timeout 500 python3 -m pytest -q "${workers[@]}" tests bench/test_tpot.py \
             bench/test_tpot_sparse.py --benchmark-disable -p no:cacheprovider \
             > "$R/tests.log" 2>&1; tail -15 "$R/tests.log"
           if ((${#workers[@]})); then
             timeout 90 python3 -m pytest -q tests/test_runner.py -k "capture_fault and oom" \
               -p no:cacheprovider > "$R/tests-oom.log" 2>&1; tail -2 "$R/tests-oom.log"
           fi ;;
    gputests) workers=(); python3 -c "import xdist" 2>/dev/null && workers=(-n "${TEST_WORKERS:-14}")
              # About 330 s on 14 workers of an H100 (760 tests).
              timeout 420 python3 -m pytest -q "${workers[@]}" -m gpu \
                ${GPU_TESTS:-tests bench/test_tpot.py bench/test_tpot_sparse.py} \
                -p no:cacheprovider > "$R/tests.log" 2>&1
              tail -15 "$R/tests.log"
              if ((${#workers[@]})); then
                timeout 90 python3 -m pytest -q tests/test_runner.py -k "capture_fault and oom" \
                  -p no:cacheprovider > "$R/tests-oom.log" 2>&1; tail -2 "$R/tests-oom.log"
              fi ;;
    balancedtests) timeout 200 python3 -m pytest -q tests/test_balanced_kernels.py \
                     tests/test_ragged_switch.py tests/test_ladder_oracle.py -p no:cacheprovider \
                     > "$R/balanced-tests.log" 2>&1; tail -4 "$R/balanced-tests.log" ;;
    sweep) timeout 240 python3 bench/kernel_sweep.py --out "$R" > "$R/sweep.log" 2>&1
           tail -42 "$R/sweep.log" ;;
    threeway) # The sweep beside FlashInfer (wheels in .whl/) and FlashMLA (its build kit
              # copied into .flashmla-kit/ and carried: about 100 s to build), one run.
              if [ -f .flashmla-kit/build.sh ]; then
                timeout 300 bash .flashmla-kit/build.sh /tmp/flashmla-src > "$R/flashmla-build.log" 2>&1
                tail -2 "$R/flashmla-build.log"
                export PYTHONPATH=/tmp/flashmla-src/FlashMLA${PYTHONPATH:+:$PYTHONPATH}
              fi
              # FlashInfer: its wheels in .whl/, or already unpacked into .whl/site.tar.xz
              # (a third the size, for a carry limit).
              if [ -f .whl/site.tar.xz ]; then mkdir -p /tmp/site && tar xJf .whl/site.tar.xz -C /tmp/site
              elif [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile \
                --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1; fi
              PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} timeout 480 python3 \
                bench/kernel_sweep.py --splits --contexts 256 1024 4096 16384 65536 131072 \
                --out "$R" > "$R/sweep.log" 2>&1; tail -80 "$R/sweep.log" ;;
    fisweep) [ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile \
               --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
             PYTHONPATH=/tmp/site timeout 300 python3 bench/kernel_sweep.py --splits --out "$R" \
               > "$R/sweep.log" 2>&1; tail -60 "$R/sweep.log" ;;
    fp8) timeout 300 python3 bench/fp8_sweep.py --out "$R" --ab ${FP8_AB:-} > "$R/fp8.log" 2>&1
         tail -40 "$R/fp8.log" ;;
    balancedseesaw) timeout 300 python3 -m pytest -q tests/test_seesaw.py -m gpu \
                      -p no:cacheprovider > "$R/balanced-seesaw-tests.log" 2>&1
                    tail -3 "$R/balanced-seesaw-tests.log"
                    for h in ${SEESAW_HEADS:-128 16}; do
                      timeout 300 python3 bench/experiments/balanced_seesaw.py --heads "$h" \
                        --out "$R" > "$R/balanced-seesaw-h$h.log" 2>&1
                      tail -36 "$R/balanced-seesaw-h$h.log"; pack
                    done ;;
    stepvariants) # The seesaw's step options against the default (the lazy rescale): their
                  # float64 tests, then the split-KV kernel and the balanced kernels (items,
                  # ranges, charged) with each variant (STEP_VARIANTS: eager-rescale,
                  # one-rescale, pv-cols-64) against the default, in one process each.
                  workers=(); python3 -c "import xdist" 2>/dev/null && workers=(-n 8)
                  timeout 420 python3 -m pytest -q "${workers[@]}" tests/test_seesaw.py -m gpu \
                    -k "${STEP_VARIANT_TESTS:-lazy or row_max_jumps or False-None-True}" -p no:cacheprovider \
                    > "$R/step-variants-tests.log" 2>&1
                  tail -3 "$R/step-variants-tests.log"
                  for variant in ${STEP_VARIANTS:-eager-rescale}; do
                    timeout 240 python3 bench/experiments/seesaw_variant_ab.py \
                      --variant "$variant" --out "$R" > "$R/seesaw-variant-ab-$variant.log" 2>&1
                    tail -14 "$R/seesaw-variant-ab-$variant.log"
                    [ "${STEP_BALANCED:-1}" = 0 ] || [ "$variant" = one-rescale ] || {
                      timeout 420 python3 bench/experiments/balanced_variant_ab.py \
                        --variant "$variant" --out "$R" > "$R/balanced-variant-ab-$variant.log" 2>&1
                      tail -46 "$R/balanced-variant-ab-$variant.log"; }
                  done ;;
    fp8seesaw) # The seesaw over fp8 caches (under trial): its float64 tests, then the A/B
               # against the bf16 seesaw and the Triton kernels on the same fp8 caches.
               workers=(); python3 -c "import xdist" 2>/dev/null && workers=(-n 8)
               # A new barrier protocol can hang: the first test alone, with a short limit.
               if timeout 90 python3 -m pytest -q -x tests/test_seesaw_fp8.py -m gpu \
                    -k "fp8-tensor-3-128-lens3 or fp8-v32-3-128-lens3" -p no:cacheprovider > "$R/seesaw-fp8-first.log" 2>&1
               then
                 timeout 300 python3 -m pytest -q "${workers[@]}" tests/test_seesaw_fp8.py \
                   -m gpu -k "${FP8_SEESAW_TESTS:-gpu}" -p no:cacheprovider \
                   > "$R/seesaw-fp8-tests.log" 2>&1
                 tail -3 "$R/seesaw-fp8-tests.log"
                 timeout 240 python3 bench/experiments/seesaw_fp8_ab.py --out "$R" \
                   > "$R/seesaw-fp8-ab.log" 2>&1; tail -12 "$R/seesaw-fp8-ab.log"
               else tail -30 "$R/seesaw-fp8-first.log"; fi ;;
    mergetiles)   # The balanced merge: its tests (the merge alone, the balanced paths and
                  # runners, the balanced seesaws over bf16 and fp8 caches, on the GPU), then
                  # the plan's merge tile against tiles of several heads per unit.
                  workers=(); python3 -c "import xdist" 2>/dev/null && workers=(-n 8)
                  timeout 420 python3 -m pytest -q "${workers[@]}" tests/test_balanced_merge.py \
                    tests/test_balanced.py tests/test_balanced_kernels.py tests/test_seesaw.py \
                    tests/test_seesaw_fp8.py -k "not test_seesaw or balanced or range or item \
                    or runs_seesaw_plans" -p no:cacheprovider > "$R/merge-tests.log" 2>&1
                  tail -3 "$R/merge-tests.log"
                  timeout 420 python3 bench/experiments/merge_tiles.py --out "$R" \
                    > "$R/merge-tiles.log" 2>&1; tail -30 "$R/merge-tiles.log" ;;
    ncu)          # Nsight Compute: a ragged step split into its kernels (128 and 16 heads),
                  # then the fp8 seesaw's memory tables, warp stalls and instruction mix.
                  command -v ncu > /dev/null || { echo "ncu: not installed"; continue; }
                  timeout 300 ncu --section SpeedOfLight python3 bench/ncu_ragged.py \
                    > "$R/ncu-ragged.txt" 2>&1; grep -E "^  [a-z_]+.*\(|Duration" "$R/ncu-ragged.txt" | tail -40
                  timeout 240 ncu -k regex:seesaw_fp8 -c 4 --section MemoryWorkloadAnalysis_Tables \
                    --section WarpStateStats --section InstructionStats python3 bench/ncu_stage1.py \
                    > "$R/ncu-fp8.txt" 2>&1; grep -E "Duration|Hit Rate|Stall" "$R/ncu-fp8.txt" | head -30 ;;
    ncuspread)    # Nsight Compute: a 128-head batch spread over 1..8K, kernel by kernel.
                  command -v ncu > /dev/null || { echo "ncu: not installed"; continue; }
                  timeout 240 ncu --section SpeedOfLight python3 bench/ncu_ragged.py --heads 128 \
                    --mix spread-8k > "$R/ncu-spread.txt" 2>&1
                  grep -E "^[0-9]+ |^  [a-z_]+.*\(|Duration" "$R/ncu-spread.txt" | tail -40 ;;
    ncumerge)     # Nsight Compute: the balanced merge of a 128-head batch spread over 1..8K:
                  # memory tables, warp stalls, occupancy (why it takes a third of the step).
                  command -v ncu > /dev/null || { echo "ncu: not installed"; continue; }
                  timeout 240 ncu -k regex:balanced_merge -c 8 --section SpeedOfLight \
                    --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
                    --section WarpStateStats --section Occupancy --section LaunchStats \
                    --section SchedulerStats python3 bench/ncu_ragged.py --heads 128 \
                    --mix spread-8k > "$R/ncu-merge.txt" 2>&1
                  grep -E "^[0-9]+ |Duration|Throughput|Stall|Occupancy|Registers|Hit Rate|Eligible|Waves" \
                    "$R/ncu-merge.txt" | tail -80 ;;
    mergesweep)   # Merge tiles against the plan's (no tests): whole balanced steps.
                  timeout 400 python3 bench/experiments/merge_tiles.py --heads ${MERGE_HEADS:-128} \
                    ${MERGE_TILES:+--tiles $MERGE_TILES} \
                    --mixes ${MERGE_MIXES:-spread-8k long-among-short uniform-1024} \
                    --out "$R" > "$R/merge-sweep.log" 2>&1
                  tail -20 "$R/merge-sweep.log" ;;
    rows32)       # 32 query rows (32 heads, 16 heads x 2 tokens): 32-row against 64-row
                  # programs, bf16 and both fp8 formats (whether the planner should switch).
                  timeout 400 python3 bench/experiments/rows32_route.py --out "$R" \
                    > "$R/rows32.log" 2>&1; tail -30 "$R/rows32.log" ;;
    ncuseesaw)    # Nsight Compute: the bf16 seesaw at 128 heads (8 x 64K): where its warps stall,
                  # how busy the tensor pipe and the schedulers are.
                  command -v ncu > /dev/null || { echo "ncu: not installed"; continue; }
                  timeout 240 ncu -k regex:^seesaw_stage1 -c 2 --section SpeedOfLight \
                    --section WarpStateStats --section ComputeWorkloadAnalysis \
                    --section SchedulerStats --section InstructionStats --section Occupancy \
                    python3 bench/ncu_stage1.py > "$R/ncu-seesaw-bf16.txt" 2>&1
                  grep -E "Duration|Throughput|Stall|Issue|Pipe|Eligible|Active Warps|Registers" \
                    "$R/ncu-seesaw-bf16.txt" | tail -60
                  # Every stall reason's share, then the stalls per SASS instruction (the
                  # source page of one profiled launch, as CSV).
                  timeout 200 ncu -k regex:^seesaw_stage1 -c 1 --metrics \
                    "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
                    python3 bench/ncu_stage1.py > "$R/ncu-seesaw-bf16-stalls.txt" 2>&1
                  grep -E "stalled" "$R/ncu-seesaw-bf16-stalls.txt" | sort -k3 -g -r | head -25
                  timeout 240 ncu -k regex:^seesaw_stage1 -c 1 --section SourceCounters \
                    --section WarpStateStats -f -o "$R/ncu-seesaw-bf16" python3 bench/ncu_stage1.py \
                    > /dev/null 2>&1 \
                    && ncu -i "$R/ncu-seesaw-bf16.ncu-rep" --page source --csv --print-source sass \
                      > "$R/ncu-seesaw-bf16-sass.csv" 2>&1
                  rm -f "$R/ncu-seesaw-bf16.ncu-rep"; wc -l "$R/ncu-seesaw-bf16-sass.csv" ;;
    seesawverify) # Verify steps on the seesaw (under trial): float64 tests, then the timing
                  # against the Triton verify step and the q_len 1 step.
                  workers=(); python3 -c "import xdist" 2>/dev/null && workers=(-n 8)
                  timeout 360 python3 -m pytest -q "${workers[@]}" tests/test_seesaw.py -m gpu \
                    -k verify_step \
                    -p no:cacheprovider > "$R/seesaw-verify-tests.log" 2>&1
                  tail -3 "$R/seesaw-verify-tests.log"
                  timeout 240 python3 bench/experiments/seesaw_verify.py --out "$R" \
                    > "$R/seesaw-verify.log" 2>&1; tail -14 "$R/seesaw-verify.log" ;;
    seesawrows)   # Live rows on the 16-head seesaw (q_len 1, 2, 4 on the same programs): lazy and
                  # eager rescale, L2-resident pages, stage 1 alone.
                  timeout 240 python3 bench/experiments/seesaw_rows.py ${SEESAW_ROWS_ARGS:-} --out "$R" \
                    > "$R/seesaw-rows.log" 2>&1; tail -8 "$R/seesaw-rows.log" ;;
    ncurows)      # Nsight Compute over the seesaw at q_len 1 and 4, 16 heads, 64 x 4K.
                  command -v ncu > /dev/null || { echo "ncu: not installed"; continue; }
                  timeout 240 ncu -k regex:seesaw_stage1 -c 4 --section SpeedOfLight \
                    --section WarpStateStats --section InstructionStats --section SchedulerStats \
                    --section MemoryWorkloadAnalysis --section LaunchStats \
                    python3 bench/experiments/seesaw_rows.py --ncu > "$R/ncu-seesaw-rows.txt" 2>&1
                  grep -E "^  [a-z_]+.*\(|Duration|Throughput|Stall|Issue|Executed Ipc|Instructions|Eligible|Hit Rate" \
                    "$R/ncu-seesaw-rows.txt" | head -90 ;;
    tpothf) if [ -d .whl/hf ]; then
              python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
                --upgrade --target /tmp/hf .whl/hf/*.whl > /dev/null 2>&1
              export PYTHONPATH=/tmp/hf${PYTHONPATH:+:$PYTHONPATH}
            fi
            timeout 200 python3 -m pytest -q tests/test_transformers_adapter.py -m gpu \
              -p no:cacheprovider > "$R/hf-tests.log" 2>&1; tail -3 "$R/hf-tests.log"
            timeout 300 python3 bench/tpot.py --model bench.hf_tpot:deepseek_v3 --layers 4 \
              --batches 1 8 --contexts 1024 4096 16384 65536 100000 --policies fixed-1 \
              fixed-max ladder --out "$R" > "$R/tpot-hf.log" 2>&1; tail -4 "$R/tpot-hf.log"
            python3 scripts/tpot_report.py --json "$R/h200-tpot-transformers.json" --force ;;
    stepkernels) timeout 500 python3 bench/experiments/step_kernels.py --out "$R" \
                   ${STEPKERNELS_ARGS:-} > "$R/step-kernels.log" 2>&1
                 tail -14 "$R/step-kernels.log" ;;
    hostphases) timeout 200 python3 bench/experiments/host_phases.py --out "$R" \
                  > "$R/host-phases.log" 2>&1; tail -30 "$R/host-phases.log" ;;
    selectcost) # The selector's host cost with the shipped ladders' two balanced graphs
                # against one, on this machine's host (no GPU work).
                timeout 200 python3 bench/experiments/select_cost.py --out "$R" \
                  > "$R/select-cost.log" 2>&1; tail -40 "$R/select-cost.log" ;;
    l2) timeout 200 python3 bench/l2_resident.py --out "$R" > "$R/l2.log" 2>&1
        tail -12 "$R/l2.log" ;;
    mtp) timeout 200 python3 bench/mtp_sweep.py --out "$R" > "$R/mtp.log" 2>&1
         tail -40 "$R/mtp.log" ;;
    sparse) timeout 180 python3 -m pytest -q tests/test_sparse.py tests/test_sparse_model.py \
              tests/test_index_prologue.py -p no:cacheprovider \
              > "$R/sparse-tests.log" 2>&1; tail -5 "$R/sparse-tests.log"
            timeout 300 python3 bench/sparse_sweep.py --out "$R" > "$R/sparse.log" 2>&1
            tail -30 "$R/sparse.log" ;;
    sparseab) timeout 200 python3 bench/indexer_ab.py --out "$R" > "$R/indexer-ab.log" 2>&1
              tail -25 "$R/indexer-ab.log"
              timeout 240 python3 bench/sparse_attention_ab.py --out "$R" > "$R/attn-ab.log" 2>&1
              tail -25 "$R/attn-ab.log" ;;
    tpotsparse) timeout 300 python3 bench/tpot_sparse.py --layers 2 --contexts 1024 16384 \
                  100000 131072 --policies fixed-1 fixed-max ladder seed-ladder --out "$R" \
                  > "$R/tpot-sparse.log" 2>&1; tail -30 "$R/tpot-sparse.log" ;;
    oracle) for ladder in ${ORACLE_LADDERS:?ORACLE_LADDERS="a.json b.json" names the ladders}; do
              name=$(basename "$ladder" .json); mkdir -p "$R/oracle-$name"
              timeout "${TUNE_LIMIT:-330}" python3 bench/ladder_oracle.py \
                --heads "${ORACLE_HEADS:-16}" --kv-cache "${ORACLE_KV:-bf16}" \
                --q-len "${ORACLE_Q:-1}" ${ORACLE_BATCHES:+--batches $ORACLE_BATCHES} \
                --ladder "$ladder" --out "$R/oracle-$name" > "$R/oracle-$name/oracle.log" 2>&1
              grep -A12 "^Worst" "$R/oracle-$name/oracle.log" | tail -10; pack
            done ;;
    capture) timeout 120 python3 bench/capture_dispatch.py --out "$R" > "$R/capture.log" 2>&1
             tail -20 "$R/capture.log" ;;
    tune) for h in ${TUNE_HEADS:-16 128 12}; do tune_one "$h" bf16 1; done ;;
    tunefp8) for h in ${TUNE_FP8_HEADS:-16}; do
               for fmt in ${TUNE_FP8:-fp8-tensor fp8-v32}; do tune_one "$h" "$fmt" 1; done; done ;;
    tunemtp) for hq in ${TUNE_MTP:-16:2 128:2 16:4 128:4}; do
               tune_one "${hq%:*}" bf16 "${hq#*:}"; done ;;
    tunesparse) tune_one 16 bf16 1 --sparse ;;
    retime) for hr in ${RETIME:-16:bench/results/h200-ladder-tune.json}; do
              TUNE_FROM=${hr#*:} tune_one "${hr%%:*}" bf16 1; done ;;
    tpotfp8) timeout 420 python3 bench/tpot.py --layers "${TPOT_LAYERS:-4}" --out "$R" \
               --kv-cache bf16 fp8-tensor fp8-v32 --policies fixed-1 ladder \
               > "$R/tpot-fp8.log" 2>&1; tail -5 "$R/tpot-fp8.log"
             python3 scripts/tpot_report.py --json "$R/h200-tpot-fp8.json" --force ;;
    tpotbatches) for preset in ${TPOT_PRESETS:-deepseek-v3-tp8 deepseek-v3-dp}; do
                   mkdir -p "$R/$preset"
                   timeout 280 python3 bench/tpot.py --preset "$preset" --layers 2 \
                     --batches 1 8 32 64 128 --contexts 256 4096 32768 131072 \
                     --policies fixed-1 fixed-max balanced-only ladder --out "$R/$preset" \
                     > "$R/tpot-batches-$preset.log" 2>&1; tail -3 "$R/tpot-batches-$preset.log"
                 done ;;
    tpotdp) timeout 480 python3 bench/tpot.py --preset deepseek-v3-dp --layers "${TPOT_LAYERS:-4}" \
              --contexts 1 1024 16384 65536 102400 131072 --batches 1 8 --out "$R" \
              > "$R/tpot-dp.log" 2>&1; tail -5 "$R/tpot-dp.log"
            python3 scripts/tpot_report.py --json "$R/h200-tpot-deepseek-v3-dp.json" --force ;;
    tpot) timeout 240 python3 bench/tpot.py --layers "${TPOT_LAYERS:-4}" --out "$R" \
            > "$R/tpot.log" 2>&1; tail -5 "$R/tpot.log"
          python3 scripts/tpot_report.py --json "$R/h200-tpot.json" --force ;;
    tpotmtp) timeout 540 python3 bench/tpot.py --layers "${TPOT_LAYERS:-4}" --out "$R" \
            --q-len 1 2 4 --policies eager fixed-1 fixed-max ladder \
            --contexts 64 1024 16384 65536 100000 131072 > "$R/tpot-mtp.log" 2>&1
          tail -5 "$R/tpot-mtp.log"
          for q in 1 2 4; do python3 scripts/tpot_report.py --json "$R/h200-tpot-mtp.json" \
            --q-len "$q" --no-png --force; done ;;
    stepahead) timeout 240 python3 -m pytest -q tests/test_step_ahead.py -p no:cacheprovider \
                 > "$R/step-ahead-tests.log" 2>&1; tail -3 "$R/step-ahead-tests.log"
               timeout 240 python3 bench/experiments/step_ahead.py --out "$R" \
                 > "$R/step-ahead.log" 2>&1; tail -8 "$R/step-ahead.log" ;;
    splitflip) timeout 200 python3 bench/experiments/split_flip.py --out "$R" \
                 > "$R/split-flip.log" 2>&1; tail -9 "$R/split-flip.log" ;;
    tp) NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
          timeout 300 python3 scripts/tp_decode.py --world-size 2 --out "$R" > "$R/tp.log" 2>&1
        tail -12 "$R/tp.log" ;;
    ragged) timeout 120 python3 bench/ragged.py --out "$R" > "$R/ragged.log" 2>&1
            tail -8 "$R/h200-ragged.md" ;;
    demo) timeout 240 python3 scripts/demo.py 2>&1 | tee "$R/demo.log" ;;
  esac
  pack
done
pack
