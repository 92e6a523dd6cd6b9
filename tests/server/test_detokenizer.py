"""Streamed text: built piece by piece it equals the whole decode, never shows half a character
(U+FFFD), and never sends what a stop string may still swallow."""
from __future__ import annotations

import pytest

from hybridkv.server.detokenizer import IncrementalDetokenizer, StopHoldback

TEXT = "héllo ✓ 日本 — ok"


@pytest.fixture(scope="module")
def byte_tokenizer():
    """A byte-level tokenizer (one token per UTF-8 byte), built offline: multi-byte characters
    span several tokens, as they do in real BPE vocabularies."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.mark.parametrize("step", [1, 2, 3, 5])
def test_pieces_join_to_the_whole_decode_without_replacement_chars(byte_tokenizer, step):
    ids = byte_tokenizer(TEXT)["input_ids"]
    assert len(ids) > len(TEXT)  # multi-byte characters really are split across tokens
    assert "\ufffd" in byte_tokenizer.decode(ids[1:2])
    d = IncrementalDetokenizer(byte_tokenizer)
    pieces = [d.push(ids[i:i + step]) for i in range(0, len(ids), step)]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == byte_tokenizer.decode(ids) == TEXT


def test_no_tokenizer_gives_no_text():
    assert IncrementalDetokenizer(None).push([1, 2, 3]) == ""


def test_stop_holdback_never_sends_what_a_stop_string_swallows():
    h = StopHoldback(["STOP"])
    sent = "".join(h.push(c) for c in "abcST")
    assert sent == "ab"  # 'cST' could still begin 'STOP'
    assert h.finish("O", final="abc") == "c"  # the engine cut 'STOP': only 'c' is left to send
    h = StopHoldback([])
    assert "".join(h.push(c) for c in "abc") == "abc" and h.finish("d", final=None) == "d"
    h = StopHoldback(["xy"])
    assert h.push("abx") == "ab" and h.finish("z", final="abxz") == "xz"  # not a stop after all
