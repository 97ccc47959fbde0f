"""Corrupted GGUF files through `ninfer info` and `ninfer logits`: every one ends in a one-line error (or runs).

A seeded generator derives 200+ files from one valid tiny model: truncations, byte flips anywhere in the
header, huge and zero counts (tensors, metadata entries, array lengths, string lengths, dimensions), zero and
huge model sizes (block_count 2^31 - 1 and 2^32 - 1, head counts 0), misaligned tensor offsets, bad
alignments, unknown value and tensor types, wrong magic and versions. They run in a few child processes,
each case under a time limit, and each child's peak memory is read from the kernel: no traceback, no hang,
and under 1 GB of resident memory for any batch (so for any case in it).
"""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.gguf_factory import QT, TinySpec, tensors_for, write_gguf

SEED = 20261201
CASE_SECONDS = 20
PEAK_BYTES = 1 << 30
BATCH = 30

_CHILD = r"""
import contextlib, io, json, signal, sys, traceback
from ninfer_numba import cli

def alarm(signum, frame):
    raise TimeoutError("case time limit")

signal.signal(signal.SIGALRM, alarm)
out_file, paths = sys.argv[1], sys.argv[2:]
results = []
for path in paths:
    for argv in (["info", "--model", path],
                 ["logits", "--model", path, "--backend", "cpu", "--tokens", "1,2,3", "--out", out_file]):
        err, out = io.StringIO(), io.StringIO()
        kind, rc, detail = "ran", None, ""
        signal.alarm(%d)
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
                rc = cli.main(argv)
        except SystemExit as e:
            rc = e.code
        except TimeoutError:
            kind = "hang"
        except BaseException:
            kind, detail = "traceback", traceback.format_exc()[-600:]
        finally:
            signal.alarm(0)
        lines = err.getvalue().strip().splitlines()
        results.append({"path": path, "cmd": argv[0], "kind": kind, "rc": rc,
                        "stderr_lines": len(lines), "last": lines[-1] if lines else "", "detail": detail})
# this process's own peak resident set (VmHWM belongs to the address space exec created: unlike ru_maxrss, it
# does not count the test process's pages that the fork copied before the exec)
peak_kib = max(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"results": results, "peak_bytes": peak_kib * 1024}))
""" % CASE_SECONDS


