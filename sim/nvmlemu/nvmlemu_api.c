/* NVML emulator: the exported entry points, each compiled against NVIDIA's declaration in nvml.h.
 * SYNTHETIC answers from the state the controller wrote (README.md); never a measurement.
 *
 * Every entry point first goes through emu_enter() (nvmlemu_core.c): count the call, take the lock,
 * answer FUNCTION_NOT_FOUND if the driver profile lacks it, UNINITIALIZED before nvmlInit, re-read
 * the control file if it changed, check the handle, apply a scripted failure, GPU_IS_LOST,
 * the fixture's not_supported list and the MIG-handle rule; only then does the body run. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "nvmlemu.h"

#define API(sym, hint, expr)                                                                                 \
    emu_ctx c;                                                                                               \
    nvmlReturn_t rc = emu_enter(EMU_SYM_##sym, (hint), &c);                                                  \
    if (rc == NVML_SUCCESS)                                                                                  \
        rc = (expr);                                                                                         \
    emu_leave();                                                                                             \
    return rc

#define API_DEV(sym, dev, expr)                                                                              \
    emu_ctx c;                                                                                               \
    nvmlReturn_t rc = emu_enter_dev(EMU_SYM_##sym, (dev), &c);                                               \
    if (rc == NVML_SUCCESS)                                                                                  \
        rc = (expr);                                                                                         \
    emu_leave();                                                                                             \
    return rc

#define UINT_NA 0xFFFFFFFFu

static int mig_on(const emu_gpu *g) { return g->mig_supported && g->mig_current == 1; }

static nvmlReturn_t copy_str(char *dst, unsigned int len, const char *src)
{
    if (!dst)
        return NVML_ERROR_INVALID_ARGUMENT;
    size_t n = strlen(src);
    if (n + 1 > len)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, n + 1);
    return NVML_SUCCESS;
}

static unsigned long long ctr_value(const emu_ctx *c, enum emu_ctr_id id)
{
    double v = emu_ctr_at(&c->g->ctr[id], c->t_ns);
    return v <= 0 ? 0ULL : (unsigned long long)v;
}

/* ================================================================================ init, system */
nvmlReturn_t nvmlInit(void) { return emu_init(EMU_SYM_nvmlInit, 0); }
nvmlReturn_t nvmlInit_v2(void) { return emu_init(EMU_SYM_nvmlInit_v2, 0); }
nvmlReturn_t nvmlInitWithFlags(unsigned int flags) { return emu_init(EMU_SYM_nvmlInitWithFlags, flags); }

nvmlReturn_t nvmlShutdown(void)
{
    emu_count(EMU_SYM_nvmlShutdown);
    emu_lock();
    nvmlReturn_t rc = emu_shutdown();
    emu_unlock();
    return rc;
}

/* Our own wording for each code (pynvml has its own strings for the codes it knows). */
const char *nvmlErrorString(nvmlReturn_t result)
{
    emu_count(EMU_SYM_nvmlErrorString);
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "NVML is not initialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "An argument is invalid";
    case NVML_ERROR_NOT_SUPPORTED: return "Not supported on this device";
    case NVML_ERROR_NO_PERMISSION: return "No permission";
    case NVML_ERROR_NOT_FOUND: return "Not found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Buffer too small";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver not loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function not found in this driver";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Structure version mismatch";
    case NVML_ERROR_NOT_READY: return "Not ready";
    case NVML_ERROR_MEMORY: return "Out of memory";
    case NVML_ERROR_UNKNOWN: return "Unknown error";
    default: return "Error (emulated)";
    }
}

static nvmlReturn_t sys_int(const emu_ctx *c, int *out)
{
    if (!out)
        return NVML_ERROR_INVALID_ARGUMENT;
    *out = c->s->cuda_version;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    API(nvmlSystemGetDriverVersion, -1, copy_str(version, length, c.s->driver_version));
}
nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    API(nvmlSystemGetNVMLVersion, -1, copy_str(version, length, c.s->nvml_version));
}
nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion)
{
    API(nvmlSystemGetCudaDriverVersion, -1, sys_int(&c, cudaDriverVersion));
}
nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion)
{
    API(nvmlSystemGetCudaDriverVersion_v2, -1, sys_int(&c, cudaDriverVersion));
}

static nvmlReturn_t dev_count(const emu_ctx *c, unsigned int *n)
{
    if (!n)
        return NVML_ERROR_INVALID_ARGUMENT;
    *n = (unsigned)c->s->ngpu;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount) { API(nvmlDeviceGetCount, -1, dev_count(&c, deviceCount)); }
nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    API(nvmlDeviceGetCount_v2, -1, dev_count(&c, deviceCount));
}

/* ================================================================================ handles */
static nvmlReturn_t by_index(const emu_ctx *c, unsigned int index, nvmlDevice_t *dev)
{
    if (!dev || index >= (unsigned)c->s->ngpu)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (c->s->gpu[index].lost)
        return NVML_ERROR_GPU_IS_LOST;
    *dev = &emu_dev_handles[index];
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    API(nvmlDeviceGetHandleByIndex, (int)index, by_index(&c, index, device));
}
nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    API(nvmlDeviceGetHandleByIndex_v2, (int)index, by_index(&c, index, device));
}

static nvmlReturn_t by_uuid(const emu_ctx *c, const char *uuid, nvmlDevice_t *dev)
{
    if (!uuid || !dev)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < c->s->ngpu; i++) {
        emu_gpu *g = &c->s->gpu[i];
        if (strcmp(g->uuid, uuid) == 0) {
            if (g->lost)
                return NVML_ERROR_GPU_IS_LOST;
            *dev = &emu_dev_handles[i];
            return NVML_SUCCESS;
        }
        for (int k = 0; mig_on(g) && k < g->nmig; k++)
            if (strcmp(g->mig[k].uuid, uuid) == 0) {
                if (g->lost)
                    return NVML_ERROR_GPU_IS_LOST;
                *dev = &emu_mig_handles[i][g->mig[k].gi][g->mig[k].ci];
                return NVML_SUCCESS;
            }
    }
    return NVML_ERROR_NOT_FOUND;
}
nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    API(nvmlDeviceGetHandleByUUID, -1, by_uuid(&c, uuid, device));
}

/* "domain:bus:device.function" in hex, any domain width (NVML prints 8 digits, sysfs 4). */
static int parse_bus_id(const char *s, unsigned *dom, unsigned *bus, unsigned *dev, unsigned *fn)
{
    char tail;
    return sscanf(s, "%x:%x:%x.%x%c", dom, bus, dev, fn, &tail) == 4 ? 0 : -1;
}

static nvmlReturn_t by_bus(const emu_ctx *c, const char *bus_id, nvmlDevice_t *dev)
{
    unsigned d, b, v, f;
    if (!bus_id || !dev)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (parse_bus_id(bus_id, &d, &b, &v, &f) != 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < c->s->ngpu; i++) {
        unsigned d2, b2, v2, f2;
        if (parse_bus_id(c->s->gpu[i].bus_id, &d2, &b2, &v2, &f2) == 0 && d == d2 && b == b2 && v == v2 &&
            f == f2) {
            if (c->s->gpu[i].lost)
                return NVML_ERROR_GPU_IS_LOST;
            *dev = &emu_dev_handles[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}
nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *pciBusId, nvmlDevice_t *device)
{
    API(nvmlDeviceGetHandleByPciBusId, -1, by_bus(&c, pciBusId, device));
}
nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device)
{
    API(nvmlDeviceGetHandleByPciBusId_v2, -1, by_bus(&c, pciBusId, device));
}

/* ================================================================================ identity */
static nvmlReturn_t put_uint(unsigned int *out, unsigned int v)
{
    if (!out)
        return NVML_ERROR_INVALID_ARGUMENT;
    *out = v;
    return NVML_SUCCESS;
}

static nvmlReturn_t put_ull(unsigned long long *out, unsigned long long v)
{
    if (!out)
        return NVML_ERROR_INVALID_ARGUMENT;
    *out = v;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    API_DEV(nvmlDeviceGetIndex, device, put_uint(index, (unsigned)c.gpu));
}

/* A MIG device is named "<GPU name> <profile name>", e.g. "NVIDIA H100 80GB HBM3 MIG 1g.10gb". */
static nvmlReturn_t dev_name(const emu_ctx *c, char *name, unsigned int length)
{
    if (!c->m)
        return copy_str(name, length, c->g->name);
    char buf[2 * NVML_DEVICE_NAME_V2_BUFFER_SIZE];
    const emu_profile *p = emu_find_profile_by_id(c->s, c->m->profile_id);
    snprintf(buf, sizeof buf, "%s %s", c->g->name, p ? p->name : "MIG");
    return copy_str(name, length, buf);
}
nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    API_DEV(nvmlDeviceGetName, device, dev_name(&c, name, length));
}
nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    API_DEV(nvmlDeviceGetUUID, device, copy_str(uuid, length, c.m ? c.m->uuid : c.g->uuid));
}

