"""Any image folder tree, one sub-folder per domain and per class: the ``imagefolder`` source.

Layouts read (folder names are the class and domain names, kept verbatim):

- ``root/<domain>/<class>/*.{jpg,jpeg,png,bmp}``: split per (domain, class) by a seeded, stratified draw
  of ``test_fraction``;
- ``root/<domain>/{train,test}/<class>/*``: the dataset's own split, kept; decided per domain, so a
  tree may mix both forms;
- with ``domain_level: false``, ``root/<class>/*`` or ``root/{train,test}/<class>/*`` (no domain ids).

Decisions: classes default to the union of the class folders of the selected domains (a class a domain
lacks simply has no samples there); a class named in ``classes`` must exist, with images, in every
selected domain, since a missing one there usually means a wrong root. An empty class folder is an
error, not a silent zero. Files with other suffixes (thumbnails' databases, notes) are ignored. Samples
are ordered by domain, class and file name, so two runs give identical tensors.

``max_train_per_class`` (shared by every image source, see ``_images``) keeps a seeded draw of at most
that many training images per domain and class, after the split: FedCADO's 30 images per class and
client on any folder tree.

Everything is held in memory as float32 [N, 3, S, S] with S = ``image_size`` (default 32): DomainNet's
~590k images take ~7 GB at 32 but ~350 GB at 224, which does not fit in memory — hence the small default.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from pydantic import Field

from fedguide.data.sources._images import (ImageParams, Sample, build_splits, check_known, list_images,
                                           sorted_names, subfolders)
from fedguide.data.sources.base import DATASETS, DatasetSplits
from fedguide.registry import ConfigError

SPLITS = ("train", "test")
LAYOUT = ("root/<domain>/<class>/*.{jpg,jpeg,png,bmp} or root/<domain>/{train,test}/<class>/*; "
          "with domain_level: false, root/<class>/* or root/{train,test}/<class>/*")


class ImageFolderParams(ImageParams):
    root: Optional[str] = Field(None, description="the folder holding the domain (or class) folders; required")
    domains: Optional[list[str]] = Field(None, description="domain folders to read, in this order (default: all)")
    classes: Optional[list[str]] = Field(None, description="class folders to read, in this order (default: all)")
    domain_level: bool = Field(True, description="false: root holds the class folders directly, no domains")


def split_parts(folder: Path) -> list[tuple[Optional[str], Path]]:
    """The folder's own train/test split when it has both, else the folder itself (split decided later)."""
    if all((folder / s).is_dir() for s in SPLITS):
        return [(s, folder / s) for s in SPLITS]
    return [(None, folder)]


def domain_base(root: Path, domain: Optional[str]) -> Path:
    return root / domain if domain is not None else root


def resolve_classes(root: Path, domains: list[Optional[str]], classes: Optional[list[str]], layout: str) -> list[str]:
    """``classes`` checked to exist in every domain, or (None) the union of the domains' class folders."""
    found = {d: {c for _, part in split_parts(domain_base(root, d)) for c in subfolders(part)} for d in domains}
    if classes is None:
        classes = sorted_names(c for names in found.values() for c in names)
        if not classes:
            raise ConfigError(f"no class folders under {root}. Expected layout: {layout}")
        return classes
    if not classes or len(set(classes)) != len(classes):
        raise ConfigError(f"classes {classes} must name at least one class folder, each once")
    for d in domains:
        missing = [c for c in classes if c not in found[d]]
        if missing:
            raise ConfigError(f"class folders {missing} missing in {domain_base(root, d)} "
                              f"(found {sorted_names(found[d])}). Expected layout: {layout}")
    return list(classes)


def read_tree(root: Path, domains: list[Optional[str]], classes: Optional[list[str]],
              layout: str) -> tuple[list[Sample], list[str]]:
    """Samples under ``root/<domain>`` (or ``root`` itself for the domain ``None``), and the class names.

    ``domains`` are folder names already checked to exist (or ``[None]``); ``classes`` None = from folders.
    """
    classes = resolve_classes(root, domains, classes, layout)
    samples = []
    for d in domains:
        for split, part in split_parts(domain_base(root, d)):
            for c in classes:
                folder = part / c
                if not folder.is_dir():
                    continue
                files = list_images(folder)
                if not files:
                    raise ConfigError(f"{folder} holds no .jpg/.jpeg/.png/.bmp images. Expected layout: {layout}")
                samples.extend(Sample(p, c, d, split) for p in files)
    return samples, classes


def read_domain_tree(root: Path, domains: Optional[list[str]], classes: Optional[list[str]],
                     layout: str) -> tuple[list[Sample], list[str], list[str]]:
    """``root/<domain>/...``: samples, class names, domain names (``domains`` None = every domain folder)."""
    present = subfolders(root)
    if not present:
        raise ConfigError(f"no domain folders under {root}. Expected layout: {layout}")
    if domains is None and set(present) == set(SPLITS):
        raise ConfigError(f"{root} holds train/ and test/ folders rather than domains; set domain_level: false "
                          f"or point root at the folder above the domains. Expected layout: {layout}")
    domains = check_known(domains, present, f"domain folders of {root}", layout)
    samples, classes = read_tree(root, domains, classes, layout)
    return samples, classes, domains


def read_folder_dataset(root: Path, params: ImageParams, layout: str, domains: Optional[list[str]] = None,
                        classes: Optional[list[str]] = None, domain_level: bool = True) -> DatasetSplits:
    """The tensors of a folder tree; presets call this with their own domain and class lists."""
    if not root.is_dir():
        raise ConfigError(f"{root} is not a folder. Expected layout: {layout}")
    if domain_level:
        samples, classes, domain_names = read_domain_tree(root, domains, classes, layout)
        return build_splits(samples, classes, domain_names, params, layout)
    samples, classes = read_tree(root, [None], classes, layout)
    return build_splits(samples, classes, None, params, layout)


@DATASETS.register("imagefolder", params=ImageFolderParams,
                   summary="image folders root/<domain>/<class>/*.jpg (optional train/test level), with domain ids")
def load_imagefolder(params: ImageFolderParams) -> DatasetSplits:
    if not params.root:
        raise ConfigError(f"imagefolder needs data.root. Expected layout: {LAYOUT}")
    root = Path(params.root).expanduser()
    if params.domains is not None and not params.domain_level:
        raise ConfigError("domains selects domain folders, but domain_level is false; drop one of the two")
    return read_folder_dataset(root, params, LAYOUT, params.domains, params.classes, params.domain_level)
