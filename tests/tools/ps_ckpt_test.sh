#!/usr/bin/env bash
# ps_ckpt end to end (ctest tools.ps_ckpt): ps_bench trains llama_tiny and saves a checkpoint;
# ps_ckpt shows it, verifies it, exports its weights under transformers' names; ps_bench resumes
# from it with another chunk size; a flipped byte in its data file is reported by verify (exit 1)
# and refused by the resume, naming the file.
set -euo pipefail
bench=$1
tool=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

"$bench" --model llama_tiny --steps 2 --chunk_size 65536 --save_checkpoint "$dir/ckpt" > "$dir/save.log"
grep -q "saved checkpoint $dir/ckpt" "$dir/save.log" || fail "ps_bench did not save"

"$tool" show "$dir/ckpt" --tensors > "$dir/show.txt"
cat "$dir/show.txt"
grep -q "written by: 1 rank(s), shard groups of 1, chunks of 65536 elements, fp32" "$dir/show.txt" ||
  fail "show: the writing run"
grep -q "at: iteration 2, Adam step 2" "$dir/show.txt" || fail "show: the iteration"
grep -q "tensors: 21 (158016 parameters" "$dir/show.txt" || fail "show: llama_tiny's 21 tensors"
grep -q "layers.1.mlp.down_proj.weight" "$dir/show.txt" || fail "show --tensors: a tensor"

"$tool" verify "$dir/ckpt" | tee "$dir/verify.txt"
grep -q "sound" "$dir/verify.txt" || fail "verify: an intact checkpoint"

"$tool" export "$dir/ckpt" "$dir/hf" --names llama --dtype bf16 | tee "$dir/export.txt"
grep -q "21 tensors, 316032 bytes in 1 file(s)" "$dir/export.txt" || fail "export: bf16 bytes"
head -c 8192 "$dir/hf/model.safetensors" | grep -q "model.layers.1.mlp.down_proj.weight" ||
  fail "export: transformers' names"
head -c 8192 "$dir/hf/model.safetensors" | grep -q '"BF16"' || fail "export: bf16"

"$bench" --model llama_tiny --steps 2 --chunk_size 32768 --resume_from "$dir/ckpt" > "$dir/resume.log"
grep -q "resumed from checkpoint $dir/ckpt" "$dir/resume.log" || fail "resume with another chunk size"

data=$(ls "$dir" | grep '^ckpt\..*\.rank0-of-1$')
printf '\x5a' | dd of="$dir/$data" bs=1 seek=1000 conv=notrunc status=none
if "$tool" verify "$dir/ckpt" > "$dir/damaged.txt"; then fail "verify passed a damaged file"; fi
cat "$dir/damaged.txt"
grep -q "problem: .*$data" "$dir/damaged.txt" || fail "verify: the damaged file named"
if "$bench" --model llama_tiny --steps 2 --resume_from "$dir/ckpt" > "$dir/refused.log" 2>&1; then
  fail "a damaged checkpoint resumed"
fi
grep -q "$data" "$dir/refused.log" || fail "the refusal names the damaged file"
echo "ps_ckpt: show, verify, export and resume as expected"