static nvmlReturn_t dev_serial(const emu_ctx *c, char *serial, unsigned int length)
{
    return c->g->serial[0] ? copy_str(serial, length, c->g->serial) : NVML_ERROR_NOT_SUPPORTED;
}
nvmlReturn_t nvmlDeviceGetSerial(nvmlDevice_t device, char *serial, unsigned int length)
{
    API_DEV(nvmlDeviceGetSerial, device, dev_serial(&c, serial, length));
}

static nvmlReturn_t dev_pci(const emu_ctx *c, nvmlPciInfo_t *pci)
{
    unsigned d = 0, b = 0, v = 0, f = 0;
    if (!pci)
        return NVML_ERROR_INVALID_ARGUMENT;
    memset(pci, 0, sizeof *pci);
    parse_bus_id(c->g->bus_id, &d, &b, &v, &f);
    pci->domain = d;
    pci->bus = b;
    pci->device = v;
    pci->pciDeviceId = c->g->pci_device_id;
    pci->pciSubSystemId = c->g->pci_subsystem_id;
    snprintf(pci->busId, sizeof pci->busId, "%08X:%02X:%02X.%X", d, b, v, f);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.%X", d & 0xffffu, b, v, f);
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    API_DEV(nvmlDeviceGetPciInfo_v3, device, dev_pci(&c, pci));
}

/* The GPU memory's own NUMA node: only where the GPU is a NUMA node (GH200 class); else
 * NOT_SUPPORTED, and the CPU side comes from the affinity calls. */
static nvmlReturn_t dev_numa(const emu_ctx *c, unsigned int *node)
{
    if (c->g->memory_numa_node < 0)
        return NVML_ERROR_NOT_SUPPORTED;
    return put_uint(node, (unsigned)c->g->memory_numa_node);
}
nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t device, unsigned int *node)
{
    API_DEV(nvmlDeviceGetNumaNodeId, device, dev_numa(&c, node));
}

static nvmlReturn_t dev_affinity(const emu_ctx *c, unsigned int size, unsigned long *set, unsigned scope)
{
    if (!set || size == 0 || scope > NVML_AFFINITY_SCOPE_SOCKET)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!c->g->have_affinity)
        return NVML_ERROR_NOT_SUPPORTED;
    const uint64_t *mask = scope == NVML_AFFINITY_SCOPE_SOCKET ? c->g->affinity_socket : c->g->affinity;
    for (unsigned i = 0; i < size; i++)
        set[i] = i < EMU_CPU_WORDS ? (unsigned long)mask[i] : 0UL;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetCpuAffinity(nvmlDevice_t device, unsigned int cpuSetSize, unsigned long *cpuSet)
{
    API_DEV(nvmlDeviceGetCpuAffinity, device, dev_affinity(&c, cpuSetSize, cpuSet, NVML_AFFINITY_SCOPE_NODE));
}
nvmlReturn_t nvmlDeviceGetCpuAffinityWithinScope(nvmlDevice_t device, unsigned int cpuSetSize, unsigned long *cpuSet,
                                                 nvmlAffinityScope_t scope)
{
    API_DEV(nvmlDeviceGetCpuAffinityWithinScope, device, dev_affinity(&c, cpuSetSize, cpuSet, scope));
}

static nvmlReturn_t dev_cc(const emu_ctx *c, int *major, int *minor)
{
    if (!major || !minor)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (c->g->cc_major < 0)
        return NVML_ERROR_NOT_SUPPORTED;
    *major = c->g->cc_major;
    *minor = c->g->cc_minor;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor)
{
    API_DEV(nvmlDeviceGetCudaComputeCapability, device, dev_cc(&c, major, minor));
}

/* ================================================================================ memory */
static void mem_numbers(const emu_ctx *c, unsigned long long *total, unsigned long long *used,
                        unsigned long long *reserved)
{
    if (c->m) {
        *total = c->m->mem_total;
        *used = c->m->mem_used;
        *reserved = c->m->mem_reserved < c->m->mem_used ? c->m->mem_reserved : c->m->mem_used;
    } else {
        *total = c->g->mem_total;
        *used = c->g->mem_used;
        *reserved = c->g->mem_reserved < c->g->mem_used ? c->g->mem_reserved : c->g->mem_used;
    }
    if (*used > *total)
        *used = *total;
}

/* v1: "used" includes what the driver reserves (the v1 structure has no field for it). */
static nvmlReturn_t mem_v1(const emu_ctx *c, nvmlMemory_t *mem)
{
    unsigned long long total, used, reserved;
    if (!mem)
        return NVML_ERROR_INVALID_ARGUMENT;
    mem_numbers(c, &total, &used, &reserved);
    mem->total = total;
    mem->used = used;
    mem->free = total - used;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    API_DEV(nvmlDeviceGetMemoryInfo, device, mem_v1(&c, memory));
}

/* v2: "reserved" on its own, "used" without it; free is the same as v1's. */
static nvmlReturn_t mem_v2(const emu_ctx *c, nvmlMemory_v2_t *mem)
{
    unsigned long long total, used, reserved;
    if (!mem)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (mem->version != nvmlMemory_v2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    mem_numbers(c, &total, &used, &reserved);
    mem->total = total;
    mem->reserved = reserved;
    mem->used = used - reserved;
    mem->free = total - used;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    API_DEV(nvmlDeviceGetMemoryInfo_v2, device, mem_v2(&c, memory));
}

/* ================================================================================ utilization */
static nvmlReturn_t util_rates(const emu_ctx *c, nvmlUtilization_t *u)
{
    if (!u)
        return NVML_ERROR_INVALID_ARGUMENT;
    u->gpu = c->g->util_gpu;
    u->memory = c->g->util_mem;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization)
{
    API_DEV(nvmlDeviceGetUtilizationRates, device, util_rates(&c, utilization));
}

static nvmlReturn_t util_codec(const emu_ctx *c, unsigned v, unsigned int *util, unsigned int *period)
{
    if (!util || !period)
        return NVML_ERROR_INVALID_ARGUMENT;
    *util = v;
    *period = (unsigned)c->s->util_period_us;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetEncoderUtilization(nvmlDevice_t device, unsigned int *utilization,
                                             unsigned int *samplingPeriodUs)
{
    API_DEV(nvmlDeviceGetEncoderUtilization, device, util_codec(&c, c.g->util_enc, utilization, samplingPeriodUs));
}
nvmlReturn_t nvmlDeviceGetDecoderUtilization(nvmlDevice_t device, unsigned int *utilization,
                                             unsigned int *samplingPeriodUs)
{
    API_DEV(nvmlDeviceGetDecoderUtilization, device, util_codec(&c, c.g->util_dec, utilization, samplingPeriodUs));
}

/* ================================================================================ power, thermal, clocks */
nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power)
{
    API_DEV(nvmlDeviceGetPowerUsage, device, put_uint(power, c.g->power_mw));
}

static nvmlReturn_t energy(const emu_ctx *c, unsigned long long *e)
{
    if (!c->g->ctr[EMU_CTR_energy_mj].present)
        return NVML_ERROR_NOT_SUPPORTED;
    return put_ull(e, ctr_value(c, EMU_CTR_energy_mj));
}
nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t device, unsigned long long *energy_mj)
{
    API_DEV(nvmlDeviceGetTotalEnergyConsumption, device, energy(&c, energy_mj));
}
nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t device, unsigned int *limit)
{
    API_DEV(nvmlDeviceGetEnforcedPowerLimit, device, put_uint(limit, c.g->power_limit_mw));
}
nvmlReturn_t nvmlDeviceGetPowerManagementLimit(nvmlDevice_t device, unsigned int *limit)
{
    API_DEV(nvmlDeviceGetPowerManagementLimit, device, put_uint(limit, c.g->power_mgmt_limit_mw));
}

