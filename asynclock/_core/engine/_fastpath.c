/* The header round of asynclock.tiny in C: one call issues, spins and folds.
 *
 * Why: on the small-message path MPI itself takes ~2 us and the Python around
 * it (buffer writes, the Iallgather and Test calls through mpi4py, the header
 * compare, a numpy fold) another ~5 us; this does the same steps on the same
 * bytes in well under a microsecond. Built per MPI by asynclock/_core/engine/fastpath.py
 * with that MPI's compiler wrapper; without it the Python path runs.
 *
 * A Round holds one lane's send and receive slots and at most one request.
 * exchange() writes the header (sequence patched) and payload, starts
 * MPI_Iallgather, tests it until the spin deadline and, if every rank's header
 * equals ours, folds the payload rows into `out` in rank order (the numpy
 * fold's arithmetic: a left fold, wrapping integers). A round still in flight
 * is moved into an mpi4py Request by give(), so the engine finishes it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <mpi.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

enum { DONE_FOLDED = 0, DIFFERENT = 1, IN_FLIGHT = 2, DONE = 3 };
enum { F_NONE, F_F32_SUM, F_F64_SUM, F_I32_SUM, F_I64_SUM, F_F32_PROD, F_F64_PROD,
       F_I32_PROD, F_I64_PROD, F_I32_MIN, F_I64_MIN, F_I32_MAX, F_I64_MAX, F_LAST };

typedef struct {
    PyObject_HEAD
    MPI_Comm comm;
    MPI_Request req;
    char *send, *recv;
    Py_ssize_t slot, header, size;
} Round;

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

static int round_init(Round *self, PyObject *args, PyObject *kw) {
    unsigned long long comm_addr, send, recv;
    if (!PyArg_ParseTuple(args, "KKKnnn", &comm_addr, &send, &recv, &self->slot,
                          &self->header, &self->size))
        return -1;
    self->comm = *(MPI_Comm *)(uintptr_t)comm_addr;
    self->send = (char *)(uintptr_t)send;
    self->recv = (char *)(uintptr_t)recv;
    self->req = MPI_REQUEST_NULL;
    return 0;
}

#define FOLD(T, EXPR)                                                        \
    do {                                                                     \
        T *o = (T *)out;                                                     \
        memcpy(o, rows, (size_t)n * sizeof(T));                              \
        for (Py_ssize_t r = 1; r < size; r++) {                              \
            const T *x = (const T *)(rows + r * slot);                       \
            for (Py_ssize_t i = 0; i < n; i++) { T a = o[i], b = x[i]; o[i] = (EXPR); } \
        }                                                                    \
    } while (0)
#define WRAP(T, U, OP) ((T)((U)a OP (U)b))

static void fold(int kind, const char *rows, Py_ssize_t slot, Py_ssize_t size,
                 char *out, Py_ssize_t n) {
    switch (kind) {
    case F_F32_SUM: FOLD(float, a + b); break;
    case F_F64_SUM: FOLD(double, a + b); break;
    case F_I32_SUM: FOLD(int32_t, WRAP(int32_t, uint32_t, +)); break;
    case F_I64_SUM: FOLD(int64_t, WRAP(int64_t, uint64_t, +)); break;
    case F_F32_PROD: FOLD(float, a * b); break;
    case F_F64_PROD: FOLD(double, a * b); break;
    case F_I32_PROD: FOLD(int32_t, WRAP(int32_t, uint32_t, *)); break;
    case F_I64_PROD: FOLD(int64_t, WRAP(int64_t, uint64_t, *)); break;
    case F_I32_MIN: FOLD(int32_t, b < a ? b : a); break;
    case F_I64_MIN: FOLD(int64_t, b < a ? b : a); break;
    case F_I32_MAX: FOLD(int32_t, b > a ? b : a); break;
    case F_I64_MAX: FOLD(int64_t, b > a ? b : a); break;
    }
}

static int agreed(const Round *self) {
    for (Py_ssize_t r = 1; r < self->size; r++)
        if (memcmp(self->recv, self->recv + r * self->slot, (size_t)self->header))
            return 0;
    return 1;
}

static const int ITEM[F_LAST] = {0, 4, 8, 4, 8, 4, 8, 4, 8, 4, 8, 4, 8};

/* exchange(header, seq, data, spin_s, fold, out) -> DONE_FOLDED | DIFFERENT | IN_FLIGHT | DONE */
static PyObject *round_exchange(Round *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) return PyErr_Format(PyExc_TypeError, "exchange takes 6 arguments");
    if (self->req != MPI_REQUEST_NULL)
        return PyErr_Format(PyExc_RuntimeError, "a round is still in flight");
    char *hdr;
    Py_ssize_t hlen;
    if (PyBytes_AsStringAndSize(args[0], &hdr, &hlen) < 0) return NULL;
    long long seq = PyLong_AsLongLong(args[1]);
    double spin = PyFloat_AsDouble(args[3]);
    long kind = PyLong_AsLong(args[4]);
    if (PyErr_Occurred()) return NULL;
    if (hlen != self->header || kind < 0 || kind >= F_LAST)
        return PyErr_Format(PyExc_ValueError, "bad header or fold");
    memcpy(self->send, hdr, (size_t)hlen);
    memcpy(self->send + 8, &seq, 8);  /* W_SEQ */
    if (args[2] != Py_None) {
        Py_buffer data;
        if (PyObject_GetBuffer(args[2], &data, PyBUF_C_CONTIGUOUS) < 0) return NULL;
        if (data.len > self->slot - self->header) {
            PyBuffer_Release(&data);
            return PyErr_Format(PyExc_ValueError, "payload too big for a slot");
        }
        memcpy(self->send + self->header, data.buf, (size_t)data.len);
        PyBuffer_Release(&data);
    }
    double deadline = now() + spin;
    int rc = MPI_Iallgather(self->send, (int)self->slot, MPI_BYTE, self->recv, (int)self->slot,
                            MPI_BYTE, self->comm, &self->req);
    if (rc != MPI_SUCCESS) return mpi_error(rc, "MPI_Iallgather");
    int flag = 0;
    for (;;) {
        rc = MPI_Test(&self->req, &flag, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS) return mpi_error(rc, "MPI_Test");
        if (flag) break;
        if (now() >= deadline) return PyLong_FromLong(IN_FLIGHT);
    }
    if (!agreed(self)) return PyLong_FromLong(DIFFERENT);
    if (kind == F_NONE) return PyLong_FromLong(DONE);
    Py_buffer out;
    if (PyObject_GetBuffer(args[5], &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) return NULL;
    fold((int)kind, self->recv + self->header, self->slot, self->size, out.buf,
         out.len / ITEM[kind]);
    PyBuffer_Release(&out);
    return PyLong_FromLong(DONE_FOLDED);
}