class _Header:
    """Byte positions of the fields of a GGUF v3 header (an independent walk, for patching)."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 24
        self.n_tensors, self.n_kv = struct.unpack_from("<QQ", data, 8)
        self.kv: dict[str, tuple[int, int, int]] = {}     # key -> (key length pos, type pos, value pos)
        for _ in range(self.n_kv):
            klen_at = self.pos
            key = self._str()
            type_at = self.pos
            vtype = self._u32()
            self.kv[key] = (klen_at, type_at, self.pos)
            self._skip(vtype)
        self.tensors = []                                 # (name, n_dims pos, dims pos, type pos, offset pos)
        for _ in range(self.n_tensors):
            name = self._str()
            nd_at = self.pos
            nd = self._u32()
            dims_at = self.pos
            self.pos += 8 * nd
            self.tensors.append((name, nd_at, dims_at, self.pos, self.pos + 4))
            self.pos += 12
        self.end = self.pos

    def _u32(self) -> int:
        v = struct.unpack_from("<I", self.data, self.pos)[0]
        self.pos += 4
        return v

    def _str(self) -> str:
        n = struct.unpack_from("<Q", self.data, self.pos)[0]
        self.pos += 8 + n
        return self.data[self.pos - n:self.pos].decode()

    def _skip(self, vtype: int) -> None:
        sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
        if vtype == 8:
            self._str()
        elif vtype == 9:
            etype = self._u32()
            count = struct.unpack_from("<Q", self.data, self.pos)[0]
            self.pos += 8
            for _ in range(count):
                self._skip(etype)
        else:
            self.pos += sizes[vtype]


def _patch(data: bytes, at: int, fmt: str, value) -> bytes:
    b = bytearray(data)
    struct.pack_into(fmt, b, at, value)
    return bytes(b)


def _corruptions(base: bytes, meta_files: dict[str, bytes], rng: np.random.Generator) -> dict[str, bytes]:
    h = _Header(base)
    cases: dict[str, bytes] = {}
    for i, cut in enumerate(sorted(set(rng.integers(0, h.end + 64, 30).tolist() +
                                       rng.integers(h.end, len(base), 10).tolist()))):
        cases[f"truncate_{i}_{cut}"] = base[:cut]
    for i in range(120):
        b = bytearray(base)
        at = int(rng.integers(4, h.end))
        b[at] = int(rng.integers(0, 256)) if i % 2 else b[at] ^ 0xFF
        cases[f"flip_{i}_at{at}"] = bytes(b)
    for field, at in (("n_tensors", 8), ("n_kv", 16)):
        for v in (0, 1, 2**31 - 1, 2**32 - 1, 2**63 - 1, 2**64 - 1):
            cases[f"{field}_{v}"] = _patch(base, at, "<Q", v)
    for magic in (b"GGUE", b"\0\0\0\0", b"FUGG"):
        cases[f"magic_{magic!r}"] = magic + base[4:]
    for v in (0, 1, 4, 2**32 - 1):
        cases[f"version_{v}"] = _patch(base, 4, "<I", v)
    first, middle, last = h.tensors[0], h.tensors[len(h.tensors) // 2], h.tensors[-1]
    for t in (first, middle, last):
        rel = struct.unpack_from("<Q", base, t[4])[0]
        for shift in (1, 8, 31):
            cases[f"offset_{t[0]}_+{shift}"] = _patch(base, t[4], "<Q", rel + shift)
        cases[f"ndims0_{t[0]}"] = _patch(base, t[1], "<I", 0)
        cases[f"ndims5_{t[0]}"] = _patch(base, t[1], "<I", 5)
        cases[f"dim_huge_{t[0]}"] = _patch(base, t[2], "<Q", 2**62)
        cases[f"type_255_{t[0]}"] = _patch(base, t[3], "<I", 255)
    key_len_at, type_at, _ = h.kv["general.architecture"]
    cases["kv_type_99"] = _patch(base, type_at, "<I", 99)
    cases["key_len_huge"] = _patch(base, key_len_at, "<Q", 2**63)
    _, _, value_at = h.kv["general.architecture"]
    cases["string_len_huge"] = _patch(base, value_at, "<Q", 2**62)
    cases.update(meta_files)
    return cases


def _meta_variants(tmp: Path, spec: TinySpec, tensors: dict) -> dict[str, bytes]:
    """Files whose metadata claims impossible sizes while the tensors stay those of ``spec``."""
    out = {}
    for name, kw in {"block_count_2e31": dict(n_layer=2**31 - 1), "block_count_2e32": dict(n_layer=2**32 - 1),
                     "block_count_0": dict(n_layer=0), "block_count_1e6": dict(n_layer=10**6),
                     "head_count_0": dict(n_head=0), "head_count_kv_0": dict(n_head_kv=0),
                     "group_count_0": dict(ssm_groups=0), "embedding_0": dict(n_embd=0),
                     "state_size_0": dict(ssm_state=0), "conv_kernel_0": dict(conv_kernel=0),
                     "ffn_0": dict(n_ff=0), "ffn_huge": dict(n_ff=2**32 - 1)}.items():
        p = write_gguf(tmp / f"{name}.gguf", spec.with_(**kw), tensors)
        out[name] = Path(p).read_bytes()
    base = Path(write_gguf(tmp / "align.gguf", spec, tensors, alignment=32)).read_bytes()
    at = _Header(base).kv["general.alignment"][2]
    for v in (0, 3, 48, 2**31):
        out[f"alignment_{v}"] = _patch(base, at, "<I", v)
    return out


def _run_batch(paths: list[str], out_file: str) -> tuple[list[dict], int]:
    """(one result per case and command, the child's peak resident bytes)"""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _CHILD, out_file, *paths], capture_output=True, env=env,
                          cwd=Path(__file__).resolve().parents[2], timeout=CASE_SECONDS * 2 * len(paths) + 60)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    out = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    return out["results"], out["peak_bytes"]


def test_corrupted_files_end_in_one_line_errors(tmp_path):
    spec = TinySpec(n_layer=4)
    tensors = tensors_for(spec, np.random.default_rng(1))
    base = Path(write_gguf(tmp_path / "base.gguf", spec, tensors, matrix_type=QT.Q8_0)).read_bytes()
    cases = _corruptions(base, _meta_variants(tmp_path, spec, tensors), np.random.default_rng(SEED))
    assert len(cases) >= 200
    paths = []
    for name, data in cases.items():
        p = tmp_path / "cases" / f"{len(paths):03d}.gguf"
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(data)
        paths.append(str(p))
    names = dict(zip(paths, cases))
    results, peak = [], 0
    for s in range(0, len(paths), BATCH):
        batch, batch_peak = _run_batch(paths[s:s + BATCH], str(tmp_path / "logits.npy"))
        results += batch
        peak = max(peak, batch_peak)          # a batch's peak bounds each of its cases
    assert len(results) == 2 * len(paths)
    bad = [r for r in results if r["kind"] != "ran" or r["rc"] not in (0, 2)
           or (r["rc"] == 2 and not (r["stderr_lines"] == 1 and r["last"].startswith("error: ")))]
    assert not bad, [(names[r["path"]], r["cmd"], r["kind"], r["last"], r["detail"]) for r in bad[:5]]
    refused = {names[r["path"]] for r in results if r["cmd"] == "info" and r["rc"] == 2}
    assert len(refused) >= 0.75 * len(paths), f"only {len(refused)} of {len(paths)} refused"
    must = [n for n in cases if n.startswith(("truncate", "n_tensors_2", "n_kv_2", "magic", "version", "offset",
                                              "ndims", "dim_huge", "type_255", "kv_type", "key_len", "string_len",
                                              "block_count", "head_count", "group_count", "embedding", "state",
                                              "conv", "ffn", "alignment_0", "alignment_3", "alignment_48"))
            and not n.startswith(("truncate_0_", "version_3"))]
    assert not [n for n in must if n not in refused and not n.startswith("truncate")], \
        sorted(n for n in must if n not in refused)
    assert peak < PEAK_BYTES, f"peak resident memory {peak / 2**20:.0f} MiB"
