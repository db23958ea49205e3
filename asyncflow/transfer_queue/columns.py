"""Columns as the TransferQueue stores and moves them.

Three kinds:
- ``fixed``: one tensor ``[rows, *shape]`` (scalars per row, fixed-size vectors).
- ``jagged``: variable-length rows (token ids, per-token log-probs) as one flat
  ``values`` buffer ``[total, *shape]`` plus ``offsets`` ``[rows + 1]``; never padded.
- ``object``: a list of JSON-representable Python values (strings such as
  ground-truth answers, dicts of metadata). They travel as JSON, never as pickle.

A column's *schema* (kind, dtype, per-element shape) is fixed on first write; later
writes to the same column of a partition must match it. Columns are checked for being
well formed (column_problem) where data enters: to_column of a user's Column, a storage
unit's put; replies are not checked again.
"""
from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ..cpu_account import charged
from ..rpc.codec import CodecError, dtype_name

if TYPE_CHECKING:  # tensordict is imported where a TensorDict is built (a slow import)
    from tensordict import NestedKey, TensorCollection, TensorDict

_C = TypeVar("_C", bound="Column")


@dataclass(frozen=True)
class FieldSchema:
    kind: str  # "fixed" | "jagged" | "object"
    dtype: str | None  # None for object columns
    shape: tuple[int, ...]  # per-row shape (fixed) or per-token shape (jagged)

    def describe(self) -> str:
        if self.kind == "object":
            return "object"
        return f"{self.kind} {self.dtype}{list(self.shape)}"

    def to_wire(self) -> list[Any]:
        return [self.kind, self.dtype, list(self.shape)]

    @staticmethod
    def from_wire(w: Sequence[Any]) -> FieldSchema:
        return FieldSchema(w[0], w[1], tuple(w[2]))


class Column:
    kind: str

    def __len__(self) -> int:
        raise NotImplementedError

    def take(self, idx: Sequence[int]) -> Column:
        """Rows ``idx`` in that order."""
        raise NotImplementedError

    @property
    def schema(self) -> FieldSchema:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        raise NotImplementedError


@dataclass
class FixedColumn(Column):
    data: torch.Tensor
    kind = "fixed"

    def __len__(self) -> int:
        return self.data.shape[0]

    @property
    def schema(self) -> FieldSchema:
        return FieldSchema("fixed", dtype_name(self.data.dtype), tuple(self.data.shape[1:]))

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def take(self, idx: Sequence[int]) -> FixedColumn:
        run = _as_run(idx)
        if run == (0, len(self)):
            return self  # the same tensors: a read of a whole put can resend its frames
        if run is not None:
            return FixedColumn(self.data[run[0]:run[1]])
        return FixedColumn(self.data[torch.as_tensor(idx, dtype=torch.long)])


@dataclass
class JaggedColumn(Column):
    values: torch.Tensor  # [total, *shape]
    offsets: torch.Tensor  # [rows + 1], int64, offsets[0] == 0
    kind = "jagged"

    def __len__(self) -> int:
        return self.offsets.shape[0] - 1

    @property
    def schema(self) -> FieldSchema:
        return FieldSchema("jagged", dtype_name(self.values.dtype), tuple(self.values.shape[1:]))

    @property
    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size() + self.offsets.numel() * 8

    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def row(self, i: int) -> torch.Tensor:
        return self.values[int(self.offsets[i]):int(self.offsets[i + 1])]

    def take(self, idx: Sequence[int]) -> JaggedColumn:
        run = _as_run(idx)
        if run == (0, len(self)):
            return self  # the same tensors: a read of a whole put can resend its frames
        if run is not None:  # contiguous rows: a view, no copy
            a, b = run
            lo, hi = int(self.offsets[a]), int(self.offsets[b])
            return JaggedColumn(self.values[lo:hi], self.offsets[a:b + 1] - lo)
        ix = torch.as_tensor(idx, dtype=torch.long)
        starts = self.offsets[ix]
        lens = self.offsets[ix + 1] - starts
        new_off = torch.zeros(len(ix) + 1, dtype=torch.long)
        torch.cumsum(lens, 0, out=new_off[1:])
        total = int(new_off[-1])
        # One flat gather index: each row's source start shifted onto its new position.
        flat = torch.repeat_interleave(starts - new_off[:-1], lens, output_size=total)
        flat += torch.arange(total)
        return JaggedColumn(self.values[flat], new_off)


