"""``python -m ddplab <command>``: what ddplab does besides training (train.py trains).

    python -m ddplab export <run dir or checkpoint> --to safetensors|state_dict|hf|auto   # the model out
    python -m ddplab generate <run dir or export folder> --prompt TEXT                  # what it writes
    python -m ddplab sync <run dir>                                     # what an outage kept from MLflow

(the export: ``ddplab.checkpoint.export``; sampling: ``ddplab.generate``; ``ddplab.sync``)
"""

from __future__ import annotations

import sys

COMMANDS = {"export": "ddplab.checkpoint.export", "generate": "ddplab.generate", "sync": "ddplab.sync"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        got = repr(argv[0]) if argv else "nothing"
        print(
            f"python -m ddplab: {got} is not a command. Fix: python -m ddplab "
            f"{'|'.join(COMMANDS)} ... (train with python train.py)",
            file=sys.stderr,
        )
        return 2
    import importlib

    return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    from ddplab.runtime import teardown

    teardown.cheap_interpreter_exit()  # before torch is imported: its handler then runs last
    sys.exit(main())
