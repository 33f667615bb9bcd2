/*
 * gpu_power.h - a GPU's SM clock, power, energy counter and clock-limit
 * reasons through NVML, loaded at run time (dlopen of libnvidia-ml.so.1): no
 * build dependency, and where the driver's library or a query is missing the
 * probe says so (ok = 0) and the benchmark prints "n/a". For benchmarks only
 * (bench/gemm_bench.cu): under sustained load an H100/H200 GEMM is limited by
 * power, so its clock and energy per FLOP explain its rate.
 * NVML's calls are declared here by hand (stable C ABI; the CUDA toolkit here
 * ships no nvml.h): nvmlReturn_t is an int, 0 = success; nvmlDevice_t is an
 * opaque pointer.
 */
#ifndef COMET_BENCH_GPU_POWER_H
#define COMET_BENCH_GPU_POWER_H

#include <dlfcn.h>
#include <stdio.h>

typedef struct {
    int ok;
    void *dev;
    int (*clock)(void *dev, int type, unsigned *mhz);         /* nvmlDeviceGetClockInfo; type 1 = SM */
    int (*power)(void *dev, unsigned *mw);                    /* nvmlDeviceGetPowerUsage */
    int (*energy)(void *dev, unsigned long long *mj);         /* nvmlDeviceGetTotalEnergyConsumption */
    int (*reasons)(void *dev, unsigned long long *bits);      /* nvmlDeviceGetCurrentClocksEventReasons */
} gpu_power_t;

/* One sample: SM clock (MHz), power (W), energy since driver load (J), reasons bits. */
typedef struct {
    unsigned mhz;
    double watts, joules;
    unsigned long long reasons;
} gpu_power_sample_t;

/* Opens NVML for the GPU at PCI bus id `bus` (cudaDeviceGetPCIBusId). */
static inline void gpu_power_open(gpu_power_t *p, const char *bus) {
    p->ok = 0;
    void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return;
    int (*init)(void) = (int (*)(void))dlsym(lib, "nvmlInit_v2");
    int (*by_bus)(const char *, void **) = (int (*)(const char *, void **))dlsym(lib, "nvmlDeviceGetHandleByPciBusId_v2");
    p->clock = (int (*)(void *, int, unsigned *))dlsym(lib, "nvmlDeviceGetClockInfo");
    p->power = (int (*)(void *, unsigned *))dlsym(lib, "nvmlDeviceGetPowerUsage");
    p->energy = (int (*)(void *, unsigned long long *))dlsym(lib, "nvmlDeviceGetTotalEnergyConsumption");
    p->reasons = (int (*)(void *, unsigned long long *))dlsym(lib, "nvmlDeviceGetCurrentClocksEventReasons");
    if (!p->reasons) p->reasons = (int (*)(void *, unsigned long long *))dlsym(lib, "nvmlDeviceGetCurrentClocksThrottleReasons");
    if (!init || !by_bus || !p->clock || !p->power || !p->energy || !p->reasons || init() != 0 ||
        by_bus(bus, &p->dev) != 0)
        return;
    p->ok = 1;
}

/* Reads one sample; returns 0 when NVML is not open or a query fails. */
static inline int gpu_power_read(const gpu_power_t *p, gpu_power_sample_t *s) {
    unsigned mw = 0;
    unsigned long long mj = 0;
    if (!p->ok || p->clock(p->dev, 1, &s->mhz) != 0 || p->power(p->dev, &mw) != 0 || p->energy(p->dev, &mj) != 0 ||
        p->reasons(p->dev, &s->reasons) != 0)
        return 0;
    s->watts = mw / 1000.0, s->joules = mj / 1000.0;
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
