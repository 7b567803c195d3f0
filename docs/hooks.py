"""MkDocs hook: the embedded guidance models' card (kept beside the weights it describes) and its sample
grids become pages of the site, so the docs link to it and ``mkdocs build --strict`` checks those links."""
from pathlib import Path

from mkdocs.structure.files import File

CARD_DIR = Path(__file__).resolve().parent.parent / "src" / "fedguide" / "guidance" / "embedded" / "weights"


def on_files(files, config):
    files.append(File.generated(config, "embedded-model-card.md", abs_src_path=str(CARD_DIR / "MODEL_CARD.md")))
    for image in sorted(CARD_DIR.glob("*.png")):
        files.append(File.generated(config, image.name, abs_src_path=str(image)))
    return files
