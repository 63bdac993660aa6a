#!/usr/bin/env bash
# The GPU check, prepared to run at once on a lent NVIDIA machine (H100 / H200) within about 8 minutes. Here, once:
#   python scripts/gpu_wheels.py          # the wheels the device lacks, into .gpu_wheels/ (ignored; ~32 MiB)
# then, with the device tool:
#   run(command="bash scripts/gpu_check.sh", carry=[".gpu_wheels"], timeout_s=480)
# Steps, in order of value, each under its own `timeout` (cut to what is left of BUDGET seconds):
#   1. bench_compile_gpt2: GPT-2-small (124 M, T=1024, bf16) through the Trainer eager / compiled / hand-compiled,
#      3 trials of 20 steps: its MFU and the compile's PAYBACK in steps (labkit.runtime.step.PAYBACK_STEPS's "cuda" row);
#   2. peers_resnet50_cl, peers_resnet50_nchw, peers_mlp: labkit / a hand loop / Lightning Fabric / Accelerate
#      (bench/bench_gpu_peers.py: each in its own process, 3 segments of 30 steps), ResNet-50 bf16 batch 64 at 224 px
#      in channels_last and in NCHW, and the MLP at batch 64 (the host tax);
#   3. fsdp2_case: FSDP2 on one GPU through labkit's own code (bench/gpu_fsdp_case.py: "cpu:gloo,cuda:nccl",
#      labkit.parallel.FullyShard of a bf16 ResNet with float32 BatchNorm units, labkit.meta_init materialized on
#      CUDA, the agreed sharded save into the CpuMirror with its STALL, restored and compared);
#   4. bench_stage (only where bench/bench_stage.py exists): labkit's stager against torch's;
#      feed_gpu_decode: torchvision's batched decode_jpeg on the GPU with a crop + resize to 224 (bench_feed.py
#      --gpu-decode), images/s against one H200's demand;
#   5. bench_compile_resnet50: ResNet-50 at 224 px, batch 128, images/s, the same three loops as 1;
#      bench_compile_gpt2_cudnn: 1. again with cuDNN's attention tried first (--sdpa cudnn), as far as the budget goes;
#   6. notebooks 08, 02, 01 on CUDA with the exercises unsolved (LABKIT_SOLUTIONS=0, LABKIT_FAST=1), each whole and
#      under its own limit, as far as the budget goes.
# Results: $OUT/results.json and $OUT/results.txt (which torch, GPU, CUDA and driver ran; every step's status, exit
# code, seconds and limit, also for a step the limit stopped or the budget left out; the RATIO/MFU/PAYBACK/HOST/CASE/
# STALL/FEED lines),
# env.txt (nvidia-smi, glibc, the wheels' install, pip list), and logs.tar.gz: each step's log and the executed
# notebooks (the device tool returns at most 8 files from $OUT).
#
# GPU_CHECK_DRY=1: the same script on the CPU at tiny sizes, in the simulated device venv (tests/test_gpu_check.py:
# Python 3.12, torch 2.11, only the device's packages plus these wheels): bench steps at a few steps, torch.compile
# with backend eager (Dynamo's capture and its graph breaks, without AOTAutograd or Inductor: aot_eager alone took
# minutes of wall time per loop on the shared 2-core machine), and notebook 08 up to its first training cell (its
# imports, parameters and set-up cell in a kernel from the carried ipykernel).
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 2
OUT=${OUT:-$ROOT/gpu_out}
PY=${PY:-python3}
WHEELS=${WHEELS:-$ROOT/.gpu_wheels}
SITE=${GPU_CHECK_SITE:-/tmp/gpu_check_site}
DRY=${GPU_CHECK_DRY:-0}
# seconds for all of it (the tool's own start and transfers come on top); the dry run's limits are generous: CI's
# 2 cores are shared, and a step that the limit stops there would say nothing of the device
BUDGET=${BUDGET:-$([ "${GPU_CHECK_DRY:-0}" = 1 ] && echo 1500 || echo 470)}
DRY_LIMIT=300
START=$(date +%s)
LOGS=${GPU_CHECK_LOGS:-/tmp/gpu_check_logs} # each step's log; $OUT gets 4 files (the tool returns at most 8)
rm -rf "$LOGS" "$LOGS"_nb
mkdir -p "$OUT" "$LOGS"
STEPS="$LOGS/steps.tsv"
: >"$STEPS"
export LABKIT_CONSOLE=1 PYTHONUNBUFFERED=1 MPLBACKEND=Agg PYTHONNOUSERSITE=1
export TORCH_DEVICE_BACKEND_AUTOLOAD=0 # no out-of-tree backend (torch_tpu) autoloads with torch
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d /tmp/gpu_check_inductor.XXXX)}

