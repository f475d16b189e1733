#!/usr/bin/env bash
# The whole CPU extension on its AVX-512 VNNI paths, on a CPU without AVX-512, under
# AddressSanitizer: the op-level code around the VNNI tiles (dispatch, workspaces,
# fused outliers, paged attention, the decode plan) that tests/csrc/test_cpu_isa_emulation.py, which runs
# the tiles alone, does not reach.
#
# It copies the sources to $TREE (default build/vnni-emulated) and there:
#   - drops every `#pragma GCC target` region marker and target attribute, so all code
#     is compiled for the baseline ISA;
#   - gives every file SIMDe's portable intrinsics under their Intel names
#     (csrc/cpu/tests/simde_shim plus SIMDe's AVX-512 headers; simde-py, a test extra),
#     after the compiler's own <x86intrin.h>, which torch's headers include;
#   - makes the ISA probe report AVX-512 VNNI;
# then builds compress._C with -fsanitize=address and runs the CPU op and decode tests
# (every ISA: the emulated VNNI, AVX2, scalar). Slow: ~5 min to build on 2 cores.
#
#   csrc/cpu/tests/check_vnni_emulated.sh [pytest args, default: the op and native-decode tests]
set -euo pipefail
cd "$(dirname "$0")/../../.."
REPO=$PWD
PY=${PY:-$REPO/.venv/bin/python}
TREE=${TREE:-build/vnni-emulated}
SIMDE=$($PY -c "import simde_py; print(simde_py.get_include())")

rm -rf "$TREE" && mkdir -p "$TREE"
git ls-files -z | xargs -0 cp --parents -t "$TREE"
cd "$TREE"
src=(csrc/cpu/*.cpp csrc/cpu/*.h csrc/cpu/*.inc)
sed -i '/#pragma GCC \(push_options\|pop_options\|target\)/d' "${src[@]}"
sed -i 's/__attribute__((target("[^"]*")))//g' "${src[@]}"
sed -i '/__asm__ volatile("" :/d' csrc/cpu/compute_peak.cpp   # register pins of SIMD types
sed -i 's|#include <immintrin.h>|#include "emulated_isa.h"|' "${src[@]}"
cat > csrc/cpu/emulated_isa.h <<'EOF'
#pragma once
#include "simde_shim/immintrin.h"
#include <simde/x86/avx512.h>
EOF
python3 - <<'EOF'
import re
p = "csrc/cpu/isa.cpp"
s = open(p).read()
s, n = re.subn(r"Isa detect\(\) \{\n", "Isa detect() {\n  return Isa::Avx512Vnni;  // emulated build\n", s, count=1)
assert n == 1, "isa.cpp: detect() not found"
open(p, "w").write(s)
EOF
python3 - "$SIMDE" "$PWD" <<'EOF'
import sys
p = "setup.py"
s = open(p).read()
old = '"-ffp-contract=off"]'
assert old in s, "setup.py: the CPU flags moved"
flags = ['-ffp-contract=off', '-DCOMPRESS_ISA_EMULATION', f'-I{sys.argv[2]}/csrc/cpu/tests', '-include',
         'x86intrin.h', f'-I{sys.argv[1]}']
open(p, "w").write(s.replace(old, ", ".join(f'"{f}"' for f in flags) + "]", 1))
EOF
rm -f asan.*
echo "building the emulated extension in $TREE (build.log)"
COMPRESS_SANITIZE=address COMPRESS_BUILD_CUDA=0 MAX_JOBS=${MAX_JOBS:-2} $PY setup.py build_ext --inplace >build.log 2>&1 \
  || { tail -30 build.log; exit 1; }
cxx=${CXX:-g++}  # its runtime libraries: the compiler that built the extension
export LD_PRELOAD="$($cxx -print-file-name=libasan.so) $($cxx -print-file-name=libstdc++.so)"
export ASAN_OPTIONS=detect_leaks=0:log_path=$PWD/asan
isa=$($PY -c "import compress.ops as o; print(o.cpu_isa())")
[ "$isa" = avx512_vnni ] || { echo "the emulated build reports ISA $isa"; exit 1; }
[ $# -eq 0 ] && set -- tests/ops/test_ops_cpu.py tests/ops/test_paged_decode_attention.py tests/runtime/test_native_decode.py
$PY -m pytest -p no:cacheprovider -q "$@" && rc=0 || rc=$?
for f in asan.*; do [ -e "$f" ] && { echo "AddressSanitizer report $f:"; head -60 "$f"; rc=1; }; done
exit $rc
