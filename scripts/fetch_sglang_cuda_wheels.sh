#!/usr/bin/env bash
# Fetch the wheels scripts/device_sglang_cuda.sh installs on a GPU machine that has no network and no sglang
# (Python 3.12, CUDA torch, transformers, hypothesis): sglang 0.5.23 itself and the light packages its
# model-runner import chain needs, into runs/wheels-cuda/ (git-ignored), for the run tool's `carry`.
#   bash scripts/fetch_sglang_cuda_wheels.sh
# --no-deps throughout: sglang's own pins (torch 2.14, sglang-kernel, flashinfer, ...) are hundreds of MB of CUDA
# wheels, and torch / transformers / triton must stay the machine's own. The list is install_sglang_cpu.sh's DEPS
# minus what such a machine already has or what is too big to carry (scipy, triton, pillow, transformers,
# huggingface_hub, safetensors, tokenizers, numpy, torch), plus the import-time dependencies of what remains
# (checked here by importing sglang's chain with every other package blocked: see the device script's header).
# What the machine already imports is skipped there, so a package listed here and present there costs only bytes.
# The carry limit of a call is 64 MiB with the repository (~2 MiB): the wheels must stay under 58 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
D=runs/wheels-cuda
MAX_MIB=58
# Versions: sglang 0.5.23's own pins where it has one (checked against its METADATA below), else the versions
# this project's CPU environment runs sglang 0.5.23 with.
PKGS=(
  sglang==0.5.23
  # sglang's own module-level imports
  orjson==3.13.0 msgspec==0.23.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
  typing-inspection==0.4.5 psutil==7.2.2 pyzmq==27.3.0 pybase64==1.5.1 setproctitle==1.3.8 einops==0.8.2
  partial-json-parser==0.2.1.1.post7 dill==0.4.1 gguf==0.19.0 apache-tvm-ffi==0.1.11 python-dateutil==2.9.0.post0
  six==1.17.0 sentencepiece==0.2.1 tiktoken==0.14.0 nvidia-ml-py==13.615.71 compressed-tensors==0.18.0
  loguru==0.7.3 interegular==0.3.3 easydict==1.14 distro==1.9.0 xxhash==4.1.0 prometheus-client==0.26.0
  # the HTTP / server stack sglang's utils and entrypoints import at module level
  requests==2.34.2 urllib3==2.8.0 charset-normalizer==3.5.3 idna==3.21 certifi==2026.10.19.post1
  aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0 frozenlist==1.8.0 multidict==7.2.1
  propcache==0.5.4 yarl==1.25.1 fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7 opentelemetry-api==1.45.3
  uvicorn==0.55.0 click==8.5.1 h11==0.16.0 python-multipart==0.0.34
  openai==2.8.0 jiter==0.19.0 httpx==0.29.0 httpcore==1.0.9 anyio==4.16.0 sniffio==1.3.1
  # sglang/utils.py imports IPython.display at module level: that needs traitlets and pygments, not IPython's
  # shell (jedi, prompt_toolkit, ... 6 MB), which the import never reaches
  ipython==9.19.1 traitlets==5.16.1 pygments==2.21.0
  # imported inside try / except ImportError: carried so the machine runs the real module, not the fallback
  xgrammar==0.2.7
  # left out, 10 MB between them: zstandard (only other packages' optional import), uvloop (the HTTP server's)
)
mkdir -p "$D"
export PIP_DISABLE_PIP_VERSION_CHECK=1
# sglang 0.5.23's x86_64 wheel is tagged manylinux_2_34: without that platform pip finds no 0.5.23 at all.
pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_34_x86_64 --platform any -d "$D" "${PKGS[@]}"

# Every carried wheel within sglang's own requirement on it (its METADATA, markers for Linux x86_64, py3.12).
python - "$D" <<'PY'
import glob, re, sys, zipfile
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
d = sys.argv[1]
wheels = {canonicalize_name(n): v for n, v, _, _ in (parse_wheel_filename(w.rsplit("/", 1)[1])
                                                      for w in glob.glob(f"{d}/*.whl"))}
sgl = glob.glob(f"{d}/sglang-0.5.23-*.whl")[0]
meta = zipfile.ZipFile(sgl).read("sglang-0.5.23.dist-info/METADATA").decode()
env = {"sys_platform": "linux", "platform_machine": "x86_64", "platform_system": "Linux",
       "python_version": "3.12", "python_full_version": "3.12.0", "implementation_name": "cpython", "extra": ""}
bad = []
for line in re.findall(r"^Requires-Dist: (.+)$", meta, re.M):
    r = Requirement(line)
    if (r.marker is None or r.marker.evaluate(env)) and canonicalize_name(r.name) in wheels:
        v = wheels[canonicalize_name(r.name)]
        if not r.specifier.contains(v, prereleases=True):
            bad.append(f"{r.name} {v}: sglang 0.5.23 requires {r.specifier}")
print("\n".join(bad) or f"{len(wheels)} wheels, each within sglang 0.5.23's requirement where it states one")
sys.exit(1 if bad else 0)
PY

# Only this list in the folder: a wheel left from an older list would travel and be installed too.
keep=$(printf '%s\n' "${PKGS[@]}" | sed 's/==.*//' | tr 'A-Z-' 'a-z_')
for w in "$D"/*.whl; do
  n=$(basename "$w" | cut -d- -f1 | tr 'A-Z-' 'a-z_')
  grep -qx "$n" <<< "$keep" || { echo "removing $(basename "$w") (not in the list)"; rm -f "$w"; }
done
ls -l "$D" | awk 'NR > 1 {printf "%10d  %s\n", $5, $9}'
bytes=$(du -cb "$D"/*.whl | tail -1 | cut -f1)
echo "$(ls "$D"/*.whl | wc -l) wheels, $bytes bytes ($(( bytes / 1048576 )) MiB; limit $MAX_MIB MiB)"
[ "$bytes" -le $(( MAX_MIB * 1048576 )) ] || { echo "over $MAX_MIB MiB: too big to carry" >&2; exit 1; }
