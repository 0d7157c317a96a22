/* The compact header round of engine.small_calls in C: one call issues, spins
 * and judges it.
 *
 * Why: on the small-message path MPI itself takes ~2 us, and the Python
 * around it (buffer writes, the Iallreduce and Test calls through mpi4py, the
 * verdict, a copy) costs several times that; this does the same steps on the
 * same bytes in well under a microsecond. Built per MPI by
 * asynclock/_core/engine/fastpath.py with that MPI's compiler wrapper;
 * without it the Python round (engine/header_round.py) runs.
 *
 * A CompactRound holds one lane's send and receive words and at most one
 * request. exchange() writes the call's fingerprint (its key mixed with the
 * sequence number), flags, fold code and inline payload, starts
 * MPI_Iallreduce of COMPACT_BYTES under `combine`, tests it until the spin
 * deadline and, when every rank agreed, copies the reduced payload into
 * `out`. `combine` is a non-commutative user op, so MPI applies it in rank
 * order: it ORs the fingerprint words and folds the inline payloads
 * (base/header.py's `combine` is its twin). A round still in flight is moved
 * into an mpi4py Request by give(), so the engine finishes it.
 * start_compact() issues the same reduction for the general path, so every
 * rank reduces with the same op.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <mpi.h>
#include <stdint.h>
#include <string.h>
#include <sched.h>
#include <time.h>

enum { DONE_FOLDED = 0, DIFFERENT = 1, IN_FLIGHT = 2, DONE = 3 };

/* More ranks than cores on this host: a spinning rank gives its core to a peer
 * between tests (header_round.yield_when_idle), or the peer it waits for may
 * not run before the spin ends. */
static int yield_idle = 0;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);  /* time.perf_counter's clock on Linux */
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static PyObject *mpi_error(int code, const char *what) {
    char text[MPI_MAX_ERROR_STRING];
    int n = 0;
    MPI_Error_string(code, text, &n);
    PyErr_Format(PyExc_RuntimeError, "%s: %.*s", what, n, text);
    return NULL;
}

#define WRAP(T, U, OP) ((T)((U)a OP (U)b))

/* -- the compact round --------------------------------------------------- */
enum { C_FP, C_NOT_FP, C_FLAGS, C_FOLD, C_HEAD };
enum { INLINE = 128, COMPACT_WORDS = C_HEAD + INLINE / 8, FOLD_BOR = 17, CONFLICT = -1 };

static MPI_Op compact_op = MPI_OP_NULL;
static MPI_Datatype compact_type = MPI_DATATYPE_NULL;

#define COMBINE(T, EXPR)                                                     \
    do {                                                                     \
        const T *x = (const T *)pa;                                          \
        T *o = (T *)pb;                                                      \
        for (size_t i = 0; i < INLINE / sizeof(T); i++) { T a = x[i], b = o[i]; o[i] = (EXPR); } \
    } while (0)
/* numpy's minimum/maximum: a NaN on either side wins */
#define FMIN(a, b) ((a) != (a) ? (a) : (b) != (b) ? (b) : ((b) < (a) ? (b) : (a)))
#define FMAX(a, b) ((a) != (a) ? (a) : (b) != (b) ? (b) : ((b) > (a) ? (b) : (a)))

