/* Compiled shared-memory allreduce for the ranks of one host ("shm1", and "shm2" below),
 * and the flight recorder's store.
 *
 * Why compiled: below about 16 KiB an allreduce costs a few microseconds, and the Python
 * shared-memory path spends that much on NumPy calls alone, while MPI's own shared-memory
 * allreduce takes about one. Here one call is: copy the input into this rank's slot,
 * post a counter, wait for every other rank's counter, then reduce all slots in
 * local-rank order into the output. One synchronisation per step, no Python in between.
 *
 * Memory: each local rank owns a segment (in an MPI-3 shared window, mapped by all):
 *   [header: int64 counter, two signatures of SIG_WORDS int64 (by the epoch's parity),
 *    then one int64 "asleep on this counter" flag per rank]
 *   [slot, parity 0: cap bytes] [slot, parity 1: cap bytes]
 * Steps alternate parity. A rank writes its slot of parity p at step e only after it saw
 * every rank post step e-1, which each did after finishing step e-2 (the last reader of
 * that slot): one counter wait per step suffices.
 *
 * Every rank reduces the same slots in the same order, so every rank gets the same bits.
 * Waits: spin (both ranks on-CPU: the other is a moment behind); then, with the GIL
 * released, keep spinning or yield the core, for up to yield_ns; then sleep on the counter
 * with a futex (2 ms timeout), checking for Python signals (Ctrl-C) every 100 ms. A poster
 * wakes sleepers only when one announced itself, so the common case makes no system call.
 *
 * Spin or yield: each rank posts the CPU it ran on (the header's last cache line). A rank
 * waiting for one that last ran on its own CPU yields at once: the late rank needs this
 * core. Otherwise it spins and does not yield, because sched_yield hands the core to
 * whatever else runs there (a busy process: a whole time slice, 1-4 ms) and the late rank,
 * on another core, is not helped by it. Nor does it go to sleep early: when the late rank
 * is only preempted for a moment, a sleeping waiter costs it a wake-up on every step, which
 * takes longer than the small allreduce itself. With more ranks than CPUs
 * (yield_always) every wait yields after a short spin, as the late rank may be queued
 * behind the waiter on any core.
 *
 * Mismatch check: every synchronisation carries the caller's signature (operation, dtype,
 * element count, op, path: signature.py packs it), written next to the counter before the
 * post. After the wait each rank compares the others' signatures with its own; at the
 * first synchronisation of a call that is the first exchange, so ranks that called with
 * different arguments all see it there, before any of them reduces, and all raise (through
 * the on_mismatch callback) instead of reducing garbage or waiting for a step that never
 * comes. It costs three stores and a few loads of the cache line the wait reads anyway.
 * A signature of zeros means "none" (checks off): never compared.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <sched.h>
#include <time.h>
#include <errno.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if PY_VERSION_HEX < 0x030A0000
static inline PyObject *Py_NewRef(PyObject *o) { Py_INCREF(o); return o; }
#endif

#define MAX_RANKS 4096
#define MAX_FAST 32          /* rows of allreduce()'s own path table */
#define SPIN_NS 20000L       /* default: spin this long before yielding */
#define YIELD_NS 10000000L   /* default: then spin or yield this long before sleeping */
#define SLEEP_NS 2000000L    /* futex timeout: the longest a missed wake-up can cost */
#define SIGNAL_CHECK_NS 100000000L
#define SIG_WORDS 3
#define NT_NS 140L           /* default: a synchronisation round slower than this streams */
#define NT_FLOOR (256L << 10)  /* default: calls from this many bytes choose how to write */
#define NT_ROUNDS 4          /* timed synchronisation rounds per such call */

enum { OP_SUM, OP_PROD, OP_MIN, OP_MAX, OP_AVG, N_OPS };
enum { T_I8, T_U8, T_I16, T_U16, T_I32, T_U32, T_I64, T_U64, T_F32, T_F64, N_TYPES };
static const int type_size[N_TYPES] = {1, 1, 2, 2, 4, 4, 8, 8, 4, 8};

typedef struct {
    PyObject_HEAD
    int me, n;
    Py_ssize_t cap, hdr;
    char **seg;               /* seg[k]: rank k's segment in this process's mapping */
    int64_t epoch;            /* counter value posted last */
    int64_t step;             /* steps so far: a step's parity picks its slots */
    /* allreduce()'s own table, out of place [0] and in place [1]: sizes below
     * fast_bound[v][i] (and at or above the row before) take fast_code[v][i]
     * (1: shm1, 2: shm2); sizes at or above the last bound go to the fallback */
    long long fast_bound[2][MAX_FAST];
    int fast_code[2][MAX_FAST], fast_n[2];
    long long limit_out, limit_in;  /* the last bounds (read-only: tests read them) */
    long long slept;          /* times this rank went to sleep (benchmarks read it) */
    long long shared_waits;   /* waits that yielded at once: the late rank ran on this CPU */
    long long spin_ns, yield_ns;
    int yield_always;         /* more ranks than CPUs: every wait yields after its spin */
    int my_cpu;               /* the CPU this rank posted last (-1: none yet) */
    /* flight recorder (optional): ring of (seq, desc) int64 pairs */
    int64_t *rec;
    long long rec_mask;
    long long seq;
    long long rec_desc[N_TYPES];  /* operation and dtype bits of an allreduce, per type */
    long long rec_count_max;
    int recording;            /* 0: stores skipped (the recorder benchmark's "off" rounds) */
    int64_t *rec_inside;      /* the recorder header's flag word: 1 while inside allreduce() */
    int64_t *inside_on;       /* rec_inside, or NULL while timing is off (the hot path reads this only) */
    int timing;               /* 0: the flag is not stored (the wait-timing benchmark's "off") */
    /* mismatch check: the signature every synchronisation of the current call carries */
    int checking;             /* 0: no signatures (DTRUN_CHECK=0) */
    int64_t sig[SIG_WORDS];
    /* how this rank writes its slot (see choose_writes): -1 auto, 0 cached, 1 streaming */
    int nt_mode, nt_now;
    long long nt_ns, nt_floor, nt_last_ns, nt_calls;
    long long sig_base[N_TYPES];  /* allreduce()'s signature bits per type code */
    int redop_shift, path_shift;
    PyObject *on_mismatch;    /* called with every rank's signature; raises */
    PyObject *keep;           /* objects that own the mappings (kept alive) */
    PyObject *fallback;       /* called with the original arguments when not taken */
    PyObject *empty_like;
    PyTypeObject *ndarray;
} Engine;

static PyObject *s_sum, *s_prod, *s_min, *s_max, *s_avg;
static const char *kwlist_names[] = {"x", "op", "out", "inplace"};

static inline int64_t *counter(Engine *e, int k) { return (int64_t *)e->seg[k]; }
static inline int64_t *sigw(Engine *e, int k, int par) { return (int64_t *)e->seg[k] + 1 + par * SIG_WORDS; }
static inline int64_t *flag(Engine *e, int k, int waiter) {
    return (int64_t *)e->seg[k] + 1 + 2 * SIG_WORDS + waiter;
}
static inline char *slot(Engine *e, int k, int par) { return e->seg[k] + e->hdr + par * e->cap; }
/* the CPU rank k ran on when it last posted: the header's last cache line, apart from the
 * counter's (it changes only when the rank migrates) */
static inline int64_t *cpu_of(Engine *e, int k) { return (int64_t *)(e->seg[k] + e->hdr - 64); }

static inline int current_cpu(void) {
#ifdef __linux__
    return sched_getcpu();
#else
    return -1;
#endif
}

