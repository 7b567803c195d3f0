"""Frozen foundation models guiding federated learning: a Stable-Diffusion-layout pipeline (hub id or
folder) loaded with diffusers/transformers, its text and image encoders, hooked UNet features, fused
PCA features, a validated on-disk feature cache and guided samplers. See README "Guidance models".

Import the submodules directly (``fedguide.guidance.model``, ``.features``, ``.samplers``, ...): they
pull in diffusers and transformers, which a run without guidance never needs.
"""
