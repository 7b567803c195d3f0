#!/usr/bin/env bash
# fedguide's GPU checks in one run, on a GPU host as it is (no package index needed), in under 8 minutes:
#   1. a CUDA GPU is there (nvidia-smi and torch agree), else exit 3 at once, saying so;
#   2. set-up (scripts/device_check_setup.py): what the host's Python lacks is installed from the carried
#      wheels (the folder given as the argument, or $FEDGUIDE_WHEELS, or wheels/; scripts/wheels.sh builds it)
#      into a temporary folder of its own, then pip check and real imports; exit 2 if fedguide's core does
#      not import;
#   3. benchmarks/gpu_checks.py: every registered method one round on CUDA against the same run on the CPU
#      (first-round loss and final weights within stated tolerances), host syncs and host-to-device bytes per
#      step against the simulated device's counts, determinism across two fresh processes, bf16 and fp16;
#   4. benchmarks/paper_scale.py: FedAvg with ResNet-18 on a CIFAR-100 stand-in (the feddw_cifar100_practical
#      config with method.name=fedavg), and FedDifRC's CIFAR-10 config with a random pipeline of Stable
#      Diffusion 1.5's channel widths (fused_dim 512; the hub model is not downloadable there);
#   5. where the host has pytest: `pytest -m gpu` on tests/gpu and tests/test_paper_scale.py, less the agreement
#      of every method (step 3 ran it): resume from a GPU checkpoint on the CPU, the worker pool and Flower's
#      actors sharing the GPU, compiled against eager, head training on cached features.
# Everything runs on stand-in data: the host needs no data set. A check that needs a package the host lacks
# (scikit-learn for FedDifRC, diffusers for the guided methods) says so in its line instead of running.
# Results in $OUT/<card> when $OUT is set, else benchmarks/results/device_check/<card> (<card>-dry-run for a
# dry run), six files:
#   summary.txt       every step's status and key numbers, every failure as a sentence naming its step;
#   environment.txt   card, versions, commit, install log, pip check;
#   gpu_checks.log, gpu_checks.json, paper_scale.log, pytest_gpu.log   the steps' own output.
# Each step has a time cap, cut to what is left of DEVICE_CHECK_SECONDS (default 450), so that the run gives
# its signal within 8 minutes; a step stopped at its cap is reported with what it was doing. The caps are an
# H200's measured times with room (benchmarks/results/device_check/nvidia-h200/README.md): set-up 23 s, the
# GPU checks about 200 s, each paper_scale run about 60 s, most of it its first round's kernel selection, pytest
# about 50 s (4 workers).
# Exit status: 0 every check ran and passed, 1 a check failed, timed out or could not run (summary.txt says
# which and why), 2 set-up failed, 3 no CUDA GPU on this machine.
# A dry run without a GPU: FEDGUIDE_CHECK_DEVICE=simulated runs the checks with train.device: simulated
# (the CPU under CUDA's rules) instead of cuda, DEVICE_CHECK_QUICK=1 with the smallest sizes
# (tests/test_device_check.py does both, with a stand-in nvidia-smi); nothing then measures a GPU.
#
#   scripts/device-check.sh [WHEELS_DIR]        (PYTHON=... to choose the interpreter; default python3;
#                                                FEDGUIDE_WHEELS=none to install nothing)
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
START=$(date +%s)
BUDGET=${DEVICE_CHECK_SECONDS:-450}
DEVICE="${FEDGUIDE_CHECK_DEVICE:-cuda}"
QUICK="${DEVICE_CHECK_QUICK:-}"
[ "$QUICK" = 0 ] && QUICK=""

no_gpu() {
  echo "device-check: no CUDA GPU on this machine ($1); run this script on a GPU host. Nothing was run." >&2
  exit 3
}

