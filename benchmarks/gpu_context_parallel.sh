#!/usr/bin/env bash
# Context parallelism on a machine with two CUDA GPUs, in one command:
#
#   bash benchmarks/gpu_context_parallel.sh DIR [cp-tests] [other-tests] [profile] [throughput]
#   (default: all four)
#
# Writes into DIR, <card> being h100 or h200:
#   context_parallel_tests_2x<card>.log        pytest -m cuda tests/test_context_parallel.py (both GPUs)
#   gpu_tests_attention_1x<card>.log           the other GPU tests of the attention and the
#   gpu_tests_trainers_2x<card>.log            trainers: integration and QLoRA on one GPU, DDP /
#                                              FSDP2 / ZeRO-3 on both (their packages installed)
#   context_parallel_profile_2x<card>.jsonl    bench_context_parallel.py --mode profile at 65,536
#                                              tokens: one GPU, two GPUs (SHARDINGS: balanced,
#                                              and zigzag with SHARDINGS="balanced zigzag")
#   context_parallel_throughput_2x<card>.jsonl --mode throughput: one GPU against two at 65,536
#                                              and 196,608 tokens
# Every phase has a time limit, so that the logs are written whatever happens.
set -u
out=${1:?usage: bash benchmarks/gpu_context_parallel.sh DIR [cp-tests] [other-tests] [profile] [throughput]}
shift
phases=${*:-cp-tests other-tests profile throughput}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9]\+' | tr A-Z a-z)
card=${card:-gpu}
bench=(benchmarks/bench_context_parallel.py --model 1b)
one() { CUDA_VISIBLE_DEVICES=$1 WORLD_SIZE=1 RANK=0 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 \
        MASTER_PORT=$((29600 + $1)) timeout "$2" python3 "${@:3}"; }
two() { timeout "$1" torchrun --nproc_per_node 2 --master_port 29700 "${@:2}"; }
pytest=(python3 -m pytest -q -p no:cacheprovider -m cuda -rA --tb=short)
header() {
    echo "# pytest -m cuda on 2x $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
    python3 -c "import torch, triton, transformers; print('# torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
}

if [[ $phases == *cp-tests* ]]; then
    log=$out/context_parallel_tests_2x$card.log
    header >"$log"
    timeout 420 "${pytest[@]}" tests/test_context_parallel.py >>"$log" 2>&1 &
fi
if [[ $phases == *other-tests* ]]; then
    log=$out/gpu_tests_attention_1x$card.log
    header >"$log"
    # one GPU visible: the Trainer would wrap a model in nn.DataParallel over two
    CUDA_VISIBLE_DEVICES=1 timeout 300 "${pytest[@]}" tests/test_integration_cuda.py tests/test_qlora.py \
        >>"$log" 2>&1 &
    log=$out/gpu_tests_trainers_2x$card.log
    header >"$log"
    timeout 300 "${pytest[@]}" tests/test_distributed.py >>"$log" 2>&1 &
fi
wait

if [[ $phases == *profile* ]]; then
    jsonl=$out/context_parallel_profile_2x$card.jsonl
    one 0 150 "${bench[@]}" --mode profile --lengths 65536 --warmup 2 --steps 2 --out "$jsonl"
    for sharding in ${SHARDINGS:-balanced}; do
        two 150 "${bench[@]}" --mode profile --sharding $sharding --lengths 65536 --warmup 2 --steps 2 \
            --out "$jsonl"
    done
fi >"$out/context_parallel_profile_2x$card.log" 2>&1

if [[ $phases == *throughput* ]]; then
    jsonl=$out/context_parallel_throughput_2x$card.jsonl
    # one GPU each, at the same time: 65,536 tokens on GPU 0, 196,608 on GPU 1
    one 0 150 "${bench[@]}" --mode throughput --lengths 65536 --warmup 2 --steps 6 --out "$jsonl" &
    one 1 200 "${bench[@]}" --mode throughput --lengths 196608 --warmup 1 --steps 4 --out "$jsonl" &
    wait
    two 150 "${bench[@]}" --mode throughput --lengths 65536 --warmup 2 --steps 6 --out "$jsonl"
    two 200 "${bench[@]}" --mode throughput --lengths 196608 --warmup 1 --steps 4 --out "$jsonl"
fi >"$out/context_parallel_throughput_2x$card.log" 2>&1

tail -n 4 "$out"/*.log
cat "$out"/*.jsonl 2>/dev/null
