#!/usr/bin/env bash
# Builds, on a machine with PyPI, the wheels scripts/gpu_check.py needs on a GPU machine that has no network and only
# its image's packages; checks that they and the working tree fit in what one call to that machine carries; prints the
# one command to run there. See `scripts/gpu_wheelhouse.sh --help` and docs/scaling.md ("Checking a GPU machine").
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: scripts/gpu_wheelhouse.sh [--flashinfer] [--out DIR] [--limit-mib N] [--python PY] [--print-command]

Builds one set of cp312 manylinux x86_64 wheels (one pinned version each) for a GPU machine whose image has
Python 3.12, torch 2.11 (CUDA 13.0), transformers 5.17 and the rest IMAGE_HAS in this script lists, no network,
then prints the command to run there in the repository root (the working tree and the set's folder copied there):

  (default)      DIR/base: what gpu_check.py needs beyond the image (DeepSpeed, pydantic, datasets and their
                 needs), and apache-tvm-ffi, which `import flashinfer` needs (carried in this set, because the
                 FlashInfer wheel fills the second call alone). The command installs it into /tmp/wh and runs
                 gpu_check.py, every section (FlashInfer's skips: not installed yet).
  --flashinfer   DIR/flashinfer: flashinfer-python alone (a 62 MB wheel). Build the base set first. The command,
                 for the same machine still warm after the first (it needs /tmp/wh), installs it into /tmp/wh-fi
                 and runs gpu_check.py's flashinfer section twice: the first run compiles FlashInfer's kernels
                 (JIT, cached in /tmp/fi-jit), the second reuses them; the difference is the JIT time.

Options:
  --out DIR        the wheelhouse folder (default: wheelhouse, which .gitignore leaves out). This script owns
                   DIR/base and DIR/flashinfer: it replaces the wheels in the set it builds.
  --limit-mib N    what one call may carry, the working tree's files (tracked and untracked-not-ignored) and the
                   set together, in MiB (default 64); the script fails when the set and the tree are over it
  --python PY      the Python that runs pip and builds DeepSpeed's wheel; it must import torch
                   (default: .venv/bin/python)
  --print-command  print the set's command for the GPU machine and nothing else; build nothing
  -h, --help       show this help

The device command's output folder is $OUT (the folder a lent machine sends back), else ./gpu-check-out.
EOF
}

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MODE=base
OUT_DIR=wheelhouse
LIMIT_MIB=64
PY=.venv/bin/python
PRINT_ONLY=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --flashinfer) MODE=flashinfer; shift ;;
    --out) OUT_DIR=${2:?--out needs a folder}; shift 2 ;;
    --limit-mib) LIMIT_MIB=${2:?--limit-mib needs a number}; shift 2 ;;
    --python) PY=${2:?--python needs an interpreter}; shift 2 ;;
    --print-command) PRINT_ONLY=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_wheelhouse.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
cd "$REPO"
if [[ ! "$LIMIT_MIB" =~ ^[0-9]+$ ]]; then
  echo "gpu_wheelhouse.sh: --limit-mib takes a whole number of MiB, not '$LIMIT_MIB'" >&2; exit 2
