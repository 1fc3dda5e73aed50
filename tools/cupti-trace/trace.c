/*
 * A timeline of a CUDA program's GPU work and host API calls, for any CUDA program, with no change
 * to it: a CUDA injection library. The driver loads it when the program initializes CUDA
 * (`CUDA_INJECTION64_PATH=libcupti_trace.so`) and calls `InitializeInjection`, which turns on
 * CUPTI's activity records for
 *   - every kernel, copy and memset the GPU runs (start and end on the GPU's clock),
 *   - every driver and runtime API call on the host (start and end, calling thread),
 * linked by CUPTI's correlation id (a kernel's id is that of the call that launched it). They are
 * written as CSV to `$CUPTI_TRACE_OUT` (default `cupti-trace.csv`) as CUPTI hands its buffers back
 * and at exit:
 *
 *   what,start_ns,end_ns,correlation,stream_or_thread,bytes,name
 *
 * `what` is kernel, copy, memset (stream id in the fifth column) or driver, runtime (thread id).
 * `tools/step_timeline.py` reads two such files and says where the GPU sat idle and what the host
 * was doing meanwhile. It exists because Nsight Systems cannot make a report on the GPU machines
 * used here; `ncu` times kernels one at a time, so it cannot see the gaps between them.
 *
 * Build (CUDA toolkit with CUPTI; tools/cupti-trace/build.sh picks the record versions):
 *   cc -O2 -shared -fPIC trace.c -I$CUPTI/include -L$CUPTI/lib64 -lcupti -o libcupti_trace.so
 */
#include <cupti.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

/* CUPTI versions its activity records (CUpti_ActivityKernel10 in CUDA 13.0); build.sh passes the
   newest each header declares. The fields read here exist in every version. */
#ifndef KERNEL_RECORD
#define KERNEL_RECORD CUpti_ActivityKernel10
#endif
#ifndef MEMCPY_RECORD
#define MEMCPY_RECORD CUpti_ActivityMemcpy6
#endif
#ifndef MEMSET_RECORD
#define MEMSET_RECORD CUpti_ActivityMemset4
#endif

#define BUFFER_BYTES (8u << 20)

static void give_up(void);

static FILE *out;
static pthread_mutex_t out_lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned long long dropped;

/* On a failed CUPTI call: say which, turn off what was enabled, close the file, give up. */
#define CHECK(call)                                                                  \
    do {                                                                             \
        CUptiResult status_ = (call);                                                \
        if (status_ != CUPTI_SUCCESS) {                                              \
            const char *why_ = "?";                                                  \
            cuptiGetResultString(status_, &why_);                                    \
            fprintf(stderr, "cupti-trace: %s failed: %s\n", #call, why_);            \
            give_up();                                                               \
            return 0;                                                                \
        }                                                                            \
    } while (0)

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    *buffer = aligned_alloc(8, BUFFER_BYTES);
    *size = *buffer ? BUFFER_BYTES : 0;
    *max_records = 0;
}

/* A name as one CSV field: quoted, with quotes doubled (demangled names hold commas). */
static void write_name(const char *name) {
    fputc('"', out);
    for (const char *c = name ? name : "?"; *c; c++) {
        if (*c == '"') fputc('"', out);
        fputc(*c, out);
    }
    fputs("\"\n", out);
}

static const char *api_name(CUpti_CallbackDomain domain, uint32_t cbid) {
    const char *name = NULL;
    if (cuptiGetCallbackName(domain, cbid, &name) != CUPTI_SUCCESS) return "?";
    return name;
}

/* One CSV row; `id` is the stream of GPU work, the thread of an API call. */
static void write_row(const char *what, uint64_t start, uint64_t end, uint32_t correlation,
                      uint32_t id, uint64_t bytes, const char *name) {
    fprintf(out, "%s,%llu,%llu,%u,%u,%llu,", what, (unsigned long long)start,
            (unsigned long long)end, correlation, id, (unsigned long long)bytes);
    write_name(name);
}

