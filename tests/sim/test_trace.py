"""The shared trace format: Chrome trace JSON round trip."""
import json
import threading

import pytest

from roundpipe.trace import Trace


def test_round_trip_keeps_workers_names_and_times(tmp_path):
    """Saving and loading a trace keeps each event's worker, name, category, args and times (to 1 us)."""
    t = Trace(metadata={"schedule": "roundpipe"})
    t.add("cuda:0", "F1 mb0", 1.0, 1.5, cat="forward", stage=1)
    t.add("cuda:1", "B1 mb0", 1.5, 2.25, cat="fused")
    path = tmp_path / "t.json"
    t.save(path)
    data = json.loads(path.read_text())
    assert {e["ph"] for e in data["traceEvents"]} == {"M", "X"}
    back = Trace.load(path)
    assert back.workers() == ["cuda:0", "cuda:1"] and back.metadata == {"schedule": "roundpipe"}
    ev = sorted(back.events, key=lambda e: e.start)
    assert [(e.worker, e.name, e.cat) for e in ev] == [("cuda:0", "F1 mb0", "forward"), ("cuda:1", "B1 mb0", "fused")]
    assert ev[0].args == {"stage": 1}
    assert ev[0].start == pytest.approx(0.0) and ev[1].end == pytest.approx(1.25, abs=1e-6)


def test_add_is_thread_safe_and_validates():
    """Concurrent adds lose nothing; an event ending before it starts is rejected."""
    t = Trace()
    threads = [threading.Thread(target=lambda w=w: [t.add(f"w{w}", "x", i, i + 1) for i in range(500)]) for w in range(4)]
    [th.start() for th in threads]
    [th.join() for th in threads]
    assert len(t.events) == 2000
    with pytest.raises(ValueError, match="ends"):
        t.add("w", "bad", 2.0, 1.0)
    with pytest.raises(ValueError, match="not a Chrome trace"):
        Trace.from_chrome({"events": []})
