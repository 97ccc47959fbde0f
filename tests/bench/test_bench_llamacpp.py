"""llama.cpp acquisition: which archive members are extracted, the build-cache key, offline overrides."""
from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from benchmarks import llamacpp

TOP = "llama_cpp_python-0.3.18/"
TREE = {  # path inside the vendored llama.cpp tree -> contents
    "CMakeLists.txt": "project(llama.cpp)",
    "tools/llama-bench/llama-bench.cpp": "int main() {}",
    "tools/server/server.cpp": "server",
    "ggml/src/ggml-cuda/mmq.cu": "cuda",
    "ggml/src/ggml-vulkan/vk.cpp": "vulkan",
    "src/llama.cpp": "llama",
    "models/ggml-vocab-qwen2.gguf": "vocab",
    "docs/build.md": "docs",
}


def make_sdist(path: Path, tree: dict[str, str] = TREE, extra: dict[str, str] | None = None) -> Path:
    """A tar.gz laid out like the llama-cpp-python sdist, plus a symlink that must be skipped."""
    with tarfile.open(path, "w:gz") as tar:
        members = {TOP + "vendor/llama.cpp/" + k: v for k, v in tree.items()}
        members[TOP + "llama_cpp/llama.py"] = "bindings"
        members.update(extra or {})
        for name, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo(TOP + "vendor/llama.cpp/src/link")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    return path


@pytest.mark.parametrize("rel, wanted", [
    ("CMakeLists.txt", True), ("tools/llama-bench/llama-bench.cpp", True), ("tools/mtmd/clip.cpp", True),
    ("ggml/src/ggml-cuda/mmq.cu", True), ("ggml/src/ggml-cpu/ggml-cpu.c", True), ("vendor/nlohmann/json.hpp", True),
    ("tools/server/server.cpp", False), ("tools/cli/cli.cpp", False), ("ggml/src/ggml-vulkan/vk.cpp", False),
    ("ggml/src/ggml-metal/x.m", False), ("models/ggml-vocab-qwen2.gguf", False), ("docs/build.md", False),
    (".github/workflows/build.yml", False), ("src/../../etc/passwd", False), ("", False)])
def test_wanted_member(rel, wanted):
    assert llamacpp.wanted_member(rel) is wanted


def test_extract_source_keeps_only_the_build_subset(tmp_path):
    archive = make_sdist(tmp_path / llamacpp.SDIST_NAME)
    marker = llamacpp.extract_source(archive, tmp_path / "src")
    files = sorted(p.relative_to(tmp_path / "src").as_posix() for p in (tmp_path / "src").rglob("*") if p.is_file())
    assert files == [llamacpp.SOURCE_MARKER, "CMakeLists.txt", "ggml/src/ggml-cuda/mmq.cu", "src/llama.cpp",
                     "tools/llama-bench/llama-bench.cpp"]
    assert marker["files"] == 4 and marker["archive_sha256"] == llamacpp.file_sha256(archive)
    assert not (tmp_path / "src.partial").exists()


def test_extract_refuses_an_archive_without_llama_bench(tmp_path):
    archive = make_sdist(tmp_path / "x.tar.gz", {"CMakeLists.txt": "x"})
    with pytest.raises(RuntimeError, match="tools/llama-bench"):
        llamacpp.extract_source(archive, tmp_path / "src")
    assert not (tmp_path / "src").exists() and not (tmp_path / "src.partial").exists()


def test_fetch_uses_archive_then_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("LLAMACPP_SRC", raising=False)
    archive = make_sdist(tmp_path / llamacpp.SDIST_NAME)
    monkeypatch.setenv("LLAMACPP_SDIST", str(archive))
    src = llamacpp.fetch(tmp_path / "cache")
    assert src == tmp_path / "cache" / "src" and (src / llamacpp.SOURCE_MARKER).is_file()
    archive.unlink()  # a second fetch reuses the extract and needs neither archive nor network
    assert llamacpp.fetch(tmp_path / "cache") == src
    monkeypatch.setenv("LLAMACPP_SDIST", str(tmp_path / "missing.tar.gz"))
    with pytest.raises(FileNotFoundError):
        llamacpp.fetch(tmp_path / "other-cache")


