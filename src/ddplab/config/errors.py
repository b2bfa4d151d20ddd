"""The error every config check raises: it names the key, the value, why, and the fix. Defined in
:mod:`ddplab.errors` (imported by the Hydra-free data layer too) and re-exported here."""

from ddplab.errors import ConfigError, InputError, require

__all__ = ["ConfigError", "InputError", "require"]
