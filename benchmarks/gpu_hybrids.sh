#!/usr/bin/env bash
# Hybrid families on one GPU, in phases (one device call each, the machine kept between them):
#
#   bash benchmarks/gpu_hybrids.sh pytorch WHEELS OUT     # transformers' PyTorch mixers (no fla)
#   bash benchmarks/gpu_hybrids.sh fla WHEELS OUT         # with fla (and tilelang on Hopper)
#   bash benchmarks/gpu_hybrids.sh exactness WHEELS OUT   # fla's route against each one alone
#
# Each phase installs the wheels of WHEELS (pip --no-index --no-deps into this Python):
#   pytorch: first bench_hybrids.py (packed-ce and the family's own packed row against every
#            conversation alone) and the CUDA tests of the mixers on the PyTorch route, then the
#            wheels (fla and what it needs but tilelang's solver, which the next call brings);
#   fla:     the rest of the wheels, then bench_trl.py --model qwen3_5-2b packed against stock
#            trl (with the host's stacks of every slow step, and Triton's autotuning printed)
#            and the CUDA tests of the mixers (the whole-row route through fla);
#   exactness: bench_hybrids.py on the fla route (packed-ce and the family's own packed row
#            against every conversation alone, float32 and bf16, on several rows; float32 again
#            with Triton's float32 dots in full precision).
# Logs go to OUT (<phase>_tests_<card>.log, <phase>_bench_<card>.log); the benchmarks write their
# JSON lines and tables into OUT too. Every step has a time limit.
set -u
phase=${1:?usage: bash benchmarks/gpu_hybrids.sh pytorch|fla WHEELS OUT}
wheels=${2:?wheels folder}
out=${3:?output folder}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9]\+' | tr A-Z a-z)
card=${card:-gpu}
pytest=(python3 -m pytest -q -p no:cacheprovider -m cuda -rA --tb=short -s)
install() { python3 -m pip install -q --no-index --no-deps "$wheels"/*.whl 2>&1 | tail -3; }
if [ "$phase" = pytorch ]; then
    timeout 150 python3 benchmarks/bench_hybrids.py --out "$out" >"$out/pytorch_bench_$card.log" 2>&1
    timeout 200 "${pytest[@]}" tests/test_mixers.py >"$out/pytorch_tests_$card.log" 2>&1
    install
elif [ "$phase" = fla ]; then
    install
    python3 -c "import fla, tilelang; print('fla', fla.__version__, 'tilelang', tilelang.__version__)"
    TRITON_PRINT_AUTOTUNING=1 timeout 360 python3 benchmarks/bench_trl.py --model qwen3_5-2b \
        --runs packed stock --warmup 5 --max-steps 10 --seconds 300 --sample-stacks --out "$out" \
        >"$out/fla_bench_$card.log" 2>&1
    timeout 150 "${pytest[@]}" tests/test_mixers.py >"$out/fla_tests_$card.log" 2>&1
elif [ "$phase" = exactness ]; then
    install
    # float32 then bf16 in one process (bf16 is read against the float32 truth), on
    # EXACTNESS_SAMPLES rows of the same shapes; then float32 with Triton's dots in full float32
    # (fla's run in TF32 on Hopper by default). With cold caches fla and tilelang compile for each
    # dtype and precision first, minutes each: a run cut short keeps the lines it wrote.
    timeout "${EXACTNESS_SECONDS:-500}" python3 benchmarks/bench_hybrids.py \
        --samples "${EXACTNESS_SAMPLES:-3}" --out "$out" >>"$out/fla_exactness_$card.log" 2>&1
    TRITON_F32_DEFAULT=ieee timeout "${EXACTNESS_SECONDS:-500}" python3 benchmarks/bench_hybrids.py \
        --dtypes float32 --out "$out" >>"$out/fla_exactness_$card.log" 2>&1
else
    echo "gpu_hybrids.sh: unknown phase $phase (pytorch, fla or exactness)" >&2
    exit 2
fi
for log in "$out"/*_"$card".log; do tail -n 5 "$log"; done