# ---- 1. the GPU, before anything is installed ---------------------------------------------------------
command -v nvidia-smi >/dev/null 2>&1 || no_gpu "nvidia-smi is not on PATH"
CARD="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)"
[ -n "$CARD" ] || no_gpu "nvidia-smi lists no GPU"
case "$DEVICE" in
  cuda)
    "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null \
      || no_gpu "nvidia-smi lists '$CARD' but $PY's torch cannot use CUDA (no torch, or a CPU-only build)" ;;
  simulated) ;;
  *) echo "device-check: FEDGUIDE_CHECK_DEVICE=$DEVICE: write cuda (the default) or simulated" >&2; exit 2 ;;
esac

SLUG="$(echo "$CARD" | tr '[:upper:]' '[:lower:]' | tr -cs 'a-z0-9' '-' | sed 's/^-*//; s/-*$//')"
[ "$DEVICE" = simulated ] && SLUG="${SLUG:-gpu}-dry-run"  # never mistaken for a GPU's results
RESULTS="${OUT:-$REPO/benchmarks/results/device_check}/${SLUG:-gpu}"
mkdir -p "$RESULTS"
rm -f "$RESULTS"/summary.txt "$RESULTS"/environment.txt "$RESULTS"/gpu_checks.* "$RESULTS"/paper_scale.log \
  "$RESULTS"/pytest_gpu.log
ENV_LOG="$RESULTS/environment.txt"
SUMMARY="$RESULTS/summary.txt"
: >"$SUMMARY"
FAILED=0
note() { echo "$*" | tee -a "$SUMMARY"; }
# Every way out writes the last line: the total and why it ended.
finish() {
  note "total: $(($(date +%s) - START)) s; $1"
  exit "$2"
}
# Scratch (the set-up's installs, run folders, pipelines) outside $OUT, removed at exit.
WORK="$(mktemp -d "${TMPDIR:-/tmp}/fedguide-device-check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
export TMPDIR="$WORK"

if [ "$DEVICE" = simulated ]; then
  note "device-check: DRY RUN with train.device: simulated on the CPU (FEDGUIDE_CHECK_DEVICE=simulated)${QUICK:+, smallest sizes (DEVICE_CHECK_QUICK)}; nvidia-smi names '$CARD', but nothing here measures a GPU; results in $RESULTS"
else
  note "device-check on $CARD${QUICK:+ (smallest sizes: DEVICE_CHECK_QUICK)}; results in $RESULTS"
fi

# The commit: from git where the tree has its .git, else from what scripts/wheels.sh recorded, with
# whether this tree is still the one it recorded (the same hash over the same files).
tree_hash() {
  (cd "$REPO" && find src benchmarks scripts configs -type f \( -name '*.py' -o -name '*.sh' -o -name '*.yaml' \) \
    | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c 1-64)
}
WHEELS="${1:-${FEDGUIDE_WHEELS:-}}"
[ -z "$WHEELS" ] && [ -d "$REPO/wheels" ] && WHEELS="$REPO/wheels"
[ "$WHEELS" = none ] && WHEELS=""
if COMMIT="$(git -C "$REPO" rev-parse HEAD 2>/dev/null)"; then
  [ -n "$(git -C "$REPO" status --porcelain --untracked-files=no 2>/dev/null)" ] && COMMIT+=" with uncommitted changes"
elif [ -n "$WHEELS" ] && [ -f "$WHEELS/COMMIT" ]; then
  COMMIT="$(sed -n 's/^commit: //p' "$WHEELS/COMMIT") (recorded by scripts/wheels.sh on $(sed -n 's/^built: //p' \
    "$WHEELS/COMMIT"); this tree is $( [ "$(sed -n 's/^tree_sha256: //p' "$WHEELS/COMMIT")" = "$(tree_hash)" ] \
    && echo 'the one it recorded' || echo 'NOT the one it recorded: it changed since'))"
else
  COMMIT="unknown (no .git here and no COMMIT file among the wheels)"
fi
note "fedguide commit: $COMMIT"
{
  echo "card: $CARD"
  nvidia-smi
  echo "python: $("$PY" -c 'import sys; print(sys.version)')"
  echo "fedguide commit: $COMMIT"
  echo "tree_sha256: $(tree_hash)"
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
} >"$ENV_LOG" 2>&1

