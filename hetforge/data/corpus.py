"""Reading and cleaning a corpus of documents.

Inputs are the embedded aclsum papers, JSONL (one object per line, text in a configurable field),
plain text (one document per file) and parquet (a text column). A corpus of scientific text gathered
from many places always contains some junk: every file that cannot be read is skipped and counted
with its reason, never fatal, and every dropped document is counted too, so the user sees exactly
what went into the shards.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from hetforge.core.errors import HetforgeError

if TYPE_CHECKING:  # worker processes import this module: no torch
    from hetforge.config import DataConfig, SourceConfig

TEXT_SUFFIXES = {".txt", ".text", ".md"}
JSONL_SUFFIXES = {".jsonl", ".json", ".ndjson"}
PARQUET_SUFFIXES = {".parquet", ".pq"}


class CorpusError(HetforgeError, ValueError):
    """The corpus as configured cannot be read at all (e.g. a source path does not exist)."""


@dataclass
class Document:
    doc_id: str  # source file (and line / row) it came from: for reports and exclusion lists
    text: str


@dataclass
class CorpusReport:
    """What was read, what was skipped and why. Printed by `prepare` and stored in the metadata."""

    files_read: int = 0
    files_skipped: Counter = field(default_factory=Counter)  # reason -> count
    skipped_examples: dict[str, list[str]] = field(default_factory=dict)
    docs_read: int = 0
    docs_dropped: Counter = field(default_factory=Counter)  # reason -> count
    docs_kept: int = 0
    chars_kept: int = 0
    files_transcoded: Counter = field(default_factory=Counter)  # encoding read from a BOM -> files
    nul_bytes_removed: int = 0  # NUL bytes inside otherwise text files (past the binary sniff)
    files_with_nul: int = 0
    # compressed files cut short (a partial download): their complete lines before the cut are kept
    files_truncated: int = 0
    truncated_examples: list[str] = field(default_factory=list)

    def skip_file(self, path: Path, reason: str) -> None:
        self.files_skipped[reason] += 1
        self.skipped_examples.setdefault(reason, [])
        if len(self.skipped_examples[reason]) < 5:
            self.skipped_examples[reason].append(str(path))

    def truncated_file(self, path: Path) -> None:
        self.files_truncated += 1
        if len(self.truncated_examples) < 5:
            self.truncated_examples.append(str(path))

    def to_dict(self) -> dict:
        return {
            "files_read": self.files_read,
            "files_skipped": dict(self.files_skipped),
            "skipped_examples": self.skipped_examples,
            "docs_read": self.docs_read,
            "docs_dropped": dict(self.docs_dropped),
            "docs_kept": self.docs_kept,
            "chars_kept": self.chars_kept,
            "files_transcoded": dict(self.files_transcoded),
            "nul_bytes_removed": self.nul_bytes_removed,
            "files_with_nul": self.files_with_nul,
            "files_truncated": self.files_truncated,
            "truncated_examples": self.truncated_examples,
        }


def aclsum_dir() -> Path:
    """Locate the aclsum wheel's data folder without importing the package (it needs `sienna`)."""
    from importlib.util import find_spec

    spec = find_spec("aclsum")
    if spec is None or not spec.submodule_search_locations:
        raise CorpusError("the embedded corpus needs the `aclsum` package: pip install aclsum==0.1.2")
    return Path(list(spec.submodule_search_locations)[0]) / "dataset"


def aclsum_split_ids(split: str) -> set[str]:
    """Paper ids of one split of the aclsum summarisation benchmark."""
    path = aclsum_dir() / f"{split}.jsonl"
    with path.open(encoding="utf-8") as f:
        return {json.loads(line)["id"] for line in f if line.strip()}


