export PYTHONPATH=src:tests
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/gpu.txt
for w in gptfast_prefill gptfast_decode; do
for b in inductor tilefuse; do
  C=$(mktemp -d)
  for ph in cold warm; do
    echo "### $w $b $ph" >> $OUT/first_calls.txt
    TILEFUSE_LOGS=compile_time,cache TORCHINDUCTOR_CACHE_DIR=$C/ind TRITON_CACHE_DIR=$C/triton TILEFUSE_CACHE_DIR=$C/tf \
      timeout 80 python scripts/first_call_phases.py $w $b cuda >> $OUT/first_calls.txt 2>&1
  done
done
done
timeout 120 python scripts/interleaved_zoo.py --workloads gptfast_decode --shape 1,2048,8,2048 --backends inductor,tilefuse --dtype bfloat16 --device cuda --rounds 6 --calls 50 > $OUT/decode_default.txt 2>&1
grep -h "###\|==\|front cache" $OUT/first_calls.txt | cut -c1-160
tail -2 $OUT/decode_default.txt
