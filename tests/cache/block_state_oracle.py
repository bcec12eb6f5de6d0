"""The block-map state of a block, from the definition in docs/architecture.md.

Written on its own, not copied from ``BlockPool._state_of``: the caller
passes what *it* counted (references held, pins among them, whether the
prefix cache indexes the block), and the states are a lookup on those counts:

    references  pins  indexed   state
    0           0     no        free
    0           0     yes       cached   (free with a hash: a prefix hit revives it)
    1           0     -         used     (a running sequence's)
    1           1     -         pinned   (an idle session's pin)
    >= 2        any   -         shared

Shared wins over pinned and used: a block referenced twice shows shared
whoever the holders are (a session's pinned history that a running
sequence also reads, or two sessions pinning one prefix), because neither
unpinning nor finishing one holder frees it. The hash matters only for a
block nobody references: a referenced full block is used/pinned/shared
whether or not it is indexed. Anything else (pins without a reference, more
pins than references on a single reference) is impossible and fails.
"""

from __future__ import annotations

from streamkv.cache.block import BlockState


def expected_block_state(num_refs: int, num_pins: int, indexed: bool) -> BlockState:
    """The state the map must show for a block with these holders (see the table above)."""
    match num_refs, num_pins:
        case 0, 0:
            return BlockState.CACHED if indexed else BlockState.FREE
        case 1, 0:
            return BlockState.USED
        case 1, 1:
            return BlockState.PINNED
        case n, p if n >= 2 and 0 <= p <= n:
            return BlockState.SHARED
    raise AssertionError(f"no block can hold {num_refs} references with {num_pins} pins")
