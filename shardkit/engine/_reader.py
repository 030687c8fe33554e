"""Reading a DeepSpeed-style JSON tree: values as DeepSpeed accepts them, "auto", key accounting.

A :class:`Reader` wraps one section of the config. Every key it is asked for is marked as read;
:meth:`Reader.ignore` marks keys accepted but without effect (reported by name);
:meth:`Reader.unsupported` accepts a DeepSpeed key only at its DeepSpeed default. Whatever is
left unread at the end is unknown (:meth:`Reader.unread`), so no key is ever silently dropped.

Values are coerced the way DeepSpeed's pydantic models coerce them: ``"true"``/``"false"``
strings are booleans, ``1e9`` (a float with no fraction) is an integer size, numeric strings are
numbers. ``"auto"`` is looked up in the ``auto_values`` keywords of ``load_config``; one that
nothing fills is recorded (:attr:`Reader.report`) and reading goes on with the key's default, so
that :class:`UnfilledAutoError` names every such key at once.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["AUTO", "MISSING", "Reader", "UnfilledAutoError", "to_bool", "to_float", "to_int"]

AUTO = "auto"
MISSING = object()
_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def to_bool(key: str, value: Any) -> bool:
    """``value`` as a bool: True/False, 0/1, or a "true"/"false"/"yes"/"no"/"on"/"off" string."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"{key}: expected true/false, got {value!r}")


def to_float(key: str, value: Any) -> float:
    """``value`` as a float: an int, a float or a numeric string (never a bool)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    raise ValueError(f"{key}: expected a number, got {value!r}")


def to_int(key: str, value: Any) -> int:
    """``value`` as an int: an int, an integral float (``2e8``) or an integral numeric string."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    number = to_float(key, value) if isinstance(value, (float, str)) else None
    if number is not None and number.is_integer():
        return int(number)
    raise ValueError(f"{key}: expected an integer, got {value!r}")


class UnfilledAutoError(ValueError):
    """Every ``"auto"`` of a config that nothing fills, in one error.

    Attributes:
        missing: ``(dotted key, keywords)`` per unfilled key, in reading order; any one of the
            keywords fills it.
        after: the message of another error met after them, or None (it may follow from the
            defaults the unfilled keys were read as).

    Example:
        >>> try:
        ...     load_config({"train_batch_size": 8, "gradient_clipping": "auto",
        ...                  "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, world_size=1)
        ... except UnfilledAutoError as e:
        ...     e.missing
        [('gradient_clipping', ['gradient_clipping']), ('optimizer.params.lr', ['lr'])]
    """

    def __init__(self, missing: Sequence[tuple[str, Sequence[str]]], after: str | None = None) -> None:
        self.missing = [(key, list(names)) for key, names in missing]
        self.after = after
        super().__init__(self._message())

    def _message(self) -> str:
        phrases = [_unfilled(key, names) for key, names in self.missing]
        if len(phrases) == 1:
            text = f"{phrases[0]} {TO_CALLER} (or write a value in the config)"
        else:
            head = f'{len(phrases)} "auto" values nothing fills; pass them {TO_CALLER} (or write values in the config):'
            text = "\n".join([head, *(f"  {phrase}" for phrase in phrases)])
        if self.after is not None:
            text += f"\n(reading stopped after them at another error, which may follow from them: {self.after})"
        return text


#: where the keywords that fill an "auto" go (``shardkit config check`` says ``--auto`` instead)
TO_CALLER = "to load_config / initialize"

#: the dotted "key" of the batch-size pair, when neither is given and an "auto" is left unfilled
BATCH_PAIR = "train_batch_size / train_micro_batch_size_per_gpu"


def _unfilled(key: str, names: Sequence[str]) -> str:
    how = " or ".join(f"{n}=..." for n in names)
    if key == BATCH_PAIR:
        return (
            f'train_batch_size or train_micro_batch_size_per_gpu must be given ("auto" or absent, nothing fills them): pass {how}'
        )
    return f'{key} is "auto" but nothing fills it: pass {how}'


class _Report:
    """What a whole config's readers saw: keys ignored (in order, once each) and the "auto"
    values nothing filled."""

    def __init__(self) -> None:
        self.ignored: list[str] = []
        self.missing: list[tuple[str, list[str]]] = []

    def add_ignored(self, key: str) -> None:
        if key not in self.ignored:
            self.ignored.append(key)

    def add_missing(self, key: str, names: Sequence[str]) -> None:
        # a key that the keyword asked for by an earlier one fills too is not listed again (lr
        # fills optimizer.params.lr and scheduler.params.warmup_max_lr)
        if not any(k == key or first[0] in names for k, first in self.missing):
            self.missing.append((key, list(names)))


