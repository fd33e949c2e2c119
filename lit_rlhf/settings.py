"""Settings groups: dataclasses that validate themselves and accept plain dicts (litgpt's ``TrainArgs`` style).

A group is one constructor argument of a module (``generation``, ``update``, ``kl``, ...). Users pass an
instance, a dict of its fields (YAML, or Python), or None (the defaults). Each group checks its fields in
``__post_init__`` with messages that name the key as a user writes it (``update.clip_coef``), starting with
:meth:`Settings.check_types`: the field types, read from the annotations, so a value of the wrong type (the
string ``'5e-2'`` PyYAML's ``safe_load`` reads, a float ``epochs``) is refused naming its key instead of
failing later in an operator.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, Literal, TypeVar, Union

S = TypeVar("S", bound="Settings")

__all__ = ["Settings", "SettingsTypeError"]


class SettingsTypeError(TypeError, ValueError):
    """A settings field of the wrong type (:meth:`Settings.check_types`). A ``TypeError``, and a ``ValueError``
    as well: the checks it replaced (``generation.max_new_tokens must be an integer``, ``bucketing.split_cost``)
    raised that, and code catching it keeps working."""


@dataclasses.dataclass
class Settings:
    """Base of the settings dataclasses: ``coerce`` from plain values, plain ``as_dict``, range checks.

    A subclass is a ``@dataclass`` (a dataclass all the way down, so jsonargparse shows its fields as
    nested options rather than a ``class_path``) that sets ``group`` (the key users write, used in messages) and checks
    its fields in ``__post_init__``: first their types with :meth:`check_types`, then their ranges with
    :meth:`require`.
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

    def check_types(self) -> None:
        """Refuse a field whose value is not of its annotated type (the first check of a group's
        ``__post_init__``), with :class:`SettingsTypeError` ``"<group>.<field> must be <kind>, got <value>"``.

        Checked annotations: ``int`` (not a bool), ``float`` (an int is accepted, a bool not), ``bool``,
        ``str``, ``Literal[...]`` (the type of its values only: which values a group accepts is its own
        check, the registries may hold more than the annotation), unions of these (``X | None``) and nested
        groups (a dict of the nested group's fields is checked here, named ``<group>.<field>.<nested
        field>``; an instance checked itself). Other annotations (lists, dicts, ``Any``) are left to the
        group's own checks.
        """
        self.check_values(type(self), {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, self.group)

    @staticmethod
    def check_values(group_cls: type[Settings], values: Mapping[str, Any], prefix: str) -> None:
        """:meth:`check_types` of the fields ``values`` of the group ``group_cls``, named ``<prefix>.<field>``;
        unknown names are skipped (``coerce`` names them)."""
        hints = _type_hints(group_cls)
        for name, value in values.items():
            if name not in hints:
                continue
            annotation, where = hints[name], f"{prefix}.{name}"
            nested = _nested_group(annotation)
            if nested is not None and isinstance(value, Mapping):  # checked before the group coerces it
                Settings.check_values(nested, nested.migrate(dict(value)), where)
                continue
            kinds = _kinds(annotation)
            if kinds is not None and not any(_matches(kind, value) for kind in kinds):
                raise SettingsTypeError(f"{where} must be {_describe(kinds)}, got {value!r}")


@functools.cache
def _type_hints(cls: type[Settings]) -> dict[str, Any]:
    """The resolved annotations of ``cls``'s dataclass fields (``from __future__ import annotations``
    leaves them as strings)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _union_args(annotation: Any) -> tuple[Any, ...]:
    """The members of a union annotation (``X | None``, ``Optional[X]``), else ``(annotation,)``."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _nested_group(annotation: Any) -> type[Settings] | None:
    """The settings group among the members of ``annotation`` (``Bucketing | None``), if any."""
    for member in _union_args(annotation):
        if isinstance(member, type) and issubclass(member, Settings):
            return member
    return None


def _kinds(annotation: Any) -> tuple[Any, ...] | None:
    """The members of ``annotation`` this check knows, or None where one is not (the field is not checked)."""
    members = _union_args(annotation)
    known = all(
        member in (int, float, bool, str, type(None))
        or typing.get_origin(member) is Literal
        or (isinstance(member, type) and issubclass(member, Settings))
        for member in members
    )
    return members if known else None


def _matches(kind: Any, value: Any) -> bool:
    """Whether ``value`` is of ``kind`` (one member of an annotation, see :meth:`Settings.check_types`)."""
    if kind is type(None):
        return value is None
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if kind is str:
        return isinstance(value, str)
    if typing.get_origin(kind) is Literal:
        return any(isinstance(value, type(choice)) and not isinstance(value, bool) for choice in typing.get_args(kind))
    return True  # a nested group: its own coerce accepts (or names) what it is given


def _describe(kinds: tuple[Any, ...]) -> str:
    """``kinds`` in words: ``an integer or None``."""
    words = []
    for kind in kinds:
        if typing.get_origin(kind) is Literal:
            words.append(f"one of {list(typing.get_args(kind))}")
        elif isinstance(kind, type) and issubclass(kind, Settings):
            words.append(f"a dict of {kind.__name__} fields")
        else:
            names = {int: "an integer", float: "a number", bool: "a bool (true or false)", str: "a string"}
            words.append(names.get(kind, "None"))
    return ", ".join(words[:-1]) + f" or {words[-1]}" if len(words) > 1 else words[0]
