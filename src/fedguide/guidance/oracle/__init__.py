"""The oracle guidance source (``guidance.model: oracle``): a diagnostic upper bound, never a default.

Question it answers: when a diffusion-guided method gains nothing over FedAvg, is the guidance model the
limit, or the way the method's loss uses it? The oracle replaces the diffusion model by the best features
the guidance pool can give: a small supervised CNN trained on the labels of the very pool the embedded
guidance models were pretrained on for the run's dataset, whose penultimate features are served through
the interface the methods already read (``GuidanceModel``'s text, image and block-feature calls, its
image encoder, the fused recipes and the feature store). FedDifRC, SemanticFL, align_features, FedRCL's
SD alignment and the frozen-encoder methods (zero-shot, centroid fine-tuning, FedAvg-SM, SemiFL, RSCFed)
run on it unchanged. A method that generates images (FedCADO, SD_Gen, FedDISC, FedDDA, FedRCL's
generated data) is refused with a ConfigError when the method is built, so ``--dry-run`` says so too: the
oracle has no diffusion model to sample from.

What it serves (its record in ``<run>/guidance/<method>.json`` under ``guidance_source`` says the same):
- image features f(x): the network's penultimate layer (``OracleSettings.width`` units after ReLU) on the
  image resized to 32 x 32 RGB in [-1, 1] (the embedded models' input); it reads no other size;
- the same features for every timestep t, noise draw and client condition: nothing is noised;
- "text" embedding of a prompt naming a class of the pool ("a photo of a {class}"): that class's
  prototype, the mean f over the class's pool images; a prompt naming no class (the empty prompt, the
  self-supervised vocabulary) embeds to zeros;
- block features of an image under a prompt, at every block name a method asks for (down.i, mid, up.i):
  f(x) + the prompt's embedding, as a 1 x 1 map, so a class prompt pulls the features towards its class
  as a text-conditioned UNet's would and FedDifRC's TDCL still has distinct positives and negatives
  (with the same features for every prompt its loss would be log C with no gradient).

The pool: the embedded models' pretraining pool of the dataset (``fmnist``, ``digits_domains``: the public
slice their MODEL_CARD.md records, drawn as ``fedguide pretrain-guidance`` draws it), else the run's own
public pool (``data.public_fraction > 0``), else a ConfigError; never other client images, never the test
set. A tenth of the pool (stratified, seeded) is held out to report an honest accuracy. Training is seeded
and deterministic on the CPU, and the network is cached as a sealed safetensors file under
``guidance.feature_cache``/oracle, keyed by everything it depends on (data, pool, settings).

Modules: ``network`` (the CNN and its input), ``pool`` (which images it learns from), ``training`` (the
seeded fit, accuracies, prototypes), ``cache`` (sealed files and their key), ``serving`` (the
GuidanceModel and image-encoder interface), ``loading`` (one oracle per run data, from the cache or trained).
"""
from __future__ import annotations

NAME = "oracle"
INPUT_SIDE = 32  # pixels per side, the embedded models' input: the oracle reads images at this size only

GENERATION_REFUSED = (
    "guidance.model=oracle serves features only: it has no diffusion model to generate images with, and {who} "
    "generates them. Use guidance.model=embedded (or a Stable Diffusion pipeline) for it; the oracle is a "
    "diagnostic for the feature-guided methods (feddifrc, semanticfl, align_features, the frozen-encoder methods)")
