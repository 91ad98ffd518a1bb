"""meshformer: PyTorch-native pre-training and fine-tuning of Llama-family models from one YAML file."""

__version__ = "0.1.0"