fi
if [[ "$OUT_DIR" == /* || "/$OUT_DIR/" == */../* ]]; then  # it travels with the working tree: inside the checkout
  echo "gpu_wheelhouse.sh: --out names a folder inside the repository, relative to its root, not '$OUT_DIR'" >&2
  exit 2
fi
SET_DIR="$OUT_DIR/$MODE"

# ---- the command for the GPU machine -------------------------------------------------------------------------------
# Each ends 570 s after it starts, its install included (a lent machine's call stops at 600 s): D is that deadline in
# bash's SECONDS, and each timeout is what is left of it (at least 10 s: `timeout 0` would never stop).
OFFLINE='HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled PYTHONUNBUFFERED=1'
PIP_INSTALL='python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target'
PACKAGES_SEEN="python3 -m pip list 2>/dev/null | grep -iE '^(torch|transformers|pyarrow|fsspec|huggingface.hub|pandas|numpy|typing.extensions|xxhash) '"
LEFT='$(( D - SECONDS > 10 ? D - SECONDS : 10 ))'
LEFT_BUT_120='$(( D - SECONDS - 120 > 10 ? D - SECONDS - 120 : 10 ))'
if [[ "$MODE" == base ]]; then
  COMMAND="set -o pipefail; D=\$((SECONDS + 570)); O=\"\${OUT:-gpu-check-out}\"; \
$PIP_INSTALL /tmp/wh $SET_DIR/*.whl || exit; export PYTHONPATH=/tmp/wh:. $OFFLINE; $PACKAGES_SEEN; \
mkdir -p \"\$O/gpu_check\"; timeout $LEFT python3 scripts/gpu_check.py --out \"\$O/gpu_check\" 2>&1 \
| tee \"\$O/gpu_check/log.txt\""
else
  COMMAND="set -o pipefail; D=\$((SECONDS + 570)); O=\"\${OUT:-gpu-check-out}\"; \
test -d /tmp/wh/deepspeed || { echo 'no /tmp/wh here: run the base set first, on this machine'; exit 3; }; \
test -d /tmp/wh-fi/flashinfer || $PIP_INSTALL /tmp/wh-fi $SET_DIR/*.whl || exit; \
export PYTHONPATH=/tmp/wh-fi:/tmp/wh:. FLASHINFER_WORKSPACE_BASE=/tmp/fi-jit $OFFLINE; \
mkdir -p \"\$O/fi_jit\" \"\$O/fi_cached\"; \
timeout $LEFT_BUT_120 python3 scripts/gpu_check.py --sections env flashinfer --out \"\$O/fi_jit\" 2>&1 \
| tee \"\$O/fi_jit/log.txt\"; \
timeout $LEFT python3 scripts/gpu_check.py --sections flashinfer --out \"\$O/fi_cached\" 2>&1 \
| tee \"\$O/fi_cached/log.txt\""
fi
if [[ "$PRINT_ONLY" == 1 ]]; then
  echo "$COMMAND"
  exit 0
fi

if ! "$PY" -c "import torch, packaging, pip" 2>/dev/null; then
  echo "gpu_wheelhouse.sh: $PY cannot import torch, packaging and pip (DeepSpeed's build imports torch); run" \
       "\`make setup\` first or name another interpreter with --python" >&2
  exit 2
fi

# ---- the pins: one version each, the versions this repository's test suite runs with ---------------------------------
# What gpu_check.py (and the `mtp-train train` processes it starts) imports that the image lacks. pydantic: the recipe
# (mtp_train/recipe.py) and DeepSpeed's config; datasets: prepare; deepspeed: training.
BASE_PINS=(
  "pydantic==2.14.4"
  "pydantic-core==2.50.5"
  "annotated-types==0.8.0"
  "typing-inspection==0.4.5"
  "typing-extensions==4.16.0"     # the image has one, of a version nobody read; pydantic-core 2.50 needs >= 4.16
  "datasets==5.2.0"
  "dill==0.4.1"                   # datasets' needs the image lacks
  "multiprocess==0.70.19"
  "hjson==3.1.0"                  # DeepSpeed's
  "apache-tvm-ffi==0.1.15.post2"  # flashinfer-python's (`import flashinfer` imports tvm_ffi): see --help
)
DEEPSPEED_VERSION=0.19.8  # a source archive on PyPI: its pure-Python wheel is built here (DS_BUILD_OPS=0)
# The version gpu_check.py is to run FlashInfer with (pyproject.toml's `gpu` extra names the same).
FLASHINFER_PINS=("flashinfer-python==0.7.2.post1")

# The GPU image's packages that the carried wheels' requirements name (as read on the machine, 2026-11; a version
# where one was read). A requirement that is neither carried nor here fails the check below.
IMAGE_HAS="torch==2.11.0 transformers==5.17.0 safetensors==0.8.0 tokenizers==0.23.2 huggingface-hub==1.33.0
numpy==2.5.2 pyarrow fsspec pandas python-dateutil xxhash filelock packaging pyyaml tqdm requests httpx aiohttp
einops msgpack ninja psutil py-cpuinfo nvidia-ml-py click tabulate typing-extensions cuda-bindings cuda-pathfinder
cuda-core jinja2"
# flashinfer-python's requirements left behind on purpose: imported only by kernels this project does not call
# (cuDNN, CuTe-DSL, cuTile and NCCL paths); `import flashinfer` and its decode/prefill wrappers import none of them.
NOT_CARRIED="cuda-python cuda-tile nccl-extensions nccl4py nvidia-cudnn-frontend nvidia-cutlass-dsl"
# Image packages carried all the same, for a version the image may lack (PYTHONPATH puts the carried one first).
OVER_IMAGE="typing-extensions"

PLATFORMS=(manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64
           manylinux_2_28_x86_64 manylinux1_x86_64)

mkdir -p "$OUT_DIR"
STAGING=$(mktemp -d "$OUT_DIR/.staging-$MODE.XXXXXX")
trap 'rm -rf "$STAGING"' EXIT

download() {  # the cp312 manylinux x86_64 (or pure) wheels of the pins given, no dependencies
  local platform_args=()
  for platform in "${PLATFORMS[@]}"; do platform_args+=(--platform "$platform"); done
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platform_args[@]}" --dest "$STAGING" "$@"
}

if [[ "$MODE" == base ]]; then
  echo "downloading ${#BASE_PINS[@]} wheels into $SET_DIR ..."
  download "${BASE_PINS[@]}"
  echo "building deepspeed==$DEEPSPEED_VERSION's pure-Python wheel from its source archive (DS_BUILD_OPS=0) ..."
  # No build isolation: DeepSpeed's setup.py imports torch. Its kernels are compiled on the GPU machine when used
  # (ninja and nvcc are in the image); gpu_check.py's ZeRO-2 with torch's AdamW needs none of them.
  # No cache either: pip would reuse a wheel built earlier with other settings (ops compiled in).
  DS_BUILD_OPS=0 "$PY" -m pip wheel --quiet --no-cache-dir --no-deps --no-build-isolation --no-binary deepspeed \
    --wheel-dir "$STAGING" "deepspeed==$DEEPSPEED_VERSION"
else
  if ! compgen -G "$OUT_DIR/base/*.whl" >/dev/null; then
    echo "gpu_wheelhouse.sh: $OUT_DIR/base has no wheels; build the base set first (scripts/gpu_wheelhouse.sh)," \
         "whose call installs what flashinfer-python needs beside its own wheel" >&2
    exit 1
  fi
  echo "downloading ${FLASHINFER_PINS[*]} into $SET_DIR ..."
  download "${FLASHINFER_PINS[@]}"
fi

# ---- checks: tags, one version each, every requirement met, the size ---------------------------------------------------
TREE_BYTES=$(git ls-files -z --cached --others --exclude-standard | "$PY" -c '
import os, sys
names = [n for n in sys.stdin.buffer.read().decode().split("\0") if n]
print(sum(os.path.getsize(n) for n in names if os.path.isfile(n) and not os.path.islink(n)))')
if [[ -d shared ]]; then  # a shared/ folder in the checkout travels too
  TREE_BYTES=$((TREE_BYTES + $(du -sb shared | cut -f1)))
fi

"$PY" - "$STAGING" "$OUT_DIR/base" "$MODE" "$TREE_BYTES" "$LIMIT_MIB" "$IMAGE_HAS" "$NOT_CARRIED" "$OVER_IMAGE" \
  <<'PYEOF'
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

staging, base_dir, mode, tree_bytes, limit_mib, image_has, not_carried, over_image = sys.argv[1:]
MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
problems = []


def wheels(folder):
    """{name: (version, path, metadata)} of the wheels in `folder`; two versions of one name are a problem."""
    found = {}
    for path in sorted(Path(folder).glob("*.whl")):
        name, version, _, tags = parse_wheel_filename(path.name)
        if name in found:
            problems.append(f"two versions of {name}: {found[name][0]} and {version}")
        if not any(t.interpreter in ("py3", "py312", "cp312") and t.abi in ("none", "abi3", "cp312")
                   and (t.platform == "any" or (t.platform.startswith("manylinux") and t.platform.endswith("x86_64")))
                   for t in tags):
            problems.append(f"{path.name} is not a wheel for CPython 3.12 on manylinux x86_64")
        with zipfile.ZipFile(path) as archive:
            meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
            found[name] = (version, path, Parser().parsestr(archive.read(meta).decode()))
    return found


carried = wheels(staging)
if mode == "flashinfer":
    # the base set is on the machine already (/tmp/wh); its wheels meet flashinfer-python's needs
    available = {**wheels(base_dir), **carried}
else:
    available = carried
image = {}
for item in image_has.split():
    name, _, version = item.partition("==")
    image[canonicalize_name(name)] = Version(version) if version else None
left_behind = {canonicalize_name(n) for n in not_carried.split()}
over = {canonicalize_name(n) for n in over_image.split()}

for name, (version, path, meta) in sorted(carried.items()):
    if name in image and name not in over:
        problems.append(f"{name} is in the image already; carry it only for another version (drop its pin)")
    for line in meta.get_all("Requires-Dist") or []:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate(MARKERS):
            continue  # an extra, or another platform's
        needed = canonicalize_name(requirement.name)
        if needed in available:
            have = available[needed][0]
        elif needed in image:
            have = image[needed]
        elif needed in left_behind:
            continue
        else:
            problems.append(f"{name} {version} needs {requirement}, which is neither carried nor in the image")
            continue
        if have is not None and requirement.specifier and not requirement.specifier.contains(have, prereleases=True):
            problems.append(f"{name} {version} needs {requirement}; the {'set' if needed in available else 'image'} "
                            f"has {needed} {have}")

set_bytes = sum(path.stat().st_size for _, path, _ in carried.values())
limit = int(limit_mib) * 2**20
total = set_bytes + int(tree_bytes)
print(f"{mode} set: {len(carried)} wheels, {set_bytes / 2**20:.2f} MiB")
for name, (version, path, _) in sorted(carried.items()):
    print(f"  {path.stat().st_size / 2**20:7.2f} MiB  {path.name}")
print(f"working tree (tracked and untracked-not-ignored files): {int(tree_bytes) / 2**20:.2f} MiB")
print(f"one call carries {total / 2**20:.2f} MiB of at most {limit_mib} MiB ({(limit - total) / 2**20:.2f} MiB left)")
if total > limit:
    problems.append(f"the set ({set_bytes / 2**20:.2f} MiB) and the working tree ({int(tree_bytes) / 2**20:.2f} MiB) "
                    f"are {total / 2**20:.2f} MiB, over the {limit_mib} MiB one call carries")
if problems:
    print("gpu_wheelhouse.sh: the set is not fit to carry:\n  " + "\n  ".join(problems), file=sys.stderr)
    sys.exit(1)
PYEOF

mkdir -p "$SET_DIR"
rm -f "$SET_DIR"/*.whl  # this script's own wheels of this set (see --help)
mv "$STAGING"/*.whl "$SET_DIR"/

if [[ "$MODE" == base ]]; then
  echo
  echo "The first call: on the GPU machine, in the repository root with $SET_DIR/ copied beside the working tree"
  echo "(a lent machine's run: carry [\"$SET_DIR\"], timeout_s 600), run this one line; gpu_check.json and log.txt"
  echo "come back in \$OUT/gpu_check:"
else
  echo
  echo "The second call: on the same GPU machine, still warm after the first (it keeps /tmp/wh), in the repository"
  echo "root with $SET_DIR/ copied there (a lent machine's run: carry [\"$SET_DIR\"] alone, timeout_s 600),"
  echo "run this one line. The flashinfer section's seconds in \$OUT/fi_jit/gpu_check.json less those in"
  echo "\$OUT/fi_cached/gpu_check.json are the JIT time; if the first run times out compiling, run the line again:"
  echo "/tmp/fi-jit keeps what was compiled, /tmp/wh-fi the install."
fi
echo
echo "$COMMAND"
echo
echo "(the command is ${#COMMAND} characters)"
