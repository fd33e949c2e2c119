"""Settings groups: dataclasses that validate themselves and accept plain dicts (litgpt's ``TrainArgs`` style).

A group is one constructor argument of a module (``generation``, ``update``, ``kl``, ...). Users pass an
instance, a dict of its fields (YAML, or Python), or None (the defaults). Each group checks its fields in
``__post_init__`` with messages that name the key as a user writes it (``update.clip_coef``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, TypeVar

S = TypeVar("S", bound="Settings")

__all__ = ["Settings"]


@dataclasses.dataclass
class Settings:
    """Base of the settings dataclasses: ``coerce`` from plain values, plain ``as_dict``, range checks.

    A subclass is a ``@dataclass`` (a dataclass all the way down, so jsonargparse shows its fields as
    nested options rather than a ``class_path``) that sets ``group`` (the key users write, used in messages) and checks
    its fields in ``__post_init__`` with :meth:`require`.
    """

    group: ClassVar[str] = "settings"
    # old field names of this group -> their new name (an unknown field that is one gets that hint)
    renamed: ClassVar[dict[str, str]] = {}

    @classmethod
    def coerce(cls: type[S], value: Any, argument: str | None = None) -> S:
        """The group from what a user passes: an instance, a dict of its fields, or None (the defaults).

        Args:
            value: the instance, a dict, or None.
            argument: how the argument is named in messages (default: ``group``).

        Raises:
            TypeError: another type, or a dict with unknown fields (named with ``argument``).
            ValueError: a field out of range (from the group's own checks).
        """
        argument = argument or cls.group
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            value = cls.migrate(dict(value))
            names = [f.name for f in dataclasses.fields(cls)]
            unknown = sorted(set(value) - set(names))
            if unknown:
                hints = [f"{k!r} is now {cls.renamed[k]!r}" for k in unknown if k in cls.renamed]
                hint = f" ({'; '.join(hints)})" if hints else ""
                raise TypeError(
                    f"{argument}: unknown {cls.__name__} field(s) {unknown}{hint}; valid ones are {names}"
                )
            return cls(**value)
        raise TypeError(f"{argument}: expected {cls.__name__}, a dict of its fields or None, got {type(value).__name__}")

    @classmethod
    def migrate(cls, values: dict[str, Any]) -> dict[str, Any]:
        """``values`` (fields by name) of an earlier version of the group rewritten into the current fields,
        where a field's meaning moved to another (a YAML config, a checkpoint's hyper-parameters); here
        unchanged. A subclass that replaces a field overrides it."""
        return values

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickling (a checkpoint that stored the group itself): fields of an earlier version migrated
        (:meth:`migrate`), fields added since at their defaults."""
        state = type(self).migrate(dict(state))
        for f in dataclasses.fields(self):
            if f.name not in state and f.default is not dataclasses.MISSING:
                state[f.name] = f.default
            elif f.name not in state and f.default_factory is not dataclasses.MISSING:
                state[f.name] = f.default_factory()
        self.__dict__.update(state)

    def as_dict(self) -> dict[str, Any]:
        """Plain fields, nested groups as dicts (what ``hparams.yaml`` stores)."""
        return dataclasses.asdict(self)

    def require(self, name: str, ok: bool, requirement: str) -> None:
        """Raise ``ValueError("<group>.<name> must be <requirement>, got <value>")`` unless ``ok``."""
        if not ok:
            raise ValueError(f"{self.group}.{name} must be {requirement}, got {getattr(self, name)!r}")

    def require_choice(self, name: str, choices: tuple[str, ...]) -> None:
        self.require(name, getattr(self, name) in choices, f"one of {list(choices)}")

    def require_finite(self, *names: str) -> None:
        """Every float field among ``names`` is finite (NaN would pass every ``<= 0`` check)."""
        for name in names:
            value = getattr(self, name)
            if isinstance(value, float):
                self.require(name, math.isfinite(value), "a finite number")
