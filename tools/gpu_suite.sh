#!/usr/bin/env bash
# The GPU suites, run from the repo root on the device machine, each within a 10-minute command:
#   `FLA=1 REST=0 bash tools/gpu_suite.sh` (once; ~6 min): fla-core autotunes its kernels (once per shape key, not
#   per T) into its own triton cache folder; the *.autotune.json entries come back packed as $OUT/fla_autotune.tgz:
#   keep them as .gpu/fla_autotune.tgz and carry that file from then on;
#   `KDA=1 REST=0 bash tools/gpu_suite.sh` (~3 min): the CUDA KDA kernel tests, then benchmarks/bench_kda.py in one
#   run: ours (both gates), SDPA and — with .gpu/fla_autotune.tgz carried — fla-core at every size, plus the
#   1M-token forwards;
#   `MODEL=1 REST=0 MODEL_BENCH_S=0 bash tools/gpu_suite.sh` (~7 min): the CUDA tests of the model's fused path,
#   torch.compile and offsets past 2^31; `MODEL=1 REST=0 MODEL_TEST_S=0 ...` (~6 min): benchmarks/bench_model.py
#   (ours against fla's model; MODEL_ROWS picks rows, MODEL_PROFILE / MODEL_MEMORY the rows profiled / broken down
#   by memory, MODEL_PRECISION=amp fp32 weights under bf16 autocast as kdamoe-train runs them, MODEL_ALT="NAME=DIR
#   ..." other model folders in the same run, carried in alt/), fla's autotuning packed again (a limit of 0 skips a
#   part);
#   `DECODE=1 REST=0 DECODE_BENCH_S=0 bash tools/gpu_suite.sh`: the CUDA tests of the static cache, the decode steps
#   replayed as CUDA graphs and the fused decode kernel; `DECODE=1 REST=0 DECODE_TEST_S=0 ...`:
#   benchmarks/bench_decode.py (DECODE_MODELS, DECODE_CONTEXTS, DECODE_BATCHES,
#   DECODE_MAX_PREFILL narrow it);
#   `STEP=1 REST=0 STEP_ALT="NAME=DIR ..." bash tools/gpu_suite.sh` (~1 min a model folder): benchmarks/profile_step.py
#   on the `small` preset's step (its wall time against its GPU kernels' time: where the host binds), this code and
#   each model folder of STEP_ALT (carried in alt/) interleaved, twice (STEP_ARGS: other profile_step.py shapes);
#   `PROFILE=1 REST=0 ...`: benchmarks/profile_ops.py (kernel tables, ours vs fla-core; autotunes fla again);
#   `SDPA=1 REST=0 ...` (~2 min): benchmarks/bench_sdpa.py, the attention layers' kernels at the hybrid's shapes
#   (SDPA_SHAPES narrows them);
#   `LONG=1 REST=0 bash tools/gpu_suite.sh` (~8 min; carry .gpu/tok32k and .gpu/fla_autotune.tgz): million-token
#   contexts, each part under its own limit (LONG_TEST_S, LONG_BENCH_S, LONG_TRAIN_S, LONG_LOCALIZE_S, LONG_EVAL_S;
#   0 skips it; LONG_PARTS narrows the benchmark's parts):
#   tests/test_long_context.py (a 1M-token prefill and 32 cached decode steps per kind of config),
#   benchmarks/bench_long_context.py (1M prefill of the twin and the hybrid MoE, SDPA alone, decode after 4K vs 1M,
#   the twin's 1M training step against fla's), the `small` preset trained 8K -> 64K -> 256K -> 1M
#   (configs/small_staged_1m.json), tools/localize_nonfinite.py on it in bf16 (LONG_LOCALIZE_S) and kdamoe-eval of
#   it up to 1M tokens; all printed to $OUT/long.log;
#   `ABLATE=1 REST=0 ABLATE_FACTORS=router_balancing ABLATE_SEEDS=0 bash tools/gpu_suite.sh` (carry .gpu/tok8k:
#   kdamoe-tokenizer --vocab-size 8192 --output-dir .gpu/tok8k): one job of the H200 ablation, its results.json and
#   report.md in $OUT/ablate_<factors>_<seeds>/ (with benchmarks/balance_floor.py on its quantile runs: the floor of
#   MaxVio_batch at fixed weights, FLOOR_S; ABLATE_CONFIG another base config, e.g. a Quantile Balancing variant);
#   `kdamoe-ablate --merge` of the jobs' folders makes the report;
#   `bash tools/gpu_suite.sh` (REST, ~5 min): CUDA-only MoE tests, benchmarks/bench_moe.py, a short `small`-preset
#   training run for tokens/s and MFU, and a torch.profiler table of one `small` training step
#   (benchmarks/profile_step.py).
# Carries: .whl (datasets, dill, multiprocess, fla-core wheels) and .gpu/tok32k (a BPE trained here, so no device
# time goes to tokenizer training; make it here first with
#   kdamoe-tokenizer --vocab-size 32768 --max-chars 20000000 --output-dir .gpu/tok32k). Results land in $OUT.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PYTHONPATH:/tmp/site
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"