static nvmlReturn_t temp_v1(const emu_ctx *c, nvmlTemperatureSensors_t sensor, unsigned int *temp)
{
    if (sensor != NVML_TEMPERATURE_GPU)
        return NVML_ERROR_INVALID_ARGUMENT;
    return put_uint(temp, (unsigned)c->g->temperature_c);
}
nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, nvmlTemperatureSensors_t sensorType, unsigned int *temp)
{
    API_DEV(nvmlDeviceGetTemperature, device, temp_v1(&c, sensorType, temp));
}

static nvmlReturn_t temp_v(const emu_ctx *c, nvmlTemperature_t *t)
{
    if (!t)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (t->version != nvmlTemperature_v1)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (t->sensorType != NVML_TEMPERATURE_GPU)
        return NVML_ERROR_INVALID_ARGUMENT;
    t->temperature = c->g->temperature_c;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t device, nvmlTemperature_t *temperature)
{
    API_DEV(nvmlDeviceGetTemperatureV, device, temp_v(&c, temperature));
}

static nvmlReturn_t clock_of(const int *table, nvmlClockType_t type, unsigned int *mhz)
{
    if ((unsigned)type > NVML_CLOCK_VIDEO)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (table[type] < 0)
        return NVML_ERROR_NOT_SUPPORTED;
    return put_uint(mhz, (unsigned)table[type]);
}
nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, nvmlClockType_t type, unsigned int *clock)
{
    API_DEV(nvmlDeviceGetClockInfo, device, clock_of(c.g->clock, type, clock));
}
nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t device, nvmlClockType_t type, unsigned int *clock)
{
    API_DEV(nvmlDeviceGetMaxClockInfo, device, clock_of(c.g->clock_max, type, clock));
}
nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device, unsigned long long *clocksEventReasons)
{
    API_DEV(nvmlDeviceGetCurrentClocksEventReasons, device, put_ull(clocksEventReasons, c.g->throttle_mask));
}
nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t device, unsigned long long *clocksThrottleReasons)
{
    API_DEV(nvmlDeviceGetCurrentClocksThrottleReasons, device, put_ull(clocksThrottleReasons, c.g->throttle_mask));
}

/* ================================================================================ PCIe */
nvmlReturn_t nvmlDeviceGetCurrPcieLinkGeneration(nvmlDevice_t device, unsigned int *currLinkGen)
{
    API_DEV(nvmlDeviceGetCurrPcieLinkGeneration, device, put_uint(currLinkGen, c.g->pcie_gen));
}
nvmlReturn_t nvmlDeviceGetMaxPcieLinkGeneration(nvmlDevice_t device, unsigned int *maxLinkGen)
{
    API_DEV(nvmlDeviceGetMaxPcieLinkGeneration, device, put_uint(maxLinkGen, c.g->pcie_gen_max));
}
nvmlReturn_t nvmlDeviceGetCurrPcieLinkWidth(nvmlDevice_t device, unsigned int *currLinkWidth)
{
    API_DEV(nvmlDeviceGetCurrPcieLinkWidth, device, put_uint(currLinkWidth, c.g->pcie_width));
}
nvmlReturn_t nvmlDeviceGetMaxPcieLinkWidth(nvmlDevice_t device, unsigned int *maxLinkWidth)
{
    API_DEV(nvmlDeviceGetMaxPcieLinkWidth, device, put_uint(maxLinkWidth, c.g->pcie_width_max));
}

/* KB/s over a 20 ms window: with the real clock the call blocks that long, as the driver's does
 * (pcie_throughput_delay_us in the state; not with a frozen clock). The lock is not held meanwhile. */
nvmlReturn_t nvmlDeviceGetPcieThroughput(nvmlDevice_t device, nvmlPcieUtilCounter_t counter, unsigned int *value)
{
    emu_ctx c;
    long long delay_us = 0;
    nvmlReturn_t rc = emu_enter_dev(EMU_SYM_nvmlDeviceGetPcieThroughput, device, &c);
    if (rc == NVML_SUCCESS) {
        if (counter == NVML_PCIE_UTIL_TX_BYTES)
            rc = put_uint(value, c.g->pcie_tx_kbps);
        else if (counter == NVML_PCIE_UTIL_RX_BYTES)
            rc = put_uint(value, c.g->pcie_rx_kbps);
        else
            rc = NVML_ERROR_INVALID_ARGUMENT;
        if (!c.s->frozen)
            delay_us = c.s->pcie_delay_us;
    }
    emu_leave();
    if (rc == NVML_SUCCESS && delay_us > 0) {
        struct timespec ts = {delay_us / 1000000, (delay_us % 1000000) * 1000};
        nanosleep(&ts, NULL);
    }
    return rc;
}

static nvmlReturn_t replay(const emu_ctx *c, unsigned int *v)
{
    if (!c->g->ctr[EMU_CTR_pcie_replay].present)
        return NVML_ERROR_NOT_SUPPORTED;
    return put_uint(v, (unsigned)ctr_value(c, EMU_CTR_pcie_replay));
}
nvmlReturn_t nvmlDeviceGetPcieReplayCounter(nvmlDevice_t device, unsigned int *value)
{
    API_DEV(nvmlDeviceGetPcieReplayCounter, device, replay(&c, value));
}

/* ================================================================================ ECC, pages, rows */
static nvmlReturn_t ecc_total(const emu_ctx *c, nvmlMemoryErrorType_t type, nvmlEccCounterType_t counter,
                              unsigned long long *out)
{
    if (!out || (unsigned)type > NVML_MEMORY_ERROR_TYPE_UNCORRECTED || (unsigned)counter > NVML_AGGREGATE_ECC)
        return NVML_ERROR_INVALID_ARGUMENT;
    enum emu_ctr_id id = type == NVML_MEMORY_ERROR_TYPE_CORRECTED ? EMU_CTR_ecc_sbe : EMU_CTR_ecc_dbe;
    if (!c->g->ctr[id].present)
        return NVML_ERROR_NOT_SUPPORTED;
    unsigned long long v = ctr_value(c, id);
    if (counter == NVML_AGGREGATE_ECC)
        v += type == NVML_MEMORY_ERROR_TYPE_CORRECTED ? c->g->ecc_agg_sbe : c->g->ecc_agg_dbe;
    *out = v;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, nvmlMemoryErrorType_t errorType,
                                         nvmlEccCounterType_t counterType, unsigned long long *eccCounts)
{
    API_DEV(nvmlDeviceGetTotalEccErrors, device, ecc_total(&c, errorType, counterType, eccCounts));
}

/* Every emulated ECC error is in device memory (DRAM); the on-chip locations count none. */
static nvmlReturn_t ecc_location(const emu_ctx *c, nvmlMemoryErrorType_t type, nvmlEccCounterType_t counter,
                                 nvmlMemoryLocation_t loc, unsigned long long *out)
{
    switch (loc) {
    case NVML_MEMORY_LOCATION_DRAM:
        return ecc_total(c, type, counter, out);
    case NVML_MEMORY_LOCATION_L1_CACHE:
    case NVML_MEMORY_LOCATION_L2_CACHE:
    case NVML_MEMORY_LOCATION_REGISTER_FILE:
    case NVML_MEMORY_LOCATION_SRAM: {
        unsigned long long dummy;
        nvmlReturn_t rc = ecc_total(c, type, counter, &dummy);
        if (rc == NVML_SUCCESS)
            *out = 0;
        return rc;
    }
    case NVML_MEMORY_LOCATION_TEXTURE_MEMORY:
    case NVML_MEMORY_LOCATION_TEXTURE_SHM:
    case NVML_MEMORY_LOCATION_CBU:
        return NVML_ERROR_NOT_SUPPORTED;
    default:
        return NVML_ERROR_INVALID_ARGUMENT;
    }
}
nvmlReturn_t nvmlDeviceGetMemoryErrorCounter(nvmlDevice_t device, nvmlMemoryErrorType_t errorType,
                                             nvmlEccCounterType_t counterType, nvmlMemoryLocation_t locationType,
                                             unsigned long long *count)
{
    API_DEV(nvmlDeviceGetMemoryErrorCounter, device, ecc_location(&c, errorType, counterType, locationType, count));
}

