#!/usr/bin/env bash
# fedguide's GPU checks in one run, for a GPU host as it is (no package index needed), in under 8 minutes:
#   1. a CUDA GPU is there (nvidia-smi and torch agree), else exit 3 at once, saying so;
#   2. the carried wheels (folder given as the argument or $FEDGUIDE_WHEELS; scripts/wheels.sh builds it) and
#      fedguide itself are installed with pip --no-deps; the dependencies still missing are named;
#   3. pytest -m gpu;
#   4. benchmarks/paper_scale.py: FedAvg with ResNet-18 on CIFAR-100-shaped data (10 clients, batch 128: the
#      feddw_cifar100_practical config with method.name=fedavg), and FedDifRC's CIFAR-10 config with a tiny
#      stand-in guidance pipeline (Stable Diffusion is not downloadable there) and its FedAvg row;
#   5. determinism: the same small GPU run twice with train.deterministic=true gives identical metrics;
#   6. benchmarks/parallel_clients.py with workers 1, 2, 4 and 8 (CPU, FMNIST-shaped CNN workload).
# Results: $OUT/<card> when $OUT is set, else benchmarks/results/device_check/<card>: environment.txt (card,
# versions, install log), one log per step and summary.txt (every step's status and key numbers).
# Each step has a time cap, so the whole run stays under 8 minutes; a step that hits its cap is reported.
# Exit status: 0 every check passed, 1 a check failed (summary.txt says which), 2 set-up failed (install or
# imports), 3 no CUDA GPU on this machine.
#
#   scripts/device-check.sh [WHEELS_DIR]        (PYTHON=... to choose the interpreter; default python3)
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
START=$(date +%s)
BUDGET=${DEVICE_CHECK_SECONDS:-450}  # the steps' caps are cut to what is left of this

no_gpu() {
  echo "device-check: no CUDA GPU on this machine ($1); run this script on a GPU host. Nothing was run." >&2
  exit 3
}

# ---- 1. the GPU, before anything is installed ---------------------------------------------------------
command -v nvidia-smi >/dev/null 2>&1 || no_gpu "nvidia-smi is not on PATH"
CARD="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)"
[ -n "$CARD" ] || no_gpu "nvidia-smi lists no GPU"
"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null \
  || no_gpu "nvidia-smi lists '$CARD' but $PY's torch cannot use CUDA (no torch, or a CPU-only build)"

SLUG="$(echo "$CARD" | tr '[:upper:]' '[:lower:]' | tr -cs 'a-z0-9' '-' | sed 's/^-*//; s/-*$//')"
RESULTS="${OUT:-$REPO/benchmarks/results/device_check}/${SLUG:-gpu}"
mkdir -p "$RESULTS"
ENV_LOG="$RESULTS/environment.txt"
SUMMARY="$RESULTS/summary.txt"
: >"$SUMMARY"
FAILED=0
note() { echo "$*" | tee -a "$SUMMARY"; }
{
  echo "card: $CARD"
  nvidia-smi
  echo "python: $("$PY" -c 'import sys; print(sys.version)')"
  echo "torch: $("$PY" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)')"
  echo "fedguide commit: $(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo unknown)$(
    [ -n "$(git -C "$REPO" status --porcelain --untracked-files=no 2>/dev/null)" ] && echo +dirty)"
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
} >"$ENV_LOG" 2>&1
note "device-check on $CARD; results in $RESULTS"

# ---- 2. install: carried wheels, then fedguide without its dependencies ----------------------------------
WHEELS="${1:-${FEDGUIDE_WHEELS:-}}"
if [ -n "$WHEELS" ] && ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  note "set-up: no .whl files in $WHEELS (build them with scripts/wheels.sh $WHEELS)"
  exit 2