def aclsum_paper_text(paper: dict) -> str:
    """Title, abstract and body paragraphs of an S2ORC-style paper, paragraphs separated by
    blank lines; section headings kept, since a model of scientific text should see them."""
    parts: list[str] = []
    if paper.get("title"):
        parts.append(paper["title"])
    if paper.get("abstract"):
        parts.append(paper["abstract"])
    last_section = None
    for para in (paper.get("pdf_parse") or {}).get("body_text", []):
        section = para.get("section")
        if section and section != last_section:
            parts.append(section)
            last_section = section
        if para.get("text"):
            parts.append(para["text"])
    return "\n\n".join(parts)


# Longest first: a UTF-32-LE BOM begins with the UTF-16-LE one.
_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF8, "utf-8-sig"),
         (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))


def _read_bytes_as_text(path: Path, report: CorpusReport) -> str | None:
    """UTF-8, or UTF-16 / UTF-32 where a byte-order mark says so (what Windows tools write). A file
    with NUL bytes in its first 8 KiB is binary; NUL bytes further in are dropped and counted."""
    try:
        raw = path.read_bytes()
    except OSError as err:
        report.skip_file(path, f"unreadable ({err.__class__.__name__})")
        return None
    if not raw:
        report.skip_file(path, "empty file")
        return None
    encoding = next((enc for bom, enc in _BOMS if raw.startswith(bom)), None)
    if encoding not in (None, "utf-8-sig"):
        try:
            text = raw.decode(encoding)
        except UnicodeDecodeError:
            report.skip_file(path, f"not {encoding.upper()} (though it starts with its byte-order mark)")
            return None
        report.files_transcoded[encoding.upper()] += 1
        return text
    if b"\x00" in raw[:8192]:
        report.skip_file(path, "binary file")
        return None
    nul = raw.count(b"\x00")
    if nul:
        report.nul_bytes_removed += nul
        report.files_with_nul += 1
        raw = raw.replace(b"\x00", b"")
    try:
        return raw.decode(encoding or "utf-8")
    except UnicodeDecodeError:
        report.skip_file(path, "not UTF-8")
        return None


def _iter_jsonl(path: Path, text_field: str, report: CorpusReport) -> Iterator[Document]:
    text = _read_bytes_as_text(path, report)
    if text is None:
        return
    report.files_read += 1
    stripped = text.lstrip()
    if path.suffix == ".json" and stripped.startswith("{") and "\n{" not in stripped:
        lines = [stripped]  # a single JSON document (e.g. one S2ORC paper per file)
    else:
        lines = text.splitlines()
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            report.docs_dropped["bad JSON line"] += 1
            continue
        if isinstance(obj, dict) and "pdf_parse" in obj and text_field not in obj:
            value = aclsum_paper_text(obj)
        else:
            value = obj.get(text_field) if isinstance(obj, dict) else None
        if not isinstance(value, str):
            report.docs_dropped[f"no string field {text_field!r}"] += 1
            continue
        yield Document(f"{path}:{lineno}", value)


def _iter_parquet(path: Path, text_field: str, report: CorpusReport) -> Iterator[Document]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path, columns=[text_field])
    except (OSError, ValueError, KeyError) as err:  # pyarrow raises ArrowInvalid (a ValueError)
        reason = "no such column" if "No match for FieldRef" in str(err) else "unreadable parquet"
        report.skip_file(path, f"{reason} ({text_field!r})" if reason == "no such column" else reason)
        return
    report.files_read += 1
    for row, value in enumerate(table.column(text_field).to_pylist()):
        if not isinstance(value, str):
            report.docs_dropped[f"no string field {text_field!r}"] += 1
            continue
        yield Document(f"{path}#{row}", value)


def _iter_text(path: Path, report: CorpusReport) -> Iterator[Document]:
    text = _read_bytes_as_text(path, report)
    if text is None:
        return
    report.files_read += 1
    yield Document(str(path), text)


def _format_of(path: Path, declared: str) -> str | None:
    if declared != "auto":
        return declared
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    if suffix in TEXT_SUFFIXES:
        return "txt"
    return None


