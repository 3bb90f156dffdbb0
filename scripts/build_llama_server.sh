#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` (the benchmark peer with parallel slots) from the llama.cpp sources inside the
# llama-cpp-python 0.3.36 sdist, linked against the libllama/libggml/libmtmd that the installed llama-cpp-python
# wheel already carries: the server computes with the very libraries `bench weights`/`bench llamacpp` measure in
# process, and only cpp-httplib, llama-common, the (empty) web UI stub and the server itself are compiled
# (~70 files instead of ~330). Prints the `export HAFIZA_LLAMA_SERVER=...` line at the end.
#
#   scripts/build_llama_server.sh [WORK_DIR]      (default /tmp/lcp; JOBS=2 and NICE=10 by default)
set -euo pipefail
work=${1:-/tmp/lcp}
jobs=${JOBS:-2}
nice=${NICE:-10}
version=0.3.36
python=${PYTHON:-.venv/bin/python}
libdir=$("$python" -c "import llama_cpp, pathlib; print(pathlib.Path(llama_cpp.__file__).parent / 'lib')")
[ -f "$libdir/libllama.so" ] || { echo "no libllama.so in $libdir: install llama-cpp-python==$version first" >&2; exit 1; }
src=$work/llama_cpp_python-$version/vendor/llama.cpp
build=$work/build
mkdir -p "$work"
if [ ! -d "$src" ]; then
  "$python" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work"
  tar xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
fi
# The same CPU flags as the Makefile's LLAMA_CMAKE; AVX-512 only where the CPU has it (an AVX2-only CPU would stop
# with SIGILL). No prebuilt web UI: it would be fetched from a hub at build time, and the bench runs --no-webui.
avx512=()
grep -qw avx512f /proc/cpuinfo && avx512=(-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON)
nice -n "$nice" cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_AVX2=ON \
  -DGGML_FMA=ON -DGGML_F16C=ON "${avx512[@]}" -DLLAMA_CURL=OFF -DLLAMA_USE_PREBUILT_UI=OFF >/dev/null
# The wheel's shared libraries stand where the build would have put its own.
mkdir -p "$build/bin"
for lib in "$libdir"/lib*.so.*.*; do
  name=$(basename "$lib")
  ln -sf "$lib" "$build/bin/$name"
  soname=${name%.*.*}
  ln -sf "$name" "$build/bin/$soname"
  ln -sf "$soname" "$build/bin/${soname%.*}"
done
# Each target's own build.make: its objects and its link, without the rules that would compile libllama/libggml.
cd "$build"
for target in vendor/cpp-httplib/CMakeFiles/cpp-httplib.dir common/CMakeFiles/llama-common-base.dir \
    common/CMakeFiles/llama-common.dir tools/ui/CMakeFiles/llama-ui-assets.dir tools/ui/CMakeFiles/llama-ui.dir \
    tools/server/CMakeFiles/server-context.dir tools/server/CMakeFiles/llama-server-impl.dir \
    tools/server/CMakeFiles/llama-server.dir; do
  echo "== $target ($(date -u +%H:%M:%S) UTC)"
  nice -n "$nice" make -s -j "$jobs" -f "$target/build.make" "$target/build"
done
"$build/bin/llama-server" --version
echo "export HAFIZA_LLAMA_SERVER=$build/bin/llama-server"
