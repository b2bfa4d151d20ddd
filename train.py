"""ddplab's entry point: Hydra composes conf/, ddplab.run trains.

python train.py                                            # one process (debugger-friendly)
torchrun --standalone --nproc_per_node=2 train.py model=resnet18 amp=true
python train.py distributed.nproc_per_node=2               # starts its own 2 ranks
python train.py -m optimizer.lr=0.1,0.01 model=mlp,convnet # sweep (add hydra/launcher=joblib ...)
python train.py --cfg job                                  # print the composed config
"""

import sys
from pathlib import Path

if (
    __name__ == "__main__"
):  # first, before the seconds of imports below: a preemption signal then is not fatal
    from ddplab.runtime import signals, teardown

    signals.hold_during_startup()
    teardown.cheap_interpreter_exit()  # registered first so that it runs last: 0.7 s less at every exit

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

from ddplab import cli  # noqa: E402
from ddplab.config import register_configs  # noqa: E402


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
@record  # under torchrun, a failing rank's traceback appears in torchrun's summary
def main(cfg: DictConfig) -> float | None:
    return cli.main(cfg)  # ddplab.run(cfg), returning cfg.objective to sweepers


if __name__ == "__main__":
    register_configs()  # the typed schemas conf/'s defaults lists name
    cli.skip_needless_mode_lookup(
        Path(__file__).resolve().parent / "conf"
    )  # one compose, not two, where it can
    sys.argv = cli.prepare_argv(sys.argv)
    main()
