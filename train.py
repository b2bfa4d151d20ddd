"""ddplab's entry point: Hydra composes conf/, ddplab.run trains.

    python train.py                                            # one process (debugger-friendly)
    torchrun --standalone --nproc_per_node=2 train.py model=resnet18 amp=true
    python train.py -m optimizer.lr=0.1,0.01 model=mlp,convnet # sweep
    python train.py --cfg job                                  # print the composed config
"""

import sys

import hydra
from omegaconf import DictConfig
from torch.distributed.elastic.multiprocessing.errors import record

import ddplab  # registers the typed config schemas used by conf/
from ddplab.cli import prepare_argv


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
@record  # under torchrun, a failing rank's traceback appears in torchrun's summary
def main(cfg: DictConfig) -> float | None:
    return ddplab.run(cfg).get(cfg.objective)  # sweepers (e.g. Optuna) read the objective


if __name__ == "__main__":
    sys.argv = prepare_argv(sys.argv)
    main()
