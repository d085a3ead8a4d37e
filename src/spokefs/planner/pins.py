"""The planner's pins: one ledger of bytes pinned, kept by the holders that pin.

Each holder (the announced orders together, each learner's kept set, each learner's endgame)
is a ``Pins``: key -> size, with nested pins counted (an order may hold one block at two
positions). Every ``Pin`` action comes from ``Pins.pin`` and every ``Unpin`` from
``Pins.unpin`` or ``Pins.release``, so the store's pin counts, each holder's bytes and the
ledger's total cannot drift apart (tests/test_planner_ledgers.py checks it).
"""

from __future__ import annotations

from collections.abc import ItemsView

from spokefs.planner.events import Action, Pin, Unpin
from spokefs.policy import BlockKey


class PinLedger:
    """Bytes pinned by every holder together (a block pinned twice counts twice)."""

    __slots__ = ("bytes",)

    def __init__(self) -> None:
        self.bytes = 0

    def holder(self) -> Pins:
        return Pins(self)


class Pins:
    """One holder's pins. ``bytes`` is its share of the ledger."""

    __slots__ = ("_extra", "_sizes", "bytes", "ledger")

    def __init__(self, ledger: PinLedger) -> None:
        self.ledger = ledger
        self._sizes: dict[BlockKey, int] = {}
        self._extra: dict[BlockKey, int] = {}  # pins beyond the first (rare: orders only)
        self.bytes = 0

    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def items(self) -> ItemsView[BlockKey, int]:
        """(key, size) once per key, in pin order."""
        return self._sizes.items()

    def count(self, key: BlockKey) -> int:
        return (1 + self._extra.get(key, 0)) if key in self._sizes else 0

    def pin(self, key: BlockKey, size: int, out: list[Action]) -> None:
        if key in self._sizes:
            self._extra[key] = self._extra.get(key, 0) + 1
        else:
            self._sizes[key] = size
        self.bytes += size
        self.ledger.bytes += size
        out.append(Pin(key))

    def unpin(self, key: BlockKey, out: list[Action]) -> bool:
        """Release one pin of ``key``; False (and no action) when this holder has none."""
        size = self._sizes.get(key)
        if size is None:
            return False
        extra = self._extra.get(key, 0)
        if extra > 1:
            self._extra[key] = extra - 1
        elif extra == 1:
            del self._extra[key]
        else:
            del self._sizes[key]
        self.bytes -= size
        self.ledger.bytes -= size
        out.append(Unpin(key))
        return True

    def release(self, out: list[Action]) -> None:
        """Release every pin this holder has, in pin order."""
        for key in self._sizes:
            out.extend([Unpin(key)] * (1 + self._extra.get(key, 0)))
        self.ledger.bytes -= self.bytes
        self.bytes = 0
        self._sizes.clear()
        self._extra.clear()
