"""What every dataset source yields: in-memory tensors, ready for batching by index."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from pydantic import BaseModel, ConfigDict

from fedguide.registry import Registry


@dataclass
class DatasetSplits:
    """Inputs and int64 labels, held in memory for the whole run.

    Images are normalised float32 [N, C, H, W]; text is int64 token ids [N, L] (0 = padding).
    A source with domains (Digits, Office-Caltech, DomainNet, ...) also gives every train and test
    sample an int64 domain id indexing ``domain_names``.
    """

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    class_names: list[str]
    train_domains: Optional[torch.Tensor] = None
    test_domains: Optional[torch.Tensor] = None
    domain_names: Optional[list[str]] = None

    def __post_init__(self) -> None:
        has = [self.train_domains is not None, self.test_domains is not None, self.domain_names is not None]
        if any(has) and not all(has):
            raise ValueError("train_domains, test_domains and domain_names come together or not at all")

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.train_x.shape[1:])

    @property
    def vocab_size(self) -> int:
        """Token ids are in [0, vocab_size) for text; 0 for images."""
        if self.train_x.dtype.is_floating_point:
            return 0
        return int(max(self.train_x.max(), self.test_x.max())) + 1

    def model_spec(self):
        from fedguide.models.registry import ModelSpec

        return ModelSpec(self.input_shape, self.num_classes, self.vocab_size)


class SourceParams(BaseModel):
    """Keys of the ``data`` section that every source understands (a source may add its own)."""

    model_config = ConfigDict(extra="forbid")
    root: Optional[str] = None


DATASETS: Registry = Registry("dataset")


def normalise(images_uint8: torch.Tensor, mean: float, std: float) -> torch.Tensor:
    """uint8 [N,H,W] or [N,C,H,W] -> float32 [N,C,H,W], standardised once so batches are plain gathers."""
    x = images_uint8.to(torch.float32).div_(255.0)
    if x.dim() == 3:
        x = x.unsqueeze(1)
    return x.sub_(mean).div_(std).contiguous()


def offline() -> bool:
    """Downloads are off when FEDGUIDE_OFFLINE=1 (tests and air-gapped machines set it)."""
    import os

    return os.environ.get("FEDGUIDE_OFFLINE") == "1"


def download_file(url: str, dest: Path, timeout: float = 30.0) -> Path:
    """Fetch ``url`` to ``dest`` atomically: a temporary file beside it, renamed when complete, so an
    interrupted download never leaves a half file that a later run would take for the dataset."""
    import os
    import shutil
    import tempfile
    import urllib.request

    if offline():
        raise OSError("downloads disabled by FEDGUIDE_OFFLINE=1")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=dest.parent, delete=False) as tmp:
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp:
                shutil.copyfileobj(resp, tmp)
        except BaseException:
            tmp.close()
            os.unlink(tmp.name)
            raise
    os.replace(tmp.name, dest)
    return dest


def download_dir(name: str) -> Path:
    """Where downloads of dataset ``name`` go: $FEDGUIDE_DATA/<name> or ~/.cache/fedguide/<name>."""
    import os

    base = os.environ.get("FEDGUIDE_DATA") or os.path.join(os.path.expanduser("~"), ".cache", "fedguide")
    return Path(base) / name


def candidate_roots(root: Optional[str], env_var: str, *defaults: str) -> list[Path]:
    """Where to look, in order: the config's data.root, the environment variable, system defaults."""
    import os

    out = []
    if root:
        out.append(Path(root).expanduser())
    if os.environ.get(env_var):
        out.append(Path(os.environ[env_var]).expanduser())
    out.extend(Path(d) for d in defaults)
    return out
