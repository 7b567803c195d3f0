"""Named multi-domain image datasets: each knows its domains, classes and on-disk layout.

``office_caltech10``, ``domainnet`` and ``nicopp`` are folder trees read through ``imagefolder``;
``nicopp_unique``, ``openimage_fedcado`` / ``openimage_feddisc``, ``ham10000`` and ``eurosat`` have their
own layouts. Every one takes ``max_train_per_class`` (a seeded draw of at most that many training images
per domain and class, test images untouched; see ``_images``), FedCADO's 30 images per class and
client. None is downloaded automatically except EuroSAT (one 90 MB zip, also taken from a searched folder
when it lies there): the others are several gigabytes or sit behind a registration page, so a missing
dataset is the standard "not found" ConfigError (``_files``), saying where to get it and the layout
expected. Roots are searched in data.root, $FEDGUIDE_DATA and the download folder, each as it is or with
the dataset's usual folder name appended.

Decisions where the datasets or papers are silent:

- Office-Caltech-10 and NICO++ have no official split used in FL: a seeded stratified ``test_fraction``
  per domain and class (see ``_images``), unless the tree has ``<domain>/{train,test}/`` folders
  (or, for NICO++, the official ``<domain>_{train,test}.txt`` lists of NICO_DG_official).
- DomainNet: the official ``<domain>_{train,test}.txt`` lists are honoured per domain when both are
  present (in root, root/splits or root/txt); the numeric label in a line is ignored, the class comes from
  the path, so a class selection re-numbers labels consistently. ``subset: ten`` is FedBN's 10 classes;
  ``num_classes: N`` keeps the first N in the official (alphabetical) order, as FedCADO (90) and FedDISC
  (90 / 150 / 345) do.
- NICO++ has two tracks, two presets: ``nicopp`` (the 6 common contexts, the same for every class) and
  ``nicopp_unique`` (every class has contexts of its own). They share neither domains, nor folder order
  (``<domain>/<class>`` vs ``<class>/<context>``), nor split-list names, nor parameters, so one preset
  with a ``track`` switch would give ``domains`` two meanings under one name. Source of truth for the
  unique track: the official release as FedCADO's and FedDISC's released loaders read it,
  ``NICO_unique/<class>/<context>/*.jpg`` with the lists
  ``NICO_unique_official/<class>_<context>_{train,test}.txt``, taken per (class, context) when present,
  else the seeded split. Domains: both papers make a class's six unique contexts six domains (their
  client0..client5) without saying which context of one class shares a domain with which of another.
  Here a class's contexts are sorted by name and the k-th joins domain ``unique<k>``: the order both papers
  list them in (FedDISC: bear = "black, in cage, lying, roaring, sitting, wombat"; FedCADO Fig. 9's
  columns) and the one the authors' released loaders deal them in. ``num_groups`` K deals a class's
  contexts round-robin (context i to group i mod K), for trees with more contexts than groups; every
  class needs at least K.
- OpenImage (FedCADO Table 5, which states it follows FedDISC's partition; FedDISC's own text defers the
  list to a supplement that is not part of the paper, and both authors' released loaders use this same
  table): labels are the 20 super-categories, domain ``client<k>`` holds the k-th fine-grained subclass of
  every super-category. Images come from Open Images' own train/test splits as a FiftyOne download lays
  them out. Only positive image-level labels (Confidence 1) count; an image positive for two chosen
  subclasses of one domain is dropped (its super-class label would be ambiguous); label rows whose image
  was not downloaded are skipped (a partial download is the normal case), but every selected domain and
  class must keep at least one training image. The same image may serve two domains (``Knife`` is client3's
  kitchen utensil and client0's weapon), as in the papers. FedCADO trains on 30 images per class and
  client (``max_train_per_class: 30``, a seeded draw); FedDISC's 300-500 per subcategory is not pinned
  down, so ``openimage_feddisc`` keeps all by default.
- HAM10000: labels = ``dx``, domains = the ``dataset`` column (the four sources of the images); the test
  split is drawn per (domain, class) with all images of one lesion (``lesion_id``) on the same side, so
  no lesion is seen in both training and test.
- EuroSAT: the RGB release, 64x64 images, held at their native 64 by default; no domains.
"""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Iterator, Literal, Optional

from pydantic import Field