if [ "${KDA:-0}" = 1 ]; then
  echo "== CUDA KDA kernel tests"
  python3 -m pytest -q tests/test_kda_triton.py 2>&1 | tail -5
  impls=ours-bounded,ours-softplus,sdpa
  if [ -f .gpu/fla_autotune.tgz ]; then  # fla-core's tuned configs: it then runs in seconds, not minutes
    mkdir -p ~/.triton/cache && tar xzf .gpu/fla_autotune.tgz -C ~/.triton/cache && impls=$impls,fla-bounded
  fi
  echo "== bench_kda ($impls)"
  python3 benchmarks/bench_kda.py --impls "$impls" --out "$OUT/bench_kda.json" 2>&1 \
    | tee "$OUT/bench_kda.log" | tail -20
fi
if [ "${MODEL:-0}" = 1 ]; then
  [ -f .gpu/fla_autotune.tgz ] && mkdir -p ~/.triton/cache && tar xzf .gpu/fla_autotune.tgz -C ~/.triton/cache
  if [ "${MODEL_TEST_S:-420}" != 0 ]; then
    echo "== CUDA tests of the model's fused path, torch.compile, offsets past 2^31"
    timeout "${MODEL_TEST_S:-420}" python3 -m pytest -q ${MODEL_TESTS:-tests/test_model_fused.py tests/test_fused_ops.py \
      tests/test_attnres.py tests/test_loss.py tests/test_compile.py tests/test_large_offsets.py} 2>&1 | tail -8
  fi
  if [ "${MODEL_BENCH_S:-330}" != 0 ]; then
    echo "== bench_model (ours against fla's KDAForCausalLM, one process)"
    timeout "${MODEL_BENCH_S:-330}" python3 benchmarks/bench_model.py --rows "${MODEL_ROWS:-dense,attnres,packed,moe,moe_packed}" \
      --steps 6 --warmup 2 --profile "${MODEL_PROFILE:-attnres}" --memory "${MODEL_MEMORY:-dense}" \
      --precision "${MODEL_PRECISION:-bf16}" $(for alt in ${MODEL_ALT:-}; do printf -- '--alt %s ' "$alt"; done) \
      --out "$OUT/model_h200.json" 2>&1 \
      | grep -v -i warn | tee "$OUT/bench_model.log" | tail -25
  fi
  (cd ~/.triton/cache && find . -name "*.autotune.json" | tar czf "$OUT/fla_autotune.tgz" -T -)
fi
if [ "${STEP:-0}" = 1 ]; then
  echo "== the small preset's step, wall against kernels (profile_step.py): this code and STEP_ALT interleaved"
  for round in 1 2; do
    for alt in this=src ${STEP_ALT:-}; do
      name=${alt%%=*} path=$PWD/src
      if [ "$name" != this ]; then  # the package with the alt model folder in place of its own
        path=/tmp/step_$name && rm -rf "$path" && mkdir -p "$path" && cp -r src/kdamoe "$path/" \
          && rm -rf "$path/kdamoe/model" && cp -r "${alt#*=}" "$path/kdamoe/model"
      fi
      PYTHONPATH=${PYTHONPATH/$PWD\/src/$path} timeout "${STEP_S:-90}" python3 benchmarks/profile_step.py \
        ${STEP_ARGS:---preset small --rows 16 --seq-len 2048} --warmup 3 --top 3 \
        --out "$OUT/step_${name}_$round.json" > "$OUT/step_${name}_$round.log" 2>&1
      python3 -c "import json; d = json.load(open('$OUT/step_${name}_$round.json')); print('$name', $round, \
f\"{d['step_ms']:.1f} ms wall, {d.get('kernel_ms', float('nan')):.1f} ms kernels, {d['aten_calls_per_step']} aten calls\")" \
        || tail -3 "$OUT/step_${name}_$round.log"
    done
  done
