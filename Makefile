# comet - build of the C library, the CLI and the tests; the CUDA sources are
# compiled for sm_90a whenever nvcc is found, so compile errors in GPU code
# show up on machines without a GPU.
#
#   make            libcomet.a, libcomet.so, the CLI, tests (and CUDA objects
#                   when nvcc exists)
#   make NVCC=      CPU-only build (no CUDA backend, no NCCL), even where nvcc
#                   exists; pair it with BUILD=build-cpu to keep both builds
#   make test       build and run every test
#   make bench      build and run `comet bench` on the default model
#   make test SAN=thread   the same under ThreadSanitizer (no CUDA, no .so)
#   make install PREFIX=/usr/local   (also DESTDIR=): include/comet.h,
#                   lib/libcomet.so*, lib/libcomet.a, lib/pkgconfig/comet.pc
#   make uninstall  the same PREFIX/DESTDIR
#   make clean

CC      ?= cc
CFLAGS  ?= -O2 -g
SAN     ?=            # e.g. SAN=thread or SAN=address,undefined (builds into build-$(SAN))
BUILD   ?= build$(if $(SAN),-$(subst $(comma),-,$(SAN)))
comma   := ,
XCFLAGS := $(CFLAGS) -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -ffp-contract=off -pthread -Iinclude \
           $(if $(SAN),-fsanitize=$(SAN) -fno-omit-frame-pointer)
XLDLIBS := $(LDLIBS) -lm -pthread $(if $(SAN),-fsanitize=$(SAN))

NVCC    ?= $(if $(SAN),,$(shell command -v nvcc 2>/dev/null))
NVFLAGS ?= -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -Iinclude -Xptxas -warn-spills

