#!/bin/bash
# run.sh: the one script the GPU call runs: build, check + time every version (each in its own process with a
# timeout, so a hang in one version does not hide the others), memcheck a small shape, print the tables last.
# Logs go to $OUT (or ./out when OUT is unset).
export NCCL_NVLS_ENABLE=0
cd "$(dirname "$0")"
O=${OUT:-./out}; mkdir -p $O
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv > $O/gpu.txt 2>&1
./build.sh > $O/build.log 2>&1 || { cat $O/build.log; exit 1; }
grep -E "Used|spill" $O/build.log | tail -12
echo "HGMMA in SASS: $(grep -c HGMMA gemm.sass)"; grep -m3 HGMMA gemm.sass
VERS=${VERS:-"1 2 3 4 5 6 7"}
for v in $VERS; do
  timeout ${TO:-150} ./gemm $v > $O/v$v.log 2>&1; echo "v$v exit $?" >> $O/v$v.log
done
if [ -n "$MEMCHECK" ]; then
  for v in $VERS; do [ $v = 5 ] && continue; timeout 120 compute-sanitizer --tool memcheck ./gemm $v ${MCSHAPE:-300 520 200} > $O/mc.tmp 2>&1; echo "memcheck v$v exit $?: $(grep -E 'ERROR SUMMARY' $O/mc.tmp) $(grep -c CORRECT $O/mc.tmp) CORRECT lines" | tee -a $O/memcheck.log; cat $O/mc.tmp >> $O/memcheck.log; done; rm -f $O/mc.tmp
fi
cat $O/gpu.txt
for v in $VERS; do echo "----- v$v"; grep -E "vs cuBLAS|vs CPU|padding|race|error|exit|max active" $O/v$v.log | grep -v "^\[cuBLAS\] vs" | head -40; done
for v in $VERS; do echo "----- v$v summary"; sed -n '/==== .*SUMMARY/,$p' $O/v$v.log; done
# keep the number of files under $OUT small (the device tool returns at most 8)
for v in $VERS; do cat $O/v$v.log; done > $O/versions.log && for v in $VERS; do rm -f $O/v$v.log; done