fi
if [ "${SDPA:-0}" = 1 ]; then
  echo "== bench_sdpa (the attention layers' kernels)"
  timeout "${SDPA_S:-300}" python3 benchmarks/bench_sdpa.py ${SDPA_SHAPES:+--shapes "$SDPA_SHAPES"} \
    --out "$OUT/sdpa.json" 2>&1 | grep -v -i warn | tee "$OUT/bench_sdpa.log" | grep "^|"
fi
if [ "${DECODE:-0}" = 1 ]; then
  [ -f .gpu/fla_autotune.tgz ] && mkdir -p ~/.triton/cache && tar xzf .gpu/fla_autotune.tgz -C ~/.triton/cache
  if [ "${DECODE_TEST_S:-420}" != 0 ]; then
    echo "== CUDA tests of the static cache, the decode graphs and the fused decode kernel"
    timeout "${DECODE_TEST_S:-420}" python3 -m pytest -q tests/test_static_cache.py tests/test_kda_decode.py \
      2>&1 | tail -8
  fi
  if [ "${DECODE_BENCH_S:-540}" != 0 ]; then
    echo "== bench_decode (static cache + CUDA graphs, the dynamic cache, fla's KDAForCausalLM; one process)"
    timeout "${DECODE_BENCH_S:-540}" python3 benchmarks/bench_decode.py --models "${DECODE_MODELS:-kda,hybrid}" \
      --contexts "${DECODE_CONTEXTS:-1024,32768,131072,1048576}" --batches "${DECODE_BATCHES:-1,16,64}" \
      --max-prefill-tokens "${DECODE_MAX_PREFILL:-16777216}" \
      --out "$OUT/bench_decode_h200.json" 2>&1 | grep -v -i warn | tee "$OUT/bench_decode.log" | tail -40
  fi
fi
if [ "${FLA:-0}" = 1 ]; then
  echo "== fla-core autotuning, packed to $OUT/fla_autotune.tgz"
  TRITON_CACHE_DIR=/tmp/fla-tc python3 benchmarks/bench_kda.py --skip-checks --no-million --impls fla-bounded \
    --out "$OUT/bench_kda_fla.json" 2>&1 | tee "$OUT/bench_kda_fla.log" | tail -12
  (cd /tmp/fla-tc && find . -name "*.autotune.json" | tar czf "$OUT/fla_autotune.tgz" -T -)
fi
if [ "${PROFILE:-0}" = 1 ]; then
  echo "== per-kernel tables (ours vs fla-core, MoE experts and block)"
  (cd benchmarks && python3 profile_ops.py --out "$OUT/profile_ops.json" 2>&1 | grep -v -i warn > "$OUT/profile_ops.log")
fi

if [ "${LONG:-0}" = 1 ]; then
  [ -f .gpu/fla_autotune.tgz ] && mkdir -p ~/.triton/cache && tar xzf .gpu/fla_autotune.tgz -C ~/.triton/cache
  export TQDM_DISABLE=1
  {
    if [ "${LONG_TEST_S:-120}" != 0 ]; then
      echo "== tests/test_long_context.py: 1M-token prefill, 32 cached decode steps, cached = uncached, per config"
      timeout "${LONG_TEST_S:-120}" python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_long_context.py \
        2>&1 | tail -30
    fi
    if [ "${LONG_BENCH_S:-180}" != 0 ]; then
      echo "== bench_long_context: 1M prefill, SDPA, decode after 4K vs 1M, 1M training step (ours, fla)"
      timeout "${LONG_BENCH_S:-180}" python3 benchmarks/bench_long_context.py --parts "${LONG_PARTS:-prefill,sdpa,decode,train}" \
        --out "$OUT/long_context.json" 2>&1 \
        | grep -v -i warn | tail -22
    fi
    if [ "${LONG_TRAIN_S:-150}" != 0 ]; then
      echo "== kdamoe-train --config configs/small_staged_1m.json: 8K -> 64K -> 256K -> 1M tokens a row"
      rm -rf /tmp/staged
      timeout "${LONG_TRAIN_S:-150}" python3 -m kdamoe.train --config configs/small_staged_1m.json \
        --tokenizer .gpu/tok32k --output-dir /tmp/staged 2>&1 | grep -v -i warn | tail -15
      cp /tmp/staged/metrics.jsonl "$OUT/staged_metrics.jsonl" 2>/dev/null
      cp /tmp/staged/final/training_info.json "$OUT/staged_info.json" 2>/dev/null
    fi
    if [ "${LONG_LOCALIZE_S:-150}" != 0 ] && [ -d /tmp/staged/final ]; then
      echo "== tools/localize_nonfinite.py: where the staged model's bf16 forward first turns non-finite (if it does)"
      timeout "${LONG_LOCALIZE_S:-150}" python3 tools/localize_nonfinite.py /tmp/staged/final --out /tmp/nonfinite \
        --dtype bfloat16 2>&1 | grep -v -i warn | tail -30
    fi
    if [ "${LONG_EVAL_S:-120}" != 0 ] && [ -d /tmp/staged/final ]; then
      # the whole corpus: its held-out split (390K tokens with tok32k) is shorter than one 1M-token row
      echo "== kdamoe-eval --max-context 1048576 of the staged model"
      timeout "${LONG_EVAL_S:-120}" python3 -m kdamoe.evaluate /tmp/staged/final --output-dir /tmp/staged_eval \
        --max-context 1048576 --split all --rows 4 --position-rows 1 --position-bins 16 \
        --passkey-lengths 65536,1048576 --passkey-depths 0.5 --passkey-trials 1 --speed-lengths 65536,1048576 \
        --decode-tokens 16 --no-progress --no-plots 2>&1 | grep -v -i warn | tail -6
      cp /tmp/staged_eval/eval.json "$OUT/staged_eval.json" 2>/dev/null
    fi
  } 2>&1 | tee "$OUT/long.log"
