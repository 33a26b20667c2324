#!/usr/bin/env bash
# On the GPU host, after ../shared/gpu-host's install (/tmp/gpu-site): put the chunks tools/stage_sglang.sh wrote
# together (this script travels as .stage-sglang/install.sh, beside them) and install them with --no-deps into
# /tmp/gpu-site-sglang, SGLang's own site folder; writes /tmp/gpu-site-sglang/env.sh, which sources the stack's
# env.sh and puts this folder in front of it, then checks that SGLang's engine imports.
# Idempotent: a second call on the same host only checks. Exit 3: a chunk missing or damaged (named);
# exit 4: the engine does not import (the missing module named: add its wheel to tools/sglang-host-requirements.txt).
# Afterwards:  source /tmp/gpu-site-sglang/env.sh
set -euo pipefail
stage="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
site=/tmp/gpu-site-sglang
[ -f /tmp/gpu-site/env.sh ] || { echo "install_sglang.sh: /tmp/gpu-site/env.sh missing: run .stage/install.sh first" >&2; exit 3; }
if [ ! -f "$site/.installed" ]; then
  missing=0
  while read -r sum name; do
    if [ ! -f "$stage/$name" ]; then echo "install_sglang.sh: $name has not arrived yet" >&2; missing=1; continue; fi
    echo "$sum  $stage/$name" | sha256sum -c --quiet - || { echo "install_sglang.sh: $name is damaged; send it again" >&2; missing=1; }
  done < "$stage/MANIFEST"
  [ "$missing" = 0 ] || exit 3
  rm -rf /tmp/gpu-wheels-sglang && mkdir -p /tmp/gpu-wheels-sglang
  cat "$stage"/chunk.* | tar xf - -C /tmp/gpu-wheels-sglang
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
    /tmp/gpu-wheels-sglang/*.whl 2>&1 | grep -v -E "Target directory .* already exists|WARNING: Target directory" || true
  cat > "$site/env.sh" <<ENV
source /tmp/gpu-site/env.sh
export PYTHONPATH=$site:\$PYTHONPATH
export PATH=$site/bin:\$PATH
ENV
  touch "$site/.installed"
fi
# shellcheck disable=SC1091
source "$site/env.sh"
python3 - <<'PY' || exit 4
import importlib
for m in ("sglang", "sgl_kernel", "sglang.srt.entrypoints.engine", "sglang.srt.weight_sync.tensor_bucket"):
    mod = importlib.import_module(m)
    print(f"ok   {m} {getattr(mod, '__version__', '')}")
PY
