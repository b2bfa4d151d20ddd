"""Checkpoints: the :class:`CheckpointManager` and torch's ``Stateful`` protocol its
components implement (``manager``), the files on disk (``files``), RNG streams (``rng``)."""

from ddplab.checkpoint.files import BEST, LAST, load, save, save_atomic
from ddplab.checkpoint.manager import CheckpointManager

__all__ = ["CheckpointManager", "save", "save_atomic", "load", "LAST", "BEST"]
