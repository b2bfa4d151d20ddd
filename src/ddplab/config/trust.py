"""What a stored config may build: a run dir or checkpoint from elsewhere runs nothing of its own.

``python -m ddplab export`` and ``mode=eval`` build the model, data, task and callbacks from the config a
checkpoint carries. Its ``_target_`` entries are text anyone could have written: ``numpy.savetxt``,
``builtins.open`` or ``numpy.load(allow_pickle=True)`` of a file shipped beside it are as easy to name as a
model (Hydra's own blocklist stops ``os.system`` and little else). So every ``_target_`` in a stored
config, at any depth, must be one of:

* a target ddplab ships: the schemas' defaults and ``conf/``'s options (a model, a dataset, a task, a
  callback, a schedule), compared as the objects they import to, so an alias through a module's imports
  (``ddplab.models.torch.load``) is not mistaken for one;
* a ``torch.optim`` optimizer or learning-rate scheduler class;
* a target the command's own config names (what you typed is yours to run);

unless the user passes the trust switch (``trust_stored_config=true``, ``export --trust-config``). A name
outside ddplab and torch is refused without being imported: importing a module runs it.
"""

from __future__ import annotations

import functools
import importlib
from pathlib import Path
from typing import Any, Iterator

from omegaconf import DictConfig, ListConfig, OmegaConf

# Packages whose modules may be imported to compare a target by identity (importing them runs only their
# own, installed code); any other top-level name is refused as text.
_IMPORTABLE = ("ddplab", "torch", "optuna")


def targets(node: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """Every ``(key, _target_)`` in ``node`` (a config, a dict or list of them), at any depth."""
    if isinstance(node, (DictConfig, ListConfig)):
        node = OmegaConf.to_container(node, resolve=False)
    if isinstance(node, dict):
        for key, value in node.items():
            where = f"{path}.{key}" if path else str(key)
            if key == "_target_":
                yield path or "(top)", str(value)
            else:
                yield from targets(value, where)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from targets(value, f"{path}[{i}]")


def _locate(target: str) -> Any:
    """The object a target names, imported only from ddplab, torch or optuna; None otherwise or if absent."""
    parts = target.split(".")
    if parts[0] not in _IMPORTABLE:
        return None
    for i in range(len(parts), 0, -1):  # the longest importable module, then attributes (Hydra's own walk)
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ImportError:
            continue
    else:
        return None
    for attr in parts[i:]:
        obj = getattr(obj, attr, None)
        if obj is None:
            return None
    return obj


# Targets ddplab itself adds to a job's config (a study trial's reporter, verify_resume's stop): shipped too.
_ADDED_BY_DDPLAB = ("ddplab.study.report.ReportToStudy", "ddplab.verify.PreemptAt")


def _conf_dir() -> Path:
    return Path(__file__).resolve().parents[3] / "conf"  # the repository's conf/, beside src/


@functools.lru_cache(maxsize=1)
def _shipped_names() -> frozenset[str]:
    """The targets ddplab's own config names: the registered schemas', conf/'s and those it adds itself."""
    from hydra.core.config_store import ConfigStore

    from ddplab.config import register_configs

    register_configs()
    found: set[str] = set(_ADDED_BY_DDPLAB)

    def walk(repo: dict[str, Any]) -> None:
        for value in repo.values():
            if isinstance(value, dict):
                walk(value)
            elif getattr(value, "node", None) is not None:
                found.update(t for _, t in targets(value.node))

    walk(ConfigStore.instance().repo)
    for yaml in sorted(_conf_dir().rglob("*.yaml")) if _conf_dir().is_dir() else []:
        found.update(t for _, t in targets(OmegaConf.load(yaml)))
    return frozenset(found)


@functools.lru_cache(maxsize=1)
def _shipped_objects() -> frozenset[int]:
    """ids of what those names import to (another spelling of a shipped target is that target)."""
    return frozenset(id(o) for o in map(_locate, _shipped_names()) if o is not None)


def _is_torch_optim(obj: Any) -> bool:
    import torch

    return isinstance(obj, type) and issubclass(
        obj, (torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler)
    )


def untrusted(stored: Any, own: Any = None) -> list[tuple[str, str]]:
    """The ``(key, _target_)`` entries of ``stored`` that ddplab would not build without the trust switch."""
    mine = {t for _, t in targets(own)} if own is not None else set()
    refused = []
    for key, target in targets(stored):
        if target in mine or target in _shipped_names():
            continue
        obj = _locate(target)
        if obj is None or not (id(obj) in _shipped_objects() or _is_torch_optim(obj)):
            refused.append((key, target))
    return refused


def refusal(
    source: str, stored: Any, own: Any = None, switch: str = "trust_stored_config=true"
) -> str | None:
    """One line naming the first target ``stored`` may not build and the switch, or None if it may."""
    bad = untrusted(stored, own)
    if not bad:
        return None
    key, target = bad[0]
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    return (
        f"{source}: its stored config names {key}._target_={target!r}{more}, which is neither ddplab's, "
        "torch.optim's nor in this command's config; a run dir from elsewhere builds only what ddplab "
        "ships. "
        f"Fix: if you trust where it came from, pass {switch}"
    )
