#!/usr/bin/env bash
# Session 50's device calls (the extension of .dev/s49: cyext/src has not changed since), with
# the tree's two Python changes A/B (VERS, default "before after": .dev/s50/before holds
# strata/model/qwen3_next.py and strata/engine/stages.py as at 736aef2, .dev/s50/after this
# tree's: the fused dense MoE weight padded to a multiple of 8 rows, the window's embedding
# as one gather):
#   n8   full-depth FP8 80B shapes (LAYERS, 48 on an H200), batch_mtp W16 N=8 with and without
#        engine.draft_vocab=32768, 64-token prompts and outputs (the goal row; this tree)
#   td   the embedded model, solo and batch_mtp W16 at N=1 and 8, 256 tokens, 3 repeats
#   tg   the embedded model, the N=8 goal command (128 tokens, 8-slot prompt chunks)
#   pt   compiled window profiles of the embedded model, 8 x 2 and 1 x 4 (this tree)
#   fw   full-depth (LAYERS) solo spec 4, model.fp8_dense=auto then windows (the wide input
#        projections FP8 in windows too), 256 tokens, 2 repeats each
#   fn   the same A/B at batch_mtp W16 N=8 (64-token prompts and outputs, 8-slot chunks)
set -u
export SO=${SO:-.dev/s49/new_cuda.so.xz}
. docs/bench/device_common.sh $SO
L="--layers ${LAYERS:-24}"; [ "${LAYERS:-24}" = 48 ] && L=
use() { cp .dev/s50/$1/strata/model/qwen3_next.py strata/model/; cp .dev/s50/$1/strata/engine/stages.py strata/engine/; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $R/gpu.txt
for s in "$@"; do case $s in
n8)
  use after
  TAIL=10 st n8 280 python3 scripts/bench_engine.py $F $L --configs batch_mtp_w16,batch_mtp_w16_draft32k --n 8 --max-tokens 64 --repeats 2 --json $R/n8.json
  grep -h "warm-up: \|window 8x2@256\|prompt chunk" $R/n8.log | cut -c1-160 ;;
td) for v in ${VERS:-before after}; do use $v
  TAIL=7 st td_$v 200 python3 scripts/bench_engine.py --configs solo,batch_mtp_w16 --n 1,8 --prompt-tokens 64 --max-tokens 256 --overlap on --repeats 3 --no-reverse --json $R/td_$v.json
  grep -h "window 1x4@256\|window 8x2@256" $R/td_$v.log | cut -c1-140; done ;;
tg) for v in ${VERS:-before after}; do use $v
  TAIL=4 st tg_$v 150 python3 scripts/bench_engine.py --configs batch_mtp_w16 --n 8 --max-tokens 128 --repeats 3 --overlap on --no-reverse --prefill-slots 8 --json $R/tg_$v.json; done ;;
fw) use after; for d in auto windows; do
  TAIL=4 st fw_$d 200 python3 scripts/bench_engine.py $F $L --configs solo --n 1 --max-tokens 256 --repeats 2 --fp8-dense $d --json $R/fw_$d.json
  grep -h "window 1x4@256\|prompt chunk" $R/fw_$d.log | cut -c1-140; done ;;
fn) use after; for d in auto windows; do
  TAIL=4 st fn_$d 200 python3 scripts/bench_engine.py $F $L --configs batch_mtp_w16 --n 8 --max-tokens 64 --repeats 2 --fp8-dense $d --json $R/fn_$d.json
  grep -h "window 8x2@256\|prompt chunk" $R/fn_$d.log | cut -c1-140; done ;;
pt) use after
  TAIL=3 st pt 150 python3 scripts/profile_window.py --backend auto --compile --iters 30 --shapes 8x2,1x4 --top 40 --json $R/pt.json
  grep -A14 "graph replay kernels" $R/pt.log | cut -c1-140 ;;
esac; done
use after
true
