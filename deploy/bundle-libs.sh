# Sourced by tests/gpu/make_kit.sh (the GPU kit) and deploy/make-wheel.sh (the Python wheel): what
# a bundle of tierd's binaries needs to run from any folder on a machine with nothing installed.

# Every library the FILEs load, by the paths this machine resolves them to (with the caller's
# LD_LIBRARY_PATH), copied into DEST — except glibc, libstdc++ and libgcc_s, which the host
# provides, and libtierd_client.so.0, which the bundle places itself. Fails when one is not found.
#   bundle_libraries DEST FILE...
bundle_libraries() {
  local dest=$1 host_provided lib name
  shift
  host_provided='^(libc|libm|libdl|librt|libpthread|libstdc\+\+|libgcc_s|ld-linux-x86-64)\.so'
  if ldd "$@" | grep -q "not found"; then
    echo "bundle_libraries: a library is not found:" >&2
    ldd "$@" | grep "not found" >&2
    return 1
  fi
  for lib in $(ldd "$@" | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u); do
    name=$(basename "$lib")
    [[ "$name" =~ $host_provided || "$name" == libtierd_client.so.0 ]] && continue
    cp -L "$lib" "$dest/$name"
  done
}

# The newest version of the symbols the FILEs take from the host with PREFIX (GLIBC or GLIBCXX),
# as PREFIX_X.Y.
#   newest_symbol_version PREFIX FILE...
newest_symbol_version() {
  local prefix=$1 f
  shift
  for f in "$@"; do
    objdump -T "$f" | grep -o "${prefix}_[0-9.]*" || true
  done | sort -u -V | tail -1
}