@dataclass
class ObjectColumn(Column):
    items: list[Any]
    kind = "object"

    def __len__(self) -> int:
        return len(self.items)

    @property
    def schema(self) -> FieldSchema:
        return FieldSchema("object", None, ())

    @property
    def nbytes(self) -> int:
        """Capacity accounting: each item's content (see _object_nbytes) plus a fixed overhead.
        A loop over the items: the storage unit computes it once per put."""
        return _object_nbytes(self.items)

    def take(self, idx: Sequence[int]) -> ObjectColumn:
        items = self.items
        return ObjectColumn([items[i] for i in idx])


# What an object item holds beyond its content: CPython's header of a str (49 bytes) plus
# its slot in the list (8), rounded. Keeps many tiny items (empty strings, ints) counted.
_OBJECT_ITEM_OVERHEAD = 56


def _object_nbytes(items: list[Any]) -> int:
    """The content size of object items, cheaply: a string's UTF-8 length, bytes' length, 8
    for a number, and for anything else (dicts, lists) the length of the JSON text it travels
    as (codec.py); plus _OBJECT_ITEM_OVERHEAD each."""
    total = _OBJECT_ITEM_OVERHEAD * len(items)
    rest = []
    for x in items:
        t = type(x)
        if t is str:
            # isascii() reads a flag CPython keeps on the string (O(1)): ASCII text is counted
            # by len() without encoding a copy. Lone surrogates (JSON can carry them) count too.
            total += len(x) if x.isascii() else len(x.encode("utf-8", "surrogatepass"))
        elif t is bytes or t is bytearray:
            total += len(x)
        elif t is int or t is float or t is bool or x is None:
            total += 8
        else:
            rest.append(x)
    if rest:  # one JSON encoding of them all (C speed), less the list's brackets and commas
        total += _json_nbytes(rest) - len(rest) - 1
    return total


def _json_nbytes(x: Any) -> int:
    """Length of ``x`` as its compact JSON travels (codec.encode: ASCII-escaped); tensors inside
    (the codec sends those as frames) count their element bytes, anything else JSON cannot
    write counts its repr."""
    frames = 0

    def other(o: Any) -> Any:
        nonlocal frames
        if isinstance(o, torch.Tensor):
            frames += o.numel() * o.element_size()
            return 0
        return repr(o)

    try:
        return len(json.dumps(x, separators=(",", ":"), default=other)) + frames
    except (TypeError, ValueError):  # e.g. a dict with tuple keys: only in-process puts get here
        return len(repr(x))


def _as_run(idx: Sequence[int]) -> tuple[int, int] | None:
    """(start, stop) when ``idx`` is a contiguous ascending range."""
    if isinstance(idx, range) and idx.step == 1:
        return (idx.start, idx.stop)
    n = len(idx)
    if n == 0:
        return (0, 0)
    a = idx[0]
    if idx[n - 1] - a == n - 1 and (n < 3 or all(idx[i] + 1 == idx[i + 1] for i in range(n - 1))):
        return (a, a + n)
    return None


def concat(cols: Sequence[Column]) -> Column:
    """Rows of ``cols`` one after another; all of one kind and dtype."""
    if len(cols) == 1:
        return cols[0]
    first = cols[0]
    if isinstance(first, FixedColumn):
        return FixedColumn(torch.cat([c.data for c in _of_kind(cols, FixedColumn)]))
    if isinstance(first, JaggedColumn):
        jagged = _of_kind(cols, JaggedColumn)
        # Each column's offsets end at its values' length (the jagged invariant), so the shift of
        # every piece comes from shapes: a few tensor ops in all, not two per piece.
        sizes = [c.values.shape[0] for c in jagged]
        rows = [len(c) for c in jagged]
        bases = torch.tensor([0, *itertools.accumulate(sizes[:-1])], dtype=torch.long)
        tails = torch.cat([c.offsets[1:] for c in jagged])
        tails += torch.repeat_interleave(bases, torch.tensor(rows), output_size=tails.shape[0])
        return JaggedColumn(torch.cat([c.values for c in jagged]), torch.cat([tails.new_zeros(1), tails]))
    return ObjectColumn([x for c in _of_kind(cols, ObjectColumn) for x in c.items])


