"""TextStream: stop strings cut the text before them, a streamed chunk never ends in an
incomplete UTF-8 character nor in what could still become a stop string."""

from __future__ import annotations

from strata.engine.detokenizer import TextStream


class ByteTokenizer:
    """Token i is byte i; decoding replaces an incomplete UTF-8 sequence with U+FFFD."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def feed(stream: TextStream, data: bytes, finish_at_end: bool = True) -> list[str]:
    ids, chunks = [], []
    for i, b in enumerate(data):
        ids.append(b)
        if stream.stop_hit(ids):
            chunks.append(stream.advance(ids, True))
            return chunks
        chunks.append(stream.advance(ids, finish_at_end and i == len(data) - 1))
    return chunks


def test_stop_string_cuts_the_text_and_is_never_streamed():
    s = TextStream(ByteTokenizer(), stop=["END"], stream=True)
    chunks = feed(s, b"abcENDxyz")
    assert "".join(chunks) == "abc" and s.text == "abc" and s.stopped
    assert all("E" not in c for c in chunks)


def test_what_could_still_start_a_stop_string_is_held_back():
    s = TextStream(ByteTokenizer(), stop=["END"], stream=True)
    ids = []
    streamed = []
    for b in b"abEN":
        ids.append(b)
        assert not s.stop_hit(ids)
        streamed.append(s.advance(ids, False))
    assert "".join(streamed) == "ab"  # "EN" could still become "END"
    ids.append(ord("!"))
    assert not s.stop_hit(ids)
    assert s.advance(ids, False) == "E"  # the last len("END") - 1 chars always wait
    assert s.advance(ids, True) == "N!"


def test_split_utf8_character_is_held_back():
    s = TextStream(ByteTokenizer(), stream=True)
    data = "aé".encode()  # é is two bytes
    ids = [data[0], data[1]]
    first = s.advance(ids, False)
    assert "\ufffd" not in first  # the half character waits
    ids.append(data[2])
    assert first + s.advance(ids, True) == "aé" == s.text


def test_not_streaming_keeps_the_text_only():
    s = TextStream(ByteTokenizer(), stream=False)
    assert s.advance(list(b"hi"), True) == "" and s.text == "hi"
