#!/usr/bin/env bash
# One GPU check: the CUDA tests and the GPU benchmarks, their reports written into OUTDIR (about 5 minutes on one
# H100 / H200). Needs torch with CUDA, transformers, peft and pytest; the package is imported from src/.
#
#   bash benchmarks/gpu_check.sh OUTDIR                      # on the GPU machine
#   DEVICE=cpu QUICK=1 bash benchmarks/gpu_check.sh OUTDIR   # the same steps, small, on a CPU (to catch errors)
#
# Steps, in order of importance; each has its own time limit and the whole stays within BUDGET seconds (default
# 300): a step that no longer fits is skipped and says so.
#   1. tests:    tests/test_cuda.py and tests/tools/study/test_cuda.py (skip without a GPU), tests/slot,
#                tests/test_fuse.py
#   2. generate: bench_generate.py -- base / hooks / fused weights / auto (the default) / PEFT LoRA on, batch 1 and 8,
#                1B shape (16 layers), bf16, 256-token prompt, 64 new tokens; logits vs a float64 dense reference;
#                base weights bit-identical afterwards
#   3. fusion:   bench_fusion.py -- PRAG's PEFT path, PEFT hotswap, the slot write, the device copy floor
#                (1B shape, N = 3 and 10), and a mixed batch vs one question at a time
#   4. labels:   bench_labels.py -- the label builder's records/s against its forward floor
#   5. shims:    bench_shim_slot.py -- PRAG's shim (use_slot, generating 64 tokens) and DyPRAG's, per question
#   6. study:    fcprag study with the real SmolLM2-135M (GGUF, float32) on the paper-table's 200 questions
#                (100 HotpotQA + 100 2Wiki), --controller benchmarks/efficacy/controller, on DEVICE; needs the payload
#                benchmarks/device_carry.py carries (CARRY, default /tmp/fcprag_carry/payload, and the questions in
#                .cache/device/data); skipped, saying so, without it. Its own budget is large: run it alone,
#                STEPS=study BUDGET=560 (not in the default STEPS; docs/results/gpu.md gives the calls).
#   7. study_full: a whole fcprag study (augmentation, adapters, labels, both controllers trained, evaluation) on
#                all 640 shared questions (400 HotpotQA + 240 2Wiki, carried gzipped in .cache/device/data), on
#                DEVICE; STEPS=study_full BUDGET=590, resumable: the same call again goes on where it stopped
#                (STUDY_FULL_OUT, default /tmp/fcprag_study_full, outlives a call while the machine is warm).
# Files in OUTDIR: check.log (everything), gpu_table.md (the issue-33 table from this run, gpu_report.py),
# bench_generate.{json,md}, bench_fusion.{json,md}, labels.json, shims.json; study_timings.jsonl and
# study_report.md (the study's own folder stays outside OUTDIR, in STUDY_OUT, default /tmp/fcprag_study).
set -u -o pipefail
OUTDIR=${1:?usage: bash benchmarks/gpu_check.sh OUTDIR}
mkdir -p "$OUTDIR"
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
DEV=${DEVICE:-cuda}
DT=${DTYPE:-bfloat16}
BUDGET=${BUDGET:-300}
STEPS=${STEPS:-tests,generate,fusion,labels,shims}  # a subset, e.g. STEPS=fusion,labels; the study step: STEPS=study
SCALE=${LIMIT_SCALE:-1}  # multiplies every step's time limit (a slow CPU)
LOG="$OUTDIR/check.log"
FAILED=()

if [ "${QUICK:-0}" = 1 ]; then
  GEN=(--layers 1 --vocab 2000 --batches 1,2 --prompt 16 --new-tokens 4 --rounds 1)
  FUS=(--shapes smollm2-135m --ns 3 --repeats 5 --peft-repeats 1 --mem-queries 20 --mixed-batch 2 --mixed-tokens 8
       --mixed-repeats 1)
  LAB=(--records 2 --repeat 1 --generate --max-new-tokens 2)
  SHIM=(--layers 1 --questions 1 --rounds 1 --new-tokens 2)
  STUDY=(--limit 4 --max-new-tokens 2)
else
  GEN=(--layers 16 --batches 1,8 --prompt 256 --new-tokens 64 --rounds 3)
  FUS=(--shapes llama-3.2-1b --ns 3,10 --repeats 50 --peft-repeats 3 --mem-queries 300 --mixed-batch 8
       --mixed-tokens 32 --mixed-repeats 3 --threads 4)
  LAB=(--records 8 --repeat 2 --generate --max-new-tokens 8)
  SHIM=(--layers 16 --questions 3 --rounds 1 --new-tokens 64 --vocab 32000)
  STUDY=()
fi
CARRY=${CARRY:-/tmp/fcprag_carry/payload}
STUDY_OUT=${STUDY_OUT:-/tmp/fcprag_study}
QDIR=.cache/device/data

