"""``fedguide pretrain-guidance``: trains the embedded guidance models from scratch on a CPU.

Data: the public pools of the embedded datasets only — Fashion-MNIST's and digits_domains' stratified
``public_fraction`` (0.1) slices, drawn with ``public_seed`` exactly as a run's ``data.public_fraction``
draws them (``data.federated.public_pool``), so a run with the same public settings never gives a client
or the test set an image the guidance models saw. Images become 32x32 RGB in [-1, 1] (Fashion-MNIST's
28x28 grey is resized and repeated to three channels); every class gets the prompt
"a photo of a {class name}" (20 prompts: ten garments, ten digits).

Stages, each seeded from ``seed`` and logged to ``train_log.jsonl`` (step, loss, seconds):
1. Mini CLIP: EfficientNet-Lite0 features of the pool (frozen, computed once) and a projection MLP into
   MiniLM's sentence space, trained with the CLIP loss against the 20 prompt embeddings. With one prompt
   per class the text side of a batch is the prompt set, so the loss is cross-entropy over cosine
   logits / τ with a learned temperature (CLIP's image-to-text direction; the text tower is frozen).
   ``clip_augmented_views`` adds random views (``augment.random_views``: pose and colour) of each
   digits_domains image: trained on the 430 originals alone the projection reaches train zero-shot 1.0
   and names 59 % of the test digits, since the domains differ mostly in colour and polarity.
2. VAE: diffusers ``AutoencoderKL`` 32x32x3 -> 8x8x4, L2 reconstruction + ``vae_kl`` x KL. Its
   ``scaling_factor`` is then set to 1 / std of the pool's latents (Stable Diffusion's convention).
3. UNet: diffusers ``UNet2DConditionModel`` with four levels like SD's (so "decoder layer L of 4"
   exists), cross-attention on MiniLM's token states plus one image-embedding token (the mini-CLIP
   embedding, L2-normalised and scaled to the text tokens' mean norm), ε-prediction with the
   ``DDPMScheduler`` of SD-1.5 (1000 steps, scaled-linear betas). Condition dropout: the prompt is
   replaced by the empty prompt with ``p_drop_text`` and the image token by zeros with ``p_drop_image``,
   independently, so the model knows p(x), p(x|text), p(x|image) and p(x|text, image) —
   classifier-free and composed guidance need all four. Latents are drawn from the VAE posterior
   each step (mean and std stored once). The shipped weights are the EMA of the training weights.
   ``unet_dataset_share`` fixes each dataset's share of every UNet batch: digits_domains' public slice
   is 430 images beside Fashion-MNIST's 6000, and drawn in proportion (6.7 % of a batch) the UNet never
   learns to draw digits (16 % of its text-conditioned digits were recognisable); at 0.35 it sees each
   digits image ~7.5x as often as a Fashion-MNIST one. ``None`` draws batches uniformly over the pool.
   ``repa_weight`` > 0 adds representation alignment (REPA, repa.py): the hidden states of the
   ``repa_layers`` blocks, through small projection heads trained alongside and then discarded, are
   pulled towards the frozen EfficientNet-Lite0 feature map (or the mini-CLIP embedding) of the clean image.

The output folder has the SD layout (unet/, vae/, scheduler/, tokenizer/, image_encoder/,
model_index.json) plus fedguide.json (the packaged text encoder, the embedded image encoder, the image
token's scale) and MODEL_CARD.md (command, seed, data, settings, losses, times, sha256 of every file).
It is written to a temporary sibling folder and renamed into place at the end. Finished stages and
UNet checkpoints (every ``checkpoint_every`` steps) are kept in a ``.<name>.partial`` sibling until
then: a killed run, started again with the same settings, skips the finished stages and continues the
UNet from its last checkpoint, drawing the same batches and noise as an uninterrupted run. Those files
are safetensors with a JSON part (partial.py), never pickles: a file there that is not one stops the
run with an error and is never unpickled.

Modules, in the order a run uses them: ``settings`` (PretrainSettings and what each stage depends on),
``partial`` (the log and the finished stages kept across a kill), ``data`` (the pool and its prompts'
text states), ``batches`` (seeded batch draws), ``clip_stage``, ``vae_stage``, ``repa``, ``unet_stage``,
``layout`` (the SD-layout folder), ``card`` (MODEL_CARD.md) and ``run`` (``pretrain`` and the CLI).
"""
