"""The one removable handle: what every ``register_*`` / ``on_*`` call of graphsafe returns.

``handle.remove()`` undoes the registration (idempotent); ``handle.active`` says whether it is still in force; a
handle is also a context manager that removes on exit, for registrations scoped to a block.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from types import TracebackType

__all__ = ["RemovableHandle"]


class RemovableHandle(AbstractContextManager["RemovableHandle"]):
    """Undoes one registration. Made by graphsafe (``register_derived``, ``on_recapture``, ``on_outcome``).

    Built from two callables; a registration made on a hot path (PWAL re-declaring every slot on every reload)
    subclasses it instead and overrides :meth:`remove`, :attr:`active` and :attr:`description`, sparing the
    closures.
    """

    __slots__ = ("_active", "_description", "_remove")

    def __init__(self, remove: Callable[[], None], active: Callable[[], bool], description: str) -> None:
        self._remove = remove
        self._active = active
        self._description = description

    @property
    def description(self) -> str:
        """What was registered, for messages (``register_derived(Linear, 'workspace')``)."""
        return self._description

    @property
    def active(self) -> bool:
        """Whether the registration is still in force."""
        return self._active()

    def remove(self) -> None:
        """Undo the registration (idempotent)."""
        self._remove()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"RemovableHandle({self.description}, active={self.active})"
