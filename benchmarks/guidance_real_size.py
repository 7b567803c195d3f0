"""Each diffusion-guided method's guidance workload at Stable Diffusion's real size, on a GPU.

    python benchmarks/guidance_real_size.py [--preset real|small] [--out DIR]

Builds randomly initialised pipelines with the published component sizes of SD-1.5 (UNet 320-640-1280-1280,
VAE 128-256-512-512, a 12-layer 768-wide CLIP text encoder, 77 tokens, 512-px images) and of
SD-2.1-unCLIP (1024-wide UNet context, 23-layer text encoder, v-prediction, 768-px images, image
embeddings through the noised-embedding class input), writes them in SD layout and loads them through
fedguide's own loader (``guidance.dtype: auto`` = float16 on CUDA). Then, per method, its guidance work:

- UNet FLOPs per image at the input sizes the methods use (FedDifRC 224 px, SemanticFL 32 px, the
  pipeline's 512 px), counted by torch's FlopCounterMode on the meta device: no weights, no device, the
  same count on any machine;
- FedDifRC features: VAE encode + noise at t = 150 + hooked UNet (decoder layers 2-4) + the fused PCA
  recipe (d = 512), against the bare UNet forward on the same latents (target: within 2x), at the paper's
  224 px (Sec. 4.1, ``method.image_size: paper``) and at the pipeline's 512 px;
- SemanticFL features: the same at t = 150 from every UNet block pooled and reduced by one PCA, at the
  data's own 32 px (Stage 1: 4x4 latents);
- SD_Gen: DDIM 50 steps, CFG 3, class prompts only;
- FedCADO: the same plus classifier guidance (CE + 0.1 L_BN of a ResNet-18 at 224 px, through the VAE
  decoder and the UNet) and M = 10 noise-editing steps;
- FedDISC: DDIM 20 steps, CFG 3, composed guidance with two image-embedding conditions (w_f = w_g = 2)
  on the unCLIP pipeline.

Random weights cost what trained ones do (the arithmetic does not depend on the values), so the speeds are
the real models'; the check that every output stays finite in float16 is a check of the code path, not of
image quality. The image encoder of the unCLIP pipeline is small (not timed: FedDISC encodes client images
once, on the clients). ``--preset small`` runs the same workloads at a few-channel size on any machine.
Prints one table row per workload (images/s, peak GPU memory, finite) and writes results.json to --out.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from fedguide.config import GuidanceConfig  # noqa: E402
from fedguide.guidance.features import DiffusionFeatures, FeatureSpec  # noqa: E402
from fedguide.guidance.fused import FusedFeatures, PooledPCAFeatures  # noqa: E402
from fedguide.guidance.model import GuidanceModel  # noqa: E402
from fedguide.guidance.samplers import SamplerConfig, sample, scaled_gradient  # noqa: E402
from fedguide.guidance.tiny import clip_char_tokenizer  # noqa: E402
from fedguide.methods.one_shot.fedcado import BatchNormStatistics, guidance_loss  # noqa: E402
from fedguide.methods.frozen_encoder.centroids.feddisc import composed_conditions  # noqa: E402
from fedguide.models import MODELS, ModelSpec, build_model  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
from _timing import best_seconds, synchronized_seconds  # noqa: E402

# Published sizes (diffusers/transformers configs of runwayml/stable-diffusion-v1-5 and
# stabilityai/stable-diffusion-2-1-unclip); "small" keeps the structure at a few channels for a CPU.
PRESETS = {
    "real": {
        "sd": dict(image=512, unet=dict(block_out_channels=(320, 640, 1280, 1280), layers_per_block=2,
                                        attention_head_dim=8, cross_attention_dim=768),
                   text=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                             hidden_act="quick_gelu"),
                   vae=dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2)),
        "unclip": dict(image=768, unet=dict(block_out_channels=(320, 640, 1280, 1280), layers_per_block=2,
                                            attention_head_dim=(5, 10, 20, 20), cross_attention_dim=1024,
                                            use_linear_projection=True),
                       text=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=23,
                                 num_attention_heads=16, hidden_act="gelu"),
                       vae=dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2), embed=1024),
        "batch": 8, "extract_images": 64, "fit_batches": 2, "pca_dim": 512, "teacher_px": 224, "teacher_width": 64,
        "feddifrc_px": 224, "data_px": 32,
    },
    "small": {
        "sd": dict(image=64, unet=dict(block_out_channels=(32, 64, 64, 64), layers_per_block=1, attention_head_dim=8,
                                       cross_attention_dim=64, norm_num_groups=8),
                   text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                             hidden_act="quick_gelu"),
                   vae=dict(block_out_channels=(16, 32, 32, 32), layers_per_block=1, norm_num_groups=8)),
        "unclip": dict(image=64, unet=dict(block_out_channels=(32, 64, 64, 64), layers_per_block=1,
                                           attention_head_dim=(2, 4, 8, 8), cross_attention_dim=64,
                                           use_linear_projection=True, norm_num_groups=8),
                       text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                 hidden_act="gelu"),
                       vae=dict(block_out_channels=(16, 32, 32, 32), layers_per_block=1, norm_num_groups=8), embed=32),
        "batch": 2, "extract_images": 8, "fit_batches": 2, "pca_dim": 32, "teacher_px": 32, "teacher_width": 8,
        "feddifrc_px": 32, "data_px": 16,
    },
}
MAX_TOKENS = 77


def build_pipeline(folder: Path, sizes: dict, unclip: bool, seed: int = 0) -> Path:
    """A randomly initialised SD-layout pipeline of the given component sizes, written to ``folder``."""
    from diffusers import AutoencoderKL, DDIMScheduler, DDPMScheduler, UNet2DConditionModel
    from diffusers.pipelines.stable_diffusion.stable_unclip_image_normalizer import StableUnCLIPImageNormalizer
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPVisionConfig, CLIPVisionModelWithProjection

    torch.manual_seed(seed)
    image, latent = sizes["image"], sizes["image"] // 8
    tok = clip_char_tokenizer(folder / "tokenizer", MAX_TOKENS)
    CLIPTextModel(CLIPTextConfig(vocab_size=len(tok), max_position_embeddings=MAX_TOKENS, eos_token_id=1,
                                 bos_token_id=0, pad_token_id=1, **sizes["text"])).save_pretrained(folder / "text_encoder")
    vae = sizes["vae"]
    AutoencoderKL(latent_channels=4, sample_size=image, down_block_types=("DownEncoderBlock2D",) * 4,
                  up_block_types=("UpDecoderBlock2D",) * 4, **vae).save_pretrained(folder / "vae")
    unet_kw = dict(sizes["unet"])
    if unclip:
        unet_kw.update(class_embed_type="projection", projection_class_embeddings_input_dim=2 * sizes["embed"])
    UNet2DConditionModel(sample_size=latent, in_channels=4, out_channels=4, **unet_kw).save_pretrained(folder / "unet")
    DDIMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                  set_alpha_to_one=False, steps_offset=1, clip_sample=False,
                  prediction_type="v_prediction" if unclip else "epsilon").save_pretrained(folder / "scheduler")
    components = {"vae": ["diffusers", "AutoencoderKL"], "unet": ["diffusers", "UNet2DConditionModel"],
                  "text_encoder": ["transformers", "CLIPTextModel"], "tokenizer": ["transformers", "CLIPTokenizer"],
                  "scheduler": ["diffusers", "DDIMScheduler"]}
    if unclip:
        CLIPVisionModelWithProjection(CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                       num_attention_heads=2, image_size=224, patch_size=32,
                                                       projection_dim=sizes["embed"])).save_pretrained(
            folder / "image_encoder")
        StableUnCLIPImageNormalizer(embedding_dim=sizes["embed"]).save_pretrained(folder / "image_normalizer")
        DDPMScheduler(num_train_timesteps=1000, beta_schedule="squaredcos_cap_v2").save_pretrained(
            folder / "image_noising_scheduler")
        components.update(image_encoder=["transformers", "CLIPVisionModelWithProjection"],
                          image_normalizer=["stable_diffusion", "StableUnCLIPImageNormalizer"],
                          image_noising_scheduler=["diffusers", "DDPMScheduler"])
    name = "StableUnCLIPImg2ImgPipeline" if unclip else "StableDiffusionPipeline"
    (folder / "model_index.json").write_text(json.dumps({"_class_name": name, "_diffusers_version": "0.0.0",
                                                          **components}, indent=1))
    return folder


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2 ** 30 if torch.cuda.is_available() else float("nan")


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


PROMPTS = ["a photo of a cat", "a photo of a dog", "a photo of a truck", "a photo of a bird"]


def prompts_for(n: int) -> list[str]:
    return [PROMPTS[i % len(PROMPTS)] for i in range(n)]


ALL_BLOCKS = ("down.0", "down.1", "down.2", "down.3", "mid", "up.0", "up.1", "up.2", "up.3")


def unet_flops(cfg: dict) -> dict:
    """FLOPs of one UNet forward per image (batch 1, t = 150, a full text context) at each input size the
    methods use; the UNet is built on the meta device, so nothing is allocated or computed."""
    from diffusers import UNet2DConditionModel
    from torch.utils.flop_counter import FlopCounterMode

    sizes = cfg["sd"]
    with torch.device("meta"):
        unet = UNet2DConditionModel(sample_size=sizes["image"] // 8, in_channels=4, out_channels=4, **sizes["unet"])
    context = torch.empty(1, MAX_TOKENS, sizes["unet"]["cross_attention_dim"], device="meta")
    out = {}
    for name, px in (("feddifrc_paper", cfg["feddifrc_px"]), ("semanticfl_native", cfg["data_px"]),
                     ("pipeline", sizes["image"])):
        with FlopCounterMode(display=False) as counter:
            unet(torch.empty(1, 4, px // 8, px // 8, device="meta"), torch.tensor([150], device="meta"),
                 encoder_hidden_states=context)
        out[f"gflop_{name}_{px}px"] = round(counter.get_total_flops() / 1e9, 2)
    flops = list(out.values())
    out["pipeline_over_feddifrc_paper"] = round(flops[2] / flops[0], 2)
    out["pipeline_over_semanticfl_native"] = round(flops[2] / flops[1], 1)
    return {"img_s": float("nan"), "finite": True, **out}


def features(model, cfg: dict, size: int, image_size: int | None = None, recipe: str = "fused") -> dict:
    """Feature extraction of ``size``-px images resized to ``image_size`` before the VAE (None: the
    pipeline's own): FedDifRC's fused decoder layers 2-4 or SemanticFL's pooled blocks (``recipe``)."""
    n, b = cfg["extract_images"], cfg["batch"]
    images = torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(0)) * 2 - 1
    prompts = prompts_for(n)
    fit = b * cfg["fit_batches"]
    if recipe == "fused":
        layers = ("up.1", "up.2", "up.3")
        fusion = FusedFeatures(layers, d=cfg["pca_dim"], samples_per_image=64)
    else:  # one PCA over pooled vectors needs as many images as dims; its size does not change the timing
        layers = ALL_BLOCKS
        fusion = PooledPCAFeatures(layers, d=min(cfg["pca_dim"], fit - 1))
    feats = DiffusionFeatures(model, FeatureSpec(layers, t=150, image_size=image_size), fusion)
    feats.fit(images[:fit], prompts[:fit], np.arange(fit), batch_size=b)

    def extract():
        for i in range(0, n, b):
            out = feats(images[i:i + b], prompts[i:i + b], np.arange(i, i + b))
            assert torch.isfinite(out).all(), "non-finite features"

    latents = model.encode_image(images[:b].to(model.device), size=image_size).detach()
    context = model.encode_text(tuple(prompts[:b])).tokens

    def bare():
        with torch.no_grad():
            for _ in range(0, n, b):
                model.eps(latents, 150, context)

    batch = images[:b].to(model.device)

    def encode():
        with torch.no_grad():
            for _ in range(0, n, b):
                model.encode_image(batch, size=image_size)

    extract()  # warm-up (kernels, caches)
    bare()
    encode()
    reset_peak()
    t_extract, t_bare, t_vae = (best_seconds(f, warmup=False) for f in (extract, bare, encode))
    # The target compares the feature pass with the UNet pass it hooks; the VAE encode is the same for any
    # use of the latents, so it is timed on its own and taken out of that ratio.
    return {"img_s": n / t_extract, "bare_unet_img_s": n / t_bare, "vae_encode_img_s": n / t_vae,
            "ratio_to_bare_unet": (t_extract - t_vae) / t_bare, "latent_px": int(latents.shape[-1]), "finite": True}