def _of_kind(cols: Sequence[Column], kind: type[_C]) -> list[_C]:
    """``cols`` as columns of one kind: a concat of mixed kinds is refused, naming them."""
    if not all(isinstance(c, kind) for c in cols):
        raise TypeError(f"concat of columns of mixed kinds: {sorted({c.kind for c in cols})}")
    return [c for c in cols if isinstance(c, kind)]


# ---- wire form: nested JSON + tensors for codec.encode ------------------------------

@charged("serialization")
def column_to_wire(col: Column) -> dict[str, Any]:
    if isinstance(col, FixedColumn):
        return {"k": "fixed", "data": col.data}
    if isinstance(col, JaggedColumn):
        return {"k": "jagged", "values": col.values, "offsets": col.offsets}
    if isinstance(col, ObjectColumn):
        return {"k": "object", "items": col.items}
    raise TypeError(_unknown_kind(col))


def _unknown_kind(col: Column) -> str:
    return f"a column of unknown kind: {type(col).__name__} (columns are FixedColumn, JaggedColumn, ObjectColumn)"


@charged("serialization")
def column_from_wire(w: Mapping[str, Any], check: bool = False) -> Column:
    """A column from its wire form. ``check``: also refuse a column that is malformed (see
    column_problem), for data about to be stored; replies a unit built from checked columns
    are read with ``check`` off, so reads pay nothing for it."""
    kind = w.get("k") if isinstance(w, Mapping) else None
    try:
        if kind == "fixed":
            col: Column = FixedColumn(w["data"])
        elif kind == "jagged":
            col = JaggedColumn(w["values"], w["offsets"])
            # (checked below in detail when asked; a reply's offsets only need to be usable)
            if not check and (col.offsets.dtype != torch.int64 or col.offsets.dim() != 1):
                raise CodecError("jagged offsets must be a 1-D int64 tensor")
        elif kind == "object":
            items = w["items"]
            if check and not isinstance(items, list):  # list() of a string would split it
                raise CodecError(f"object column items must be a list, got a {type(items).__name__}")
            return ObjectColumn(list(items))
        else:
            raise CodecError(f"unknown column kind {kind!r}")
    except KeyError as e:
        raise CodecError(f"column of kind {kind!r} lacks {e}") from None
    if check:
        problem = column_problem(col)
        if problem is not None:
            raise CodecError(problem)
    return col


def column_problem(col: Column) -> str | None:
    """What makes ``col`` unfit to store, with how to fix it; None when it is well formed.

    Malformed columns must be refused where data enters (a unit's put, to_column of a user's
    column): stored, they give wrong token counts and fail much later inside torch, naming
    neither the column nor the cause. A few numpy ops on the offsets, no loop over rows: this
    runs on every put."""
    if isinstance(col, FixedColumn):
        data = col.data
        if not isinstance(data, torch.Tensor):
            return f"fixed column data is a {type(data).__name__}, not a tensor of shape [rows, *shape]"
        if data.dim() == 0:
            return ("fixed column data is a 0-d tensor; a column needs one entry per row: "
                    "a tensor of shape [rows, *shape] (e.g. x.reshape(1) for one row)")
        return None
    if isinstance(col, JaggedColumn):
        return _jagged_problem(col.values, col.offsets)
    if isinstance(col, ObjectColumn) and not isinstance(col.items, list):
        return f"object column items must be a list, got a {type(col.items).__name__}"
    return None


_JAGGED_FIX = ("build it with to_column from a list of row tensors or a jagged nested tensor, "
               "or give offsets [0, len0, len0+len1, ..., values.shape[0]]")


