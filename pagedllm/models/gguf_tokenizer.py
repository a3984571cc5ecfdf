"""The transformers tokenizer of a GGUF file, built from the header the loader has already parsed.

transformers builds a GGUF file's tokenizer from its metadata (``get_gguf_tokenizer``), which it
reads with its own reader: a call per vocabulary entry and merge, over a second of a load on a
128k-token vocabulary, for the header ``read_gguf`` has parsed already. While the tokenizer is built
here, that reader answers for this file with the parsed metadata; everything transformers does
with it (which tokenizer class, special tokens, BOS / EOS flags, chat template) stays its own, so the
tokenizer is the one it builds from the file. Another file, or a transformers whose layout differs,
goes through transformers' reader as before.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from pagedllm.models.gguf_loader import GGUFFile, read_gguf


def load_gguf_tokenizer(path: str) -> Any:
    """``PreTrainedTokenizerFast`` of the GGUF file ``path``."""
    from transformers import PreTrainedTokenizerFast

    folder, name = os.path.split(path)
    with _metadata_from(read_gguf(path)):
        # The fast tokenizer class directly: AutoTokenizer would first read the whole GGUF for its
        # config, then build the same tokenizer.
        return PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name, local_files_only=True)


@contextlib.contextmanager
def _metadata_from(gguf_file: GGUFFile) -> Iterator[None]:
    """transformers' GGUF metadata reader answering for ``gguf_file`` from its parsed header."""
    try:
        from transformers.integrations.gguf import reader
    except ImportError:
        yield
        return
    original = getattr(reader, "read_gguf_metadata", None)
    if original is None:
        yield
        return

    def read_gguf_metadata(gguf_path: str, string_arrays: Any = ()) -> tuple[dict[str, Any], tuple[str, ...]]:
        if not _same_file(gguf_path, gguf_file.path):
            return original(gguf_path, string_arrays)
        # Copies of the lists: the header is shared, and a tokenizer builder may edit what it is given.
        metadata = {key: list(value) if isinstance(value, list) else value
                    for key, value in gguf_file.metadata.items()}
        return metadata, tuple(gguf_file.tensors)

    reader.read_gguf_metadata = read_gguf_metadata
    try:
        yield
    finally:
        reader.read_gguf_metadata = original


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
