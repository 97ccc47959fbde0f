"""engine/cuda_runner.chunk_lengths: the forwards of a prefill, short rests in pieces whose lengths recur."""
import pytest

from ninfer_numba.engine.cuda_runner import SPLIT_MAX, SPLIT_STEP, chunk_lengths, piece_lengths


@pytest.mark.parametrize("n,chunk,want", [
    (137, 2048, [128, 9]), (129, 2048, [128, 1]), (300, 2048, [300]), (256, 2048, [256]),
    (4096 + 33, 2048, [2048, 2048, 32, 1]), (4096, 2048, [2048, 2048]), (15, 2048, [15]), (31, 32, [16, 15]),
    (5, 32, [5]), (70, 32, [32, 32, 6]), (255, 2048, [240, 15]), (150, 2048, [144, 6]), (160, 2048, [160])])
def test_pieces(n, chunk, want):
    assert chunk_lengths(n, chunk) == want


def test_every_length_sums_and_recurs():
    """Every n up to two chunks: the pieces sum to n, a rest of at most SPLIT_MAX is at most two of them, and
    the lengths below a chunk come from a small set (the multiples of SPLIT_STEP up to SPLIT_MAX, the lengths
    under SPLIT_STEP, and single rests over SPLIT_MAX)."""
    seen = set()
    for n in range(1, 4097):
        parts = chunk_lengths(n, 2048)
        assert sum(parts) == n and all(0 < p <= 2048 for p in parts)
        if n % 2048 <= SPLIT_MAX:
            assert len(parts) - n // 2048 <= 2
        seen |= {p for p in parts if p <= SPLIT_MAX}
    assert seen <= set(range(SPLIT_STEP, SPLIT_MAX + 1, SPLIT_STEP)) | set(range(1, SPLIT_STEP))
    assert set(piece_lengths()) == seen                 # what warm_prefill captures: each one, and no other
    assert len(piece_lengths()) == len(seen)


def test_unsplit_is_whole_chunks_and_the_rest():
    assert chunk_lengths(137, 2048, split=False) == [137]
    assert chunk_lengths(4100, 2048, split=False) == [2048, 2048, 4]