def _jagged_problem(values: Any, offsets: Any) -> str | None:
    if not isinstance(values, torch.Tensor) or not isinstance(offsets, torch.Tensor):
        return (f"jagged column values and offsets must be tensors, got {type(values).__name__} and "
                f"{type(offsets).__name__}; {_JAGGED_FIX}")
    if values.dim() == 0:
        return f"jagged column values is a 0-d tensor; it must be [total, *shape]; {_JAGGED_FIX}"
    if offsets.dtype != torch.int64 or offsets.dim() != 1 or offsets.shape[0] == 0:
        return (f"jagged column offsets must be a 1-D int64 tensor of rows + 1 entries, got "
                f"{str(offsets.dtype).removeprefix('torch.')} of shape {list(offsets.shape)}; {_JAGGED_FIX}")
    # numpy view of the int64 offsets: a few us per check where each torch op costs several.
    o = (offsets if offsets.device.type == "cpu" else offsets.cpu()).numpy()
    total = values.shape[0]
    if o[0] != 0:
        return f"jagged column offsets[0] is {int(o[0])}, must be 0; {_JAGGED_FIX}"
    down = o[1:] < o[:-1]
    if down.any():
        i = int(down.argmax())
        return (f"jagged column offsets decrease at row {i} ({int(o[i])} -> {int(o[i + 1])}); they must "
                f"be non-decreasing (row i is values[offsets[i]:offsets[i+1]]); {_JAGGED_FIX}")
    if o[-1] != total:
        return (f"jagged column offsets end at {int(o[-1])} but values has {total} rows; offsets[-1] must "
                f"equal values.shape[0]; {_JAGGED_FIX}")
    return None


# ---- user data -> columns -----------------------------------------------------------

def _is_tensordict(x: Any) -> bool:
    return type(x).__module__.startswith("tensordict")


def _from_nested(nt: torch.Tensor, name: str) -> JaggedColumn:
    if getattr(nt, "layout", None) != torch.jagged:
        rows = nt.unbind()
        return _from_row_list(list(rows), name)
    return _from_jagged(nt, name)


def _from_jagged(nt: torch.Tensor, name: str) -> JaggedColumn:
    """A jagged-layout nested tensor -> its column (no copy unless it has holes)."""
    if getattr(nt, "_lengths", None) is not None:  # holes in the buffer: gather rows
        return _from_row_list(list(nt.unbind()), name)
    # The private fields skip NestedTensor's __torch_function__ dispatch, paid in Python on
    # every accessor call, for every jagged column of every put.
    offsets = getattr(nt, "_offsets", None)
    values = getattr(nt, "_values", None)
    if offsets is None or values is None:
        jagged: Any = nt  # a NestedTensor: offsets() and values() are not in torch.Tensor's stubs
        offsets, values = jagged.offsets(), jagged.values()
    offsets = offsets.to(torch.long)
    lo, hi = int(offsets[0]), int(offsets[-1])
    if lo or hi != values.shape[0]:
        values = values[lo:hi]
        offsets = offsets - lo
    return JaggedColumn(values, offsets)


def _from_row_list(rows: list[torch.Tensor], name: str) -> JaggedColumn:
    if not rows:
        raise ValueError(f"column {name!r}: an empty list of rows has no dtype; send at least one row")
    # One pass over the rows (a put of a step's rows runs this per column): each row's dtype,
    # shape, and whether torch.cat can take it as it is (on the CPU, outside autograd).
    dtype, tail = rows[0].dtype, rows[0].shape[1:]
    lens = []
    as_is = True
    for r in rows:
        shape = r.shape
        if r.dtype != dtype or not shape or shape[1:] != tail:
            _refuse_row_list(rows, name)
        lens.append(shape[0])
        if as_is and (r.requires_grad or not r.is_cpu):
            as_is = False
    offsets = torch.zeros(len(rows) + 1, dtype=torch.long)
    torch.cumsum(torch.tensor(lens, dtype=torch.long), 0, out=offsets[1:])
    return JaggedColumn(torch.cat(rows if as_is else [r.detach().cpu() for r in rows]), offsets)


def _refuse_row_list(rows: list[torch.Tensor], name: str) -> None:
    """Raise what is wrong with a list of rows that are not one jagged column."""
    dtypes = {r.dtype for r in rows}
    if len(dtypes) > 1:
        raise ValueError(f"column {name!r}: rows have mixed dtypes {sorted(map(str, dtypes))}")
    raise ValueError(f"column {name!r}: variable-length rows must be tensors of shape [len, *same]; "
                     f"got shapes {sorted({tuple(r.shape) for r in rows})[:4]}")


