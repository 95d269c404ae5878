#!/usr/bin/env bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1
cd benchmarks
timeout 560 python3 tune_kda_kernels.py --sizes 4x8192,1x32768 --jobs 16 --out $OUT/tune_kda_s7.json \
  --slices '[{}, {"intra": 64, "wu_k": 32, "wu_v": 32, "fwd_o_v": 32}, {"intra": 128, "wu_k": 128, "wu_v": 128, "fwd_o_k": 128}]' 2>&1 | grep -v Warn
