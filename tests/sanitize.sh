#!/usr/bin/env bash
# The engine under AddressSanitizer + UndefinedBehaviorSanitizer: its C++ unit tests and its
# TensorFlow-free Python tests (one process and multi-process: conformance, failures, kill
# trials, hostile input, misuse), in a venv of their own. Any finding aborts the process it
# is in, so it fails a test; the run also fails if a sanitizer report shows up anywhere.
#
#   bash tests/sanitize.sh            # what .ci/run does
#   bash tests/sanitize.sh -k ring    # extra pytest arguments
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=build/asan
VENV=.venv-asan
mkdir -p build  # a clean clone has none; the build and its logs go there

# The C++ unit tests need doctest's header (Debian's doctest-dev, which the README's setup does not install):
# installed here when this runs as root with apt-get, else the script says what to install and stops.
if ! echo '#include <doctest/doctest.h>' | "${CXX:-c++}" -x c++ -fsyntax-only - 2> /dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
    echo "sanitize.sh: installing doctest-dev (the header of the engine's C++ unit tests)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q doctest-dev > /dev/null 2>&1 ||
      { apt-get update -q > /dev/null && apt-get install -y -q doctest-dev > /dev/null; }
  else
    echo "sanitize.sh: the engine's C++ unit tests need doctest's header (doctest/doctest.h), which is missing:" \
      "install it (Debian/Ubuntu: sudo apt-get install doctest-dev), then run this script again" >&2
    exit 1
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
"$VENV/bin/pip" install -q numpy ml-dtypes grpcio protobuf cloudpickle pybind11 pytest pytest-timeout
# CMake and Ninja: the system's, else the venv's own (pip installs both; the README's setup needs neither on PATH).
for tool in cmake ninja; do
  command -v "$tool" > /dev/null || "$VENV/bin/pip" install -q "$tool"
done
export PATH="$PATH:$PWD/$VENV/bin"
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DRDKERAS_TESTS=ON \
  "-DRDKERAS_SANITIZE=address,undefined" -DPython_EXECUTABLE="$PWD/$VENV/bin/python" \
  -Dpybind11_DIR="$("$VENV/bin/python" -m pybind11 --cmakedir)" > "$BUILD.log" 2>&1 || { cat "$BUILD.log"; exit 1; }
cmake --build "$BUILD" --parallel 2 > "$BUILD.build.log" 2>&1 || { tail -50 "$BUILD.build.log"; exit 1; }

# Python is not built with ASan: the runtime comes first in the process (with libstdc++, or the
# first C++ exception aborts inside ASan). Leaks are Python's business here; everything else halts.
LIBASAN=$(gcc -print-file-name=libasan.so)
LIBSTDCXX=$(gcc -print-file-name=libstdc++.so)
export ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=1:detect_stack_use_after_return=0
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
REPORTS=$(mktemp -d)
export ASAN_OPTIONS="$ASAN_OPTIONS:log_path=$REPORTS/asan"
export UBSAN_OPTIONS="$UBSAN_OPTIONS:log_path=$REPORTS/ubsan"

LD_PRELOAD="$LIBASAN:$LIBSTDCXX" ctest --test-dir "$BUILD" --output-on-failure

# grep reads all of ldd's output: with -q it may exit first, and pipefail then fails on ldd's SIGPIPE.
ldd "$BUILD"/_engine*.so | grep libasan > /dev/null || { echo "the module is not instrumented"; exit 1; }
# The checked module sits next to the sources for this run only (the venv has no rdkeras installed).
cp "$BUILD"/_engine*.so rdkeras/
trap 'rm -f rdkeras/_engine*.so; rm -rf "$REPORTS"' EXIT
set +e
LD_PRELOAD="$LIBASAN:$LIBSTDCXX" "$VENV/bin/python" -m pytest -p no:cacheprovider -q -o addopts="" -m "not slow" \
  tests/unit/test_engine_single.py tests/multiproc/test_conformance.py tests/multiproc/test_failures.py \
  tests/multiproc/test_hostile.py tests/multiproc/test_misuse.py tests/multiproc/test_kill_trials.py \
  tests/multiproc/test_hierarchical.py tests/multiproc/test_algorithms.py -k "not doctor and not rdkeras_command" "$@"
rc=$?
set -e
if ls "$REPORTS"/* > /dev/null 2>&1; then
  echo "sanitizer reports:"; cat "$REPORTS"/*; exit 1
fi
echo "sanitizers: no report"
exit $rc
