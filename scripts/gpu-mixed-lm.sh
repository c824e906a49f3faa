#!/usr/bin/env bash
# The mixed Rust + PyTorch transformer job on a GPU machine (not run by CI): Rust trainers
# (hypha-executor, CPU) and the PyTorch trainer (python/examples/torch_lm_trainer.py, CUDA)
# train one 100 M-parameter byte-level transformer together through `hypha quickstart`, then
# this prints each trainer kind's tokens per second and the losses. Record the numbers in
# BENCHMARKS.md ("language model on a GPU") with the card named.
#
# Needs release binaries (cargo build --release, or carried there: stripped, in BIN_DIR) and
# python3 with torch and numpy (blake3 optional). From the repository's root:
#
#     scripts/gpu-mixed-lm.sh [BIN_DIR]        # default target/release
#
# Environment: ROUNDS (5), RUST_TRAINERS (1), LAYERS (15: GPT-2-small's width and heads, 15
# blocks, 106.9 M parameters), BATCH (8 sequences of 256 tokens), PYTHON (python3),
# WORK (a new temporary directory).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-target/release}
ROUNDS=${ROUNDS:-5}
RUST_TRAINERS=${RUST_TRAINERS:-1}
LAYERS=${LAYERS:-15}
BATCH=${BATCH:-8}
PYTHON=${PYTHON:-python3}
WORK=${WORK:-$(mktemp -d)}
MODEL="{\"type\": \"transformer\", \"vocab\": 258, \"context\": 256, \"dim\": 768, \"heads\": 12, \"layers\": $LAYERS}"

for program in hypha hypha-data hypha-executor hypha-gateway hypha-worker hypha-scheduler hypha-certutil; do
    [ -x "$BIN/$program" ] || { echo "error: $BIN/$program is missing: cargo build --release" >&2; exit 1; }
done
"$PYTHON" -c "import torch, numpy" || { echo "error: $PYTHON cannot import torch and numpy" >&2; exit 1; }
echo "card: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo none)"
echo "torch: $("$PYTHON" -c 'import torch; print(torch.__version__, "cuda" if torch.cuda.is_available() else "no cuda")')"
echo "cpu: $(nproc) cores; work: $WORK"

mkdir -p "$WORK/text"
cp README.md BENCHMARKS.md docs/*.md "$WORK/text/"
"$BIN/hypha-data" prepare "$WORK/text" -o "$WORK/datasets/text" --sequence-length 257 --slice-size 32

started=$(date +%s)
PYTHONPATH=python "$BIN/hypha" quickstart --dir "$WORK/run" --dataset "$WORK/datasets/text" \
    --model "$MODEL" --trainers "$RUST_TRAINERS" \
    --python-trainer python/examples/torch_lm_trainer.py --python "$PYTHON" \
    --rounds "$ROUNDS" --samples-per-round $((BATCH * 8)) --batch-size "$BATCH" \
    --round-seconds 900 --learning-rate 0.0003
echo "wall: $(( $(date +%s) - started )) s"

"$PYTHON" - "$WORK/run" <<'SUMMARY'
import glob, json, os, sys
run = sys.argv[1]
kind = {}
for path in glob.glob(os.path.join(run, "work", "*", "hypha-*")):
    worker = os.path.basename(os.path.dirname(path))
    if worker == "parameter-server":
        continue
    kind[os.path.basename(path)[len("hypha-"):]] = "pytorch" if worker == "python-trainer" else "rust"
last = {}
rounds = []
for line in open(os.path.join(run, "metrics.jsonl")):
    m = json.loads(line)
    if m.get("kind") == "round":
        rounds.append(m)
    elif m.get("kind") == "trainer" and m.get("round") is not None and m.get("batch_ms"):
        key = (m["job"], m["round"])
        if m["batches"] >= last.get(key, {}).get("batches", 0):
            last[key] = m
totals = {}
for (job, _), m in last.items():
    k = kind.get(job, "?")
    tokens, seconds = totals.get(k, (0, 0.0))
    totals[k] = (tokens + m["samples"] * 256, seconds + m["batches"] * m["batch_ms"] / 1000)
for k, (tokens, seconds) in sorted(totals.items()):
    trainers = sum(1 for v in kind.values() if v == k)
    print(f"{k}: {tokens / seconds:.0f} tokens/s per trainer ({trainers} trainer(s), {tokens} tokens)")
for r in rounds:
    print(f"round {r['round']}: loss {r.get('loss')}, close {r.get('close_ms')} ms")
for path in glob.glob(os.path.join(run, "work", "python-trainer", "hypha-*", "stderr.log")):
    for line in open(path):
        if "tokens/s" in line or "parameters on" in line:
            print("pytorch trainer said:", line.strip())
SUMMARY
