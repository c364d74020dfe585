#!/usr/bin/env bash
# Fuzzes the parsers that peers and strangers feed: the handshake, dynamic-channel records,
# descriptors and a peer's region table (libFuzzer, clang, ASan+UBSan), and the rendezvous
# store's message handling (atheris). Seeds are kept in tests/fuzz/corpus/<target>; what a
# run finds goes to build/fuzz/corpus/<target> (and crash-* files to build/fuzz/).
#
#   bash tests/fuzz/run.sh            # 30 s per target (what .ci/run does)
#   bash tests/fuzz/run.sh 600        # longer, on demand
# Needs clang-14 and libclang-rt-14-dev (apt), and atheris (pip) in the active Python.
set -euo pipefail
cd "$(dirname "$0")/../.."
SECONDS_EACH=${1:-30}
CXX=${CXX:-clang++-14}
BUILD=build/fuzz
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_CXX_COMPILER="$CXX" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DRDKERAS_PYTHON=OFF -DRDKERAS_FUZZ=ON "-DRDKERAS_SANITIZE=address,undefined,fuzzer-no-link" > "$BUILD.log" 2>&1 \
  || { cat "$BUILD.log"; exit 1; }
cmake --build "$BUILD" --parallel 2 > "$BUILD.build.log" 2>&1 || { tail -50 "$BUILD.build.log"; exit 1; }
status=0
for target in handshake record descriptor region; do
  mkdir -p "$BUILD/corpus/$target"
  log="$BUILD/$target.log"
  if (cd "$BUILD" && "./${target}_fuzz" -max_total_time="$SECONDS_EACH" -print_final_stats=1 \
        "corpus/$target" "../../tests/fuzz/corpus/$target") > "$log" 2>&1; then
    runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$')
    echo "fuzz $target: $runs executions in ${SECONDS_EACH} s, corpus $(ls "$BUILD/corpus/$target" | wc -l) new + $(ls "tests/fuzz/corpus/$target" | wc -l) seeds, no finding"
  else
    echo "fuzz $target: FOUND A CRASH (see $log and $BUILD/crash-*)"; tail -40 "$log"; status=1
  fi
done
mkdir -p "$BUILD/corpus/store"
log="$BUILD/store.log"
if timeout $((SECONDS_EACH + 60)) python tests/fuzz/store_fuzz.py -max_total_time="$SECONDS_EACH" \
    "$BUILD/corpus/store" tests/fuzz/corpus/store > "$log" 2>&1; then
  runs=$(grep -o 'Done [0-9]* runs' "$log" | grep -o '[0-9]*' || echo "?")
  echo "fuzz store (atheris): $runs executions in ${SECONDS_EACH} s, corpus $(ls "$BUILD/corpus/store" | wc -l) new + $(ls tests/fuzz/corpus/store | wc -l) seeds, no finding"
else
  echo "fuzz store (atheris): FOUND A PROBLEM (see $log)"; tail -40 "$log"; status=1
fi
exit $status
