"""kvfill.bank: recorded KV rows, the value source of a replay fill (no vLLM
import here, nor any other part of kvfill: ``kvfill.kernels`` and
``kvfill.connector`` import the bank, never the reverse).

One file per role:

    format.py   what a bank file holds and how it replays: the schema, the replay
                rule, BANK_FORMAT / BANK_VERSION, BankError, dtype_name
    files.py    a bank file on disk: metadata read and checked, a part loaded,
                atomic save, the file's identity, free_bytes
    bank.py     Bank, a bank in memory: checked as built, a part selected
    checks.py   a bank checked against a cache: rows in its element order, state pages
    parts.py    BankPart, what one rank loads: its TP heads, PP layers, DCP positions
    dcp.py      DcpGeometry, which DCP rank holds which token (the fill kernels' too)
    index.py    BankIndex, which recorded sequence a block replays (metadata alone)
    stream.py   a bank file's header alone (StoredBank) and its rows a bounded chunk at a time
    rows.py     RowFormat, the canonical K/V row order and the permutation to each cache's
    state.py    StateTensor, the state section: hybrid models' recurrent state per sequence
"""
from .bank import Bank
from .dcp import NO_DCP, DcpGeometry
from .files import free_bytes
from .format import BANK_FORMAT, BANK_VERSION, BankError, dtype_name
from .index import BankIndex, sequence_key
from .parts import WHOLE, BankPart, head_range
from .rows import RowFormat

__all__ = [
    "BANK_FORMAT",
    "BANK_VERSION",
    "Bank",
    "BankError",
    "BankIndex",
    "BankPart",
    "DcpGeometry",
    "NO_DCP",
    "RowFormat",
    "WHOLE",
    "dtype_name",
    "free_bytes",
    "head_range",
    "sequence_key",
]
