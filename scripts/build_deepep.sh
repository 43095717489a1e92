#!/usr/bin/env bash
# Build and install DeepEP (the `deepep` baseline, weave_moe/backends/deepep.py) from its public source, on the GPU
# machine, which has no network. Usage: scripts/build_deepep.sh SRC_DIR [WHEEL_DIR]
#
#   SRC_DIR    a checkout of DeepEP's public repository at the tag to measure (v1.2.1: the paper's version; newer ones
#              need a newer NCCL than torch 2.11's). Keep it outside git: e.g. `git archive v1.2.1` of a mirror into
#              `.deepep/DeepEP`, a folder `.git/info/exclude` ignores, carried to the device with `carry: [".deepep"]`.
#   WHEEL_DIR  where the built wheel is kept (default SRC_DIR/dist). If it already holds a DeepEP wheel, that wheel is
#              installed and nothing is built.
#
# What the H200 image needs (measured 2026-12-01, torch 2.11 + CUDA 13): the CUDA toolkit's include/cccl on the
# include path of both compilers; TORCH_CUDA_ARCH_LIST=9.0. setup.py finds torch's NVSHMEM (nvidia-nvshmem-cu13) by
# itself. ~50-60 s, a ~9 MB wheel. The import is checked from outside the source tree: the source's own deep_ep/
# folder would shadow the installed package.
set -euo pipefail
src=${1:?usage: scripts/build_deepep.sh SRC_DIR [WHEEL_DIR]}
src=$(cd "$src" && pwd)
wheels=${2:-$src/dist}
mkdir -p "$wheels"
wheels=$(cd "$wheels" && pwd)
if ! ls "$wheels"/deep_ep-*.whl > /dev/null 2>&1; then
  cuda=${CUDA_HOME:-/usr/local/cuda}
  if [ ! -d "$cuda/include/cccl" ]; then
    echo "build_deepep: $cuda/include/cccl not found (set CUDA_HOME to the CUDA toolkit)" >&2
    exit 1
  fi
  export CPATH="$cuda/include/cccl${CPATH:+:$CPATH}"
  export NVCC_APPEND_FLAGS="-I$cuda/include/cccl ${NVCC_APPEND_FLAGS:-}"
  export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
  (cd "$src" && python3 setup.py -q bdist_wheel --dist-dir "$wheels")
fi
python3 -m pip install -q --no-deps --force-reinstall "$(ls -t "$wheels"/deep_ep-*.whl | head -1)"
cd /tmp && python3 -c "import deep_ep, importlib.metadata as m; print('deep_ep', m.version('deep_ep'), deep_ep.__file__)"
