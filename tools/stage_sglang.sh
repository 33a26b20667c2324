#!/usr/bin/env bash
# Stage SGLang (policy.generation.backend: sglang) for the GPU host, apart from the vLLM stack: its pins clash with
# vLLM 0.22's (apache-tvm-ffi, xgrammar, openai, transformers), so it goes into a site folder of its own,
# /tmp/gpu-site-sglang, put in front of the stack's only where SGLang runs (docs/rollout-engines.md).
#
# On the CPU machine, from the checkout root, after ../shared/gpu-host/stage.sh:
#   bash tools/stage_sglang.sh
# Wheels: pyproject.toml's `sglang` extra (python tools/pins.py --extra sglang) and tools/sglang-host-requirements.txt
# (what SGLang imports that the host lacks), cp312 manylinux x86_64 or pure Python, cached in
# ${GPU_HOST_WHEEL_CACHE:-~/.cache/gpu-host-wheels}. Writes .stage-sglang/ (added to .git/info/exclude):
#   chunk.NN    pieces of one tar of the wheels, CHUNK_MB (default 40) MiB each: one transfer holds 64 MiB
#   MANIFEST    chunk names and sha256 sums
#   install.sh  tools/install_sglang.sh: checks, unpacks and installs them on the GPU host
set -euo pipefail
root="$(git rev-parse --show-toplevel)"
cd "$root"
cache="${GPU_HOST_WHEEL_CACHE:-$HOME/.cache/gpu-host-wheels}"
stage="$root/.stage-sglang"
mkdir -p "$cache"
excl="$(git rev-parse --git-path info/exclude)"; mkdir -p "$(dirname "$excl")"
grep -qxF "/.stage-sglang/" "$excl" 2>/dev/null || echo "/.stage-sglang/" >> "$excl"

extra=$(PYTHONPATH="$root" python3 tools/pins.py --extra sglang)
host=$(grep -v '^\s*#' tools/sglang-host-requirements.txt | sed 's/#.*//' | awk 'NF{print $1}')
pins="$extra $host"
plat=(--python-version 3.12 --implementation cp --only-binary=:all: --no-deps)
for t in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_17 manylinux2014; do
  plat+=(--platform "${t}_x86_64")
done
plat+=(--platform any)

find_wheel() {  # $1=name $2=version -> the cached wheel's file name, if any (names compared as pip normalises them)
  local norm; norm=$(echo "$1" | tr 'A-Z.-' 'a-z__')
  ls "$cache" | awk -v n="$norm" -v v="$2" '/\.whl$/ {split($0,a,"-"); x=tolower(a[1]); gsub(/[-.]/,"_",x);
    if (!f && x==n && a[2]==v) {print; f=1}}'
}
missing=()
for p in $pins; do [ -n "$(find_wheel "${p%%==*}" "${p##*==}")" ] || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "downloading ${#missing[@]} wheels" >&2
  python3 -m pip download -q "${plat[@]}" -d "$cache" "${missing[@]}" 2>&1 | grep -v -i warning >&2 || true
fi
want=()
for p in $pins; do
  hit=$(find_wheel "${p%%==*}" "${p##*==}")
  [ -n "$hit" ] || { echo "stage_sglang.sh: no cp312 manylinux x86_64 wheel for $p" >&2; exit 1; }
  want+=("$cache/$hit")
done

rm -rf "$stage"; mkdir -p "$stage/bundle"
for w in "${want[@]}"; do ln -s "$w" "$stage/bundle/"; done
tar chf - -C "$stage/bundle" . | split -b "${CHUNK_MB:-40}M" -d -a 2 - "$stage/chunk."
rm -rf "$stage/bundle"
cp tools/install_sglang.sh "$stage/install.sh"
(cd "$stage" && sha256sum chunk.* > MANIFEST)
n=$(ls "$stage"/chunk.* | wc -l)
echo "staged ${#want[@]} SGLang wheels in $n chunks under .stage-sglang/ ($(du -sh "$stage" | cut -f1))."
echo "Carry each chunk on its own after the stack's (.stage/), then .stage-sglang/install.sh and MANIFEST; there:"
echo "  bash .stage/install.sh && bash .stage-sglang/install.sh && source /tmp/gpu-site-sglang/env.sh"
