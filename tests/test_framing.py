"""The SSE / NDJSON framer (skylb/balancer/framing.py): whole events pass unchanged, garbage is a FramingError,
the stream's last event is recognised. Table-driven; tests/test_bad_input.py fuzzes the same framer."""

from __future__ import annotations

import pytest

from skylb.balancer.framing import FramingError, StreamFramer


@pytest.mark.parametrize("event", [
    b'data: {"type": []}\n\n',  # unhashable where a Responses API event names its type
    b'data: {"type": {"a": 1}}\n\n',
    b'data: {"type": 5}\n\n',
])
def test_an_event_whose_type_is_no_string_is_passed_on_and_does_not_end_the_stream(event):
    """A ``type`` that is no string is no Responses API last event (and no crash: a list is unhashable)."""
    framer = StreamFramer("sse")
    assert framer.feed(event) == event and not framer.done