static nvmlReturn_t remapped(const emu_ctx *c, unsigned int *cor, unsigned int *unc, unsigned int *pending,
                             unsigned int *failure)
{
    if (!c->g->remapped_supported)
        return NVML_ERROR_NOT_SUPPORTED;
    if (!cor || !unc || !pending || !failure)
        return NVML_ERROR_INVALID_ARGUMENT;
    *cor = c->g->remap_cor;
    *unc = c->g->remap_unc;
    *pending = c->g->remap_pending;
    *failure = c->g->remap_failure;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrRows, unsigned int *uncRows,
                                       unsigned int *isPending, unsigned int *failureOccurred)
{
    API_DEV(nvmlDeviceGetRemappedRows, device, remapped(&c, corrRows, uncRows, isPending, failureOccurred));
}

/* Size query first (addresses NULL or *count too small: INSUFFICIENT_SIZE with the count needed);
 * timestamps are only touched when the addresses are (pynvml's size query passes no 5th argument). */
static nvmlReturn_t retired(const emu_ctx *c, nvmlPageRetirementCause_t cause, unsigned int *count,
                            unsigned long long *addr, unsigned long long *ts)
{
    if (!c->g->retired_supported)
        return NVML_ERROR_NOT_SUPPORTED;
    if (!count || (unsigned)cause >= NVML_PAGE_RETIREMENT_CAUSE_COUNT)
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned n = 0;
    for (int i = 0; i < c->g->nretired; i++)
        n += c->g->retired[i].cause == (unsigned)cause;
    if (*count == 0 || !addr) {
        *count = n;
        return n ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
    }
    if (*count < n) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    unsigned k = 0;
    for (int i = 0; i < c->g->nretired; i++)
        if (c->g->retired[i].cause == (unsigned)cause) {
            addr[k] = c->g->retired[i].addr;
            if (ts)
                ts[k] = c->g->retired[i].ts_us;
            k++;
        }
    *count = n;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetRetiredPages(nvmlDevice_t device, nvmlPageRetirementCause_t cause, unsigned int *pageCount,
                                       unsigned long long *addresses)
{
    API_DEV(nvmlDeviceGetRetiredPages, device, retired(&c, cause, pageCount, addresses, NULL));
}
nvmlReturn_t nvmlDeviceGetRetiredPages_v2(nvmlDevice_t device, nvmlPageRetirementCause_t cause,
                                          unsigned int *pageCount, unsigned long long *addresses,
                                          unsigned long long *timestamps)
{
    API_DEV(nvmlDeviceGetRetiredPages_v2, device, retired(&c, cause, pageCount, addresses, timestamps));
}

/* nvml.h: "Check if any pages are pending retirement and need a reboot to fully retire"; NOT_SUPPORTED
 * where the GPU has no page retirement (Ampere and newer remap rows instead; see nvmlDeviceGetRemappedRows). */
static nvmlReturn_t retired_pending(const emu_ctx *c, nvmlEnableState_t *pending)
{
    if (!c->g->retired_supported)
        return NVML_ERROR_NOT_SUPPORTED;
    if (!pending)
        return NVML_ERROR_INVALID_ARGUMENT;
    *pending = c->g->retired_pending ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t device, nvmlEnableState_t *isPending)
{
    API_DEV(nvmlDeviceGetRetiredPagesPendingStatus, device, retired_pending(&c, isPending));
}

static unsigned retired_count(const emu_gpu *g, unsigned cause)
{
    unsigned n = 0;
    for (int i = 0; i < g->nretired; i++)
        n += g->retired[i].cause == cause;
    return n;
}

/* ================================================================================ NVLink */
static nvmlReturn_t link_state(const emu_ctx *c, unsigned int link, nvmlEnableState_t *active)
{
    if (c->g->nvlink_max_links == 0)
        return NVML_ERROR_NOT_SUPPORTED;
    if (!active || link >= c->g->nvlink_max_links)
        return NVML_ERROR_INVALID_ARGUMENT;
    *active = link < c->g->nvlink_links && !(c->g->nvlink_down_mask >> link & 1) ? NVML_FEATURE_ENABLED
                                                                                  : NVML_FEATURE_DISABLED;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, nvmlEnableState_t *isActive)
{
    API_DEV(nvmlDeviceGetNvLinkState, device, link_state(&c, link, isActive));
}

/* A GPU-wide counter split over the active links: link k gets total/links, link 0 the remainder,
 * so the per-link values add up to the total. */
static unsigned long long link_share(unsigned long long total, unsigned links, unsigned link)
{
    if (links == 0 || link >= links)
        return 0;
    unsigned long long each = total / links;
    return link == 0 ? total - each * (links - 1) : each;
}

/* nvmlNvLinkErrorCounter_t -> the GPU-wide counter it is a share of */
static const enum emu_ctr_id nvl_err_ctr[EMU_NVL_ERRS] = {EMU_CTR_nvlink_replay, EMU_CTR_nvlink_recovery,
                                                          EMU_CTR_nvlink_crc_flit, EMU_CTR_nvlink_crc_data,
                                                          EMU_CTR_nvlink_ecc_data};

static nvmlReturn_t link_errors(const emu_ctx *c, unsigned int link, nvmlNvLinkErrorCounter_t counter,
                                unsigned long long *out)
{
    if (c->g->nvlink_max_links == 0)
        return NVML_ERROR_NOT_SUPPORTED;
    if (!out || link >= c->g->nvlink_max_links || (unsigned)counter > NVML_NVLINK_ERROR_DL_ECC_DATA)
        return NVML_ERROR_INVALID_ARGUMENT;
    enum emu_ctr_id id = nvl_err_ctr[counter];
    if (!c->g->ctr[id].present)
        return NVML_ERROR_NOT_SUPPORTED;
    *out = link_share(ctr_value(c, id), c->g->nvlink_links, link) + c->g->nvl_err[link][counter];
    return NVML_SUCCESS;
}

/* The per-link error counts a test set on top of the shared counter, summed over the links (the
 * *_ERROR_COUNT_TOTAL fields add them, so the total stays the sum of the links). */
static unsigned long long link_err_extra(const emu_gpu *g, int counter)
{
    unsigned long long sum = 0;
    for (unsigned k = 0; k < g->nvlink_max_links && k < EMU_MAX_LINKS; k++)
        sum += g->nvl_err[k][counter];
    return sum;
}
nvmlReturn_t nvmlDeviceGetNvLinkErrorCounter(nvmlDevice_t device, unsigned int link, nvmlNvLinkErrorCounter_t counter,
                                             unsigned long long *counterValue)
{
    API_DEV(nvmlDeviceGetNvLinkErrorCounter, device, link_errors(&c, link, counter, counterValue));
}

/* ================================================================================ field values */
/* nvmlPerfPolicyType_t -> its violation-time counter (ns); EMU_NCTR for no such policy. */
static enum emu_ctr_id viol_ctr(nvmlPerfPolicyType_t policy)
{
    switch (policy) {
    case NVML_PERF_POLICY_POWER: return EMU_CTR_viol_power_ns;
    case NVML_PERF_POLICY_THERMAL: return EMU_CTR_viol_thermal_ns;
    case NVML_PERF_POLICY_SYNC_BOOST: return EMU_CTR_viol_sync_boost_ns;
    case NVML_PERF_POLICY_BOARD_LIMIT: return EMU_CTR_viol_board_limit_ns;
    case NVML_PERF_POLICY_LOW_UTILIZATION: return EMU_CTR_viol_low_util_ns;
    case NVML_PERF_POLICY_RELIABILITY: return EMU_CTR_viol_reliability_ns;
    case NVML_PERF_POLICY_TOTAL_APP_CLOCKS: return EMU_CTR_viol_total_app_ns;
    case NVML_PERF_POLICY_TOTAL_BASE_CLOCKS: return EMU_CTR_viol_total_base_ns;
    default: return EMU_NCTR;
    }
}

/* One field. Field ids are nvml.h's NVML_FI_DEV_*; NVLink throughput fields take the link as
 * scopeId, UINT_MAX meaning the sum over all links (as the agent asks). */
static void field_one(const emu_ctx *c, nvmlFieldValue_t *v)
{
    const emu_gpu *g = c->g;
    enum emu_ctr_id ctr = EMU_NCTR;
    unsigned long long extra = 0; /* added to the counter: lifetime ECC before this load, per-link errors */
    int per_link = 0;
    v->timestamp = emu_epoch_us(c->s, c->t_ns);
    v->latencyUsec = 0;
    v->valueType = NVML_VALUE_TYPE_UNSIGNED_LONG_LONG;
    v->nvmlReturn = NVML_SUCCESS;
    v->value.ullVal = 0;
    if (emu_field_dropped(c->s, v->fieldId, c->gpu)) {
        v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        return;
    }
    switch (v->fieldId) {
    case NVML_FI_DEV_ECC_SBE_VOL_TOTAL: ctr = EMU_CTR_ecc_sbe; break;
    case NVML_FI_DEV_ECC_DBE_VOL_TOTAL: ctr = EMU_CTR_ecc_dbe; break;
    case NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION: ctr = EMU_CTR_energy_mj; break;
    case NVML_FI_DEV_PCIE_REPLAY_COUNTER: ctr = EMU_CTR_pcie_replay; break;
    case NVML_FI_DEV_ECC_SBE_AGG_TOTAL: ctr = EMU_CTR_ecc_sbe; extra = g->ecc_agg_sbe; break;
    case NVML_FI_DEV_ECC_DBE_AGG_TOTAL: ctr = EMU_CTR_ecc_dbe; extra = g->ecc_agg_dbe; break;
    case NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL:
    case NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL:
    case NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL:
    case NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL: {
        int e = v->fieldId == NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL   ? NVML_NVLINK_ERROR_DL_CRC_FLIT
                : v->fieldId == NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL ? NVML_NVLINK_ERROR_DL_CRC_DATA
                : v->fieldId == NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL   ? NVML_NVLINK_ERROR_DL_REPLAY
                                                                              : NVML_NVLINK_ERROR_DL_RECOVERY;
        ctr = nvl_err_ctr[e];
        extra = link_err_extra(g, e);
        break;
    }
    /* clock-event ("throttle") durations in ns (nvml.h "Field values for Clock Throttle Reason Counters"):
     * the perf-policy fields 74-81 are nvmlDeviceGetViolationStatus's policies in order (74 is also
     * ..._CLOCKS_EVENT_REASON_SW_POWER_CAP, 76 ..._SYNC_BOOST), and 269 is the same SW thermal time as 75 */
    case NVML_FI_DEV_PERF_POLICY_POWER:
    case NVML_FI_DEV_PERF_POLICY_THERMAL:
    case NVML_FI_DEV_PERF_POLICY_SYNC_BOOST:
    case NVML_FI_DEV_PERF_POLICY_BOARD_LIMIT:
    case NVML_FI_DEV_PERF_POLICY_LOW_UTILIZATION:
    case NVML_FI_DEV_PERF_POLICY_RELIABILITY:
    case NVML_FI_DEV_PERF_POLICY_TOTAL_APP_CLOCKS:
    case NVML_FI_DEV_PERF_POLICY_TOTAL_BASE_CLOCKS:
        ctr = viol_ctr((nvmlPerfPolicyType_t)(v->fieldId - NVML_FI_DEV_PERF_POLICY_POWER));
        break;
    case NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN: ctr = EMU_CTR_viol_thermal_ns; break;
    case NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN: ctr = EMU_CTR_viol_hw_thermal_ns; break;
    case NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN: ctr = EMU_CTR_viol_hw_power_brake_ns; break;
    case NVML_FI_DEV_GET_GPU_RECOVERY_ACTION:
        v->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
        v->value.uiVal = g->recovery_action;
        return;
    case NVML_FI_DEV_RETIRED_SBE:
    case NVML_FI_DEV_RETIRED_DBE:
    case NVML_FI_DEV_RETIRED_PENDING:
        if (!g->retired_supported) {
            v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
            return;
        }
        v->value.ullVal = v->fieldId == NVML_FI_DEV_RETIRED_PENDING ? (unsigned long long)(g->retired_pending != 0)
                          : retired_count(g, v->fieldId == NVML_FI_DEV_RETIRED_SBE
                                                 ? NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
                                                 : NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR);
        return;
    case NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: ctr = EMU_CTR_nvlink_tx_kib; per_link = 1; break;
    case NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: ctr = EMU_CTR_nvlink_rx_kib; per_link = 1; break;
    case NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_TX: ctr = EMU_CTR_nvlink_raw_tx_kib; per_link = 1; break;
    case NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_RX: ctr = EMU_CTR_nvlink_raw_rx_kib; per_link = 1; break;
    case NVML_FI_DEV_PCIE_COUNT_TX_BYTES:
    case NVML_FI_DEV_PCIE_COUNT_RX_BYTES:
        if (!g->pcie_byte_counters) {
            v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
            return;
        }
        ctr = v->fieldId == NVML_FI_DEV_PCIE_COUNT_TX_BYTES ? EMU_CTR_pcie_tx_bytes : EMU_CTR_pcie_rx_bytes;
        break;
    case NVML_FI_DEV_MEMORY_TEMP:
        v->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
        if (g->memory_temperature_c < 0)
            v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        else
            v->value.uiVal = (unsigned)g->memory_temperature_c;
        return;
    case NVML_FI_DEV_POWER_INSTANT:
        v->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
        v->value.uiVal = g->power_mw;
        return;
    case NVML_FI_DEV_NVLINK_LINK_COUNT:
        v->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
        if (g->nvlink_max_links == 0)
            v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        else
            v->value.uiVal = g->nvlink_links;
        return;
    case NVML_FI_DEV_NVLINK_GET_SPEED:
        v->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
        if (g->nvlink_speed_mbps == 0)
            v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        else if (v->scopeId != UINT_NA && v->scopeId >= g->nvlink_max_links)
            v->nvmlReturn = NVML_ERROR_INVALID_ARGUMENT;
        else
            v->value.uiVal = (v->scopeId == UINT_NA || v->scopeId < g->nvlink_links) ? g->nvlink_speed_mbps : 0;
        return;
    case NVML_FI_DEV_REMAPPED_COR:
    case NVML_FI_DEV_REMAPPED_UNC:
    case NVML_FI_DEV_REMAPPED_PENDING:
    case NVML_FI_DEV_REMAPPED_FAILURE:
        v->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
        if (!g->remapped_supported) {
            v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
            return;
        }
        v->value.uiVal = v->fieldId == NVML_FI_DEV_REMAPPED_COR   ? g->remap_cor
                         : v->fieldId == NVML_FI_DEV_REMAPPED_UNC ? g->remap_unc
                         : v->fieldId == NVML_FI_DEV_REMAPPED_PENDING ? g->remap_pending
                                                                      : g->remap_failure;
        return;
    default:
        v->nvmlReturn = v->fieldId >= NVML_FI_MAX ? NVML_ERROR_INVALID_ARGUMENT : NVML_ERROR_NOT_SUPPORTED;
        return;
    }
    if (!g->ctr[ctr].present) {
        v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        return;
    }
    unsigned long long total = ctr_value(c, ctr) + extra;
    if (!per_link || v->scopeId == UINT_NA) {
        v->value.ullVal = total;
    } else if (v->scopeId >= g->nvlink_max_links) {
        v->nvmlReturn = NVML_ERROR_INVALID_ARGUMENT;
    } else {
        v->value.ullVal = link_share(total, g->nvlink_links, v->scopeId);
    }
}

static nvmlReturn_t fields(const emu_ctx *c, int count, nvmlFieldValue_t *values)
{
    if (count < 0 || (count > 0 && !values))
        return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < count; i++)
        field_one(c, &values[i]);
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int valuesCount, nvmlFieldValue_t *values)
{
    API_DEV(nvmlDeviceGetFieldValues, device, fields(&c, valuesCount, values));
}