static inline long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long)ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void futex_wait(int64_t *addr, int64_t seen) {
#ifdef __linux__
    struct timespec to = {0, SLEEP_NS};
    uint32_t *word = (uint32_t *)addr;
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    word += 1;
#endif
    syscall(SYS_futex, word, FUTEX_WAIT, (uint32_t)seen, &to, NULL, 0);
#else
    struct timespec to = {0, 50000};
    (void)addr; (void)seen;
    nanosleep(&to, NULL);
#endif
}

static void futex_wake(int64_t *addr) {
#ifdef __linux__
    uint32_t *word = (uint32_t *)addr;
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    word += 1;
#endif
    syscall(SYS_futex, word, FUTEX_WAKE, 0x7fffffff, NULL, NULL, 0);
#else
    (void)addr;
#endif
}

static void post(Engine *e, int64_t epoch) {
    int64_t *mine = counter(e, e->me);
    int cpu = current_cpu();
    if (cpu != e->my_cpu) {
        e->my_cpu = cpu;
        __atomic_store_n(cpu_of(e, e->me), (int64_t)cpu, __ATOMIC_RELAXED);
    }
    __atomic_store_n(mine, epoch, __ATOMIC_RELEASE);   /* the slot's data before the counter */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);           /* the counter before the flags are read */
    for (int k = 0; k < e->n; k++) {
        if (k != e->me && __atomic_load_n(flag(e, e->me, k), __ATOMIC_RELAXED)) {
            futex_wake(mine);
            break;
        }
    }
}

/* Wait until rank k posted ``epoch``. Called with the GIL held; returns -1 with a Python
 * exception set when a signal handler raised (Ctrl-C) during a long wait. */
static int wait_for(Engine *e, int k, int64_t epoch) {
    int64_t *c = counter(e, k);
    if (__atomic_load_n(c, __ATOMIC_ACQUIRE) >= epoch)
        return 0;
    long start = now_ns();
    /* k last ran on this CPU (or has not posted yet): it needs this core, yield at once */
    int64_t kcpu = __atomic_load_n(cpu_of(e, k), __ATOMIC_RELAXED);
    int shared = kcpu >= 0 && kcpu == current_cpu();
    int yield = e->yield_always || kcpu < 0 || shared;
    e->shared_waits += shared;
    if (!yield || e->yield_always) {
        for (;;) {
            for (int i = 0; i < 64; i++) {
                if (__atomic_load_n(c, __ATOMIC_ACQUIRE) >= epoch)
                    return 0;
                cpu_relax();
            }
            if (now_ns() - start > e->spin_ns)
                break;
        }
    }
    int rc = 0;
    PyThreadState *ts = PyEval_SaveThread();
    while (now_ns() - start < e->spin_ns + e->yield_ns) {
        if (yield) {
            sched_yield();
        } else {
            for (int i = 0; i < 256; i++) {
                if (__atomic_load_n(c, __ATOMIC_ACQUIRE) >= epoch)
                    goto done;
                cpu_relax();
            }
        }
        if (__atomic_load_n(c, __ATOMIC_ACQUIRE) >= epoch)
            goto done;
    }
    e->slept++;
    int64_t *f = flag(e, k, e->me);
    long last_check = now_ns();
    for (;;) {
        int64_t seen = __atomic_load_n(c, __ATOMIC_ACQUIRE);
        if (seen >= epoch)
            break;
        __atomic_store_n(f, 1, __ATOMIC_RELAXED);
        __atomic_thread_fence(__ATOMIC_SEQ_CST);       /* the flag before the counter is re-read */
        seen = __atomic_load_n(c, __ATOMIC_ACQUIRE);
        if (seen >= epoch)
            break;
        futex_wait(c, seen);
        long t = now_ns();
        if (t - last_check > SIGNAL_CHECK_NS) {
            last_check = t;
            PyEval_RestoreThread(ts);
            if (PyErr_CheckSignals() < 0) {
                __atomic_store_n(f, 0, __ATOMIC_RELAXED);
                return -1;
            }
            ts = PyEval_SaveThread();
        }
    }
    __atomic_store_n(f, 0, __ATOMIC_RELAXED);
done:
    PyEval_RestoreThread(ts);
    return rc;
}

/* The ranks' signatures differ at the synchronisation of parity ``par``: hand every rank's
 * to on_mismatch, which raises. Returns -1 with the exception set. */
static int mismatch(Engine *e, int par) {
    PyObject *rows = PyList_New(e->n);
    if (rows == NULL) return -1;
    for (int k = 0; k < e->n; k++) {
        const int64_t *w = k == e->me ? e->sig : sigw(e, k, par);
        PyObject *row = Py_BuildValue("(LLL)", (long long)__atomic_load_n(w, __ATOMIC_RELAXED),
                                      (long long)__atomic_load_n(w + 1, __ATOMIC_RELAXED),
                                      (long long)__atomic_load_n(w + 2, __ATOMIC_RELAXED));
        if (row == NULL) { Py_DECREF(rows); return -1; }
        PyList_SET_ITEM(rows, k, row);
    }
    if (e->on_mismatch == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "ranks called the engine with different signatures");
    } else {
        PyObject *r = PyObject_CallOneArg(e->on_mismatch, rows);
        if (r != NULL) {   /* the callback must raise */
            Py_DECREF(r);
            PyErr_SetString(PyExc_RuntimeError, "ranks called the engine with different signatures");
        }
    }
    Py_DECREF(rows);
    return -1;
}

/* One synchronisation: post the next epoch (with this call's signature) and wait until
 * every other rank posted it, then compare signatures. Returns -1 with a Python exception
 * set when a signal handler raised or the signatures differ. */
static int sync_all(Engine *e) {
    int64_t epoch = ++e->epoch;
    int par = (int)(epoch & 1);
    /* Rewritten at epoch+2 only, which this rank posts after every other rank posted
     * epoch+1, i.e. after each finished reading this one. */
    int64_t *mine = sigw(e, e->me, par);
    for (int i = 0; i < SIG_WORDS; i++)
        __atomic_store_n(mine + i, e->sig[i], __ATOMIC_RELAXED);  /* ordered by post's release */
    post(e, epoch);
    for (int k = 0; k < e->n; k++)
        if (k != e->me && wait_for(e, k, epoch) < 0)
            return -1;
    if (e->sig[0] != 0) {
        for (int k = 0; k < e->n; k++) {
            if (k == e->me) continue;
            const int64_t *w = sigw(e, k, par);
            int64_t w0 = __atomic_load_n(w, __ATOMIC_RELAXED);
            if (w0 != 0 && (w0 != e->sig[0] || __atomic_load_n(w + 1, __ATOMIC_RELAXED) != e->sig[1] ||
                            __atomic_load_n(w + 2, __ATOMIC_RELAXED) != e->sig[2]))
                return mismatch(e, par);
        }
    }
    return 0;
}

static inline void set_sig(Engine *e, int64_t w0, int64_t w1, int64_t w2) {
    if (e->checking) {
        e->sig[0] = w0; e->sig[1] = w1; e->sig[2] = w2;
    } else {
        e->sig[0] = e->sig[1] = e->sig[2] = 0;
    }
}

/* An optional signature argument: None (no check) or a tuple of SIG_WORDS ints. */
static int sig_arg(Engine *e, PyObject *o) {
    long long w[SIG_WORDS] = {0, 0, 0};
    if (o != Py_None && !PyArg_ParseTuple(o, "LLL", &w[0], &w[1], &w[2]))
        return -1;
    set_sig(e, w[0], w[1], w[2]);
    return 0;
}

