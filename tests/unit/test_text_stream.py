"""Tokens to text: nothing released that could still change, and no part of a stop sequence."""
from __future__ import annotations

from frontend.text_stream import TextStream


class CharTokenizer:
    """Each token is a character code; 0xFFFD stands for a byte that completes only with the next token."""

    def decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        text = "".join(chr(t) for t in tokens)
        # A lone 0xFFFD before a 0x301 combines into "é" once the second half arrives.
        return text.replace("\ufffd\u0301", "é")


def feed(stream: TextStream, text: str) -> str:
    return "".join(stream.push(ord(c)) for c in text) + stream.finish()


def test_without_stops_everything_is_released_in_order():
    s = TextStream(CharTokenizer())
    assert feed(s, "hello world") == "hello world" and not s.stopped


def test_a_stop_sequence_ends_the_text_before_it_and_is_never_released():
    s = TextStream(CharTokenizer(), ["END"])
    released = [s.push(ord(c)) for c in "abc EN"]
    assert "".join(released) == "abc "  # "EN" could start "END": held back
    assert s.push(ord("D")) == "" and s.stopped
    assert s.text == "abc " and s.finish() == ""


def test_held_text_that_was_not_a_stop_is_released():
    s = TextStream(CharTokenizer(), ["END"])
    assert feed(s, "an ENvelope") == "an ENvelope" and not s.stopped


def test_the_earliest_of_several_stops_wins():
    s = TextStream(CharTokenizer(), ["\n\n", "."])
    assert feed(s, "one. two\n\n") == "one" and s.stopped


def test_an_incomplete_character_waits_for_its_second_half():
    s = TextStream(CharTokenizer())
    assert s.push(ord("a")) == "a"
    assert s.push(0xFFFD) == ""
    assert s.push(0x301) == "é"
