"""The earlier demo, kept for ``python -m demo --distributed``: a small MLP on synthetic data,
float16 + dynamic loss scaling through the facade, data-parallel over 2 ranks (DDP and FSDP2)."""
