/* NVML emulator, the machinery behind the entry points: the state file parser, the emulated clock,
 * the control-file reload, per-symbol call counters, fail rules, XID event queues, GPM samples and
 * handle checks. SYNTHETIC: every value comes from the state the Python controller
 * (gpuagent.sim.nvml_emulator) writes; nothing here measures a GPU.
 *
 * Files in the state directory ($GPUAGENT_NVMLEMU_DIR, read at every nvmlInit*):
 *   state        the node as started (key/value lines, format in README.md)
 *   control      the node now: the same format, rewritten whole by the controller on every change
 *   generation   8 bytes, a counter the controller bumps after writing control; mapped here and
 *                compared on every call, so a change is seen at the next call for one memory read
 *   calls.<pid>  written here: one 64-byte slot per exported symbol with its call count (mapped
 *                shared, so the controller reads the counts of a live process)
 * A malformed file is one sentence on stderr (and in the file "error"), never a crash: nvmlInit
 * fails, or a bad control file is ignored and the previous state kept. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "nvmlemu.h"

#define EMU_ENV_DIR "GPUAGENT_NVMLEMU_DIR"

const char *const emu_sym_names[EMU_NSYMS] = {
#define EMU_SYM_NAME(n, f) #n,
    EMU_SYMBOLS(EMU_SYM_NAME)
#undef EMU_SYM_NAME
};
const unsigned emu_sym_flags[EMU_NSYMS] = {
#define EMU_SYM_FLAG(n, f) (f),
    EMU_SYMBOLS(EMU_SYM_FLAG)
#undef EMU_SYM_FLAG
};
static const char *const emu_ctr_names[EMU_NCTR] = {
#define EMU_CTR_NAME(n) #n,
    EMU_COUNTERS(EMU_CTR_NAME)
#undef EMU_CTR_NAME
};
static char emu_sym_base[EMU_NSYMS][64]; /* the name without a _vN suffix, for fail rules and not_supported */

struct nvmlDevice_st emu_dev_handles[EMU_MAX_GPUS];
struct nvmlDevice_st emu_mig_handles[EMU_MAX_GPUS][EMU_MAX_GI_ID][EMU_MAX_CI_ID];
struct nvmlGpuInstance_st emu_gi_handles[EMU_MAX_GPUS][EMU_MAX_GI_ID];

/* ------------------------------------------------------------------------------------------------
 * Call counters: "calls.<pid>" = a 64-byte header, then one 64-byte slot per symbol (name[56],
 * uint64 count). Calls made before the first nvmlInit (or without a state directory) are counted
 * in process memory only. A map is never unmapped: another thread may be counting into it. */
#define EMU_CHDR 64
#define EMU_CENT 64
static uint64_t emu_local_counts[EMU_NSYMS];
static unsigned char *emu_cmap;

void emu_count(enum emu_sym sym)
{
    unsigned char *m = __atomic_load_n(&emu_cmap, __ATOMIC_ACQUIRE);
    uint64_t *p = m ? (uint64_t *)(void *)(m + EMU_CHDR + (size_t)sym * EMU_CENT + 56) : &emu_local_counts[sym];
    __atomic_fetch_add(p, 1, __ATOMIC_RELAXED);
}

/* ------------------------------------------------------------------------------------------------
 * Process-local runtime: what the driver keeps between calls and the state files do not say. */
static struct {
    pthread_mutex_t mu;
    emu_state *s;
    int refcount;
    char dir[PATH_MAX];
    char node_id[64];
    unsigned long long loaded_gen;
    uint64_t *genp;
    struct stat ctl_st;
    int have_ctl_st;
    char cmap_dir[PATH_MAX];
    pid_t cmap_pid;
    long long last_seq;
    int npending;
    emu_event pending[EMU_MAX_EVENTS];
    int nused;
    int used_id[4 * EMU_MAX_FAIL];
    long used_n[4 * EMU_MAX_FAIL];
    nvmlEventSet_t sets;
    nvmlGpmSample_t samples;
    char last_error[512];
} R = {.mu = PTHREAD_MUTEX_INITIALIZER};

void emu_lock(void) { pthread_mutex_lock(&R.mu); }
void emu_unlock(void) { pthread_mutex_unlock(&R.mu); }

__attribute__((constructor)) static void emu_setup(void)
{
    for (int i = 0; i < EMU_NSYMS; i++) {
        const char *n = emu_sym_names[i];
        size_t len = strlen(n);
        size_t cut = len;
        /* strip a trailing _v<digits> */
        size_t j = len;
        while (j > 0 && n[j - 1] >= '0' && n[j - 1] <= '9')
            j--;
        if (j < len && j >= 2 && n[j - 1] == 'v' && n[j - 2] == '_')
            cut = j - 2;
        if (cut >= sizeof emu_sym_base[i])
            cut = sizeof emu_sym_base[i] - 1;
        memcpy(emu_sym_base[i], n, cut);
        emu_sym_base[i][cut] = '\0';
    }
    for (int g = 0; g < EMU_MAX_GPUS; g++) {
        emu_dev_handles[g] = (struct nvmlDevice_st){EMU_MAGIC_DEV, g, -1, -1};
        for (int gi = 0; gi < EMU_MAX_GI_ID; gi++) {
            emu_gi_handles[g][gi] = (struct nvmlGpuInstance_st){EMU_MAGIC_GI, g, gi};
            for (int ci = 0; ci < EMU_MAX_CI_ID; ci++)
                emu_mig_handles[g][gi][ci] = (struct nvmlDevice_st){EMU_MAGIC_DEV, g, gi, ci};
        }
    }
}

