"""Device- and version-specific code kept out of the model, parallel and training code: `cpu.py` (the CPU's own
tuning) and `torch_private.py` (every private torch API meshformer uses, each wrapped once)."""
