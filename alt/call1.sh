#!/usr/bin/env bash
# device call 1: fla-core fwd+bwd autotune (cache brought back) + A/B main / gf2 / giw2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
t0=$(date +%s)
( cd benchmarks && TRITON_CACHE_DIR=/tmp/tc timeout 300 python3 bench_kda.py --impls fla-bounded --skip-checks \
   --sizes 4x8192,1x32768,1x131072 --no-million --out "$OUT/fla_fb.json" 2>&1 | grep -v Warning | tail -30 )
echo "fla took $(( $(date +%s) - t0 )) s"
( cd /tmp/tc && find . -name "*.autotune.json" | tar czf "$OUT/fla_autotune.tgz" -T - ; ls -la "$OUT" )
bash benchmarks/ab_kda.sh run 4x8192,1x32768
echo "total $(( $(date +%s) - t0 )) s"