static void write_record(CUpti_Activity *record) {
    static const char *copy_kinds[] = {"unknown", "HtoD", "DtoH", "HtoA", "AtoH", "AtoA",
                                       "AtoD",    "DtoA", "DtoD", "HtoH", "PtoP"};
    switch (record->kind) {
    case CUPTI_ACTIVITY_KIND_KERNEL:
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        KERNEL_RECORD *k = (KERNEL_RECORD *)record;
        write_row("kernel", k->start, k->end, k->correlationId, k->streamId, 0, k->name);
        break;
    }
    case CUPTI_ACTIVITY_KIND_MEMCPY: {
        MEMCPY_RECORD *m = (MEMCPY_RECORD *)record;
        const char *kind = m->copyKind < sizeof copy_kinds / sizeof *copy_kinds
                               ? copy_kinds[m->copyKind]
                               : "other";
        write_row("copy", m->start, m->end, m->correlationId, m->streamId, m->bytes, kind);
        break;
    }
    case CUPTI_ACTIVITY_KIND_MEMSET: {
        MEMSET_RECORD *m = (MEMSET_RECORD *)record;
        write_row("memset", m->start, m->end, m->correlationId, m->streamId, m->bytes, "memset");
        break;
    }
    case CUPTI_ACTIVITY_KIND_DRIVER:
    case CUPTI_ACTIVITY_KIND_RUNTIME: {
        CUpti_ActivityAPI *a = (CUpti_ActivityAPI *)record;
        int driver = record->kind == CUPTI_ACTIVITY_KIND_DRIVER;
        write_row(driver ? "driver" : "runtime", a->start, a->end, a->correlationId, a->threadId,
                  0, api_name(driver ? CUPTI_CB_DOMAIN_DRIVER_API : CUPTI_CB_DOMAIN_RUNTIME_API,
                              a->cbid));
        break;
    }
    default:
        break;
    }
}

static void CUPTIAPI buffer_completed(CUcontext context, uint32_t stream, uint8_t *buffer,
                                      size_t size, size_t valid) {
    (void)context, (void)stream, (void)size;
    CUpti_Activity *record = NULL;
    pthread_mutex_lock(&out_lock);
    if (out) {
        while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS)
            write_record(record);
    }
    size_t lost = 0;
    if (cuptiActivityGetNumDroppedRecords(context, stream, &lost) == CUPTI_SUCCESS)
        dropped += lost;
    pthread_mutex_unlock(&out_lock);
    free(buffer);
}

static void finish(void) {
    cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    pthread_mutex_lock(&out_lock);
    if (out) {
        if (dropped) fprintf(stderr, "cupti-trace: %llu records dropped\n", dropped);
        fclose(out);
        out = NULL;
    }
    pthread_mutex_unlock(&out_lock);
}

static const CUpti_ActivityKind KINDS[] = {
    CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY, CUPTI_ACTIVITY_KIND_MEMSET,
    CUPTI_ACTIVITY_KIND_DRIVER, CUPTI_ACTIVITY_KIND_RUNTIME};

static void give_up(void) {
    for (size_t i = 0; i < sizeof KINDS / sizeof *KINDS; i++) cuptiActivityDisable(KINDS[i]);
    pthread_mutex_lock(&out_lock);
    if (out) fclose(out);
    out = NULL;
    pthread_mutex_unlock(&out_lock);
}

int InitializeInjection(void) {
    const char *path = getenv("CUPTI_TRACE_OUT");
    if (!path || !*path) path = "cupti-trace.csv";
    out = fopen(path, "w");
    if (!out) {
        fprintf(stderr, "cupti-trace: cannot write %s\n", path);
        return 0;
    }
    /* Processes this one starts (compiler workers) would truncate the file: they load no tracer. */
    unsetenv("CUDA_INJECTION64_PATH");
    fputs("what,start_ns,end_ns,correlation,stream_or_thread,bytes,name\n", out);
    CHECK(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed));
    for (size_t i = 0; i < sizeof KINDS / sizeof *KINDS; i++) CHECK(cuptiActivityEnable(KINDS[i]));
    /* Buffers handed back at least every second, so a run killed early keeps most of its trace. */
    CHECK(cuptiActivityFlushPeriod(1000));
    atexit(finish);
    fprintf(stderr, "cupti-trace: recording to %s\n", path);
    return 1;
}
