import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hetforge.config import DataConfig, SourceConfig
from hetforge.data.corpus import CorpusError, clean_text, read_corpus
from hetforge.data.prepare import PrepareError, prepare
from hetforge.data.shards import PackedSamples, SampleOrder, ShardError, TokenShard, read_doc_ids
from hetforge.data.tokenizer import EOT, PAD, load_tokenizer, token_byte_lengths, token_dtype, train_bpe

PARA = ("The {a} constant of the {m} was measured at {t} K by {b} diffraction; the {c} gap {d} as "
        "temperature rises, consistent with {e} coupling in {f} samples. ")
WORDS = ["lattice", "perovskite", "spinel", "garnet", "olivine", "wurtzite", "zincblende", "rutile", "anatase",
         "fluorite", "pyrochlore", "brookite", "corundum", "magnetite", "hematite", "ilmenite", "kesterite", "neutron",
         "electron", "band", "mobility", "shrinks", "widens", "saturates", "oscillates", "spin-orbit", "exchange",
         "dipolar", "hyperfine", "Rashba", "annealed", "quenched", "sintered", "epitaxial", "polycrystalline"]


def _doc(i: int, n: int = 6) -> str:
    """Distinct documents (in letters: near-duplicate detection folds digits)."""
    import random

    rng = random.Random(i)
    return "".join(PARA.format(t=100 + 7 * i + k, **{s: rng.choice(WORDS) for s in "abcdefm"}) for k in range(n))


def _mixed_dir(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    for i in range(4):
        (d / f"paper{i}.txt").write_text(_doc(i), encoding="utf-8")
    (d / "dup.txt").write_text(_doc(0), encoding="utf-8")  # exact duplicate of paper0
    (d / "short.txt").write_text("too short", encoding="utf-8")
    (d / "empty.txt").write_bytes(b"")
    (d / "binary.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    (d / "latin1.txt").write_bytes("Schrödinger équation très façile ".encode("latin-1") * 20)
    (d / "image.png").write_bytes(b"\x89PNG\x00\x00")
    with (d / "more.jsonl").open("w") as f:
        for i in range(4, 7):
            f.write(json.dumps({"body": _doc(i)}) + "\n")
        f.write("{not json\n")
    pq.write_table(pa.table({"body": [_doc(7), _doc(8)]}), d / "table.parquet")
    (d / "utf16.txt").write_bytes(_doc(9).encode("utf-16"))  # with its BOM, as Windows tools write it
    (d / "utf32.txt").write_bytes(_doc(10).encode("utf-32"))
    (d / "nul.txt").write_bytes(_doc(11).encode() + b"x" * 9000 + b"\x00\x00tail")  # NULs past the sniff
    (d / "sub").mkdir()
    (d / "sub" / "loop").symlink_to(d, target_is_directory=True)  # a symlink loop
    (d / "dangling.txt").symlink_to(d / "nowhere.txt")
    return d


def test_bad_files_are_skipped_and_counted(tmp_path):
    d = _mixed_dir(tmp_path)
    cfg = DataConfig(sources=[SourceConfig(path=str(d), text_field="body")], out_dir=str(tmp_path / "out"),
                     tokenizer={"vocab_size": 300}, min_chars=100)
    res = prepare(cfg, progress=False)
    r = res.meta["report"]
    assert r["files_skipped"] == {"empty file": 1, "binary file": 1, "not UTF-8": 1,
                                  "unsupported file type (.png)": 1, "symlink loop (directory already read)": 1,
                                  "broken symlink": 1}
    assert r["files_transcoded"] == {"UTF-16": 1, "UTF-32": 1}
    assert (r["nul_bytes_removed"], r["files_with_nul"]) == (2, 1)
    assert r["docs_dropped"]["exact duplicate"] == 1
    assert r["docs_dropped"]["shorter than min_chars=100"] == 1
    assert r["docs_dropped"]["bad JSON line"] == 1
    assert r["docs_kept"] == 12  # 4 txt + 3 jsonl + 2 parquet + UTF-16 + UTF-32 + the one with NULs
    total_docs = sum(s["documents"] for s in res.meta["splits"].values())
    assert total_docs == 12
    assert TokenShard(res.out_dir, "train").num_tokens > 0


def test_missing_corpus_path_is_named(tmp_path):
    missing = tmp_path / "no-such-dir"
    cfg = DataConfig(sources=[SourceConfig(path=str(missing))], out_dir=str(tmp_path / "out"))
    with pytest.raises(CorpusError, match=str(missing)):
        prepare(cfg, progress=False)


def test_too_few_documents_is_a_clear_error(tmp_path):
    (tmp_path / "one.txt").write_text(_doc(0))
    cfg = DataConfig(sources=[SourceConfig(path=str(tmp_path / "one.txt"))], out_dir=str(tmp_path / "out"))
    with pytest.raises(PrepareError, match="at least 2 are needed"):
        prepare(cfg, progress=False)


def test_clean_text_normalises_unicode_and_whitespace():
    raw = "ﬁne  structure\u00a0 constant\r\n\r\n\r\n\r\nα ≈ 1/137\x07"
    assert clean_text(raw, "NFKC") == "fine structure constant\n\nα ≈ 1/137"
    assert clean_text(raw, "none").startswith("ﬁne")


def test_clean_text_strips_every_line_of_every_unicode_space():
    """Each line: runs of spaces, tabs and no-break spaces made one space, then str.strip(), as the
    line-by-line definition does; checked on random texts over every whitespace character."""
    import random
    import re

    spaces = [chr(c) for c in range(0x110000) if chr(c).isspace()]
    runs = re.compile(r"[ \t\u00a0]{2,}|[\t\u00a0]")

    def by_lines(text: str) -> str:
        text = re.sub(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]", "", text.replace("\r\n", "\n").replace("\r", "\n"))
        text = "\n".join(runs.sub(" ", line).strip() for line in text.split("\n"))
        return re.sub(r"\n{3,}", "\n\n", text).strip()

    rng = random.Random(0)
    alphabet = spaces + ["a", "b", ".", "\n", "\n", "\r\n", "\x07", "é"]
    for _ in range(20_000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24)))
        assert clean_text(text, "none") == by_lines(text), repr(text)