def generation(model, cfg: dict, steps: int, loss_fn=None, edit_steps: int = 0, conditions=(),
               prompts=None) -> dict:
    b = cfg["batch"]
    prompts = prompts or prompts_for(b)
    config = SamplerConfig(steps=steps, guidance_scale=3.0, batch_size=b, edit_steps=edit_steps, progress=False)
    # one short untimed call first: kernel selection and caches
    sample(model, prompts, SamplerConfig(steps=2, guidance_scale=3.0, batch_size=b, progress=False),
           conditions, loss_fn=loss_fn)
    reset_peak()
    result = None

    def go():
        nonlocal result
        result = sample(model, prompts, config, conditions, loss_fn=loss_fn)

    seconds = synchronized_seconds(go)
    out = {"img_s": len(prompts) / seconds, "finite": bool(torch.isfinite(result.images).all()
                                                          and torch.isfinite(result.latents).all())}
    if result.edit_losses:
        out["edit_loss_first_last"] = [round(result.edit_losses[0], 4), round(result.edit_losses[-1], 4)]
    return out


def teacher_and_targets(model, cfg: dict, b: int):
    """A ResNet-18 client classifier at ``teacher_px``, the splits stub ``to_model_input`` reads, b labels."""
    px = cfg["teacher_px"]
    torch.manual_seed(0)
    teacher = build_model("resnet18", MODELS.get("resnet18").params(width=cfg["teacher_width"]),
                          ModelSpec(input_shape=(3, px, px), num_classes=10)).to(model.device).eval()
    splits = SimpleNamespace(input_shape=(3, px, px), pixel_stats=((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)))
    return teacher, splits, torch.arange(b, device=model.device) % 10


