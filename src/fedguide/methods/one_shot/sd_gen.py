"""SD_Gen, FedCADO's text-only baseline (FedCADO paper, Sec. 4.1): the server generates images from the
class prompts alone, no classifier guiding them, and trains the global model on them.

It is FedCADO's pipeline (fedcado.py) with every guidance term off: the same prompts (``prompt``, "a
photo of a {class}"), CFG scale, sampler, number of images and per-image noise, and the same chunked,
resumable synthetic set (_synthetic.py), so an SD_Gen and a FedCADO run of one seed differ in the
classifier guidance alone.

Decisions:
- The images are generated per client "slot" as FedCADO's are: ``images_per_class`` for each class a
  client holds. The clients' class sets are the only thing SD_Gen takes from them, so the synthetic set
  has FedCADO's size and class balance (under label skew, the label space the clients cover).
- With ``aggregation: ft`` (the default, as in the paper) clients upload their class sets but do not
  train: no client model is needed. ``md`` / ``sd`` distil from trained client models as in FedCADO.
"""
from __future__ import annotations

from fedguide.methods.base import METHODS
from fedguide.methods.one_shot.fedcado import FedCADO, GenerationParams


@METHODS.register("sd_gen", params=GenerationParams)
class SDGen(FedCADO):
    """SD_Gen: text-to-image generation from class prompts alone, then training on it (FedCADO's baseline)."""

    paper = "https://arxiv.org/abs/2311.08870"

    Params = GenerationParams

    def guidance_terms(self) -> tuple[bool, bool, bool]:
        return False, False, False