/* ================================================================================ violations, modes */
static nvmlReturn_t violation(const emu_ctx *c, nvmlPerfPolicyType_t policy, nvmlViolationTime_t *out)
{
    enum emu_ctr_id id = viol_ctr(policy);
    if (id == EMU_NCTR)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!out)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!c->g->ctr[id].present)
        return NVML_ERROR_NOT_SUPPORTED;
    out->referenceTime = (unsigned long long)emu_epoch_us(c->s, c->t_ns);
    out->violationTime = ctr_value(c, id);
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetViolationStatus(nvmlDevice_t device, nvmlPerfPolicyType_t perfPolicyType,
                                          nvmlViolationTime_t *violTime)
{
    API_DEV(nvmlDeviceGetViolationStatus, device, violation(&c, perfPolicyType, violTime));
}

static nvmlReturn_t virt(const emu_ctx *c, nvmlGpuVirtualizationMode_t *mode)
{
    if (!mode)
        return NVML_ERROR_INVALID_ARGUMENT;
    *mode = (nvmlGpuVirtualizationMode_t)c->g->virt_mode;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetVirtualizationMode(nvmlDevice_t device, nvmlGpuVirtualizationMode_t *pVirtualMode)
{
    API_DEV(nvmlDeviceGetVirtualizationMode, device, virt(&c, pVirtualMode));
}

/* A vGPU guest's license: one feature when the fixture has one; isGridLicenseSupported 0 elsewhere. */
static nvmlReturn_t grid(const emu_ctx *c, nvmlGridLicensableFeatures_t *f)
{
    if (!f)
        return NVML_ERROR_INVALID_ARGUMENT;
    const emu_gpu *g = c->g;
    memset(f, 0, sizeof *f);
    f->isGridLicenseSupported = g->grid_supported;
    if (!g->grid_supported || !g->grid_nfeat)
        return NVML_SUCCESS;
    f->licensableFeaturesCount = 1;
    nvmlGridLicensableFeature_t *x = &f->gridLicensableFeatures[0];
    x->featureCode = (nvmlGridLicenseFeatureCode_t)g->grid_code;
    x->featureState = g->grid_state;
    x->featureEnabled = g->grid_enabled;
    snprintf(x->productName, sizeof x->productName, "%s", g->grid_product);
    x->licenseExpiry.year = g->grid_year;
    x->licenseExpiry.month = (unsigned short)g->grid_month;
    x->licenseExpiry.day = (unsigned short)g->grid_day;
    x->licenseExpiry.hour = (unsigned short)g->grid_hour;
    x->licenseExpiry.min = (unsigned short)g->grid_min;
    x->licenseExpiry.sec = (unsigned short)g->grid_sec;
    x->licenseExpiry.status = (unsigned char)g->grid_exp_status;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetGridLicensableFeatures_v4(nvmlDevice_t device,
                                                    nvmlGridLicensableFeatures_t *pGridLicensableFeatures)
{
    API_DEV(nvmlDeviceGetGridLicensableFeatures_v4, device, grid(&c, pGridLicensableFeatures));
}

/* ================================================================================ processes */
enum { PROC_V1, PROC_V2 };

/* Compute processes: on a MIG device only its own; on the GPU's handle under MIG all of them (only
 * with privileges: EMU_MIG_PRIV). Graphics processes: none (the emulated nodes run compute only). */
static nvmlReturn_t procs(const emu_ctx *c, int graphics, int kind, unsigned int *count, void *infos)
{
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    const emu_gpu *g = c->g;
    int mig = mig_on(g);
    unsigned n = 0;
    for (int i = 0; !graphics && i < g->nproc; i++)
        if (!c->m || (g->proc[i].gi == c->m->gi && g->proc[i].ci == c->m->ci))
            n++;
    if (n == 0) {
        *count = 0;
        return NVML_SUCCESS;
    }
    if (!infos || *count < n) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    unsigned k = 0;
    for (int i = 0; i < g->nproc; i++) {
        const emu_proc *p = &g->proc[i];
        if (c->m && !(p->gi == c->m->gi && p->ci == c->m->ci))
            continue;
        unsigned long long used =
            (p->used_na || g->proc_mem_na) ? (unsigned long long)NVML_VALUE_NOT_AVAILABLE : p->used;
        if (kind == PROC_V1) {
            nvmlProcessInfo_v1_t *o = (nvmlProcessInfo_v1_t *)infos + k;
            o->pid = p->pid;
            o->usedGpuMemory = used;
        } else {
            nvmlProcessInfo_v2_t *o = (nvmlProcessInfo_v2_t *)infos + k;
            o->pid = p->pid;
            o->usedGpuMemory = used;
            o->gpuInstanceId = mig ? p->gi : UINT_NA;
            o->computeInstanceId = mig ? p->ci : UINT_NA;
        }
        k++;
    }
    *count = n;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                  nvmlProcessInfo_v1_t *infos)
{
    API_DEV(nvmlDeviceGetComputeRunningProcesses, device, procs(&c, 0, PROC_V1, infoCount, infos));
}
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                     nvmlProcessInfo_v2_t *infos)
{
    API_DEV(nvmlDeviceGetComputeRunningProcesses_v2, device, procs(&c, 0, PROC_V2, infoCount, infos));
}
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                     nvmlProcessInfo_t *infos)
{
    API_DEV(nvmlDeviceGetComputeRunningProcesses_v3, device, procs(&c, 0, PROC_V2, infoCount, infos));
}
nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                   nvmlProcessInfo_v1_t *infos)
{
    API_DEV(nvmlDeviceGetGraphicsRunningProcesses, device, procs(&c, 1, PROC_V1, infoCount, infos));
}
nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                      nvmlProcessInfo_v2_t *infos)
{
    API_DEV(nvmlDeviceGetGraphicsRunningProcesses_v2, device, procs(&c, 1, PROC_V2, infoCount, infos));
}
nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                      nvmlProcessInfo_t *infos)
{
    API_DEV(nvmlDeviceGetGraphicsRunningProcesses_v3, device, procs(&c, 1, PROC_V2, infoCount, infos));
}