/* inout = in (the lower ranks) with inout; the fold codes are header.FOLDS's */
static void combine(void *in, void *inout, int *len, MPI_Datatype *type) {
    for (int e = 0; e < *len; e++) {
        const int64_t *a = (const int64_t *)in + (size_t)e * COMPACT_WORDS;
        int64_t *b = (int64_t *)inout + (size_t)e * COMPACT_WORDS;
        b[C_FP] |= a[C_FP];
        b[C_NOT_FP] |= a[C_NOT_FP];
        b[C_FLAGS] |= a[C_FLAGS];
        if (a[C_FOLD] != b[C_FOLD]) { b[C_FOLD] = CONFLICT; continue; }
        const char *pa = (const char *)(a + C_HEAD);
        char *pb = (char *)(b + C_HEAD);
        switch (b[C_FOLD]) {
        case 1: COMBINE(float, a + b); break;
        case 2: COMBINE(double, a + b); break;
        case 3: COMBINE(int32_t, WRAP(int32_t, uint32_t, +)); break;
        case 4: COMBINE(int64_t, WRAP(int64_t, uint64_t, +)); break;
        case 5: COMBINE(float, a * b); break;
        case 6: COMBINE(double, a * b); break;
        case 7: COMBINE(int32_t, WRAP(int32_t, uint32_t, *)); break;
        case 8: COMBINE(int64_t, WRAP(int64_t, uint64_t, *)); break;
        case 9: COMBINE(float, FMIN(a, b)); break;
        case 10: COMBINE(double, FMIN(a, b)); break;
        case 11: COMBINE(int32_t, b < a ? b : a); break;
        case 12: COMBINE(int64_t, b < a ? b : a); break;
        case 13: COMBINE(float, FMAX(a, b)); break;
        case 14: COMBINE(double, FMAX(a, b)); break;
        case 15: COMBINE(int32_t, b > a ? b : a); break;
        case 16: COMBINE(int64_t, b > a ? b : a); break;
        case FOLD_BOR: COMBINE(uint64_t, a | b); break;
        }
    }
}

static int compact_ready(void) {
    if (compact_op != MPI_OP_NULL) return MPI_SUCCESS;
    int rc = MPI_Type_contiguous(COMPACT_WORDS * 8, MPI_BYTE, &compact_type);
    if (rc == MPI_SUCCESS) rc = MPI_Type_commit(&compact_type);
    if (rc == MPI_SUCCESS) rc = MPI_Op_create(combine, 0 /* not commutative */, &compact_op);
    return rc;
}

static uint64_t splitmix(uint64_t z) {  /* header.fingerprint's mix */
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

typedef struct {
    PyObject_HEAD
    MPI_Comm comm;
    MPI_Request req;
    int64_t *send, *recv;
} CompactRound;

static int compact_init(CompactRound *self, PyObject *args, PyObject *kw) {
    unsigned long long comm_addr, send, recv;
    if (!PyArg_ParseTuple(args, "KKK", &comm_addr, &send, &recv)) return -1;
    int rc = compact_ready();
    if (rc != MPI_SUCCESS) { mpi_error(rc, "the compact round's MPI op"); return -1; }
    self->comm = *(MPI_Comm *)(uintptr_t)comm_addr;
    self->send = (int64_t *)(uintptr_t)send;
    self->recv = (int64_t *)(uintptr_t)recv;
    self->req = MPI_REQUEST_NULL;
    return 0;
}

/* exchange(key, seq, data, spin_s, copy, out) -> DONE_FOLDED | DIFFERENT | IN_FLIGHT | DONE
 * key: 16 bytes, the call's fingerprint key and fold code; copy: nonzero to copy the
 * reduced payload into `out` once every rank agreed. */
static PyObject *compact_exchange(CompactRound *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) return PyErr_Format(PyExc_TypeError, "exchange takes 6 arguments");
    if (self->req != MPI_REQUEST_NULL)
        return PyErr_Format(PyExc_RuntimeError, "a round is still in flight");
    char *key;
    Py_ssize_t klen;
    if (PyBytes_AsStringAndSize(args[0], &key, &klen) < 0) return NULL;
    long long seq = PyLong_AsLongLong(args[1]);
    double spin = PyFloat_AsDouble(args[3]);
    long copy = PyLong_AsLong(args[4]);
    if (PyErr_Occurred()) return NULL;
    if (klen != 16) return PyErr_Format(PyExc_ValueError, "bad compact key");
    int64_t h, fold;
    memcpy(&h, key, 8);
    memcpy(&fold, key + 8, 8);
    int64_t *s = self->send;
    uint64_t fp = splitmix((uint64_t)h ^ (uint64_t)seq);
    s[C_FP] = (int64_t)fp;
    s[C_NOT_FP] = (int64_t)~fp;
    s[C_FLAGS] = 0;
    s[C_FOLD] = fold;
    if (args[2] != Py_None) {
        Py_buffer data;
        if (PyObject_GetBuffer(args[2], &data, PyBUF_C_CONTIGUOUS) < 0) return NULL;
        if (data.len > INLINE) {
            PyBuffer_Release(&data);
            return PyErr_Format(PyExc_ValueError, "payload too big for a slot");
        }
        memcpy(s + C_HEAD, data.buf, (size_t)data.len);
        PyBuffer_Release(&data);
    } else {
        memset(s + C_HEAD, 0, INLINE);  /* a broadcast's non-root: OR with zeros */
    }
    double deadline = now() + spin;
    int rc = MPI_Iallreduce(s, self->recv, 1, compact_type, compact_op, self->comm, &self->req);
    if (rc != MPI_SUCCESS) return mpi_error(rc, "MPI_Iallreduce");
    int flag = 0;
    for (;;) {
        rc = MPI_Test(&self->req, &flag, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS) return mpi_error(rc, "MPI_Test");
        if (flag) break;
        if (now() >= deadline) return PyLong_FromLong(IN_FLIGHT);
        if (yield_idle) sched_yield();
    }
    const int64_t *r = self->recv;
    if ((r[C_FP] & r[C_NOT_FP]) || r[C_FLAGS] || r[C_FOLD] != fold)
        return PyLong_FromLong(DIFFERENT);
    if (!copy) return PyLong_FromLong(DONE);
    Py_buffer out;
    if (PyObject_GetBuffer(args[5], &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) return NULL;
    memcpy(out.buf, r + C_HEAD, (size_t)(out.len < INLINE ? out.len : INLINE));
    PyBuffer_Release(&out);
    return PyLong_FromLong(DONE_FOLDED);
}

static PyObject *compact_give(CompactRound *self, PyObject *arg) {
    unsigned long long addr = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) return NULL;
    *(MPI_Request *)(uintptr_t)addr = self->req;
    self->req = MPI_REQUEST_NULL;
    Py_RETURN_NONE;
}

