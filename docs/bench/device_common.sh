# Sourced by a session's device-call script (docs/bench/sNN/device/calls.sh), run in the tree's
# root on the device: the carried wheels into /tmp/site, the carried CUDA extension ($1, a
# stripped xz of the Python 3.12 build; SO overrides it), results under $OUT/r (and
# $OUT/r.tgz after every step), and `st NAME LIMIT CMD...`: one step with its time limit, its
# log in $R/NAME.log, its return code and time, and the log's last TAIL (6) lines.
R=$OUT/r; mkdir -p $R
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/strata_inductor
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
unxz -c ${SO:-$1} > strata/kernels/strata_cuda.cpython-312-x86_64-linux-gnu.so || exit 1
st() { local n=$1 l=$2; shift 2; local t0=$SECONDS; timeout $l "$@" > $R/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0)) s"; grep -v -i -E "warn|^$" $R/$n.log | tail -n ${TAIL:-6}; tar czf $OUT/r.tgz -C $OUT r; }
export PYTHONPATH=/tmp/site:$PWD
#: the full-depth FP8 runs' common flags (dummy weights, SYNTHETIC acceptance 0.8)
F="--preset qwen3_next_80b_a3b_fp8 --load-format dummy --synthetic-acceptance 0.8 --overlap on --no-reverse"
#: the embedded model's N=8 goal command (batch_mtp W16, 128 tokens, 8-slot prompt chunks, 3 repeats)
GOAL_N8="--configs batch_mtp_w16 --n 8 --max-tokens 128 --repeats 3 --overlap on --no-reverse --prefill-slots 8"
# The CPUs local to the (first) GPU, as a taskset list (all of them when sysfs does not say):
# nvidia-smi names its bus with an 8-digit domain (00000000:19:00.0), sysfs with a 4-digit one.
gpu_local_cpus() {
  local bus; bus=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader | head -1 | tr 'A-Z' 'a-z')
  cat /sys/bus/pci/devices/${bus: -12}/local_cpulist 2>/dev/null || echo "0-$(($(nproc --all) - 1))"
}