/* One sentence on stderr (once per distinct sentence in a row) and in <dir>/error. */
static void emu_note(const char *dir, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void emu_note(const char *dir, const char *fmt, ...)
{
    char msg[sizeof R.last_error];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (strcmp(msg, R.last_error) == 0)
        return;
    snprintf(R.last_error, sizeof R.last_error, "%s", msg);
    fprintf(stderr, "nvmlemu: %s\n", msg);
    if (dir && *dir) {
        char path[PATH_MAX + 16];
        snprintf(path, sizeof path, "%s/error", dir);
        FILE *f = fopen(path, "w");
        if (f) {
            fprintf(f, "%s\n", msg);
            fclose(f);
        }
    }
}

static void emu_open_counts(const char *dir)
{
    pid_t pid = getpid();
    if (emu_cmap && R.cmap_pid == pid && strcmp(R.cmap_dir, dir) == 0)
        return;
    char path[PATH_MAX + 32];
    snprintf(path, sizeof path, "%s/calls.%ld", dir, (long)pid);
    size_t len = EMU_CHDR + (size_t)EMU_NSYMS * EMU_CENT;
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        emu_note(dir, "cannot create the call counter file %s (%s); counting in memory only", path, strerror(errno));
        return;
    }
    if (ftruncate(fd, (off_t)len) != 0) {
        close(fd);
        return;
    }
    unsigned char *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED)
        return;
    memcpy(m, "NVEMUCN1", 8);
    uint32_t hdr[3] = {1u, (uint32_t)EMU_NSYMS, (uint32_t)EMU_CENT};
    memcpy(m + 8, hdr, sizeof hdr);
    int64_t p64 = (int64_t)pid;
    memcpy(m + 24, &p64, sizeof p64);
    for (int i = 0; i < EMU_NSYMS; i++)
        snprintf((char *)m + EMU_CHDR + (size_t)i * EMU_CENT, 56, "%s", emu_sym_names[i]);
    __atomic_store_n(&emu_cmap, m, __ATOMIC_RELEASE);
    snprintf(R.cmap_dir, sizeof R.cmap_dir, "%s", dir);
    R.cmap_pid = pid;
}