fi
{
  echo "== install"
  if [ -n "$WHEELS" ]; then
    "$PY" -m pip install --no-index --no-deps --no-compile --disable-pip-version-check "$WHEELS"/*.whl || exit 1
  fi
  # No build isolation: the host has setuptools but no index to fetch a fresh one from.
  if ! "$PY" -m pip install --no-index --no-deps --no-build-isolation --disable-pip-version-check -e "$REPO"; then
    echo "pip install -e failed; fedguide is imported from $REPO/src instead"
  fi
} >>"$ENV_LOG" 2>&1
[ $? = 0 ] || { note "set-up: installing the wheels failed (see environment.txt)"; exit 2; }
export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}"  # a no-op after a working editable install
export HF_HUB_OFFLINE=1 FEDGUIDE_OFFLINE=1 PYTHONUNBUFFERED=1
cd "$REPO" || exit 2

# Every requirement of pyproject.toml's core list must import; the guidance extra's are named when missing.
if ! "$PY" - >>"$ENV_LOG" 2>&1 <<'EOF'
import importlib.metadata as md, re, sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
def missing(reqs):
    names = [re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0] for r in reqs if not r.startswith("fedguide")]
    out = []
    for n in names:
        try:
            md.distribution(n)
        except md.PackageNotFoundError:
            out.append(n)
    return out
core = missing(project["dependencies"])
extra = missing(project.get("optional-dependencies", {}).get("guidance", []))
print("missing core dependencies:", core or "none")
print("missing guidance dependencies:", extra or "none")
import fedguide.cli  # noqa: F401  (fails here, not in every step, when something is still missing)
sys.exit(1 if core else 0)
EOF
then
  note "set-up: fedguide's dependencies are incomplete (see environment.txt); carry them: scripts/wheels.sh DIR"
  exit 2
fi
grep "^missing" "$ENV_LOG" | tee -a "$SUMMARY"

# ---- the steps ---------------------------------------------------------------------------------------
# The lines of a step's log that summary.txt repeats: paper_scale's keys, parallel_clients' and pytest's results.
KEY_LINES="^(setup_s|s_per_round|peak_gpu_gib|projected_hours|ratio_vs_floor|ratio_vs_flower|determinism)="
KEY_LINES+="|^(guidance|device|floor): |^fedguide workers=[0-9]+ ->|^speed-up|^[0-9]+ (passed|failed|skipped|errors?)"

# step NAME LOG CAP_SECONDS COMMAND...: runs COMMAND under the smaller of its cap and the time left.
step() {
  local name="$1" log="$2" cap="$3"
  shift 3
  local left=$((BUDGET - ($(date +%s) - START)))
  [ "$cap" -gt "$left" ] && cap=$left
  if [ "$cap" -lt 10 ]; then
    note "$name: skipped (the run's time budget is spent)"
    FAILED=1
    return
  fi
  local t0 rc seen
  t0=$(date +%s)
  echo "== $name (cap ${cap}s): $*" >>"$log"
  seen=$(wc -l <"$log")
  timeout --kill-after=15 "$cap" "$@" >>"$log" 2>&1
  rc=$?
  local took=$(($(date +%s) - t0))
  case $rc in
    0) note "$name: ok (${took}s)" ;;
    124) note "$name: TIMED OUT after ${cap}s"; FAILED=1 ;;
    *) note "$name: FAILED (exit $rc, ${took}s; see $(basename "$log"))"; FAILED=1 ;;
  esac
  grep -E "$KEY_LINES" <(tail -n +"$((seen + 1))" "$log") | sed "s/^/  $name: /" | tee -a "$SUMMARY"
}

# 3. GPU tests: only the files that hold some, so that a test module needing an absent package (Flower)
#    cannot stop the collection.
GPU_TESTS=$(grep -rl --include='test_*.py' "mark.gpu" tests 2>/dev/null | sort)
if [ -n "$GPU_TESTS" ]; then
  # shellcheck disable=SC2086  # one argument per file
  step "pytest -m gpu" "$RESULTS/pytest_gpu.log" 90 "$PY" -m pytest -m gpu -p no:cacheprovider $GPU_TESTS
else
  note "pytest -m gpu: no GPU tests in tests/"
fi

# 4. Cost projections on stand-in data.
step "paper_scale FedAvg ResNet-18 CIFAR-100" "$RESULTS/paper_scale_fedavg_resnet18_cifar100.log" 100 \
  "$PY" benchmarks/paper_scale.py configs/paper/feddw_cifar100_practical.yaml --rounds 2 --fraction 0.5 \
  --device cuda method.name=fedavg
step "paper_scale FedDifRC CIFAR-10" "$RESULTS/paper_scale_feddifrc_cifar10.log" 90 \
  "$PY" benchmarks/paper_scale.py configs/paper/feddifrc_cifar10_dir0.05.yaml --rounds 2 --fraction 0.1 \
  --device cuda --guidance tiny
step "paper_scale FedAvg on FedDifRC's CIFAR-10 config" "$RESULTS/paper_scale_feddifrc_cifar10_fedavg.log" 50 \
  "$PY" benchmarks/paper_scale.py configs/paper/feddifrc_cifar10_dir0.05.yaml --rounds 2 --fraction 0.1 \
  --device cuda method.name=fedavg

# 5. Determinism on the GPU: two runs, one config, identical metrics and weights.
step "determinism" "$RESULTS/determinism.log" 50 "$PY" - <<'EOF'
import hashlib, json, sys, tempfile
from pathlib import Path
from fedguide.config import TrainConfig, build_config
from fedguide.fl.engine import TIMING_METRICS, Experiment
from fedguide.fl.setup import prepare
if "deterministic" not in TrainConfig.model_fields:
    print("determinism=unavailable (this fedguide has no train.deterministic)")
    sys.exit(1)
train = {"rounds": 2, "epochs": 1, "batch_size": 64, "device": "cuda", "deterministic": True}
if "augment" in TrainConfig.model_fields:
    train["augment"] = "crop_flip"  # seeded on the device: part of what must repeat
raw = {"data": {"name": "standin", "like": "cifar10", "scale": 0.04}, "model": {"name": "resnet10"},
       "partition": {"name": "dirichlet", "alpha": 0.5, "min_size": 10}, "clients": {"num": 4, "per_round": 4},
       "train": train, "seed": 0}
def run(out):
    Experiment(prepare(build_config(raw)), out, log=lambda s: None).run()
    rows = [{k: v for k, v in json.loads(x).items() if k not in TIMING_METRICS}
            for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return rows, hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
with tempfile.TemporaryDirectory() as tmp:
    (a, wa), (b, wb) = run(Path(tmp) / "a"), run(Path(tmp) / "b")
print(json.dumps(a))
same = a == b and wa == wb
print(f"determinism={'identical' if same else 'DIFFERENT'} (metrics {'equal' if a == b else 'differ'}, "
      f"final weights {'equal' if wa == wb else 'differ'})")
sys.exit(0 if same else 1)
EOF

# 6. The worker pool on this host's cores (CPU), FMNIST-shaped stand-in data, a quarter of its size.
DEVICE_KEY=$("$PY" -c 'from fedguide.config import TrainConfig
print("train.device=cpu" if "device" in TrainConfig.model_fields else "")')
for w in 1 2 4 8; do
  # shellcheck disable=SC2086  # DEVICE_KEY is one override or none
  step "parallel_clients workers=$w" "$RESULTS/parallel_clients.log" 30 \
    "$PY" benchmarks/parallel_clients.py --rounds 3 --workers "$w" --no-flower \
    data.name=standin data.like=fmnist data.scale=0.25 $DEVICE_KEY
done

note "total: $(($(date +%s) - START)) s; $([ $FAILED = 0 ] && echo 'every check passed' || echo 'some checks FAILED')"
exit $FAILED
