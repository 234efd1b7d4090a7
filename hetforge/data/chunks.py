"""The corpus cut into chunks that are read, cleaned and encoded independently.

A chunk is a list of pieces of files of one source, about `data.chunk_bytes` in all: whole small
files packed together, byte ranges of a large JSONL file (a line belongs to the range it starts
in), row groups of a parquet file, row ranges of a Hugging Face dataset on disk. The plan is a
pure function of the sources and the files' sizes, so every worker, every `--task i/N` and every
restart cuts the corpus the same way; what a chunk produces depends on nothing else. Reading
streams: one line, row batch or text file at a time, never the whole corpus.

This module must stay light: worker processes import it, and it does not pull in torch.
"""

from __future__ import annotations

import gzip
import io
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from hetforge.data.corpus import (
    JSONL_SUFFIXES, PARQUET_SUFFIXES, TEXT_SUFFIXES, CorpusError, CorpusReport, Document, _read_bytes_as_text,
    _walk, aclsum_dir, aclsum_paper_text, aclsum_split_ids,
)

if TYPE_CHECKING:
    from hetforge.config import SourceConfig

COMPRESSED = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
# Stored size x this ~ text size, for the tokenizer's sample quota of a compressed file.
EXPANSION = {"gzip": 3.5, "zstd": 4.0}
SNIFF = 8192


@dataclass(frozen=True)
class Piece:
    """A file, or part of one: bytes [start, stop) of a JSONL file, row groups [start, stop) of a
    parquet file, rows [start, stop) of a dataset. stop = -1: to the end."""

    path: str
    fmt: str  # jsonl | txt | parquet | hf | aclsum
    compression: str | None = None
    start: int = 0
    stop: int = -1
    size: int = 0  # about how many bytes of text it holds

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.stop == -1


@dataclass
class Chunk:
    index: int
    source: int
    pieces: list[Piece] = field(default_factory=list)

    @property
    def size(self) -> int:
        return sum(p.size for p in self.pieces)

    def to_dict(self) -> dict:
        return {"index": self.index, "source": self.source, "pieces": [asdict(p) for p in self.pieces]}

    @classmethod
    def from_dict(cls, d: dict) -> "Chunk":
        return cls(d["index"], d["source"], [Piece(**p) for p in d["pieces"]])


@dataclass
class Plan:
    chunks: list[Chunk]
    report: CorpusReport  # files skipped while listing (unsupported, broken links, loops)
    source_bytes: list[int]  # per source, about how many bytes of text

    def inputs_key(self) -> list:
        """What identifies the inputs without reading them: each piece's path, size and mtime."""
        out = []
        for c in self.chunks:
            for p in c.pieces:
                path = Path(p.path)
                files = sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]
                stats = [(f.stat().st_size, f.stat().st_mtime_ns) for f in files]
                out.append([p.path, p.start, p.stop, stats])
        return out


def _format(path: Path, declared: str) -> tuple[str | None, str | None]:
    """(format, compression) of a file, from its suffixes unless the source declares the format."""
    suffixes = [s.lower() for s in path.suffixes]
    compression = COMPRESSED.get(suffixes[-1]) if suffixes else None
    inner = suffixes[-2] if compression and len(suffixes) > 1 else (suffixes[-1] if suffixes else "")
    if declared not in ("auto", "hf"):
        return declared, compression
    if inner in JSONL_SUFFIXES:
        return "jsonl", compression
    if compression:
        return None, compression
    if inner in PARQUET_SUFFIXES:
        return "parquet", None
    if inner in TEXT_SUFFIXES:
        return "txt", None
    return None, None


def _is_hf_dataset(path: Path) -> bool:
    return path.is_dir() and (path / "state.json").is_file() and (path / "dataset_info.json").is_file()


def _load_hf(path: str):
    try:
        import datasets
    except ImportError:
        raise CorpusError(f"data.sources: {path} is a Hugging Face dataset; reading it needs the `datasets` "
                          f"package (pip install 'hetforge[datasets]')") from None
    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        raise CorpusError(f"data.sources: {path} holds a DatasetDict ({', '.join(ds)}); point the source at "
                          f"one split's folder, e.g. {path}/{next(iter(ds))}")
    return ds


