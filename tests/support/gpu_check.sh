#!/usr/bin/env bash
# The GPU check, on a machine with CUDA and seamline's dependencies importable: the CUDA and
# Triton tests, then `seamline bench gpu`. Writes tests.log, bench.log and bench_gpu.json into
# OUT_DIR (default ./gpu-check). Without the embedded model installed, set
# SEAMLINE_TOKENIZER_GGUF to a GGUF holding its tokenizer (the bench's random models take it).
set -o pipefail
out=${1:-gpu-check}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
(python3 -c "from seamline_bench.gpu_models import gpu_models; print(gpu_models())" > "$out/models.log" 2>&1) &
models=$!
tests="tests/model/test_triton_gguf.py tests/model/test_triton_ops.py tests/model/test_triton_attention.py
       tests/model/test_cuda.py tests/model/test_cuda_lockstep.py tests/mesh/test_mesh_cuda.py"
# the CPU reference runs the torch path: the check does not wait for the C++ kernels to build
SEAMLINE_QUANT_KERNELS=0 timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -p timeout \
  --timeout 120 -rs --tb=short $tests 2>&1 | tee "$out/tests.log" | tail -40
wait $models
timeout "${BENCH_TIMEOUT:-600}" python3 -m seamline.cli bench gpu --tokens "${TOKENS:-32}" \
  --json "$out/bench_gpu.json" > "$out/bench.log" 2>&1
echo "bench exit $?"
tail -c 4000 "$out/bench.log"
