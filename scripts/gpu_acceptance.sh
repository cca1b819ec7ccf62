#!/usr/bin/env bash
# The GPU acceptance runs, in two parts that each fit one device call (10 minutes: each part's
# step limits add up to under 600 s), with a time limit on every step so that one slow step
# cannot starve the rest. Results go to $OUT.
#
#   STRATA_COMMIT=<hash> bash scripts/gpu_acceptance.sh 1    # ~10 min: sim check
#   STRATA_COMMIT=<hash> bash scripts/gpu_acceptance.sh 1k   # ~3 min: kernel GPU tests
#   STRATA_COMMIT=<hash> bash scripts/gpu_acceptance.sh 2    # ~8 min: graph soak, reserves 700, 2048
#   STRATA_COMMIT=<hash> bash scripts/gpu_acceptance.sh 2b   # ~5 min: graph soak, reserve 4096; shape keys
#   STRATA_COMMIT=<hash> bash scripts/gpu_acceptance.sh 2s   # ~2 min: graphs vs eager, one run
#   STRATA_COMMIT=<hash> bash scripts/gpu_acceptance.sh 3    # ~9 min: identity, engine grid, host profile,
#                                                            #   server bench (re-measure)
#   STRATA_COMMIT=<hash> bash scripts/gpu_acceptance.sh 6    # ~9 min: realistic scale (FP8 80B shapes)
#   STRATA_COMMIT=<hash> bash scripts/gpu_acceptance.sh 4    # ~9 min: engine.batch_invariant, bf16 text
#                                                            #   and cost
#   STRATA_COMMIT=<hash> bash scripts/gpu_acceptance.sh 5    # ~5-7 min: sim transfer check (new workload,
#                                                            #   quick calibration, both presets)
#   STRATA_COMMIT=<hash> bash scripts/gpu_acceptance.sh 7    # ~9 min: engine.overlap: identity, the tiny
#                                                            #   grid and window breakdown off and on
#   STRATA_COMMIT=<hash> bash scripts/gpu_acceptance.sh 9    # ~10 min, two GPUs: engine.stages=2, the
#                                                            #   identity tests, then full-depth bf16
#                                                            #   batch_mtp with one group (PIPE=off)
#
# STRATA_COMMIT names the commit in the results (the device's copy of the tree may carry a
# stale .git). Every step prints one summary line; see docs/GPU_RUNBOOK.md for what each feeds.
set -u
part=${1:?usage: gpu_acceptance.sh 1|1k|2|2b|2s|3|4|5|5c|6|7|7c|8|8b|9}
OUT=${OUT:?set OUT to the results directory}
export PYTHONUNBUFFERED=1
# The device tool brings back at most 8 files from $OUT: every log and result goes under $R
# (outside $OUT) and is packed into $OUT/results.tgz after each step, so a call cut by its limit
# still returns all that finished.
R=${STRATA_RESULTS:-/tmp/strata_results}/r; mkdir -p "$R"
# torch.compile's cache in a fixed place: the steps of a call share it, and so do calls that
# find the machine still warm. (Carrying it between machines was tried: a part's cache is far
# over the 16 MB a returned file may have.)
export TORCHINDUCTOR_CACHE_DIR=/tmp/strata_inductor
pack() {  # into a part file, then renamed: a call cut while packing keeps the last archive
  tar -czf "$OUT/results.tgz.part" -C "$(dirname "$R")" r && mv -f "$OUT/results.tgz.part" "$OUT/results.tgz"
}
step() {  # step NAME SECONDS CMD...: run with a limit, log to $R/NAME.log, say how it ended
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$R/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc ($((SECONDS - t0)) s of $limit)"
  grep -v -i -E "warn|Loading weights|^\[transformers\]|softmax|^$" "$R/$name.log" | tail -n "${TAIL:-6}"
  pack
}
# Carried extensions (built here for the device's Python) are used when they import; else build
# them (about 70 s), as a step of its own.
if python3 -c "import strata.kernels.strata_cuda" 2>/dev/null; then
  echo "== build: the carried extensions import"
else
  step build 150 python3 setup.py build_ext --inplace -q
