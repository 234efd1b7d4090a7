"""Byte-level BPE tokenizer (Hugging Face `tokenizers`), as GPT-NeoX and FORGE use.

Byte-level means no unknown tokens: any UTF-8 input round-trips exactly, which matters for
scientific text full of formulae, units and symbols.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from hetforge.core.errors import HetforgeError

EOT = "<|endoftext|>"
PAD = "<|padding|>"
SPECIAL_TOKENS = [EOT, PAD]


class TokenizerError(HetforgeError, ValueError):
    pass


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_tokenizer(path: str | Path) -> Tokenizer:
    path = Path(path)
    if not path.is_file():
        raise TokenizerError(f"tokenizer file not found: {path}")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception on a malformed file
        raise TokenizerError(f"{path}: not a valid tokenizer.json ({err})") from None
    if tok.token_to_id(EOT) is None:
        raise TokenizerError(f"{path}: the tokenizer has no {EOT} token, needed between documents")
    return tok


def tokenizer_hash(path: str | Path) -> str:
    if not Path(path).is_file():
        raise TokenizerError(f"data.tokenizer.path: tokenizer file not found: {path}")
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def token_dtype(vocab_size: int) -> str:
    """uint16 halves shard size whenever the vocabulary allows it."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    # The GPT-2 byte <-> printable-character map that byte-level BPE uses for its vocabulary.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_byte_lengths(tok: Tokenizer) -> list[int]:
    """UTF-8 bytes each token id stands for (0 for special tokens): the denominator of
    bits-per-byte, which compares models with different tokenizers fairly."""
    table = _unicode_to_byte()
    specials = set(SPECIAL_TOKENS)
    lengths = [0] * tok.get_vocab_size()
    for token, idx in tok.get_vocab().items():
        if token in specials or idx >= len(lengths):
            continue
        lengths[idx] = sum(1 for ch in token if ch in table)
    return lengths