class Reader:
    """One section of a config (``prefix`` is its dotted path, "" for the root).

    Args:
        data: the section's dict.
        auto_values: the ``**auto_values`` of ``load_config`` ("auto" replacements).
        prefix: dotted path of this section.
    """

    def __init__(self, data: Mapping[str, Any], auto_values: Mapping[str, Any], prefix: str = "", _report: _Report | None = None):
        if not isinstance(data, Mapping):
            raise ValueError(f"{prefix or 'config'}: expected an object, got {type(data).__name__}")
        self.data = data
        self.auto_values = auto_values
        self.prefix = prefix
        self.report = _report if _report is not None else _Report()
        self._read: set[str] = set()  # keys asked for (present or not): the section's known names
        self._children: list[Reader] = []

    def dotted(self, key: str) -> str:
        """The dotted path of ``key`` in this section."""
        return f"{self.prefix}.{key}" if self.prefix else key

    def has(self, key: str) -> bool:
        return key in self.data

    def is_auto(self, key: str) -> bool:
        return self.data.get(key) == AUTO

    def raw(self, key: str, default: Any = None) -> Any:
        """The value as written (marked read), or ``default``."""
        self._read.add(key)
        return self.data.get(key, default)

    def resolve_auto(self, key: str, keywords: Sequence[str], fallback: Any = MISSING, hint: str = "") -> Any:
        """The replacement for an ``"auto"`` at ``key``: the first of ``keywords`` given, else
        ``fallback``, else MISSING, the key recorded in :attr:`report` with the keywords that
        would fill it (``load_config`` raises :class:`UnfilledAutoError` listing them all)."""
        for kw in keywords:
            if self.auto_values.get(kw) is not None:
                return self.auto_values[kw]
        if fallback is not MISSING:
            return fallback
        self.report.add_missing(self.dotted(key), [*keywords, *([hint] if hint else [])])
        return MISSING

    def get(
        self,
        key: str,
        convert: Callable[[str, Any], Any],
        default: Any = None,
        *,
        auto: Sequence[str] | None = None,
        auto_fallback: Any = MISSING,
        auto_hint: str = "",
        check: Callable[[Any], bool] | None = None,
        must: str = "",
    ) -> Any:
        """Read ``key``, resolve "auto", coerce with ``convert`` and validate.

        Args:
            key: the key in this section.
            convert: ``to_int``/``to_float``/``to_bool``/... taking ``(dotted_key, value)``.
            default: returned (unconverted) when the key is absent or null, or is an "auto"
                nothing fills (recorded: ``load_config`` raises once reading is done).
            auto: keywords that may fill an "auto" (default: ``[key]``).
            auto_fallback: value for an "auto" no keyword fills (default: recorded as unfilled).
            auto_hint: another keyword the error should suggest (one ``auto_fallback`` came from).
            check: predicate the converted value must satisfy ...
            must: ... described in the error (e.g. "be > 0").
        """
        value = self.raw(key, MISSING)
        if value is MISSING or value is None:
            return default
        if value == AUTO:
            value = self.resolve_auto(key, list(auto) if auto else [key], auto_fallback, auto_hint)
            if value is MISSING:  # unfilled: recorded; reading goes on as if the key were absent
                return default if default is not MISSING else self._stand_in(key, convert, check)
            if value is None:
                return default
        value = convert(self.dotted(key), value)
        if check is not None and not check(value):
            raise ValueError(f"{self.dotted(key)} must {must}, got {value!r}")
        return value

    def _stand_in(self, key: str, convert: Callable[[str, Any], Any], check: Callable[[Any], bool] | None) -> Any:
        """A valid value for an unfilled "auto" that has no default (a scheduler's required
        argument), so that reading goes on to find the other unfilled keys; MISSING if none fits."""
        for candidate in (1, 1e-3, False):
            try:
                value = convert(self.dotted(key), candidate)
            except ValueError:
                continue
            if check is None or check(value):
                return value
        return MISSING

    def choice(self, key: str, choices: Sequence[str], default: str, *, lower: bool = True) -> str:
        """A string from ``choices`` (compared lower-case unless ``lower=False``)."""
        value = self.get(key, lambda k, v: v if isinstance(v, str) else str(v), default)
        norm = value.lower() if lower else value
        if norm not in choices:
            raise ValueError(f"{self.dotted(key)} must be one of {list(choices)}, got {value!r}")
        return norm

    def section(self, key: str) -> Reader:
        """The child section ``key`` (an empty one when absent)."""
        value = self.raw(key, None)
        child = Reader({} if value is None else value, self.auto_values, self.dotted(key), self.report)
        self._children.append(child)
        return child

    def ignore(self, *keys: str, report: bool = True) -> None:
        """Accept ``keys`` without effect: each present one is reported as ignored (unless
        ``report`` is False: the caller reports the whole section instead)."""
        for key in keys:
            self._read.add(key)  # asked-for keys, present or not, are the known names (typo hints)
            if key in self.data and report:
                self.report.add_ignored(self.dotted(key))

    def unsupported(self, key: str, default: Any, convert: Callable[[str, Any], Any] = lambda k, v: v) -> None:
        """A DeepSpeed key shardkit does not implement: fine (and reported as ignored) at its
        DeepSpeed default ``default``, a ValueError naming the key otherwise."""
        value = self.raw(key, MISSING)
        if value is MISSING:
            return
        if value is not None and convert(self.dotted(key), value) != default:
            raise ValueError(
                f"{self.dotted(key)}={value!r} is a DeepSpeed feature shardkit does not implement "
                f"(only its default {default!r} is accepted)"
            )
        self.report.add_ignored(self.dotted(key))

    def unread(self) -> list[tuple[str, list[str]]]:
        """Every key of this section and its children never read: ``(dotted key, close matches)``."""
        out = []
        for key in self.data:
            if key not in self._read:
                out.append((self.dotted(key), difflib.get_close_matches(key, sorted(self._read), n=1)))
        for child in self._children:
            out.extend(child.unread())
        return out
