"""fedguide: heterogeneous federated learning guided by pretrained diffusion models."""
__version__ = "0.1.0"
