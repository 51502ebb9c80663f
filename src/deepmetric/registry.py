"""One registry class for every kind of named part: losses, models, backbones, datasets,
transforms and metrics (the bottom layer: every package may import it).

>>> LOSSES = Registry("loss")
>>> @LOSSES.register("my_loss")
... class MyLoss(nn.Module): ...

registers ``MyLoss`` under ``"my_loss"`` (as timm's ``register_model``); ``LOSSES.build("my_loss",
margin=0.2)`` builds it, ``LOSSES.options("my_loss")`` lists its keyword parameters (read from the
signature), and an unknown name or option is a ValueError / TypeError with the closest valid one
(:func:`did_you_mean`, the one place that suggestion is written).
"""
from __future__ import annotations

import contextlib
import difflib
import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

__all__ = ["Registry", "did_you_mean", "suggest", "signature_options", "SUGGESTION_OPENING"]


def did_you_mean(word: object, choices: Iterable[str] | Mapping[str, str], *, prefix: str = "",
                 cutoff: float = 0.6, sentence: bool = False) -> str:
    """``" (did you mean 'x'?)"`` for the choice closest to ``word`` (``difflib``), or ``""`` when
    none is close. ``prefix`` is put before the suggestion (``'optim.'`` for a nested key).

    ``choices`` may map spellings to what they stand for (an alias to its name): the closest
    spelling is searched, the name it stands for suggested.  ``sentence``: the form that ends
    a sentence of its own, ``" Did you mean 'x'?"``."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=cutoff)
    if not close:
        return ""
    return suggest(f"'{prefix}{choices[close[0]] if isinstance(choices, Mapping) else close[0]}'", sentence=sentence)


#: the words that open every suggestion, so that a reader of a message can tell it apart
SUGGESTION_OPENING = "did you mean"


def suggest(suggestion: str, *, sentence: bool = False) -> str:
    """The one wording of a suggestion: ``" (did you mean X?)"`` (``sentence``: ``" Did you mean X?"``)."""
    opening = SUGGESTION_OPENING
    return f" {opening.capitalize()} {suggestion}?" if sentence else f" ({opening} {suggestion}?)"


def signature_options(fn: Callable, *, skip: Iterable[str] = ()) -> set[str] | None:
    """The keyword parameters of ``fn`` (a function or a class: its constructor), less ``skip``;
    None when it takes ``**kwargs`` (it checks its options itself)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    skip = set(skip)
    return {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in skip}


class Registry:
    """Named objects of one ``kind`` (a class or a factory each), with aliases and free-form
    ``info`` per entry (a dataset's ``event`` flag, a metric's ``needs`` and ``keys``).

    ``normalize`` maps a user's spelling to the stored key (datasets ignore case and read ``_``
    as ``-``); names are stored and listed as registered.  ``unknown`` is the message of an
    unknown name, a ``str.format`` template of ``kind``, ``name``, ``names`` (the sorted list),
    ``available`` (the same, comma-separated), ``hint`` (:func:`did_you_mean`) and ``Hint``
    (its sentence form)."""

    def __init__(self, kind: str, *, normalize: Callable[[str], str] | None = None,
                 unknown: str = "unknown {kind} {name!r}{hint}; available: {available}"):
        self.kind = kind
        self._normalize = normalize or (lambda s: s)
        self._unknown = unknown
        self._entries: dict[str, Any] = {}
        self._info: dict[str, dict] = {}
        self._aliases: dict[str, str] = {}  # normalised alias or name -> registered name

    def register(self, name: str, *, aliases: Iterable[str] = (), **info) -> Callable[[Any], Any]:
        """Decorator: ``@REGISTRY.register("name")`` above a class or a function."""

        def deco(obj):
            self.add(name, obj, aliases=aliases, **info)
            return obj

        return deco

    def add(self, name: str, obj: Any, *, aliases: Iterable[str] = (), **info) -> None:
        """Register ``obj`` under ``name``; a second entry of the same name (or alias) is an error."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} name must be a non-empty string, got {name!r}")
        for key in (name, *aliases):
            k = self._normalize(key)
            if k in self._aliases:
                owner = self._aliases[k]
                raise ValueError(f"{self.kind} {key!r} is already registered (by "
                                 f"{getattr(self._entries[owner], '__qualname__', owner)})")
        self._entries[name] = obj
        self._info[name] = dict(info)
        for key in (name, *aliases):
            self._aliases[self._normalize(key)] = name

    def names(self) -> list[str]:
        """The registered names (not the aliases), sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._normalize(name) in self._aliases

    def __iter__(self) -> Iterator[str]:
        """The registered names in the order they were registered (metrics keep that order)."""
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def canonical(self, name: object) -> str:
        """The registered name that ``name`` (or an alias, in any accepted spelling) stands for;
        ValueError naming the closest one and the list otherwise."""
        if name not in self:
            spelling = self._normalize(name) if isinstance(name, str) else name
            raise ValueError(self._unknown.format(
                kind=self.kind, name=name, names=self.names(), available=", ".join(self.names()),
                hint=did_you_mean(spelling, self._aliases), Hint=did_you_mean(spelling, self._aliases, sentence=True)))
        return self._aliases[self._normalize(name)]

    def get(self, name: object) -> Any:
        """The class or factory registered under ``name``."""
        return self._entries[self.canonical(name)]

    def info(self, name: object) -> dict:
        """The keyword ``info`` given at registration (a copy)."""
        return dict(self._info[self.canonical(name)])

    def options(self, name: object, *, skip: Iterable[str] = ()) -> set[str] | None:
        """Keyword parameters of the registered class / factory (:func:`signature_options`)."""
        return signature_options(self.get(name), skip=skip)

    def check_options(self, name: object, options: Iterable[str], *, skip: Iterable[str] = (),
                      where: str | None = None) -> None:
        """TypeError naming the first option ``name`` does not accept, with the closest one (or the
        accepted list); nothing when the entry takes ``**kwargs``."""
        accepted = self.options(name, skip=skip)
        if accepted is None:
            return
        for key in options:
            if key not in accepted:
                hint = did_you_mean(key, accepted) or f"; accepted: {', '.join(sorted(accepted)) or 'none'}"
                raise TypeError(f"{where or f'{self.kind} {name!r}'}: unknown option {key!r}{hint}")

    @contextlib.contextmanager
    def scratch(self) -> Iterator[Registry]:
        """Registrations made inside the ``with`` block are undone at its end (tests)."""
        saved = dict(self._entries), dict(self._info), dict(self._aliases)
        try:
            yield self
        finally:
            for table, copy in zip((self._entries, self._info, self._aliases), saved, strict=True):
                table.clear()
                table.update(copy)

    def build(self, name: object, /, *args, **options) -> Any:
        """``registered(*args, **options)`` after checking the option names."""
        self.check_options(name, options)
        return self.get(name)(*args, **options)
