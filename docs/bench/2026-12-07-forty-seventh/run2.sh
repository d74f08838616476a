export PYTHONPATH=src:tests
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/gpu.txt
for w in hf_bert hf_llama gptfast_prefill; do
for b in inductor tilefuse; do
  C=$(mktemp -d)
  for ph in cold warm; do
    echo "### $w $b $ph" >> $OUT/first_calls.txt
    TILEFUSE_LOGS=compile_time TORCHINDUCTOR_CACHE_DIR=$C/ind TRITON_CACHE_DIR=$C/triton TILEFUSE_CACHE_DIR=$C/tf \
      timeout 80 python scripts/first_call_phases.py $w $b cuda >> $OUT/first_calls.txt 2>&1
  done
done
done
C=$(mktemp -d)
for ph in cold warm; do TILEFUSE_LOGS=compile_time TORCHINDUCTOR_CACHE_DIR=$C/ind TRITON_CACHE_DIR=$C/triton TILEFUSE_CACHE_DIR=$C/tf timeout 60 python scripts/first_call_phases.py nanogpt tilefuse cuda > $OUT/nanogpt_$ph.txt 2>&1; done
TORCHINDUCTOR_CACHE_DIR=$C/ind TRITON_CACHE_DIR=$C/triton TILEFUSE_CACHE_DIR=$C/tf timeout 60 python -m cProfile -o $OUT/warm_nanogpt.prof scripts/first_call_phases.py nanogpt tilefuse cuda > $OUT/nanogpt_warm_prof_run.txt 2>&1
python - > $OUT/warm_prof.txt <<'PY'
import os, pstats
s = pstats.Stats(os.environ["OUT"] + "/warm_nanogpt.prof").sort_stats("cumulative")
s.print_stats(60)
s.print_stats("tilefuse", 60)
PY
rm -f $OUT/warm_nanogpt.prof
grep -h "###\|==" $OUT/first_calls.txt | cut -c1-200
