"""Tokenizer handling for `dataloader.prepare`.

Every document is stored as ``BOS tokens EOS``. We add those two ids ourselves
(encoding with ``add_special_tokens=False``) so the stored stream never depends on
a tokenizer's post-processor. A tokenizer we *train* additionally gets a
post-processor that prepends exactly one BOS, plus ``add_bos_token: false`` in
``tokenizer_config.json``: transformers, vLLM and torchtitan's
``HuggingFaceTokenizer`` then all see one BOS at the start of a prompt (the same
as in training) and none of them adds a second one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from itertools import chain
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from common.io import write_bytes_atomic, write_json_atomic
from dataloader.common import token_content

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
MODEL_MAX_LENGTH = 131072
# Split documents longer than this (characters) into pieces before encoding, so a
# single huge document never needs one giant Encoding object in memory.
MAX_ENCODE_CHARS = 1 << 20


def sha256_file(path: str | Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE (GPT-2 style pre-tokenizer, exact round trip)."""
    if vocab_size < 258 + 2:
        raise ValueError(
            f"--train-tokenizer {vocab_size}: a byte-level BPE needs at least 260 tokens "
            "(256 bytes + 2 special tokens); pass a larger vocabulary size"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer


def tokenizer_config(bos_token: str, eos_token: str) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos_token,
        "eos_token": eos_token,
        "model_max_length": MODEL_MAX_LENGTH,
        # The tokenizer.json post-processor already prepends one BOS.
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }


def install_tokenizer(
    source_dir: str | Path | None, trained: Tokenizer | None, out_dir: Path
) -> None:
    """Write DATA/tokenizer/{tokenizer.json,tokenizer_config.json}."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if trained is not None:
        write_bytes_atomic(out_dir / "tokenizer.json", trained.to_str(pretty=True).encode())
        write_json_atomic(out_dir / "tokenizer_config.json", tokenizer_config(BOS_TOKEN, EOS_TOKEN))
        return
    source_dir = Path(source_dir)  # checked by `resolve_tokenizer`: it holds a tokenizer.json
    if source_dir.resolve() != out_dir.resolve():
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (source_dir / name).is_file():
                write_bytes_atomic(out_dir / name, (source_dir / name).read_bytes())
    if not (out_dir / "tokenizer_config.json").is_file():
        ids = load_special_ids(out_dir / "tokenizer.json", None)
        write_json_atomic(out_dir / "tokenizer_config.json", tokenizer_config(*ids[2:]))


def load_tokenizer(tokenizer_json: Path) -> Tokenizer:
    """The tokenizer in `tokenizer_json`; ValueError naming the file when it is not one
    (torn, not JSON: `tokenizers` raises a bare Exception)."""
    try:
        return Tokenizer.from_file(str(tokenizer_json))
    except Exception as e:
        raise ValueError(
            f"{tokenizer_json}: not a Hugging Face tokenizer.json ({e}); restore it, or "
            "prepare the data again with a tokenizer that loads"
        ) from None


def load_special_ids(tokenizer_json: Path, config: dict | None) -> tuple[int, int, str, str]:
    """(bos_id, eos_id, bos_token, eos_token) from tokenizer_config.json or the defaults."""
    tokenizer = load_tokenizer(tokenizer_json)
    config = config or {}
    bos = token_content(config.get("bos_token")) or BOS_TOKEN
    eos = token_content(config.get("eos_token")) or EOS_TOKEN
    bos_id, eos_id = tokenizer.token_to_id(bos), tokenizer.token_to_id(eos)
    if bos_id is None or eos_id is None:
        raise ValueError(
            f"{tokenizer_json}: BOS {bos!r} / EOS {eos!r} are not in the vocabulary; set "
            "bos_token and eos_token in tokenizer_config.json beside it"
        )
    return bos_id, eos_id, bos, eos


def _split_long(text: str, max_chars: int) -> Iterator[str]:
    """Cut `text` into pieces of about `max_chars`, each cut placed just before a
    space that follows a non-space, where the byte-level pre-tokenizer splits
    anyway, so the pieces encode to the same ids as the whole."""
    start = 0
    while len(text) - start > max_chars:
        cut = text.rfind(" ", start + max_chars // 2, start + max_chars)
        while cut > start and (
            text[cut - 1].isspace() or cut + 1 >= len(text) or text[cut + 1].isspace()
        ):
            cut = text.rfind(" ", start + max_chars // 2, cut)
        if cut <= start:
            cut = start + max_chars  # no clean cut point: the ids may differ, the text does not
        yield text[start:cut]
        start = cut
    yield text[start:]


def encode_documents(
    tokenizer: Tokenizer, texts: list[str], bos_id: int, eos_id: int, dtype: np.dtype
) -> list[np.ndarray]:
    """`BOS ids EOS` for each text as a `dtype` array; long texts are encoded piecewise."""
    short = [i for i, t in enumerate(texts) if len(t) <= MAX_ENCODE_CHARS]
    out: list[np.ndarray | None] = [None] * len(texts)
    encodings = tokenizer.encode_batch([texts[i] for i in short], add_special_tokens=False)
    for i, enc in zip(short, encodings, strict=True):
        out[i] = np.array([bos_id, *enc.ids, eos_id], dtype=dtype)
    for i, text in enumerate(texts):
        if out[i] is None:  # streamed piece by piece: no list of all the ids
            pieces = _split_long(text, MAX_ENCODE_CHARS)
            ids = (tokenizer.encode(p, add_special_tokens=False).ids for p in pieces)
            out[i] = np.fromiter(chain([bos_id], chain.from_iterable(ids), [eos_id]), dtype=dtype)
    return out  # type: ignore[return-value]
