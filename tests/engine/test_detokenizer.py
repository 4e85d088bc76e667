"""IncrementalDetokenizer: incremental text equals a full decode, multi-byte characters come
out whole, stop strings are found across token boundaries and cut, and the hold-back never
hands out what a stop string will take back."""

from __future__ import annotations

import random

import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from keel.engine.detokenizer import (
    FastIncrementalDetokenizer,
    IncrementalDetokenizer,
    SlowIncrementalDetokenizer,
)
from keel.request import Request
from keel.sampling_params import SamplingParams
from tests.hf_models import make_tokenizer

BOS, EOS = 0, 1  # make_tokenizer's special tokens
ALPHABET = list("abcdefgh  .,!TS") + ["é", "漢", "😀", "ß", "\n"]


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def make_request(prompt_ids: list[int], **params) -> Request:
    return Request("r", list(prompt_ids), SamplingParams(**params))


def detok(tokenizer, prompt_ids=(40,), **params) -> IncrementalDetokenizer:
    return IncrementalDetokenizer.from_new_request(tokenizer, make_request(prompt_ids, **params))


def feed(d: IncrementalDetokenizer, ids: list[int]) -> str | None:
    """Feed one token at a time, as decoding does; returns the stop string if one matched."""
    for i in ids:
        stop = d.update([i], False)
        if stop is not None:
            return stop
    return None


def byte_chars() -> dict[int, str]:
    """The byte -> printable character map of byte-level BPE (GPT-2's): printable Latin-1
    bytes stand for themselves, the others are shifted past 255."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in keep:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def cross_boundary_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Byte-level BPE whose merges straddle character boundaries, so a token can end in the
    middle of a character and the next one complete it *and* start another:
    "漢漢" -> [E6 BC] [A2 E6] [BC A2], "éx" -> [C3] [A9 'x']."""
    m = byte_chars()
    vocab = {"<s>": 0, "</s>": 1}
    for b in range(256):
        vocab[m[b]] = len(vocab)
    merges = [(m[0xA2], m[0xE6]), (m[0xE6], m[0xBC]), (m[0xBC], m[0xA2]), (m[0xA9], "x")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>",
                                                eos_token="</s>")


def metaspace_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """SentencePiece-style: a word's leading space is part of its token ("▁world") and a
    decode drops the space of its first token, so output text is only right with context."""
    words = ["▁Hello", "▁world", "!", "▁the", "▁end"]
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=True)
    backend.decoder = decoders.Metaspace(prepend_scheme="first")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>",
                                                eos_token="</s>", unk_token="<unk>")


class ByteTokenizer(transformers.PreTrainedTokenizer):
    """A slow (pure Python) tokenizer: one token per UTF-8 byte, so every non-ASCII character
    spans several tokens."""

    def __init__(self, **kwargs):
        self._vocab = {"<s>": 0, "</s>": 1, **{f"<0x{b:02X}>": b + 2 for b in range(256)}}
        self._ids = {i: t for t, i in self._vocab.items()}
        super().__init__(bos_token="<s>", eos_token="</s>", **kwargs)

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)

    def _tokenize(self, text, **kwargs):
        return [f"<0x{b:02X}>" for b in text.encode()]

    def _convert_token_to_id(self, token):
        return self._vocab[token]

    def _convert_id_to_token(self, index):
        return self._ids[index]

    def convert_tokens_to_string(self, tokens):
        parts, buf = [], bytearray()
        for t in tokens:
            if t.startswith("<0x"):
                buf.append(int(t[3:5], 16))
            else:
                parts += [buf.decode(errors="replace"), t]
                buf = bytearray()
        parts.append(buf.decode(errors="replace"))
        return "".join(parts)


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(n))


# ---- which detokenizer ------------------------------------------------------------------------


def test_no_tokenizer_or_no_detokenize_tracks_ids_only(tok):
    for d in (detok(None), detok(tok, detokenize=False)):
        assert type(d) is IncrementalDetokenizer
        assert d.update([50, 51], False) is None
        assert d.update([EOS], True) is None
        assert d.output_token_ids == [50, 51, EOS] and d.num_output_tokens() == 3
        assert d.output_text == "" and d.get_next_output_text(True, False) == ""


