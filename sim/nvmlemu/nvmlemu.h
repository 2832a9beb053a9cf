/* Internal types of the NVML emulator (SYNTHETIC devices; see README.md). Not installed anywhere:
 * only nvmlemu_core.c and nvmlemu_api.c include it. NVIDIA's own nvml.h comes first so that every
 * exported entry point is compiled against NVIDIA's declaration of it; with
 * NVML_NO_UNVERSIONED_FUNC_DEFS the header declares the old unversioned names too (instead of
 * #defining them to their _v2/_v3 successors), so both can be exported side by side. */
#ifndef NVMLEMU_H
#define NVMLEMU_H

#define NVML_NO_UNVERSIONED_FUNC_DEFS
#include <nvml.h>

#include <pthread.h>
#include <stdint.h>

#include "nvmlemu_syms.h"

enum emu_sym {
#define EMU_SYM_ENUM(n, f) EMU_SYM_##n,
    EMU_SYMBOLS(EMU_SYM_ENUM)
#undef EMU_SYM_ENUM
    EMU_NSYMS
};

/* Limits of one emulated node (the controller refuses fixtures beyond them). */
#define EMU_MAX_GPUS 32
#define EMU_MAX_PROCS 128
#define EMU_MAX_MIG 16       /* MIG devices (GPU instance + compute instance) per GPU */
#define EMU_MAX_GI_ID 16     /* GPU instance ids 0..15 */
#define EMU_MAX_CI_ID 8      /* compute instance ids 0..7 */
#define EMU_MAX_GPM 256      /* GPM metric counters per GPU, the device's and each instance's */
#define EMU_MAX_GPM_SAMPLE 64 /* metric counters one GPM sample holds */
#define EMU_MAX_NOTSUP 48
#define EMU_MAX_FAIL 64
#define EMU_MAX_DROP 64
#define EMU_MAX_EVENTS 1024
#define EMU_MAX_PROFILES 24
#define EMU_MAX_RETIRED 64
#define EMU_MAX_LINKS NVML_NVLINK_MAX_LINKS /* per-link NVLink error offsets and link-down bits */
#define EMU_NVL_ERRS 5       /* nvmlNvLinkErrorCounter_t: DL_REPLAY .. DL_ECC_DATA */
#define EMU_CPU_WORDS 16     /* 1024 CPUs in an affinity mask */
#define EMU_QUEUE 256        /* events one event set holds before dropping the oldest */

/* The cumulative counters of a GPU: value(t) = base + rate * (t - t0) / 1 s. */
#define EMU_COUNTERS(X)                                                                        \
    X(energy_mj) X(pcie_tx_bytes) X(pcie_rx_bytes) X(nvlink_tx_kib) X(nvlink_rx_kib)           \
    X(nvlink_raw_tx_kib) X(nvlink_raw_rx_kib) X(ecc_sbe) X(ecc_dbe) X(pcie_replay)              \
    X(nvlink_replay) X(nvlink_recovery) X(nvlink_crc_flit) X(nvlink_crc_data) X(nvlink_ecc_data) \
    X(viol_power_ns) X(viol_thermal_ns) X(viol_sync_boost_ns) X(viol_board_limit_ns)           \
    X(viol_low_util_ns) X(viol_reliability_ns) X(viol_total_app_ns) X(viol_total_base_ns)      \
    X(viol_hw_thermal_ns) X(viol_hw_power_brake_ns)

enum emu_ctr_id {
#define EMU_CTR_ENUM(n) EMU_CTR_##n,
    EMU_COUNTERS(EMU_CTR_ENUM)
#undef EMU_CTR_ENUM
    EMU_NCTR
};

typedef struct {
    double base;
    double rate;   /* per second */
    int64_t t0_ns; /* emulated time at which the value was base */
    int present;
} emu_ctr;

typedef struct {
    unsigned pid;
    unsigned long long used;
    int used_na; /* usedGpuMemory is NVML_VALUE_NOT_AVAILABLE */
    unsigned gi, ci;
    unsigned sm, mem, enc, dec; /* utilization samples, percent */
} emu_proc;

typedef struct {
    unsigned gi, ci, profile_id, start;
    unsigned long long mem_total, mem_used, mem_reserved;
    char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
} emu_mig;

typedef struct {
    int gi; /* -1: the whole device */
    unsigned metric;
    emu_ctr c;
} emu_gpm;

