"""model/qwen35._Views: the forward's buffer views, each made once per base and extent."""
import numpy as np

from ninfer_numba.model.qwen35 import _Views


def test_a_view_is_made_once_per_base_and_extent():
    views, made = _Views(), []
    base = np.zeros(64, np.float32)

    def make(t, n):
        made.append((t, n))
        return base[: t * n].reshape(t, n)
    first = views.get(base, (4, 8), lambda: make(4, 8))
    assert views.get(base, (4, 8), lambda: make(4, 8)) is first and made == [(4, 8)]
    assert views.get(base, (2, 8), lambda: make(2, 8)).shape == (2, 8) and made == [(4, 8), (2, 8)]


def test_an_entry_serves_only_its_own_base():
    """A key's id may be reused by a new object once its base is gone: the entry's base must be the very one."""
    views = _Views()
    old, new = np.zeros(8), np.ones(8)
    views._views[(id(new), 8)] = (old, "a view of a base that is gone")
    got = views.get(new, (8,), lambda: new[:8])
    assert isinstance(got, np.ndarray) and np.shares_memory(got, new)
    assert views.get(new, (8,), lambda: "made again") is got and views._views[(id(new), 8)][0] is new


def test_the_views_are_dropped_at_the_limit():
    views = _Views(limit=2)
    base = np.zeros(8)
    for t in (1, 2, 3):
        views.get(base, (t,), lambda t=t: base[:t])
    assert len(views._views) == 1                      # cleared before the third, which is kept
