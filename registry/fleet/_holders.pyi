"""The fleet view's holder maps at native speed (``_holders.c``); see
``registry.fleet.holders`` and ``registry.fleet.matches``, its only callers."""

from collections.abc import Iterable

class Index:
    """Block hash -> holder int, kept equal to the table's dict by ``change``."""

    def __len__(self) -> int: ...
    def as_dict(self) -> dict[int, int]: ...

def change(
    blocks: dict[int, int],
    index: Index,
    added: Iterable[int],
    removed: Iterable[int],
    bit: int,
    shared: list[int],
    /,
) -> None: ...
def walk(
    index: Index,
    hashes: list[int],
    mask: int,
    mamba: Index | None,
    /,
) -> tuple[list[tuple[int, int]], list[int], int] | None: ...
