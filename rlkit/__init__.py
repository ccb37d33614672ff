"""rlkit: composable RL post-training of language models on PyTorch Lightning."""

__version__ = "0.1.0"

__all__ = ["FitResult", "__version__", "fit"]


def __getattr__(name: str):
    # `rlkit.fit` imports Lightning and torch only when it is used: `import rlkit` stays instant
    if name in ("fit", "FitResult"):
        from rlkit import api

        return getattr(api, name)
    raise AttributeError(f"module 'rlkit' has no attribute {name!r}")
