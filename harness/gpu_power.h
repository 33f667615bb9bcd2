/*
 * harness/gpu_power.h - benchmark harness (header only), not part of the
 * library: a GPU's SM clock, energy counter (its power over a span) and
 * clock-limit reasons through NVML, loaded at run time (dlopen of libnvidia-ml.so.1): no
 * build dependency, and where the driver's library or a query is missing the
 * probe says so (ok = 0) and the benchmark prints "n/a". For benchmarks only
 * (bench/gemm_bench.cu; `comet bench` through harness/gpu_watch.h): under
 * sustained load an H100/H200 GEMM is limited by power, so its clock and
 * energy per FLOP explain its rate.
 * NVML's calls are declared here by hand (stable C ABI; the CUDA toolkit here
 * ships no nvml.h): nvmlReturn_t is an int, 0 = success; nvmlDevice_t is an
 * opaque pointer.
 */
#ifndef COMET_HARNESS_GPU_POWER_H
#define COMET_HARNESS_GPU_POWER_H

#include <dlfcn.h>
#include <stdio.h>

/* One GPU as NVML knows it (ok = 0: not opened). */
typedef struct {
    int ok;
    void *dev; /* nvmlDevice_t */
} gpu_power_t;

/* One sample: SM clock (MHz), energy since driver load (J), reasons bits. (Power
 * comes from the energy counter over a span: NVML's power reading is a moving
 * average of its own.) */
typedef struct {
    unsigned mhz;
    double joules;
    unsigned long long reasons;
} gpu_power_sample_t;

/* NVML's library and the calls used here, loaded once (0: not available). */
typedef struct {
    int ok, count;
    int (*by_bus)(const char *, void **);      /* nvmlDeviceGetHandleByPciBusId_v2 */
    int (*by_index)(unsigned, void **);        /* nvmlDeviceGetHandleByIndex_v2 */
    int (*clock)(void *, int, unsigned *);        /* nvmlDeviceGetClockInfo; type 1 = SM */
    int (*energy)(void *, unsigned long long *);  /* nvmlDeviceGetTotalEnergyConsumption (mJ) */
    int (*reasons)(void *, unsigned long long *); /* nvmlDeviceGetCurrentClocksEventReasons */
} gpu_power_lib_t;

static inline const gpu_power_lib_t *gpu_power_lib(void) {
    static gpu_power_lib_t l;
    static int tried;
    if (tried) return &l;
    tried = 1;
    void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return &l;
    int (*init)(void) = (int (*)(void))dlsym(lib, "nvmlInit_v2");
    int (*count)(unsigned *) = (int (*)(unsigned *))dlsym(lib, "nvmlDeviceGetCount_v2");
    l.by_bus = (int (*)(const char *, void **))dlsym(lib, "nvmlDeviceGetHandleByPciBusId_v2");
    l.by_index = (int (*)(unsigned, void **))dlsym(lib, "nvmlDeviceGetHandleByIndex_v2");
    l.clock = (int (*)(void *, int, unsigned *))dlsym(lib, "nvmlDeviceGetClockInfo");
    l.energy = (int (*)(void *, unsigned long long *))dlsym(lib, "nvmlDeviceGetTotalEnergyConsumption");
    l.reasons = (int (*)(void *, unsigned long long *))dlsym(lib, "nvmlDeviceGetCurrentClocksEventReasons");
    if (!l.reasons) l.reasons = (int (*)(void *, unsigned long long *))dlsym(lib, "nvmlDeviceGetCurrentClocksThrottleReasons");
    unsigned n = 0;
    if (!init || !count || !l.by_bus || !l.by_index || !l.clock || !l.energy || !l.reasons || init() != 0 ||
        count(&n) != 0)
        return &l;
    l.count = (int)n, l.ok = 1;
    return &l;
}

/* Opens NVML for the GPU at PCI bus id `bus` (cudaDeviceGetPCIBusId). */
static inline void gpu_power_open(gpu_power_t *p, const char *bus) {
    const gpu_power_lib_t *l = gpu_power_lib();
    p->ok = l->ok && l->by_bus(bus, &p->dev) == 0;
}

/* GPUs NVML sees (every GPU of this node, whatever CUDA_VISIBLE_DEVICES says); 0 without NVML. */
static inline int gpu_power_count(void) { return gpu_power_lib()->count; }

/* Opens NVML for its GPU number i (0 .. gpu_power_count() - 1). */
static inline void gpu_power_open_index(gpu_power_t *p, int i) {
    const gpu_power_lib_t *l = gpu_power_lib();
    p->ok = l->ok && i >= 0 && i < l->count && l->by_index((unsigned)i, &p->dev) == 0;
}

/* Reads one sample; returns 0 when NVML is not open or a query fails. */
static inline int gpu_power_read(const gpu_power_t *p, gpu_power_sample_t *s) {
    const gpu_power_lib_t *l = gpu_power_lib();
    unsigned long long mj = 0;
    if (!p->ok || l->clock(p->dev, 1, &s->mhz) != 0 || l->energy(p->dev, &mj) != 0 || l->reasons(p->dev, &s->reasons) != 0)
        return 0;
    s->joules = mj / 1000.0;
    return 1;
}

/* The reasons bits that limit a busy GPU's clock, as text ("-" for none). */
static inline const char *gpu_power_reasons(unsigned long long bits, char *buf, size_t n) {
    static const struct { unsigned long long bit; const char *name; } r[] = {
        {0x4, "sw-power"}, {0x8, "hw-slowdown"}, {0x20, "sw-thermal"}, {0x40, "hw-thermal"}, {0x80, "power-brake"}};
    size_t at = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < sizeof r / sizeof r[0]; i++)
        if ((bits & r[i].bit) && at < n)
            at += (size_t)snprintf(buf + at, n - at, "%s%s", at ? "," : "", r[i].name);
    if (!at) snprintf(buf, n, "-");
    return buf;
}

#endif
