"""The step's own bytecode, read to tell a counter (``x += 1``) from other writes, and to name a line.

A counter is stored by an augmented assignment: ``+=`` or ``-=`` (``BINARY_OP`` with that ``argrepr`` on
Python 3.11+, ``INPLACE_ADD``/``INPLACE_SUBTRACT`` before), followed by its store, with at most stack moves
between them (``x.a += 1`` swaps the owner back on top).
"""

from __future__ import annotations

import dis
import types
from typing import Iterator

_AUGMENTED = frozenset({"+=", "-=", "INPLACE_ADD", "INPLACE_SUBTRACT"})
_STACK_MOVES = frozenset({"SWAP", "ROT_TWO", "CACHE"})


def instructions(code: types.CodeType) -> Iterator[tuple[dis.Instruction, bool]]:
    """Each instruction of ``code``, with whether a ``+=`` or ``-=`` comes right before it: for a store,
    whether it is the store of an augmented assignment."""
    previous = None
    for instruction in dis.get_instructions(code):
        yield instruction, previous is not None and (previous.argrepr in _AUGMENTED or previous.opname in _AUGMENTED)
        if instruction.opname not in _STACK_MOVES:
            previous = instruction


def augmented_at(code: types.CodeType, offset: int) -> bool:
    """Whether the store at ``offset`` of ``code`` is ``x += ...`` or ``x -= ...``."""
    return next((augmented for instruction, augmented in instructions(code) if instruction.offset == offset), False)


def line_of(code: types.CodeType, offset: int) -> int:
    """The source line of the instruction at ``offset`` of ``code``."""
    starts = [(o, line) for o, line in dis.findlinestarts(code) if line is not None and o <= offset]
    return max(starts, default=(0, code.co_firstlineno))[1]