left() { echo $((BUDGET - ($(date +%s) - START))); }

# step NAME SECONDS COMMAND...: run under `timeout` (cut to what is left), log to $LOGS/NAME.txt, one line in steps.tsv
step() {
    local name=$1 limit=$2 l t0 rc status
    shift 2
    l=$(left)
    if [ "$l" -lt 20 ]; then
        printf '%s\tskipped\t\t0\t%s\n' "$name" "$limit" >>"$STEPS"
        echo "[gpu_check] $name: skipped, $l s of the budget left"
        return
    fi
    [ "$DRY" = 1 ] && limit=$DRY_LIMIT
    [ "$limit" -gt "$l" ] && limit=$l
    local cmd="$*"
    echo "[gpu_check] $name (limit $limit s): ${cmd:0:200}"
    t0=$(date +%s)
    timeout -k 10 "$limit" "$@" >"$LOGS/$name.txt" 2>&1
    rc=$?
    case $rc in 0) status=passed ;; 124 | 137) status=timeout ;; *) status=failed ;; esac
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$(($(date +%s) - t0))" "$limit" >>"$STEPS"
    echo "[gpu_check] $name: $status (exit $rc) after $(($(date +%s) - t0)) s"
    [ "$status" = passed ] || tail -n 15 "$LOGS/$name.txt"
}

# -- the carried wheels: installed beside the device's packages, never over them (its torch stays) ---------------
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$LOGS/nvidia_smi.txt"
    git log -1 --oneline 2>/dev/null
    ldd --version 2>&1 | head -n 1
    "$PY" -m pip list 2>&1
} >"$OUT/env.txt" 2>&1