def test_fetch_accepts_a_source_folder(tmp_path, monkeypatch):
    llamacpp.extract_source(make_sdist(tmp_path / "a.tar.gz"), tmp_path / "tree")
    monkeypatch.setenv("LLAMACPP_SRC", str(tmp_path / "tree"))
    assert llamacpp.fetch(tmp_path / "cache") == tmp_path / "tree"
    with pytest.raises(FileNotFoundError, match="not a llama.cpp source tree"):
        llamacpp.fetch(tmp_path / "cache", source=tmp_path)


def test_source_digest_tracks_contents_not_the_marker(tmp_path):
    src = tmp_path / "src"
    llamacpp.extract_source(make_sdist(tmp_path / "a.tar.gz"), src)
    d0 = llamacpp.source_digest(src)
    (src / llamacpp.SOURCE_MARKER).write_text("{}")
    assert llamacpp.source_digest(src) == d0
    (src / "src" / "llama.cpp").write_text("patched")
    assert llamacpp.source_digest(src) != d0


def test_cmake_flags():
    cpu, gpu = llamacpp.cmake_flags(None), llamacpp.cmake_flags("90")
    for flags in (cpu, gpu):
        assert "-DLLAMA_BUILD_NUMBER=8475" in flags and "-DLLAMA_BUILD_COMMIT=49bfdde" in flags
        assert "-DBUILD_SHARED_LIBS=OFF" in flags and "-DCMAKE_BUILD_TYPE=Release" in flags
    assert "-DGGML_CUDA=OFF" in cpu and not any("CUDA_ARCH" in f for f in cpu)
    assert "-DGGML_CUDA=ON" in gpu and "-DCMAKE_CUDA_ARCHITECTURES=90" in gpu


def test_cache_key():
    flags = llamacpp.cmake_flags("90")
    key = llamacpp.cache_key("d" * 64, flags, "Intel Xeon")
    assert len(key) == 16 and key == llamacpp.cache_key("d" * 64, list(reversed(flags)), "Intel Xeon")
    assert key != llamacpp.cache_key("e" * 64, flags, "Intel Xeon")            # source changed
    assert key != llamacpp.cache_key("d" * 64, llamacpp.cmake_flags("80"), "Intel Xeon")  # other GPU arch
    assert key != llamacpp.cache_key("d" * 64, llamacpp.cmake_flags(None), "Intel Xeon")  # CPU build
    assert key != llamacpp.cache_key("d" * 64, flags, "AMD EPYC")               # -march=native differs