def _walk(root: Path, report: CorpusReport | None) -> list[Path]:
    """Every file under `root`, following symlinks, each directory once: a link back to a directory
    already walked (a loop) is skipped and counted, like a broken link."""
    seen: set[tuple[int, int]] = set()
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        st = os.stat(dirpath)
        if (st.st_dev, st.st_ino) in seen:
            if report is not None:
                report.skip_file(Path(dirpath), "symlink loop (directory already read)")
            dirnames[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in filenames:
            p = Path(dirpath) / name
            if name.startswith("."):
                continue
            if p.is_file():
                files.append(p)
            elif report is not None:
                report.skip_file(p, "broken symlink" if p.is_symlink() else "not a regular file")
    return sorted(files)


def source_files(source: SourceConfig, report: CorpusReport | None = None) -> list[Path]:
    """The files a source names, sorted so that the corpus order never depends on the file system."""
    if source.type == "aclsum":
        excluded: set[str] = set()
        for split in source.exclude_splits:
            excluded |= aclsum_split_ids(split)
        papers = sorted((aclsum_dir() / "paper_jsons").glob("*.json"))
        return [p for p in papers if p.stem not in excluded]
    path = Path(source.path).expanduser()
    if not path.exists():
        raise CorpusError(f"data.sources: path does not exist: {path}")
    if path.is_file():
        return [path]
    return _walk(path, report)


def iter_documents(sources: list[SourceConfig], report: CorpusReport) -> Iterator[Document]:
    for source in sources:
        for path in source_files(source, report):
            fmt = "jsonl" if source.type == "aclsum" else _format_of(path, source.format)
            if fmt is None:
                report.skip_file(path, f"unsupported file type ({path.suffix or 'no suffix'})")
            elif fmt == "jsonl":
                yield from _iter_jsonl(path, source.text_field, report)
            elif fmt == "parquet":
                yield from _iter_parquet(path, source.text_field, report)
            else:
                yield from _iter_text(path, report)


_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
# runs of spaces, tabs and no-break spaces become one space; a single space, by far the most common
# match of the plain pattern, is left alone (re.sub builds a piece per match: ~18 bytes a character)
_SPACES = re.compile(r"[ \t\u00a0]{2,}|[\t\u00a0]")
_BLANK_LINES = re.compile(r"\n{3,}")


def clean_text(text: str, normalize: str) -> str:
    """Unicode normalisation (NFKC folds the ligatures and full-width forms PDF extraction leaves),
    control characters removed, runs of spaces collapsed; paragraph breaks kept."""
    if normalize != "none":
        text = unicodedata.normalize(normalize, text)
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _CONTROL.sub("", text)
    if "  " in text or "\t" in text or "\u00a0" in text:  # else nothing matches: skip the scan (~50 MB/s)
        text = _SPACES.sub(" ", text)  # no match spans a newline, so the whole text at once
    text = "\n".join(line.strip() for line in text.split("\n"))
    return _BLANK_LINES.sub("\n\n", text).strip()


def read_corpus(cfg: DataConfig) -> tuple[list[Document], CorpusReport]:
    """All kept documents, cleaned and exact-deduplicated (by SHA-1 of the cleaned text)."""
    report = CorpusReport()
    seen: set[bytes] = set()
    docs: list[Document] = []
    for doc in iter_documents(cfg.sources, report):
        report.docs_read += 1
        text = clean_text(doc.text, cfg.normalize)
        if not text:
            report.docs_dropped["empty"] += 1
            continue
        if len(text) < cfg.min_chars:
            report.docs_dropped[f"shorter than min_chars={cfg.min_chars}"] += 1
            continue
        digest = hashlib.sha1(text.encode("utf-8")).digest()
        if digest in seen:
            report.docs_dropped["exact duplicate"] += 1
            continue
        seen.add(digest)
        docs.append(Document(doc.doc_id, text))
        report.docs_kept += 1
        report.chars_kept += len(text)
    return docs, report