def to_column(name: str, value: Any) -> Column:
    if isinstance(value, Column):  # a user's own column: the one kind not built (so checked) here
        problem = column_problem(value)
        if problem is not None:
            raise ValueError(f"column {name!r}: {problem}")
        return value
    if isinstance(value, torch.Tensor):
        # A NestedTensor is jagged by construction; asking it is_nested and layout would go
        # through its __torch_function__, a Python-level dispatch per question.
        if _NestedTensor is not None and type(value) is _NestedTensor:
            return _from_jagged(value, name)
        if value.is_nested:
            return _from_nested(value, name)
        if value.dim() == 0:
            raise ValueError(f"column {name!r} is a 0-d tensor; a column needs one entry per row")
        return FixedColumn(value.detach().cpu())
    if _is_tensordict(value):
        if type(value).__name__.startswith("NonTensor"):  # NonTensorStack / NonTensorData
            return ObjectColumn(list(value.tolist()))
        raise ValueError(f"column {name!r} is a nested TensorDict; store its fields as columns of their "
                         f"own (e.g. td.flatten_keys('.'))")
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, torch.Tensor) for v in value):
            return _from_row_list(list(value), name)
        if any(isinstance(v, torch.Tensor) for v in value):
            raise ValueError(f"column {name!r} mixes tensors and other values")
        return ObjectColumn(list(value))
    raise ValueError(f"column {name!r}: cannot store a {type(value).__name__}; use a tensor, a nested "
                     "(jagged) tensor, a list of 1-D tensors, or a list of JSON values")


@charged("serialization")
def to_columns(data: Any) -> tuple[dict[str, Column], int]:
    """Normalise a TensorDict or a mapping of columns; check every column has one row count."""
    if _is_tensordict(data):
        names = list(data.keys())
        items = {k: data.get(k) for k in names}
    elif isinstance(data, Mapping):
        items = dict(data)
    else:
        raise TypeError(f"put expects a TensorDict or a dict of columns, got {type(data).__name__}")
    if not items:
        raise ValueError("put of no columns: the data has no fields")
    cols = {str(k): to_column(str(k), v) for k, v in items.items()}
    counts = {k: len(c) for k, c in cols.items()}
    if len(set(counts.values())) != 1:
        raise ValueError(f"columns have different row counts: {counts}; every column needs one entry per row")
    return cols, next(iter(counts.values()))


def _nested(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """A jagged nested tensor over ``values``/``offsets`` (no copy).

    Built with NestedTensor's constructor: ``nested_tensor_from_jagged`` goes through
    ``__torch_function__`` and a view op, which the constructor skips, for every jagged
    column of every get. The result
    reads the same; it is just not an autograd view of ``values``, which received data
    never needs. Falls back to the public function if the private class moves."""
    if _NestedTensor is not None and not values.requires_grad:
        try:
            return _NestedTensor(values, offsets)
        except Exception:  # noqa: BLE001  (a torch whose constructor differs: use the public path)
            pass
    return torch.nested.nested_tensor_from_jagged(values, offsets)


_NestedTensor: type[torch.Tensor] | None
try:
    from torch.nested._internal.nested_tensor import NestedTensor as _NestedTensorClass
    _NestedTensor = _NestedTensorClass
except Exception:  # noqa: BLE001
    _NestedTensor = None


@charged("serialization")
def to_tensordict(cols: Mapping[str, Column], n_rows: int) -> TensorDict:
    """Columns -> TensorDict with ``batch_size=[n_rows]``; jagged columns become nested tensors."""
    from tensordict import NonTensorStack, TensorDict  # slow import: only when asked for

    out: dict[NestedKey, torch.Tensor | TensorCollection] = {}
    for k, c in cols.items():
        if isinstance(c, FixedColumn):
            out[k] = c.data
        elif isinstance(c, JaggedColumn):
            out[k] = _nested(c.values, c.offsets)
        elif isinstance(c, ObjectColumn):
            out[k] = NonTensorStack.from_list(c.items) if c.items else NonTensorStack(batch_size=[0])
        else:
            raise TypeError(f"column {k!r}: {_unknown_kind(c)}")
    # Every column already has n_rows rows (checked on put): skip TensorDict's re-validation.
    return TensorDict._new_unsafe(out, batch_size=torch.Size([n_rows]))