from fedguide.data.sources._files import (FETCH_ERRORS, Probe, fetch_archive, find_or_fetch, first_found, has_paths,
                                          search_bases, search_folders, unpack)
from fedguide.data.sources._images import (ImageParams, Sample, build_splits, check_known, list_images, sort_key,
                                           sorted_names, subfolders)
from fedguide.data.sources.base import DATASETS, DatasetSplits
from fedguide.data.sources.imagefolder import read_folder_dataset, read_tree, resolve_classes
from fedguide.registry import ConfigError


def find_dataset(title: str, root: Optional[str], name: str, subdirs: tuple[str, ...], probe: Probe[Path],
                 layout: str, how: str) -> Path:
    """The dataset's folder, as it is or in one of ``subdirs``; ``how`` says where to get it when it is missing."""
    return find_or_fetch(title, root, name, ("",) + subdirs, probe, layout, how=how)


class DomainParams(ImageParams):
    domains: Optional[list[str]] = Field(None, description="domains to read, in this order (default: all)")
    classes: Optional[list[str]] = Field(None, description="classes to read, in this order (default: all)")


# ---- Office-Caltech-10 ---------------------------------------------------------------------------

OFFICE_DOMAINS = ["amazon", "caltech", "dslr", "webcam"]
OFFICE_CLASSES = ["back_pack", "bike", "calculator", "headphones", "keyboard", "laptop_computer", "monitor",
                  "mouse", "mug", "projector"]
OFFICE_LAYOUT = ("root/{amazon,caltech,dslr,webcam}/<class>/*.jpg with the class folders "
                 + ", ".join(OFFICE_CLASSES) + " (optionally root/<domain>/{train,test}/<class>/*)")


@DATASETS.register("office_caltech10", params=DomainParams,
                   summary="Office-Caltech-10: 4 domains (amazon, caltech, dslr, webcam), 10 classes")
def load_office_caltech10(params: DomainParams) -> DatasetSplits:
    domains = check_known(params.domains, OFFICE_DOMAINS, "Office-Caltech-10 domains", OFFICE_LAYOUT)
    classes = check_known(params.classes, OFFICE_CLASSES, "Office-Caltech-10 classes", OFFICE_LAYOUT)
    root = find_dataset("Office-Caltech-10", params.root, "office_caltech10", ("office_caltech_10", "office_caltech10"),
                        has_paths(dirs=domains), OFFICE_LAYOUT, "It has no official archive: it is the 10 classes "
                        "shared by Office-31 and Caltech-256 (Gong et al., CVPR 2012).")
    return read_folder_dataset(root, params, OFFICE_LAYOUT, domains, classes)


# ---- split lists (DomainNet, NICO++) ------------------------------------------------------------

def split_lists(split_dirs: list[Path], stem: str) -> Optional[dict[str, Path]]:
    """``<stem>_train.txt`` and ``<stem>_test.txt`` from the first folder holding either."""
    for folder in split_dirs:
        found = {s: folder / f"{stem}_{s}.txt" for s in ("train", "test")}
        present = [p for p in found.values() if p.is_file()]
        if len(present) == 2:
            return found
        if present:
            raise ConfigError(f"{present[0]} has no partner {stem}_{{train,test}}.txt beside it; add it or "
                              "remove both to fall back to the seeded split")
    return None


def list_entries(path: Path, form: str) -> Iterator[tuple[int, tuple[str, str, str]]]:
    """(line number, the path's last three parts) of every line '<...>/<a>/<b>/<file> <label>'.

    The numeric label is ignored: the class comes from the path, so a class selection re-numbers labels
    consistently. ``form`` names the two folder levels for the error message.
    """
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            rel, _, label = line.rpartition(" ")
            parts = Path(rel.replace("\\", "/")).parts
            if len(parts) < 3 or not label.lstrip("-").isdigit():
                raise ConfigError(f"{path} line {n} is not '{form} <label>': {line!r}")
            yield n, parts[-3:]


