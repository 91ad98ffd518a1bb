"""Device- and version-specific code kept out of the model, parallel and training code: `cpu.py` (the CPU's own
tuning), `cpu_attention.py` (the CPU's causal attention kernel and when it runs), `peaks.py` (accelerator peaks) and
`torch_private.py` (every private torch API meshformer uses, each wrapped once)."""
