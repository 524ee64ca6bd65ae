#!/usr/bin/env bash
# torchtitan 0.3.0, and what it needs that a CUDA torch image with transformers lacks, installed
# from wheels/ with no network and without touching torch. The GPU session's one command
# (`bench.py --parts titan`, issue 34; about 7.5 minutes on one H200, estimated):
#
#   bash scripts/gpu_setup.sh && PYTHONPATH=. python3 scripts/bench.py --parts titan
#
# wheels/ is git-ignored (2.6 MB): fill it where PyPI is reached, with `bash scripts/gpu_setup.sh
# --download`, and carry it to the GPU machine (the device tool: carry wheels, and data/shards_16k
# if it was prepared here, which saves the ~45 s of tokenizing there).
#
# Why each: torchtitan imports tyro (its config CLI), spmd_types and torch_checkpointing at import,
# and HF datasets (trainer -> validate -> hf_datasets), whose dill and multiprocess the image
# lacks (it has pyarrow, pandas, xxhash); recipes.job needs torchdata. wandb is imported only
# when enabled. The pins are torchtitan 0.3.0's requirements as resolved on 2026-11-28.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(
  torchtitan==0.3.0
  spmd_types==0.2.3
  torch_checkpointing==0.1.1
  tyro==1.0.17
  docstring-parser==0.18.0
  typeguard==4.6.1
  datasets==4.7.0
  dill==0.4.0
  multiprocess==0.70.18
  torchdata==0.11.0
)

if [[ "${1:-}" == "--download" ]]; then
  # The GPU image's Python is 3.12 (multiprocess ships one wheel per Python version).
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_17_x86_64 -d wheels "${WHEELS[@]}"
  ls -l wheels
  exit 0
fi

# Only what is missing: the image's own versions (and its torch) stay as they are.
installed=$(python3 -m pip list --format=freeze 2>/dev/null | tr 'A-Z_' 'a-z-' | cut -d= -f1)
missing=()
for spec in "${WHEELS[@]}"; do
  name=$(echo "${spec%%==*}" | tr 'A-Z_' 'a-z-')
  grep -qx "$name" <<<"$installed" || missing+=("$spec")
done
if ((${#missing[@]})); then
  echo "installing from wheels/: ${missing[*]}"
  python3 -m pip install -q --no-index --no-deps --find-links wheels "${missing[@]}"
fi
python3 -c "import importlib.metadata as m, torch, torchtitan.trainer;
print('torch', torch.__version__, '| torchtitan', m.version('torchtitan'), '| cuda',
      torch.cuda.is_available())"
