"""lit_rlhf: RLHF (SFT, reward modelling, PPO) the PyTorch Lightning way."""

__version__ = "0.1.0"
