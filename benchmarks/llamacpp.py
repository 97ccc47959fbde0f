"""llama.cpp's llama-bench, fetched, built and cached: the baseline every result is compared with.

The baseline is llama.cpp build 8462. PyPI's llama-cpp-python 0.3.18 source archive vendors build 8475
(8462 + 13 commits, none touching the qwen35 model), so that archive is the reproducible source: it is fetched
with ``pip download``, only the parts a llama-bench build needs are extracted (the archive is ~60 MB, the
extract ~22 MB), and the build is cached under a key of source digest + cmake flags + host CPU, so a machine
that built it once never builds again.

    python -m benchmarks.llamacpp fetch    # download and extract the source into .cache/llama.cpp/src
    python -m benchmarks.llamacpp build    # build llama-bench (CUDA when nvidia-smi sees a GPU), print its path
    python -m benchmarks.llamacpp path     # print the path of an existing build; exit 1 when there is none

Offline: LLAMA_BENCH=path (an existing binary), LLAMACPP_SRC=folder (an extracted llama.cpp tree) or
LLAMACPP_SDIST=path (a downloaded llama_cpp_python-0.3.18.tar.gz); each has a matching command-line flag.

llama_devices() picks the GPUs llama-bench runs on so that they match our engine's --gpus (the harness uses it).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from benchmarks.machine import cpu_name

SDIST_REQUIREMENT = "llama-cpp-python==0.3.18"
SDIST_NAME = "llama_cpp_python-0.3.18.tar.gz"
VENDOR_PREFIX = "vendor/llama.cpp/"        # where the sdist keeps the llama.cpp tree (after its top folder)
BUILD_NUMBER = 8475
BUILD_COMMIT = "49bfdde"                   # the vendored submodule's commit; the archive carries no usable history
LABEL = "llama.cpp b8475 (b8462 + 13)"
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CACHE = REPO_ROOT / ".cache" / "llama.cpp"
SOURCE_MARKER = ".ninfer-source.json"      # written into an extracted tree; excluded from its digest
BUILD_STAMP = "ninfer-build.json"          # written into a build folder once llama-bench has linked

# Top-level entries of the llama.cpp tree that a llama-bench build configures or compiles. tools/ is needed
# whole (tools/CMakeLists.txt adds every tool unconditionally) and so is vendor/ (mtmd, common).
KEEP_TOP = frozenset({"CMakeLists.txt", "LICENSE", "cmake", "include", "src", "common", "ggml", "tools",
                      "vendor", "licenses"})
# Sub-trees under KEEP_TOP that are only configured when options we leave off are on.
DROP_PREFIXES = tuple(f"ggml/src/ggml-{b}/" for b in (
    "blas", "cann", "hexagon", "hip", "metal", "musa", "opencl", "openvino", "rpc", "sycl", "virtgpu",
    "vulkan", "webgpu", "zdnn", "zendnn")) + ("tools/server/", "tools/cli/", "tools/rpc/")


def log(msg: str) -> None:
    print(f"[llama.cpp] {msg}", file=sys.stderr, flush=True)


def wanted_member(relpath: str) -> bool:
    """Whether a path inside the llama.cpp tree (relative to it, '/'-separated) is needed to build llama-bench."""
    parts = relpath.split("/")
    if not parts[0] or parts[0] not in KEEP_TOP or ".." in parts:
        return False
    return not any((relpath + "/").startswith(p) for p in DROP_PREFIXES)


def _llama_relpath(member_name: str) -> str | None:
    """'llama_cpp_python-0.3.18/vendor/llama.cpp/src/x.cpp' -> 'src/x.cpp'; None outside the vendored tree."""
    _, _, rest = member_name.partition("/")
    if not rest.startswith(VENDOR_PREFIX):
        return None
    return rest[len(VENDOR_PREFIX):] or None


def extract_source(archive: Path, dest: Path) -> dict:
    """Extract the llama-bench subset of the vendored llama.cpp tree from the sdist into ``dest``.

    Extracts into a sibling temporary folder and renames it, so an interrupted run leaves no half tree.
    Returns the marker written into the tree: archive name + sha256, file count, bytes.
    """
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    n_files = n_bytes = 0
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar:
            rel = _llama_relpath(member.name)
            if rel is None or not member.isfile() or not wanted_member(rel):
                continue  # symlinks and devices are never needed; skipping them also keeps the extract inside tmp
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(member) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out)
            os.chmod(target, 0o755 if member.mode & 0o111 else 0o644)
            n_files += 1
            n_bytes += member.size
    if n_files == 0 or not (tmp / "tools" / "llama-bench" / "llama-bench.cpp").is_file():
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"{archive} does not contain a vendored llama.cpp tree with tools/llama-bench")
    marker = {"archive": archive.name, "archive_sha256": file_sha256(archive), "files": n_files, "bytes": n_bytes,
              "build_number": BUILD_NUMBER, "build_commit": BUILD_COMMIT}
    (tmp / SOURCE_MARKER).write_text(json.dumps(marker, indent=1) + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return marker


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def source_digest(src: Path) -> str:
    """sha256 over every file's relative path and contents, in sorted order (the marker file excluded)."""
    h = hashlib.sha256()
    files = sorted(p for p in src.rglob("*") if p.is_file() and p.name != SOURCE_MARKER)
    for p in files:
        h.update(p.relative_to(src).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def download_sdist(dest_dir: Path) -> Path:
    """``pip download`` the source archive (no wheels, no dependencies) into dest_dir; reuse it when present."""
    archive = dest_dir / SDIST_NAME
    if archive.is_file():
        return archive
    dest_dir.mkdir(parents=True, exist_ok=True)
    log(f"downloading {SDIST_REQUIREMENT} source from PyPI")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(dest_dir),
           SDIST_REQUIREMENT]
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    if not archive.is_file():
        raise RuntimeError(f"pip download did not produce {archive}")
    return archive


