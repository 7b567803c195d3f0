"""The paper configs (configs/paper/*.yaml) validate against the registries without touching any data.

Each file reproduces one column family of a paper's table. For every file this checks that

- the config loads and every named section (data, partition, model, method, regularizers) parses
  against its registry (``resolve``), including a long tail's nested ``then`` partition, which the
  partition only parses once data is loaded;
- client counts agree with the scenario where that is knowable from the config alone (NID2's
  biased + unbiased clients, a domain assignment, one client per configured domain);
- its header comment names its paper, the table or figure it reproduces, and its runtime class;
- every ``fedguide run`` command in the header names this file and every run of its sweep grid
  validates too, so the documented commands cannot name an unregistered method or a wrong key;
- a scenario that leaves the clients unlabeled, paired with a method that trains on client labels,
  is declared not runnable in the header;
- the config runs its paper's own method, at least one documented run keeps it, and a diffusion
  paper's config names the paper's guidance model and says how to run offline on the embedded ones.
"""
from __future__ import annotations

import itertools
import re
import shlex
from pathlib import Path

import pytest

from fedguide.config import load_config, load_raw
from fedguide.data.partition import PARTITIONS
from fedguide.fl.setup import resolve
from fedguide.methods import METHODS

PAPER_DIR = Path(__file__).resolve().parents[1] / "configs" / "paper"
FILES = sorted(PAPER_DIR.glob("*.yaml"))
WRITTEN = 51  # files shipped with this test; more may be added, none silently lost

PAPERS = {"feddifrc": "FedDifRC", "semanticfl": "SemanticFL", "feddw": "FedDW", "fedcado": "FedCADO",
          "feddisc": "FedDISC"}
REPRODUCES = re.compile(r"^Reproduces:.*\b(Table|Fig\.)\s+[0-9IVX]+")
COMMAND = re.compile(r"^\s*fedguide run (.*)$")
# The method each paper proposes, and the guidance model its paper names (None: no diffusion model).
OWN_METHOD = {"feddifrc": "feddifrc", "semanticfl": "semanticfl", "feddw": "feddw", "fedcado": "fedcado",
              "feddisc": "feddisc"}
PAPER_GUIDANCE = {"feddifrc": "runwayml/stable-diffusion-v1-5", "semanticfl": "runwayml/stable-diffusion-v1-5",
                  "fedcado": "runwayml/stable-diffusion-v1-5", "feddisc": "stabilityai/stable-diffusion-2-1-unclip",
                  "feddw": None}


def header_lines(path: Path) -> list[str]:
    """The leading comment block, without the '# ' markers."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[1:].removeprefix(" "))
    return lines


def documented_runs(path: Path) -> list[list[str]]:
    """Every run (as its list of overrides) that the header's ``fedguide run`` commands stand for."""
    runs = []
    for line in header_lines(path):
        match = COMMAND.match(line)
        if not match:
            continue
        config, *tokens = shlex.split(match.group(1))
        assert config == f"configs/paper/{path.name}", f"{path.name}: its header runs {config}, not itself"
        overrides, axes = [], []
        it = iter(tokens)
        for tok in it:
            if tok == "--sweep":
                key, values = next(it).split("=", 1)
                axes.append([f"{key}={v}" for v in values.split(",")])
            elif "=" in tok:
                overrides.append(tok)
            else:
                pytest.fail(f"{path.name}: unexpected token {tok!r} in the header command {line.strip()!r}")
        runs += [overrides + list(combo) for combo in itertools.product(*axes)]
    return runs