/* One sample per process that ran (non-zero utilization), stamped with the start of the current
 * sampling period of the emulated clock; none newer than lastSeenTimeStamp: NOT_FOUND. Not
 * supported under MIG (nvml.h: "On MIG-enabled GPUs, querying process utilization is not
 * currently supported"). */
static nvmlReturn_t proc_util(const emu_ctx *c, nvmlProcessUtilizationSample_t *out, unsigned int *count,
                              unsigned long long last_seen)
{
    const emu_gpu *g = c->g;
    if (mig_on(g))
        return NVML_ERROR_NOT_SUPPORTED;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    long long period = c->s->proc_period_us;
    long long t_us = c->t_ns / 1000;
    unsigned long long stamp = (unsigned long long)(c->s->epoch_origin_us + (t_us / period) * period);
    unsigned n = 0;
    if (stamp > last_seen)
        for (int i = 0; i < g->nproc; i++)
            n += (g->proc[i].sm | g->proc[i].mem | g->proc[i].enc | g->proc[i].dec) != 0;
    if (n == 0)
        return NVML_ERROR_NOT_FOUND;
    if (!out || *count < n) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    unsigned k = 0;
    for (int i = 0; i < g->nproc; i++) {
        const emu_proc *p = &g->proc[i];
        if (!(p->sm | p->mem | p->enc | p->dec))
            continue;
        out[k].pid = p->pid;
        out[k].timeStamp = stamp;
        out[k].smUtil = p->sm;
        out[k].memUtil = p->mem;
        out[k].encUtil = p->enc;
        out[k].decUtil = p->dec;
        k++;
    }
    *count = n;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device, nvmlProcessUtilizationSample_t *utilization,
                                             unsigned int *processSamplesCount, unsigned long long lastSeenTimeStamp)
{
    API_DEV(nvmlDeviceGetProcessUtilization, device,
            proc_util(&c, utilization, processSamplesCount, lastSeenTimeStamp));
}

/* ================================================================================ MIG */
static nvmlReturn_t mig_mode(const emu_ctx *c, unsigned int *cur, unsigned int *pend)
{
    if (!c->g->mig_supported)
        return NVML_ERROR_NOT_SUPPORTED;
    if (!cur || !pend)
        return NVML_ERROR_INVALID_ARGUMENT;
    *cur = c->g->mig_current;
    *pend = c->g->mig_pending;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode, unsigned int *pendingMode)
{
    API_DEV(nvmlDeviceGetMigMode, device, mig_mode(&c, currentMode, pendingMode));
}
nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count)
{
    API_DEV(nvmlDeviceGetMaxMigDeviceCount, device, put_uint(count, mig_on(c.g) ? c.g->mig_max_devices : 0));
}