def read_split_list(path: Path, image_root: Path, domain: str, split: str, classes: set[str],
                    layout: str) -> list[Sample]:
    """Lines '<...>/<domain>/<class>/<file> <label>'; the path's last three parts locate the image."""
    samples = []
    for n, (dom, cls, name) in list_entries(path, "<domain>/<class>/<file>"):
        if dom != domain:
            raise ConfigError(f"{path} line {n} names domain {dom!r}, not {domain!r}")
        if cls not in classes:
            continue
        image = image_root / dom / cls / name
        if not image.is_file():
            raise ConfigError(f"{image} is listed in {path} line {n} but missing. Expected layout: {layout}")
        samples.append(Sample(image, cls, dom, split))
    return samples


def read_listed_tree(root: Path, split_dirs: list[Path], params: ImageParams, layout: str,
                     domains: list[str], classes: Optional[list[str]]) -> DatasetSplits:
    """Like ``read_folder_dataset``, but a domain with split lists takes its split from them."""
    classes = resolve_classes(root, domains, classes, layout)
    listed = {d: split_lists(split_dirs, d) for d in domains}
    folder_domains = [d for d in domains if listed[d] is None]
    samples = read_tree(root, folder_domains, classes, layout)[0] if folder_domains else []
    for d, lists in listed.items():
        if lists is not None:
            for split, path in lists.items():
                samples += read_split_list(path, root, d, split, set(classes), layout)
    d_rank = {d: i for i, d in enumerate(domains)}
    c_rank = {c: i for i, c in enumerate(classes)}
    samples.sort(key=lambda s: (d_rank[s.domain], c_rank[s.label], sort_key(s.path.name)))
    return build_splits(samples, classes, domains, params, layout)


# ---- DomainNet -----------------------------------------------------------------------------------

DOMAINNET_DOMAINS = ["clipart", "infograph", "painting", "quickdraw", "real", "sketch"]
DOMAINNET_TEN = ["bird", "feather", "headphones", "ice_cream", "teapot", "tiger", "whale", "windmill",
                 "wine_glass", "zebra"]  # FedBN's subset
DOMAINNET_PAGE = "http://ai.bu.edu/M3SDA/"
DOMAINNET_BASE = "http://csr.bu.edu/ftp/visda/2019/multi-source/"
DOMAINNET_URLS = {d: DOMAINNET_BASE + ("groundtruth/" if d in ("clipart", "painting") else "") + f"{d}.zip"
                  for d in DOMAINNET_DOMAINS}  # the cleaned release
DOMAINNET_SPLIT_URL = DOMAINNET_BASE + "domainnet/txt/{domain}_{split}.txt"
DOMAINNET_LAYOUT = ("root/<domain>/<class>/*.jpg for the domains " + ", ".join(DOMAINNET_DOMAINS)
                    + " (the official zips), with the official split lists root/<domain>_train.txt and "
                    "root/<domain>_test.txt (lines 'domain/class/file.jpg label'; also read from root/splits)")


class DomainNetParams(DomainParams):
    subset: Literal["all", "ten"] = Field("all", description="ten: FedBN's 10 classes (bird, feather, ...)")
    num_classes: Optional[int] = Field(None, ge=1, description=(
        "keep the first N classes in the official order (FedCADO: 90; FedDISC: 90, 150, 345)"))


@DATASETS.register("domainnet", params=DomainNetParams,
                   summary="DomainNet: 6 domains, 345 classes (or FedBN's 10), official split lists when present")
def load_domainnet(params: DomainNetParams) -> DatasetSplits:
    domains = check_known(params.domains, DOMAINNET_DOMAINS, "DomainNet domains", DOMAINNET_LAYOUT)
    chosen = [params.classes is not None, params.subset != "all", params.num_classes is not None]
    if sum(chosen) > 1:
        raise ConfigError("choose classes with one of classes, subset or num_classes, not several")
    root = find_dataset("DomainNet", params.root, "domainnet", ("domainnet", "DomainNet"), has_paths(dirs=domains),
                        DOMAINNET_LAYOUT, f"Download the domain zips from {DOMAINNET_PAGE} "
                        f"(e.g. {DOMAINNET_URLS['clipart']}) and the split lists "
                        f"({DOMAINNET_SPLIT_URL.format(domain='clipart', split='train')}, ...).")
    classes = params.classes
    if params.subset == "ten":
        classes = list(DOMAINNET_TEN)
    elif params.num_classes is not None:
        all_classes = resolve_classes(root, domains, None, DOMAINNET_LAYOUT)
        if params.num_classes > len(all_classes):
            raise ConfigError(f"num_classes {params.num_classes} exceeds the {len(all_classes)} classes found")
        classes = all_classes[: params.num_classes]
    return read_listed_tree(root, [root, root / "splits", root / "txt"], params, DOMAINNET_LAYOUT, domains, classes)


