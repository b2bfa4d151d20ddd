"""Secrets stay out of what ddplab writes and prints.

A config carries credentials in two ways: the user info of a URI (``mlflow.tracking_uri=http://user:pw@host``,
``study.storage=postgresql://user:pw@host/db``, ``distributed.init_method``) and keys that hold one (an API
key, a token a callback uploads with). The job itself uses the real values; every copy ddplab writes or
prints — the config in TensorBoard and MLflow (params, tags, artifacts), checkpoints' stored config (and so
exports and model cards), ``provenance.json``'s command line, Hydra's ``.hydra/*.yaml`` and ``multirun.yaml``,
``mlflow.json``, the console and ``train.log`` — goes through here first:

* a URI's user info becomes ``***`` (``http://***@host``), wherever it appears in a text;
* the value of a key named in ``redact_keys`` (dotted, e.g. ``redact_keys=[callbacks.upload.token]``) or whose
  last part names a secret (``password``, ``secret``, ``api_key``, ...) becomes ``***``, in a config and in
  ``key=value`` overrides.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

MASK = "***"
# scheme://user[:password]@ — the user info alone is replaced (a token is often the user part). Also as a
# sweep's job gets it: Hydra escapes an override's special characters (``http\://user\:pw@host``). Escaped
# once (a sweep job's overrides: ``http\://u\:p@h``, Hydra escaping ``\()[]{}:=,``) or more (the repr of such
# a string).
_USERINFO = re.compile(
    r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*\\*://)"
    r"(?P<info>(?:\\+[:=,()\[\]{}]|[^\s/@'\"\\])+)@"
)
_SECRET_NAMES = frozenset(
    {
        "password",
        "passwd",
        "secret",
        "secret_key",
        "api_key",
        "apikey",
        "access_token",
        "auth_token",
        "hf_token",
        "private_key",
        "client_secret",
    }
)


def is_secret_key(dotted: str, keys: Iterable[str] = ()) -> bool:
    """``dotted`` is named in ``keys`` or its last part names a secret."""
    return dotted in set(keys) or dotted.rsplit(".", 1)[-1].lower() in _SECRET_NAMES


def text(s: str, keys: Iterable[str] = ()) -> str:
    """``s`` with URIs' user info and the values of ``key=value`` overrides of secret keys masked."""
    out = _USERINFO.sub(lambda m: f"{m['scheme']}{MASK}@", s)
    for key in {*keys, *_SECRET_NAMES}:
        # key=value as an override spells it: after a start, a space, a comma, a quote or a bracket; + or ~
        # first. A value's escaped characters (``\,``: Hydra's, in a sweep's job) are part of it; so is a
        # quoted one.
        pattern = (
            rf"((?:^|(?<=[\s,'\"\[/]))[+~]{{0,2}}(?:[\w.]*\.)?{re.escape(key)}=)"
            r"(?:'[^']*'|\"[^\"]*\"|(?:\\.|[^,\s'\"\]\\])*)"
        )
        out = re.sub(pattern, rf"\g<1>{MASK}", out)
    return out


def node(value: Any, keys: Iterable[str] = (), path: str = "") -> Any:
    """A plain config (dicts, lists, scalars) with secret keys' values and URIs' user info masked."""
    keys = tuple(keys)
    if isinstance(value, dict):
        return {
            k: (
                MASK
                if is_secret_key(f"{path}.{k}" if path else str(k), keys) and v is not None
                else node(v, keys, f"{path}.{k}" if path else str(k))
            )
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [node(v, keys, f"{path}[{i}]") for i, v in enumerate(value)]
    return text(value, keys) if isinstance(value, str) else value


def written_out(value: Any, keys: Iterable[str] = (), path: str = "") -> list[str]:
    """The dotted keys of an unresolved config (dicts, lists, scalars) that hold a secret as such: what
    :func:`node` masks, less what interpolations (``${oc.env:VAR}``) fetch where the job runs."""
    keys = tuple(keys)
    if (
        is_secret_key(path, keys)
        and value not in (None, "")
        and (not isinstance(value, str) or _literal(value))
    ):
        return [path]  # masked whole by node(), whatever it holds
    if isinstance(value, dict):
        return [
            hit for k, v in value.items() for hit in written_out(v, keys, f"{path}.{k}" if path else str(k))
        ]
    if isinstance(value, list):
        return [hit for i, v in enumerate(value) for hit in written_out(v, keys, f"{path}[{i}]")]
    return [path] if isinstance(value, str) and text(_literal(value), keys) != _literal(value) else []


def _literal(s: str) -> str:
    """``s`` without its interpolations, and without the user info they alone fill
    (``http://${oc.env:U}:${...}@h`` holds no secret)."""
    bare = re.sub(r"\$\{[^}]*\}", "", s)
    return _USERINFO.sub(lambda m: m[0] if m["info"].strip(":\\") else m["scheme"] + "@", bare)


_ACTIVE: tuple[str, ...] = ()


def use(keys: Iterable[str]) -> None:
    """The job's ``redact_keys``, for what is masked without its config at hand (the console's lines)."""
    global _ACTIVE
    _ACTIVE = tuple(keys)


def active() -> tuple[str, ...]:
    return _ACTIVE


def keys_of(cfg: Any) -> tuple[str, ...]:
    """The config's ``redact_keys`` (empty where it has none)."""
    try:
        return tuple(str(k) for k in (cfg.get("redact_keys") or ()))
    except AttributeError:
        return ()


def config_yaml(cfg: Any) -> str:
    """The resolved config as YAML, secrets masked: what is written or logged of it."""
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True) if not isinstance(cfg, dict) else cfg
    return OmegaConf.to_yaml(OmegaConf.create(node(plain, keys_of(cfg))))