static nvmlReturn_t mig_by_index(const emu_ctx *c, unsigned int index, nvmlDevice_t *out)
{
    if (!out)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!c->g->mig_supported)
        return NVML_ERROR_NOT_SUPPORTED;
    if (!mig_on(c->g) || index >= (unsigned)c->g->nmig)
        return NVML_ERROR_NOT_FOUND;
    const emu_mig *m = &c->g->mig[index];
    *out = &emu_mig_handles[c->gpu][m->gi][m->ci];
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index, nvmlDevice_t *migDevice)
{
    API_DEV(nvmlDeviceGetMigDeviceHandleByIndex, device, mig_by_index(&c, index, migDevice));
}
nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice)
{
    API_DEV(nvmlDeviceIsMigDeviceHandle, device, put_uint(isMigDevice, c.m != NULL));
}
nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id)
{
    API_DEV(nvmlDeviceGetGpuInstanceId, device, c.m ? put_uint(id, c.m->gi) : NVML_ERROR_NOT_SUPPORTED);
}
nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id)
{
    API_DEV(nvmlDeviceGetComputeInstanceId, device, c.m ? put_uint(id, c.m->ci) : NVML_ERROR_NOT_SUPPORTED);
}

static nvmlReturn_t parent_of(const emu_ctx *c, nvmlDevice_t *out)
{
    if (!c->m || !out)
        return NVML_ERROR_INVALID_ARGUMENT;
    *out = &emu_dev_handles[c->gpu];
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice, nvmlDevice_t *device)
{
    API_DEV(nvmlDeviceGetDeviceHandleFromMigDeviceHandle, migDevice, parent_of(&c, device));
}

/* GPU instance handles: nvml.h says both lookups "Require privileged user" (EMU_MIG_PRIV). */
static const emu_mig *first_of_gi(const emu_gpu *g, unsigned gi)
{
    for (int i = 0; i < g->nmig; i++)
        if (g->mig[i].gi == gi)
            return &g->mig[i];
    return NULL;
}

static nvmlReturn_t gi_by_id(const emu_ctx *c, unsigned int id, nvmlGpuInstance_t *out)
{
    if (!out)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!mig_on(c->g))
        return NVML_ERROR_NOT_SUPPORTED;
    if (id >= EMU_MAX_GI_ID || !first_of_gi(c->g, id))
        return NVML_ERROR_NOT_FOUND;
    *out = &emu_gi_handles[c->gpu][id];
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetGpuInstanceById(nvmlDevice_t device, unsigned int id, nvmlGpuInstance_t *gpuInstance)
{
    API_DEV(nvmlDeviceGetGpuInstanceById, device, gi_by_id(&c, id, gpuInstance));
}

static nvmlReturn_t gi_list(const emu_ctx *c, unsigned int profile_id, nvmlGpuInstance_t *out, unsigned int *count)
{
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!mig_on(c->g))
        return NVML_ERROR_NOT_SUPPORTED;
    unsigned n = 0;
    int seen[EMU_MAX_GI_ID] = {0};
    for (int i = 0; i < c->g->nmig; i++) {
        const emu_mig *m = &c->g->mig[i];
        if (m->profile_id != profile_id || seen[m->gi])
            continue;
        seen[m->gi] = 1;
        if (out)
            out[n] = &emu_gi_handles[c->gpu][m->gi];
        n++;
    }
    *count = n;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetGpuInstances(nvmlDevice_t device, unsigned int profileId, nvmlGpuInstance_t *gpuInstances,
                                       unsigned int *count)
{
    API_DEV(nvmlDeviceGetGpuInstances, device, gi_list(&c, profileId, gpuInstances, count));
}

