# Shared by scripts/test and scripts/demo: configure and build quietly, one clear line when a step fails.
ps_configure() { # ps_configure <build-dir> [cmake -D options...]
  local dir=$1; shift
  mkdir -p "$dir"
  echo "== configure $(basename "$dir") $*"
  if ! cmake -S "$root" -B "$dir" -G Ninja "$@" >"$dir/configure.log" 2>&1; then
    grep -A4 -m3 "CMake Error" "$dir/configure.log" | sed 's/^/   | /' >&2 || true
    echo "FAILED: cmake configure of $dir (full log: $dir/configure.log)" >&2
    exit 1
  fi
}
ps_build() { # ps_build <build-dir> <targets...>
  local dir=$1; shift
  echo "== build $(basename "$dir"): $* ($jobs jobs)"
  local start=$SECONDS
  local rc=0
  cmake --build "$dir" -j"$jobs" --target "$@" > >(tee "$dir/build.log" | grep --line-buffered -E '^\[[0-9]+/[0-9]+\] (Building|Linking)') 2>&1 || rc=$?
  wait
  if [ "$rc" != 0 ]; then
    grep -E -m5 -B2 -A6 "error|Error" "$dir/build.log" | head -60 | sed 's/^/   | /' >&2 || true
    echo "FAILED: build of $* in $dir (full log: $dir/build.log)" >&2
    exit 1
  fi
  echo "== built in $((SECONDS - start)) s"
}
ps_sanitized_test_targets() { # the test executables run under ASan + UBSan that exist in this build
  local t out=()
  for t in chunk_tests comm_tests optimizer_tests overlap_tests memtracer_tests engine_tests; do
    if grep -q "^build $t:\|^build ${t}:" "$1/build.ninja" 2>/dev/null || grep -q "/$t:" "$1/build.ninja" 2>/dev/null; then
      out+=("$t")
    fi
  done
  echo "${out[@]}"
}
