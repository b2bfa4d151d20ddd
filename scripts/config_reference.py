"""Write docs/reference.md, every key, group option and default, from the schema (src/ddplab/config/) and
conf/.

Each key's meaning is its schema field's own comment (the lines above it, or the one after it); each group
option's description is the first comment of its yaml, its keys and defaults what Hydra composes for it. So
the page cannot drift from the code: ``tests/integration/test_config_reference.py`` fails when the committed
page differs from what this writes.

    python scripts/config_reference.py           # rewrite docs/reference.md
    python scripts/config_reference.py --check   # exit 1 if it is not current
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import inspect
import io
import sys
import textwrap
import tokenize
import typing
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
OUT = REPO / "docs" / "reference.md"
CONF = REPO / "conf"
NESTED = ("distributed", "checkpoint", "perf", "verify", "study")  # TrainConfig's own sub-configs
GROUPS = ("model", "dataset", "optimizer", "scheduler", "task", "callbacks")  # options with keys of their own
PRESETS = ("experiment", "debug", "hparams_search")  # options that set keys elsewhere


def field_comments(cls: type) -> dict[str, str]:
    """Each field's own comment in its class's source (a base class's for a field it defines): the comment
    lines right above it, else the one on its line. A comment says what one key means: it covers no field
    after it."""
    out: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        out.update({k: v for k, v in _own_comments(klass).items() if v or k not in out})
    return out


def _own_comments(cls: type) -> dict[str, str]:
    source = textwrap.dedent(inspect.getsource(cls))
    comments = {
        tok.start[0]: tok.string.lstrip("#").strip()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    }
    lines = source.splitlines()
    out = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, n = [], node.lineno - 1
        while n >= 1 and n in comments and lines[n - 1].strip().startswith("#"):
            above.insert(0, comments[n])
            n -= 1
        out[node.target.id] = " ".join(above) if above else comments.get(node.end_lineno, "")
    return out


def unmeant(page: str) -> list[str]:
    """The rows of ``page``'s key tables whose meaning is empty, or the same as another key's in that
    table."""
    out, seen = [], {}
    for line in page.splitlines():
        if not line.startswith("| `") or line.count(" | ") < 2:
            seen = {} if not line.startswith("|") else seen  # a new table starts after any other line
            continue
        key, meaning = line.split(" | ")[0].strip("| `"), line.rsplit(" | ", 1)[1].rstrip(" |")
        if not meaning or meaning in seen:
            out.append(f"{key}: {'no meaning' if not meaning else 'the meaning of ' + seen[meaning]}")
        seen.setdefault(meaning, key)
    return out


def shown(value: Any) -> str:
    if isinstance(value, enum.Enum):
        value = value.name
    if value is None:
        return "null"
    if value == "???":
        return "required"
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return f"`{text}`" if text else '`""`'


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def schema_table(cls: type, prefix: str, values: dict[str, Any] | None = None) -> list[str]:
    """key | default | meaning, for every field of ``cls`` (``values``: an option's composed defaults
    instead)."""
    return ["| key | default | meaning |", "| --- | --- | --- |"] + _rows(cls, prefix, values)


def _rows(cls: type, prefix: str, values: dict[str, Any] | None) -> list[str]:
    notes, rows, hints = field_comments(cls), [], typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name.startswith("_") or (not prefix and f.name in NESTED + GROUPS):
            continue
        if values is not None:
            default = values.get(f.name, "???")
        elif f.default is not dataclasses.MISSING:
            default = f.default
        else:
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else "???"
        kind = hints.get(f.name)
        # a nested schema (dataset.augment): its keys
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            rows += _rows(kind, f"{prefix}{f.name}.", default if isinstance(default, dict) else None)
            continue
        rows.append(f"| `{prefix}{f.name}` | {cell(shown(default))} | {cell(notes.get(f.name, ''))} |")
    return rows


def first_comment(path: Path) -> str:
    """The yaml's opening comment (its description), without Hydra's ``@package`` line."""
    out = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if "@package" not in line:
            out.append(line.lstrip("# ").rstrip())
    return " ".join(out)


def compose(overrides: list[str]) -> Any:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return OmegaConf.to_container(hydra_compose(config_name="train", overrides=overrides), resolve=False)


def group_section(group: str) -> list[str]:
    from ddplab.config.groups import GROUPS as SCHEMAS

    lines = [f"## `{group}=`", ""]
    for path in sorted((CONF / group).glob("*.yaml")):
        name = path.stem
        composed = compose([f"+{group}=[{name}]" if group == "callbacks" else f"{group}={name}"])
        values = composed["callbacks"][name] if group == "callbacks" else composed[group]
        schema = next(
            (cls for key, cls in SCHEMAS[group].items() if f"/schema/{group}/{key}@" in path.read_text()),
            None,
        )
        lines += [f"### `{group}={name}`" if group != "callbacks" else f"### `callbacks=[{name}]`", ""]
        lines += [first_comment(path) or f"(conf/{group}/{name}.yaml)", ""]
        if schema is not None:
            key = f"callbacks.{name}." if group == "callbacks" else f"{group}."
            lines += [f"Schema: `{schema.__module__}.{schema.__name__}`.", ""]
            lines += schema_table(schema, key, values) + [""]
    return lines


def flat(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict) and node:
        return {k: v for key, sub in node.items() for k, v in flat(sub, f"{prefix}{key}.").items()}
    return {prefix[:-1]: node}


def preset_section(group: str) -> list[str]:
    """What each preset option sets: the keys whose composed value differs from the plain job's."""
    base = flat(compose([]))
    lines = [f"## `{group}=`", "", "| option | what it is | what it sets |", "| --- | --- | --- |"]
    for path in sorted((CONF / group).glob("*.yaml")):
        changed = flat(compose([f"{group}={path.stem}"]))
        sets = [
            f"`{k}={shown(v).strip('`')}`"
            for k, v in sorted(changed.items())
            if base.get(k, "<absent>") != v and not k.startswith(("hydra.", group))
        ]
        lines.append(
            f"| `{path.stem}` | {cell(first_comment(path))} | {cell(', '.join(sets) or '(the defaults)')} |"
        )
    return lines + [""]


def render() -> str:
    from ddplab.config import register_configs
    from ddplab.config.schema import (
        CheckpointConfig,
        DistributedConfig,
        PerfConfig,
        StudyConfig,
        TrainConfig,
        VerifyConfig,
    )

    register_configs()
    lines = [
        "# Configuration reference",
        "",
        "<!-- Written by scripts/config_reference.py from src/ddplab/config/ and conf/; do not edit by hand "
        "(tests/integration/test_config_reference.py checks it is current). -->",
        "",
        "Every key, group option and default, as the schema and `conf/` define them today. How the groups "
        "compose and how a job runs: [Configuration](configuration.md).",
        "",
        "## Top-level keys",
        "",
    ]
    lines += schema_table(TrainConfig, "") + [""]
    for name, cls in zip(
        NESTED, (DistributedConfig, CheckpointConfig, PerfConfig, VerifyConfig, StudyConfig)
    ):
        # not dataclass's
        doc = inspect.getdoc(cls) if not (cls.__doc__ or "").startswith(f"{cls.__name__}(") else ""
        lines += [f"## `{name}.*`", ""] + ([doc.replace("\n", " "), ""] if doc else [])
        lines += schema_table(cls, f"{name}.") + [""]
    lines += [
        "## `distributed=` options",
        "",
        "| option | what it is | what it sets |",
        "| --- | --- | --- |",
    ]
    for path in sorted((CONF / "distributed").glob("*.yaml")):
        sets = flat(compose([f"distributed={path.stem}"])["distributed"])
        lines.append(
            f"| `{path.stem}` | {cell(first_comment(path))} | "
            f"`strategy={shown(sets['strategy']).strip('`')}` |"
        )
    lines.append("")
    for group in GROUPS:
        lines += group_section(group)
    for group in PRESETS:
        lines += preset_section(group)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--check", action="store_true", help="exit 1 if docs/reference.md is not what this writes"
    )
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            print(
                f"{OUT.relative_to(REPO)} is out of date. Fix: python scripts/config_reference.py",
                file=sys.stderr,
            )
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(REPO)} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