def fedcado(model, cfg: dict) -> dict:
    teacher, splits, labels = teacher_and_targets(model, cfg, cfg["batch"])
    with BatchNormStatistics(teacher) as bn:
        loss_fn = guidance_loss(teacher, splits, labels, ce=True, bn=bn, bn_weight=0.1)
        return generation(model, cfg, 50, loss_fn=loss_fn, edit_steps=10)


def guidance_gradient(model, folder: Path, cfg: dict) -> dict:
    """FedCADO's gradient ∇_{s_t} L(decode(ŝ_0)) in the model's dtype against a float32 copy of the same
    weights: float16 must not underflow it (cosine near 1, few exact zeros)."""
    b = min(cfg["batch"], 4)
    teacher, splits, labels = teacher_and_targets(model, cfg, b)
    reference = GuidanceModel.from_config(GuidanceConfig(model=str(folder), dtype="float32"))
    latent = torch.randn(b, model.latent_channels, model.latent_size, model.latent_size, generator=torch.Generator().manual_seed(1))
    grads = []
    for m in (model, reference):
        loss_fn = guidance_loss(teacher, splits, labels, ce=True, bn=None, bn_weight=0.0)
        context = m.encode_text(tuple(prompts_for(b))).tokens

        def objective(s, m=m, loss_fn=loss_fn, context=context):
            eps = m.eps(s, 500, context).float()
            return loss_fn(m.decode(m.predict_x0(s, 500, eps)).float(), torch.arange(b)).sum(), None

        # the sampler's latents are float32; the UNet and VAE run in the model's dtype
        x = latent.to(m.device)
        if m is model:  # what an unscaled backward gives, for comparison
            leaf = x.clone().requires_grad_(True)
            grads.append(torch.autograd.grad(objective(leaf)[0], leaf)[0].float().flatten())
        grads.append(scaled_gradient(objective, x, m.dtype)[0].float().flatten())
    plain, half, full = grads if len(grads) == 3 else (grads[0], grads[0], grads[1])

    def cos(a):
        return round(float(torch.nn.functional.cosine_similarity(a, full, dim=0)), 5)

    return {"img_s": float("nan"), "finite": bool(torch.isfinite(half).all()), "grad_cosine_vs_fp32": cos(half),
            "grad_norm_ratio": round(float(half.norm() / full.norm()), 5),
            "grad_zero_fraction": round(float((half == 0).float().mean()), 6),
            "unscaled_grad_cosine_vs_fp32": cos(plain),
            "unscaled_grad_zero_fraction": round(float((plain == 0).float().mean()), 6),
            "grad_norm_fp32": float(full.norm())}