fi

if [ "${ABLATE:-0}" = 1 ]; then
  # one job of the H200 ablation (configs/ablate_h200.json): ABLATE_FACTORS x ABLATE_SEEDS, with the 8K BPE carried in
  # .gpu/tok8k so that every job trains on the same tokens; `kdamoe-ablate --merge` joins the jobs' results.json
  name=ablate_${ABLATE_FACTORS:-router_balancing}_${ABLATE_SEEDS:-0}${ABLATE_CONFIG:+_$(basename "$ABLATE_CONFIG" .json)}
  name=${name//,/-}
  echo "== kdamoe-ablate ($name)"
  TQDM_DISABLE=1 timeout "${ABLATE_S:-540}" python3 -m kdamoe.ablate --config "${ABLATE_CONFIG:-configs/ablate_h200.json}" \
    --factors "${ABLATE_FACTORS:-router_balancing}" --seeds "${ABLATE_SEEDS:-0}" --tokenizer .gpu/tok8k \
    --output-dir "/tmp/$name" 2>&1 | grep -v -i warn | tail -5
  mkdir -p "$OUT/$name" && cp /tmp/$name/results.json /tmp/$name/report.md "$OUT/$name/" 2>/dev/null
  if [ -d "/tmp/$name/runs/base" ]; then  # the quantile runs against the floor of a bias fitted at fixed weights
    echo "== balance_floor (the base runs: quantile balancing)"
    TQDM_DISABLE=1 timeout "${FLOOR_S:-120}" python3 benchmarks/balance_floor.py /tmp/$name/runs/base/seed* \
      --rows 16,64 --after-step 50 --out "$OUT/$name/balance_floor.json" 2>&1 | grep -v -i warn | tail -12
  fi
fi

if [ "${REST:-1}" = 1 ]; then
  echo "== CUDA MoE tests"
  python3 -m pytest -q -x tests/test_moe.py -k cuda 2>&1 | tail -5

  echo "== bench_moe"
  python3 benchmarks/bench_moe.py --out "$OUT/bench_moe.json" 2>&1 | tee "$OUT/bench_moe.log" | tail -25

  echo "== small preset: tokens/s and MFU"
  STEPS=${SMALL_STEPS:-30}
  python3 -m kdamoe.train --preset small --tokenizer .gpu/tok32k --stages 2048:$STEPS --micro-batch-size 16 \
    --save-every 0 --eval-every 0 --val-rows 8 --output-dir /tmp/small > "$OUT/train_small.log" 2>&1
  tail -5 "$OUT/train_small.log"
  cp /tmp/small/metrics.jsonl "$OUT/small_metrics.jsonl" 2>/dev/null
  python3 benchmarks/throughput.py /tmp/small --peak-tflops "${PEAK_TFLOPS:-989}" | tee "$OUT/small_throughput.txt"

  echo "== one small-preset step under torch.profiler (where the time goes)"
  python3 benchmarks/profile_step.py --preset small --rows 16 --seq-len 2048 --top 30 \
    --out /tmp/prof/profile_step.json \
    2>&1 | grep -v -i warn > "$OUT/profile_step.txt"
  head -33 "$OUT/profile_step.txt" && tail -1 "$OUT/profile_step.txt"  # the GPU kernels by total time; the step time
  cp /tmp/prof/profile_step.json "$OUT/" 2>/dev/null
fi