# ---- NICO++ --------------------------------------------------------------------------------------

NICO_DOMAINS = ["autumn", "dim", "grass", "outdoor", "rock", "water"]
NICO_PAGE = "https://github.com/xxgege/NICO-plus"
NICO_LAYOUT = ("root/<domain>/<class>/*.jpg for the common domains " + ", ".join(NICO_DOMAINS)
               + " (NICO_DG of the official release), optionally with its split lists "
               "<domain>_{train,test}.txt in root, root/splits or root/../NICO_DG_official")


@DATASETS.register("nicopp", params=DomainParams,
                   summary="NICO++ common contexts: 6 domains (autumn, dim, grass, outdoor, rock, water), 60 classes")
def load_nicopp(params: DomainParams) -> DatasetSplits:
    domains = check_known(params.domains, NICO_DOMAINS, "NICO++ domains", NICO_LAYOUT)
    root = find_dataset("NICO++", params.root, "nicopp", ("NICO_DG", "nicopp", "nicopp/NICO_DG"),
                        has_paths(dirs=domains), NICO_LAYOUT, f"Request it via {NICO_PAGE}.")
    split_dirs = [root, root / "splits", root.parent / "NICO_DG_official"]
    return read_listed_tree(root, split_dirs, params, NICO_LAYOUT, domains, params.classes)


# ---- NICO++ unique contexts ------------------------------------------------------------------------

NICO_UNIQUE_GROUPS = 6  # contexts per class in the released unique track, one per client in both papers
NICO_RELEASE_FOLDERS = ("NICO_unique", "NICO_DG", "NICO_DG_official", "NICO_unique_official", "txtlist")
NICO_UNIQUE_LAYOUT = ("root/<class>/<context>/*.jpg, each class with its own unique contexts (NICO_unique of "
                      "the official release, six contexts per class), optionally with the official split lists "
                      "<class>_<context>_{train,test}.txt (lines '<...>/<class>/<context>/<file> <label>') in root, "
                      "root/../NICO_unique_official or root/../txtlist/NICO_unique_official")


class NicoUniqueParams(DomainParams):
    domains: Optional[list[str]] = Field(None, description=(
        "context groups to read, in this order: unique0 .. unique<num_groups - 1> (default: all)"))
    num_groups: int = Field(NICO_UNIQUE_GROUPS, ge=1, description=(
        "domains formed from the contexts: a class's contexts, sorted by name, go round-robin to unique0, "
        "unique1, ...; 6 (the papers): group k is the k-th context of every class"))


def unique_group_names(num_groups: int) -> list[str]:
    return [f"unique{k}" for k in range(num_groups)]


def group_contexts(contexts: list[str], num_groups: int) -> list[list[str]]:
    """A class's contexts dealt to ``num_groups`` groups: the i-th in name order goes to group i mod K."""
    ordered = sorted_names(contexts)
    return [ordered[k::num_groups] for k in range(num_groups)]


def unique_tree(folder: Path) -> Optional[Path]:
    """``folder`` if it holds class folders holding context folders; neither the release's parent folder nor
    the common tree."""
    names = subfolders(folder)
    if not names or set(names) & set(NICO_RELEASE_FOLDERS) or set(NICO_DOMAINS) <= set(names):
        return None
    return folder if subfolders(folder / names[0]) else None


def read_unique_list(path: Path, root: Path, cls: str, context: str, group: str, split: str) -> list[Sample]:
    samples = []
    for n, (c, ctx, name) in list_entries(path, "<class>/<context>/<file>"):
        if (c, ctx) != (cls, context):
            raise ConfigError(f"{path} line {n} names {c}/{ctx}, not {cls}/{context}: a list named "
                              "<class>_<context>_<split>.txt lists that class and context only")
        image = root / c / ctx / name
        if not image.is_file():
            raise ConfigError(f"{image} is listed in {path} line {n} but missing. Expected layout: "
                              f"{NICO_UNIQUE_LAYOUT}")
        samples.append(Sample(image, cls, group, split))
    return samples