rm -rf "$SITE"
shopt -s nullglob
WHEEL_FILES=("$WHEELS"/*.whl)
[ ${#WHEEL_FILES[@]} -gt 0 ] || echo "[gpu_check] no wheels in $WHEELS: run scripts/gpu_wheels.py here, carry .gpu_wheels"
step wheels 90 "$PY" -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "${WHEEL_FILES[@]}"
export PYTHONPATH=$ROOT:$SITE

if [ "$DRY" = 1 ]; then
    DEV=cpu BACKEND=(--compile-backend eager)
    GPT=(--size small --batch 2 --steps 1 --trials 1)
    RES=(--size small --batch 2 --steps 1 --trials 1)
    PEERS=(--device cpu --frameworks hand,labkit,fabric,accel --segments 1 --steps 1 --warmup 1 --batch 2)
    RESNET=(--model resnet18 --size 32)
    FEED=(--photos 8 --batch 8 --trials 1)
    NOTEBOOKS=(notebooks/08_*.ipynb)
    NB_LIMITS=(300)
    NB_ARGS=(--stop-before 'backward\(|\.fit\(')
else
    DEV=cuda BACKEND=()
    GPT=(--size gpt2 --steps 20 --trials 3)
    RES=(--size gpt2 --steps 10 --trials 3)
    PEERS=(--device cuda --frameworks hand,labkit,fabric,accel --segments 3 --steps 30 --warmup 10 --batch 64)
    RESNET=(--model resnet50 --size 224)
    FEED=(--photos 256 --batch 64 --trials 3)
    NOTEBOOKS=(notebooks/08_*.ipynb notebooks/02_*.ipynb notebooks/01_*.ipynb)
    NB_LIMITS=(90 60 60)
    NB_ARGS=()
fi

step imports 60 "$PY" -c "
import torch, torchvision, labkit, webdataset, google.cloud.storage, ipywidgets, nbclient, nbformat, ipykernel
import data_tools
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'torchvision', torchvision.__version__)
print('gpu', torch.cuda.get_device_name() if torch.cuda.is_available() else None)
print('labkit', labkit.__file__, 'webdataset', webdataset.__version__, 'ipykernel', ipykernel.__version__)
print(labkit.setup('$DEV'))"
step bench_compile_gpt2 170 "$PY" bench/bench_compile.py --device $DEV --models gpt "${GPT[@]}" "${BACKEND[@]}"
step peers_resnet50_cl 75 "$PY" bench/bench_gpu_peers.py "${PEERS[@]}" "${RESNET[@]}" --memory-format channels_last
step peers_resnet50_nchw 75 "$PY" bench/bench_gpu_peers.py "${PEERS[@]}" "${RESNET[@]}" --memory-format nchw
step peers_mlp 50 "$PY" bench/bench_gpu_peers.py "${PEERS[@]}" --model mlp
step fsdp2_case 40 "$PY" bench/gpu_fsdp_case.py --device $DEV
# -- labkit's stager against torch's: bench/bench_stage.py is written elsewhere; its step runs once it exists --
if [ -f bench/bench_stage.py ]; then
    step bench_stage 40 "$PY" bench/bench_stage.py --device $DEV
fi
step feed_gpu_decode 30 "$PY" bench/bench_feed.py --gpu-decode $DEV "${FEED[@]}"
step bench_compile_resnet50 100 "$PY" bench/bench_compile.py --device $DEV --models resnet "${RES[@]}" "${BACKEND[@]}"
step bench_compile_gpt2_cudnn 120 "$PY" bench/bench_compile.py --device $DEV --models gpt "${GPT[@]}" "${BACKEND[@]}" \
    --sdpa cudnn
for i in "${!NOTEBOOKS[@]}"; do
    nb=${NOTEBOOKS[$i]}
    name=notebook_$(basename "$nb" .ipynb | cut -d_ -f1)
    step "$name" "${NB_LIMITS[$i]}" env LABKIT_SOLUTIONS=0 LABKIT_FAST=1 LABKIT_BACKEND=$DEV \
        "$PY" scripts/run_notebooks.py --quiet --timeout 300 --out "$LOGS"_nb "${NB_ARGS[@]}" "$nb"
done

# -- the results: what ran where, every step's status, the figures ------------------------------------------------
"$PY" - "$OUT" "$LOGS" "$START" "$DRY" <<'EOF'
import json, re, sys, time
from pathlib import Path

out, logs, start, dry = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
steps = []
for line in (logs / "steps.tsv").read_text().splitlines():
    name, status, rc, seconds, limit = line.split("\t")
    log = logs / f"{name}.txt"
    text = log.read_text(errors="replace") if log.exists() else ""
    figures = [ln for ln in text.splitlines() if re.match(r"(RATIO|MFU|PAYBACK|HOST|CASE|STALL|FEED) ", ln)]
    steps.append(dict(name=name, status=status, exit=int(rc) if rc else None, seconds=int(seconds),
                      limit=int(limit), figures=figures, tail=text.splitlines()[-3:] if status != "passed" else []))
ran = {}
try:
    import torch
    ran = dict(torch=torch.__version__, cuda=torch.version.cuda,
               gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None)
except Exception as e:  # the results are written whatever broke
    ran = dict(torch=f"not importable: {e!r}")
smi = (logs / "nvidia_smi.txt").read_text(errors="replace").strip() if (logs / "nvidia_smi.txt").exists() else ""
ran["nvidia_smi"] = smi if smi.count(",") >= 2 and "not found" not in smi else None  # name, memory, driver
ran["python"] = sys.version.split()[0]
result = dict(dry_run=dry, ran_on=ran, seconds=int(time.time()) - start, steps=steps,
              passed=sum(s["status"] == "passed" for s in steps), of=len(steps))
(out / "results.json").write_text(json.dumps(result, indent=1))
lines = [f"gpu_check{' (dry run, CPU)' if dry else ''}: torch {ran.get('torch')}, CUDA {ran.get('cuda')}, "
         f"GPU {ran.get('gpu')}, nvidia-smi {ran.get('nvidia_smi')}, Python {ran['python']}"]
for s in steps:
    lines.append(f"{s['name']}: {s['status']} (exit {s['exit']}) {s['seconds']} s of {s['limit']} s")
    lines += [f"    {f}" for f in s["figures"]]
lines.append(f"{result['passed']} of {result['of']} steps passed in {result['seconds']} s")
(out / "results.txt").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
tar czf "$OUT/logs.tar.gz" -C "$(dirname "$LOGS")" "$(basename "$LOGS")" \
    $([ -d "$LOGS"_nb ] && echo "$(basename "$LOGS")_nb") 2>/dev/null
# exit status: 0 only when every step passed (the results files are there either way)
! grep -qv $'\tpassed\t' "$STEPS"
