"""The cost table `deepinfer profile` measures and `deepinfer simulate` reads: step seconds by
prefill chunk and context, by chunks per step, by decode batch and context, the host copies'
and the block store's bandwidth, the KV geometry, and where / when / on what it was measured."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import orjson

FORMAT = "deepinfer-sim-table-1"


class TableError(ValueError):
    """A table file that cannot be read as a cost table."""


@dataclass
class Provenance:
    """Where, when and on what the table was measured (or how it was derived)."""

    where: str  # the machine: host name and CPU / accelerator model
    when: str  # ISO 8601 UTC
    device: str  # torch device type
    model: str
    dtype: str
    threads: int = 0  # CPU threads of the forward (0: not a CPU device)
    torch: str = ""
    command: str = ""  # the command line that measured it
    note: str = ""


@dataclass
class Grid:
    """seconds[i][j]: a step at rows[i] (tokens or sequences) and columns[j] (context)."""

    rows: list[int]
    columns: list[int]
    seconds: list[list[float]]

    def __post_init__(self) -> None:
        if not self.rows or not self.columns:
            raise TableError("a grid needs at least one row and one column")
        if self.rows != sorted(set(self.rows)) or self.columns != sorted(set(self.columns)):
            raise TableError("grid rows and columns must be strictly increasing")
        if len(self.seconds) != len(self.rows) or any(
            len(r) != len(self.columns) for r in self.seconds
        ):
            raise TableError("grid seconds must be rows x columns")
        if any(s <= 0 for r in self.seconds for s in r):
            raise TableError("grid seconds must be positive")

    def at(self, row: float, column: float) -> float:
        """Bilinear in the grid, linear past its ends (from the last two points), never below
        the smallest value measured in that row's neighbourhood / 2 (an extrapolation toward 0)."""
        i, u = _where(self.rows, row)
        j, v = _where(self.columns, column)
        s = self.seconds
        i2, j2 = min(i + 1, len(self.rows) - 1), min(j + 1, len(self.columns) - 1)
        top = s[i][j] + (s[i][j2] - s[i][j]) * v
        bottom = s[i2][j] + (s[i2][j2] - s[i2][j]) * v
        value = top + (bottom - top) * u
        return max(value, 0.5 * min(s[i][j], s[i2][j]))


def _where(points: list[int], x: float) -> tuple[int, float]:
    """(index, fraction) of x between points[index] and points[index + 1]; the fraction is
    outside [0, 1] past the ends (linear extrapolation); one point: (0, 0)."""
    if len(points) == 1:
        return 0, 0.0
    i = 0
    while i < len(points) - 2 and x > points[i + 1]:
        i += 1
    return i, (x - points[i]) / (points[i + 1] - points[i])


@dataclass
class Bandwidth:
    """A transfer of `n` bytes costs latency_s + n / bytes_per_s."""

    bytes_per_s: float
    latency_s: float = 0.0

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bytes_per_s if nbytes else 0.0


@dataclass
class KVGeometry:
    """The model's prefix-block KV, as the simulator's KV manager lays it out (one paged
    full-attention group)."""

    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    @property
    def bytes_per_block(self) -> int:
        itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}[self.dtype]
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * itemsize * self.num_layers


@dataclass
class CostTable:
    provenance: Provenance
    kv: KVGeometry
    prefill: Grid  # rows: tokens of one chunk; columns: positions computed before it
    decode: Grid  # rows: decode sequences; columns: context of each
    host_save: Bandwidth  # device -> host copies (demotions, blocks to persist)
    host_load: Bandwidth  # host -> device copies (host and store hits)
    store_read: Bandwidth  # a chain read: latency once, then bandwidth
    store_write: Bandwidth
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    extra: dict[str, object] = field(default_factory=dict)
    # rows: tokens of each chunk; columns: chunks in one step (1 and more), at context 0;
    # None: not measured (a step's once-paid part is then guessed, see cost.StepCost)
    prefill_batch: Grid | None = None

    def to_json(self) -> bytes:
        return orjson.dumps({"format": FORMAT} | asdict(self), option=orjson.OPT_INDENT_2)

    def save(self, path: str | Path) -> None:
        Path(path).write_bytes(self.to_json())

    @classmethod
    def from_dict(cls, d: dict) -> CostTable:
        if d.get("format") != FORMAT:
            raise TableError(f"not a {FORMAT} table (format {d.get('format')!r})")
        try:
            return cls(
                Provenance(**d["provenance"]),
                KVGeometry(**d["kv"]),
                Grid(**d["prefill"]),
                Grid(**d["decode"]),
                Bandwidth(**d["host_save"]),
                Bandwidth(**d["host_load"]),
                Bandwidth(**d["store_read"]),
                Bandwidth(**d["store_write"]),
                d.get("max_num_batched_tokens", 2048),
                d.get("max_num_seqs", 128),
                d.get("extra", {}),
                _batch(d.get("prefill_batch")),
            )
        except (KeyError, TypeError) as e:
            raise TableError(f"a cost table field is missing or wrong: {e}") from e

    @classmethod
    def load(cls, path: str | Path) -> CostTable:
        try:
            data = orjson.loads(Path(path).read_bytes())
        except orjson.JSONDecodeError as e:
            raise TableError(f"{path}: not JSON ({e})") from e
        if not isinstance(data, dict):
            raise TableError(f"{path}: not a cost table")
        return cls.from_dict(data)


def _batch(d: dict | None) -> Grid | None:
    """The steps of several chunks, if measured: at least two columns, the first one chunk."""
    if d is None:
        return None
    grid = Grid(**d)
    if len(grid.columns) < 2 or grid.columns[0] != 1:
        raise TableError("prefill_batch columns must be 1 and more chunks per step")
    return grid