typedef struct {
    unsigned cause;
    unsigned long long addr, ts_us;
} emu_page;

typedef struct {
    unsigned profile; /* NVML_GPU_INSTANCE_PROFILE_* */
    unsigned id, slices, instances, sms, copy_engines;
    unsigned long long mem_mb;
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
} emu_profile;

typedef struct {
    int id;
    char sym[64];
    int code;
    int gpu;    /* -1: every GPU and the calls without one */
    long times; /* -1: until cleared */
} emu_fail;

typedef struct {
    unsigned fid;
    int gpu; /* -1: every GPU */
} emu_drop;

typedef struct {
    long long seq;
    int gpu;
    unsigned long long type, data;
    unsigned gi, ci;
} emu_event;

typedef struct {
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
    char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    char serial[NVML_DEVICE_SERIAL_BUFFER_SIZE];
    char bus_id[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
    unsigned pci_device_id, pci_subsystem_id;
    int memory_numa_node; /* nvmlDeviceGetNumaNodeId; -1: NOT_SUPPORTED (GPU is not a NUMA node) */
    int have_affinity;
    uint64_t affinity[EMU_CPU_WORDS], affinity_socket[EMU_CPU_WORDS];
    int cc_major, cc_minor; /* -1: unknown */
    unsigned long long mem_total, mem_used, mem_reserved;
    unsigned util_gpu, util_mem, util_enc, util_dec;
    unsigned power_mw, power_limit_mw, power_mgmt_limit_mw;
    int temperature_c, memory_temperature_c; /* memory: -1 none */
    int clock[4], clock_max[4];              /* NVML_CLOCK_GRAPHICS..VIDEO, MHz; -1 none */
    unsigned long long throttle_mask;
    unsigned pcie_gen, pcie_gen_max, pcie_width, pcie_width_max;
    unsigned pcie_tx_kbps, pcie_rx_kbps;
    int pcie_byte_counters;
    unsigned nvlink_links, nvlink_max_links, nvlink_speed_mbps;
    unsigned long long nvlink_down_mask; /* bit k: link k (< nvlink_links) is down (state DISABLED) */
    unsigned long long nvl_err[EMU_MAX_LINKS][EMU_NVL_ERRS]; /* per-link error counts on top of the shared counters */
    int mig_supported;
    unsigned mig_current, mig_pending, mig_max_devices;
    unsigned virt_mode;
    unsigned long long ecc_agg_sbe, ecc_agg_dbe; /* lifetime counts from before this driver load */
    int remapped_supported;
    unsigned remap_cor, remap_unc, remap_pending, remap_failure;
    int retired_supported, nretired;
    int retired_pending; /* nvmlDeviceGetRetiredPagesPendingStatus, field NVML_FI_DEV_RETIRED_PENDING */
    unsigned recovery_action; /* field NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (nvmlDeviceGpuRecoveryAction_t) */
    emu_page retired[EMU_MAX_RETIRED];
    int lost;
    int gpm_supported;
    int proc_mem_na;
    int grid_supported, grid_nfeat;
    unsigned grid_code, grid_state, grid_enabled, grid_exp_status;
    unsigned grid_year, grid_month, grid_day, grid_hour, grid_min, grid_sec;
    char grid_product[NVML_GRID_LICENSE_BUFFER_SIZE];
    unsigned long long event_types;
    int nnotsup;
    char notsup[EMU_MAX_NOTSUP][64];
    emu_ctr ctr[EMU_NCTR];
    int ngpm;
    emu_gpm gpm[EMU_MAX_GPM];
    int nproc;
    emu_proc proc[EMU_MAX_PROCS];
    int nmig;
    emu_mig mig[EMU_MAX_MIG];
} emu_gpu;

enum emu_profile_id { EMU_PROFILE_R550 = 0, EMU_PROFILE_OLD = 1, EMU_PROFILE_CUDA14 = 2 };

typedef struct {
    char node_id[64];
    unsigned long long generation;
    char driver_version[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE];
    char nvml_version[NVML_SYSTEM_NVML_VERSION_BUFFER_SIZE];
    int cuda_version;
    int profile;
    int privileged;
    int frozen;
    int64_t clock_origin_ns, clock_offset_ns, epoch_origin_us;
    int64_t proc_period_us, pcie_delay_us, util_period_us;
    int ngpu;
    emu_gpu gpu[EMU_MAX_GPUS];
    int nprof;
    emu_profile prof[EMU_MAX_PROFILES];
    int nfail;
    emu_fail fail[EMU_MAX_FAIL];
    int ndrop;
    emu_drop drop[EMU_MAX_DROP];
    int nevent;
    emu_event event[EMU_MAX_EVENTS];
} emu_state;

/* Handles the library gives out. They live in static arrays, so a handle stays valid when the
 * state is reloaded; it is checked against the current state on every call. */
#define EMU_MAGIC_DEV 0x4e56444bu
#define EMU_MAGIC_GI 0x4e564749u
#define EMU_MAGIC_SET 0x4e564553u
#define EMU_MAGIC_GPM 0x4e56474du

struct nvmlDevice_st {
    uint32_t magic;
    int gpu;
    int gi, ci; /* -1: the GPU itself; else the MIG device (GPU instance gi, compute instance ci) */
};

struct nvmlGpuInstance_st {
    uint32_t magic;
    int gpu, gi;
};

struct nvmlEventSet_st {
    uint32_t magic;
    int live;
    unsigned long long types[EMU_MAX_GPUS]; /* event types registered per GPU */
    int head, count;
    unsigned long long dropped;
    emu_event q[EMU_QUEUE];
    struct nvmlEventSet_st *next;
};

struct nvmlGpmSample_st {
    uint32_t magic;
    int taken;
    int gpu, gi; /* gi -1: device-level sample */
    int64_t t_ns;
    int n;
    unsigned metric[EMU_MAX_GPM_SAMPLE];
    double value[EMU_MAX_GPM_SAMPLE];
    struct nvmlGpmSample_st *next;
};

/* What an entry point has resolved before its body runs (under the lock). */
typedef struct {
    emu_state *s;
    int gpu;      /* -1: none */
    emu_gpu *g;   /* NULL: none */
    emu_mig *m;   /* NULL: the call is on the GPU itself */
    int64_t t_ns; /* emulated time of this call */
    enum emu_sym sym;
} emu_ctx;

/* ---- nvmlemu_core.c ---- */
extern const char *const emu_sym_names[EMU_NSYMS];
extern const unsigned emu_sym_flags[EMU_NSYMS];
extern struct nvmlDevice_st emu_dev_handles[EMU_MAX_GPUS];
extern struct nvmlDevice_st emu_mig_handles[EMU_MAX_GPUS][EMU_MAX_GI_ID][EMU_MAX_CI_ID];
extern struct nvmlGpuInstance_st emu_gi_handles[EMU_MAX_GPUS][EMU_MAX_GI_ID];

void emu_count(enum emu_sym sym);
void emu_lock(void);
void emu_unlock(void);
nvmlReturn_t emu_init(enum emu_sym sym, unsigned int flags);
nvmlReturn_t emu_shutdown(void);
nvmlReturn_t emu_enter(enum emu_sym sym, int gpu_hint, emu_ctx *c);
nvmlReturn_t emu_enter_dev(enum emu_sym sym, nvmlDevice_t dev, emu_ctx *c);
nvmlReturn_t emu_enter_gi(enum emu_sym sym, nvmlGpuInstance_t gi, emu_ctx *c);
void emu_leave(void);
void emu_refresh(void);
int64_t emu_now_ns(const emu_state *s);
int64_t emu_epoch_us(const emu_state *s, int64_t t_ns);
double emu_ctr_at(const emu_ctr *c, int64_t t_ns);
int emu_field_dropped(const emu_state *s, unsigned fid, int gpu);
emu_mig *emu_find_mig(emu_gpu *g, unsigned gi, unsigned ci);
const emu_profile *emu_find_profile_by_id(const emu_state *s, unsigned id);
nvmlEventSet_t emu_event_set_new(void);
int emu_event_set_valid(nvmlEventSet_t set);
void emu_event_set_free(nvmlEventSet_t set);
void emu_event_register(nvmlEventSet_t set, int gpu, unsigned long long types);
int emu_event_pop(nvmlEventSet_t set, emu_event *out);
nvmlGpmSample_t emu_gpm_new(void);
int emu_gpm_valid(nvmlGpmSample_t s);
void emu_gpm_free(nvmlGpmSample_t s);

#endif
