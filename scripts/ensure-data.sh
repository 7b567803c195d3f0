#!/usr/bin/env bash
# Makes the offline Fashion-MNIST available: FEDGUIDE_DATA, the Debian package's folder, or install it.
set -euo pipefail
SYSTEM_DIR=/usr/share/datasets/fashion-mnist
has_idx() { ls "$1"/train-images-idx3-ubyte* >/dev/null 2>&1; }

if [ -n "${FEDGUIDE_DATA:-}" ] && { has_idx "$FEDGUIDE_DATA" || has_idx "$FEDGUIDE_DATA/fashion-mnist"; }; then
  echo "Fashion-MNIST: using FEDGUIDE_DATA=$FEDGUIDE_DATA"; exit 0
fi
if has_idx "$SYSTEM_DIR"; then
  echo "Fashion-MNIST: using $SYSTEM_DIR"; exit 0
fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
  echo "Fashion-MNIST: installing the Debian package dataset-fashion-mnist"
  apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null && apt-get install -y -q dataset-fashion-mnist >/dev/null; }
  has_idx "$SYSTEM_DIR" && { echo "Fashion-MNIST: installed in $SYSTEM_DIR"; exit 0; }
fi
cat >&2 <<MSG
Fashion-MNIST was not found. Either
  - install it:  sudo apt-get install dataset-fashion-mnist   (files land in $SYSTEM_DIR), or
  - put train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz], t10k-images-idx3-ubyte[.gz] and
    t10k-labels-idx1-ubyte[.gz] in a folder and export FEDGUIDE_DATA=/that/folder
(with a network, fedguide also downloads them itself into ~/.cache/fedguide on first use).
MSG
exit 1