def test_fast_tokenizer_uses_decode_stream_and_falls_back(tok):
    assert type(detok(tok)) is FastIncrementalDetokenizer
    assert type(detok(tok, spaces_between_special_tokens=False)) is SlowIncrementalDetokenizer
    assert type(detok(ByteTokenizer())) is SlowIncrementalDetokenizer


# ---- text ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("spaces", [True, False])
def test_incremental_equals_full_decode(tok, skip, spaces):
    rng = random.Random(1234)
    for _ in range(150):
        prompt = tok.encode(random_text(rng, rng.randrange(1, 12)))
        out: list[int] = []
        for _ in range(rng.randrange(1, 6)):
            out += tok.encode(random_text(rng, rng.randrange(1, 8)))
            if rng.random() < 0.3:
                out.append(rng.choice([BOS, EOS]))
        d = detok(tok, prompt, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
        i = 0
        while i < len(out):  # several tokens per step too (e.g. speculative decoding)
            k = rng.randrange(1, 4)
            d.update(out[i:i + k], False)
            i += k
        assert d.output_text == tok.decode(out, skip_special_tokens=skip)
        assert d.output_token_ids == out


@pytest.mark.parametrize("spaces", [True, False])
def test_multibyte_characters_split_over_byte_tokens_come_out_whole(tok, spaces):
    text = "aé漢😀b"
    ids = tok.encode(text)
    assert len(ids) > len(text)  # really split: each non-ASCII byte is a token here
    d = detok(tok, spaces_between_special_tokens=spaces)
    for i in ids:
        d.update([i], False)
        assert "\ufffd" not in d.output_text
    assert d.output_text == text


@pytest.mark.parametrize("spaces", [True, False])
def test_tokens_that_end_mid_character_and_start_the_next(spaces):
    t = cross_boundary_tokenizer()
    ids = t.encode("漢漢")
    assert [len(t.convert_ids_to_tokens(i)) for i in ids] == [2, 2, 2]
    d = detok(t, t.encode("ab"), spaces_between_special_tokens=spaces)
    seen = []
    for i in ids:
        d.update([i], False)
        seen.append(d.output_text)
    # The second token completes one character and starts another: nothing is handed out
    # until the text no longer ends inside a character.
    assert seen == ["", "", "漢漢"]
    ids = t.encode("éxé")
    d = detok(t, t.encode("ab"), spaces_between_special_tokens=spaces)
    assert feed(d, ids) is None and d.output_text == "éxé"


def test_slow_tokenizer_multibyte_and_special_tokens():
    t = ByteTokenizer()
    text = "né 漢😀!"
    ids = [BOS, *t.encode(text, add_special_tokens=False), EOS]
    for skip in (True, False):
        d = detok(t, t.encode("hi", add_special_tokens=False), skip_special_tokens=skip)
        for i in ids:
            d.update([i], False)
            assert "\ufffd" not in d.output_text
        assert d.output_text == t.decode(ids, skip_special_tokens=skip)
    assert d.output_text == "<s>" + text + "</s>"


@pytest.mark.parametrize("spaces", [True, False])
def test_first_output_token_keeps_its_leading_space(spaces):
    t = metaspace_tokenizer()
    prompt = t.convert_tokens_to_ids(["▁Hello"])
    out = t.convert_tokens_to_ids(["▁world", "!"])
    assert t.decode(out) == "world!"  # a bare decode loses the space...
    d = detok(t, prompt, spaces_between_special_tokens=spaces)
    feed(d, out)
    assert d.output_text == " world!"  # ...the prompt-primed detokenizer keeps it


# ---- stop strings -------------------------------------------------------------------------------


def test_stop_string_split_across_tokens_is_cut(tok):
    ids = tok.encode("Hello world. More text")
    d = detok(tok, stop=["ld. M"])
    assert len(tok.encode("ld. M")) > 1
    assert feed(d, ids) == "ld. M"
    assert d.output_text == "Hello wor"
    assert d.get_next_output_text(finished=True, delta=False) == "Hello wor"


def test_stop_string_kept_with_include_stop_str_in_output(tok):
    ids = tok.encode("Hello world. More text")
    d = detok(tok, stop=["world."], include_stop_str_in_output=True)
    stop = None
    for i in ids:
        stop = d.update([i], False)
        if stop:
            break
    assert stop == "world."
    assert d.output_text == "Hello world."


def test_stop_string_cut_mid_token_with_include(tok):
    d = detok(tok, stop=["wo"], include_stop_str_in_output=True)
    # One step brings "Hello world" at once: the text is cut right after the stop string.
    assert d.update(tok.encode("Hello world"), False) == "wo"
    assert d.output_text == "Hello wo"


def test_earliest_stop_string_wins(tok):
    d = detok(tok, stop=["lazy", "fox"])
    assert d.update(tok.encode("a fox, a lazy dog"), False) == "fox"
    assert d.output_text == "a "


@pytest.mark.parametrize("spaces", [True, False])
def test_stop_string_next_to_multibyte_character(tok, spaces):
    d = detok(tok, stop=["STOP"], spaces_between_special_tokens=spaces)
    assert feed(d, tok.encode("ab漢STOP漢")) == "STOP"
    assert d.output_text == "ab漢"
    # A stop string that is itself multi-byte is found once its last byte arrives.
    d = detok(tok, stop=["漢"], spaces_between_special_tokens=spaces)
    assert feed(d, tok.encode("é漢😀")) == "漢"
    assert d.output_text == "é"
    # The character completed by a cross-boundary token, right before the stop string.
    t = cross_boundary_tokenizer()
    d = detok(t, stop=["x"], spaces_between_special_tokens=spaces)
    assert feed(d, t.encode("aéxb")) == "x"
    assert d.output_text == "aé"


def test_stop_terminated_drops_the_stop_token_text(tok):
    out = tok.encode("Hello") + [EOS]
    d = detok(tok, skip_special_tokens=False)
    assert d.update(out, stop_terminated=True) is None
    assert d.output_text == "Hello" and d.output_token_ids == out
    d = detok(tok, skip_special_tokens=False, include_stop_str_in_output=True)
    d.update(out, stop_terminated=True)
    assert d.output_text == "Hello</s>"
    # A stop token id that is ordinary text is dropped the same way.
    dot = tok.encode(".")
    assert len(dot) == 1
    d = detok(tok)
    d.update(tok.encode("Hi") + dot, stop_terminated=True)
    assert d.output_text == "Hi" and d.output_token_ids[-1] == dot[0]


def test_min_tokens_delays_stop_strings(tok):
    ids = [tok.encode(c)[0] for c in "xaxxaxx"]
    assert len(ids) == 7
    d = detok(tok, stop=["a"], min_tokens=3)
    assert d.update(ids[:3], False) is None  # "xax": an "a" within the first min_tokens
    assert d.update(ids[3:4], False) is None
    assert d.update(ids[4:5], False) == "a"
    assert d.output_text == "xaxx"
    # One step that crosses the min_tokens boundary: only the "a" after it counts.
    d = detok(tok, stop=["a"], min_tokens=3)
    assert d.update(ids[:5], False) == "a"
    assert d.output_text == "xaxx"
    # A stop string that starts inside the first min_tokens and ends after them still counts.
    d = detok(tok, stop=["ab"], min_tokens=2)
    assert d.update([tok.encode(c)[0] for c in "xa"], False) is None
    assert d.update(tok.encode("b"), False) == "ab"
    assert d.output_text == "x"


def test_delta_hold_back_never_leaks_a_stop_prefix(tok):
    rng = random.Random(7)
    stop = "STOP!"
    for _ in range(60):
        parts = [random_text(rng, rng.randrange(0, 5)) + rng.choice(["S", "ST", "STO", "STOP"])
                 for _ in range(rng.randrange(1, 5))]
        text = "".join(parts) + stop + random_text(rng, 4)
        final = text[:text.index(stop)]
        d = detok(tok, stop=[stop])
        sent, matched = "", None
        for i in tok.encode(text):
            matched = d.update([i], False)
            if matched:
                break
            sent += d.get_next_output_text(finished=False, delta=True)
            assert final.startswith(sent)  # nothing handed out is ever taken back
            assert final.startswith(d.get_next_output_text(finished=False, delta=False))
            assert len(d.output_text) - len(sent) <= len(stop) - 1
        assert matched == stop
        sent += d.get_next_output_text(finished=True, delta=True)
        assert sent == final == d.output_text


def test_delta_without_stop_strings_hands_out_everything(tok):
    d = detok(tok)
    pieces = []
    for i in tok.encode("Hello world"):
        d.update([i], False)
        pieces.append(d.get_next_output_text(finished=False, delta=True))
    assert "".join(pieces) == "Hello world"
    assert d.get_next_output_text(finished=True, delta=True) == ""
