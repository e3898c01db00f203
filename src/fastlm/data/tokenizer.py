"""Tokenizers for `fastlm data prepare --tokenizer SPEC`:

    bytes        ids 0..255 are the text's UTF-8 bytes; 256 marks a document boundary: vocabulary 257
    gpt2         tiktoken's "gpt2" encoding, 50257 ids; <|endoftext|> (50256) marks a document boundary.
                 tiktoken downloads its tables on first use: without a network (and no cached
                 copy) that is a one-line error
    PATH.json    a Hugging Face `tokenizers` file (tokenizer.json); the first of END_OF_TEXT it holds
                 marks a document boundary
    bpe:VOCAB    a byte-level BPE of VOCAB ids (GPT-2's pre-tokenizer and byte alphabet, <|endoftext|>
                 first), trained on the input by `tokenizers` without a network

The last two need the `tokenizers` package (`pip install "fastlm[tokenizers]"`); `prepare` saves
their tokenizer.json with the data. `encode` never treats text as a special token (a document that
contains "<|endoftext|>" is encoded as those characters); only `prepare` writes the boundary id,
before every document.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TOKENIZERS = ("bytes", "gpt2")  # the named tokenizers; a PATH.json and bpe:VOCAB are the others
END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
BPE_PREFIX = "bpe:"
MIN_BPE_VOCAB = 258  # 256 bytes, <|endoftext|> and one merge
TOKENIZERS_PACKAGE = 'the tokenizers package (pip install "fastlm[tokenizers]")'


@dataclass(frozen=True)
class Tokenizer:
    name: str
    vocab_size: int
    eot: int  # the id written before every document
    encode: Callable[[str], np.ndarray]  # text -> (n,) token ids
    # whether a document must be encoded at once: a pre-tokenizer that, say, adds a space at the start
    # of its input would give other ids at the cuts between pieces
    whole_documents: bool = False
    json: str | None = None  # the `tokenizers` file, saved with the data


def tokenizer_spec(text: str) -> str:
    """argparse type of --tokenizer: a named tokenizer, bpe:VOCAB or an existing file."""
    if text in TOKENIZERS:
        return text
    if text.startswith(BPE_PREFIX):
        vocab = text.removeprefix(BPE_PREFIX)
        if not (vocab.isdigit() and int(vocab) >= MIN_BPE_VOCAB):
            raise argparse.ArgumentTypeError(
                f"expected bpe:VOCAB with VOCAB an integer of at least {MIN_BPE_VOCAB} "
                f"(256 bytes, <|endoftext|> and one merge), got {text!r}"
            )
        return text
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(
            f"expected {', '.join(TOKENIZERS)}, bpe:VOCAB or a tokenizer.json file, got {text!r}"
        )
    return text


def tokenizer_name(spec: str) -> str:
    """What the manifest and a run's configuration call the tokenizer of ``spec``, found without
    loading it: the spec itself, or for a file "hf:" and the start of its sha256."""
    if spec in TOKENIZERS or spec.startswith(BPE_PREFIX):
        return spec
    return f"hf:{hashlib.sha256(Path(spec).read_bytes()).hexdigest()[:16]}"


def default_tokenizer() -> str:
    """gpt2 where tiktoken is installed, else bytes."""
    return "gpt2" if importlib.util.find_spec("tiktoken") is not None else "bytes"


def load_tokenizer(spec: str, documents: Callable[[], Iterator[str]] = lambda: iter(())) -> Tokenizer:
    """The tokenizer of ``spec`` (bpe:VOCAB is trained on ``documents()``); ValueError, one
    sentence, for one that cannot be loaded."""
    if spec == "bytes":
        return Tokenizer("bytes", 257, 256, _encode_bytes)
    if spec == "gpt2":
        return _gpt2()
    tokenizer_spec(spec)  # the same sentence as on the command line for a malformed spec
    if spec.startswith(BPE_PREFIX):
        return _from_tokenizers(_train_bpe(int(spec.removeprefix(BPE_PREFIX)), documents), spec, spec)
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError:
        raise ValueError(f"a tokenizer.json needs {TOKENIZERS_PACKAGE}") from None
    try:
        hf = HFTokenizer.from_file(spec)
    except Exception as error:  # the Rust library raises one type for every malformed file
        raise ValueError(f"{spec} is not a tokenizers file: {str(error).splitlines()[0]}") from None
    return _from_tokenizers(hf, tokenizer_name(spec), spec, whole_documents=True)


def _encode_bytes(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def _gpt2() -> Tokenizer:
    try:
        import tiktoken
    except ImportError:
        raise ValueError(
            "gpt2 needs tiktoken (pip install tiktoken); or use bytes, bpe:VOCAB or a tokenizer.json"
        ) from None
    try:
        encoding = tiktoken.get_encoding("gpt2")
    except Exception as error:  # tiktoken downloads its tables on first use; any failure ends the same way
        raise ValueError(
            f"tiktoken cannot load GPT-2's tables (they are downloaded on first use: offline?): "
            f"{str(error).splitlines()[0]}; use bytes, bpe:VOCAB or a tokenizer.json "
            "instead"
        ) from None

    def encode(text: str) -> np.ndarray:
        return np.asarray(encoding.encode_ordinary(text), dtype=np.uint32)

    return Tokenizer("gpt2", encoding.n_vocab, encoding.eot_token, encode)


def _train_bpe(vocab_size: int, documents: Callable[[], Iterator[str]]):
    """A byte-level BPE of at most ``vocab_size`` ids trained on ``documents()`` (fewer when the
    text holds fewer pairs worth merging)."""
    try:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise ValueError(f"bpe:VOCAB needs {TOKENIZERS_PACKAGE}") from None
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's: no space added to pieces
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT[0]],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    hf.train_from_iterator(documents(), trainer)
    return hf


def _from_tokenizers(hf, name: str, source: str, whole_documents: bool = False) -> Tokenizer:
    eot = next((hf.token_to_id(t) for t in END_OF_TEXT if hf.token_to_id(t) is not None), None)
    if eot is None:
        raise ValueError(
            f"{source} holds none of the end-of-text tokens {', '.join(END_OF_TEXT)}, one of which "
            "marks where each document starts"
        )
    json = hf.to_str()
    hf.encode_special_tokens = True  # text that spells a special token is encoded as text

    def encode(text: str) -> np.ndarray:
        return np.asarray(hf.encode(text, add_special_tokens=False).ids, dtype=np.uint32)

    return Tokenizer(name, hf.get_vocab_size(with_added_tokens=True), eot, encode, whole_documents, json)
