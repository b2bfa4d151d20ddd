"""ddplab: config-driven DDP + mixed-precision training, composed by Hydra.

    python train.py                                            # one process
    torchrun --standalone --nproc_per_node=2 train.py model=resnet18 amp=true
    tensorboard --logdir outputs

``ddplab.run(cfg)`` runs one job and returns its final metrics.
"""

from ddplab.run import run

__all__ = ["run"]
__version__ = "0.1.0"
