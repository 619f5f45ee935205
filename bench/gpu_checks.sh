#!/usr/bin/env bash
# The GPU checks, as one command for a lent GPU machine (or any CUDA host with PyTorch):
#   1. pytest -m gpu over the test files that hold GPU tests;
#   2. bench/bench_train.py at the paper's per-GPU batch (180, ViT-S/16, 224 px, bf16), recorded;
#   3. bench/bench_gpu_decode.py: nvjpeg decoding on the GPU vs PIL in tasks, cores per GPU, recorded.
# A machine without the project's stack can take it as wheels: put them in $PUMA_GPU_WHEELS
# (default .gpu/, git-ignored) and, for Ray, a ray.tar.xz of the unpacked wheel; they are installed
# into the running Python first. Results and logs go to $OUT (default /tmp/puma-gpu-out); copy
# train_gpu.{json,md} and gpu_decode.{json,md} into bench/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/puma-gpu-out}
PY=${PYTHON:-python3}
WHEELS=${PUMA_GPU_WHEELS:-.gpu}
mkdir -p "$OUT"
if [ -d "$WHEELS" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "$WHEELS"/*.whl
  SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  [ ! -f "$WHEELS/ray.tar.xz" ] || tar -xJf "$WHEELS/ray.tar.xz" -C "$SITE"
fi
# the sample photos some GPU tests read from ../shared/data, where the checkout has none beside it
[ -d ../shared/data ] || [ ! -d "$WHEELS/shared" ] || ln -s "$PWD/$WHEELS/shared" ../shared
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$OUT/nvidia_smi.txt"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PUMA_BENCH_RESULTS=$OUT
"$PY" -c 'import torch, timm, ray, faiss; print("torch", torch.__version__, "cuda", torch.version.cuda,
  "timm", timm.__version__, "ray", ray.__version__, "faiss GPUs", faiss.get_num_gpus())' 2>&1 | tee "$OUT/stack.txt"
GPU_TESTS=${PUMA_GPU_TESTS:-"tests/test_device_views.py tests/test_gpu.py tests/test_vptspg.py tests/test_udml_ss.py tests/test_index.py
  tests/test_embed_job.py tests/test_serve.py"}
# shellcheck disable=SC2086
timeout "${PUMA_GPU_TEST_TIMEOUT:-300}" "$PY" -m pytest -m gpu -p no:cacheprovider -q -rs \
  --continue-on-collection-errors $GPU_TESTS 2>&1 | tee "$OUT/pytest_gpu.log"
timeout "${PUMA_GPU_BENCH_TIMEOUT:-240}" "$PY" bench/bench_train.py --config configs/paper_vit_s.yaml \
  --weights none --img-size 224 --batch 180 --repeats 10 --precision bf16 --record train_gpu 2>&1 \
  | tee "$OUT/bench_train.log"
timeout "${PUMA_GPU_DECODE_TIMEOUT:-150}" "$PY" bench/bench_gpu_decode.py --source ../shared/data/cub200-subset \
  --images "${PUMA_GPU_DECODE_IMAGES:-256}" --train-record "$OUT/train_gpu.json" --record gpu_decode 2>&1 \
  | tee "$OUT/bench_gpu_decode.log"