/* start_compact(comm_addr, send_addr, recv_addr, request_addr): the general path's
 * compact round, with this module's op, into an mpi4py Request's handle. */
static PyObject *start_compact(PyObject *module, PyObject *args) {
    unsigned long long comm_addr, send, recv, req;
    if (!PyArg_ParseTuple(args, "KKKK", &comm_addr, &send, &recv, &req)) return NULL;
    int rc = compact_ready();
    if (rc == MPI_SUCCESS)
        rc = MPI_Iallreduce((void *)(uintptr_t)send, (void *)(uintptr_t)recv, 1, compact_type,
                            compact_op, *(MPI_Comm *)(uintptr_t)comm_addr,
                            (MPI_Request *)(uintptr_t)req);
    if (rc != MPI_SUCCESS) return mpi_error(rc, "MPI_Iallreduce");
    Py_RETURN_NONE;
}

static PyMethodDef compact_methods[] = {
    {"exchange", (PyCFunction)(void (*)(void))compact_exchange, METH_FASTCALL,
     "Issue the compact round, spin, and copy the reduced payload when every rank agreed."},
    {"give", (PyCFunction)compact_give, METH_O, "Move the request in flight to an mpi4py Request."},
    {NULL, NULL, 0, NULL}};

static PyTypeObject CompactRoundType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "asynclock._fastpath.CompactRound",
    .tp_basicsize = sizeof(CompactRound),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One lane's compact round: CompactRound(comm_addr, send_addr, recv_addr)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)compact_init,
    .tp_methods = compact_methods,
};

static PyObject *set_yield(PyObject *module, PyObject *arg) {
    yield_idle = PyObject_IsTrue(arg);
    Py_RETURN_NONE;
}

static PyMethodDef module_functions[] = {
    {"set_yield", set_yield, METH_O, "Yield the core between tests of a spin (oversubscribed)."},
    {"start_compact", start_compact, METH_VARARGS, "Issue a compact round (general path)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastpath", NULL, -1,
                                    module_functions};

PyMODINIT_FUNC PyInit__fastpath(void) {
    if (PyType_Ready(&CompactRoundType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&CompactRoundType);
    if (PyModule_AddObject(m, "CompactRound", (PyObject *)&CompactRoundType) < 0) return NULL;
    PyModule_AddIntConstant(m, "DONE_FOLDED", DONE_FOLDED);
    PyModule_AddIntConstant(m, "DIFFERENT", DIFFERENT);
    PyModule_AddIntConstant(m, "IN_FLIGHT", IN_FLIGHT);
    PyModule_AddIntConstant(m, "DONE", DONE);
    return m;
}
