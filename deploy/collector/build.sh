#!/usr/bin/env bash
# Build the Collector described by manifest.yaml once per machine.
#
# The binary lands in a cache directory keyed by the manifest's hash, so a
# second call (another test run, CI after a developer) only finds it. Prints
# the binary's path on its last line; the build time is kept beside it in
# build-info.txt. Never writes into the repository.
#
#   DURABLE_CHECK_CACHE   cache root (default: $XDG_CACHE_HOME or ~/.cache, /durable-check)
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
manifest="$here/manifest.yaml"
builder_version="v0.161.0"  # the release every module in the manifest is at
binary_name="otelcol-durable-check"

command -v go >/dev/null || { echo "build.sh: Go is not on PATH; the Collector needs Go 1.26 to build" >&2; exit 1; }

hash="$(sha256sum "$manifest" | cut -c1-16)"
cache_root="${DURABLE_CHECK_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/durable-check}"
dest="$cache_root/otelcol-$hash"
binary="$dest/$binary_name"

if [ -x "$binary" ]; then
  echo "$binary"
  exit 0
fi

mkdir -p "$cache_root"
# One build at a time per cache: parallel test runs wait for the first.
exec 9>"$cache_root/otelcol-$hash.lock"
flock 9
if [ -x "$binary" ]; then
  echo "$binary"
  exit 0
fi

work="$(mktemp -d "$cache_root/otelcol-$hash.build.XXXXXX")"
trap 'rm -rf "$work"' EXIT
start=$(date +%s)
echo "build.sh: building the Collector ($builder_version, manifest $hash); this takes minutes the first time" >&2
GOBIN="$work/bin" go install "go.opentelemetry.io/collector/cmd/builder@$builder_version" >&2
# output_path in the manifest is relative: the generated sources go to $work.
(cd "$work" && "$work/bin/builder" --config "$manifest" >&2)
end=$(date +%s)

mkdir -p "$dest.tmp"
mv "$work/otelcol-build/$binary_name" "$dest.tmp/$binary_name"
{
  echo "manifest_sha256_prefix=$hash"
  echo "builder=$builder_version"
  echo "go=$(go env GOVERSION)"
  echo "build_seconds=$((end - start))"
  echo "built_at=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
} >"$dest.tmp/build-info.txt"
rm -rf "$dest"
mv "$dest.tmp" "$dest"
echo "build.sh: built in $((end - start)) s" >&2
echo "$binary"