def _executable(path: Path, text: str = "#!/bin/sh\nexit 0\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_cached_build_is_found_only_when_stamped(tmp_path, monkeypatch):
    monkeypatch.delenv("LLAMA_BENCH", raising=False)
    monkeypatch.delenv("LLAMACPP_SRC", raising=False)
    cache = tmp_path / "cache"
    llamacpp.extract_source(make_sdist(tmp_path / "a.tar.gz"), cache / "src")
    assert llamacpp.find_llama_bench(cache=cache, cuda_arch=None) is None
    build_dir, _, _ = llamacpp.build_dir_for(cache, cache / "src", None)
    binary = _executable(build_dir / "bin" / "llama-bench")
    assert llamacpp.find_llama_bench(cache=cache, cuda_arch=None) is None     # interrupted build: no stamp
    (build_dir / llamacpp.BUILD_STAMP).write_text("{}")
    assert llamacpp.find_llama_bench(cache=cache, cuda_arch=None) == binary
    assert llamacpp.find_llama_bench(cache=cache, cuda_arch="90") is None     # a CUDA build has another key
    assert llamacpp.build(cache / "src", cache, cuda_arch=None) == binary     # cached: cmake is not run


def test_explicit_binary_wins(tmp_path, monkeypatch):
    binary = _executable(tmp_path / "bin" / "llama-bench")
    monkeypatch.setenv("LLAMA_BENCH", str(binary))
    assert llamacpp.find_llama_bench(cache=tmp_path / "empty") == binary
    assert llamacpp.ensure_llama_bench(cache=tmp_path / "empty") == binary
    monkeypatch.setenv("LLAMA_BENCH", str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        llamacpp.find_llama_bench(cache=tmp_path / "empty")


def test_detect_cuda_arch(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert llamacpp.detect_cuda_arch() is None
    _executable(tmp_path / "nvidia-smi", "#!/bin/sh\necho 9.0\necho 9.0\n")
    assert llamacpp.detect_cuda_arch() == "90"
    _executable(tmp_path / "nvidia-smi", "#!/bin/sh\necho 'NVIDIA-SMI has failed'\nexit 9\n")
    assert llamacpp.detect_cuda_arch() is None


def test_cli_path_without_build(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("LLAMA_BENCH", raising=False)
    monkeypatch.delenv("LLAMACPP_SRC", raising=False)
    assert llamacpp.main(["path", "--cache", str(tmp_path), "--cpu"]) == 1
    assert "no llama-bench build" in capsys.readouterr().err


@pytest.mark.skipif(not (llamacpp.DEFAULT_CACHE / "src" / llamacpp.SOURCE_MARKER).is_file(),
                    reason="no fetched llama.cpp source (python -m benchmarks.llamacpp fetch)")
def test_real_extract_is_small_and_complete():
    src = llamacpp.DEFAULT_CACHE / "src"
    size = sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    assert size < 30e6
    for needed in ("CMakeLists.txt", "tools/llama-bench/llama-bench.cpp", "ggml/src/ggml-cuda/fattn.cu",
                   "src/models/qwen35.cpp", "common/arg.cpp", "vendor/cpp-httplib/CMakeLists.txt"):
        assert (src / needed).is_file(), needed
    assert os.access(src / "CMakeLists.txt", os.R_OK)


@pytest.mark.parametrize("devices, visible, split, note", [
    ([0], "0", "none", None),
    ([2], "2", "none", None),
    ([0, 1], "0,1", "layer", None),
    ([1, 0], "1,0", "layer", None),                     # first-use order: llama.cpp's first layers on GPU 1 too
    ([0, 0], "0", "none", "shards sharing a device apply to ninfer only (2 shards); llama.cpp runs unsplit on it"),
    ([0, 1, 1], "0,1", "layer", "shards sharing a device apply to ninfer only (3 shards); llama.cpp runs split by "
                                "layer over each of the 2 once")])
def test_llama_devices_match_our_shards(devices, visible, split, note):
    sel = llamacpp.llama_devices(devices)
    assert (sel.visible, sel.split_mode, sel.note) == (visible, split, note)
    assert sel.args() == ["-sm", split] and sel.n_devices == len(set(devices))
    assert sel.as_settings() == {"cuda_visible_devices": visible, "split_mode": split,
                                 "n_devices": len(set(devices)), "note": note}


def test_llama_devices_map_our_ordinals_through_cuda_visible_devices():
    # our ids are numba's ordinals inside the parent's CUDA_VISIBLE_DEVICES; the child must name the same GPUs
    assert llamacpp.llama_devices([2, 0], "GPU-aaa, GPU-bbb,3").visible == "3,GPU-aaa"
    assert llamacpp.llama_devices([1, 1], "4,6").visible == "6"
    with pytest.raises(ValueError, match="device 2 is not among CUDA_VISIBLE_DEVICES='4,6'"):
        llamacpp.llama_devices([0, 2], "4,6")
    with pytest.raises(ValueError, match="no devices"):
        llamacpp.llama_devices([])


def test_llama_devices_env_replaces_only_the_device_list():
    base = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    env = llamacpp.llama_devices([3, 1], base["CUDA_VISIBLE_DEVICES"]).env(base)
    assert env == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "3,1"}
    assert base["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
