"""Tokenizers for `fastlm data prepare`: UTF-8 bytes, or GPT-2's BPE through tiktoken.

    bytes  ids 0..255 are the text's UTF-8 bytes; 256 marks a document boundary: vocabulary 257
    gpt2   tiktoken's "gpt2" encoding, 50257 ids; <|endoftext|> (50256) marks a document boundary

`encode` never treats text as a special token (a document that contains "<|endoftext|>" is
encoded as those characters); only `prepare` writes the boundary id, before every document.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

TOKENIZERS = ("bytes", "gpt2")


@dataclass(frozen=True)
class Tokenizer:
    name: str
    vocab_size: int
    eot: int  # the id written before every document
    encode: Callable[[str], np.ndarray]  # text -> (n,) token ids


def _encode_bytes(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def default_tokenizer() -> str:
    """gpt2 where tiktoken is installed, else bytes."""
    return "gpt2" if importlib.util.find_spec("tiktoken") is not None else "bytes"


def load_tokenizer(name: str) -> Tokenizer:
    """The tokenizer ``name``; ValueError for an unknown name or a gpt2 request without tiktoken."""
    if name == "bytes":
        return Tokenizer("bytes", 257, 256, _encode_bytes)
    if name != "gpt2":
        raise ValueError(f"unknown tokenizer {name!r}; choose from {', '.join(TOKENIZERS)}")
    try:
        import tiktoken
    except ImportError:
        raise ValueError("the gpt2 tokenizer needs tiktoken (pip install tiktoken); or use bytes") from None
    try:
        encoding = tiktoken.get_encoding("gpt2")
    except Exception as error:  # tiktoken downloads the BPE tables on first use; any failure ends the same way
        raise ValueError(f"tiktoken cannot load the gpt2 encoding: {str(error).splitlines()[0]}") from None

    def encode(text: str) -> np.ndarray:
        return np.asarray(encoding.encode_ordinary(text), dtype=np.uint32)

    return Tokenizer("gpt2", encoding.n_vocab, encoding.eot_token, encode)