def read_unique_context(root: Path, split_dirs: list[Path], cls: str, context: str, group: str) -> list[Sample]:
    """One class's images in one of its contexts: the official split lists when present, else the folder."""
    lists = split_lists(split_dirs, f"{cls}_{context}")
    if lists is None:
        files = list_images(root / cls / context)
        if not files:
            raise ConfigError(f"{root / cls / context} holds no .jpg/.jpeg/.png/.bmp images. "
                              f"Expected layout: {NICO_UNIQUE_LAYOUT}")
        return [Sample(p, cls, group) for p in files]
    samples = [s for split, path in lists.items() for s in read_unique_list(path, root, cls, context, group, split)]
    if not any(s.split == "train" for s in samples):
        raise ConfigError(f"{lists['train']} lists no images. Expected layout: {NICO_UNIQUE_LAYOUT}")
    return samples


@DATASETS.register("nicopp_unique", params=NicoUniqueParams,
                   summary="NICO++ unique contexts: 60 classes, each with its own 6 contexts; "
                           "domain unique<k> = every class's k-th context")
def load_nicopp_unique(params: NicoUniqueParams) -> DatasetSplits:
    names = unique_group_names(params.num_groups)
    domains = check_known(params.domains, names, "NICO++ unique-context groups", NICO_UNIQUE_LAYOUT)
    root = find_dataset("NICO++ unique contexts", params.root, "nicopp",
                        ("NICO_unique", "nicopp", "nicopp/NICO_unique"), unique_tree, NICO_UNIQUE_LAYOUT,
                        f"Request NICO++ via {NICO_PAGE}.")
    classes = check_known(params.classes, subfolders(root), f"class folders of {root}", NICO_UNIQUE_LAYOUT)
    split_dirs = [root, root.parent / "NICO_unique_official", root.parent / "txtlist" / "NICO_unique_official"]
    samples = []
    for cls in classes:
        contexts = subfolders(root / cls)
        if len(contexts) < params.num_groups:
            raise ConfigError(f"{root / cls} has {len(contexts)} context folders {contexts}, fewer than num_groups "
                              f"= {params.num_groups}; every group needs a context of every class, so lower "
                              f"num_groups. Expected layout: {NICO_UNIQUE_LAYOUT}")
        for group, group_ctx in zip(names, group_contexts(contexts, params.num_groups)):
            if group in domains:
                for ctx in group_ctx:
                    samples += read_unique_context(root, split_dirs, cls, ctx, group)
    d_rank = {d: i for i, d in enumerate(domains)}
    c_rank = {c: i for i, c in enumerate(classes)}
    samples.sort(key=lambda s: (d_rank[s.domain], c_rank[s.label], sort_key(s.path.parent.name),
                                sort_key(s.path.name)))
    return build_splits(samples, classes, domains, params, NICO_UNIQUE_LAYOUT)


# ---- OpenImage super-categories (FedCADO / FedDISC) --------------------------------------------

