#!/usr/bin/env bash
# Start (or resume) the efficacy study's CPU pipeline in the background: one thread, nice 10, survives the shell.
#   benchmarks/efficacy/start_background.sh            # from the repository root
#   PIN=0 THREADS=1 benchmarks/efficacy/start_background.sh   # pinned to CPU 0 (other work on the rest)
# Log: benchmarks/efficacy/work/pipeline.log; PID: benchmarks/efficacy/work/pipeline.pid. Every stage skips what
# its cache already holds, so running this again after a stop resumes where it stopped. Refuses to start a second
# copy while the first is alive. The pipeline runs in its own process group (setsid) whose id is the PID, so
#   kill -- -$(cat benchmarks/efficacy/work/pipeline.pid)
# stops it together with the stage it is running (killing the PID alone leaves that stage's process behind).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/latest/bin/python}
[ -x "$PY" ] || PY=/work/main/.venv/latest/bin/python
WORK=benchmarks/efficacy/work
mkdir -p "$WORK"
if [ -f "$WORK/pipeline.pid" ] && kill -0 "$(cat "$WORK/pipeline.pid")" 2>/dev/null; then
    echo "the pipeline is already running (pid $(cat "$WORK/pipeline.pid")); log: $WORK/pipeline.log" >&2
    exit 2
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
setsid nohup nice -n 10 ${PIN:+taskset -c "$PIN"} "$PY" benchmarks/efficacy/study.py pipeline --threads "${THREADS:-1}" >> "$WORK/pipeline.log" 2>&1 < /dev/null &
echo $! > "$WORK/pipeline.pid"
echo "started pid $! ; log: $WORK/pipeline.log"
