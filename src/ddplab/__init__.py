"""ddplab: config-driven DDP + mixed-precision training, composed by Hydra.

    python train.py                                            # one process
    torchrun --standalone --nproc_per_node=2 train.py model=resnet18 amp=true
    tensorboard --logdir outputs

``ddplab.run(cfg)`` runs one job and returns its final metrics.
"""

from typing import Any

__all__ = ["run"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Lazy: `from ddplab.models import ConvNet` (or a launcher importing one
    # module) should not pay for the trainer's imports.
    if name == "run":
        from ddplab.modes import run

        return run
    raise AttributeError(f"module 'ddplab' has no attribute {name!r}")
