#!/usr/bin/env bash
# A CUDA 13.0 build toolkit for crates/candle on a machine without CUDA (CI, build hosts):
# nvcc and its parts from NVIDIA's PyPI wheels (pinned), plus link stubs of the libraries
# candle-core's `cuda` feature links (libcuda, libcublas, libcublasLt, libcurand), generated from
# the symbols cudarc declares. The stubs only satisfy the linker; at run time the GPU host's real
# libraries are loaded by their SONAMEs. Prints the environment to use:
#   eval "$(.ci/cuda-toolkit.sh)"
set -euo pipefail
cd "$(dirname "$0")/.."
root=.tools/cuda13
cu=$root/nvidia/cu13
if [ ! -x "$cu/bin/nvcc" ] || [ ! -e "$cu/lib/libnvrtc.so" ]; then
  python3 -m pip install --quiet --no-deps --target "$root" \
    nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-cuda-runtime==13.0.88 \
    nvidia-cuda-cccl==13.0.85 nvidia-nvvm==13.0.88 nvidia-cuda-nvrtc==13.0.88 >&2
  # The wheels ship versioned names only; the linker looks for lib<name>.so.
  ln -sf libnvrtc.so.13 "$cu/lib/libnvrtc.so"
  ln -sf libcudart.so.13 "$cu/lib/libcudart.so"
fi
if [ ! -e "$cu/lib/stubs/libcuda.so" ]; then
  cudarc=$(cargo metadata --format-version 1 --manifest-path crates/candle/Cargo.toml 2>/dev/null |
    python3 -c 'import json,sys,os; m=json.load(sys.stdin); print(next(os.path.dirname(p["manifest_path"]) for p in m["packages"] if p["name"]=="cudarc"))')
  mkdir -p "$cu/lib/stubs"
  # library:soname:cudarc module
  for spec in cuda:libcuda.so.1:driver cublas:libcublas.so.13:cublas cublasLt:libcublasLt.so.13:cublaslt curand:libcurand.so.10:curand; do
    IFS=: read -r name soname module <<<"$spec"
    c="$cu/lib/stubs/$name.c"
    grep -ohE '^\s*(pub )?fn [A-Za-z_][A-Za-z0-9_]*\(' "$cudarc/src/$module/sys/mod.rs" |
      sed -E 's/^\s*(pub )?fn ([A-Za-z0-9_]+)\(/\2/' | sort -u |
      awk '{ printf "void %s(void) {}\n", $1 }' >"$c"
    gcc -shared -fPIC -o "$cu/lib/stubs/lib$name.so" -Wl,-soname,"$soname" "$c"
  done
fi
abs=$(cd "$cu" && pwd)
echo "export CUDA_ROOT=$abs PATH=$abs/bin:\$PATH CUDA_COMPUTE_CAP=90"
