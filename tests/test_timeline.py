"""Trace round trip and timeline pictures, for simulated and hand-recorded traces."""
import json

import pytest

from roundpipe.sim import Costs, bubbles, simulate
from roundpipe.sim.timeline import draw, main as timeline_main
from roundpipe.trace import Trace


def test_simulated_trace_round_trip(tmp_path):
    """A simulated trace saved as Chrome JSON loads back with the same events and bubble numbers."""
    r = simulate("roundpipe", Costs.uniform(8, 1e-3, 2e-3, 4e-3, 8e-3, 1e-4), 4, 8)
    trace = r.trace()
    path = tmp_path / "sim.json"
    trace.save(path)
    assert "traceEvents" in json.loads(path.read_text())
    back = Trace.load(path)
    assert sorted(back.workers()) == sorted(trace.workers())
    key = lambda e: (e.worker, e.start, e.name)
    for a, b in zip(sorted(trace.events, key=key), sorted(back.events, key=key)):
        assert (a.worker, a.name, a.cat, a.args) == (b.worker, b.name, b.cat, b.args)
        assert a.start == pytest.approx(b.start, abs=1e-9) and a.end == pytest.approx(b.end, abs=1e-9)
    assert bubbles(back).ratio == pytest.approx(r.bubbles.ratio)


def test_measured_style_trace_bubbles():
    """Bubbles of a trace recorded by hand (no stage args) classify fill, switch, steady and drain."""
    t = Trace()
    t.add("cuda:0", "F1 mb0", 0.0, 1.0, "forward")
    t.add("cuda:0", "F1 mb1", 1.5, 2.5, "forward")   # 0.5 steady (same stage)
    t.add("cuda:0", "B1 mb0", 3.0, 4.0, "backward")  # 0.5 switch
    t.add("cuda:1", "F2 mb0", 1.0, 4.5, "forward")   # 1.0 fill
    b = bubbles(t)
    assert (b.fill, b.steady, b.switch, b.drain) == pytest.approx((1.0, 0.5, 0.5, 0.5))
    assert b.ratio == pytest.approx(2.5 / 9.0)


def test_span_records_host_work():
    """Trace.span records the body of a with-block as one event on the named worker."""
    t = Trace()
    with t.span("cpu:0", "step", "optimizer", iteration=3):
        sum(range(1000))
    (e,) = t.events
    assert e.worker == "cpu:0" and e.cat == "optimizer" and e.args == {"iteration": 3} and e.end >= e.start


def test_png_renders(tmp_path):
    """draw() and the `roundpipe timeline` command write non-empty PNG files."""
    pytest.importorskip("matplotlib")
    r = simulate("1f1b", Costs.uniform(8, 1e-3, 2e-3), 4, 4)
    path = tmp_path / "t.json"
    r.trace().save(path)
    png = tmp_path / "t.png"
    assert timeline_main([str(path), "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    measured = Trace()
    measured.add("cuda:10", "F1 mb0", 0.0, 1.0, "forward")
    measured.add("cuda:2", "copy", 0.5, 0.8, "copy")
    draw(measured, tmp_path / "m.png", title="measured")
    assert (tmp_path / "m.png").stat().st_size > 1000


def test_timeline_rejects_non_trace(tmp_path):
    """A JSON file that is not a trace exits with a usage error."""
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit):
        timeline_main([str(bad), "--png", str(tmp_path / "x.png")])
