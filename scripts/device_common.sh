# Sourced by the device scripts (scripts/device_*.sh): the repository root as working folder, OUT (the caller's
# default as $1) created, offline hub settings, the fixture cache, the interpreter, the summary file, a stamp
# with elapsed seconds, and `lim SECONDS CMD...` (SIGINT first, so pytest still prints its summary).
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-$1}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export DPEP_FIXTURE_CACHE="${DPEP_FIXTURE_CACHE:-/tmp/dpep-fixtures}"
PY="${PYTHON:-python3}"
S="$OUT/summary.txt"
T0=$(date +%s)
stamp() { echo "== $* (+$(( $(date +%s) - T0 ))s)" | tee -a "$S"; }
lim() { local s=$1; shift; timeout -s INT -k 30 "$s" "$@"; }