# step NAME LOG CAP KEYS COMMAND...: runs COMMAND under the smaller of CAP and the time left, appending to
# LOG; summary.txt gets the step's status and the lines of its output that match KEYS.
step() {
  local name="$1" log="$2" cap="$3" keys="$4"
  shift 4
  local left=$((BUDGET - ($(date +%s) - START)))
  [ "$cap" -gt "$left" ] && cap=$left
  if [ "$cap" -lt 10 ]; then
    note "$name: not run: the run's time budget ($BUDGET s) is spent"
    FAILED=1
    return 1
  fi
  local t0 rc seen took
  t0=$(date +%s)
  echo "== $name (cap ${cap}s): $*" >>"$log"
  seen=$(wc -l <"$log")
  timeout --kill-after=10 "$cap" "$@" >>"$log" 2>&1
  rc=$?
  took=$(($(date +%s) - t0))
  case $rc in
    0) note "$name: ok (${took} s)" ;;
    124|137) note "$name: TIMED OUT: stopped at its cap of ${cap} s (see $(basename "$log"))"; FAILED=1 ;;
    *) note "$name: FAILED (exit $rc after ${took} s): $(tail -n +"$((seen + 1))" "$log" | grep -v '^ *|' \
         | grep . | tail -n 1 | cut -c 1-300) (see $(basename "$log"))"; FAILED=1 ;;
  esac
  [ -z "$keys" ] || grep -E "$keys" <(tail -n +"$((seen + 1))" "$log") | sed "s/^/  $name: /" | cut -c 1-600 \
    | tee -a "$SUMMARY"
  return $rc
}

# ---- 2. set-up: the carried wheels into a folder of this run's own, pip check, imports ---------------------
SITE="$WORK/site"
GROUPS_FILE="$WORK/groups"
export PYTHONPATH="$SITE:$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 FEDGUIDE_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
cd "$REPO" || finish "set-up FAILED: cannot enter $REPO" 2
if ! step "set-up" "$ENV_LOG" 45 "" "$PY" scripts/device_check_setup.py ${WHEELS:+--wheels "$WHEELS"} \
     --site "$SITE" --summary "$SUMMARY" --groups "$GROUPS_FILE"; then
  finish "set-up FAILED (see the set-up lines above and environment.txt): no check was run" 2
fi
has() { grep -q "^$1=ok" "$GROUPS_FILE" 2>/dev/null; }
missing() { sed -n "s/^$1=missing: //p" "$GROUPS_FILE" 2>/dev/null; }

# ---- 3. the GPU checks -------------------------------------------------------------------------------------
GPU_CAP=270  # the longest step: every method on the GPU while their CPU runs go alongside (about 200 s on an H200)
RESULT_LINES='^(agreement|transfers|determinism|precision) .*: (ok|FAILED|not run)|^gpu_checks:'
if ! step "gpu checks" "$RESULTS/gpu_checks.log" "$GPU_CAP" "$RESULT_LINES" \
     "$PY" benchmarks/gpu_checks.py --device "$DEVICE" --seconds $((GPU_CAP - 20)) \
     --json "$RESULTS/gpu_checks.json" ${QUICK:+--quick}; then
  # a method still running when the cap stopped the script: named, with the methods it kept from running
  running="$(grep -E '^agreement .*: running$' "$RESULTS/gpu_checks.log" | tail -n 1 | sed 's/^agreement \(.*\): running$/\1/')"
  if [ -n "$running" ] && ! grep -qE "^agreement $running: (ok|FAILED|not run)" "$RESULTS/gpu_checks.log"; then
    note "  gpu checks: agreement $running was running when the cap stopped it; the methods after it did not run"
  fi