# Super-category -> its fine-grained subclass in client0 .. client5 (FedCADO Table 5).
OPENIMAGE_TABLE: dict[str, tuple[str, ...]] = {
    "Baked goods": ("Pretzel", "Bagel", "Muffin", "Cookie", "Bread", "Croissant"),
    "Bird": ("Woodpecker", "Parrot", "Magpie", "Eagle", "Falcon", "Sparrow"),
    "Building": ("Convenience store", "House", "Tower", "Office building", "Castle", "Skyscraper"),
    "Carnivore": ("Bear", "Leopard", "Fox", "Tiger", "Lion", "Otter"),
    "Clothing": ("Shorts", "Dress", "Swimwear", "Brassiere", "Tiara", "Shirt"),
    "Drink": ("Beer", "Cocktail", "Coffee", "Juice", "Tea", "Wine"),
    "Fruit": ("Apple", "Lemon", "Banana", "Strawberry", "Peach", "Pineapple"),
    "Furniture": ("Chair", "Desk", "Couch", "Wardrobe", "Bed", "Shelf"),
    "Home appliance": ("Washing machine", "Toaster", "Oven", "Blender", "Gas stove", "Mechanical fan"),
    "Human body": ("Human eye", "Skull", "Human mouth", "Human ear", "Human nose", "Human foot"),
    "Kitchen utensil": ("Spatula", "Spoon", "Fork", "Knife", "Whisk", "Cutting board"),
    "Land vehicle": ("Ambulance", "Cart", "Bus", "Van", "Truck", "Car"),
    "Musical instrument": ("Drum", "Guitar", "Harp", "Piano", "Violin", "Accordion"),
    "Office supplies": ("Pen", "Poster", "Calculator", "Whiteboard", "Box", "Envelope"),
    "Plant": ("Maple", "Willow", "Rose", "Lily", "Common sunflower", "Houseplant"),
    "Reptile": ("Dinosaur", "Lizard", "Snake", "Tortoise", "Crocodile", "Sea turtle"),
    "Sports equipment (Ball)": ("Football", "Tennis ball", "Baseball bat", "Golf ball", "Rugby ball",
                                "Volleyball (Ball)"),
    "Toy": ("Doll", "Balloon", "Dice", "Flying disc", "Kite", "Teddy bear"),
    "Vegetable": ("Potato", "Carrot", "Broccoli", "Cabbage", "Bell pepper", "Pumpkin"),
    "Weapon": ("Knife", "Axe", "Sword", "Handgun", "Shotgun", "Dagger"),
}
OPENIMAGE_CLASSES = list(OPENIMAGE_TABLE)
OPENIMAGE_DOMAINS = [f"client{k}" for k in range(6)]
OPENIMAGE_LAYOUT = ("root/{train,test}/labels/classifications.csv (columns ImageID, LabelName, Confidence), "
                    "root/{train,test}/metadata/classes.csv (rows 'MID,display name'), "
                    "root/{train,test}/data/<ImageID>.jpg — an Open Images download by FiftyOne "
                    "(load_zoo_dataset('open-images-v7', label_types=['classifications'], classes=[...]))")


class OpenImageParams(DomainParams):
    max_train_per_class: Optional[int] = Field(30, ge=1, description=(
        "seeded draw of at most this many training images per client and class (FedCADO: 30); null = all"))


def read_class_ids(path: Path) -> dict[str, set[str]]:
    """Display name -> its MIDs; a header row (first cell not a MID) is skipped."""
    names: dict[str, set[str]] = {}
    with open(path, newline="", encoding="utf-8") as fh:
        for row in csv.reader(fh):
            if len(row) >= 2 and row[0].startswith("/"):
                names.setdefault(row[1].strip(), set()).add(row[0].strip())
    if not names:
        raise ConfigError(f"{path} lists no classes. Expected layout: {OPENIMAGE_LAYOUT}")
    return names


def read_positive_labels(path: Path, wanted: set[str]) -> dict[str, set[str]]:
    """ImageID -> its positively verified labels among ``wanted``."""
    out: dict[str, set[str]] = {}
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        if not {"ImageID", "LabelName"} <= set(reader.fieldnames or ()):
            raise ConfigError(f"{path} lacks the columns ImageID and LabelName. Expected layout: {OPENIMAGE_LAYOUT}")
        for row in reader:
            if row["LabelName"] not in wanted:
                continue
            try:
                positive = float(row.get("Confidence") or 1) >= 0.5  # 0 = verified absent
            except ValueError:
                raise ConfigError(f"{path} line {reader.line_num}: Confidence {row['Confidence']!r} is not a "
                                  "number") from None
            if positive:
                out.setdefault(row["ImageID"], set()).add(row["LabelName"])
    return out


def read_openimage_split(folder: Path, split: str, domains: list[str], classes: list[str]) -> list[Sample]:
    for need in ("labels/classifications.csv", "metadata/classes.csv"):
        if not (folder / need).is_file():
            raise ConfigError(f"{folder / need} is missing. Expected layout: {OPENIMAGE_LAYOUT}")
    ids = read_class_ids(folder / "metadata" / "classes.csv")
    mid_to_super: dict[str, dict[str, str]] = {}  # domain -> MID -> super-category
    for d in domains:
        k = OPENIMAGE_DOMAINS.index(d)
        for c in classes:
            sub = OPENIMAGE_TABLE[c][k]
            if sub not in ids:
                raise ConfigError(f"{folder / 'metadata' / 'classes.csv'} has no class {sub!r} ({d}'s {c}); "
                                  f"download Open Images with it. Expected layout: {OPENIMAGE_LAYOUT}")
            mid_to_super.setdefault(d, {}).update({mid: c for mid in ids[sub]})
    wanted = {mid for m in mid_to_super.values() for mid in m}
    labels = read_positive_labels(folder / "labels" / "classifications.csv", wanted)
    samples = []
    for image_id in sorted(labels):
        path = folder / "data" / f"{image_id}.jpg"
        if not path.is_file():
            continue
        for d in domains:
            supers = {mid_to_super[d][m] for m in labels[image_id] if m in mid_to_super[d]}
            if len(supers) == 1:
                samples.append(Sample(path, supers.pop(), d, split))
    return samples