static uint64_t *emu_open_generation(const char *dir)
{
    char path[PATH_MAX + 16];
    snprintf(path, sizeof path, "%s/generation", dir);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return NULL;
    void *m = mmap(NULL, sizeof(uint64_t), PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    return m == MAP_FAILED ? NULL : (uint64_t *)m;
}

/* ------------------------------------------------------------------------------------------------
 * The emulated clock: CLOCK_MONOTONIC since the controller started the node (the controller reads
 * the same clock), or frozen at a value only the controller moves. */
int64_t emu_now_ns(const emu_state *s)
{
    if (s->frozen)
        return s->clock_offset_ns;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec - s->clock_origin_ns + s->clock_offset_ns;
}

int64_t emu_epoch_us(const emu_state *s, int64_t t_ns) { return s->epoch_origin_us + t_ns / 1000; }

double emu_ctr_at(const emu_ctr *c, int64_t t_ns)
{
    if (t_ns < c->t0_ns)
        t_ns = c->t0_ns;
    return c->base + c->rate * (double)(t_ns - c->t0_ns) / 1e9;
}

/* ------------------------------------------------------------------------------------------------
 * The state file parser. */
enum { T_STR, T_U32, T_I32, T_U64, T_I64, T_BOOL };
typedef struct {
    const char *key;
    int type;
    size_t off, size;
} emu_key;

#define GK(k, t, f) {k, t, offsetof(emu_gpu, f), sizeof(((emu_gpu *)0)->f)}
#define SK(k, t, f) {k, t, offsetof(emu_state, f), sizeof(((emu_state *)0)->f)}

static const emu_key gpu_keys[] = {
    GK("name", T_STR, name), GK("uuid", T_STR, uuid), GK("serial", T_STR, serial),
    GK("pci_bus_id", T_STR, bus_id), GK("pci_device_id", T_U32, pci_device_id),
    GK("pci_subsystem_id", T_U32, pci_subsystem_id), GK("memory_numa_node", T_I32, memory_numa_node),
    GK("cc_major", T_I32, cc_major), GK("cc_minor", T_I32, cc_minor),
    GK("memory_total", T_U64, mem_total), GK("memory_used", T_U64, mem_used),
    GK("memory_reserved", T_U64, mem_reserved), GK("util_gpu", T_U32, util_gpu),
    GK("util_mem", T_U32, util_mem), GK("util_enc", T_U32, util_enc), GK("util_dec", T_U32, util_dec),
    GK("power_mw", T_U32, power_mw), GK("power_limit_mw", T_U32, power_limit_mw),
    GK("power_mgmt_limit_mw", T_U32, power_mgmt_limit_mw), GK("temperature_c", T_I32, temperature_c),
    GK("memory_temperature_c", T_I32, memory_temperature_c), GK("throttle_mask", T_U64, throttle_mask),
    GK("pcie_gen", T_U32, pcie_gen), GK("pcie_gen_max", T_U32, pcie_gen_max),
    GK("pcie_width", T_U32, pcie_width), GK("pcie_width_max", T_U32, pcie_width_max),
    GK("pcie_tx_kbps", T_U32, pcie_tx_kbps), GK("pcie_rx_kbps", T_U32, pcie_rx_kbps),
    GK("pcie_byte_counters", T_BOOL, pcie_byte_counters), GK("nvlink_links", T_U32, nvlink_links),
    GK("nvlink_max_links", T_U32, nvlink_max_links), GK("nvlink_speed_mbps", T_U32, nvlink_speed_mbps),
    GK("mig_max_devices", T_U32, mig_max_devices), GK("virtualization_mode", T_U32, virt_mode),
    GK("ecc_aggregate_sbe", T_U64, ecc_agg_sbe), GK("ecc_aggregate_dbe", T_U64, ecc_agg_dbe),
    GK("remapped_supported", T_BOOL, remapped_supported), GK("remapped_cor", T_U32, remap_cor),
    GK("remapped_unc", T_U32, remap_unc), GK("remapped_pending", T_U32, remap_pending),
    GK("remapped_failure", T_U32, remap_failure), GK("retired_supported", T_BOOL, retired_supported),
    GK("retired_pending", T_BOOL, retired_pending), GK("recovery_action", T_U32, recovery_action), GK("nvlink_down_mask", T_U64, nvlink_down_mask),
    GK("lost", T_BOOL, lost), GK("gpm_supported", T_BOOL, gpm_supported),
    GK("process_memory_unavailable", T_BOOL, proc_mem_na), GK("grid_supported", T_BOOL, grid_supported),
    GK("event_types", T_U64, event_types),
};

static const emu_key state_keys[] = {
    SK("node_id", T_STR, node_id), SK("generation", T_U64, generation),
    SK("driver_version", T_STR, driver_version), SK("nvml_version", T_STR, nvml_version),
    SK("cuda_driver_version", T_I32, cuda_version), SK("privileged", T_BOOL, privileged),
    SK("clock_origin_ns", T_I64, clock_origin_ns), SK("clock_offset_ns", T_I64, clock_offset_ns),
    SK("epoch_origin_us", T_I64, epoch_origin_us), SK("proc_sample_period_us", T_I64, proc_period_us),
    SK("pcie_throughput_delay_us", T_I64, pcie_delay_us), SK("util_sample_period_us", T_I64, util_period_us),
};

typedef struct {
    char *err;
    size_t errlen;
    int line;
} emu_parser;

static int perr(emu_parser *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int perr(emu_parser *p, const char *fmt, ...)
{
    char msg[300];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    snprintf(p->err, p->errlen, "line %d: %s", p->line, msg);
    return -1;
}

static char *next_tok(char **sp)
{
    char *s = *sp;
    while (*s == ' ' || *s == '\t')
        s++;
    if (!*s) {
        *sp = s;
        return NULL;
    }
    char *start = s;
    while (*s && *s != ' ' && *s != '\t')
        s++;
    if (*s)
        *s++ = '\0';
    *sp = s;
    return start;
}

static char *rest_of_line(char **sp)
{
    char *s = *sp;
    while (*s == ' ' || *s == '\t')
        s++;
    size_t n = strlen(s);
    while (n > 0 && (s[n - 1] == ' ' || s[n - 1] == '\t'))
        s[--n] = '\0';
    *sp = s + n;
    return s;
}

static int tok_i64(emu_parser *p, char **sp, const char *what, long long *out)
{
    char *t = next_tok(sp), *end;
    if (!t)
        return perr(p, "%s: missing number", what);
    errno = 0;
    long long v = strtoll(t, &end, 0);
    if (errno || *end)
        return perr(p, "%s: '%s' is not an integer", what, t);
    *out = v;
    return 0;
}

static int tok_u64(emu_parser *p, char **sp, const char *what, unsigned long long *out)
{
    char *t = next_tok(sp), *end;
    if (!t)
        return perr(p, "%s: missing number", what);
    if (t[0] == '-')
        return perr(p, "%s: '%s' is negative", what, t);
    errno = 0;
    unsigned long long v = strtoull(t, &end, 0);
    if (errno || *end)
        return perr(p, "%s: '%s' is not an unsigned integer", what, t);
    *out = v;
    return 0;
}

static int tok_f64(emu_parser *p, char **sp, const char *what, double *out)
{
    char *t = next_tok(sp), *end;
    if (!t)
        return perr(p, "%s: missing number", what);
    errno = 0;
    double v = strtod(t, &end);
    if (errno || *end)
        return perr(p, "%s: '%s' is not a number", what, t);
    *out = v;
    return 0;
}

static int tok_uint(emu_parser *p, char **sp, const char *what, unsigned *out)
{
    unsigned long long v = 0;
    if (tok_u64(p, sp, what, &v))
        return -1;
    if (v > UINT_MAX)
        return perr(p, "%s: %llu is out of range", what, v);
    *out = (unsigned)v;
    return 0;
}

static int tok_int(emu_parser *p, char **sp, const char *what, int *out)
{
    long long v = 0;
    if (tok_i64(p, sp, what, &v))
        return -1;
    if (v < INT_MIN || v > INT_MAX)
        return perr(p, "%s: %lld is out of range", what, v);
    *out = (int)v;
    return 0;
}

static int no_more(emu_parser *p, char **sp, const char *what)
{
    char *t = next_tok(sp);
    return t ? perr(p, "%s: unexpected '%s' at the end of the line", what, t) : 0;
}

static int set_key(emu_parser *p, const emu_key *k, void *base, char **sp)
{
    char *dst = (char *)base + k->off;
    switch (k->type) {
    case T_STR: {
        char *v = rest_of_line(sp);
        if (strlen(v) >= k->size)
            return perr(p, "%s: longer than %zu characters", k->key, k->size - 1);
        memcpy(dst, v, strlen(v) + 1);
        return 0;
    }
    case T_U32: {
        unsigned v = 0;
        if (tok_uint(p, sp, k->key, &v))
            return -1;
        memcpy(dst, &v, sizeof v);
        break;
    }
    case T_I32: {
        int v = 0;
        if (tok_int(p, sp, k->key, &v))
            return -1;
        memcpy(dst, &v, sizeof v);
        break;
    }
    case T_U64: {
        unsigned long long v = 0;
        if (tok_u64(p, sp, k->key, &v))
            return -1;
        memcpy(dst, &v, sizeof v);
        break;
    }
    case T_I64: {
        long long v = 0;
        if (tok_i64(p, sp, k->key, &v))
            return -1;
        int64_t w = (int64_t)v;
        memcpy(dst, &w, sizeof w);
        break;
    }
    case T_BOOL: {
        long long v = 0;
        if (tok_i64(p, sp, k->key, &v))
            return -1;
        if (v != 0 && v != 1)
            return perr(p, "%s: %lld is not 0 or 1", k->key, v);
        int w = (int)v;
        memcpy(dst, &w, sizeof w);
        break;
    }
    }
    return no_more(p, sp, k->key);
}

static int parse_cpulist(emu_parser *p, char *text, uint64_t *mask)
{
    memset(mask, 0, sizeof(uint64_t) * EMU_CPU_WORDS);
    char *save = NULL;
    for (char *part = strtok_r(text, ",", &save); part; part = strtok_r(NULL, ",", &save)) {
        char *end;
        long a = strtol(part, &end, 10), b = a;
        if (end == part)
            return perr(p, "cpu list: '%s' is not a CPU number or range", part);
        if (*end == '-') {
            char *e2;
            b = strtol(end + 1, &e2, 10);
            if (e2 == end + 1 || *e2)
                return perr(p, "cpu list: '%s' is not a range", part);
        } else if (*end) {
            return perr(p, "cpu list: '%s' is not a CPU number", part);
        }
        if (a < 0 || b < a || b >= 64 * EMU_CPU_WORDS)
            return perr(p, "cpu list: '%s' is outside 0-%d", part, 64 * EMU_CPU_WORDS - 1);
        for (long c = a; c <= b; c++)
            mask[c / 64] |= 1ULL << (c % 64);
    }
    return 0;
}

static void gpu_defaults(emu_gpu *g)
{
    memset(g, 0, sizeof *g);
    g->memory_numa_node = -1;
    g->cc_major = g->cc_minor = -1;
    g->memory_temperature_c = -1;
    for (int i = 0; i < 4; i++)
        g->clock[i] = g->clock_max[i] = -1;
    g->event_types = nvmlEventTypeXidCriticalError;
}

static int parse_gpu_line(emu_parser *p, emu_gpu *g, const char *key, char **sp)
{
    for (size_t i = 0; i < sizeof gpu_keys / sizeof gpu_keys[0]; i++)
        if (strcmp(key, gpu_keys[i].key) == 0)
            return set_key(p, &gpu_keys[i], g, sp);
    if (strcmp(key, "clock") == 0 || strcmp(key, "clock_max") == 0) {
        int *dst = key[5] ? g->clock_max : g->clock;
        for (int i = 0; i < 4; i++)
            if (tok_int(p, sp, key, &dst[i]))
                return -1;
        return no_more(p, sp, key);
    }
    if (strcmp(key, "cpu_affinity") == 0 || strcmp(key, "cpu_affinity_socket") == 0) {
        int socket = key[12] != '\0';
        char *v = next_tok(sp);
        if (!v)
            return perr(p, "%s: missing CPU list", key);
        if (parse_cpulist(p, v, socket ? g->affinity_socket : g->affinity))
            return -1;
        if (!socket) {
            g->have_affinity = 1;
            memcpy(g->affinity_socket, g->affinity, sizeof g->affinity);
        }
        return no_more(p, sp, key);
    }
    if (strcmp(key, "mig_mode") == 0) {
        g->mig_supported = 1;
        if (tok_uint(p, sp, key, &g->mig_current) || tok_uint(p, sp, key, &g->mig_pending))
            return -1;
        return no_more(p, sp, key);
    }
    if (strcmp(key, "not_supported") == 0) {
        char *v = next_tok(sp);
        if (!v || strlen(v) >= sizeof g->notsup[0])
            return perr(p, "not_supported: missing or too long a name");
        if (g->nnotsup >= EMU_MAX_NOTSUP)
            return perr(p, "not_supported: more than %d names", EMU_MAX_NOTSUP);
        snprintf(g->notsup[g->nnotsup++], sizeof g->notsup[0], "%s", v);
        return no_more(p, sp, key);
    }
    if (strcmp(key, "counter") == 0) {
        char *name = next_tok(sp);
        int id = -1;
        for (int i = 0; name && i < EMU_NCTR; i++)
            if (strcmp(name, emu_ctr_names[i]) == 0)
                id = i;
        if (id < 0)
            return perr(p, "counter: unknown counter '%s'", name ? name : "");
        emu_ctr *c = &g->ctr[id];
        long long t0 = 0;
        if (tok_f64(p, sp, "counter base", &c->base) || tok_f64(p, sp, "counter rate", &c->rate) ||
            tok_i64(p, sp, "counter t0", &t0))
            return -1;
        c->t0_ns = t0;
        c->present = 1;
        return no_more(p, sp, key);
    }
    if (strcmp(key, "gpm") == 0) {
        if (g->ngpm >= EMU_MAX_GPM)
            return perr(p, "gpm: more than %d metric counters on one GPU", EMU_MAX_GPM);
        emu_gpm *m = &g->gpm[g->ngpm];
        long long t0 = 0;
        if (tok_int(p, sp, "gpm instance", &m->gi) || tok_uint(p, sp, "gpm metric", &m->metric) ||
            tok_f64(p, sp, "gpm base", &m->c.base) || tok_f64(p, sp, "gpm rate", &m->c.rate) ||
            tok_i64(p, sp, "gpm t0", &t0))
            return -1;
        if (m->metric == 0 || m->metric >= NVML_GPM_METRIC_MAX)
            return perr(p, "gpm: metric id %u is outside 1-%d", m->metric, NVML_GPM_METRIC_MAX - 1);
        m->c.t0_ns = t0;
        m->c.present = 1;
        g->ngpm++;
        return no_more(p, sp, key);
    }
    if (strcmp(key, "proc") == 0) {
        if (g->nproc >= EMU_MAX_PROCS)
            return perr(p, "proc: more than %d processes on one GPU", EMU_MAX_PROCS);
        emu_proc *q = &g->proc[g->nproc];
        if (tok_uint(p, sp, "proc pid", &q->pid))
            return -1;
        char *used = next_tok(sp);
        if (!used)
            return perr(p, "proc: missing used memory");
        if (strcmp(used, "na") == 0) {
            q->used_na = 1;
        } else {
            char *end;
            errno = 0;
            q->used = strtoull(used, &end, 10);
            if (errno || *end || used[0] == '-')
                return perr(p, "proc: used memory '%s' is not a byte count or 'na'", used);
        }
        if (tok_uint(p, sp, "proc gi", &q->gi) || tok_uint(p, sp, "proc ci", &q->ci) ||
            tok_uint(p, sp, "proc sm", &q->sm) || tok_uint(p, sp, "proc mem", &q->mem) ||
            tok_uint(p, sp, "proc enc", &q->enc) || tok_uint(p, sp, "proc dec", &q->dec))
            return -1;
        g->nproc++;
        return no_more(p, sp, key);
    }
    if (strcmp(key, "mig") == 0) {
        if (g->nmig >= EMU_MAX_MIG)
            return perr(p, "mig: more than %d MIG devices on one GPU", EMU_MAX_MIG);
        emu_mig *m = &g->mig[g->nmig];
        if (tok_uint(p, sp, "mig gi", &m->gi) || tok_uint(p, sp, "mig ci", &m->ci) ||
            tok_uint(p, sp, "mig profile id", &m->profile_id) || tok_uint(p, sp, "mig start", &m->start) ||
            tok_u64(p, sp, "mig memory total", &m->mem_total) || tok_u64(p, sp, "mig memory used", &m->mem_used) ||
            tok_u64(p, sp, "mig memory reserved", &m->mem_reserved))
            return -1;
        if (m->gi >= EMU_MAX_GI_ID || m->ci >= EMU_MAX_CI_ID)
            return perr(p, "mig: GPU instance %u / compute instance %u is beyond %d / %d", m->gi, m->ci,
                        EMU_MAX_GI_ID - 1, EMU_MAX_CI_ID - 1);
        char *uuid = next_tok(sp);
        if (!uuid || strlen(uuid) >= sizeof m->uuid)
            return perr(p, "mig: missing or too long a UUID");
        snprintf(m->uuid, sizeof m->uuid, "%s", uuid);
        g->nmig++;
        return no_more(p, sp, key);
    }
    if (strcmp(key, "nvlink_link_error") == 0) {
        unsigned link = 0, counter = 0;
        unsigned long long v = 0;
        if (tok_uint(p, sp, "nvlink_link_error link", &link) || tok_uint(p, sp, "nvlink_link_error counter", &counter) ||
            tok_u64(p, sp, "nvlink_link_error value", &v))
            return -1;
        if (link >= EMU_MAX_LINKS || counter >= EMU_NVL_ERRS)
            return perr(p, "nvlink_link_error: link %u / counter %u is beyond %d / %d", link, counter,
                        EMU_MAX_LINKS - 1, EMU_NVL_ERRS - 1);
        g->nvl_err[link][counter] = v;
        return no_more(p, sp, key);
    }
    if (strcmp(key, "retired_page") == 0) {
        if (g->nretired >= EMU_MAX_RETIRED)
            return perr(p, "retired_page: more than %d pages", EMU_MAX_RETIRED);
        emu_page *pg = &g->retired[g->nretired];
        if (tok_uint(p, sp, "retired cause", &pg->cause) || tok_u64(p, sp, "retired address", &pg->addr) ||
            tok_u64(p, sp, "retired timestamp", &pg->ts_us))
            return -1;
        g->nretired++;
        return no_more(p, sp, key);
    }
    if (strcmp(key, "grid_feature") == 0) {
        if (tok_uint(p, sp, "grid code", &g->grid_code) || tok_uint(p, sp, "grid state", &g->grid_state) ||
            tok_uint(p, sp, "grid enabled", &g->grid_enabled) ||
            tok_uint(p, sp, "grid expiry status", &g->grid_exp_status) ||
            tok_uint(p, sp, "grid year", &g->grid_year) || tok_uint(p, sp, "grid month", &g->grid_month) ||
            tok_uint(p, sp, "grid day", &g->grid_day) || tok_uint(p, sp, "grid hour", &g->grid_hour) ||
            tok_uint(p, sp, "grid minute", &g->grid_min) || tok_uint(p, sp, "grid second", &g->grid_sec))
            return -1;
        char *prod = rest_of_line(sp);
        if (strlen(prod) >= sizeof g->grid_product)
            return perr(p, "grid_feature: product name too long");
        snprintf(g->grid_product, sizeof g->grid_product, "%s", prod);
        g->grid_nfeat = 1;
        return 0;
    }
    return perr(p, "unknown GPU key '%s'", key);
}

static int parse_global_line(emu_parser *p, emu_state *s, const char *key, char **sp)
{
    for (size_t i = 0; i < sizeof state_keys / sizeof state_keys[0]; i++)
        if (strcmp(key, state_keys[i].key) == 0)
            return set_key(p, &state_keys[i], s, sp);
    if (strcmp(key, "driver_profile") == 0) {
        char *v = next_tok(sp);
        if (v && strcmp(v, "r550") == 0)
            s->profile = EMU_PROFILE_R550;
        else if (v && strcmp(v, "old") == 0)
            s->profile = EMU_PROFILE_OLD;
        else if (v && strcmp(v, "cuda14") == 0)
            s->profile = EMU_PROFILE_CUDA14;
        else
            return perr(p, "driver_profile: '%s' is not r550, old or cuda14", v ? v : "");
        return no_more(p, sp, key);
    }
    if (strcmp(key, "clock") == 0) {
        char *v = next_tok(sp);
        if (v && strcmp(v, "real") == 0)
            s->frozen = 0;
        else if (v && strcmp(v, "frozen") == 0)
            s->frozen = 1;
        else
            return perr(p, "clock: '%s' is not real or frozen", v ? v : "");
        return no_more(p, sp, key);
    }
    if (strcmp(key, "gpu_count") == 0) {
        int n = 0;
        if (tok_int(p, sp, key, &n))
            return -1;
        if (n < 0 || n > EMU_MAX_GPUS)
            return perr(p, "gpu_count: %d is outside 0-%d", n, EMU_MAX_GPUS);
        s->ngpu = n;
        return no_more(p, sp, key);
    }
    if (strcmp(key, "mig_profile") == 0) {
        if (s->nprof >= EMU_MAX_PROFILES)
            return perr(p, "mig_profile: more than %d profiles", EMU_MAX_PROFILES);
        emu_profile *pr = &s->prof[s->nprof];
        if (tok_uint(p, sp, "profile", &pr->profile) || tok_uint(p, sp, "profile id", &pr->id) ||
            tok_uint(p, sp, "slices", &pr->slices) || tok_uint(p, sp, "instances", &pr->instances) ||
            tok_uint(p, sp, "sm count", &pr->sms) || tok_uint(p, sp, "copy engines", &pr->copy_engines) ||
            tok_u64(p, sp, "memory MB", &pr->mem_mb))
            return -1;
        char *name = rest_of_line(sp);
        if (!*name || strlen(name) >= sizeof pr->name)
            return perr(p, "mig_profile: missing or too long a name");
        snprintf(pr->name, sizeof pr->name, "%s", name);
        s->nprof++;
        return 0;
    }
    if (strcmp(key, "fail") == 0) {
        if (s->nfail >= EMU_MAX_FAIL)
            return perr(p, "fail: more than %d rules", EMU_MAX_FAIL);
        emu_fail *f = &s->fail[s->nfail];
        long long times = 0;
        if (tok_int(p, sp, "fail id", &f->id))
            return -1;
        char *sym = next_tok(sp);
        if (!sym || strlen(sym) >= sizeof f->sym)
            return perr(p, "fail: missing or too long an entry point name");
        snprintf(f->sym, sizeof f->sym, "%s", sym);
        if (tok_int(p, sp, "fail code", &f->code) || tok_int(p, sp, "fail gpu", &f->gpu) ||
            tok_i64(p, sp, "fail times", &times))
            return -1;
        f->times = (long)times;
        s->nfail++;
        return no_more(p, sp, key);
    }
    if (strcmp(key, "drop_field") == 0) {
        if (s->ndrop >= EMU_MAX_DROP)
            return perr(p, "drop_field: more than %d fields", EMU_MAX_DROP);
        emu_drop *d = &s->drop[s->ndrop];
        if (tok_uint(p, sp, "field id", &d->fid) || tok_int(p, sp, "field gpu", &d->gpu))
            return -1;
        s->ndrop++;
        return no_more(p, sp, key);
    }
    if (strcmp(key, "event") == 0) {
        if (s->nevent >= EMU_MAX_EVENTS)
            return perr(p, "event: more than %d events", EMU_MAX_EVENTS);
        emu_event *e = &s->event[s->nevent];
        if (tok_i64(p, sp, "event seq", &e->seq) || tok_int(p, sp, "event gpu", &e->gpu) ||
            tok_u64(p, sp, "event type", &e->type) || tok_u64(p, sp, "event data", &e->data) ||
            tok_uint(p, sp, "event gi", &e->gi) || tok_uint(p, sp, "event ci", &e->ci))
            return -1;
        s->nevent++;
        return no_more(p, sp, key);
    }
    return perr(p, "unknown key '%s'", key);
}

/* Parse a whole state file into s (zeroed by the caller). 0, or -1 with one sentence in err. */
static int emu_parse(const char *path, emu_state *s, char *err, size_t errlen)
{
    emu_parser p = {err, errlen, 0};
    FILE *f = fopen(path, "r");
    if (!f) {
        snprintf(err, errlen, "cannot read %s (%s)", path, strerror(errno));
        return -1;
    }
    char *line = NULL;
    size_t cap = 0;
    ssize_t n;
    int cur = -1, seen = 0, rc = 0, gpus_seen = 0;
    s->proc_period_us = 166667;
    s->util_period_us = 166667;
    while ((n = getline(&line, &cap, f)) >= 0) {
        p.line++;
        while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r'))
            line[--n] = '\0';
        char *sp = line;
        char *key = next_tok(&sp);
        if (!key || key[0] == '#')
            continue;
        if (!seen) {
            char *ver = next_tok(&sp);
            if (strcmp(key, "nvmlemu") != 0 || !ver || strcmp(ver, "1") != 0) {
                rc = perr(&p, "the file does not start with 'nvmlemu 1' (not an emulator state file)");
                break;
            }
            seen = 1;
            continue;
        }
        if (strcmp(key, "gpu") == 0) {
            int idx = 0;
            if ((rc = tok_int(&p, &sp, "gpu", &idx)) != 0)
                break;
            if (idx != gpus_seen || idx >= s->ngpu) {
                rc = perr(&p, "gpu %d: sections must be numbered 0 to gpu_count-1 in order (gpu_count %d)", idx,
                          s->ngpu);
                break;
            }
            cur = idx;
            gpus_seen++;
            gpu_defaults(&s->gpu[cur]);
            continue;
        }
        rc = cur < 0 ? parse_global_line(&p, s, key, &sp) : parse_gpu_line(&p, &s->gpu[cur], key, &sp);
        if (rc)
            break;
    }
    free(line);
    fclose(f);
    if (rc == 0 && !seen) {
        snprintf(err, errlen, "%s is empty (not an emulator state file)", path);
        rc = -1;
    }
    if (rc == 0 && gpus_seen != s->ngpu) {
        snprintf(err, errlen, "gpu_count is %d but %d gpu sections follow", s->ngpu, gpus_seen);
        rc = -1;
    }
    if (rc == 0 && !s->node_id[0]) {
        snprintf(err, errlen, "no node_id");
        rc = -1;
    }
    if (rc == 0 && s->proc_period_us <= 0)
        s->proc_period_us = 166667;
    if (rc == 0 && s->util_period_us <= 0)
        s->util_period_us = 166667;
    return rc;
}

/* ------------------------------------------------------------------------------------------------
 * Events: queued per event set; an event for a GPU no set is registered for waits in "pending"
 * until one registers (so a fixture's events reach the first set that registers). */
static void emu_queue_push(nvmlEventSet_t set, const emu_event *ev)
{
    if (set->count == EMU_QUEUE) {
        set->head = (set->head + 1) % EMU_QUEUE;
        set->count--;
        set->dropped++;
    }
    set->q[(set->head + set->count) % EMU_QUEUE] = *ev;
    set->count++;
}

static void emu_deliver(const emu_event *ev)
{
    int delivered = 0;
    if (ev->gpu >= 0 && ev->gpu < EMU_MAX_GPUS)
        for (nvmlEventSet_t set = R.sets; set; set = set->next)
            if (set->live && (set->types[ev->gpu] & ev->type)) {
                emu_queue_push(set, ev);
                delivered = 1;
            }
    if (delivered)
        return;
    if (R.npending == EMU_MAX_EVENTS) {
        memmove(R.pending, R.pending + 1, sizeof R.pending[0] * (EMU_MAX_EVENTS - 1));
        R.npending--;
    }
    R.pending[R.npending++] = *ev;
}

static void emu_take_new_events(const emu_state *s)
{
    long long top = R.last_seq;
    for (int i = 0; i < s->nevent; i++)
        if (s->event[i].seq > R.last_seq) {
            emu_deliver(&s->event[i]);
            if (s->event[i].seq > top)
                top = s->event[i].seq;
        }
    R.last_seq = top;
}

nvmlEventSet_t emu_event_set_new(void)
{
    nvmlEventSet_t set = calloc(1, sizeof *set);
    if (!set)
        return NULL;
    set->magic = EMU_MAGIC_SET;
    set->live = 1;
    set->next = R.sets;
    R.sets = set;
    return set;
}

int emu_event_set_valid(nvmlEventSet_t set)
{
    for (nvmlEventSet_t s = R.sets; s; s = s->next)
        if (s == set)
            return s->live;
    return 0;
}

void emu_event_set_free(nvmlEventSet_t set)
{
    for (nvmlEventSet_t *pp = &R.sets; *pp; pp = &(*pp)->next)
        if (*pp == set) {
            *pp = set->next;
            set->magic = 0;
            free(set);
            return;
        }
}

void emu_event_register(nvmlEventSet_t set, int gpu, unsigned long long types)
{
    set->types[gpu] |= types;
    int keep = 0;
    for (int i = 0; i < R.npending; i++) {
        if (R.pending[i].gpu == gpu && (R.pending[i].type & types))
            emu_queue_push(set, &R.pending[i]);
        else
            R.pending[keep++] = R.pending[i];
    }
    R.npending = keep;
}

int emu_event_pop(nvmlEventSet_t set, emu_event *out)
{
    if (set->count == 0)
        return 0;
    *out = set->q[set->head];
    set->head = (set->head + 1) % EMU_QUEUE;
    set->count--;
    return 1;
}

/* GPM sample buffers, kept in a list so that a stale or foreign pointer is refused, not followed. */
nvmlGpmSample_t emu_gpm_new(void)
{
    nvmlGpmSample_t smp = calloc(1, sizeof *smp);
    if (!smp)
        return NULL;
    smp->magic = EMU_MAGIC_GPM;
    smp->next = R.samples;
    R.samples = smp;
    return smp;
}

int emu_gpm_valid(nvmlGpmSample_t smp)
{
    for (nvmlGpmSample_t s = R.samples; s; s = s->next)
        if (s == smp)
            return 1;
    return 0;
}

void emu_gpm_free(nvmlGpmSample_t smp)
{
    for (nvmlGpmSample_t *pp = &R.samples; *pp; pp = &(*pp)->next)
        if (*pp == smp) {
            *pp = smp->next;
            smp->magic = 0;
            free(smp);
            return;
        }
}

/* ------------------------------------------------------------------------------------------------
 * Loading, init, shutdown, reload on change. */
static int emu_control_path(const char *dir, char *path, size_t len)
{
    snprintf(path, len, "%s/control", dir);
    if (access(path, R_OK) == 0)
        return 1;
    snprintf(path, len, "%s/state", dir);
    return 0;
}

static void emu_reset_runtime(void)
{
    R.last_seq = 0;
    R.npending = 0;
    R.nused = 0;
    R.refcount = 0;
    R.have_ctl_st = 0;
    for (nvmlEventSet_t set = R.sets; set; set = set->next) {
        memset(set->types, 0, sizeof set->types);
        set->count = set->head = 0;
    }
    for (nvmlGpmSample_t smp = R.samples; smp; smp = smp->next)
        smp->taken = 0;
}

static void emu_remember_control(void)
{
    char path[PATH_MAX + 16];
    snprintf(path, sizeof path, "%s/control", R.dir);
    R.have_ctl_st = stat(path, &R.ctl_st) == 0;
}

static nvmlReturn_t emu_fail_check(enum emu_sym sym, int gpu);

nvmlReturn_t emu_init(enum emu_sym sym, unsigned int flags)
{
    (void)flags; /* NO_GPUS / NO_ATTACH change nothing here: an emulated node always attaches */
    emu_lock();
    const char *dir = getenv(EMU_ENV_DIR);
    if (!dir || !*dir) {
        emu_count(sym);
        emu_note(NULL, "%s is not set, so there is no emulated driver to load (nvmlInit answers DRIVER_NOT_LOADED)",
                 EMU_ENV_DIR);
        emu_unlock();
        return NVML_ERROR_DRIVER_NOT_LOADED;
    }
    char path[PATH_MAX + 16], err[400];
    emu_control_path(dir, path, sizeof path);
    if (access(path, R_OK) != 0) {
        emu_count(sym);
        emu_note(dir, "no state file in %s (start the node with gpuagent.sim.nvml_emulator first)", dir);
        emu_unlock();
        return NVML_ERROR_DRIVER_NOT_LOADED;
    }
    emu_state *n = calloc(1, sizeof *n);
    if (!n) {
        emu_count(sym);
        emu_unlock();
        return NVML_ERROR_MEMORY;
    }
    if (emu_parse(path, n, err, sizeof err) != 0) {
        emu_count(sym);
        emu_note(dir, "%s: %s", path, err);
        free(n);
        emu_unlock();
        return NVML_ERROR_UNKNOWN;
    }
    int new_node = !R.s || strcmp(dir, R.dir) != 0 || strcmp(n->node_id, R.node_id) != 0;
    if (new_node) {
        emu_reset_runtime();
        snprintf(R.dir, sizeof R.dir, "%s", dir);
        snprintf(R.node_id, sizeof R.node_id, "%s", n->node_id);
        R.genp = emu_open_generation(dir);
        R.last_error[0] = '\0';
    }
    emu_open_counts(dir);
    emu_count(sym);
    free(R.s);
    R.s = n;
    R.loaded_gen = R.genp ? __atomic_load_n(R.genp, __ATOMIC_ACQUIRE) : n->generation;
    emu_remember_control();
    emu_take_new_events(n);
    if (n->profile != EMU_PROFILE_R550 && (emu_sym_flags[sym] & (n->profile == EMU_PROFILE_OLD ? EMU_ABSENT_OLD
                                                                                              : EMU_ABSENT_CUDA14))) {
        emu_unlock();
        return NVML_ERROR_FUNCTION_NOT_FOUND;
    }
    nvmlReturn_t rc = emu_fail_check(sym, -1);
    if (rc == NVML_SUCCESS)
        R.refcount++;
    emu_unlock();
    return rc;
}

nvmlReturn_t emu_shutdown(void)
{
    if (R.refcount == 0)
        return NVML_ERROR_UNINITIALIZED;
    R.refcount--;
    return NVML_SUCCESS;
}

void emu_refresh(void)
{
    if (!R.s || !R.dir[0])
        return;
    unsigned long long gen;
    if (R.genp) {
        gen = __atomic_load_n(R.genp, __ATOMIC_ACQUIRE);
        if (gen == R.loaded_gen)
            return;
    } else {
        char path[PATH_MAX + 16];
        struct stat st;
        snprintf(path, sizeof path, "%s/control", R.dir);
        if (stat(path, &st) != 0)
            return;
        if (R.have_ctl_st && st.st_ino == R.ctl_st.st_ino && st.st_size == R.ctl_st.st_size &&
            st.st_mtim.tv_sec == R.ctl_st.st_mtim.tv_sec && st.st_mtim.tv_nsec == R.ctl_st.st_mtim.tv_nsec)
            return;
        gen = R.loaded_gen + 1;
    }
    R.loaded_gen = gen; /* a bad file is reported once, not re-read on every call */
    char path[PATH_MAX + 16], err[400];
    if (!emu_control_path(R.dir, path, sizeof path))
        return;
    emu_state *n = calloc(1, sizeof *n);
    if (!n)
        return;
    if (emu_parse(path, n, err, sizeof err) != 0) {
        emu_note(R.dir, "%s: %s; keeping the previous state", path, err);
        free(n);
        return;
    }
    emu_remember_control();
    if (strcmp(n->node_id, R.node_id) != 0) { /* a new node started in the same directory */
        int refs = R.refcount;
        emu_reset_runtime();
        R.refcount = refs;
        snprintf(R.node_id, sizeof R.node_id, "%s", n->node_id);
    }
    free(R.s);
    R.s = n;
    emu_take_new_events(n);
}

/* ------------------------------------------------------------------------------------------------
 * What every entry point does first (always under the lock, released by emu_leave). */
static int emu_sym_absent(const emu_state *s, enum emu_sym sym)
{
    if (!s || s->profile == EMU_PROFILE_R550)
        return 0;
    unsigned bit = s->profile == EMU_PROFILE_OLD ? EMU_ABSENT_OLD : EMU_ABSENT_CUDA14;
    return (emu_sym_flags[sym] & bit) != 0;
}

static long *emu_used_slot(int id)
{
    for (int i = 0; i < R.nused; i++)
        if (R.used_id[i] == id)
            return &R.used_n[i];
    if (R.nused == (int)(sizeof R.used_id / sizeof R.used_id[0]))
        return NULL;
    R.used_id[R.nused] = id;
    R.used_n[R.nused] = 0;
    return &R.used_n[R.nused++];
}

static nvmlReturn_t emu_fail_check(enum emu_sym sym, int gpu)
{
    const emu_state *s = R.s;
    for (int i = 0; i < s->nfail; i++) {
        const emu_fail *f = &s->fail[i];
        if (strcmp(f->sym, emu_sym_names[sym]) != 0 && strcmp(f->sym, emu_sym_base[sym]) != 0)
            continue;
        if (f->gpu >= 0 && f->gpu != gpu)
            continue;
        long *used = emu_used_slot(f->id);
        if (!used)
            continue;
        if (f->times >= 0 && *used >= f->times)
            continue;
        (*used)++;
        return (nvmlReturn_t)f->code;
    }
    return NVML_SUCCESS;
}

static nvmlReturn_t emu_prelude(enum emu_sym sym, emu_ctx *c)
{
    emu_count(sym);
    emu_lock();
    memset(c, 0, sizeof *c);
    c->sym = sym;
    c->gpu = -1;
    if (R.refcount > 0)
        emu_refresh(); /* first: a changed driver profile applies to this very call */
    if (emu_sym_absent(R.s, sym))
        return NVML_ERROR_FUNCTION_NOT_FOUND;
    if (R.refcount == 0 || !R.s)
        return NVML_ERROR_UNINITIALIZED;
    c->s = R.s;
    c->t_ns = emu_now_ns(R.s);
    return NVML_SUCCESS;
}

nvmlReturn_t emu_enter(enum emu_sym sym, int gpu_hint, emu_ctx *c)
{
    nvmlReturn_t rc = emu_prelude(sym, c);
    if (rc != NVML_SUCCESS)
        return rc;
    if (gpu_hint >= 0 && gpu_hint < c->s->ngpu) {
        c->gpu = gpu_hint;
        c->g = &c->s->gpu[gpu_hint];
    }
    return emu_fail_check(sym, c->gpu);
}

static int emu_is_unsupported(const emu_gpu *g, enum emu_sym sym)
{
    for (int i = 0; i < g->nnotsup; i++)
        if (strcmp(g->notsup[i], emu_sym_names[sym]) == 0 || strcmp(g->notsup[i], emu_sym_base[sym]) == 0)
            return 1;
    return 0;
}

emu_mig *emu_find_mig(emu_gpu *g, unsigned gi, unsigned ci)
{
    if (!g->mig_supported || g->mig_current != 1)
        return NULL;
    for (int i = 0; i < g->nmig; i++)
        if (g->mig[i].gi == gi && g->mig[i].ci == ci)
            return &g->mig[i];
    return NULL;
}

const emu_profile *emu_find_profile_by_id(const emu_state *s, unsigned id)
{
    for (int i = 0; i < s->nprof; i++)
        if (s->prof[i].id == id)
            return &s->prof[i];
    return NULL;
}

/* Which GPU (and MIG device) a handle names, without following a pointer we did not hand out. */
static int emu_resolve(nvmlDevice_t dev, emu_ctx *c)
{
    uintptr_t p = (uintptr_t)dev;
    uintptr_t d0 = (uintptr_t)&emu_dev_handles[0], d1 = (uintptr_t)&emu_dev_handles[EMU_MAX_GPUS];
    uintptr_t m0 = (uintptr_t)&emu_mig_handles[0][0][0];
    uintptr_t m1 = m0 + sizeof emu_mig_handles;
    if (p >= d0 && p < d1 && (p - d0) % sizeof(struct nvmlDevice_st) == 0) {
        if (dev->gpu >= c->s->ngpu)
            return -1;
        c->gpu = dev->gpu;
        c->g = &c->s->gpu[dev->gpu];
        return 0;
    }
    if (p >= m0 && p < m1 && (p - m0) % sizeof(struct nvmlDevice_st) == 0) {
        if (dev->gpu >= c->s->ngpu)
            return -1;
        c->gpu = dev->gpu;
        c->g = &c->s->gpu[dev->gpu];
        c->m = emu_find_mig(c->g, (unsigned)dev->gi, (unsigned)dev->ci);
        return c->m ? 0 : -1;
    }
    return -1;
}

nvmlReturn_t emu_enter_dev(enum emu_sym sym, nvmlDevice_t dev, emu_ctx *c)
{
    nvmlReturn_t rc = emu_prelude(sym, c);
    if (rc != NVML_SUCCESS)
        return rc;
    if (emu_resolve(dev, c) != 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    if ((rc = emu_fail_check(sym, c->gpu)) != NVML_SUCCESS)
        return rc;
    if (c->g->lost)
        return NVML_ERROR_GPU_IS_LOST;
    if (!c->m && (emu_sym_flags[sym] & EMU_MIG_PRIV) && c->g->mig_supported && c->g->mig_current == 1 &&
        !c->s->privileged)
        return NVML_ERROR_NO_PERMISSION; /* before the not_supported list: permission is asked first */
    if (emu_is_unsupported(c->g, sym))
        return NVML_ERROR_NOT_SUPPORTED;
    if (c->m && !(emu_sym_flags[sym] & EMU_MIG_OK))
        return NVML_ERROR_NOT_SUPPORTED;
    return NVML_SUCCESS;
}

nvmlReturn_t emu_enter_gi(enum emu_sym sym, nvmlGpuInstance_t gi, emu_ctx *c)
{
    nvmlReturn_t rc = emu_prelude(sym, c);
    if (rc != NVML_SUCCESS)
        return rc;
    uintptr_t p = (uintptr_t)gi, g0 = (uintptr_t)&emu_gi_handles[0][0];
    if (p < g0 || p >= g0 + sizeof emu_gi_handles || (p - g0) % sizeof(struct nvmlGpuInstance_st) != 0 ||
        gi->gpu >= c->s->ngpu)
        return NVML_ERROR_INVALID_ARGUMENT;
    c->gpu = gi->gpu;
    c->g = &c->s->gpu[gi->gpu];
    int found = 0;
    for (int i = 0; c->g->mig_current == 1 && i < c->g->nmig; i++)
        if ((int)c->g->mig[i].gi == gi->gi)
            found = 1;
    if (!found)
        return NVML_ERROR_INVALID_ARGUMENT;
    if ((rc = emu_fail_check(sym, c->gpu)) != NVML_SUCCESS)
        return rc;
    if (c->g->lost)
        return NVML_ERROR_GPU_IS_LOST;
    return NVML_SUCCESS;
}

void emu_leave(void) { emu_unlock(); }

int emu_field_dropped(const emu_state *s, unsigned fid, int gpu)
{
    for (int i = 0; i < s->ndrop; i++)
        if (s->drop[i].fid == fid && (s->drop[i].gpu < 0 || s->drop[i].gpu == gpu))
            return 1;
    return 0;
}
