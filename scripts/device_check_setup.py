"""The set-up step of scripts/device-check.sh: install what the host's Python lacks from the carried wheels,
then check the result with pip check and real imports, before any check runs.

Runs on the host's own Python with its standard library and pip only (fedguide's dependencies are what it
installs). Nothing of the host's is replaced: wheels go to SITE, which device-check.sh puts first on
PYTHONPATH for this run only. A carried package is installed where the host lacks it, or where pip check
shows that the host's copy does not satisfy a carried package (pydantic pins pydantic-core exactly and wants
a recent typing-extensions): the carried copy then shadows the host's for the run.

    python3 scripts/device_check_setup.py --site SITE --summary SUMMARY --groups GROUPS [--wheels DIR]

Prints its log (environment.txt takes it), appends its sentences to SUMMARY and writes one line per
import group to GROUPS (``guidance=ok``, ``sklearn=missing: <why>``). Exit status 2 when fedguide's core
does not import (nothing can run), else 0.
"""
from __future__ import annotations

import argparse
import json
import lzma
import os
import re
import subprocess
import sys
from pathlib import Path

# What each group imports; "core" must import for any check to run.
GROUPS = {
    "core": ["torch", "yaml", "safetensors.torch", "pydantic", "fedguide.config", "fedguide.fl.engine",
             "fedguide.fl.setup", "fedguide.methods", "fedguide.data.sources.standin"],
    "guidance": ["diffusers", "transformers", "rich", "fedguide.guidance.tiny", "fedguide.guidance.model"],
    "sklearn": ["scipy", "sklearn.decomposition", "sklearn.cluster", "sklearn.linear_model"],
}
WHAT = {"core": "fedguide's engine, configs and methods",
        "guidance": "the guidance pipelines (diffusers, transformers)",
        "sklearn": "scikit-learn (FedDifRC's and SemanticFL's PCA, the FedDISC family's k-means and probes)"}
VERSIONS = ["torch", "numpy", "pydantic", "transformers", "huggingface-hub", "diffusers", "scikit-learn", "scipy"]
PIP_PROBLEM = re.compile(r"^(\S+) \S+ (?:requires|has requirement) ([A-Za-z0-9][A-Za-z0-9._-]*)")


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def say(summary: Path, sentence: str) -> None:
    print(sentence, flush=True)
    with summary.open("a") as f:
        f.write(sentence + "\n")


def host_version(name: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def carried_wheels(folder: Path) -> dict[str, list[Path]]:
    """name -> its wheel files (NAME.whl, or NAME.whl.xz: wheels.sh's compressed largest ones)."""
    out: dict[str, list[Path]] = {}
    for path in sorted(folder.iterdir()):
        if path.name.endswith((".whl", ".whl.xz")):
            out.setdefault(canon(path.name.split("-")[0]), []).append(path)
    return out


def unpack(names: list[str], carried: dict[str, list[Path]], to: Path) -> None:
    """The .whl.xz files of ``names`` as wheels in ``to`` (only those about to be installed: scipy's takes
    seconds)."""
    for name in names:
        for path in carried.get(name, []):
            if path.name.endswith(".xz") and not (to / path.name[:-3]).exists():
                to.mkdir(parents=True, exist_ok=True)
                (to / path.name[:-3]).write_bytes(lzma.decompress(path.read_bytes()))


def pip(*args: str) -> subprocess.CompletedProcess:
    # the root-user notice by environment: pip before 22.1 (Ubuntu 22.04's) has no option for it
    return subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                          capture_output=True, text=True, env={**os.environ, "PIP_ROOT_USER_ACTION": "ignore"})


def install(names: list[str], carried: dict[str, list[Path]], links: list[Path], site: Path) -> list[str]:
    """Installs ``names`` into ``site`` (pip picks each one's wheel for this Python); returns those it could
    not (no carried wheel for this Python)."""
    if not names:
        return []
    unpack(names, carried, links[-1])
    base = ["install", "--no-index", "--no-deps", "--no-compile", "--upgrade", "--target", str(site),
            *[f"--find-links={d}" for d in links]]
    done = pip(*base, *names)
    print(done.stdout + done.stderr, flush=True)
    if done.returncode == 0:
        return []
    failed = []
    for name in names:  # one by one, to name the ones without a wheel for this Python
        one = pip(*base, name)
        if one.returncode != 0:
            failed.append(name)
            print(one.stderr.strip().splitlines()[-1] if one.stderr.strip() else f"{name}: pip failed", flush=True)
    return failed