def _split_range(total: int, size: int, target: int) -> list[tuple[int, int]]:
    """[start, stop) ranges over `total` units holding `size` bytes, about `target` bytes each."""
    n = max(1, min(total, -(-size // max(target, 1))))
    bounds = [round(i * total / n) for i in range(n + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def _pieces(path: Path, source: "SourceConfig", chunk_bytes: int, report: CorpusReport) -> list[Piece]:
    if source.type == "aclsum":
        return [Piece(str(path), "aclsum", size=path.stat().st_size)]
    if source.format == "hf" or _is_hf_dataset(path):
        ds = _load_hf(str(path))
        if source.text_field not in ds.column_names:
            raise CorpusError(f"data.sources: {path} has no column {source.text_field!r} "
                              f"(it has {', '.join(ds.column_names)}); set text_field")
        size = sum(f.stat().st_size for f in path.glob("*.arrow")) or 1
        return [Piece(str(path), "hf", None, a, b, size * (b - a) // max(len(ds), 1))
                for a, b in _split_range(len(ds), size, chunk_bytes)]
    fmt, compression = _format(path, source.format)
    if fmt is None:
        report.skip_file(path, f"unsupported file type ({''.join(path.suffixes[-2:]) or 'no suffix'})")
        return []
    size = path.stat().st_size
    if compression:
        return [Piece(str(path), fmt, compression, size=int(size * EXPANSION[compression]))]
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            meta = pq.ParquetFile(path).metadata
        except (OSError, ValueError):  # pyarrow raises ArrowInvalid (a ValueError)
            report.skip_file(path, "unreadable parquet")
            return []
        groups = [meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)]
        pieces, start, acc = [], 0, 0
        for i, b in enumerate(groups):
            acc += b
            if acc >= chunk_bytes or i == len(groups) - 1:
                pieces.append(Piece(str(path), fmt, None, start, i + 1, acc))
                start, acc = i + 1, 0
        return pieces or [Piece(str(path), fmt, None, 0, -1, size)]
    if fmt == "jsonl" and size > chunk_bytes:
        return [Piece(str(path), fmt, None, a, b if b < size else -1, b - a) for a, b in _split_range(size, size, chunk_bytes)]
    return [Piece(str(path), fmt, None, size=size)]


def plan_chunks(sources: list["SourceConfig"], chunk_bytes: int) -> Plan:
    """Chunks of about `chunk_bytes`, in source order, then file order, then position in the file."""
    report = CorpusReport()
    chunks: list[Chunk] = []
    source_bytes = []
    for si, source in enumerate(sources):
        if source.type == "aclsum":
            excluded: set[str] = set()
            for split in source.exclude_splits:
                excluded |= aclsum_split_ids(split)
            files = [p for p in sorted((aclsum_dir() / "paper_jsons").glob("*.json")) if p.stem not in excluded]
        else:
            root = Path(source.path).expanduser()
            if not root.exists():
                raise CorpusError(f"data.sources: path does not exist: {root}")
            files = [root] if root.is_file() or source.format == "hf" or _is_hf_dataset(root) else _walk(root, report)
        total = 0
        current: Chunk | None = None
        for path in files:
            for piece in _pieces(path, source, chunk_bytes, report):
                total += piece.size
                if current is None or current.size + piece.size > chunk_bytes and current.pieces:
                    current = Chunk(len(chunks), si)
                    chunks.append(current)
                current.pieces.append(piece)
        source_bytes.append(total)
    return Plan(chunks, report, source_bytes)


# --- reading ------------------------------------------------------------------------------------
def _open_stream(piece: Piece):
    raw = open(piece.path, "rb")
    if piece.compression == "gzip":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if piece.compression == "zstd":
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True), buffer_size=1 << 20)
    return raw


def _json_text(line: str, text_field: str, report: CorpusReport) -> str | None:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        report.docs_dropped["bad JSON line"] += 1
        return None
    if isinstance(obj, dict) and "pdf_parse" in obj and text_field not in obj:
        return aclsum_paper_text(obj)
    value = obj.get(text_field) if isinstance(obj, dict) else None
    if not isinstance(value, str):
        report.docs_dropped[f"no string field {text_field!r}"] += 1
        return None
    return value


def _iter_jsonl_stream(piece: Piece, text_field: str, report: CorpusReport) -> Iterator[Document]:
    """Line by line; a byte range starts at the first line that begins in it."""
    try:
        f = _open_stream(piece)
        head = f.peek(SNIFF)[:SNIFF] if hasattr(f, "peek") else b""
    except (OSError, EOFError) as err:
        report.skip_file(Path(piece.path), f"unreadable ({err.__class__.__name__})")
        return
    with f:
        if piece.whole and not head:
            report.skip_file(Path(piece.path), "empty file")
            return
        if head.startswith((b"\xff\xfe", b"\xfe\xff")) or head[:4] in (b"\x00\x00\xfe\xff",):
            # UTF-16 / UTF-32 with a byte-order mark: not line-addressable as bytes; read whole
            f.close()
            yield from _iter_jsonl_whole(piece, text_field, report)
            return
        if b"\x00" in head and piece.start == 0:
            report.skip_file(Path(piece.path), "binary file")
            return
        if piece.start == 0:
            report.files_read += 1
        pos = piece.start
        if piece.start > 0:
            f.seek(piece.start - 1)
            pos = piece.start - 1 + len(f.readline())  # the rest of the previous range's last line
        lineno = 0
        while piece.stop < 0 or pos < piece.stop:
            try:
                line = f.readline()
            except (OSError, EOFError) as err:  # a truncated .gz / .zst: what was read before the cut stays
                if lineno:
                    report.truncated_file(Path(piece.path))
                else:
                    report.skip_file(Path(piece.path), f"truncated or corrupt ({err.__class__.__name__})")
                return
            if not line:
                break
            start, lineno = pos, lineno + 1
            pos += len(line)
            if lineno == 1 and piece.start == 0 and line.startswith(b"\xef\xbb\xbf"):
                line = line[3:]
            if not line.strip():
                continue
            if b"\x00" in line:
                report.nul_bytes_removed += line.count(b"\x00")
                line = line.replace(b"\x00", b"")
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError:
                report.docs_dropped["not UTF-8"] += 1
                continue
            del line
            value = _json_text(text, text_field, report)
            del text  # held while suspended below, these would triple a huge document's cost
            if value is not None:
                where = f"{piece.path}:{lineno}" if piece.whole else f"{piece.path}@{start}"
                doc, value = Document(where, value), None
                yield doc
                del doc


def _iter_jsonl_whole(piece: Piece, text_field: str, report: CorpusReport) -> Iterator[Document]:
    text = _read_bytes_as_text(Path(piece.path), report)
    if text is None:
        return
    report.files_read += 1
    stripped = text.lstrip()
    lines = [stripped] if stripped.startswith("{") and "\n{" not in stripped else text.splitlines()
    for lineno, line in enumerate(lines, 1):
        if line.strip():
            value = _json_text(line, text_field, report)
            if value is not None:
                yield Document(f"{piece.path}:{lineno}", value)


def _iter_parquet(piece: Piece, text_field: str, report: CorpusReport) -> Iterator[Document]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(piece.path)
        if text_field not in pf.schema_arrow.names:
            report.skip_file(Path(piece.path), f"no such column ({text_field!r})")
            return
        groups = range(piece.start, pf.metadata.num_row_groups if piece.stop < 0 else piece.stop)
        row = sum(pf.metadata.row_group(i).num_rows for i in range(piece.start))
        if piece.start == 0:
            report.files_read += 1
        for batch in pf.iter_batches(batch_size=1024, row_groups=list(groups), columns=[text_field]):
            for value in batch.column(0).to_pylist():
                if isinstance(value, str):
                    yield Document(f"{piece.path}#{row}", value)
                else:
                    report.docs_dropped[f"no string field {text_field!r}"] += 1
                row += 1
    except (OSError, ValueError):
        report.skip_file(Path(piece.path), "unreadable parquet")


def _iter_hf(piece: Piece, text_field: str, report: CorpusReport) -> Iterator[Document]:
    ds = _load_hf(piece.path).select_columns([text_field])
    stop = len(ds) if piece.stop < 0 else piece.stop
    if piece.start == 0:
        report.files_read += 1
    for a in range(piece.start, stop, 1024):
        for i, value in enumerate(ds[a:min(a + 1024, stop)][text_field]):
            if isinstance(value, str):
                yield Document(f"{piece.path}#{a + i}", value)
            else:
                report.docs_dropped[f"no string field {text_field!r}"] += 1


def iter_chunk(chunk: Chunk, text_field: str, report: CorpusReport) -> Iterator[Document]:
    """The raw documents of a chunk, in order; what cannot be read is skipped and counted."""
    for piece in chunk.pieces:
        if piece.fmt == "aclsum" or (piece.fmt == "jsonl" and piece.whole and not piece.compression
                                     and piece.path.endswith(".json")):  # often one JSON document a file
            yield from _iter_jsonl_whole(piece, text_field, report)
        elif piece.fmt == "jsonl":
            yield from _iter_jsonl_stream(piece, text_field, report)
        elif piece.fmt == "parquet":
            yield from _iter_parquet(piece, text_field, report)
        elif piece.fmt == "hf":
            yield from _iter_hf(piece, text_field, report)
        else:
            text = _read_bytes_as_text(Path(piece.path), report)
            if text is not None:
                report.files_read += 1
                yield Document(piece.path, text)
