"""Diffusion-guided methods: a frozen text-to-image model's features or images guide the clients' local
training of the run's own model.

FedDifRC, SemanticFL and align_features read the UNet's (or text encoder's) features of the client's own
samples, cached once per run and looked up per batch through ``_diffusion_features`` (``ClientTargets``,
``ClientPositions``); FedRCL (and its SD-aligned † variant, ``_sd_alignment``) and FedDDA (generated
samples added to the clients' sets, ``_generated_data``) complete the FedDifRC tables. Subclass
``fedguide.methods.base.Method``; read guidance through ``fedguide.guidance`` and never load a pipeline
inside ``local_loss``.
"""