/* ---- how a rank writes its slot: cached or streaming stores ----
 * The other ranks read a slot right after its owner wrote it. With the cores in one cache
 * domain (a shared L3) they find the lines there. With the cores in different ones
 * (another CCX of an AMD EPYC, another socket, or a VM whose vCPUs the host runs apart)
 * every read fetches a line still dirty in the writer's cache, which is slower than
 * reading memory; there streaming stores, which write past the cache, make a large
 * allreduce faster, and in one cache domain slower (bench_inplace_loop prints both).
 * Where the vCPUs run can change while a job runs, so every call of nt_floor bytes or
 * more times NT_ROUNDS synchronisation rounds right after its first synchronisation (the
 * ranks are in step then, and that one has compared the ranks' signatures: they all make
 * the same rounds): when even the fastest round took over nt_ns, the lines travel between
 * cache domains (one slow round is an interrupt or a preemption, not a placement), and
 * this rank streams its slot writes for the rest of the call. Each rank
 * decides for itself: how a slot was written changes its readers' speed, never what they
 * read. */
static int choose_writes(Engine *e, Py_ssize_t nbytes) {
    /* nt_now is 0 here: run() and run2() clear it before their first step */
    if (nbytes < e->nt_floor || e->nt_mode == 0)
        return 0;
    if (e->nt_mode < 0) {
        /* more ranks than CPUs: a round's time is the scheduler's, not the caches' */
        if (e->yield_always)
            return 0;
        long best = -1;
        for (int i = 0; i < NT_ROUNDS; i++) {
            long t0 = now_ns();
            if (sync_all(e) < 0)
                return -1;
            long took = now_ns() - t0;
            if (best < 0 || took < best)
                best = took;
        }
        e->nt_last_ns = best;
        if (e->nt_last_ns <= e->nt_ns)
            return 0;
    }
    e->nt_now = 1;
    e->nt_calls++;
    return 0;
}

/* Copy n bytes into a slot: streaming stores when this call chose them (then a store
 * fence, so the data is visible before the counter that post() stores next). */
static void slot_write(Engine *e, char *dst, const char *src, Py_ssize_t n) {
#if defined(__x86_64__)
    if (e->nt_now && n >= 256) {
        while (((uintptr_t)dst & 15) && n > 0) { *dst++ = *src++; n--; }
        for (; n >= 64; n -= 64, src += 64, dst += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)src);
            __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
            _mm_stream_si128((__m128i *)dst, a);
            _mm_stream_si128((__m128i *)(dst + 16), b);
            _mm_stream_si128((__m128i *)(dst + 32), c);
            _mm_stream_si128((__m128i *)(dst + 48), d);
        }
        memcpy(dst, src, n);
        _mm_sfence();
        return;
    }
#endif
    memcpy(dst, src, n);
}

/* ---- reduction kernels: out = a op b (elementwise, n elements) ---- */
#define SUMX(x, y) ((x) + (y))
#define PRODX(x, y) ((x) * (y))
#define MINX(x, y) ((x) < (y) ? (x) : (y))
#define MAXX(x, y) ((x) > (y) ? (x) : (y))
/* floating min/max as NumPy's minimum/maximum: a NaN in either operand wins */
#define FMINX(x, y) (((x) < (y) || (x) != (x)) ? (x) : (y))
#define FMAXX(x, y) (((x) > (y) || (x) != (x)) ? (x) : (y))

#define KERNEL(NAME, T, EXPR) \
    static void NAME(char *o_, const char *a_, const char *b_, Py_ssize_t n) { \
        T *restrict o = (T *)o_; const T *restrict a = (const T *)a_; const T *restrict b = (const T *)b_; \
        for (Py_ssize_t i = 0; i < n; i++) { T x = a[i], y = b[i]; o[i] = EXPR(x, y); } \
    }
/* the same with the output aliasing a (acc = acc op b) */
#define KERNEL_ACC(NAME, T, EXPR) \
    static void NAME(char *o_, const char *a_, const char *b_, Py_ssize_t n) { \
        T *o = (T *)o_; const T *restrict b = (const T *)b_; (void)a_; \
        for (Py_ssize_t i = 0; i < n; i++) { T x = o[i], y = b[i]; o[i] = EXPR(x, y); } \
    }
