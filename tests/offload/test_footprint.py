"""Host footprint for model-like tensors: the arena stays within 5%, power-of-two rounding does not."""
import pytest

from roundpipe import _native
from roundpipe.offload import ArenaConfig
from roundpipe.offload.footprint import arena_footprint, pow2_ceil, pow2_footprint
from roundpipe.shapes import LLAMA_3_1_8B, QWEN3_1_7B, QWEN3_4B, DecoderShape

pytestmark = pytest.mark.skipif(not _native.available(), reason="needs the native core roundpipe._C")


def test_pow2_model():
    """pow2_ceil rounds up to the next power of two and leaves powers of two alone."""
    assert [pow2_ceil(n) for n in (1, 2, 3, 1000, 1024, 1025)] == [1, 2, 4, 1024, 1024, 2048]
    assert pow2_footprint([24 << 20, 593 << 20, 0]) == (32 << 20) + (1 << 30)


@pytest.mark.parametrize("shape", [QWEN3_1_7B, QWEN3_4B, LLAMA_3_1_8B], ids=lambda s: s.name)
@pytest.mark.parametrize("bytes_per_element", [2, 4])
def test_arena_within_five_percent(shape, bytes_per_element):
    """Reserved bytes for every parameter tensor are <= 1.05x requested (bf16 upload copy and fp32 master)."""
    sizes = shape.tensor_bytes(bytes_per_element)
    assert arena_footprint(sizes) <= 1.05 * sum(sizes)


def test_power_of_two_rounding_wastes_up_to_2x():
    """For Qwen3 shapes power-of-two rounding reserves ~1.4x in total and 1.7x for the 1.7B embedding."""
    sizes = QWEN3_4B.tensor_bytes(2)
    assert pow2_footprint(sizes) >= 1.35 * sum(sizes)
    emb = QWEN3_1_7B.tensor_bytes(2)[0]  # 593 MiB -> 1 GiB
    assert pow2_ceil(emb) / emb > 1.7
    assert arena_footprint(sizes, ArenaConfig(chunk_bytes=16 << 20)) <= 1.05 * sum(sizes)


def test_shape_validation_and_counts():
    """A decoder's tensor list has embedding, 9 tensors per layer, final norm and head."""
    tiny = DecoderShape("tiny", hidden=8, intermediate=16, layers=2, vocab=10, heads=2, kv_heads=1, head_dim=4)
    numels = tiny.parameter_numels()
    assert len(numels) == 1 + 9 * 2 + 2
    assert numels[0] == numels[-1] == 80 and numels[2] == 8 * 8 and numels[3] == 8 * 4
    with pytest.raises(ValueError, match="layers=0"):
        DecoderShape("bad", 8, 16, 0, 10, 2, 1, 4)