# step NAME LIMIT_S CMD...: run with a time limit (cut to what is left of BUDGET), output into check.log
step() {
  local name=$1 limit=$(($2 * SCALE)); shift 2
  case ",$STEPS," in *",$name,"*) ;; *) return ;; esac
  local left=$((BUDGET - SECONDS - 3))
  if [ "$left" -lt 20 ]; then
    echo "== $name: SKIPPED (${left}s left of the ${BUDGET}s budget)" | tee -a "$LOG"; FAILED+=("$name(skipped)"); return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (limit ${limit}s): $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout --kill-after=5 "$limit" "$@" 2>&1 | grep --line-buffered -v -e "warnings.warn" -e "Warning:" | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "== $name: rc=$rc, $((SECONDS - t0)) s" | tee -a "$LOG"
  [ "$rc" -eq 0 ] || FAILED+=("$name(rc=$rc)")
}

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "(no nvidia-smi)"
  $PY -c "import torch, transformers, peft; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'available', torch.cuda.is_available(), '| transformers', transformers.__version__, '| peft', peft.__version__)"
  $PY -c "import fcprag_plugin; print('fcprag_plugin from', fcprag_plugin.__file__)"
} 2>&1 | tee "$LOG"

step tests 120 $PY -m pytest -q -x -p no:cacheprovider tests/test_cuda.py tests/tools/study/test_cuda.py tests/slot \
  tests/test_fuse.py
step generate 110 $PY benchmarks/bench_generate.py --device "$DEV" --dtype "$DT" "${GEN[@]}" \
  --out "$OUTDIR/bench_generate.json"
step fusion 100 $PY benchmarks/bench_fusion.py --device "$DEV" --dtype "$DT" "${FUS[@]}" \
  --out "$OUTDIR/bench_fusion.json"
step labels 60 $PY benchmarks/bench_labels.py --device "$DEV" --dtype "$DT" "${LAB[@]}" --out "$OUTDIR/labels.json"
step shims 60 $PY benchmarks/bench_shim_slot.py --device "$DEV" --dtype "$DT" "${SHIM[@]}" --out "$OUTDIR/shims.json"

if [ -f "$CARRY/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" ] && [ -f "$QDIR/hotpotqa.jsonl" ]; then
  export PYTHONPATH=$PYTHONPATH:$CARRY/site
  step study 540 $PY -m fcprag_tools.cli study "$QDIR/hotpotqa.jsonl" "$QDIR/2wiki.jsonl" --model "$CARRY/smollm2" \
    --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf --controller benchmarks/efficacy/controller --device "$DEV" \
    --out "$STUDY_OUT" --no-progress "${STUDY[@]}"
  if [ -f "$STUDY_OUT/timings.jsonl" ]; then
    cp "$STUDY_OUT/timings.jsonl" "$OUTDIR/study_timings.jsonl"
    [ -f "$STUDY_OUT/report.md" ] && cp "$STUDY_OUT/report.md" "$OUTDIR/study_report.md"
    { echo "== study timings ($STUDY_OUT/timings.jsonl)"; cat "$STUDY_OUT/timings.jsonl"
      echo "eval rows: $(wc -l < "$STUDY_OUT/eval.jsonl" 2>/dev/null || echo 0)"; } | tee -a "$LOG"
  fi
elif case ",$STEPS," in *",study,"*) true ;; *) false ;; esac; then
  echo "== study: SKIPPED (no payload at $CARRY or no $QDIR: benchmarks/device_carry.py)" | tee -a "$LOG"
  FAILED+=("study(skipped)")
fi

STUDY_FULL_OUT=${STUDY_FULL_OUT:-/tmp/fcprag_study_full}
if [ -f "$CARRY/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" ] && [ -f "$QDIR/hotpotqa_dev_sample.jsonl.gz" ]; then
  export PYTHONPATH=$PYTHONPATH:$CARRY/site
  step study_full 580 $PY -m fcprag_tools.cli study "$QDIR/hotpotqa_dev_sample.jsonl.gz" \
    "$QDIR/2wiki_dev_sample.jsonl.gz" --model "$CARRY/smollm2" --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf \
    --device "$DEV" --out "$STUDY_FULL_OUT" --no-progress "${STUDY[@]}"
  if [ -f "$STUDY_FULL_OUT/timings.jsonl" ]; then
    cp "$STUDY_FULL_OUT/timings.jsonl" "$OUTDIR/study_full_timings.jsonl"
    [ -f "$STUDY_FULL_OUT/report.md" ] && cp "$STUDY_FULL_OUT/report.md" "$OUTDIR/study_full_report.md"
    { echo "== full study timings ($STUDY_FULL_OUT/timings.jsonl)"; cat "$STUDY_FULL_OUT/timings.jsonl"; } | tee -a "$LOG"
  fi
elif case ",$STEPS," in *",study_full,"*) true ;; *) false ;; esac; then
  echo "== study_full: SKIPPED (no payload at $CARRY or no $QDIR/*_dev_sample.jsonl.gz: device_carry.py)" | tee -a "$LOG"
  FAILED+=("study_full(skipped)")
fi

$PY benchmarks/gpu_report.py "$OUTDIR" >> "$LOG" 2>&1 || echo "(gpu_report.py failed)" | tee -a "$LOG"
echo "== done in ${SECONDS}s; not passed: ${FAILED[*]:-none}" | tee -a "$LOG"
[ ${#FAILED[@]} -eq 0 ]