def fetch(cache: Path = DEFAULT_CACHE, *, sdist: Path | None = None, source: Path | None = None) -> Path:
    """Return a llama.cpp source tree: ``source`` (or $LLAMACPP_SRC) as given, else the cached extract,
    else one extracted from ``sdist`` (or $LLAMACPP_SDIST), else from a fresh ``pip download``."""
    source = source or _env_path("LLAMACPP_SRC")
    if source is not None:
        if not (source / "tools" / "llama-bench" / "llama-bench.cpp").is_file():
            raise FileNotFoundError(f"{source} is not a llama.cpp source tree (no tools/llama-bench/llama-bench.cpp)")
        return source
    src = cache / "src"
    if (src / SOURCE_MARKER).is_file():
        return src
    archive = sdist or _env_path("LLAMACPP_SDIST")
    if archive is not None and not archive.is_file():
        raise FileNotFoundError(f"llama.cpp source archive {archive} does not exist")
    archive = archive or download_sdist(cache / "dl")
    t0 = time.perf_counter()
    marker = extract_source(archive, src)
    log(f"extracted {marker['files']} files, {marker['bytes'] / 1e6:.1f} MB into {src} "
        f"in {time.perf_counter() - t0:.1f} s")
    return src


def detect_cuda_arch() -> str | None:
    """CMAKE_CUDA_ARCHITECTURES for the first GPU ('9.0' -> '90'), or None when nvidia-smi finds none."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                         capture_output=True, text=True)
    caps = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    if out.returncode != 0 or not caps:
        return None
    return caps[0].replace(".", "")


def cmake_flags(cuda_arch: str | None) -> list[str]:
    """Configure flags: a static, release llama-bench; CUDA for ``cuda_arch`` or a CPU-only build for None."""
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
             f"-DLLAMA_BUILD_NUMBER={BUILD_NUMBER}", f"-DLLAMA_BUILD_COMMIT={BUILD_COMMIT}",
             "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
             "-DLLAMA_OPENSSL=OFF"]
    if cuda_arch:
        flags += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={cuda_arch}"]
    else:
        flags += ["-DGGML_CUDA=OFF"]
    return flags


def host_cpu() -> str:
    """CPU model name: ggml's CPU code is compiled for the host (GGML_NATIVE), so a build belongs to one CPU."""
    return cpu_name()


