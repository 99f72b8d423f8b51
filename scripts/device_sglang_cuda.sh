#!/usr/bin/env bash
# The `sglang` target at tensor-parallel size 1 on one GPU machine that has no network and no sglang: installs
# sglang 0.5.23 from the wheels of scripts/fetch_sglang_cuda_wheels.sh (carried as runs/wheels-cuda) and runs
# as far as it goes, every stage logged and its exit code in summary.txt.
#   OUT=DIR bash scripts/device_sglang_cuda.sh            (run call: carry ["runs/wheels-cuda"]; fits 600 s)
# Stages: env (interpreter, torch, which modules sglang needs import already); install (pip --no-index --no-deps
# --target /tmp/sgl, skipping distributions the machine has: its triton, pydantic, ... stay its own); standins
# (import-time stand-ins in /tmp/sgl-standins, only for packages sglang imports unguarded that still fail to
# import, each listed in standins.txt); import (sglang and the target's rank-side modules, as a rank imports
# them); replay (one example per unit at tp1 on CUDA); pytest (the property suite at world size 1, when the moe
# example passed).
# sglang's CUDA kernel package (sgl_kernel: hundreds of MB) and torchvision are not carried: the target's own
# import-time stand-ins (checks/targets/sglang/cpu_shims.py STAND_INS, installed in every rank process on any
# device) take their place, and any call into them is a HarnessFault (replay exit 3) naming the function.
# Files in OUT: summary.txt, env-modules.txt, pip.log, standins.txt, import.log, replay-{moe,attention,decoder,
# model}.log, pytest-tp1.log.
set -u
. "$(dirname "$0")/device_common.sh" runs/sglang-cuda
WHEELS=runs/wheels-cuda SGL=/tmp/sgl STANDINS=/tmp/sgl-standins
BUDGET="${BUDGET:-575}"        # seconds for the whole script: the call's limit is 600
# a stage's limit: its cap, or what the budget has left less the 30 s lim may add after SIGINT
left_for() { local l=$(( BUDGET - ($(date +%s) - T0) - 35 )); echo $(( l < $1 ? l : $1 )); }
note() { echo "$*" | tee -a "$S"; }

stamp "env"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c 'import sys, platform; print("python", sys.version.split()[0], sys.executable, "| glibc", platform.libc_ver()[1])'
  $PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())'
  $PY -c 'import transformers, hypothesis; print("transformers", transformers.__version__, "| hypothesis", hypothesis.__version__)'
} >> "$S" 2>&1
[ "$($PY -c 'import sys; print(sys.version_info[:2] == (3, 12))')" = True ] ||
  note "WARNING: the carried wheels are cp312; this interpreter is not 3.12, their binary ones will not install"
# Every top-level module of the carried wheels, the stand-in candidates and the big packages sglang imports,
# imported in the machine's own environment (no PYTHONPATH yet): what it already has.
MODS="PIL triton numpy yaml safetensors tokenizers huggingface_hub scipy torchvision sgl_kernel flashinfer"
lim 120 $PY - "$WHEELS" $MODS > "$OUT/env-modules.txt" 2>&1 <<'PY'
import glob, importlib, importlib.metadata as md, sys, zipfile
mods = set(sys.argv[2:])
for w in glob.glob(f"{sys.argv[1]}/*.whl"):
    mods |= {t for t in (n.split("/")[0].removesuffix(".py") for n in zipfile.ZipFile(w).namelist())
             if t.isidentifier()}          # not *.dist-info, *.data, pyzmq.libs
dists = md.packages_distributions()
for m in sorted(mods, key=str.lower):
    try:
        importlib.import_module(m)
        d = (dists.get(m) or ["?"])[0]
        v = md.version(d) if d != "?" else "?"
        print(f"{m:24s} ok       {d} {v}")
    except (Exception, SystemExit) as e:            # a module may also exit during its import
        print(f"{m:24s} MISSING  {type(e).__name__}: {str(e)[:150]}")
