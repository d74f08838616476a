#!/usr/bin/env bash
# One device run: the end-to-end suite on CUDA, then the benchmark in bf16 and fp32.
export PYTHONPATH=src PYTHONUNBUFFERED=1 TILEFUSE_CACHE_DIR="$(mktemp -d)"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
TILEFUSE_TEST_DEVICE=cuda timeout 150 python -m pytest tests/e2e -q -p no:cacheprovider 2>&1 | tail -15 | tee $OUT/e2e_cuda.txt
for dt in bfloat16 float32; do
  timeout 200 python -m tilefuse.bench --sizes full --dtype $dt --workloads rmsnorm,softmax,gelu_linear,layernorm,mlp \
     --backends eager,inductor,tilefuse --out $OUT/$dt --quiet 2>&1 | tail -20
done
