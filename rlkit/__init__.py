"""rlkit: composable RL post-training of language models on PyTorch Lightning."""

__version__ = "0.1.0"