PY
echo "env modules exit $?; missing here: $(awk '$2 == "MISSING" {printf "%s ", $1}' "$OUT/env-modules.txt")" >> "$S"

stamp "install"
# a wheel whose distribution the machine has (metadata) is skipped: /tmp/sgl comes first on PYTHONPATH and
# would shadow it (torch's triton, the machine's pydantic / httpx / ...)
TODO=$($PY - "$WHEELS" 2> "$OUT/pip.log" <<'PY'
import glob, importlib.metadata as md, sys
for w in sorted(glob.glob(f"{sys.argv[1]}/*.whl")):
    name = w.rsplit("/", 1)[1].split("-")[0]
    try:
        print(f"skip {name}: the machine has {md.version(name)}", file=sys.stderr)
    except md.PackageNotFoundError:
        print(w)
PY
)
rm -rf "$SGL"
lim 150 $PY -m pip install --no-index --no-deps --no-compile --disable-pip-version-check --target "$SGL" \
  $TODO >> "$OUT/pip.log" 2>&1
note "install exit $? ($(echo $TODO | wc -w) wheels given to pip, $(grep -c '^skip' "$OUT/pip.log") skipped as present: pip.log)"
[ -d "$SGL/sglang" ] || { stamp "sglang did not install: stopping"; exit 1; }
export PYTHONPATH="$SGL:$STANDINS${PYTHONPATH:+:$PYTHONPATH}"

stamp "standins"
# Only packages sglang imports at module level outside any try (IPython: sglang/utils.py; openai: the OpenAI
# protocol; compressed_tensors: the quantization registry; PIL: the multimodal configs). A stand-in for an
# optional import (zstandard, xgrammar) would turn "absent" into "present and broken" (urllib3 reads
# zstandard.ZstdError at class definition), so those stay absent.
rm -rf "$STANDINS"                 # a warm machine's earlier run must not leave one behind
lim 120 $PY - "$STANDINS" IPython openai compressed_tensors PIL > "$OUT/standins.txt" 2>&1 <<'PY'
import os, subprocess, sys
root, names = sys.argv[1], sys.argv[2:]
TEMPLATE = '''"""STAND-IN for the package `{name}`, written by scripts/device_sglang_cuda.sh: NOT the real package, which
does not import on this machine ({why}). The target's own stand-in machinery (checks/targets/sglang/cpu_shims.py):
every attribute and submodule resolves, calling anything raises a HarnessFault naming it."""
import sys

from dpep_parity.checks.targets.sglang import cpu_shims

WHY = "{why}"
__version__ = "0.0.0+dpep.standin"
__dpep_standin__ = True


class _Unavailable(cpu_shims._Unavailable):
    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Unavailable(self._name + "." + item, self._why)

    def __mro_entries__(self, bases):   # class X(standin.Base): a plain class
        return (object,)


class _Submodules(cpu_shims._StandIn):
    def exec_module(self, module):
        super().exec_module(module)
        module.__getattr__ = lambda item, _m=module.__name__: (
            _Unavailable(_m + "." + item, WHY) if not item.startswith("__") else _no(item))


def _no(item):
    raise AttributeError(item)


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Unavailable(__name__ + "." + name, WHY)


sys.meta_path.insert(0, _Submodules(__name__, WHY))    # this package's submodules; the package is this file
'''
os.makedirs(root, exist_ok=True)
made = []
for name in names:
    # in a fresh interpreter: the machine's packages plus /tmp/sgl, as the ranks will see them
    p = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True)
    if p.returncode == 0:
        print(f"{name}: imports, no stand-in")
        continue
    why = (p.stderr.strip().splitlines() or ["exit %d" % p.returncode])[-1][:200]
    os.makedirs(f"{root}/{name}", exist_ok=True)
    with open(f"{root}/{name}/__init__.py", "w") as f:
        f.write(TEMPLATE.format(name=name, why=why.replace("\\", "/").replace('"', "'")))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    check = subprocess.run([sys.executable, "-c", f"import {name}; assert {name}.__dpep_standin__"],
                           capture_output=True, text=True, env=env)
    made.append(name)
    print(f"STAND-IN {name} ({root}/{name}/__init__.py) because: {why}"
          + ("" if check.returncode == 0 else f" -- and the stand-in itself fails: {check.stderr[-300:]}"))