/* give(request_addr): move the round in flight into an mpi4py Request's handle. */
static PyObject *round_give(Round *self, PyObject *arg) {
    unsigned long long addr = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) return NULL;
    *(MPI_Request *)(uintptr_t)addr = self->req;
    self->req = MPI_REQUEST_NULL;
    Py_RETURN_NONE;
}

static PyMethodDef round_methods[] = {
    {"exchange", (PyCFunction)(void (*)(void))round_exchange, METH_FASTCALL,
     "Issue the header round, spin, and fold when every rank agreed."},
    {"give", (PyCFunction)round_give, METH_O, "Move the request in flight to an mpi4py Request."},
    {NULL, NULL, 0, NULL}};

static PyTypeObject RoundType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "asynclock._fastpath.Round",
    .tp_basicsize = sizeof(Round),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One lane's header round: Round(comm_addr, send_addr, recv_addr, slot, header, size)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)round_init,
    .tp_methods = round_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastpath", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__fastpath(void) {
    if (PyType_Ready(&RoundType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&RoundType);
    if (PyModule_AddObject(m, "Round", (PyObject *)&RoundType) < 0) return NULL;
    PyModule_AddIntConstant(m, "DONE_FOLDED", DONE_FOLDED);
    PyModule_AddIntConstant(m, "DIFFERENT", DIFFERENT);
    PyModule_AddIntConstant(m, "IN_FLIGHT", IN_FLIGHT);
    PyModule_AddIntConstant(m, "DONE", DONE);
    return m;
}
