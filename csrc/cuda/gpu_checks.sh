#!/usr/bin/env bash
# Everything the GPU suite needs, in one command, on a machine with an NVIDIA GPU, nvcc
# and a CUDA build of torch (e.g. a lent device machine; see csrc/README.md):
#   1. builds compress._C and compress._cuda in place (COMPRESS_BUILD_CUDA=1) and checks
#      that the CUDA kernels load and are registered (step cudaops; the test and bench
#      steps check it first too, so a GPU run never passes on skipped tests);
#   2. runs the GPU suite (the tests marked cuda): the kernels (tests/csrc/test_cuda_ops.py)
#      and the runtime on CUDA (tests/runtime/test_cuda_runtime.py);
#   3. if the CPU has AVX-512 VNNI, runs the CPU op and runtime tests natively on it;
#   4. times the CUDA kernels (compress bench cuda);
#   5. runtime: our runtime on the GPU, decode steps from CUDA graphs and launched, against
#      transformers fp16 (compress bench model --device cuda) on an 836M-parameter model of
#      TinyLlama's widths (16 layers) made here, int4 RTN;
#   serve: compress serve --device cuda under compress bench serve (continuous batching
#      against one sequence at a time; needs fastapi and uvicorn);
#   attention: the paged decode attention kernels (split, heads) per K / V element type
#      against each other and the bandwidth roofline (csrc/cuda/lab/paged_attention_kv.py);
#   runtime-attention: decode at 512-token prompts under each of the two kernels;
#   6. cpubench: times the CPU kernels at 2 threads on this CPU;
#   asan: the CPU op tests against an AddressSanitizer build of compress._C.
# Logs go to $LOG_DIR (default ./gpu-logs). Usage: csrc/cuda/gpu_checks.sh [info|build|cudaops|test|cpu|asan|bench|attention|runtime|runtime-attention|serve|cpubench ...]
set -uo pipefail
cd "$(dirname "$0")/../.."
LOG_DIR=$(mkdir -p "${LOG_DIR:-gpu-logs}" && cd "${LOG_DIR:-gpu-logs}" && pwd)
PY=${PY:-python3}
case $PY in */*) PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY") ;; esac  # the asan step runs elsewhere
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(build test cpu bench)
status=0

# Fails (exit 1) unless torch sees a GPU, compress._cuda loads and every CUDA op is registered.
assert_cuda_ops() {
  $PY - <<'EOF_PY'
import sys
import torch
import compress.ops as ops
from compress.ops import library
if not torch.cuda.is_available():
    sys.exit("cudaops: FAILED: torch sees no CUDA device (torch " + torch.__version__ + ")")
if not ops.native_available("cuda"):
    sys.exit("cudaops: FAILED: compress._cuda is not built: the GPU suite would skip every kernel")
cuda_ops = ("w4a16_gemm", "w4a16_shuffle_for_cuda", "w4a16_gemm_shuffled", "quantize_per_token_int8",
            "w8a8_gemm", "w8a8_outlier_gemm", "paged_decode_attention")
missing = [op for op in cuda_ops
           if op not in library.SCHEMAS or not torch._C._dispatch_has_kernel_for_dispatch_key(f"compress::{op}", "CUDA")]
if missing:
    sys.exit(f"cudaops: FAILED: no CUDA kernel registered for {missing}")
print(f"cudaops: ok: {len(cuda_ops)} CUDA kernels registered on {torch.cuda.get_device_name()}")
EOF_PY
}

for step in "${steps[@]}"; do
  case $step in
    info)
      { nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
        $PY -c "import torch, sys; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
        nvcc --version | tail -1
        lscpu | grep -E "Model name|^CPU\(s\)"
        grep -o -w -E "avx512_vnni|avx512f|avx_vnni|avx2" /proc/cpuinfo | sort | uniq -c
      } 2>&1 | tee "$LOG_DIR/info.log"
      ;;
    build)
      start=$(date +%s)
      COMPRESS_BUILD_CUDA=1 MAX_JOBS=${MAX_JOBS:-16} $PY setup.py build_ext --inplace >"$LOG_DIR/build.log" 2>&1
      rc=$?
      echo "build rc=$rc in $(( $(date +%s) - start )) s"
      [ $rc -ne 0 ] && { tail -60 "$LOG_DIR/build.log"; exit $rc; }
      assert_cuda_ops || exit 1
      ;;
    cudaops)
      assert_cuda_ops || exit 1
      ;;
    test)
      assert_cuda_ops || exit 1
      $PY -m pytest -p no:cacheprovider -q --maxfail=30 tests/csrc/test_cuda_ops.py tests/runtime/test_cuda_runtime.py tests/runtime/test_cuda_graphs.py 2>&1 | tee "$LOG_DIR/test_cuda.log" | tail -40
      [ ${PIPESTATUS[0]} -ne 0 ] && status=1
      ;;
    cpu)
      if grep -q -w avx512_vnni /proc/cpuinfo; then
        # the op tests, and the runtime's CPU tests (on a Xeon they take the AMX paths CI never sees)
        $PY -m pytest -p no:cacheprovider -q --maxfail=30 -m "not slow and not cuda" tests/ops \
          tests/csrc/test_cpu_isa_emulation.py tests/csrc/test_cpu_cxx_runtime.py tests/runtime \
          2>&1 | tee "$LOG_DIR/test_cpu_vnni.log" | tail -25
        [ ${PIPESTATUS[0]} -ne 0 ] && status=1
      else
        echo "cpu: no avx512_vnni here, skipped"
      fi
      ;;
    asan)
      # the CPU op tests against a copy of compress._C built with AddressSanitizer
      tree=build/asan-tree
      rm -rf "$tree" && mkdir -p "$tree"
      tar --exclude=./build --exclude=./.git --exclude=./.venv --exclude='*.so' -cf - . | tar -xf - -C "$tree"
      (cd "$tree" && COMPRESS_SANITIZE=address COMPRESS_BUILD_CUDA=0 MAX_JOBS=${MAX_JOBS:-16} \
        $PY setup.py build_ext --inplace >build.log 2>&1) || { tail -30 "$tree/build.log"; exit 1; }
      cxx=${CXX:-g++}  # its runtime libraries: the compiler that built the extension
      (cd "$tree" && LD_PRELOAD="$($cxx -print-file-name=libasan.so) $($cxx -print-file-name=libstdc++.so)" \
        ASAN_OPTIONS=detect_leaks=0:log_path=$LOG_DIR/asan $PY -m pytest -p no:cacheprovider -q -x \
        tests/ops/test_ops_cpu.py 2>&1 | tee "$LOG_DIR/test_cpu_asan.log" | tail -15; exit "${PIPESTATUS[0]}") \
        || status=1
      for f in "$LOG_DIR"/asan.*; do [ -e "$f" ] && { status=1; head -50 "$f"; }; done
      ;;
    bench)
      assert_cuda_ops || exit 1
      $PY -m compress.cli bench cuda --json "$LOG_DIR/bench_cuda.json" 2>&1 | tee "$LOG_DIR/bench_cuda.log" | tail -60
      ;;
    attention)
      assert_cuda_ops || exit 1
      PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} $PY csrc/cuda/lab/paged_attention_kv.py --kv-dtype float16 int8 float32 \
        2>&1 | tee "$LOG_DIR/paged_attention_kv.log"
      [ ${PIPESTATUS[0]} -ne 0 ] && status=1
      ;;
    runtime|serve|runtime-attention)
      assert_cuda_ops || exit 1
      model=${RUNTIME_MODEL_DIR:-build/gpu-bench-model}
      if [ ! -d "$model/rtn-int4" ]; then
        $PY -m compress.cli bench make-model --out "$model" --hidden 2048 --layers 16 --intermediate 5632 \
          --heads 32 --kv-heads 4 --dtype float16 --exports int4 >"$LOG_DIR/make_model.log" 2>&1 \
          || { tail -30 "$LOG_DIR/make_model.log"; status=1; continue; }
      fi
      if [ "$step" = runtime-attention ]; then
        # decode at 512-token prompts under each paged attention kernel, one process each
        for kernel in heads split; do
          COMPRESS_CUDA_PAGED_KERNEL=$kernel $PY -m compress.cli bench model "$model/rtn-int4" --device cuda \
            --dtype float16 --engines compress --w4-activations float --kv-cache-dtypes model int8 \
            --batch 1 16 64 --prompt-len 512 --new-tokens 64 --reps 3 \
            --json "$LOG_DIR/bench_model_cuda_$kernel.json" 2>&1 | tee "$LOG_DIR/bench_model_cuda_$kernel.log" | tail -12
          [ ${PIPESTATUS[0]} -ne 0 ] && status=1
        done
        continue
      elif [ "$step" = runtime ]; then
        $PY -m compress.cli bench model "$model/rtn-int4" --hf "$model/hf" --device cuda --dtype float16 \
          --engines compress transformers --hf-dtypes float16 --w4-activations float --kv-cache-dtypes model \
          --cuda-graphs on off --batch 1 16 64 --prompt-len 128 --new-tokens 64 --reps 3 \
          --json "$LOG_DIR/bench_model_cuda.json" 2>&1 | tee "$LOG_DIR/bench_model_cuda.log" | tail -30
      else
        $PY -m compress.cli bench serve --model "$model/rtn-int4" --peers ours,ours-serial --concurrency 1 16 \
          --num-prompts 32 --seed 0 --threads 4 --ours-arg=--device --ours-arg=cuda --ours-arg=--dtype \
          --ours-arg=float16 --out "$LOG_DIR/bench_serve_cuda.json" 2>&1 | tee "$LOG_DIR/bench_serve_cuda.log" | tail -30
      fi
      [ ${PIPESTATUS[0]} -ne 0 ] && status=1
      ;;
    cpubench)
      # the CPU kernels at 2 threads on this CPU (VNNI where it has it) against torch
      $PY -m compress.cli bench kernels --threads 2 --shapes 4096x4096 11008x4096 14336x4096 --m 1 64 256 \
        --impl compress torch --reps 5 --budget 3 --json "$LOG_DIR/bench_cpu.json" 2>&1 | tee "$LOG_DIR/bench_cpu.log" | tail -40
      ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
exit $status