def cache_key(digest: str, flags: list[str], host: str) -> str:
    """Build-cache key: a change of source, of any configure flag or of host CPU gives a new build folder."""
    payload = json.dumps({"source": digest, "flags": sorted(flags), "host": host}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def build_dir_for(cache: Path, src: Path, cuda_arch: str | None) -> tuple[Path, list[str], str]:
    flags = cmake_flags(cuda_arch)
    key = cache_key(source_digest(src), flags, host_cpu())
    return cache / f"build-{key}", flags, key


def cached_binary(build_dir: Path) -> Path | None:
    """The llama-bench of a finished build in ``build_dir`` (its stamp is written only after linking)."""
    binary = build_dir / "bin" / "llama-bench"
    if (build_dir / BUILD_STAMP).is_file() and binary.is_file():
        return binary
    return None


def build(src: Path, cache: Path = DEFAULT_CACHE, *, cuda_arch: str | None = "auto",
          jobs: int | None = None) -> Path:
    """Configure and build the llama-bench and llama-batched-bench targets; return llama-bench. A cached build
    is reused."""
    if cuda_arch == "auto":
        cuda_arch = detect_cuda_arch()
    build_dir, flags, key = build_dir_for(cache, src, cuda_arch)
    binary = cached_binary(build_dir)
    if binary is not None:
        log(f"cached build {binary} (key {key})")
        return binary
    jobs = jobs or os.cpu_count() or 1
    kind = f"CUDA sm_{cuda_arch}" if cuda_arch else "CPU"
    log(f"building llama-bench ({kind}, {jobs} jobs) in {build_dir}")
    t0 = time.perf_counter()
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(["cmake", "-S", str(src), "-B", str(build_dir), *generator, *flags],
                   check=True, stdout=sys.stderr)
    # llama-batched-bench too: the peer of the concurrency benchmark (benchmarks/e2e/concurrency.py)
    subprocess.run(["cmake", "--build", str(build_dir), "--target", "llama-bench", "llama-batched-bench",
                    "-j", str(jobs)], check=True, stdout=sys.stderr)
    seconds = time.perf_counter() - t0
    binary = build_dir / "bin" / "llama-bench"
    if not binary.is_file():
        raise RuntimeError(f"the build finished without producing {binary}")
    stamp = {"key": key, "flags": flags, "host": host_cpu(), "cuda_arch": cuda_arch, "seconds": round(seconds, 1),
             "label": LABEL, "source": str(src)}
    (build_dir / BUILD_STAMP).write_text(json.dumps(stamp, indent=1) + "\n")
    log(f"built {binary} in {seconds:.0f} s")
    return binary


def find_llama_bench(explicit: Path | None = None, cache: Path = DEFAULT_CACHE, *,
                     cuda_arch: str | None = "auto", source: Path | None = None) -> Path | None:
    """An existing llama-bench without building: ``explicit``, $LLAMA_BENCH, else the cached build that
    matches this machine's flags (None when there is none)."""
    given = explicit or _env_path("LLAMA_BENCH")
    if given is not None:
        if not (given.is_file() and os.access(given, os.X_OK)):
            raise FileNotFoundError(f"llama-bench binary {given} does not exist or is not executable")
        return given
    src = source or _env_path("LLAMACPP_SRC") or cache / "src"
    if not (src / "tools" / "llama-bench").is_dir():
        return None
    if cuda_arch == "auto":
        cuda_arch = detect_cuda_arch()
    return cached_binary(build_dir_for(cache, src, cuda_arch)[0])


def ensure_llama_bench(explicit: Path | None = None, cache: Path = DEFAULT_CACHE, *,
                       source: Path | None = None, sdist: Path | None = None, jobs: int | None = None) -> Path:
    """An existing llama-bench, else fetch the source and build it (minutes with CUDA on a many-core host)."""
    found = find_llama_bench(explicit, cache, source=source)
    if found is not None:
        return found
    return build(fetch(cache, sdist=sdist, source=source), cache, jobs=jobs)


@dataclass(frozen=True)
class LlamaDevices:
    """The GPUs a llama-bench run uses. CUDA_VISIBLE_DEVICES names them, because llama.cpp's default split
    (-sm layer) spreads the layers over every GPU it can see; -sm layer splits over them when there are
    several, -sm none keeps the model whole on one."""
    visible: str                # CUDA_VISIBLE_DEVICES of the llama-bench process
    split_mode: str             # "layer" | "none"
    n_devices: int
    note: str | None = None     # how llama.cpp's devices differ from our shards, when they do

    def args(self) -> list[str]:
        return ["-sm", self.split_mode]

    def env(self, base: Mapping[str, str]) -> dict[str, str]:
        """``base`` (os.environ) with CUDA_VISIBLE_DEVICES replaced; ``base`` itself is left alone."""
        return {**base, "CUDA_VISIBLE_DEVICES": self.visible}

    def as_settings(self) -> dict:
        return {"cuda_visible_devices": self.visible, "split_mode": self.split_mode, "n_devices": self.n_devices,
                "note": self.note}


def llama_devices(devices: list[int], visible: str | None = None) -> LlamaDevices:
    """llama-bench's devices for our shard devices (engine/shard_plan.parse_gpus: "0,1" -> [0, 1], repeats
    allowed): each distinct device once, in first-use order, so llama.cpp's first layers sit where our
    first shard does. Shards repeating a device are ours only (they test our bridge); llama.cpp cannot split
    over one device and runs whole there. ``visible`` is our own CUDA_VISIBLE_DEVICES: our ids are ordinals
    within it, and the child's variable must name the same physical GPUs."""
    distinct = list(dict.fromkeys(devices))
    if not distinct:
        raise ValueError("no devices for llama-bench")
    if visible is not None:
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        if max(distinct) >= len(entries):
            raise ValueError(f"device {max(distinct)} is not among CUDA_VISIBLE_DEVICES={visible!r}")
        names = [entries[d] for d in distinct]
    else:
        names = [str(d) for d in distinct]
    note = None
    if len(devices) > len(distinct):
        where = "unsplit on it" if len(distinct) == 1 else f"split by layer over each of the {len(distinct)} once"
        note = f"shards sharing a device apply to ninfer only ({len(devices)} shards); llama.cpp runs {where}"
    return LlamaDevices(",".join(names), "layer" if len(distinct) > 1 else "none", len(distinct), note)


def _env_path(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value).expanduser() if value else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.llamacpp", description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=["fetch", "build", "path"])
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="cache folder (default .cache/llama.cpp)")
    p.add_argument("--source", type=Path, help="an extracted llama.cpp tree (or $LLAMACPP_SRC)")
    p.add_argument("--sdist", type=Path, help=f"a downloaded {SDIST_NAME} (or $LLAMACPP_SDIST)")
    p.add_argument("--llama-bench", type=Path, help="an existing llama-bench binary (or $LLAMA_BENCH)")
    p.add_argument("--cpu", action="store_true", help="build without CUDA even when a GPU is present")
    p.add_argument("--jobs", type=int, help="parallel compile jobs (default: all cores)")
    args = p.parse_args(argv)
    arch = None if args.cpu else "auto"
    try:
        if args.action == "fetch":
            print(fetch(args.cache, sdist=args.sdist, source=args.source))
        elif args.action == "build":
            found = find_llama_bench(args.llama_bench, args.cache, cuda_arch=arch, source=args.source)
            if found is None:
                src = fetch(args.cache, sdist=args.sdist, source=args.source)
                found = build(src, args.cache, cuda_arch=arch, jobs=args.jobs)
            print(found)
        else:
            found = find_llama_bench(args.llama_bench, args.cache, cuda_arch=arch, source=args.source)
            if found is None:
                print("no llama-bench build for this machine; run: python -m benchmarks.llamacpp build",
                      file=sys.stderr)
                return 1
            print(found)
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