def test_tokenizer_round_trip_and_specials(tmp_path):
    texts = [_doc(i) for i in range(20)]
    tok = train_bpe(texts, vocab_size=400)
    assert tok.token_to_id(EOT) == 0 and tok.token_to_id(PAD) == 1
    sample = "Ψ(x,t) = A·exp(i(kx − ωt)); ΔG° = −RT ln K at 298.15 K — naïve café 🧪\n\ttabs"
    ids = tok.encode(sample).ids
    assert tok.decode(ids) == sample  # byte-level: no unknown tokens, exact round trip
    lengths = token_byte_lengths(tok)
    assert sum(lengths[i] for i in ids) == len(sample.encode("utf-8"))
    tok.save(str(tmp_path / "tok.json"))
    assert load_tokenizer(tmp_path / "tok.json").encode(sample).ids == ids


def test_token_dtype_choice():
    assert token_dtype(65536) == "uint16" and token_dtype(65537) == "uint32"


def test_shards_and_index_reproduce_the_documents(data_dir):
    tok = load_tokenizer(data_dir / "tokenizer.json")
    meta = json.loads((data_dir / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == tok.get_vocab_size()
    docs, _ = read_corpus(DataConfig(sources=[SourceConfig(type="aclsum")]))
    by_id = {d.doc_id: d.text for d in docs}
    for split in ("train", "val"):
        shard = TokenShard(data_dir, split)
        ids = read_doc_ids(data_dir, split)
        assert shard.num_documents == len(ids) == meta["splits"][split]["documents"]
        assert shard.doc_offsets[-1] == shard.num_tokens
        for i in (0, len(ids) - 1):
            assert tok.decode(shard.document(i).tolist()) == by_id[ids[i]]
        ends = shard.doc_offsets[1:] - 1
        assert np.all(np.asarray(shard.tokens[ends]) == meta["eot_id"])
    train_ids = set(read_doc_ids(data_dir, "train"))
    assert not train_ids & set(read_doc_ids(data_dir, "val"))


def test_aclsum_test_split_papers_are_excluded(data_dir):
    from hetforge.data.corpus import aclsum_split_ids

    meta = json.loads((data_dir / "meta.json").read_text())
    used = {p.rsplit("/", 1)[-1].split(".json")[0] for s in meta["splits"] for p in read_doc_ids(data_dir, s)}
    assert len(used) == 150 and not used & aclsum_split_ids("test")


def test_prepare_is_cached_and_rebuilds_on_change(tmp_path):
    d = tmp_path / "c"
    d.mkdir()
    for i in range(3):
        (d / f"{i}.txt").write_text(_doc(i))
    cfg = DataConfig(sources=[SourceConfig(path=str(d))], out_dir=str(tmp_path / "out"), tokenizer={"vocab_size": 300})
    first = prepare(cfg, progress=False)
    mtime = (first.out_dir / "train.bin").stat().st_mtime_ns
    again = prepare(cfg, progress=False)
    assert again.cached and (again.out_dir / "train.bin").stat().st_mtime_ns == mtime
    (d / "3.txt").write_text(_doc(3))
    rebuilt = prepare(cfg, progress=False)
    assert not rebuilt.cached and rebuilt.meta["fingerprint"] != first.meta["fingerprint"]


def test_existing_tokenizer_is_used(tmp_path, data_dir):
    d = tmp_path / "c"
    d.mkdir()
    for i in range(3):
        (d / f"{i}.txt").write_text(_doc(i))
    cfg = DataConfig(sources=[SourceConfig(path=str(d))], out_dir=str(tmp_path / "out"),
                     tokenizer={"path": str(data_dir / "tokenizer.json")})
    res = prepare(cfg, progress=False)
    src = json.loads((data_dir / "meta.json").read_text())
    assert res.meta["tokenizer_sha256"] == src["tokenizer_sha256"]


def test_sample_order_is_deterministic_and_a_permutation_per_epoch():
    a, b, c = SampleOrder(50, seed=1), SampleOrder(50, seed=1), SampleOrder(50, seed=2)
    first = a.indices(0, 150)
    assert first == b.indices(0, 150) and first != c.indices(0, 150)
    for e in range(3):
        assert sorted(first[50 * e: 50 * (e + 1)]) == list(range(50))
    assert first[50:100] != first[:50]  # epochs reshuffle
    assert SampleOrder(50, seed=1).indices(73, 10) == first[73:83]  # random access = resumable


def test_packed_samples_are_shifted_windows(data_dir):
    shard = TokenShard(data_dir, "train")
    samples = PackedSamples(shard, seq_len=16)
    assert len(samples) == (shard.num_tokens - 1) // 16
    s0, s1 = samples[0], samples[1]
    assert s0.shape == (17,) and s0[-1] == s1[0]
    assert samples.batch([3, 5]).shape == (2, 17)


def test_seq_len_larger_than_data_is_a_clear_error(data_dir):
    shard = TokenShard(data_dir, "val")
    with pytest.raises(ShardError, match=r"train\.seq_len=.*larger than the val split allows"):
        PackedSamples(shard, seq_len=shard.num_tokens + 10, split="val")


def test_truncated_shard_is_detected(tmp_path, data_dir):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(data_dir, copy)
    with (copy / "val.bin").open("r+b") as f:
        f.truncate(10)
    with pytest.raises(ShardError, match="truncated"):
        TokenShard(copy, "val")