fi
case $part in
1)  # the simulator's held-out check (issue 7)
  # The warm-up engines compile every window shape (about 2-3 min on a bare machine), then
  # 36 engines of 1-2 s to start, each a closed loop of 48 prompts. The predictions run
  # afterwards, here: on the device the simulator runs took over the 40 s they had.
  step sim_check 470 python3 scripts/sim_gpu_check.py --out "$R/simchk"
  ;;
1k)  # the kernels' GPU tests (issue 6)
  step gpu_kernels 100 python3 -m pytest -q -x -m gpu tests/test_kernels_gpu.py
  ;;
2|2b)  # the graph soaks (issue 5): 10,000 windows and 500 layouts at each reserve (2: 700 and
    # 2048 MiB; 2b: 4096 MiB, then shape keys). Compiled regions off: the soak is of the graph
    # cache and device memory, and compiling every layout's window shape first took 197 s of
    # an H200 call. Uncompiled captures cost about 45 ms each, and a reserve
    # needs about 2,800 of them: two reserves per call.
  if [ "$part" = 2 ]; then reserves=700,2048; limit=460; else reserves=4096; limit=250; fi
  step soak_layout_$part $limit python3 scripts/soak_graphs.py --reserves $reserves --graph-keys layout \
      --windows 10000 --min-layouts 500 --max-seconds 200 --compile off --warm-windows 100 \
      --json "$R/soak_layout_$part.json"
  if [ "$part" = 2b ]; then
    step soak_shape 60 python3 scripts/soak_graphs.py --reserves 2048 --graph-keys shape \
        --windows 5000 --min-layouts 1 --max-seconds 20 --compile off --warm-windows 50 \
        --json "$R/soak_shape.json"
  fi
  ;;
2s)  # issue 5's speed point, side by side in one run: solo decode with graphs and eagerly, and
    # batch_mtp at N = 4 and 8 with graphs and eagerly (goal: graphs at least 5x eager)
  TAIL=16 step graphs_vs_eager 150 python3 scripts/bench_engine.py --n 1,4,8 \
      --configs solo,solo_eager,batch_mtp,batch_mtp_eager --repeats 1 --no-reverse --max-tokens 128 \
      --json "$R/graphs_vs_eager.json" --md "$R/graphs_vs_eager.md"
  ;;
3)  # re-measure (issues 4, 6, 8): identity on every backend, engine grid, where the host's
    # time goes between windows, server bench
  step gpu_identity 50 python3 -m pytest -q -x -m gpu tests/test_engine_backends.py
  TAIL=10 step engine 200 python3 scripts/bench_engine.py --n 1,2,4,8 \
      --configs solo,batch,batch_mtp,batch_mtp_w16 --repeats 3 --max-tokens 256 --hf \
      --json "$R/engine.json" --md "$R/engine.md"
  # (50 s was too few: the new process compiles its window shapes first)
  TAIL=40 step host_profile 100 python3 scripts/step_breakdown.py --n 8 --configs batch_mtp_w16 \
      --profile-host 30 --json "$R/host_profile.json"
  TAIL=14 step serve 150 python3 scripts/bench.py --device cuda --dtype bfloat16 \
      --configs solo,batch,batch_mtp --n 1,2,4,8 --repeats 1 --warmup full --no-progress \
      --out "$R/serve"
  ;;
4)  # engine.batch_invariant in bf16: greedy text against solo_inv (the first config) in every
    # mode, with graphs and eagerly, and its cost against batch_mtp and solo; then at W16 and N=8,
    # where plain batch_mtp's text differed in bf16. First the kernel property it
    # rests on: fixed split-K chunks make a row's attention independent of its window.
  step invariant_kernel 60 python3 -m pytest -q -m gpu tests/test_kernels_gpu.py -k fixed_splits
  # N = 4 and 8 (at N = 1 every mode runs the same solo window); about 2 min of it compiles
  TAIL=16 step invariant_w8 280 python3 scripts/bench_engine.py --n 4,8 \
      --configs solo_inv,batch_inv,batch_mtp_inv,batch_mtp_eager_inv,batch_mtp,solo --repeats 1 \
      --no-reverse --max-tokens 256 --json "$R/invariant_w8.json" --md "$R/invariant_w8.md"
  TAIL=12 step invariant_w16 150 python3 scripts/bench_engine.py --n 8 --window-rows 16 \
      --configs solo_inv,batch_mtp_inv,batch_mtp --repeats 1 --no-reverse --max-tokens 256 \
      --json "$R/invariant_w16.json" --md "$R/invariant_w16.md"
  ;;