static nvmlReturn_t gi_info(const emu_ctx *c, nvmlGpuInstance_t gi, nvmlGpuInstanceInfo_t *info)
{
    if (!info)
        return NVML_ERROR_INVALID_ARGUMENT;
    const emu_mig *m = first_of_gi(c->g, (unsigned)gi->gi);
    const emu_profile *p = emu_find_profile_by_id(c->s, m->profile_id);
    memset(info, 0, sizeof *info);
    info->device = &emu_dev_handles[c->gpu];
    info->id = m->gi;
    info->profileId = m->profile_id;
    info->placement.start = m->start;
    info->placement.size = p ? p->slices : 1;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlGpuInstanceGetInfo(nvmlGpuInstance_t gpuInstance, nvmlGpuInstanceInfo_t *info)
{
    emu_ctx c;
    nvmlReturn_t rc = emu_enter_gi(EMU_SYM_nvmlGpuInstanceGetInfo, gpuInstance, &c);
    if (rc == NVML_SUCCESS)
        rc = gi_info(&c, gpuInstance, info);
    emu_leave();
    return rc;
}

static const emu_profile *profile_by_enum(const emu_ctx *c, unsigned int profile)
{
    for (int i = 0; i < c->s->nprof; i++)
        if (c->s->prof[i].profile == profile)
            return &c->s->prof[i];
    return NULL;
}

static nvmlReturn_t profile_v1(const emu_ctx *c, unsigned int profile, nvmlGpuInstanceProfileInfo_t *info)
{
    if (!info || profile >= NVML_GPU_INSTANCE_PROFILE_COUNT)
        return NVML_ERROR_INVALID_ARGUMENT;
    const emu_profile *p = profile_by_enum(c, profile);
    if (!c->g->mig_supported || !p)
        return NVML_ERROR_NOT_SUPPORTED;
    memset(info, 0, sizeof *info);
    info->id = p->id;
    info->sliceCount = p->slices;
    info->instanceCount = p->instances;
    info->multiprocessorCount = p->sms;
    info->copyEngineCount = p->copy_engines;
    info->memorySizeMB = p->mem_mb;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfo(nvmlDevice_t device, unsigned int profile,
                                                 nvmlGpuInstanceProfileInfo_t *info)
{
    API_DEV(nvmlDeviceGetGpuInstanceProfileInfo, device, profile_v1(&c, profile, info));
}

/* The versioned profile structures: v2, or v3 (which drops isP2pSupported and adds capabilities). */
static nvmlReturn_t profile_fill(const emu_ctx *c, const emu_profile *p, nvmlGpuInstanceProfileInfo_v2_t *info)
{
    if (!info)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (info->version != nvmlGpuInstanceProfileInfo_v2 && info->version != nvmlGpuInstanceProfileInfo_v3)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!c->g->mig_supported || !p)
        return NVML_ERROR_NOT_SUPPORTED;
    if (info->version == nvmlGpuInstanceProfileInfo_v3) {
        nvmlGpuInstanceProfileInfo_v3_t *v3 = (nvmlGpuInstanceProfileInfo_v3_t *)(void *)info;
        memset(v3, 0, sizeof *v3);
        v3->version = nvmlGpuInstanceProfileInfo_v3;
        v3->id = p->id;
        v3->sliceCount = p->slices;
        v3->instanceCount = p->instances;
        v3->multiprocessorCount = p->sms;
        v3->copyEngineCount = p->copy_engines;
        v3->memorySizeMB = p->mem_mb;
        snprintf(v3->name, sizeof v3->name, "%s", p->name);
        return NVML_SUCCESS;
    }
    memset(info, 0, sizeof *info);
    info->version = nvmlGpuInstanceProfileInfo_v2;
    info->id = p->id;
    info->sliceCount = p->slices;
    info->instanceCount = p->instances;
    info->multiprocessorCount = p->sms;
    info->copyEngineCount = p->copy_engines;
    info->memorySizeMB = p->mem_mb;
    snprintf(info->name, sizeof info->name, "%s", p->name);
    return NVML_SUCCESS;
}

static nvmlReturn_t profile_v(const emu_ctx *c, unsigned int profile, nvmlGpuInstanceProfileInfo_v2_t *info)
{
    if (profile >= NVML_GPU_INSTANCE_PROFILE_COUNT)
        return NVML_ERROR_INVALID_ARGUMENT;
    return profile_fill(c, profile_by_enum(c, profile), info);
}
nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoV(nvmlDevice_t device, unsigned int profile,
                                                  nvmlGpuInstanceProfileInfo_v2_t *info)
{
    API_DEV(nvmlDeviceGetGpuInstanceProfileInfoV, device, profile_v(&c, profile, info));
}

/* By the profile id nvmlGpuInstanceGetInfo reports (19 for 1g.10gb on H100), not the profile index. */
nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoByIdV(nvmlDevice_t device, unsigned int profileId,
                                                      nvmlGpuInstanceProfileInfo_v2_t *info)
{
    API_DEV(nvmlDeviceGetGpuInstanceProfileInfoByIdV, device,
            profile_fill(&c, emu_find_profile_by_id(c.s, profileId), info));
}

/* ================================================================================ GPM */
static nvmlReturn_t gpm_support(const emu_ctx *c, nvmlGpmSupport_t *s)
{
    if (!s)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (s->version != NVML_GPM_SUPPORT_VERSION)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    s->isSupportedDevice = (unsigned)c->g->gpm_supported;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlGpmQueryDeviceSupport(nvmlDevice_t device, nvmlGpmSupport_t *gpmSupport)
{
    API_DEV(nvmlGpmQueryDeviceSupport, device, gpm_support(&c, gpmSupport));
}

static nvmlReturn_t gpm_alloc(nvmlGpmSample_t *out)
{
    if (!out)
        return NVML_ERROR_INVALID_ARGUMENT;
    *out = emu_gpm_new();
    return *out ? NVML_SUCCESS : NVML_ERROR_MEMORY;
}
nvmlReturn_t nvmlGpmSampleAlloc(nvmlGpmSample_t *gpmSample) { API(nvmlGpmSampleAlloc, -1, gpm_alloc(gpmSample)); }

static nvmlReturn_t gpm_free(nvmlGpmSample_t smp)
{
    if (!emu_gpm_valid(smp))
        return NVML_ERROR_INVALID_ARGUMENT;
    emu_gpm_free(smp);
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlGpmSampleFree(nvmlGpmSample_t gpmSample) { API(nvmlGpmSampleFree, -1, gpm_free(gpmSample)); }

/* A sample holds the value at this instant of every GPM counter of the device (gi -1) or of one
 * GPU instance: these come from the fixture's "gpm" model, not from the PCIe/NVLink counters. */
static nvmlReturn_t gpm_take(const emu_ctx *c, int gi, nvmlGpmSample_t smp)
{
    if (!emu_gpm_valid(smp))
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!c->g->gpm_supported)
        return NVML_ERROR_NOT_SUPPORTED;
    smp->taken = 1;
    smp->gpu = c->gpu;
    smp->gi = gi;
    smp->t_ns = c->t_ns;
    smp->n = 0;
    for (int i = 0; i < c->g->ngpm && smp->n < EMU_MAX_GPM_SAMPLE; i++)
        if (c->g->gpm[i].gi == gi) {
            smp->metric[smp->n] = c->g->gpm[i].metric;
            smp->value[smp->n] = emu_ctr_at(&c->g->gpm[i].c, c->t_ns);
            smp->n++;
        }
    return NVML_SUCCESS;
}

static nvmlReturn_t gpm_sample(const emu_ctx *c, nvmlGpmSample_t smp)
{
    return gpm_take(c, c->m ? (int)c->m->gi : -1, smp);
}
nvmlReturn_t nvmlGpmSampleGet(nvmlDevice_t device, nvmlGpmSample_t gpmSample)
{
    API_DEV(nvmlGpmSampleGet, device, gpm_sample(&c, gpmSample));
}

static nvmlReturn_t gpm_mig_sample(const emu_ctx *c, unsigned int gi, nvmlGpmSample_t smp)
{
    if (!mig_on(c->g) || gi >= EMU_MAX_GI_ID || !first_of_gi(c->g, gi))
        return NVML_ERROR_INVALID_ARGUMENT;
    return gpm_take(c, (int)gi, smp);
}
nvmlReturn_t nvmlGpmMigSampleGet(nvmlDevice_t device, unsigned int gpuInstanceId, nvmlGpmSample_t gpmSample)
{
    API_DEV(nvmlGpmMigSampleGet, device, gpm_mig_sample(&c, gpuInstanceId, gpmSample));
}

static int sample_value(nvmlGpmSample_t s, unsigned metric, double *out)
{
    for (int i = 0; i < s->n; i++)
        if (s->metric[i] == metric) {
            *out = s->value[i];
            return 1;
        }
    return 0;
}

/* Metrics over sample1 -> sample2: (counter2 - counter1) / seconds between them. Two samples at
 * most 100 ms apart (nvml.h: the interval "should be greater than 100ms") give every metric
 * NVML_ERROR_NOT_READY; samples of different devices or in the wrong order: INVALID_ARGUMENT. */
static nvmlReturn_t gpm_metrics(const emu_ctx *c, nvmlGpmMetricsGet_t *mg)
{
    if (!mg)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (mg->version != NVML_GPM_METRICS_GET_VERSION)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    nvmlGpmSample_t a = mg->sample1, b = mg->sample2;
    if (mg->numMetrics > NVML_GPM_METRIC_MAX || !emu_gpm_valid(a) || !emu_gpm_valid(b) || !a->taken || !b->taken ||
        a->gpu != b->gpu || a->gi != b->gi || b->t_ns <= a->t_ns)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (a->gpu >= c->s->ngpu)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (c->s->gpu[a->gpu].lost)
        return NVML_ERROR_GPU_IS_LOST;
    double dt = (double)(b->t_ns - a->t_ns) / 1e9;
    int too_close = b->t_ns - a->t_ns <= 100000000LL;
    for (unsigned k = 0; k < mg->numMetrics; k++) {
        nvmlGpmMetric_t *m = &mg->metrics[k];
        double va, vb;
        m->value = 0.0;
        memset(&m->metricInfo, 0, sizeof m->metricInfo);
        if (!sample_value(a, m->metricId, &va) || !sample_value(b, m->metricId, &vb))
            m->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        else if (too_close)
            m->nvmlReturn = NVML_ERROR_NOT_READY;
        else {
            m->nvmlReturn = NVML_SUCCESS;
            m->value = (vb - va) / dt;
        }
    }
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlGpmMetricsGet(nvmlGpmMetricsGet_t *metricsGet)
{
    API(nvmlGpmMetricsGet, -1, gpm_metrics(&c, metricsGet));
}

/* ================================================================================ events */
static nvmlReturn_t set_create(nvmlEventSet_t *out)
{
    if (!out)
        return NVML_ERROR_INVALID_ARGUMENT;
    *out = emu_event_set_new();
    return *out ? NVML_SUCCESS : NVML_ERROR_MEMORY;
}
nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) { API(nvmlEventSetCreate, -1, set_create(set)); }

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *eventTypes)
{
    API_DEV(nvmlDeviceGetSupportedEventTypes, device, put_ull(eventTypes, c.g->event_types));
}

static nvmlReturn_t reg(const emu_ctx *c, unsigned long long types, nvmlEventSet_t set)
{
    if (!emu_event_set_valid(set))
        return NVML_ERROR_INVALID_ARGUMENT;
    if (types == 0 || (types & ~c->g->event_types))
        return NVML_ERROR_NOT_SUPPORTED;
    emu_event_register(set, c->gpu, types);
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes, nvmlEventSet_t set)
{
    API_DEV(nvmlDeviceRegisterEvents, device, reg(&c, eventTypes, set));
}

/* Waits up to timeoutms (0: answer at once) for an event, re-reading the control file every 5 ms
 * meanwhile so that an XID injected by another process arrives. The lock is released while waiting. */
static nvmlReturn_t wait_event(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeout_ms, int v2)
{
    struct timespec t0, now;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    if (!emu_event_set_valid(set) || !data)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (;;) {
        emu_event ev;
        if (emu_event_pop(set, &ev)) {
            data->device = &emu_dev_handles[ev.gpu];
            data->eventType = ev.type;
            data->eventData = ev.data;
            if (v2) {
                data->gpuInstanceId = ev.gi;
                data->computeInstanceId = ev.ci;
            }
            return NVML_SUCCESS;
        }
        clock_gettime(CLOCK_MONOTONIC, &now);
        long long waited_ms = (now.tv_sec - t0.tv_sec) * 1000LL + (now.tv_nsec - t0.tv_nsec) / 1000000LL;
        if (waited_ms >= (long long)timeout_ms)
            return NVML_ERROR_TIMEOUT;
        long long left_ms = (long long)timeout_ms - waited_ms;
        struct timespec nap = {0, (left_ms < 5 ? left_ms : 5) * 1000000L};
        emu_unlock();
        nanosleep(&nap, NULL);
        emu_lock();
        emu_refresh();
        if (!emu_event_set_valid(set))
            return NVML_ERROR_INVALID_ARGUMENT;
    }
}
nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    API(nvmlEventSetWait, -1, wait_event(set, data, timeoutms, 0));
}
nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    API(nvmlEventSetWait_v2, -1, wait_event(set, data, timeoutms, 1));
}

static nvmlReturn_t set_free(nvmlEventSet_t set)
{
    if (!emu_event_set_valid(set))
        return NVML_ERROR_INVALID_ARGUMENT;
    emu_event_set_free(set);
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) { API(nvmlEventSetFree, -1, set_free(set)); }
