#!/usr/bin/env bash
# The set-ups that need GPUs, in one command on a machine with two CUDA GPUs (about 9 minutes on
# two H100s), with trl, datasets, peft, bitsandbytes and deepspeed installed:
#
#   bash benchmarks/gpu_setups.sh DIR
#
# Writes into DIR one log per set-up, named <set-up>_<GPUs>gpu_<card>.log (the names
# benchmarks/results/ keeps them under):
#   qlora_1gpu_<card>.log          tests/test_qlora.py on one GPU: PackedSFTTrainer on a 4-bit base
#   distributed_2gpu_<card>.log    tests/test_distributed.py: both trainers and LoRA under DDP,
#                                  FSDP2 and DeepSpeed ZeRO-3 (LoRA: DDP and FSDP2)
#   trl_steps_1b_qlora_<card>.log  bench_trl.py --adapter qlora, 1B, packed then stock, then reversed
#   trl_steps_8b_qlora_<card>.log  the same at 8B (gradient checkpointing, fewer steps)
# and the benchmarks' JSON and tables in DIR/trl_qlora_results.tgz. The tests run first, on both
# GPUs; then the 1B benchmark on GPU 0 and the 8B one on GPU 1 at the same time. Every phase has
# a time limit (all of them together 9 minutes), so that the logs and the archive are written
# whatever happens.
set -u
out=${1:?usage: bash benchmarks/gpu_setups.sh DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9]\+' | tr A-Z a-z)
card=${card:-gpu}
work=$(mktemp -d)
deadline=$(($(date +%s) + 540))  # the whole script, so that the logs are written in any case
pytest=(python3 -m pytest -q -p no:cacheprovider -m cuda -s)

# the QLoRA test on GPU 0 beside the two-GPU tests (tiny models: neither slows the other)
CUDA_VISIBLE_DEVICES=0 timeout 200 "${pytest[@]}" tests/test_qlora.py \
    >"$out/qlora_1gpu_$card.log" 2>&1 &
timeout 240 "${pytest[@]}" -rA --tb=short tests/test_distributed.py \
    >"$out/distributed_2gpu_$card.log" 2>&1
wait

# whole trl steps, packed against stock, in both orders (one invocation each). The 4-bit runs
# save the random bf16 weights once and load them back quantized: under /dev/shm where it can
# hold the 8B model's 16 GB (a disk write of that size takes minutes on some machines)
if [ "$(df --output=avail -B1G /dev/shm 2>/dev/null | tail -1)" -ge 40 ] 2>/dev/null; then
    export TMPDIR=/dev/shm
fi
bench() {  # bench GPU LOG RUN_SECONDS ARGS...: both orders, each invocation within the deadline
    local gpu=$1 log=$2 run=$3 order left
    shift 3
    for order in "" --reverse; do
        left=$((deadline - $(date +%s)))
        if [ $((left - run)) -lt 1 ]; then
            echo "gpu_setups: no time left for the runs ${order:-in order}"
            continue
        fi
        # no run starts later than one run's time (RUN_SECONDS) before the deadline
        CUDA_VISIBLE_DEVICES=$gpu timeout "$left" python3 benchmarks/bench_trl.py \
            --adapter qlora --runs packed stock $order --seconds $((left - run)) \
            --out "$work/${log}${order:+_reversed}" "$@"
    done >"$out/$log.log" 2>&1
}
bench 0 "trl_steps_1b_qlora_$card" 60 --model 1b &
bench 1 "trl_steps_8b_qlora_$card" 110 --model 8b --gradient-checkpointing --warmup 2 \
    --max-steps 6 &
wait
tar -czf "$out/trl_qlora_results.tgz" -C "$work" .
tail -n 3 "$out"/*.log
