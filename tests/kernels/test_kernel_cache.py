"""The on-disk kernel cache's keys (kernels/kernel_cache.py): equal across processes for equal factory
arguments, different for different ones, and a folder that follows the kernel sources. Loading and saving
compiled code needs a GPU; benchmarks/e2e/cold_warm_start.py measures that."""
import json
import subprocess
import sys

import pytest

from ninfer_numba.kernels.numba_env import SIMULATOR

# Every kernel factory at the 9B shapes (S=128, 16 K heads / 32 V heads, 16 / 4 attention heads of 256).
FACTORY_KEYS = """
import json
from ninfer_numba.kernels.kernel_cache import cells_digest
from ninfer_numba.kernels.flash_attn import decode, prefill, prefill_mma, rope
from ninfer_numba.kernels.gdn import chunk, chunk_intra_mma, chunk_state_f16, conv, recurrent
D = 256 if len(__import__("sys").argv) < 2 else int(__import__("sys").argv[1])
made = {
    "fa_decode": decode._decode_kernels(16, 4, D, 64),
    "fa_prefill": (prefill._prefill_kernel(16, 4, D),),
    "fa_prefill_mma": (prefill_mma._prefill_mma_kernel(16, 4, D, 8),),
    "rope": (rope._norm_rope_kernel(16, 4, D, 64),),
    "gates": (chunk._gates_kernel(128, 16, 32),),
    "gated_norm": (chunk._gated_norm_kernel(128, 16, 32),),
    "intra_mma": (chunk_intra_mma.chunk_intra_mma_kernel(128, 16, 32),),
    "state_f16": (chunk_state_f16.chunk_state_f16_kernel(128, 16, 32, 32),),
    "conv": (conv._conv_silu_norm_kernel(4, 128, 4096), conv._conv_state_shift_kernel(4)),
    "gdn_decode": (recurrent._decode_kernel(128, 4, 16, 32, False),),
}
kernels = lambda made: [k for x in made for k in (kernels(x) if isinstance(x, tuple) else [x])
                        if hasattr(k, "py_func")]
print(json.dumps({name: [cells_digest(k.py_func) for k in kernels(ks)] for name, ks in made.items()}))
"""


def _keys(*args) -> dict:
    out = subprocess.run([sys.executable, "-c", FACTORY_KEYS, *args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(SIMULATOR, reason="the simulator's kernels are plain Python functions")
def test_factory_kernel_keys_equal_across_processes_and_differ_by_shape():
    first, second = _keys(), _keys()
    assert first == second
    other = _keys("128")
    for name in ("fa_decode", "fa_prefill", "fa_prefill_mma", "rope"):
        assert other[name] != first[name], name
    assert other["conv"] == first["conv"]


def test_describe_device_function_and_refusal():
    from ninfer_numba.kernels.kernel_cache import describe

    assert describe((1, 2.5, "x")) == (1, 2.5, "x")
    with pytest.raises(TypeError, match="closure value"):
        describe(object())


def test_sources_digest_follows_every_file(tmp_path):
    from ninfer_numba.kernels.kernel_cache import sources_digest

    (tmp_path / "sub").mkdir()
    (tmp_path / "a.py").write_text("X = 1\n")
    (tmp_path / "sub" / "b.py").write_text("Y = 2\n")
    before = sources_digest(tmp_path)
    assert sources_digest(tmp_path) == before
    (tmp_path / "sub" / "b.py").write_text("Y = 3\n")
    assert sources_digest(tmp_path) != before
