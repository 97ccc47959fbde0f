"""benchmarks/e2e/gdn_f16_flips: distances in int8 levels of a 32-block, and a run with no noise moving nothing."""
import numpy as np

from benchmarks.e2e.gdn_f16_flips import levels_apart, main


def test_levels_apart_uses_each_blocks_own_level():
    a = np.zeros((2, 64))
    a[0, 0], a[0, 32], a[1, 5] = 127.0, 12.7, -254.0       # levels 1.0, 0.1 and 2.0
    b = a.copy()
    b[0, 1], b[0, 33], b[1, 6] = 0.6, 0.06, 3.0
    got = levels_apart(a, b)
    np.testing.assert_allclose([got[0, 1], got[0, 33], got[1, 6]], [0.6, 0.6, 1.5])
    assert np.count_nonzero(got) == 3


def test_no_noise_moves_no_element(capsys):
    main(["--T", "64", "--seeds", "1", "--decays", "mixed", "--noise", "0", "--heads", "2,2"])
    row = capsys.readouterr().out.strip().splitlines()[-1].split("|")
    assert row[1].split() == ["0", "0", "0", "0.000"] and row[2].split() == ["0", "0", "0", "0.000"], row
