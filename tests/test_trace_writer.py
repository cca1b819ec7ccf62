"""TraceWriter: where events go, and that an inactive writer costs the engine nothing."""

from __future__ import annotations

import io

import pytest

from strata.trace import TraceWriter


def test_inactive_writer_returns_nothing_and_keeps_nothing():
    t = TraceWriter()
    t.keep = False
    assert not t.active
    assert t.emit("finish", req="a", reason="length", tokens=3) is None
    assert t.events == []


def test_listener_sees_checked_events_without_keeping_them():
    t = TraceWriter()
    t.keep = False
    seen = []
    t.listener = lambda ev, f: seen.append((ev, f["req"]))
    assert t.active
    assert t.emit("finish", req="a", reason="length", tokens=3) is None
    assert seen == [("finish", "a")] and t.events == []
    with pytest.raises(ValueError, match="lacks"):
        t.emit("finish", req="b")  # an active writer still checks the fields


def test_stream_and_keep_both_receive_the_same_record():
    buf = io.StringIO()
    t = TraceWriter(stream=buf)
    rec = t.emit("finish", req="a", reason="stop", tokens=1)
    assert t.events == [rec] and '"ev":"finish"' in buf.getvalue()