5)  # the simulator on a workload its profile never saw (issue 21): code-prompt cohorts (64-token
    # prompts, 256 output tokens) at the engine's served defaults, acceptance learned from 8
    # other prompts, a quick calibration on the compiled model (its two passes between the
    # cohort repeats), then predictions from the shipped preset and the calibrated one with
    # their ranges. Most of a bare machine's time is the first compile (281 s in all at
    # 4f4e7c5 with a one-pass calibration; ~330 s now); the table is written as soon as the
    # shipped predictions are in.
  TAIL=32 step sim_transfer "${SIM_TRANSFER_S:-480}" python3 scripts/sim_transfer_check.py \
      --device cuda --out "$R/transfer"
  ;;
5c)  # part 5 in a shorter limit, then the expert cache's GPU checks (issue 17): the miss path in
    # a captured graph against all-resident, and the miss path's bandwidth against pinned copies
  TAIL=32 step sim_transfer 400 python3 scripts/sim_transfer_check.py --device cuda --out "$R/transfer"
  step gpu_expert_cache 60 python3 -m pytest -q -x -m gpu tests/test_expert_cache_gpu.py
  TAIL=20 step expert_bandwidth 50 python3 scripts/bench_expert_cache.py --part bandwidth --layers 4 \
      --json "$R/expert_bandwidth.json"
  ;;
6)  # realistic scale (issue 16): the kernels' GPU tests, where an 8-layer FP8 window's time goes,
    # full-depth FP8 Qwen3-Next-80B-A3B shapes on dummy weights with synthetic acceptance 0.8
    # (warm-up time, then solo spec 2, batch and batch_mtp), and bf16 at 12 layers against
    # transformers' generate() (both models must fit at once). SYNTHETIC: random weights.
  step gpu_moe 60 python3 -m pytest -q -m gpu tests/test_moe_kernels.py tests/test_sampler_compile.py
  TAIL=30 step profile_fp8_l8 60 python3 scripts/profile_window.py --model qwen3-next-80b-a3b-fp8 \
      --load-format dummy --layers 8 --backend auto --groups 4 --rows 2 --iters 20 \
      --json "$R/profile_fp8_l8.json"
  TAIL=24 step fp8_full 280 python3 scripts/bench_engine.py --preset qwen3_next_80b_a3b_fp8 \
      --load-format dummy --synthetic-acceptance 0.8 --configs batch_mtp,batch,solo_spec2 \
      --n 1,2,8 --repeats 1 --no-reverse --max-tokens 64 --max-context 1024 \
      --json "$R/fp8_full.json" --md "$R/fp8_full.md"
  TAIL=16 step bf16_l12_hf 130 python3 scripts/bench_engine.py --preset qwen3_next_80b_a3b \
      --load-format dummy --layers 12 --dtype bfloat16 --synthetic-acceptance 0.8 \
      --configs solo_spec2,batch_mtp --n 1,4 --hf --repeats 1 --no-reverse --max-tokens 64 \
      --max-context 1024 --json "$R/bf16_l12_hf.json" --md "$R/bf16_l12_hf.md"
  ;;
7)  # overlapped host scheduling (issue 18): the same text with engine.overlap in every mode on
    # every backend; the tiny model's grid with overlap off and on side by side (each
    # configuration beside its NAME+overlap twin, greedy identity checked across them); where
    # a window's time goes both ways (under overlap `other` is the host time not hidden)
  step gpu_identity 60 python3 -m pytest -q -x -m gpu tests/test_engine_backends.py
  TAIL=30 step engine_overlap 300 python3 scripts/bench_engine.py --n 1,4,8 \
      --configs solo,batch_mtp,batch_mtp_w16 --overlap both --repeats 3 --max-tokens 256 \
      --json "$R/engine_overlap.json" --md "$R/engine_overlap.md"
  TAIL=14 step breakdown_overlap 130 python3 scripts/step_breakdown.py --n 1,8 \
      --configs solo,batch_mtp_w16 --overlap both --json "$R/breakdown_overlap.json"
  ;;