/* integers: sum and product wrap (computed unsigned: signed overflow is undefined in C) */
#define INT_KERNELS(TAG, T, UT) \
    KERNEL(sum_##TAG, UT, SUMX) KERNEL(prod_##TAG, UT, PRODX) \
    KERNEL(min_##TAG, T, MINX) KERNEL(max_##TAG, T, MAXX) \
    KERNEL_ACC(sumacc_##TAG, UT, SUMX) KERNEL_ACC(prodacc_##TAG, UT, PRODX) \
    KERNEL_ACC(minacc_##TAG, T, MINX) KERNEL_ACC(maxacc_##TAG, T, MAXX)
#define FLT_KERNELS(TAG, T) \
    KERNEL(sum_##TAG, T, SUMX) KERNEL(prod_##TAG, T, PRODX) \
    KERNEL(min_##TAG, T, FMINX) KERNEL(max_##TAG, T, FMAXX) \
    KERNEL_ACC(sumacc_##TAG, T, SUMX) KERNEL_ACC(prodacc_##TAG, T, PRODX) \
    KERNEL_ACC(minacc_##TAG, T, FMINX) KERNEL_ACC(maxacc_##TAG, T, FMAXX)

INT_KERNELS(i8, int8_t, uint8_t) INT_KERNELS(u8, uint8_t, uint8_t)
INT_KERNELS(i16, int16_t, uint16_t) INT_KERNELS(u16, uint16_t, uint16_t)
INT_KERNELS(i32, int32_t, uint32_t) INT_KERNELS(u32, uint32_t, uint32_t)
INT_KERNELS(i64, int64_t, uint64_t) INT_KERNELS(u64, uint64_t, uint64_t)
FLT_KERNELS(f32, float) FLT_KERNELS(f64, double)

typedef void (*kern_t)(char *, const char *, const char *, Py_ssize_t);
#define ROW(TAG) {sum_##TAG, prod_##TAG, min_##TAG, max_##TAG, sum_##TAG}
#define ROWACC(TAG) {sumacc_##TAG, prodacc_##TAG, minacc_##TAG, maxacc_##TAG, sumacc_##TAG}
static const kern_t KERN[N_TYPES][N_OPS] = {
    ROW(i8), ROW(u8), ROW(i16), ROW(u16), ROW(i32), ROW(u32), ROW(i64), ROW(u64), ROW(f32), ROW(f64)};
static const kern_t KERNACC[N_TYPES][N_OPS] = {
    ROWACC(i8), ROWACC(u8), ROWACC(i16), ROWACC(u16), ROWACC(i32), ROWACC(u32), ROWACC(i64),
    ROWACC(u64), ROWACC(f32), ROWACC(f64)};

static void divide(char *p, int type, Py_ssize_t n, int by) {
    if (type == T_F32) {
        float *f = (float *)p, d = (float)by;
        for (Py_ssize_t i = 0; i < n; i++) f[i] = f[i] / d;
    } else {
        double *f = (double *)p, d = (double)by;
        for (Py_ssize_t i = 0; i < n; i++) f[i] = f[i] / d;
    }
}

/* The engine's allreduce: count elements of ``type`` from src into dst (may be the same
 * memory), in steps of at most cap bytes. Returns -1 with an exception set on a signal. */
static int run(Engine *e, const char *src, char *dst, Py_ssize_t count, int type, int op) {
    Py_ssize_t isz = type_size[type];
    Py_ssize_t per = e->cap / isz;
    kern_t first = KERN[type][op], acc = KERNACC[type][op];
    e->nt_now = 0;
    for (Py_ssize_t start = 0; start < count; start += per) {
        Py_ssize_t m = count - start < per ? count - start : per;
        int par = (int)(e->step++ & 1);
        slot_write(e, slot(e, e->me, par), src + start * isz, m * isz);
        if (sync_all(e) < 0)
            return -1;
        if (start == 0 && choose_writes(e, count * isz) < 0)
            return -1;
        char *o = dst + start * isz;
        first(o, slot(e, 0, par), slot(e, 1, par), m);
        for (int k = 2; k < e->n; k++)
            acc(o, NULL, slot(e, k, par), m);
        if (op == OP_AVG)
            divide(o, type, m, e->n);
    }
    return 0;
}

/* ---- the two-synchronisation form ("shm2"): each rank reduces one slice ----
 * The data is a stream of segments (dst may equal src: grouped_allreduce's arrays, in
 * place). Per step of up to cap bytes: (1) copy the slices the other ranks reduce into
 * this rank's slot; sync; (2) reduce this rank's slice over all ranks in local-rank order
 * (its own part read from src), write the result to its slot and to dst; sync; (3) copy
 * the other slices' results from their owners' slots to dst. Per rank it reads 2.5N and
 * writes 2N bytes on 2 ranks (shm1: 3N and 2N), and reads only half of the peer's data
 * across cores. */
typedef struct { char *src, *dst; Py_ssize_t len; } seg_t;

/* The index of the segment holding stream offset ``off``, looked for from ``*hint``
 * (offsets only grow within a phase), which it updates. */
static Py_ssize_t seg_at(const Py_ssize_t *starts, Py_ssize_t nseg, Py_ssize_t *hint,
                         Py_ssize_t off) {
    Py_ssize_t i = *hint;
    while (i > 0 && starts[i] > off) i--;
    while (i + 1 < nseg && starts[i + 1] <= off) i++;
    return *hint = i;
}

/* Copy ``len`` bytes of the stream at offset ``off`` out of (to_stream=0: from src) or
 * into (to_stream=1: to dst) the segments, from/to ``flat``. ``*hint``: the segment
 * index to start looking from (offsets only grow within a phase). */
static void stream_copy(Engine *e, const seg_t *segs, Py_ssize_t nseg, const Py_ssize_t *starts,
                        Py_ssize_t *hint, Py_ssize_t off, char *flat, Py_ssize_t len, int to_stream) {
    Py_ssize_t i = seg_at(starts, nseg, hint, off);
    while (len > 0 && i < nseg) {
        Py_ssize_t in = off - starts[i];
        Py_ssize_t take = segs[i].len - in;
        if (take > len) take = len;
        if (take > 0) {
            if (to_stream) memcpy(segs[i].dst + in, flat, take);
            else if (e != NULL) slot_write(e, flat, segs[i].src + in, take);
            else memcpy(flat, segs[i].src + in, take);
            flat += take; off += take; len -= take;
        }
        if (len > 0) i++;
    }
    *hint = i;
}

/* A pointer to stream bytes [off, off+len) of src: into the segment when it holds them
 * all, else gathered into ``tmp``. */
static const char *stream_src(const seg_t *segs, Py_ssize_t nseg, const Py_ssize_t *starts,
                              Py_ssize_t *hint, Py_ssize_t off, Py_ssize_t len, char *tmp) {
    Py_ssize_t i = seg_at(starts, nseg, hint, off);
    if (off - starts[i] + len <= segs[i].len)
        return segs[i].src + (off - starts[i]);
    stream_copy(NULL, segs, nseg, starts, hint, off, tmp, len, 0);
    return tmp;
}

/* Bytes of the stream from offset ``off`` to the end of the segment holding it. */
static Py_ssize_t seg_rest(const seg_t *segs, Py_ssize_t nseg, const Py_ssize_t *starts,
                           Py_ssize_t *hint, Py_ssize_t off) {
    Py_ssize_t i = seg_at(starts, nseg, hint, off);
    return starts[i] + segs[i].len - off;
}

/* Bytes [*lo, *hi) of an m-byte step that rank q reduces: whole units, clipped to m. */
static void slice_of(Py_ssize_t units, Py_ssize_t unit, Py_ssize_t m, int q, int n,
                     Py_ssize_t *lo, Py_ssize_t *hi) {
    *lo = units * q / n * unit;
    *hi = units * (q + 1) / n * unit;
    if (*lo > m) *lo = m;
    if (*hi > m) *hi = m;
}

/* Every other rank q's slice of an m-byte step, between the arrays and the slots:
 * to_stream 0 copies the arrays' bytes into this rank's slot (phase 1), to_stream 1 copies
 * q's reduced slice from q's slot into the arrays (phase 3). */
static void copy_other_slices(Engine *e, const seg_t *segs, Py_ssize_t nseg,
                              const Py_ssize_t *starts, Py_ssize_t units, Py_ssize_t unit,
                              Py_ssize_t m, Py_ssize_t start, int par, int to_stream) {
    Py_ssize_t hint = 0;
    for (int q = 0; q < e->n; q++) {
        if (q == e->me) continue;
        Py_ssize_t lo, hi;
        slice_of(units, unit, m, q, e->n, &lo, &hi);
        if (hi > lo)
            stream_copy(e, segs, nseg, starts, &hint, start + lo,
                        slot(e, to_stream ? q : e->me, par) + lo, hi - lo, to_stream);
    }
}

#define BLOCK 8192  /* bytes reduced at a time in phase 2 (stays in L1) */

static int run2(Engine *e, const seg_t *segs, Py_ssize_t nseg, int type, int op) {
    Py_ssize_t isz = type_size[type];
    Py_ssize_t *starts = PyMem_Malloc((nseg + 1) * sizeof(Py_ssize_t));
    if (starts == NULL) { PyErr_NoMemory(); return -1; }
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < nseg; i++) { starts[i] = total; total += segs[i].len; }
    starts[nseg] = total;
    int n = e->n, me = e->me;
    Py_ssize_t unit = 64;  /* slice boundaries on cache lines (and whole elements) */
    kern_t first = KERN[type][op], acc = KERNACC[type][op];
    char accbuf[BLOCK] __attribute__((aligned(64)));
    char ownbuf[BLOCK] __attribute__((aligned(64)));
    int rc = 0;
    e->nt_now = 0;
    for (Py_ssize_t start = 0; start < total; start += e->cap) {
        Py_ssize_t m = total - start < e->cap ? total - start : e->cap;  /* bytes this step */
        Py_ssize_t units = (m + unit - 1) / unit;
        int par = (int)(e->step++ & 1);
        /* (1) the others' slices of this rank's data into its slot */
        copy_other_slices(e, segs, nseg, starts, units, unit, m, start, par, 0);
        if (sync_all(e) < 0) { rc = -1; goto out; }
        if (start == 0 && choose_writes(e, total) < 0) { rc = -1; goto out; }
        /* (2) this rank's slice */
        Py_ssize_t lo, hi;
        slice_of(units, unit, m, me, n, &lo, &hi);
        Py_ssize_t hint = 0, whint = 0;
        for (Py_ssize_t b = lo, len; b < hi; b += len) {
            len = hi - b < BLOCK ? hi - b : BLOCK;
            /* A block ends where its first segment does when the segment ends inside it
             * (grouped arrays of 4 KiB: no gather into ownbuf, which cost a copy). */
            Py_ssize_t rest = seg_rest(segs, nseg, starts, &hint, start + b);
            if (rest < len) len = rest;
            Py_ssize_t cnt = len / isz;
            const char *own = stream_src(segs, nseg, starts, &hint, start + b, len, ownbuf);
            const char *in0 = me == 0 ? own : slot(e, 0, par) + b;
            const char *in1 = me == 1 ? own : slot(e, 1, par) + b;
            first(accbuf, in0, in1, cnt);
            for (int k = 2; k < n; k++)
                acc(accbuf, NULL, k == me ? own : slot(e, k, par) + b, cnt);
            if (op == OP_AVG)
                divide(accbuf, type, cnt, n);
            slot_write(e, slot(e, me, par) + b, accbuf, len);
            stream_copy(NULL, segs, nseg, starts, &whint, start + b, accbuf, len, 1);
        }
        if (sync_all(e) < 0) { rc = -1; goto out; }
        /* (3) the other slices' results */
        copy_other_slices(e, segs, nseg, starts, units, unit, m, start, par, 1);
    }
out:
    PyMem_Free(starts);
    return rc;
}

/* Buffer format (NumPy's, native byte order) -> type code, or -1. */
static int type_of(const Py_buffer *v) {
    const char *f = v->format;
    if (f == NULL) return T_U8;
    if (*f == '=' || *f == '@') f++;
    if (f[0] == '\0' || f[1] != '\0') return -1;
    switch (f[0]) {
    case 'b': return T_I8;
    case 'B': return T_U8;
    case 'h': return v->itemsize == 2 ? T_I16 : -1;
    case 'H': return v->itemsize == 2 ? T_U16 : -1;
    case 'i': return v->itemsize == 4 ? T_I32 : -1;
    case 'I': return v->itemsize == 4 ? T_U32 : -1;
    case 'l': case 'q': return v->itemsize == 8 ? T_I64 : (v->itemsize == 4 ? T_I32 : -1);
    case 'L': case 'Q': return v->itemsize == 8 ? T_U64 : (v->itemsize == 4 ? T_U32 : -1);
    case 'f': return v->itemsize == 4 ? T_F32 : -1;
    case 'd': return v->itemsize == 8 ? T_F64 : -1;
    default: return -1;
    }
}

static int op_of(PyObject *op) {
    if (op == s_sum) return OP_SUM;
    if (op == s_avg) return OP_AVG;
    if (op == s_max) return OP_MAX;
    if (op == s_min) return OP_MIN;
    if (op == s_prod) return OP_PROD;
    if (!PyUnicode_Check(op)) return -1;
    if (PyUnicode_CompareWithASCIIString(op, "sum") == 0) return OP_SUM;
    if (PyUnicode_CompareWithASCIIString(op, "avg") == 0) return OP_AVG;
    if (PyUnicode_CompareWithASCIIString(op, "max") == 0) return OP_MAX;
    if (PyUnicode_CompareWithASCIIString(op, "min") == 0) return OP_MIN;
    if (PyUnicode_CompareWithASCIIString(op, "prod") == 0) return OP_PROD;
    return -1;
}

static void record(Engine *e, long long desc) {
    if (e->rec != NULL && e->recording) {
        long long s = ++e->seq;
        int64_t *r = e->rec + ((s & e->rec_mask) << 1);
        __atomic_store_n(r + 1, (int64_t)desc, __ATOMIC_RELAXED);   /* desc before seq */
        __atomic_store_n(r, (int64_t)s, __ATOMIC_RELEASE);
    }
}

/* allreduce(x, op="sum", out=None, inplace=False): the hot path for NumPy arrays. Takes
 * the call when x is a C-contiguous ndarray of a supported dtype below the size limit,
 * and out (if any) is such an array of the same dtype and shape; else calls the fallback
 * with the same arguments. */
static PyObject *Engine_allreduce(Engine *e, PyObject *const *args, Py_ssize_t nargs,
                                  PyObject *kwnames) {
    PyObject *a[4] = {NULL, s_sum, Py_None, Py_False};
    if (nargs > 4) goto slow;
    for (Py_ssize_t i = 0; i < nargs; i++) a[i] = args[i];
    if (kwnames != NULL) {
        Py_ssize_t nk = PyTuple_GET_SIZE(kwnames);
        for (Py_ssize_t j = 0; j < nk; j++) {
            PyObject *name = PyTuple_GET_ITEM(kwnames, j);
            int idx = -1;
            for (int q = 0; q < 4; q++) {
                if (PyUnicode_CompareWithASCIIString(name, kwlist_names[q]) == 0) { idx = q; break; }
            }
            if (idx < 0 || idx < nargs) goto slow;   /* let Python raise the TypeError */
            a[idx] = args[nargs + j];
        }
    }
    if (a[0] == NULL) goto slow;
    {
        PyObject *x = a[0], *opobj = a[1], *out = a[2];
        int inplace = PyObject_IsTrue(a[3]);
        if (inplace < 0) { PyErr_Clear(); goto slow; }
        if (Py_TYPE(x) != e->ndarray || e->n < 2) goto slow;
        int op = op_of(opobj);
        if (op < 0) goto slow;
        if (out == x) inplace = 1;
        Py_buffer xv;
        if (PyObject_GetBuffer(x, &xv, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT |
                               (inplace ? PyBUF_WRITABLE : 0)) < 0) {
            PyErr_Clear();
            goto slow;
        }
        int type = type_of(&xv);
        int code = 0;
        for (int i = 0; i < e->fast_n[inplace]; i++) {
            if (xv.len < e->fast_bound[inplace][i]) { code = e->fast_code[inplace][i]; break; }
        }
        if (type < 0 || code == 0 || xv.len == 0 ||
                (op == OP_AVG && type != T_F32 && type != T_F64)) {
            PyBuffer_Release(&xv);
            goto slow;
        }
        PyObject *result;
        Py_buffer ov;
        int have_ov = 0;
        if (inplace) {
            result = x;
            Py_INCREF(result);
        } else if (out == Py_None) {
            result = PyObject_CallOneArg(e->empty_like, x);
            if (result == NULL) { PyBuffer_Release(&xv); return NULL; }
        } else {
            if (Py_TYPE(out) != e->ndarray) { PyBuffer_Release(&xv); goto slow; }
            if (PyObject_GetBuffer(out, &ov, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0) {
                PyErr_Clear(); PyBuffer_Release(&xv); goto slow;
            }
            int same = type_of(&ov) == type && ov.len == xv.len && ov.ndim == xv.ndim;
            for (int d = 0; same && d < xv.ndim; d++)
                same = ov.shape[d] == xv.shape[d];
            /* an out sharing memory with x (not x itself): Python refuses it */
            if ((char *)ov.buf < (char *)xv.buf + xv.len && (char *)xv.buf < (char *)ov.buf + ov.len)
                same = 0;
            if (!same) { PyBuffer_Release(&ov); PyBuffer_Release(&xv); goto slow; }
            have_ov = 1;
            result = out;
            Py_INCREF(result);
        }
        char *dst;
        if (have_ov) {
            dst = ov.buf;
        } else if (inplace) {
            dst = xv.buf;
        } else {
            Py_buffer rv;
            if (PyObject_GetBuffer(result, &rv, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
                Py_DECREF(result); PyBuffer_Release(&xv); return NULL;
            }
            dst = rv.buf;
            PyBuffer_Release(&rv);   /* result stays alive: we hold a reference */
        }
        Py_ssize_t count = xv.len / xv.itemsize;
        record(e, e->rec_desc[type] | (count < e->rec_count_max ? count : e->rec_count_max));
        /* inside the collective until it returns: dtrun's agent reads the flag (no clock here) */
        int64_t *inside = e->inside_on;
        if (inside != NULL) __atomic_store_n(inside, 1, __ATOMIC_RELAXED);
        set_sig(e, e->sig_base[type] | ((long long)(op + 1) << e->redop_shift) |
                ((long long)(code + 1) << e->path_shift), count, 0);
        int rc;
        if (code == 1) {
            rc = run(e, xv.buf, dst, count, type, op);
        } else {
            seg_t seg = {xv.buf, dst, xv.len};
            rc = run2(e, &seg, 1, type, op);
        }
        if (inside != NULL) __atomic_store_n(inside, 0, __ATOMIC_RELAXED);
        if (have_ov) PyBuffer_Release(&ov);
        PyBuffer_Release(&xv);
        if (rc < 0) { Py_DECREF(result); return NULL; }
        return result;
    }
slow:
    return PyObject_Vectorcall(e->fallback, args, nargs, kwnames);
}

/* reduce(src, dst, op, two=False, sig=None): the same steps for arrays the caller checked (C-contiguous,
 * one supported dtype, equal sizes; dst writable and may be src), at any size. Returns
 * True, or False when the dtype or op is not one this engine reduces. */
static PyObject *Engine_reduce(Engine *e, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 3 || nargs > 5) {
        PyErr_SetString(PyExc_TypeError, "reduce(src, dst, op, two=False, sig=None)");
        return NULL;
    }
    int two = nargs >= 4 ? PyObject_IsTrue(args[3]) : 0;
    if (two < 0) return NULL;
    if (sig_arg(e, nargs == 5 ? args[4] : Py_None) < 0) return NULL;
    if (e->n < 2) Py_RETURN_FALSE;
    int op = op_of(args[2]);
    Py_buffer sv, dv;
    if (op < 0) Py_RETURN_FALSE;
    /* A dtype NumPy cannot export (ml_dtypes' bfloat16): not one this engine reduces. */
    if (PyObject_GetBuffer(args[0], &sv, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        Py_RETURN_FALSE;
    }
    if (PyObject_GetBuffer(args[1], &dv, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&sv);
        PyErr_Clear();
        Py_RETURN_FALSE;
    }
    int type = type_of(&sv);
    PyObject *res = Py_False;
    if (type >= 0 && type_of(&dv) == type && dv.len == sv.len &&
            !(op == OP_AVG && type != T_F32 && type != T_F64)) {
        seg_t seg = {sv.buf, dv.buf, sv.len};
        if ((two ? run2(e, &seg, 1, type, op) : run(e, sv.buf, dv.buf, sv.len / sv.itemsize, type, op)) < 0)
            res = NULL;
        else
            res = Py_True;
    }
    PyBuffer_Release(&dv);
    PyBuffer_Release(&sv);
    Py_XINCREF(res);
    return res;
}

/* grouped(pairs, rep, op, sig=None): allreduce in place the arrays whose (address, nbytes) pairs
 * are the rows of ``pairs`` (an int64 array the caller built from arrays it keeps
 * alive, all of ``rep``'s dtype), as one stream, by the two-sync form. Returns True, or
 * False when the dtype or op is not one this engine reduces. */
static PyObject *Engine_grouped(Engine *e, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 && nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "grouped(pairs, rep, op, sig=None)");
        return NULL;
    }
    if (sig_arg(e, nargs == 4 ? args[3] : Py_None) < 0) return NULL;
    if (e->n < 2) Py_RETURN_FALSE;
    int op = op_of(args[2]);
    if (op < 0) Py_RETURN_FALSE;
    Py_buffer rv, pv;
    if (PyObject_GetBuffer(args[1], &rv, PyBUF_FORMAT | PyBUF_ND) < 0) {
        PyErr_Clear();   /* a dtype NumPy cannot export: not one this engine reduces */
        Py_RETURN_FALSE;
    }
    int type = type_of(&rv);
    PyBuffer_Release(&rv);
    if (type < 0 || (op == OP_AVG && type != T_F32 && type != T_F64)) Py_RETURN_FALSE;
    if (PyObject_GetBuffer(args[0], &pv, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    if (pv.itemsize != 8 || pv.len % 16) {
        PyBuffer_Release(&pv);
        PyErr_SetString(PyExc_ValueError, "pairs: int64 (address, nbytes) rows");
        return NULL;
    }
    Py_ssize_t nseg = pv.len / 16;
    seg_t *segs = PyMem_Malloc((nseg ? nseg : 1) * sizeof(seg_t));
    if (segs == NULL) { PyBuffer_Release(&pv); return PyErr_NoMemory(); }
    const int64_t *rows = pv.buf;
    for (Py_ssize_t i = 0; i < nseg; i++) {
        segs[i].src = segs[i].dst = (char *)(uintptr_t)rows[2 * i];
        segs[i].len = (Py_ssize_t)rows[2 * i + 1];
    }
    PyBuffer_Release(&pv);
    int rc = run2(e, segs, nseg, type, op);
    PyMem_Free(segs);
    if (rc < 0) return NULL;
    Py_RETURN_TRUE;
}

/* check(sig): one synchronisation carrying ``sig`` (a tuple of SIG_WORDS ints): the first
 * exchange of a collective that takes another path (MPI, the Python shared-memory path),
 * so that it meets a rank whose call took this engine. Collective over the host's ranks. */
static PyObject *Engine_check(Engine *e, PyObject *arg) {
    if (e->n < 2) Py_RETURN_NONE;
    if (sig_arg(e, arg) < 0) return NULL;
    if (sync_all(e) < 0) return NULL;
    Py_RETURN_NONE;
}

/* The N_TYPES ints of ``tuple`` (its length checked by the caller) into ``out``, one per
 * type code; -1 with an exception set at the first that is not an int. */
static int per_type(PyObject *tuple, long long *out) {
    for (int t = 0; t < N_TYPES; t++) {
        out[t] = PyLong_AsLongLong(PyTuple_GET_ITEM(tuple, t));
        if (out[t] == -1 && PyErr_Occurred())
            return -1;
    }
    return 0;
}

/* set_signature(bases, redop_shift, path_shift, on_mismatch): allreduce()'s signature bits
 * per type code, where the op and path codes go, and the callable that raises on a
 * mismatch (given every rank's signature). */
static PyObject *Engine_set_signature(Engine *e, PyObject *args) {
    PyObject *bases, *cb;
    int rs, ps;
    if (!PyArg_ParseTuple(args, "O!iiO", &PyTuple_Type, &bases, &rs, &ps, &cb))
        return NULL;
    if (PyTuple_GET_SIZE(bases) != N_TYPES || rs < 0 || rs > 60 || ps < 0 || ps > 60 ||
            !PyCallable_Check(cb)) {
        PyErr_SetString(PyExc_ValueError, "set_signature(bases: one int per type code, shifts, callable)");
        return NULL;
    }
    if (per_type(bases, e->sig_base) < 0)
        return NULL;
    e->redop_shift = rs;
    e->path_shift = ps;
    Py_XSETREF(e->on_mismatch, Py_NewRef(cb));
    e->checking = 1;
    Py_RETURN_NONE;
}

/* note(desc): the flight recorder's store for a collective that Python starts. */
static PyObject *Engine_note(Engine *e, PyObject *arg) {
    long long desc = PyLong_AsLongLong(arg);
    if (desc == -1 && PyErr_Occurred())
        return NULL;
    record(e, desc);
    Py_RETURN_NONE;
}

/* set_fast(out_rows, in_rows): allreduce()'s own table, each a tuple of (bound, code)
 * rows with growing bounds; code 1: shm1, 2: shm2. Empty tuples: every call falls back. */
static PyObject *Engine_set_fast(Engine *e, PyObject *args) {
    PyObject *rows[2];
    if (!PyArg_ParseTuple(args, "O!O!", &PyTuple_Type, &rows[0], &PyTuple_Type, &rows[1]))
        return NULL;
    long long bound[2][MAX_FAST];
    int code[2][MAX_FAST];
    for (int v = 0; v < 2; v++) {
        Py_ssize_t m = PyTuple_GET_SIZE(rows[v]);
        if (m > MAX_FAST) {
            PyErr_Format(PyExc_ValueError, "set_fast: at most %d rows", MAX_FAST);
            return NULL;
        }
        for (Py_ssize_t i = 0; i < m; i++) {
            if (!PyArg_ParseTuple(PyTuple_GET_ITEM(rows[v], i), "Li", &bound[v][i], &code[v][i]))
                return NULL;
            if ((code[v][i] != 1 && code[v][i] != 2) || bound[v][i] <= 0 ||
                    (i > 0 && bound[v][i] <= bound[v][i - 1])) {
                PyErr_SetString(PyExc_ValueError, "set_fast: rows are (growing bound > 0, code 1 or 2)");
                return NULL;
            }
        }
    }
    for (int v = 0; v < 2; v++) {
        int m = (int)PyTuple_GET_SIZE(rows[v]);
        for (int i = 0; i < m; i++) {
            e->fast_bound[v][i] = bound[v][i];
            e->fast_code[v][i] = code[v][i];
        }
        e->fast_n[v] = m;
    }
    e->limit_out = e->fast_n[0] ? e->fast_bound[0][e->fast_n[0] - 1] : 0;
    e->limit_in = e->fast_n[1] ? e->fast_bound[1][e->fast_n[1] - 1] : 0;
    Py_RETURN_NONE;
}

/* set_recorder(addr, mask, descs, count_max, inside=0): record into the ring of int64 pairs
 * at addr (kept alive by the caller, who passes its owner to keep()); descs: the
 * operation|dtype bits of an allreduce for each type code; inside: the address of the
 * header's flag word, 1 while allreduce() runs (0: none). */
static PyObject *Engine_set_recorder(Engine *e, PyObject *args) {
    unsigned long long addr, inside = 0;
    long long mask, count_max;
    PyObject *descs;
    if (!PyArg_ParseTuple(args, "KLOL|K", &addr, &mask, &descs, &count_max, &inside))
        return NULL;
    if (!PyTuple_Check(descs) || PyTuple_GET_SIZE(descs) != N_TYPES) {
        PyErr_SetString(PyExc_ValueError, "descs: one int per type code");
        return NULL;
    }
    if (per_type(descs, e->rec_desc) < 0)
        return NULL;
    e->rec = (int64_t *)(uintptr_t)addr;
    e->rec_inside = (int64_t *)(uintptr_t)inside;
    e->inside_on = e->timing ? e->rec_inside : NULL;
    e->rec_mask = mask;
    e->rec_count_max = count_max;
    Py_RETURN_NONE;
}

static int Engine_init(Engine *e, PyObject *args, PyObject *kw) {
    int me, n;
    PyObject *addrs, *keep, *fallback, *empty_like, *ndarray;
    Py_ssize_t cap, hdr;
    if (!PyArg_ParseTuple(args, "iiOnnOOOO", &me, &n, &addrs, &cap, &hdr, &keep, &fallback,
                          &empty_like, &ndarray))
        return -1;
    if (n < 1 || n > MAX_RANKS || me < 0 || me >= n || !PyTuple_Check(addrs) ||
            (n > 1 && PyTuple_GET_SIZE(addrs) != n) || cap < 0 || cap % 64 || hdr < 8 * (1 + n) ||
            (n > 1 && hdr < 8 * (1 + 2 * SIG_WORDS + n) + 64) ||
            !PyType_Check(ndarray) || !PyCallable_Check(fallback)) {
        PyErr_SetString(PyExc_ValueError, "Engine: bad layout");
        return -1;
    }
    e->me = me;
    e->n = n;
    e->cap = cap;
    e->hdr = hdr;
    PyMem_Free(e->seg);
    e->seg = NULL;
    if (n > 1) {
        e->seg = PyMem_Calloc(n, sizeof(char *));
        if (e->seg == NULL) { PyErr_NoMemory(); return -1; }
        for (int k = 0; k < n; k++) {
            e->seg[k] = (char *)(uintptr_t)PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(addrs, k));
            if (PyErr_Occurred()) return -1;
        }
        memset(e->seg[me], 0, hdr);
        *cpu_of(e, me) = -1;
    }
    e->my_cpu = -1;
    e->yield_always = 0;
    e->epoch = 0;
    e->limit_out = e->limit_in = 0;
    e->fast_n[0] = e->fast_n[1] = 0;
    e->spin_ns = SPIN_NS;
    e->recording = 1;
    e->timing = 1;
    e->checking = 0;
    e->sig[0] = e->sig[1] = e->sig[2] = 0;
    e->yield_ns = YIELD_NS;
    e->nt_mode = -1;
    e->nt_ns = NT_NS;
    e->nt_floor = NT_FLOOR;
    Py_XSETREF(e->keep, Py_NewRef(keep));
    Py_XSETREF(e->fallback, Py_NewRef(fallback));
    Py_XSETREF(e->empty_like, Py_NewRef(empty_like));
    Py_XSETREF(e->ndarray, (PyTypeObject *)Py_NewRef(ndarray));
    return 0;
}

/* The Python objects an Engine holds: the garbage collector's traverse and clear both
 * go through this one list. */
#define ENGINE_OBJECTS(X) X(keep) X(fallback) X(empty_like) X(ndarray) X(on_mismatch)

static int Engine_traverse(Engine *e, visitproc visit, void *arg) {
#define VISIT_FIELD(f) Py_VISIT(e->f);
    ENGINE_OBJECTS(VISIT_FIELD)
#undef VISIT_FIELD
    return 0;
}

static int Engine_clear(Engine *e) {
#define CLEAR_FIELD(f) Py_CLEAR(e->f);
    ENGINE_OBJECTS(CLEAR_FIELD)
#undef CLEAR_FIELD
    return 0;
}

static void Engine_dealloc(Engine *e) {
    PyObject_GC_UnTrack(e);
    Engine_clear(e);
    PyMem_Free(e->seg);
    Py_TYPE(e)->tp_free((PyObject *)e);
}

/* barrier_ns(iters): ``iters`` barriers over the engine's ranks (post, wait for all:
 * the synchronisation each collective step pays); collective over the host's ranks.
 * Returns the mean nanoseconds per barrier: the cost of one handoff between cores, which
 * on a VM changes with where the host runs its vCPUs. */
static PyObject *Engine_barrier_ns(Engine *e, PyObject *arg) {
    long iters = PyLong_AsLong(arg);
    if (iters == -1 && PyErr_Occurred()) return NULL;
    if (iters < 1 || e->n < 2) return PyFloat_FromDouble(0.0);
    set_sig(e, 0, 0, 0);
    long t0 = now_ns();
    for (long i = 0; i < iters; i++)
        if (sync_all(e) < 0) return NULL;
    return PyFloat_FromDouble((double)(now_ns() - t0) / iters);
}

static PyMethodDef Engine_methods[] = {
    {"allreduce", (PyCFunction)(void (*)(void))Engine_allreduce, METH_FASTCALL | METH_KEYWORDS,
     "allreduce(x, op='sum', out=None, inplace=False): the NumPy hot path, or the fallback."},
    {"reduce", (PyCFunction)(void (*)(void))Engine_reduce, METH_FASTCALL,
     "reduce(src, dst, op, two=False, sig=None) -> bool: allreduce src into dst (False: dtype/op\n"
     "not handled; then no rank synchronised)."},
    {"grouped", (PyCFunction)(void (*)(void))Engine_grouped, METH_FASTCALL,
     "grouped(pairs, rep, op, sig=None) -> bool: arrays at (address, nbytes) rows, in place, as one."},
    {"note", (PyCFunction)Engine_note, METH_O, "note(desc): record a collective."},
    {"check", (PyCFunction)Engine_check, METH_O,
     "check(sig): one synchronisation comparing the ranks' signatures (collective)."},
    {"set_signature", (PyCFunction)Engine_set_signature, METH_VARARGS,
     "set_signature(bases, redop_shift, path_shift, on_mismatch): turn the check on."},
    {"barrier_ns", (PyCFunction)Engine_barrier_ns, METH_O,
     "barrier_ns(iters) -> float: mean ns per shared-memory barrier (collective)."},
    {"set_recorder", (PyCFunction)Engine_set_recorder, METH_VARARGS,
     "set_recorder(addr, mask, descs, count_max)"},
    {"set_fast", (PyCFunction)Engine_set_fast, METH_VARARGS,
     "set_fast(out_rows, in_rows): allreduce()'s (bound, code) rows; code 1: shm1, 2: shm2"},
    {NULL, NULL, 0, NULL}};

static PyObject *Engine_get_timing(Engine *e, void *closure) {
    return PyLong_FromLong(e->timing);
}

static int Engine_set_timing(Engine *e, PyObject *value, void *closure) {
    int on = value == NULL ? 0 : PyObject_IsTrue(value);
    if (on < 0) return -1;
    e->timing = on;
    e->inside_on = on ? e->rec_inside : NULL;
    return 0;
}

static PyGetSetDef Engine_getset[] = {
    {"timing", (getter)Engine_get_timing, (setter)Engine_set_timing,
     "0: skip the recorder's inside-a-collective flag", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyMemberDef Engine_members[] = {
    {"limit_out", T_LONGLONG, offsetof(Engine, limit_out), READONLY,
     "allreduce() takes out-of-place calls below this many bytes (set_fast sets it)"},
    {"limit_in", T_LONGLONG, offsetof(Engine, limit_in), READONLY, "... and in-place ones below this"},
    {"seq", T_LONGLONG, offsetof(Engine, seq), 0, "the flight recorder's sequence number"},
    {"recording", T_INT, offsetof(Engine, recording), 0, "0: skip the recorder's stores"},
    {"checking", T_INT, offsetof(Engine, checking), 0,
     "0: calls carry no signature (set_signature turns it on)"},
    {"spin_ns", T_LONGLONG, offsetof(Engine, spin_ns), 0, "a wait spins this long first"},
    {"yield_ns", T_LONGLONG, offsetof(Engine, yield_ns), 0, "then spins or yields this long, then sleeps"},
    {"yield_always", T_INT, offsetof(Engine, yield_always), 0,
     "1: every wait yields after its spin (more ranks than CPUs)"},
    {"slept", T_LONGLONG, offsetof(Engine, slept), READONLY, "futex sleeps so far"},
    {"shared_waits", T_LONGLONG, offsetof(Engine, shared_waits), READONLY,
     "waits that yielded at once because the late rank last ran on this CPU"},
    {"epoch", T_LONGLONG, offsetof(Engine, epoch), READONLY, "steps so far"},
    {"cap", T_PYSSIZET, offsetof(Engine, cap), READONLY, "bytes per slot (one step)"},
    {"nt_mode", T_INT, offsetof(Engine, nt_mode), 0,
     "slot writes: -1 chosen per call by the rounds' time, 0 cached, 1 streaming"},
    {"nt_ns", T_LONGLONG, offsetof(Engine, nt_ns), 0, "a round slower than this streams"},
    {"nt_floor", T_LONGLONG, offsetof(Engine, nt_floor), 0, "calls from this many bytes choose"},
    {"nt_last_ns", T_LONGLONG, offsetof(Engine, nt_last_ns), READONLY,
     "the last timed call's fastest round (ns)"},
    {"nt_calls", T_LONGLONG, offsetof(Engine, nt_calls), READONLY, "calls that streamed so far"},
    {NULL, 0, 0, 0, NULL}};

static PyTypeObject EngineType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "collectives._fastshm.Engine",
    .tp_basicsize = sizeof(Engine),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Engine(me, n, addrs, cap, hdr, keep, fallback, empty_like, ndarray)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Engine_init,
    .tp_dealloc = (destructor)Engine_dealloc,
    .tp_traverse = (traverseproc)Engine_traverse,
    .tp_clear = (inquiry)Engine_clear,
    .tp_methods = Engine_methods,
    .tp_members = Engine_members,
    .tp_getset = Engine_getset,
};

/* same_items(a, b): whether two sequences hold the very same objects, in order (the
 * grouped_allreduce plan cache's check, on every call: a C loop of pointer compares, where
 * Python's all(map(operator.is_, a, b)) pays an interpreter step per array). */
static PyObject *same_items(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    (void)mod;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "same_items(a, b)");
        return NULL;
    }
    PyObject *a = PySequence_Fast(args[0], "same_items: a sequence");
    if (a == NULL) return NULL;
    PyObject *b = PySequence_Fast(args[1], "same_items: a sequence");
    if (b == NULL) { Py_DECREF(a); return NULL; }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(a);
    int same = n == PySequence_Fast_GET_SIZE(b);
    PyObject **x = PySequence_Fast_ITEMS(a), **y = PySequence_Fast_ITEMS(b);
    for (Py_ssize_t i = 0; same && i < n; i++)
        same = x[i] == y[i];
    Py_DECREF(a);
    Py_DECREF(b);
    return PyBool_FromLong(same);
}

static PyMethodDef module_methods[] = {
    {"same_items", (PyCFunction)(void (*)(void))same_items, METH_FASTCALL,
     "same_items(a, b) -> bool: the same objects, in the same order."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef fastshm_module = {
    PyModuleDef_HEAD_INIT, "_fastshm",
    "Compiled shared-memory allreduce and flight-recorder store (see _fastshm.c).", -1,
    module_methods};

PyMODINIT_FUNC PyInit__fastshm(void) {
    if (PyType_Ready(&EngineType) < 0)
        return NULL;
    s_sum = PyUnicode_InternFromString("sum");
    s_prod = PyUnicode_InternFromString("prod");
    s_min = PyUnicode_InternFromString("min");
    s_max = PyUnicode_InternFromString("max");
    s_avg = PyUnicode_InternFromString("avg");
    if (!s_sum || !s_prod || !s_min || !s_max || !s_avg)
        return NULL;
    PyObject *m = PyModule_Create(&fastshm_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&EngineType);
    if (PyModule_AddObject(m, "Engine", (PyObject *)&EngineType) < 0) {
        Py_DECREF(&EngineType);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "N_TYPES", N_TYPES);
    return m;
}