def feddisc(model, cfg: dict, embed: int) -> dict:
    b = cfg["batch"]
    g = torch.Generator().manual_seed(0)
    centroids, domains = (torch.nn.functional.normalize(torch.randn(b, embed, generator=g), dim=1) for _ in range(2))
    context = model.encode_text([PROMPTS[0]]).tokens.expand(b, -1, -1)
    conditions = composed_conditions(model, context, [(2.0, centroids), (2.0, domains)])
    return generation(model, cfg, 20, conditions=conditions, prompts=[PROMPTS[0]] * b)


def run_workload(name: str, fn, rows: list) -> None:
    print(f"-- {name}", flush=True)
    try:
        row = fn()
        row["peak_gib"] = round(peak_gib(), 2)
    except Exception as e:  # report every workload, even when one fails
        traceback.print_exc()
        row = {"error": f"{type(e).__name__}: {e}"}
    row["workload"] = name
    rows.append(row)
    print("   ", json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="real" if torch.cuda.is_available() else "small")
    ap.add_argument("--out", type=Path, default=None, help="folder for results.json")
    ap.add_argument("--workloads", nargs="+", default=["flops", "features_paper", "features", "semanticfl", "sd_gen",
                                                      "fedcado", "gradient", "feddisc"])
    args = ap.parse_args()
    cfg = PRESETS[args.preset]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({torch.get_num_threads()} threads)"
    print(f"preset {args.preset} on {device}, torch {torch.__version__}", flush=True)
    rows: list = []
    if "flops" in args.workloads:
        run_workload("UNet GFLOP per image at each method's input size (meta device, any machine)",
                     lambda: unet_flops(cfg), rows)
    with tempfile.TemporaryDirectory() as tmp:
        sd_work = [w for w in ("features_paper", "features", "semanticfl", "sd_gen", "fedcado", "gradient")
                   if w in args.workloads]
        if sd_work:
            t0 = time.perf_counter()
            folder = build_pipeline(Path(tmp) / "sd", cfg["sd"], unclip=False)
            model = GuidanceModel.from_config(GuidanceConfig(model=str(folder)))
            print(f"SD-1.5-sized pipeline built and loaded in {time.perf_counter() - t0:.1f} s "
                  f"({model.device}, {model.dtype})", flush=True)
            size, paper, data = cfg["sd"]["image"], cfg["feddifrc_px"], cfg["data_px"]
            if "features_paper" in sd_work:
                run_workload(f"FedDifRC features, {paper} px (image_size: paper)",
                             lambda: features(model, cfg, paper, image_size=paper), rows)
            if "features" in sd_work:
                run_workload(f"FedDifRC features, {size} px (image_size: pipeline)", lambda: features(model, cfg, size),
                             rows)
            if "semanticfl" in sd_work:
                run_workload(f"SemanticFL features, {data} px (image_size: paper = native)",
                             lambda: features(model, cfg, data, image_size=data, recipe="pooled"), rows)
            if "sd_gen" in sd_work:
                run_workload(f"SD_Gen, DDIM 50, CFG 3, {size} px", lambda: generation(model, cfg, 50), rows)
            if "fedcado" in sd_work:
                run_workload(f"FedCADO, DDIM 50, CFG 3, CE+BN guidance, M=10, {size} px",
                             lambda: fedcado(model, cfg), rows)
            if "gradient" in args.workloads:
                run_workload(f"FedCADO guidance gradient, {model.dtype} vs float32", lambda: guidance_gradient(
                    model, folder, cfg), rows)
            del model
            reset_peak()
        if "feddisc" in args.workloads:
            t0 = time.perf_counter()
            folder = build_pipeline(Path(tmp) / "unclip", cfg["unclip"], unclip=True)
            model = GuidanceModel.from_config(GuidanceConfig(model=str(folder)))
            print(f"SD-2.1-unCLIP-sized pipeline built and loaded in {time.perf_counter() - t0:.1f} s", flush=True)
            size = cfg["unclip"]["image"]
            run_workload(f"FedDISC, DDIM 20, CFG 3, composed w_f=w_g=2, {size} px",
                         lambda: feddisc(model, cfg, cfg["unclip"]["embed"]), rows)
    print("\n| workload | images/s | peak GiB | finite | notes |\n|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['workload']} | error | | | {r['error'][:120]} |")
            continue
        notes = []
        if "ratio_to_bare_unet" in r:
            notes.append(f"{r['latent_px']}x{r['latent_px']} latents; bare UNet {r['bare_unet_img_s']:.1f} img/s, VAE "
                         f"encode {r['vae_encode_img_s']:.1f} img/s; features from latents / bare UNet "
                         f"{r['ratio_to_bare_unet']:.2f}x (target <= 2)")
        if "pipeline_over_feddifrc_paper" in r:
            counts = (f"{k.removeprefix('gflop_')} {v} GFLOP" for k, v in r.items() if k.startswith("gflop_"))
            notes.append(", ".join(counts)
                         + f"; the pipeline's size costs {r['pipeline_over_feddifrc_paper']}x FedDifRC's paper size, "
                           f"{r['pipeline_over_semanticfl_native']}x SemanticFL's")
        if "grad_cosine_vs_fp32" in r:
            notes.append(f"cosine to float32 {r['grad_cosine_vs_fp32']}, norm ratio {r['grad_norm_ratio']}, "
                         f"exact zeros {r['grad_zero_fraction']} (unscaled backward: cosine "
                         f"{r['unscaled_grad_cosine_vs_fp32']}, zeros {r['unscaled_grad_zero_fraction']})")
        if "edit_loss_first_last" in r:
            notes.append("editing loss {} -> {}".format(*r["edit_loss_first_last"]))
        print(f"| {r['workload']} | {r['img_s']:.3f} | {r['peak_gib']} | {r['finite']} | {'; '.join(notes)} |")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps({"preset": args.preset, "device": device,
                                                           "torch": torch.__version__, "rows": rows}, indent=1))
    if any("error" in r or not r.get("finite", False) for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
