"""Plan: validation of forward/backward partitions and the size-based default."""
import pytest

from roundpipe.planner.plan import Plan


def test_valid_plan_properties():
    """A valid plan exposes its fused tail, layer count and slot sequence F..., B...."""
    p = Plan(forward=[range(0, 4), range(4, 8)], backward=[range(8, 12), range(6, 8), range(4, 6), range(0, 4)])
    assert p.num_layers == 12 and p.fused == range(8, 12)
    assert [k for k, _ in p.stages()] == ["F", "F", "B", "B", "B", "B"]
    assert p.check(12) is p
    with pytest.raises(ValueError, match="covers 12 layers"):
        p.check(13)


def test_all_fused_plan_has_no_forward_stage():
    """A model that fits one stage: no forward stage, one fused backward stage."""
    p = Plan(forward=[], backward=[range(0, 3)])
    assert p.stages() == [("B", range(0, 3))]


@pytest.mark.parametrize("fwd,bwd,match", [
    ([range(0, 4)], [], "at least one stage"),
    ([range(0, 3), range(2, 4)], [range(4, 6), range(0, 4)], r"forward stage 1 .* overlaps"),
    ([range(0, 2), range(3, 4)], [range(4, 6), range(0, 4)], r"forward stage 1 .* leaves a gap \(layers 2..2\)"),
    ([range(0, 3)], [range(4, 6), range(0, 4)], "must meet exactly"),
    ([range(0, 4)], [range(4, 6), range(1, 4)], "must end at layer 0"),
    ([range(0, 4)], [range(4, 6), range(2, 5), range(0, 2)], "backward stage 1 .* overlaps"),
    ([range(0, 4)], [range(4, 6), range(2, 3), range(0, 2)], "backward stage 1 .* leaves a gap"),
    ([range(0, 4)], [range(4, 6), range(4, 4), range(0, 4)], "backward stage 1 .* is empty"),
    ([range(-1, 4)], [range(4, 6), range(-1, 4)], "negative"),
])
def test_invalid_plans_name_the_stage(fwd, bwd, match):
    """Gaps, overlaps, empty stages and out-of-range layers raise ValueError naming the stage."""
    with pytest.raises(ValueError, match=match):
        Plan(forward=fwd, backward=bwd)


def test_stage_types_are_checked():
    """Stages must be step-1 ranges or lists of consecutive ints."""
    assert Plan(forward=[[0, 1]], backward=[[2], [0, 1]]).fused == range(2, 3)
    with pytest.raises(TypeError, match="forward stage 0 must be a range"):
        Plan(forward=["0-1"], backward=[range(2, 3), range(0, 2)])
    with pytest.raises(ValueError, match="consecutive"):
        Plan(forward=[[0, 2]], backward=[range(3, 4), range(0, 3)])
    with pytest.raises(ValueError, match="step 1"):
        Plan(forward=[range(0, 4, 2)], backward=[range(4, 5), range(0, 4)])


@pytest.mark.parametrize("layers", [1, 2, 5, 12, 33])
@pytest.mark.parametrize("per_stage", [1, 2, 3])
def test_uniform_plan_is_valid_and_asymmetric(layers, per_stage):
    """The default plan covers every layer; forward stages hold ~3x the layers of backward stages."""
    p = Plan.uniform(layers, backward_per_stage=per_stage)
    assert p.num_layers == layers
    assert all(len(r) <= per_stage for r in p.backward)
    assert all(len(r) <= 3 * per_stage for r in p.forward)
    with pytest.raises(ValueError, match="num_layers=0"):
        Plan.uniform(0)