print("stand-ins written:", " ".join(made) or "none")
PY
note "standins exit $?: $(tail -n 1 "$OUT/standins.txt")"

stamp "import"
# As a rank imports: the target's import shims first (torchvision, sgl_kernel stand-ins unless real ones
# import), then sglang, its model runner and the modules the target's first session imports.
lim 180 $PY - > "$OUT/import.log" 2>&1 <<'PY'
import importlib, time, traceback
t = time.time()
from dpep_parity.checks.targets.sglang import cpu_shims
cpu_shims.install_import_shims()
print("target stand-ins installed (cpu_shims.STAND_INS):", [p for p in cpu_shims.STAND_INS if p in cpu_shims._INSTALLED] or "none")
import sglang
print("sglang", sglang.__version__, "from", sglang.__file__)
from sglang.srt.model_executor.model_runner import ModelRunner  # noqa: F401
print("ModelRunner imports")
bad = 0
for m in ("sglang.srt.server_args", "sglang.srt.model_loader.loader", "sglang.srt.models.registry",
          "sglang.srt.layers.attention.torch_native_backend", "sglang.srt.models.qwen3_moe",
          "dpep_parity.checks.targets.sglang.session", "dpep_parity.checks.targets.sglang.units"):
    try:
        importlib.import_module(m)
        print("ok", m)
    except Exception:
        bad += 1
        print("FAILED", m)
        traceback.print_exc()
print(f"import done in {time.time() - t:.1f} s")
raise SystemExit(bad)
PY
rc=$?
note "import exit $rc: $(grep -m1 'target stand-ins' "$OUT/import.log")"
{ echo "--- stand-ins of the target (in memory, every rank): $(grep -m1 'target stand-ins' "$OUT/import.log")"; } >> "$OUT/standins.txt"
[ $rc = 0 ] || tail -n 25 "$OUT/import.log" >> "$S"

stamp "replay: one example per unit, tp1, cuda"
moe=fail
for unit in moe attention decoder model; do
  t=$(left_for 240)
  if [ "$t" -lt 30 ]; then note "replay $unit: skipped, ${t}s of the budget left"; continue; fi
  lim "$t" $PY -m checks.tools.replay --target sglang --device cuda --unit $unit --fixture qwen3-moe \
    --layout tp1 --dtype bfloat16 --layer 1 --batch 'dp0:2+3,4+1 seed=3' --deadline 200 > "$OUT/replay-$unit.log" 2>&1
  rc=$?
  note "replay $unit exit $rc (limit ${t}s; 0 PASS, 1 FAIL or an uncaught error, 3 harness error): $(tail -n 1 "$OUT/replay-$unit.log")"
  # exit 0 is also "skipped: ..." (a unit the release does not reach): only PASS lets the suite run
  [ $unit = moe ] && [ "$(tail -n 1 "$OUT/replay-$unit.log")" = PASS ] && moe=pass
done

if [ $moe = pass ]; then
  t=$(left_for 300)
  if [ "$t" -lt 60 ]; then note "pytest: skipped, ${t}s of the budget left"
  else
    stamp "pytest, world size 1 (limit ${t}s)"
    lim "$t" $PY -m pytest property_tests --target sglang --device cuda --world-sizes 1 -p no:xdist -q -x \
      --deadline 300 -p no:cacheprovider > "$OUT/pytest-tp1.log" 2>&1
    note "pytest exit $?"; tail -n 3 "$OUT/pytest-tp1.log" >> "$S"
  fi
else
  note "pytest: not run (the moe example did not pass)"
fi
stamp done
