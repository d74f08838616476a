export PYTHONPATH=src:tests
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $OUT/gpu.txt
python -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUT/gpu.txt
timeout 150 python scripts/interleaved_zoo.py --workloads gptfast_decode --shape 1,2048,8,2048 --backends inductor-reduce-overhead,tilefuse-reduce-overhead --dtype bfloat16 --device cuda --rounds 10 --calls 50 > $OUT/decode_interleaved.txt 2>&1
timeout 90 python -m pytest -q tests/backends/test_binary_records_gpu.py tests/frontend/test_index_constants.py -k "records or device" > $OUT/tests.txt 2>&1
for w in nanogpt hf_t5; do
for b in inductor tilefuse; do
  C=$(mktemp -d)
  for ph in cold warm; do
    echo "### $w $b $ph" >> $OUT/first_calls.txt
    TILEFUSE_LOGS=compile_time TORCHINDUCTOR_CACHE_DIR=$C/ind TRITON_CACHE_DIR=$C/triton TILEFUSE_CACHE_DIR=$C/tf \
      timeout 100 python scripts/first_call_phases.py $w $b cuda >> $OUT/first_calls.txt 2>&1
  done
done
done
grep -h "###\|==\|compile workers" $OUT/first_calls.txt | cut -c1-300
tail -3 $OUT/decode_interleaved.txt; tail -2 $OUT/tests.txt
for v in shifted plain; do
  if [ $v = plain ]; then sed -i 's/    if not p.dims or (n.is_number and n == 0):/    if True or not p.dims or (n.is_number and n == 0):/' src/tilefuse/frontend/lowerings/reductions.py; fi
  C=$(mktemp -d)
  TORCHINDUCTOR_CACHE_DIR=$C/ind TRITON_CACHE_DIR=$C/triton TILEFUSE_CACHE_DIR=$C/tf \
    timeout 150 python -m tilefuse.bench --workloads layernorm --backends inductor,tilefuse --no-sweep --no-memory > $OUT/layernorm_$v.txt 2>&1
  tail -8 $OUT/layernorm_$v.txt
done