fi
# A check that could not run (a package this host lacks, the time budget) is no pass; --quick's choice is.
unrun=$(grep -E '^(agreement|transfers|determinism|precision) .*: not run' "$RESULTS/gpu_checks.log" \
  | grep -vc -- '--quick runs')
if [ "$unrun" -gt 0 ]; then
  note "  gpu checks: $unrun check(s) did not run (their lines above say why)"
  FAILED=1
fi

# ---- 4. cost projections on stand-in data ------------------------------------------------------------------
PAPER_KEYS="^(setup_s|s_per_round|first_round_extra_s|peak_gpu_gib|projected_hours|ratio_vs_floor)=|^(guidance|device|floor): "
PAPER_LOG="$RESULTS/paper_scale.log"
if [ -n "$QUICK" ]; then  # a CPU dry run: 100 and 20 images over 2 clients, one epoch, a narrow ResNet-18;
  # FedDifRC with an MLP, TDCL only, the tiny pipeline at its 32 px (the simulated device watches every UNet
  # operation, slow on a CPU)
  SMALL=(train.epochs=1 clients.num=2 clients.per_round=2 partition.name=iid)
  FEDAVG_SIZE=(--fraction 0.002 "${SMALL[@]}" model.width=8)
  DIFRC_SIZE=(--fraction 0.0004 "${SMALL[@]}" --guidance tiny model.name=mlp method.fused_dim=auto
              method.image_size=pipeline method.fit_samples=10 method.ndcr=false)
else  # FedDifRC's 11 UNet passes per image at 224 px dominate: 1000 images
  FEDAVG_SIZE=(--fraction 0.2)
  DIFRC_SIZE=(--fraction 0.02 --guidance sd-widths method.fused_dim=512)
fi
step "paper_scale FedAvg ResNet-18 CIFAR-100" "$PAPER_LOG" 90 "$PAPER_KEYS" \
  "$PY" benchmarks/paper_scale.py configs/paper/feddw_cifar100_practical.yaml --rounds 2 --device "$DEVICE" \
  "${FEDAVG_SIZE[@]}" method.name=fedavg
if ! has guidance; then
  note "paper_scale FedDifRC CIFAR-10: not run: it needs the guidance pipelines, which do not import here ($(missing guidance))"
  FAILED=1
elif ! has sklearn; then
  note "paper_scale FedDifRC CIFAR-10: not run: its PCA needs scikit-learn, which does not import here ($(missing sklearn)); scripts/wheels.sh with SKLEARN_PYTHON set to this host's Python (the set-up lines name it) carries it"
  FAILED=1
else
  step "paper_scale FedDifRC CIFAR-10" "$PAPER_LOG" 90 "$PAPER_KEYS" \
    "$PY" benchmarks/paper_scale.py configs/paper/feddifrc_cifar10_dir0.05.yaml --rounds 2 --device "$DEVICE" \
    "${DIFRC_SIZE[@]}"
fi

# ---- 5. the pytest GPU tests (not on the dry run: they need CUDA) -----------------------------------------
PYTEST_LOG="$RESULTS/pytest_gpu.log"
if [ "$DEVICE" != cuda ]; then
  note "pytest -m gpu: not run on the dry run (its tests need CUDA)"
elif ! "$PY" -c 'import pytest' 2>/dev/null; then
  note "pytest -m gpu: not run: this host's Python has no pytest (the checks above cover the same ground but for resume, the worker pool, Flower and torch.compile)"
else
  workers=()
  "$PY" -c 'import xdist' 2>/dev/null && workers=(-n 4)
  step "pytest -m gpu" "$PYTEST_LOG" 100 "^(FAILED|ERROR|SKIPPED)|[0-9]+ (passed|failed)" \
    "$PY" -m pytest -m gpu tests/gpu tests/test_paper_scale.py -k "not every_method_agrees" -p no:cacheprovider \
    -q -rfEs "${workers[@]}"
fi

if [ $FAILED = 0 ]; then
  finish "every check passed" 0
fi
finish "some checks FAILED or did not run (the lines above say which and why)" 1
