#!/usr/bin/env bash
# Install SGLang's Python layers for the `sglang` parity target on a CPU machine (docs/sglang.md).
#
# `pip install sglang` pulls SGLang's CUDA pins (torch 2.14.x, sgl-kernel / flashinfer, several hundred MB of
# CUDA wheels): right for GPU runners (`pip install -e ".[sglang]"`), wrong for CPU machines. Here:
#   1. torch==2.13.0 (the CPU wheel) and transformers from .ci/constraints.txt stay pinned throughout;
#   2. sglang itself with --no-deps;
#   3. only the light dependencies its module imports need, under the same constraints.
# torchvision is NOT installed (the index's wheel needs CUDA torch and fails to import beside the CPU torch);
# checks/targets/sglang/cpu_shims.py supplies an import-time stand-in instead.
# Idempotent: a second run finds everything installed and returns in seconds.
# Usage: bash scripts/install_sglang_cpu.sh     (inside the project's virtualenv; SGLANG_VERSION to override)
#        bash scripts/install_sglang_cpu.sh --release 0.5.21 [0.5.22 ...]
#             also builds each release's own cached environment, layered over this one
#             (checks/targets/sglang/envs.py; $DPEP_SGLANG_ENVS, default ~/.cache/dpep-parity/sglang-envs)
set -euo pipefail
cd "$(dirname "$0")/.."
RELEASES=()
if [ "${1:-}" = "--release" ]; then
  shift
  [ "$#" -gt 0 ] || { echo "usage: $0 [--release VERSION ...]" >&2; exit 2; }
  RELEASES=("$@")
  # an unknown or unsupported release is refused before anything installs
  python -c "import sys; from dpep_parity.checks.targets.sglang import releases as r
try:
    bad = [f'sglang {v}: {r.get(v).blocked}' for v in sys.argv[1:] if not r.get(v).supported]
except r.UnknownRelease as e:
    bad = [str(e)]
if bad: raise SystemExit(chr(10).join(bad))" "${RELEASES[@]}" || exit 2
fi
SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
C=(-c .ci/constraints.txt)
t0=$(date +%s)

have() { python - "$@" <<'PY'
import sys
from importlib import metadata
name, want = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None
try:
    v = metadata.version(name)
except metadata.PackageNotFoundError:
    sys.exit(1)
sys.exit(0 if want is None or v == want else 1)
PY
}

if ! have torch; then
  pip install -q "${C[@]}" torch==2.13.0 numpy
fi

if have sglang "$SGLANG_VERSION"; then
  echo "sglang $SGLANG_VERSION already installed"
else
  pip install -q --no-deps "sglang==$SGLANG_VERSION"
fi

# The light dependencies sglang's imports need (measured: docs/sglang.md). pip skips satisfied ones.
DEPS=(aiohttp orjson msgspec pydantic psutil pyzmq requests tqdm packaging regex pybase64 setproctitle uvloop
      fastapi "uvicorn>=0.51" python-multipart prometheus-client einops scipy pillow distro xxhash zstandard
      interegular partial_json_parser easydict transformers safetensors "sentencepiece==0.2.1"
      tiktoken "openai==2.8.0" python-dateutil nvidia-ml-py huggingface_hub triton ipython dill
      "apache-tvm-ffi==0.1.11" compressed-tensors gguf "xgrammar==0.2.7")
pip install -q "${C[@]}" "${DEPS[@]}"

python - <<'PY'
import torch
from importlib import metadata
assert torch.__version__.startswith("2.13.0"), f"torch {torch.__version__} replaced the pinned 2.13.0"
print("sglang", metadata.version("sglang"), "torch", torch.__version__,
      "transformers", metadata.version("transformers"))
PY
if [ "${#RELEASES[@]}" -gt 0 ]; then
  python -m dpep_parity.checks.targets.sglang.envs install --constraints .ci/constraints.txt "${RELEASES[@]}"
fi
echo "install_sglang_cpu: done in $(( $(date +%s) - t0 )) s"
