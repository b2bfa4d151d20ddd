"""A study's search space: ``study.params`` in the Hydra Optuna sweeper's grammar → Optuna distributions.

    optimizer.lr: tag(log, interval(1e-4, 1e-1))     float, log-uniform
    optimizer.weight_decay: interval(0, 0.1)          float, uniform
    model.hidden: tag(int, interval(32, 256))         int (tag(int, log, ...) for a log scale)
    batch_size: range(32, 129, 32)                    one of 32, 64, 96, 128 (stop excluded, as in Python)
    model: choice(mlp, convnet)                       categorical (a group option too)

Hydra's own override parser reads the expressions, so they mean what they mean in a ``-m`` sweep.
"""

from __future__ import annotations

import json
import math
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ddplab.config.errors import ConfigError

GRAMMAR = (
    "interval(lo, hi), tag(log, interval(lo, hi)), tag(int, interval(lo, hi)), range(lo, hi[, step]) "
    "or choice(a, b, ...)"
)


def parse(params: Any, cfg: DictConfig) -> dict[str, Any]:
    """``{key: distribution}`` for ``study.params``; a ConfigError names the key, the expression and the
    fix."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    space = {}
    for key, expr in (params or {}).items():
        if key.split(".", 1)[0] not in cfg:
            raise ConfigError(
                f"study.params: {key!r} is not a config key. Fix: name a key of the composed config "
                f"(python train.py --cfg job), e.g. optimizer.lr"
            )
        try:
            override = parser.parse_override(f"{key}={expr}")
        except Exception as e:  # Hydra's grammar error: its first line says where
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(
                f"study.params.{key}={expr!r}: not a search expression ({why}). Fix: {GRAMMAR}"
            ) from None
        try:
            space[key] = _distribution(key, expr, override)
        except ConfigError:
            raise
        # what Hydra or Optuna still refuses (range(1, 5, 0)): before any trial, not in one
        except Exception as e:
            why = " ".join(str(e).split())[:200]
            raise ConfigError(
                f"study.params.{key}={expr!r}: not a usable search expression ({type(e).__name__}: "
                f"{why}). Fix: {GRAMMAR}"
            ) from None
    if not space:
        raise ConfigError(
            "study.params is empty: a study needs something to search. Fix: e.g. "
            "'+study.params={optimizer.lr: \"tag(log, interval(0.001, 0.5))\"}' or hparams_search=study"
        )
    return space


def _distribution(key: str, expr: Any, override: Any) -> Any:
    import optuna.distributions as d
    from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep

    value = override.value()
    if isinstance(value, ChoiceSweep):
        return d.CategoricalDistribution([_plain(v) for v in value.list])
    if isinstance(value, RangeSweep):
        values = list(override.sweep_iterator())
        if not values:
            lo, hi = sorted((value.start, value.stop))
            raise ConfigError(
                f"study.params.{key}={expr!r}: it yields no value. Fix: a start below the stop for a "
                f"positive step, above it for a negative one, e.g. range({lo:g}, {hi:g}, {abs(value.step):g})"
            )
        return d.CategoricalDistribution(values)
    if isinstance(value, IntervalSweep):
        unknown = set(value.tags) - {"log", "int"}
        if unknown:
            raise ConfigError(
                f"study.params.{key}={expr!r}: unknown tag {sorted(unknown)[0]!r}. Fix: tag(log, ...), "
                f"tag(int, ...) or tag(int, log, ...)"
            )
        log = "log" in value.tags
        if log and value.start <= 0:
            raise ConfigError(
                f"study.params.{key}={expr!r}: a log scale needs a start > 0. Fix: e.g. "
                f"tag(log, interval(1e-6, {value.end}))"
            )
        _check_bounds(key, expr, value, log)
        if "int" in value.tags:
            return d.IntDistribution(math.ceil(value.start), math.floor(value.end), log=log)
        return d.FloatDistribution(float(value.start), float(value.end), log=log)
    raise ConfigError(
        f"study.params.{key}={expr!r}: a fixed value, not a search expression. Fix: set it as a "
        f"plain override ({key}={expr}), or search it with {GRAMMAR}"
    )


def _check_bounds(key: str, expr: Any, value: Any, log: bool) -> None:
    """Refused here, named, rather than by Optuna in a traceback or, for an int, by a trial asked with 0."""
    lo, hi = value.start, value.end

    def tagged(a: float, b: float) -> str:
        return (
            f"tag({', '.join(sorted(value.tags))}, interval({a:g}, {b:g}))"
            if value.tags
            else f"interval({a:g}, {b:g})"
        )

    if lo > hi:
        raise ConfigError(
            f"study.params.{key}={expr!r}: its low {lo:g} is above its high {hi:g}. Fix: {tagged(hi, lo)}"
        )
    if "int" in value.tags and math.ceil(lo) > math.floor(hi):
        raise ConfigError(
            f"study.params.{key}={expr!r}: no integer lies in [{lo:g}, {hi:g}]. Fix: bounds around an "
            f"integer, e.g. {tagged(max(math.floor(lo), int(log)), math.ceil(hi))}, or drop the int "
            "tag for a float"
        )


def _plain(v: Any) -> Any:
    return OmegaConf.to_container(v) if OmegaConf.is_config(v) else v


def signature(space: dict[str, Any]) -> str:
    """The space as one JSON string (stored with the study; a later worker must search the same one)."""
    from optuna.distributions import distribution_to_json

    return json.dumps(
        {k: json.loads(distribution_to_json(v)) for k, v in sorted(space.items())}, sort_keys=True
    )


def differences(stored: str, mine: str) -> str:
    """What differs between two signatures, for the refusal: ``optimizer.lr (FloatDistribution 0.001..0.1 vs
    ...)``."""
    a, b = json.loads(stored), json.loads(mine)
    keys = sorted(set(a) | set(b))
    out = [f"{k} ({_short(a.get(k))} vs {_short(b.get(k))})" for k in keys if a.get(k) != b.get(k)]
    return ", ".join(out) or "none"


def _short(entry: dict[str, Any] | None) -> str:
    if entry is None:
        return "absent"
    attrs = entry.get("attributes", {})
    if "choices" in attrs:
        return f"choice{tuple(attrs['choices'])}"
    scale = " log" if attrs.get("log") else ""
    return f"{entry.get('name', '?')}{scale} {attrs.get('low')}..{attrs.get('high')}"