def load_openimage(params: DomainParams) -> DatasetSplits:
    domains = check_known(params.domains, OPENIMAGE_DOMAINS, "OpenImage clients", OPENIMAGE_LAYOUT)
    classes = check_known(params.classes, OPENIMAGE_CLASSES, "OpenImage super-categories", OPENIMAGE_LAYOUT)
    root = find_dataset("Open Images", params.root, "openimage", ("openimage", "open-images-v7", "open-images-v6"),
                        has_paths(["train/labels/classifications.csv"]), OPENIMAGE_LAYOUT,
                        "Download the train and test splits of the 120 subclasses with FiftyOne "
                        "(https://storage.googleapis.com/openimages/web/download.html).")
    train = read_openimage_split(root / "train", "train", domains, classes)  # capped in build_splits
    test = read_openimage_split(root / "test", "test", domains, classes)
    have = {(s.domain, s.label) for s in train}
    for d in domains:
        lacking = [OPENIMAGE_TABLE[c][OPENIMAGE_DOMAINS.index(d)] for c in classes if (d, c) not in have]
        if lacking:
            raise ConfigError(f"no training images of {lacking} ({d}) under {root / 'train' / 'data'}. "
                              f"Expected layout: {OPENIMAGE_LAYOUT}")
    d_rank = {d: i for i, d in enumerate(domains)}
    c_rank = {c: i for i, c in enumerate(classes)}
    samples = sorted(train + test, key=lambda s: (d_rank[s.domain], c_rank[s.label], s.path.name))
    return build_splits(samples, classes, domains, params, OPENIMAGE_LAYOUT)


DATASETS.register("openimage_fedcado", params=OpenImageParams,
                  summary="OpenImage as in FedCADO: 20 super-categories, 6 clients = 6 subclasses each, "
                          "30 train images per class")(load_openimage)
DATASETS.register("openimage_feddisc", params=DomainParams,
                  summary="OpenImage as in FedDISC: 20 super-categories, 6 domains = 6 subclasses each")(load_openimage)


# ---- HAM10000 ------------------------------------------------------------------------------------

HAM_CLASSES = ["akiec", "bcc", "bkl", "df", "mel", "nv", "vasc"]
HAM_PAGE = "https://doi.org/10.7910/DVN/DBW86T"
HAM_PARTS = ("HAM10000_images_part_1", "HAM10000_images_part_2")
HAM_LAYOUT = ("root/HAM10000_metadata.csv (columns lesion_id, image_id, dx, ..., dataset) with the images "
              "root/HAM10000_images_part_1/<image_id>.jpg and root/HAM10000_images_part_2/<image_id>.jpg")


@DATASETS.register("ham10000", params=DomainParams,
                   summary="HAM10000 skin lesions: 7 diagnoses, domains = the 4 image sources (dataset column)")