def test_every_paper_setting_is_present():
    assert len(FILES) >= WRITTEN, f"expected at least {WRITTEN} configs in {PAPER_DIR.name}/, found {len(FILES)}"
    assert {f.name.split("_")[0] for f in FILES} == set(PAPERS)


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_config_resolves_against_the_registries(path: Path):
    cfg = resolve(load_config(path)).config
    assert load_raw(path)["runtime"] == {"name": "local"}
    part = cfg.partition.params_dict()
    if cfg.partition.name == "longtail":
        then = dict(part["then"])
        PARTITIONS.parse_params(then.pop("name"), then, "partition.then")
    if cfg.partition.name == "nid2":
        assert part["n_biased"] + part["n_unbiased"] == cfg.clients.num, "nid2: n_biased + n_unbiased != clients.num"
    domains = cfg.data.params_dict().get("domains")
    if cfg.partition.name == "domain" and part["assign"] is not None:
        assert sum(part["assign"].values()) == cfg.clients.num, "partition.assign does not sum to clients.num"
        if domains is not None:
            assert set(part["assign"]) <= set(domains), f"assign names domains outside data.domains {domains}"
    if cfg.partition.name == "feature_skew" and domains is not None:
        assert len(domains) == cfg.clients.num, "feature_skew needs one client per data.domains entry"
    if cfg.partition.name == "semi_supervised" and domains is not None and part["server_domain"] is not None:
        assert part["server_domain"] in domains, "partition.server_domain is not among data.domains"
        assert len(domains) - 1 == cfg.clients.num, "semi_supervised needs one client per non-server domain"


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_header_names_paper_table_and_runtime(path: Path):
    lines = header_lines(path)
    assert lines, f"{path.name} has no header comment"
    paper = PAPERS[path.name.split("_")[0]]
    assert lines[0].startswith(f"{paper}:"), f"{path.name}: the header's first line must name {paper}"
    assert any(REPRODUCES.match(line) for line in lines), \
        f"{path.name}: no 'Reproduces: Table N' (or 'Fig. N') line in the header"
    assert any(line.startswith("Runtime:") for line in lines), f"{path.name}: no 'Runtime:' line"


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_header_commands_validate(path: Path):
    runs = documented_runs(path)
    text = "\n".join(header_lines(path))
    cfg = load_config(path)
    if cfg.partition.name == "semi_supervised" and METHODS.get(cfg.method.name).obj.needs_client_labels:
        assert "Not runnable yet" in text, f"{path.name}: {cfg.method.name} cannot train on unlabeled clients"
    else:
        assert any("method.name=" in "".join(r) for r in runs), f"{path.name}: no method sweep in the header"
    for overrides in runs:
        resolve(load_config(path, overrides))


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_config_runs_its_papers_method_and_guidance(path: Path):
    paper = path.name.split("_")[0]
    cfg = load_config(path)
    own = OWN_METHOD[paper]
    assert cfg.method.name == own, f"{path.name}: method {cfg.method.name}, not its paper's {own}"
    switches = [[o for o in run if o.startswith("method.name=")] for run in documented_runs(path)]
    assert any(not s or s[-1] == f"method.name={own}" for s in switches), \
        f"{path.name}: no documented run keeps the paper's method {own}"
    if PAPER_GUIDANCE[paper] is not None:
        assert cfg.guidance.model == PAPER_GUIDANCE[paper], \
            f"{path.name}: guidance.model {cfg.guidance.model}, not the paper's {PAPER_GUIDANCE[paper]}"
        assert "guidance.model=embedded" in "\n".join(header_lines(path)), \
            f"{path.name}: the header does not say how to run offline (guidance.model=embedded)"


def test_header_commands_are_parsed(tmp_path):
    """The command parser expands sweeps as the CLI does: fixed overrides first, then the grid."""
    cfg = tmp_path / "feddw_mnist_practical.yaml"  # a header runs its own file, named as a shipped one
    cfg.write_text("# h\n#   fedguide run configs/paper/feddw_mnist_practical.yaml a.b=1 --sweep c=1,2 --sweep d=3,4\nseed: 0\n")
    assert documented_runs(cfg) == [["a.b=1", "c=1", "d=3"], ["a.b=1", "c=1", "d=4"],
                                    ["a.b=1", "c=2", "d=3"], ["a.b=1", "c=2", "d=4"]]


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_header_names_the_augmentation_the_config_sets(path: Path) -> None:
    """train.augment is the paper's (or its released code's) recipe, and the header says which source."""
    cfg = load_config(path)
    header = [line for line in path.read_text().splitlines() if line.startswith("# Augmentation:")]
    assert len(header) == 1, f"{path.name}: one '# Augmentation:' header line naming the recipe and its source"
    assert header[0].startswith(f"# Augmentation: {cfg.train.augment} (train.augment)")
