"""What a stream may release while a stop string could still cut the text."""
from compress.serve.sse import StopHoldback, sse_event


def test_holdback_never_releases_a_possible_stop_prefix():
    hold = StopHoldback(["STOP"])
    assert hold.release("abc", False) == ""          # 3 chars could be "STO"
    assert hold.release("abcdef", False) == "abc"
    assert hold.release("abcdefS", False) == "d"
    # the engine cuts the text at the stop string: what was sent is still a prefix
    assert hold.release("abcdef", True) == "ef"


def test_no_stops_releases_everything():
    hold = StopHoldback([])
    assert hold.release("ab", False) == "ab" and hold.release("abc", True) == "c"


def test_event_format():
    assert sse_event({"a": "é"}) == 'data: {"a":"é"}\n\n'