def load_ham10000(params: DomainParams) -> DatasetSplits:
    classes = check_known(params.classes, HAM_CLASSES, "HAM10000 diagnoses", HAM_LAYOUT)
    root = find_dataset("HAM10000", params.root, "ham10000", ("HAM10000", "ham10000"),
                        has_paths(["HAM10000_metadata.csv"]), HAM_LAYOUT, f"Download it from {HAM_PAGE}.")
    images = {p.stem: p for part in HAM_PARTS if (root / part).is_dir() for p in list_images(root / part)}
    meta = root / "HAM10000_metadata.csv"
    with open(meta, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        if not {"image_id", "dx", "dataset"} <= set(reader.fieldnames or ()):
            raise ConfigError(f"{meta} lacks the columns image_id, dx and dataset (the current release has "
                              f"them, see {HAM_PAGE}). Expected layout: {HAM_LAYOUT}")
        rows = list(reader)
    unknown = sorted({r["dx"] for r in rows} - set(HAM_CLASSES))
    if unknown:
        raise ConfigError(f"{meta} has diagnoses {unknown} outside {HAM_CLASSES}")
    present = sorted({r["dataset"] for r in rows}, key=sort_key)
    domains = check_known(params.domains, present, "HAM10000 sources (dataset column)", HAM_LAYOUT)
    d_rank = {d: i for i, d in enumerate(domains)}
    c_rank = {c: i for i, c in enumerate(classes)}
    samples = []
    for r in rows:
        if r["dataset"] not in d_rank or r["dx"] not in c_rank:
            continue
        if r["image_id"] not in images:
            raise ConfigError(f"{r['image_id']}.jpg (in {meta}) is in neither {HAM_PARTS[0]}/ nor {HAM_PARTS[1]}/ "
                              f"under {root}. Expected layout: {HAM_LAYOUT}")
        samples.append(Sample(images[r["image_id"]], r["dx"], r["dataset"], None, r.get("lesion_id") or None))
    samples.sort(key=lambda s: (d_rank[s.domain], c_rank[s.label], s.path.name))
    return build_splits(samples, classes, domains, params, HAM_LAYOUT)


# ---- EuroSAT -------------------------------------------------------------------------------------

EUROSAT_URL = "https://madm.dfki.de/files/sentinel/EuroSAT.zip"
EUROSAT_CLASSES = ["AnnualCrop", "Forest", "HerbaceousVegetation", "Highway", "Industrial", "Pasture",
                   "PermanentCrop", "Residential", "River", "SeaLake"]
EUROSAT_FOLDERS = ("2750", "EuroSAT_RGB")  # inside EuroSAT.zip / EuroSAT_RGB.zip
EUROSAT_ZIPS = ("EuroSAT.zip", "EuroSAT_RGB.zip")
EUROSAT_SUBDIRS = ("", "eurosat", "EuroSAT")
EUROSAT_LAYOUT = ("root/2750/<class>/*.jpg (EuroSAT.zip extracted) or root/EuroSAT_RGB/<class>/*.jpg, with "
                  "the classes " + ", ".join(EUROSAT_CLASSES) + "; or root/EuroSAT.zip itself")


class EuroSatParams(ImageParams):
    image_size: int = Field(64, ge=4, le=1024, description="side of the square images (64 = native)")
    classes: Optional[list[str]] = Field(None, description="classes to read, in this order (default: all 10)")


def eurosat_folder(base: Path) -> Optional[Path]:
    for sub in EUROSAT_FOLDERS:
        if (base / sub).is_dir():
            return base / sub
    return None


def eurosat_zip(folder: Path) -> Optional[Path]:
    return next((folder / name for name in EUROSAT_ZIPS if (folder / name).is_file()), None)


def locate_eurosat(root: Optional[str]) -> Path:
    """The extracted folder; else a zip lying in a searched folder or, failing that, the official one
    downloaded, unpacked into the download folder (never into the user's folder)."""
    def fetch(target: Path) -> None:
        archive = first_found(search_folders(search_bases(root, "eurosat"), EUROSAT_SUBDIRS), eurosat_zip)
        if archive is None:
            fetch_archive(EUROSAT_URL, "EuroSAT.zip")(target)
            return
        try:
            unpack(archive, target)
        except FETCH_ERRORS as err:
            raise ConfigError(f"{archive} is not a readable zip ({err}); re-download it from {EUROSAT_URL}") from None

    return find_or_fetch("EuroSAT", root, "eurosat", EUROSAT_SUBDIRS, eurosat_folder, EUROSAT_LAYOUT, EUROSAT_URL,
                         fetch)


@DATASETS.register("eurosat", params=EuroSatParams,
                   summary="EuroSAT RGB: 10 land-use classes, 64x64 Sentinel-2 images (27k), no domains")
def load_eurosat(params: EuroSatParams) -> DatasetSplits:
    classes = check_known(params.classes, EUROSAT_CLASSES, "EuroSAT classes", EUROSAT_LAYOUT)
    folder = locate_eurosat(params.root)
    return read_folder_dataset(folder, params, EUROSAT_LAYOUT, classes=classes, domain_level=False)