def pip_check() -> list[tuple[str, str, str]]:
    """(owner, requirement, pip's line) of each problem pip check reports."""
    done = pip("check")
    print("== pip check\n" + done.stdout + done.stderr, flush=True)
    out = []
    for line in done.stdout.splitlines():
        m = PIP_PROBLEM.match(line.strip())
        if m:
            out.append((canon(m.group(1)), canon(m.group(2)), line.strip()))
    return out


def imports() -> dict:
    """Each group's import in a fresh interpreter (this one has not loaded what was just installed), and the
    versions that matter."""
    code = f"""
import importlib, importlib.metadata as md, json, sys
out = {{"groups": {{}}, "versions": {{}}}}
for group, modules in {GROUPS!r}.items():
    try:
        for m in modules:
            importlib.import_module(m)
        out["groups"][group] = "ok"
    except BaseException as err:
        out["groups"][group] = f"missing: {{type(err).__name__}}: {{str(err).splitlines()[0] if str(err) else ''}}"
for name in {VERSIONS!r}:
    try:
        out["versions"][name] = md.version(name)
    except md.PackageNotFoundError:
        out["versions"][name] = None
try:
    import torch
    out["versions"]["cuda"] = torch.version.cuda
except BaseException:
    pass
print(json.dumps(out))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    print("== imports\n" + done.stderr[-4000:], flush=True)
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        return {"groups": {g: f"missing: the import check failed ({done.stderr.strip()[-300:]})" for g in GROUPS},
                "versions": {}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--wheels", type=Path, default=None)
    ap.add_argument("--site", type=Path, required=True)
    ap.add_argument("--summary", type=Path, required=True)
    ap.add_argument("--groups", type=Path, required=True)
    args = ap.parse_args()
    summary = args.summary
    args.site.mkdir(parents=True, exist_ok=True)
    say(summary, f"set-up: Python {sys.version.split()[0]} ({sys.executable})")

    if args.wheels is None:
        say(summary, "set-up: no carried wheels (no folder given, no wheels/ in the tree): the host's own packages "
                     "are used as they are")
    elif pip("--version").returncode != 0:
        say(summary, f"set-up: {sys.executable} -m pip does not run here, so the carried wheels cannot be installed; "
                     "the host's own packages are used as they are")
    else:
        carried = carried_wheels(args.wheels)
        links = [args.wheels, args.site.parent / "unpacked-wheels"]
        missing = [n for n in carried if host_version(n) is None]
        installed = list(missing)
        failed = install(missing, carried, links, args.site)
        # The host's copy of a carried package that a carried package cannot use: shadow it, check again.
        problems = pip_check()
        for _ in range(2):
            shadow = sorted({req for owner, req, _ in problems if req in carried and req not in installed})
            if not shadow:
                break
            print(f"shadowing the host's {', '.join(shadow)} with the carried copies", flush=True)
            failed += install(shadow, carried, links, args.site)
            installed += shadow
            problems = pip_check()
        done = [n for n in installed if n not in failed]
        versions = {n: host_version(n) for n in carried}
        say(summary, "set-up: installed from the carried wheels: "
            + (", ".join(f"{n} {versions[n]}" for n in done) or "nothing (the host has every carried package)")
            + (f"; the host's own: {', '.join(f'{n} {versions[n]}' for n in carried if n not in installed)}"
               if any(n not in installed for n in carried) else ""))
        if failed:
            say(summary, f"set-up: no carried wheel for Python {sys.version_info[0]}.{sys.version_info[1]} of "
                         f"{', '.join(failed)} (scripts/wheels.sh: PYTHONS, SKLEARN_PYTHON)")
        ours = [line for owner, req, line in problems if owner in carried or req in carried]
        for line in ours:
            say(summary, f"set-up: pip check: {line}")
        if len(problems) > len(ours):
            say(summary, f"set-up: pip check: {len(problems) - len(ours)} problem(s) among the host's own packages, "
                         "none involving a carried one (environment.txt)")
        if not problems:
            say(summary, "set-up: pip check: no broken requirements")

    found = imports()
    versions = found.get("versions", {})
    print("versions: " + json.dumps(versions), flush=True)
    say(summary, "set-up: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v))
    lines = []
    for group, state in found["groups"].items():
        lines.append(f"{group}={state}")
        if state == "ok":
            say(summary, f"set-up: imports: {WHAT[group]}: ok")
        else:
            needs = "nothing can run" if group == "core" else "the checks that need it say so and are not run"
            say(summary, f"set-up: imports: {WHAT[group]}: {state} ({needs})")
    args.groups.write_text("\n".join(lines) + "\n")
    return 0 if found["groups"].get("core") == "ok" else 2


if __name__ == "__main__":
    sys.exit(main())