7c)  # part 7 in shorter limits (2 repeats), with the expert cache's GPU test first
  step gpu_identity 60 python3 -m pytest -q -x -m gpu tests/test_engine_backends.py
  step gpu_expert_cache 110 python3 -m pytest -q -x -m gpu tests/test_expert_cache_gpu.py
  TAIL=30 step engine_overlap 230 python3 scripts/bench_engine.py --n 1,4,8 \
      --configs solo,batch_mtp,batch_mtp_w16 --overlap both --repeats 2 --max-tokens 256 \
      --json "$R/engine_overlap.json" --md "$R/engine_overlap.md"
  TAIL=14 step breakdown_overlap 100 python3 scripts/step_breakdown.py --n 1,8 \
      --configs solo,batch_mtp_w16 --overlap both --json "$R/breakdown_overlap.json"
  ;;
8)  # the expert cache's study (issue 17), 8 layers of the FP8 80B-A3B shapes, SYNTHETIC weights
    # with routing skew 1.0 and synthetic acceptance 0.8: no cache, then budgets holding 100, 75,
    # 44 and 25% of the routed experts (the lower ones filled from the 100% run's routing
    # profile), solo / batch / batch_mtp at N=1,2,4,8. The JSON is rewritten after every engine,
    # so a cut run keeps its rows; 8b finishes a cut study and runs the GPU test.
  TAIL=70 step expert_study 500 python3 scripts/bench_expert_cache.py --part study --layers 8 \
      --skew 1.0 --json "$R/expert_study.json"
  ;;
8b)  # the expert cache's GPU test (the miss path in a captured graph; its engine case compiles),
    # then the study's lower budgets when 8 was cut (STUDY_PROFILE: the profile 8 wrote)
  step gpu_expert_cache 200 python3 -m pytest -q -x -m gpu tests/test_expert_cache_gpu.py
  if [ -n "${STUDY_BUDGETS:-}" ]; then
    TAIL=40 step expert_study_b 300 python3 scripts/bench_expert_cache.py --part study --layers 8 \
        --skew 1.0 --budgets "$STUDY_BUDGETS" --no-baseline --profile "$STUDY_PROFILE" \
        --json "$R/expert_study_b.json"
  fi
  ;;
9)  # the layer split (issue 19) on the two-GPU machine: the tokens of one GPU with stages=2
    # (compile off, pipelined groups and each stage's CUDA graphs; the compiled cases take
    # minutes), then full-depth bf16
    # Qwen3-Next-80B-A3B shapes (SYNTHETIC dummy weights, acceptance 0.8) on two stages,
    # batch_mtp at N=1,2,4,8 with PIPE (off, on or off,on) and the hand-off per window shape;
    # STAGE_GRAPHS=false runs the split eagerly (engine.stage_graphs off, CUDA's default today).
  if [ -z "${SKIP_STAGE_TESTS:-}" ]; then
    step gpu_stages 240 python3 -m pytest -q -x tests/test_stages_gpu.py -k "off or pipelined or graphs"
  fi
  TAIL=40 step stages_bench "${STAGES_S:-330}" python3 scripts/bench_stages.py \
      --preset qwen3_next_80b_a3b --load-format dummy --stages 2 --configs "${STAGE_CONFIGS:-batch_mtp}" \
      --n "${STAGE_N:-1,2,4,8}" --pipeline "${PIPE:-off}" --synthetic-acceptance 0.8 --repeats 1 \
      --max-tokens 64 --prefill-buckets 64 --graphs "${STAGE_GRAPHS:-true}" \
      --json "$R/stages_${PIPE:-off}.json"
  ;;
esac
