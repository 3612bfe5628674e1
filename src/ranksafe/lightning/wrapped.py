"""Methods that RankSafe wraps on Lightning's objects for one run: picklable meanwhile, removed at its end.

A Trainer is pickled (``ddp_spawn``, ``torch.save``) and kept after ``fit``, so what ranksafe puts on its strategy
and callbacks must pickle with them and leave nothing behind. A :class:`Wrapped` is a module-level object, not a
closure, holding the object, the method's name and ``around``: a bound method (or a ``functools.partial`` of
one) of a picklable ranksafe object.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any


class Wrapped:
    """``obj.name(*args, **kwargs)`` becomes ``around(original, *args, **kwargs)`` until :meth:`remove`."""

    def __init__(self, obj: Any, name: str, around: Callable[..., Any]) -> None:
        self.obj, self.name, self.around = obj, name, around
        # what it replaces: the instance's own attribute, or None for the class's method, looked up at each call
        # (a bound method pickles as getattr(obj, name), which after unpickling may find this wrapper itself)
        self.replaced = vars(obj).get(name)

    def original(self) -> Callable[..., Any]:
        """The method this wrapper replaces, bound to its object."""
        if self.replaced is not None:
            return self.replaced
        cls = type(self.obj)
        return inspect.getattr_static(cls, self.name).__get__(self.obj, cls)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.around(self.original(), *args, **kwargs)

    def remove(self) -> None:
        """Put back what this wrapper replaced (unless something else replaced it since)."""
        attributes = vars(self.obj)
        if attributes.get(self.name) is self:
            if self.replaced is None:
                del attributes[self.name]
            else:
                attributes[self.name] = self.replaced


def wrap(obj: Any, name: str, around: Callable[..., Any]) -> None:
    """Make ``obj.name(...)`` call ``around(original, ...)``; a wrapper already there (from a copy of a Trainer
    pickled mid-run) goes first. Raises AttributeError naming the method when ``obj`` has none."""
    getattr(obj, name)
    unwrap(obj, name)
    vars(obj)[name] = Wrapped(obj, name, around)


def unwrap(obj: Any, *names: str) -> None:
    """Remove the wrappers of ``names`` (of every method when none is given) from ``obj``."""
    for name, value in list(vars(obj).items()):
        if isinstance(value, Wrapped) and (not names or name in names):
            value.remove()