LIB_SRC := $(wildcard src/api/*.c src/core/*.c src/plan/*.c src/cpu/*.c src/tuner/*.c src/trace/*.c)
CU_SRC  := $(wildcard src/cuda/*.cu src/comm/*.cu)
CU_OBJ  := $(if $(NVCC),$(CU_SRC:%.cu=$(BUILD)/%.o))

# With nvcc: the CUDA backend and the NCCL runtime join the library. NCCL
# comes from NCCL_HOME (its include/ and lib/) if given, else the CUDA
# toolkit's, else PyTorch's nvidia.nccl package, else the system's; the
# binaries keep its lib/ as rpath, so the library found at build time (whose
# version the headers match: src/comm checks) is the one loaded.
ifneq ($(NVCC),)
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(NVCC))
PIP_NCCL  := $(shell python3 -c 'import nvidia.nccl as m; print(m.__path__[0])' 2>/dev/null)
NCCL_HOME ?= $(if $(wildcard $(CUDA_HOME)/include/nccl.h),$(CUDA_HOME),$(if $(PIP_NCCL),$(PIP_NCCL),/usr))
LIB_SRC += $(wildcard src/cuda/*.c src/comm/*.c)
XCFLAGS += -DCOMET_WITH_CUDA -I$(NCCL_HOME)/include -I$(CUDA_HOME)/include
NVFLAGS += -DCOMET_WITH_CUDA -I$(NCCL_HOME)/include
CUDA_LIBS := -L$(NCCL_HOME)/lib -L$(NCCL_HOME)/lib64 -L$(CUDA_HOME)/lib64 -l:libnccl.so.2 -lcudart -lstdc++
RPATHS    := $(NCCL_HOME)/lib $(NCCL_HOME)/lib64 $(CUDA_HOME)/lib64
XLDLIBS += $(CUDA_LIBS) $(foreach d,$(RPATHS),-Wl,-rpath,$(d))
endif
LIB_OBJ := $(LIB_SRC:%.c=$(BUILD)/%.o) $(CU_OBJ)
# Every library object is position independent, so the same objects make
# libcomet.a and libcomet.so ("private": not passed on to prerequisites).
$(LIB_OBJ): private XCFLAGS += -fPIC
$(CU_OBJ): private NVFLAGS += -Xcompiler -fPIC

# The shared library: soname libcomet.so.MAJOR, the version from comet.h. It
# records its own dependencies (CUDA runtime, NCCL, libstdc++, their rpaths),
# so a program links -lcomet alone; it exports the functions declared in
# include/comet.h and nothing else (the version script comet.map is made
# from the header).
comet_ver = $(shell sed -n 's/^\#define COMET_VERSION_$(1) *\([0-9][0-9]*\).*/\1/p' include/comet.h)
VERSION := $(call comet_ver,MAJOR).$(call comet_ver,MINOR).$(call comet_ver,PATCH)
SONAME  := libcomet.so.$(call comet_ver,MAJOR)
SO_LIBS := $(LDLIBS) $(if $(NVCC),$(CUDA_LIBS) $(foreach d,$(RPATHS),-Wl,-rpath,$(d))) -ldl -lm -pthread
SO_LIB  := $(if $(SAN),,$(BUILD)/libcomet.so)

# `make install`: Libs.private of comet.pc is what a static link needs beside
# libcomet.a.
PREFIX     ?= /usr/local
LIBDIR     ?= $(PREFIX)/lib
INCLUDEDIR ?= $(PREFIX)/include
PC_PRIVATE := $(SO_LIBS)

# The harness (harness/: presets, routing generators, the multi-rank runner,
# the torchrun bootstrap, NVML watching) is not part of the library: the CLI,
# the tests and the benchmarks link it from its own archive.
HARNESS := $(BUILD)/libcomet_harness.a
HARNESS_OBJ := $(patsubst %.c,$(BUILD)/%.o,$(wildcard harness/*.c))
TESTS   := $(patsubst tests/%.c,$(BUILD)/tests/%,$(filter-out tests/check.c,$(wildcard tests/test_*.c)))
GPU_TESTS := $(if $(NVCC),$(patsubst tests/%.cu,$(BUILD)/tests/%,$(wildcard tests/test_*.cu)))
GPU_BENCH := $(if $(NVCC),$(BUILD)/bench/gemm_bench $(BUILD)/bench/link_bench)

all: $(BUILD)/libcomet.a $(SO_LIB) $(HARNESS) $(BUILD)/comet $(TESTS) $(GPU_TESTS) $(GPU_BENCH)

# $(BUILD)/make.vars: the knobs this build directory was made with, written
# as make reads this file, when they changed (so make -n and -q see it too).
# Objects depend on it, so a change of compiler, flags or CUDA (or an older
# build without -fPIC) rebuilds them; tests/test_example.sh passes the knobs
# (lines without '#') to its `make install`, which then only copies.
CONFIG_VARS := CC CFLAGS LDLIBS SAN NVCC CUDA_HOME NCCL_HOME
CONFIG := $(foreach v,$(CONFIG_VARS),'$(v)=$(strip $($(v)))') '\# XCFLAGS=$(strip $(XCFLAGS))' \
          '\# NVFLAGS=$(strip $(NVFLAGS))' '\# library objects: -fPIC'
$(shell printf '%s\n' $(CONFIG) | cmp -s - $(BUILD)/make.vars 2>/dev/null || \
  { mkdir -p $(BUILD) && printf '%s\n' $(CONFIG) >$(BUILD)/make.vars; })

# $(BUILD)/commit: the commit of the tree this build was last made from (`git describe --dirty`;
# "unknown" outside this project's own git checkout): dev/gpu_check.sh reports it as COMET_COMMIT on machines that
# get the build without the repository's history.
$(shell mkdir -p $(BUILD) && { [ "$$(git rev-parse --show-toplevel 2>/dev/null)" = "$(CURDIR)" ] && \
  git describe --always --dirty --abbrev=7 2>/dev/null || echo unknown; } \
  >$(BUILD)/commit.new && { cmp -s $(BUILD)/commit.new $(BUILD)/commit || mv $(BUILD)/commit.new $(BUILD)/commit; }; \
  rm -f $(BUILD)/commit.new)

$(BUILD)/%.o: %.c $(BUILD)/make.vars
	@mkdir -p $(dir $@)
	$(CC) $(XCFLAGS) -MMD -MP -c $< -o $@

$(BUILD)/%.o: %.cu $(BUILD)/make.vars
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) -MMD -MP -c $< -o $@ 2>&1 | tee $@.log; \
	  test $${PIPESTATUS[0]} -eq 0 && ! grep -qE 'C7508|C751[0-9]|C7520' $@.log

# Made anew each time: `ar rcs` on an old archive keeps the members of
# sources since removed or renamed, whose symbols the linker may then take.
$(BUILD)/libcomet.a: $(LIB_OBJ)
	@rm -f $@
	$(AR) rcs $@ $^

$(BUILD)/comet.map: include/comet.h
	@mkdir -p $(@D)
	{ echo '{ global:'; $(CC) -E -P -Iinclude -x c $< | grep -oE '\<comet_[a-z0-9_]+ *\(' | tr -d ' (' | sort -u \
	  | sed 's/.*/    &;/'; echo '  local: *;'; echo '};'; } >$@.tmp && grep -q comet_layer_forward $@.tmp && mv -f $@.tmp $@

$(BUILD)/libcomet.so: $(LIB_OBJ) $(BUILD)/comet.map
	$(CC) $(LDFLAGS) -shared -Wl,-soname,$(SONAME) -Wl,--version-script=$(BUILD)/comet.map \
	  $(if $(SAN),-fsanitize=$(SAN),-Wl,-z,defs) -o $(BUILD)/libcomet.so.$(VERSION) $(LIB_OBJ) -Wl,--as-needed $(SO_LIBS)
	ln -sf libcomet.so.$(VERSION) $(BUILD)/$(SONAME)
	ln -sf $(SONAME) $@

$(HARNESS): $(HARNESS_OBJ)
	@rm -f $@
	$(AR) rcs $@ $^

# The CLI: tools/comet.c (main), parse.c, run.c, report.c (tools/cli.h).
CLI_OBJ := $(patsubst %.c,$(BUILD)/%.o,$(wildcard tools/*.c))
$(BUILD)/comet: $(CLI_OBJ) $(HARNESS) $(BUILD)/libcomet.a
	$(CC) $(XCFLAGS) $^ $(XLDLIBS) -ldl -o $@

$(BUILD)/tests/%: $(BUILD)/tests/%.o $(BUILD)/tests/check.o $(HARNESS) $(BUILD)/libcomet.a
	$(CC) $(XCFLAGS) $^ $(XLDLIBS) -o $@

# GPU tests: built whenever nvcc exists, they skip at run time without a GPU.
$(BUILD)/tests/%: tests/%.cu $(BUILD)/tests/check.o $(HARNESS) $(BUILD)/libcomet.a
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) $^ $(CUDA_LIBS) $(foreach d,$(RPATHS),-Xlinker -rpath -Xlinker $(d)) -o $@

# The grouped-GEMM benchmark (against cuBLAS): built here so that its link is
# checked everywhere; bench/run_gemm_bench.sh runs it on the GPU machine.
$(BUILD)/bench/gemm_bench: bench/gemm_bench.cu bench/bench_check.h harness/gpu_power.h $(BUILD)/tests/check.o $(HARNESS) $(BUILD)/libcomet.a
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) $(filter-out %.h,$^) $(CUDA_LIBS) -lcublas -ldl $(foreach d,$(RPATHS),-Xlinker -rpath -Xlinker $(d)) -o $@

# NVLink transport rates (pull, push, TMA bulk, copy engine; 2 GPUs).
$(BUILD)/bench/link_bench: bench/link_bench.cu bench/bench_check.h
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) $< $(CUDA_LIBS) -lcublas $(foreach d,$(RPATHS),-Xlinker -rpath -Xlinker $(d)) -o $@

test: all
	@tests/run.sh $(BUILD)

bench: $(BUILD)/comet
	$(BUILD)/comet bench

install: $(BUILD)/libcomet.a $(BUILD)/libcomet.so
	install -d $(DESTDIR)$(INCLUDEDIR) $(DESTDIR)$(LIBDIR)/pkgconfig
	install -m 644 include/comet.h $(DESTDIR)$(INCLUDEDIR)/comet.h
	install -m 644 $(BUILD)/libcomet.a $(DESTDIR)$(LIBDIR)/libcomet.a
	install -m 755 $(BUILD)/libcomet.so.$(VERSION) $(DESTDIR)$(LIBDIR)/libcomet.so.$(VERSION)
	ln -sf libcomet.so.$(VERSION) $(DESTDIR)$(LIBDIR)/$(SONAME)
	ln -sf $(SONAME) $(DESTDIR)$(LIBDIR)/libcomet.so
	sed -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@LIBDIR@|$(LIBDIR)|g' -e 's|@INCLUDEDIR@|$(INCLUDEDIR)|g' \
	  -e 's|@VERSION@|$(VERSION)|g' -e 's|@LIBS_PRIVATE@|$(strip $(PC_PRIVATE))|g' comet.pc.in \
	  >$(DESTDIR)$(LIBDIR)/pkgconfig/comet.pc

uninstall:
	rm -f $(DESTDIR)$(INCLUDEDIR)/comet.h $(DESTDIR)$(LIBDIR)/libcomet.a $(DESTDIR)$(LIBDIR)/libcomet.so \
	  $(DESTDIR)$(LIBDIR)/$(SONAME) $(DESTDIR)$(LIBDIR)/libcomet.so.$(VERSION) $(DESTDIR)$(LIBDIR)/pkgconfig/comet.pc

clean:
	rm -rf $(BUILD)

.PHONY: all test bench install uninstall clean
.SECONDARY:
SHELL := /bin/bash
-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)
