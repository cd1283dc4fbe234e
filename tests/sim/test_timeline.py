"""Trace round trip and timeline pictures, for simulated and hand-recorded traces."""
import json

import pytest

from roundpipe.sim import Costs, bubbles, simulate
from roundpipe.sim.timeline import colour, draw, figure
from roundpipe.sim.timeline import main as timeline_main
from roundpipe.trace import Trace, category


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


def _engine_style_trace() -> Trace:
    """Events named and categorised as the engine records them (stage kinds F / fused / B)."""
    t = Trace()
    for m in range(3):
        t.add("cpu:0", f"F0[0-1] mb{m}", m, m + 1, "F", stage="F0[0-1]", iteration=0)
        t.add("cpu:1", f"fused1[2-3] mb{m}", 3 + m, 4 + m, "fused", stage="fused1[2-3]", iteration=0)
        t.add("cpu:0", f"B2[0-1] mb{m}", 6 + m, 7 + m, "B", stage="B2[0-1]", iteration=0)
    return t


def _legend(fig) -> dict[str, tuple]:
    legend = fig.axes[0].get_legend()
    return {text.get_text(): tuple(patch.get_facecolor()) for text, patch in zip(legend.get_texts(),
                                                                                 legend.get_patches())}


def test_recorded_and_simulated_share_categories_and_colours():
    """The engine's F / B events are drawn as forward / backward, in the simulator's colours and legend order."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    assert (category("F"), category("B"), category("fused")) == ("forward", "backward", "fused")
    assert colour("F") == colour("forward") and colour("zz-new") == colour("zz-new") != colour("forward")
    sim = figure(simulate("roundpipe", Costs.uniform(4, 1e-3, 2e-3, 1e-3, 2e-3), 2, 3,
                          partition=([2, 2], [0, 2, 2])).trace())
    rec = figure(_engine_style_trace())
    sim_legend, rec_legend = _legend(sim), _legend(rec)
    assert list(sim_legend) == ["forward", "fused", "recompute", "backward"]
    assert list(rec_legend) == ["forward", "fused", "backward"]
    assert all(rec_legend[c] == sim_legend[c] for c in rec_legend)
    plt.close(sim)
    plt.close(rec)


def test_legend_outside_plot(tmp_path):
    """The legend lies right of the axes and inside the saved picture."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    fig = figure(simulate("gpipe", Costs.uniform(4, 1e-3, 2e-3), 2, 2).trace())
    fig.canvas.draw()
    ax = fig.axes[0]
    assert ax.get_legend().get_window_extent().x0 >= ax.get_window_extent().x1
    plt.close(fig)
    draw(simulate("gpipe", Costs.uniform(4, 1e-3, 2e-3), 2, 2).trace(), tmp_path / "g.png")
    from matplotlib.image import imread

    img = imread(tmp_path / "g.png")
    assert img.shape[1] > img.shape[0] * 2   # wide: plot plus legend column, no legend rows below


def _labels(fig):
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    return [(t.get_text(), t.get_window_extent(renderer)) for t in ax.texts], ax.get_window_extent(renderer)


@pytest.mark.parametrize("schedule, workers, partition", [
    ("roundpipe", 8, ([2] * 18, [4] + [2] * 18)),   # 40 stages on 8 workers
    ("1f1b", 40, None),                              # 40 stages on 40 workers
])
def test_readable_at_40_stages(schedule, workers, partition):
    """At 40 stages every worker row has a tick label, box labels never overlap and stay inside the
    axes, and (round-robin) every stage is named somewhere."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    trace = simulate(schedule, Costs.uniform(40, 1e-3, 2e-3, 4e-3, 8e-3, 1e-4), workers, 16,
                     partition=partition).trace()
    fig = figure(trace)
    width, height = fig.get_size_inches()
    assert width <= 24 and height / workers >= 0.3
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == [f"GPU {w}" for w in range(workers)]
    labels, axes = _labels(fig)
    assert labels
    boxes = sorted((box for _, box in labels), key=lambda box: box.x0)
    for box in boxes:
        assert axes.x0 - 1 <= box.x0 and box.x1 <= axes.x1 + 1
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            if b.x0 >= a.x1:
                break
            assert not a.overlaps(b), (a, b)
    if schedule == "roundpipe":
        named = {text.split("\n")[0] for text, _ in labels}
        assert named == {e.args["stage"] for e in trace.events}
    plt.close(fig)
