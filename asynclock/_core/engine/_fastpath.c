/* The small-message path of engine.small_calls in C, in five parts:
 * - CompactRound: the compact header round over MPI; one call issues, spins
 *   and judges it;
 * - NodeRound, NodeCompactRound, NodeRequest: the same round through the
 *   node's shared memory, where every rank of a channel is on one node;
 * - HotAllreduce: a small allreduce of an armed signature, from its checks to
 *   its fold;
 * - NodeData, NodeDataRequest: mid-size allreduces' data through the node's
 *   shared memory, where every rank of a channel is on one node;
 * - WindowSteps, WindowRequest: the steps of a node window allreduce that the
 *   loop polls (transports.node_window).
 *
 * Why: on the small-message path the Python around MPI (buffer writes, the
 * Iallreduce and Test calls through mpi4py, the verdict, a copy) costs
 * several times MPI's own part; this does the same steps on the same bytes
 * (figures: the benchmarks page). Built per MPI by
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
#include <structmember.h>
#include <mpi.h>
#include <stdint.h>
#include <string.h>
#include <sched.h>
#include <limits.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include <time.h>

enum { DONE_FOLDED = 0, DIFFERENT = 1, IN_FLIGHT = 2, DONE = 3 };

static PyObject *round_exchange(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

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

/* Write this rank's part of a compact round into `s`: the fingerprint of the call
 * `key` (16 bytes: fingerprint key, fold code) names at `seq`, the fold code and the
 * inline payload (NULL: zeros, a broadcast's non-root, OR'ed with the root's bytes).
 * Returns the fold code. */
static int64_t fill_words(int64_t *s, const char *key, long long seq, const void *data,
                          size_t len) {
    int64_t h, fold;
    memcpy(&h, key, 8);
    memcpy(&fold, key + 8, 8);
    uint64_t fp = splitmix((uint64_t)h ^ (uint64_t)seq);
    s[C_FP] = (int64_t)fp;
    s[C_NOT_FP] = (int64_t)~fp;
    s[C_FLAGS] = 0;
    s[C_FOLD] = fold;
    if (data != NULL) memcpy(s + C_HEAD, data, len);
    else memset(s + C_HEAD, 0, INLINE);
    return fold;
}

/* The verdict on a finished round's reduced words `r`; when every rank agreed and `out`
 * is given, the reduced payload is copied into it (DONE_FOLDED). */
static int judge(const int64_t *r, int64_t fold, void *out, size_t len) {
    if ((r[C_FP] & r[C_NOT_FP]) || r[C_FLAGS] || r[C_FOLD] != fold) return DIFFERENT;
    if (out == NULL) return DONE;
    memcpy(out, r + C_HEAD, len < INLINE ? len : INLINE);
    return DONE_FOLDED;
}

/* Start the round whose words are in self->send and spin on it until `spin` seconds
 * pass: DONE (reduced words in self->recv), IN_FLIGHT, or -1 with an error set. */
static int compact_run(CompactRound *self, double spin) {
    double deadline = now() + spin;
    int rc = MPI_Iallreduce(self->send, self->recv, 1, compact_type, compact_op, self->comm,
                            &self->req);
    if (rc != MPI_SUCCESS) { mpi_error(rc, "MPI_Iallreduce"); return -1; }
    int flag = 0;
    for (;;) {
        rc = MPI_Test(&self->req, &flag, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS) { mpi_error(rc, "MPI_Test"); return -1; }
        if (flag) return DONE;
        if (now() >= deadline) return IN_FLIGHT;
        if (yield_idle) sched_yield();
    }
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
    {"exchange", (PyCFunction)(void (*)(void))round_exchange, METH_FASTCALL,
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

/* -- the compact round through the node's shared memory --------------------
 * Where every rank of a channel is on one node, a compact round needs no MPI
 * message: each rank writes its words into its record of a shared segment,
 * reads every rank's record and folds them itself with `combine`, in rank
 * order. Every rank folds the same bytes in the same order, so all get the
 * same bits and the same verdict. MPI's non-blocking allreduce, even at two
 * ranks on one node, costs more than the rest of a small call (figures: the
 * benchmarks page); a round here is a few cache lines moving between cores.
 *
 * The segment (transports/node_segment.py makes it, zeroed): `depth` records
 * per rank, each REC_BYTES: the number of the round written last (0: none),
 * then COMPACT_WORDS words; after them, per rank, `depth` acks: the number of
 * the round this rank last read from each record index. Round k (numbered from
 * 1 on every rank, since every rank starts compact rounds in the same order)
 * uses record index k % depth. A rank writes round k only once every rank has
 * acked round k - depth there, so no record is overwritten before all have
 * read it; until then the round stays unwritten and its request tests false.
 * A record's words are written before its round number is stored (release)
 * and read after it is loaded (acquire); an ack is stored after the reads.
 */
enum { REC_BYTES = 192 };  /* 8 + COMPACT_BYTES, rounded up to whole cache lines */

typedef struct {
    PyObject_HEAD
    char *base;
    int rank, size;
    int64_t depth;
    int64_t rounds;  /* compact rounds started on this rank, by either path */
    PyObject *owner;  /* keeps the mapping alive */
} NodeRound;

static int64_t *node_record(const NodeRound *n, int rank, int64_t k) {
    return (int64_t *)(n->base + ((size_t)rank * (size_t)n->depth + (size_t)(k % n->depth))
                                     * REC_BYTES);
}

static int64_t *node_ack(const NodeRound *n, int rank, int64_t k) {
    int64_t *acks = (int64_t *)(n->base + (size_t)n->size * (size_t)n->depth * REC_BYTES);
    return acks + (size_t)rank * (size_t)n->depth + (size_t)(k % n->depth);
}

/* Move round k on: write it once its record is free, then fold it into `recv`
 * once every rank's words are there. 1: finished. */
static int node_step(const NodeRound *n, int64_t k, const int64_t *send, int64_t *recv,
                     int *written) {
    if (!*written) {
        if (k > n->depth)
            for (int p = 0; p < n->size; p++)
                if (__atomic_load_n(node_ack(n, p, k), __ATOMIC_ACQUIRE) < k - n->depth)
                    return 0;
        int64_t *mine = node_record(n, n->rank, k);
        memcpy(mine + 1, send, COMPACT_WORDS * 8);
        __atomic_store_n(mine, k, __ATOMIC_RELEASE);
        *written = 1;
    }
    for (int p = 0; p < n->size; p++)
        if (__atomic_load_n(node_record(n, p, k), __ATOMIC_ACQUIRE) != k) return 0;
    int64_t lower[COMPACT_WORDS];
    int one = 1;
    memcpy(recv, node_record(n, 0, k) + 1, COMPACT_WORDS * 8);
    for (int p = 1; p < n->size; p++) {  /* recv = recv (ranks < p) with rank p */
        memcpy(lower, recv, COMPACT_WORDS * 8);
        memcpy(recv, node_record(n, p, k) + 1, COMPACT_WORDS * 8);
        combine(lower, recv, &one, &compact_type);
    }
    __atomic_store_n(node_ack(n, n->rank, k), k, __ATOMIC_RELEASE);
    return 1;
}

static int node_round_init(NodeRound *self, PyObject *args, PyObject *kw) {
    unsigned long long base, nbytes;
    int rank, size;
    long long depth;
    PyObject *owner;
    if (!PyArg_ParseTuple(args, "KKiiLO", &base, &nbytes, &rank, &size, &depth, &owner))
        return -1;
    if (size < 1 || rank < 0 || rank >= size || depth < 2
            || nbytes < (unsigned long long)size * (unsigned long long)depth * (REC_BYTES + 8)) {
        PyErr_Format(PyExc_ValueError, "a node round segment too small for %d ranks", size);
        return -1;
    }
    self->base = (char *)(uintptr_t)base;
    self->rank = rank;
    self->size = size;
    self->depth = depth;
    self->rounds = 0;
    Py_INCREF(owner);
    Py_XSETREF(self->owner, owner);
    return 0;
}

static void node_round_dealloc(NodeRound *self) {
    Py_CLEAR(self->owner);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* A request for one round: what the engine tests (`Test()`), like an MPI request. */
typedef struct {
    PyObject_HEAD
    NodeRound *node;
    int64_t k;
    int written, done;
    int64_t *send, *recv;
    PyObject *send_obj, *recv_obj;  /* the arrays behind send and recv */
} NodeRequest;

static PyTypeObject NodeRequestType;

static int words_of(PyObject *obj, int64_t **words) {
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) return -1;
    Py_ssize_t len = view.len;
    *words = (int64_t *)view.buf;
    PyBuffer_Release(&view);  /* the array object, held by the caller, keeps the memory */
    if (len < COMPACT_WORDS * 8) {
        PyErr_Format(PyExc_ValueError, "a compact buffer needs %d bytes", COMPACT_WORDS * 8);
        return -1;
    }
    return 0;
}

static NodeRequest *node_request(NodeRound *node, int64_t k, int written, PyObject *send,
                                 PyObject *recv) {
    NodeRequest *req = PyObject_New(NodeRequest, &NodeRequestType);
    if (req == NULL) return NULL;
    req->node = node;
    Py_INCREF(node);
    req->k = k;
    req->written = written;
    req->done = 0;
    req->send_obj = send;
    req->recv_obj = recv;
    Py_INCREF(send);
    Py_INCREF(recv);
    if (words_of(send, &req->send) < 0 || words_of(recv, &req->recv) < 0) {
        Py_DECREF(req);
        return NULL;
    }
    return req;
}

static void node_request_dealloc(NodeRequest *self) {
    Py_CLEAR(self->node);
    Py_CLEAR(self->send_obj);
    Py_CLEAR(self->recv_obj);
    PyObject_Free(self);
}

static PyObject *node_request_test(NodeRequest *self, PyObject *unused) {
    if (!self->done)
        self->done = node_step(self->node, self->k, self->send, self->recv, &self->written);
    return PyBool_FromLong(self->done);
}

static PyMethodDef node_request_methods[] = {
    {"Test", (PyCFunction)node_request_test, METH_NOARGS, "True once the round finished."},
    {NULL, NULL, 0, NULL}};

static PyTypeObject NodeRequestType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "asynclock._fastpath.NodeRequest",
    .tp_basicsize = sizeof(NodeRequest),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One compact round through the node's shared memory, until it finishes.",
    .tp_dealloc = (destructor)node_request_dealloc,
    .tp_methods = node_request_methods,
};

/* start(send, recv) -> NodeRequest: the general path's compact round; it is
 * written at once where its record is free. */
static PyObject *node_round_start(NodeRound *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) return PyErr_Format(PyExc_TypeError, "start takes 2 arguments");
    NodeRequest *req = node_request(self, ++self->rounds, 0, args[0], args[1]);
    if (req == NULL) return NULL;
    req->done = node_step(self, req->k, req->send, req->recv, &req->written);
    return (PyObject *)req;
}

static PyMethodDef node_round_methods[] = {
    {"start", (PyCFunction)(void (*)(void))node_round_start, METH_FASTCALL,
     "Start the next compact round from `send`; its request folds into `recv`."},
    {NULL, NULL, 0, NULL}};

static PyTypeObject NodeRoundType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "asynclock._fastpath.NodeRound",
    .tp_basicsize = sizeof(NodeRound),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One channel's compact rounds through node shared memory: "
              "NodeRound(address, nbytes, rank, size, depth, owner)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)node_round_init,
    .tp_dealloc = (destructor)node_round_dealloc,
    .tp_methods = node_round_methods,
};

/* The small-call path's round on a NodeRound: CompactRound's twin, same states. */
typedef struct {
    PyObject_HEAD
    NodeRound *node;
    PyObject *send_obj, *recv_obj;
    int64_t *send, *recv;
    int64_t k;  /* the round left in flight by the last exchange (0: none) */
    int written;
} NodeCompactRound;

static int node_compact_init(NodeCompactRound *self, PyObject *args, PyObject *kw) {
    PyObject *node, *send, *recv;
    if (!PyArg_ParseTuple(args, "O!OO", &NodeRoundType, &node, &send, &recv)) return -1;
    if (words_of(send, &self->send) < 0 || words_of(recv, &self->recv) < 0) return -1;
    Py_INCREF(node);
    Py_XSETREF(self->node, (NodeRound *)node);
    Py_INCREF(send);
    Py_XSETREF(self->send_obj, send);
    Py_INCREF(recv);
    Py_XSETREF(self->recv_obj, recv);
    self->k = 0;
    return 0;
}

static void node_compact_dealloc(NodeCompactRound *self) {
    Py_CLEAR(self->node);
    Py_CLEAR(self->send_obj);
    Py_CLEAR(self->recv_obj);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* compact_run's twin on the node's records. */
static int node_run(NodeCompactRound *self, double spin) {
    NodeRound *node = self->node;
    int64_t k = ++node->rounds;
    int written = 0;
    if (node_step(node, k, self->send, self->recv, &written)) return DONE;
    double deadline = now() + spin;
    for (;;) {
        if (yield_idle) sched_yield();
        if (node_step(node, k, self->send, self->recv, &written)) return DONE;
        if (now() >= deadline) {
            self->k = k;
            self->written = written;
            return IN_FLIGHT;
        }
    }
}

/* give() -> NodeRequest: the round left in flight, for the engine to finish. */
static PyObject *node_compact_give(NodeCompactRound *self, PyObject *unused) {
    if (!self->k) return PyErr_Format(PyExc_RuntimeError, "no round in flight");
    NodeRequest *req = node_request(self->node, self->k, self->written, self->send_obj,
                                    self->recv_obj);
    self->k = 0;
    return (PyObject *)req;
}

static PyMethodDef node_compact_methods[] = {
    {"exchange", (PyCFunction)(void (*)(void))round_exchange, METH_FASTCALL,
     "Start the next compact round, spin, and copy the reduced payload when every rank "
     "agreed."},
    {"give", (PyCFunction)node_compact_give, METH_NOARGS,
     "The round in flight, as a request the engine tests."},
    {NULL, NULL, 0, NULL}};

static PyTypeObject NodeCompactRoundType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "asynclock._fastpath.NodeCompactRound",
    .tp_basicsize = sizeof(NodeCompactRound),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The small-call path's round on a NodeRound: NodeCompactRound(node, send, recv)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)node_compact_init,
    .tp_dealloc = (destructor)node_compact_dealloc,
    .tp_methods = node_compact_methods,
};

/* -- mid-size allreduces through the node's shared memory -----------------
 * Where every rank of a channel is on one node, an allreduce too big to ride in
 * the compact round but under the bulk size need not go through MPI either: a
 * non-blocking MPI allreduce costs markedly more than the copies it makes there
 * (Open MPI's libnbc most; figures: the benchmarks page). A NodeData segment
 * holds `depth` records per rank, each a 64-byte head (the number of the data
 * round written last, 0: none) and `slot` bytes of payload; after them, per
 * rank, `depth` acks (the round this rank last read from each record index),
 * as a NodeRound's. Round k (numbered from 1 on every rank: a channel's data
 * stages are issued in the same order everywhere, and whether one comes here
 * is decided from its agreed size, dtype and op) uses record index k % depth.
 * A rank copies its input into its record once every rank has read round
 * k - depth there, publishes k (a full fence first: large copies may be
 * non-temporal stores), and once every rank's record holds round k, folds all
 * of them in rank order into its output, as numpy's rank-order fold does; every
 * rank folds the same bytes in the same order, so all get the same bits. It then
 * acks k. Each step is a test that never blocks: the engine polls the request.
 */
typedef struct {
    PyObject_HEAD
    char *base;
    int rank, size;
    int64_t depth, slot;
    int64_t rounds;  /* data rounds started on this rank */
    PyObject *owner;  /* keeps the mapping alive */
} NodeData;

enum { DATA_HEAD = 64 };

static int64_t *data_record(const NodeData *n, int rank, int64_t k) {
    return (int64_t *)(n->base + ((size_t)rank * (size_t)n->depth + (size_t)(k % n->depth))
                                     * (size_t)(DATA_HEAD + n->slot));
}

static int64_t *data_ack(const NodeData *n, int rank, int64_t k) {
    int64_t *acks = (int64_t *)(n->base + (size_t)n->size * (size_t)n->depth
                                              * (size_t)(DATA_HEAD + n->slot));
    return acks + (size_t)rank * (size_t)n->depth + (size_t)(k % n->depth);
}

#define FOLD2(T, EXPR)                                                      \
    do {                                                                    \
        const T *x = (const T *)pa, *y = (const T *)pb;                     \
        T *o = (T *)po;                                                     \
        size_t cnt = len / sizeof(T);                                       \
        for (size_t i = 0; i < cnt; i++) { T a = x[i], b = y[i]; o[i] = (EXPR); } \
    } while (0)

/* The folds run over up to the whole slot: vectorised, which the build's -O2 leaves out. */
#if defined(__GNUC__) && !defined(__clang__)
#define VECTORISED __attribute__((optimize("O3")))
#else
#define VECTORISED
#endif

/* po = pa (the lower ranks) with pb, elementwise; the fold codes are header.FOLDS's,
 * with `combine`'s arithmetic. 0, or -1 for a code it does not know. */
static VECTORISED int fold_pair(int fold, const void *pa, const void *pb, void *po, size_t len) {
    switch (fold) {
    case 1: FOLD2(float, a + b); break;
    case 2: FOLD2(double, a + b); break;
    case 3: FOLD2(int32_t, WRAP(int32_t, uint32_t, +)); break;
    case 4: FOLD2(int64_t, WRAP(int64_t, uint64_t, +)); break;
    case 5: FOLD2(float, a * b); break;
    case 6: FOLD2(double, a * b); break;
    case 7: FOLD2(int32_t, WRAP(int32_t, uint32_t, *)); break;
    case 8: FOLD2(int64_t, WRAP(int64_t, uint64_t, *)); break;
    case 9: FOLD2(float, FMIN(a, b)); break;
    case 10: FOLD2(double, FMIN(a, b)); break;
    case 11: FOLD2(int32_t, b < a ? b : a); break;
    case 12: FOLD2(int64_t, b < a ? b : a); break;
    case 13: FOLD2(float, FMAX(a, b)); break;
    case 14: FOLD2(double, FMAX(a, b)); break;
    case 15: FOLD2(int32_t, b > a ? b : a); break;
    case 16: FOLD2(int64_t, b > a ? b : a); break;
    default: return -1;
    }
    return 0;
}

typedef struct {
    PyObject_HEAD
    NodeData *node;
    int64_t k;
    int written, done, fold;
    const char *src;
    char *out;
    size_t nbytes;
    PyObject *src_obj, *out_obj;  /* the arrays behind src and out */
} NodeDataRequest;

static PyTypeObject NodeDataRequestType;

/* Move data round k on: write it once its record is free, then fold every rank's
 * record into `out` once all are there. 1: finished. */
static int data_step(NodeDataRequest *r) {
    const NodeData *n = r->node;
    int64_t k = r->k;
    if (!r->written) {
        if (k > n->depth)
            for (int p = 0; p < n->size; p++)
                if (__atomic_load_n(data_ack(n, p, k), __ATOMIC_ACQUIRE) < k - n->depth)
                    return 0;
        int64_t *mine = data_record(n, n->rank, k);
        memcpy((char *)mine + DATA_HEAD, r->src, r->nbytes);
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        __atomic_store_n(mine, k, __ATOMIC_RELEASE);
        r->written = 1;
    }
    for (int p = 0; p < n->size; p++)
        if (__atomic_load_n(data_record(n, p, k), __ATOMIC_ACQUIRE) != k) return 0;
    const char *first = (const char *)data_record(n, 0, k) + DATA_HEAD;
    if (n->size == 1) {
        memcpy(r->out, first, r->nbytes);
    } else {
        fold_pair(r->fold, first, (const char *)data_record(n, 1, k) + DATA_HEAD, r->out,
                  r->nbytes);
        for (int p = 2; p < n->size; p++)
            fold_pair(r->fold, r->out, (const char *)data_record(n, p, k) + DATA_HEAD, r->out,
                      r->nbytes);
    }
    __atomic_store_n(data_ack(n, n->rank, k), k, __ATOMIC_RELEASE);
    return 1;
}

static int node_data_init(NodeData *self, PyObject *args, PyObject *kw) {
    unsigned long long base, nbytes;
    int rank, size;
    long long depth, slot;
    PyObject *owner;
    if (!PyArg_ParseTuple(args, "KKiiLLO", &base, &nbytes, &rank, &size, &depth, &slot,
                          &owner))
        return -1;
    if (size < 1 || rank < 0 || rank >= size || depth < 2 || slot < 64 || slot % 64
            || nbytes < (unsigned long long)size * (unsigned long long)depth
                            * (unsigned long long)(DATA_HEAD + slot + 8)) {
        PyErr_Format(PyExc_ValueError, "a node data segment too small for %d ranks", size);
        return -1;
    }
    self->base = (char *)(uintptr_t)base;
    self->rank = rank;
    self->size = size;
    self->depth = depth;
    self->slot = slot;
    self->rounds = 0;
    Py_INCREF(owner);
    Py_XSETREF(self->owner, owner);
    return 0;
}

static void node_data_dealloc(NodeData *self) {
    Py_CLEAR(self->owner);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The memory of a C-contiguous buffer (writable if asked); the object keeps it. */
static int memory_of(PyObject *obj, int writable, char **ptr, Py_ssize_t *len) {
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0))
            < 0)
        return -1;
    *ptr = (char *)view.buf;
    *len = view.len;
    PyBuffer_Release(&view);
    return 0;
}

/* start(src, out, fold) -> NodeDataRequest: the channel's next data round, `src`
 * folded with every rank's into `out` (the same length; `src` may be `out`). */
static PyObject *node_data_start(NodeData *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) return PyErr_Format(PyExc_TypeError, "start takes 3 arguments");
    long fold = PyLong_AsLong(args[2]);
    if (fold == -1 && PyErr_Occurred()) return NULL;
    char *src, *out;
    Py_ssize_t slen, olen;
    if (memory_of(args[0], 0, &src, &slen) < 0 || memory_of(args[1], 1, &out, &olen) < 0)
        return NULL;
    char probe[8] = {0};
    if (slen != olen || slen > self->slot || fold_pair((int)fold, probe, probe, probe, 0) < 0)
        return PyErr_Format(PyExc_ValueError, "not a call for the node's data rounds");
    NodeDataRequest *req = PyObject_New(NodeDataRequest, &NodeDataRequestType);
    if (req == NULL) return NULL;
    Py_INCREF(self);
    req->node = self;
    req->k = ++self->rounds;
    req->written = req->done = 0;
    req->fold = (int)fold;
    req->src = src;
    req->out = out;
    req->nbytes = (size_t)slen;
    Py_INCREF(args[0]);
    req->src_obj = args[0];
    Py_INCREF(args[1]);
    req->out_obj = args[1];
    req->done = data_step(req);
    return (PyObject *)req;
}

static PyMethodDef node_data_methods[] = {
    {"start", (PyCFunction)(void (*)(void))node_data_start, METH_FASTCALL,
     "Start the next data round: fold `src` with every rank's into `out`."},
    {NULL, NULL, 0, NULL}};

static PyMemberDef node_data_members[] = {
    {"slot", T_LONGLONG, offsetof(NodeData, slot), READONLY, "the most bytes a round takes"},
    {"rounds", T_LONGLONG, offsetof(NodeData, rounds), READONLY, "data rounds started here"},
    {NULL, 0, 0, 0, NULL}};

static PyTypeObject NodeDataType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "asynclock._fastpath.NodeData",
    .tp_basicsize = sizeof(NodeData),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One channel's mid-size allreduces through node shared memory: "
              "NodeData(address, nbytes, rank, size, depth, slot, owner)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)node_data_init,
    .tp_dealloc = (destructor)node_data_dealloc,
    .tp_methods = node_data_methods,
    .tp_members = node_data_members,
};

static void node_data_request_dealloc(NodeDataRequest *self) {
    Py_CLEAR(self->node);
    Py_CLEAR(self->src_obj);
    Py_CLEAR(self->out_obj);
    PyObject_Free(self);
}

static PyObject *node_data_request_test(NodeDataRequest *self, PyObject *unused) {
    if (!self->done) self->done = data_step(self);
    return PyBool_FromLong(self->done);
}

static PyMethodDef node_data_request_methods[] = {
    {"Test", (PyCFunction)node_data_request_test, METH_NOARGS, "True once the round finished."},
    {NULL, NULL, 0, NULL}};

static PyTypeObject NodeDataRequestType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "asynclock._fastpath.NodeDataRequest",
    .tp_basicsize = sizeof(NodeDataRequest),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One data round through the node's shared memory, until it finishes.",
    .tp_dealloc = (destructor)node_data_request_dealloc,
    .tp_methods = node_data_request_methods,
};

/* -- the node window's allreduce steps on the loop (transports.node_window) --
 * A mid-size allreduce that a caller awaits on one node runs through the node
 * window as a request the loop polls (node_window.LoopAllreduce): three data
 * steps, each behind every rank's progress counter. In Python each test costs
 * several MPI_Win_sync calls through mpi4py and a dozen small numpy calls, a
 * large share of a 1-4 MiB allreduce; WindowSteps does the same steps on the
 * same window, counters and bells (shared_window's layout and discipline), so
 * ranks on either path interoperate within one allreduce.
 *
 * Layout per local rank q, as shared_window.py defines it and hands it over: a
 * control block at bases[q] (int64 counters from its start, ABORTED first; the
 * 32-bit bell and the sleepers word at the offsets given), its region `region`
 * bytes after it. The counters the steps wait for and publish are
 * node_window.py's (ARRIVED, REDUCED, LEFT). A counter is stored between two
 * full fences and read between two, as shared_window.publish and least do with
 * MPI_Win_sync, which on x86-64 is such a fence.
 */
enum { W_ABORTED = 0, W_ARRIVED = 1, W_REDUCED = 2, W_LEFT = 3 };

typedef struct {
    PyObject_HEAD
    char **bases;  /* every local rank's control block */
    int rank, size;
    Py_ssize_t region;  /* offset of a region from its control block */
    Py_ssize_t bell, sleepers;  /* offsets of the bell and the sleepers word in it */
    Py_ssize_t region_bytes;
    uint32_t writer;  /* this rank's bell writer code (shared_window's PEER writer) */
    PyObject *rings;  /* shared_window's count for that writer: one sequence for both paths */
    PyObject *owner;  /* keeps the window's memory mapped */
} WindowSteps;

typedef struct {
    PyObject_HEAD
    WindowSteps *win;
    int64_t epoch;
    int step, fold;
    size_t esize, items;
    const char *src;
    char *out;
    PyObject *src_obj, *out_obj;
} WindowRequest;

static PyTypeObject WindowRequestType;

static volatile int64_t *win_counter(const WindowSteps *w, int q, int counter) {
    return (volatile int64_t *)(w->bases[q]) + counter;
}

static char *win_region(const WindowSteps *w, int q) { return w->bases[q] + w->region; }

/* shared_window.owned_slice */
static void win_slice(size_t items, int r, int n, size_t *lo, size_t *hi) {
    size_t base = items / (size_t)n, extra = items % (size_t)n;
    *lo = (size_t)r * base + ((size_t)r < extra ? (size_t)r : extra);
    *hi = *lo + base + ((size_t)r < extra ? 1 : 0);
}

/* Every rank's `counter` at `value` at least: 1; not yet: 0; a rank failed: -(q + 1). */
static int win_ready(const WindowSteps *w, int counter, int64_t value) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    int ready = 1;
    for (int q = 0; q < w->size; q++)
        if (__atomic_load_n(win_counter(w, q, counter), __ATOMIC_ACQUIRE) < value) ready = 0;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);  /* the data vouched for is read after */
    if (ready) return 1;
    for (int q = 0; q < w->size; q++)
        if (__atomic_load_n(win_counter(w, q, W_ABORTED), __ATOMIC_ACQUIRE)) return -(q + 1);
    return 0;
}

/* shared_window.publish: the counter after my writes, then every peer's bell
 * stamped and, where its owner says a thread sleeps on it, woken. -1: error set. */
static int win_publish(const WindowSteps *w, int counter, int64_t value) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    __atomic_store_n(win_counter(w, w->rank, counter), value, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    for (int q = 0; q < w->size; q++) {
        if (q == w->rank) continue;
        PyObject *n = PyIter_Next(w->rings);
        if (n == NULL) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "bell count ended");
            return -1;
        }
        unsigned long count = PyLong_AsUnsignedLongMask(n);
        Py_DECREF(n);
        uint32_t stamp = ((w->writer & 0x7Fu) << 24) | ((uint32_t)count & 0xFFFFFFu);
        __atomic_store_n((uint32_t *)(w->bases[q] + w->bell), stamp, __ATOMIC_RELAXED);
    }
    __atomic_thread_fence(__ATOMIC_SEQ_CST);  /* bells stored before I look who sleeps */
    for (int q = 0; q < w->size; q++) {
        if (q == w->rank) continue;
#ifdef __linux__  /* elsewhere base.futex sleeps briefly and looks again: no wake */
        if (__atomic_load_n((uint32_t *)(w->bases[q] + w->sleepers), __ATOMIC_RELAXED))
            syscall(SYS_futex, (uint32_t *)(w->bases[q] + w->bell), FUTEX_WAKE, INT_MAX,
                    NULL, NULL, 0);
#endif
    }
    return 0;
}

/* Rank q's part of the allreduce from item `lo` on: my own input, or q's region. */
static const char *win_part(const WindowRequest *r, int q, size_t lo) {
    return (q == r->win->rank ? r->src : win_region(r->win, q)) + lo * r->esize;
}

/* One step's memory work (no Python objects: the caller drops the GIL around it). */
static void win_work(const WindowRequest *r) {
    const WindowSteps *w = r->win;
    size_t lo, hi, es = r->esize;
    if (r->step == 0) {  /* every slice but my own into my region, for its owner */
        char *mine = win_region(w, w->rank);
        for (int k = 0; k < w->size; k++) {
            if (k == w->rank) continue;
            win_slice(r->items, k, w->size, &lo, &hi);
            memcpy(mine + lo * es, r->src + lo * es, (hi - lo) * es);
        }
    } else if (r->step == 1) {  /* my slice folded over every rank, in rank order */
        win_slice(r->items, w->rank, w->size, &lo, &hi);
        size_t len = (hi - lo) * es;
        char *acc = win_region(w, w->rank) + lo * es;
        fold_pair(r->fold, win_part(r, 0, lo), win_part(r, 1, lo), acc, len);
        for (int q = 2; q < w->size; q++) fold_pair(r->fold, acc, win_part(r, q, lo), acc, len);
    } else {  /* every folded slice from its owner's region */
        for (int k = 0; k < w->size; k++) {
            win_slice(r->items, k, w->size, &lo, &hi);
            memcpy(r->out + lo * es, win_region(w, k) + lo * es, (hi - lo) * es);
        }
    }
}

/* advance() -> int: take every step whose peers are there. 1: finished; 0: a peer
 * is not there yet; -(q + 1): local rank q failed (its ABORTED slot). A test that
 * finds a peer missing returns at once: the engine's poller decides how long to
 * wait, as for every request. */
static PyObject *window_request_advance(WindowRequest *self, PyObject *unused) {
    static const int waits[3] = {W_LEFT, W_ARRIVED, W_REDUCED};
    static const int publishes[3] = {W_ARRIVED, W_REDUCED, W_LEFT};
    while (self->step < 3) {
        int ready = win_ready(self->win, waits[self->step],
                              self->step == 0 ? self->epoch - 1 : self->epoch);
        if (ready <= 0) return PyLong_FromLong(ready);
        Py_BEGIN_ALLOW_THREADS
        win_work(self);
        Py_END_ALLOW_THREADS
        if (win_publish(self->win, publishes[self->step], self->epoch) < 0) return NULL;
        self->step++;
    }
    return PyLong_FromLong(1);
}

static void window_request_dealloc(WindowRequest *self) {
    Py_CLEAR(self->win);
    Py_CLEAR(self->src_obj);
    Py_CLEAR(self->out_obj);
    PyObject_Free(self);
}

static PyMethodDef window_request_methods[] = {
    {"advance", (PyCFunction)window_request_advance, METH_NOARGS,
     "Take the steps whose peers are there: 1 finished, 0 waiting, -(q + 1) rank q failed."},
    {NULL, NULL, 0, NULL}};

static PyMemberDef window_request_members[] = {
    {"step", T_INT, offsetof(WindowRequest, step), READONLY, "steps taken (3: all)"},
    {NULL, 0, 0, 0, NULL}};

static PyTypeObject WindowRequestType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "asynclock._fastpath.WindowRequest",
    .tp_basicsize = sizeof(WindowRequest),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One allreduce's steps through the node window, until it finishes.",
    .tp_dealloc = (destructor)window_request_dealloc,
    .tp_methods = window_request_methods,
    .tp_members = window_request_members,
};

static int window_steps_init(WindowSteps *self, PyObject *args, PyObject *kw) {
    PyObject *bases, *rings, *owner;
    int rank;
    Py_ssize_t region, bell, sleepers, region_bytes;
    unsigned int writer;
    if (!PyArg_ParseTuple(args, "O!i(nnn)nIOO", &PyTuple_Type, &bases, &rank, &region, &bell,
                          &sleepers, &region_bytes, &writer, &rings, &owner))
        return -1;
    Py_ssize_t size = PyTuple_GET_SIZE(bases);
    if (size < 2 || rank < 0 || rank >= size || bell < 8 * (W_LEFT + 1) || bell % 4
            || sleepers < 8 * (W_LEFT + 1) || sleepers % 4 || bell + 4 > region
            || sleepers + 4 > region || region_bytes < 0 || !PyIter_Check(rings)) {
        PyErr_SetString(PyExc_ValueError, "not a node window");
        return -1;
    }
    char **list = PyMem_Calloc((size_t)size, sizeof(char *));
    if (list == NULL) { PyErr_NoMemory(); return -1; }
    for (Py_ssize_t q = 0; q < size; q++) {
        list[q] = (char *)(uintptr_t)PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(bases, q));
        if (PyErr_Occurred()) { PyMem_Free(list); return -1; }
    }
    PyMem_Free(self->bases);
    self->bases = list;
    self->rank = rank;
    self->size = (int)size;
    self->region = region;
    self->bell = bell;
    self->sleepers = sleepers;
    self->region_bytes = region_bytes;
    self->writer = writer;
    Py_INCREF(rings);
    Py_XSETREF(self->rings, rings);
    Py_INCREF(owner);
    Py_XSETREF(self->owner, owner);
    return 0;
}

static void window_steps_dealloc(WindowSteps *self) {
    PyMem_Free(self->bases);
    Py_CLEAR(self->rings);
    Py_CLEAR(self->owner);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* start(src, out, fold, epoch) -> WindowRequest, or None where `fold` is no fold code
 * this file knows (the Python steps take it). `src` may be `out`. */
static PyObject *window_steps_start(WindowSteps *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) return PyErr_Format(PyExc_TypeError, "start takes 4 arguments");
    long fold = PyLong_AsLong(args[2]);
    long long epoch = PyLong_AsLongLong(args[3]);
    if (PyErr_Occurred()) return NULL;
    char probe[8] = {0};
    if (fold_pair((int)fold, probe, probe, probe, 0) < 0) Py_RETURN_NONE;
    char *src, *out;
    Py_ssize_t slen, olen;
    if (memory_of(args[0], 0, &src, &slen) < 0 || memory_of(args[1], 1, &out, &olen) < 0)
        return NULL;
    size_t esize = (fold - 1) % 2 ? 8 : 4;  /* header.FOLDS: float32, float64, int32, int64 */
    if (slen != olen || olen > self->region_bytes || (size_t)olen % esize)
        return PyErr_Format(PyExc_ValueError, "not an allreduce this window holds");
    WindowRequest *req = PyObject_New(WindowRequest, &WindowRequestType);
    if (req == NULL) return NULL;
    Py_INCREF(self);
    req->win = self;
    req->epoch = epoch;
    req->step = 0;
    req->fold = (int)fold;
    req->esize = esize;
    req->items = (size_t)olen / esize;
    req->src = src;
    req->out = out;
    Py_INCREF(args[0]);
    req->src_obj = args[0];
    Py_INCREF(args[1]);
    req->out_obj = args[1];
    return (PyObject *)req;
}

static PyMethodDef window_steps_methods[] = {
    {"start", (PyCFunction)(void (*)(void))window_steps_start, METH_FASTCALL,
     "An allreduce of `src` into `out` through the window at `epoch`, not yet stepped."},
    {NULL, NULL, 0, NULL}};

static PyTypeObject WindowStepsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "asynclock._fastpath.WindowSteps",
    .tp_basicsize = sizeof(WindowSteps),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A node window's loop allreduces in C: "
              "WindowSteps(bases, rank, (region, bell, sleepers offsets), region_bytes, "
              "writer, rings, owner)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)window_steps_init,
    .tp_dealloc = (destructor)window_steps_dealloc,
    .tp_methods = window_steps_methods,
};

/* -- both rounds behind one exchange() ----------------------------------- */

/* The send and receive words of a CompactRound or NodeCompactRound; -1 with an
 * error set when a round is still in flight there. */
static int round_words(PyObject *rnd, int64_t **send, int64_t **recv) {
    if (Py_IS_TYPE(rnd, &NodeCompactRoundType)) {
        NodeCompactRound *n = (NodeCompactRound *)rnd;
        if (n->k) { PyErr_Format(PyExc_RuntimeError, "a round is still in flight"); return -1; }
        *send = n->send;
        *recv = n->recv;
        return 0;
    }
    CompactRound *c = (CompactRound *)rnd;
    if (c->req != MPI_REQUEST_NULL) {
        PyErr_Format(PyExc_RuntimeError, "a round is still in flight");
        return -1;
    }
    *send = c->send;
    *recv = c->recv;
    return 0;
}

static int round_run(PyObject *rnd, double spin) {
    if (Py_IS_TYPE(rnd, &NodeCompactRoundType)) return node_run((NodeCompactRound *)rnd, spin);
    return compact_run((CompactRound *)rnd, spin);
}

/* exchange(key, seq, data, spin_s, copy, out) -> DONE_FOLDED | DIFFERENT | IN_FLIGHT | DONE
 * key: 16 bytes, the call's fingerprint key and fold code; data: the inline payload
 * (None: zeros); copy: nonzero to copy the reduced payload into `out` once every rank
 * agreed. */
static PyObject *round_exchange(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) return PyErr_Format(PyExc_TypeError, "exchange takes 6 arguments");
    int64_t *send, *recv;
    if (round_words(self, &send, &recv) < 0) return NULL;
    char *key;
    Py_ssize_t klen;
    if (PyBytes_AsStringAndSize(args[0], &key, &klen) < 0) return NULL;
    if (klen != 16) return PyErr_Format(PyExc_ValueError, "bad compact key");
    long long seq = PyLong_AsLongLong(args[1]);
    double spin = PyFloat_AsDouble(args[3]);
    long copy = PyLong_AsLong(args[4]);
    if (PyErr_Occurred()) return NULL;
    int64_t fold;
    if (args[2] == Py_None) {
        fold = fill_words(send, key, seq, NULL, 0);
    } else {
        Py_buffer data;
        if (PyObject_GetBuffer(args[2], &data, PyBUF_C_CONTIGUOUS) < 0) return NULL;
        if (data.len > INLINE) {
            PyBuffer_Release(&data);
            return PyErr_Format(PyExc_ValueError, "payload too big for a slot");
        }
        fold = fill_words(send, key, seq, data.buf, (size_t)data.len);
        PyBuffer_Release(&data);
    }
    int state = round_run(self, spin);
    if (state < 0) return NULL;
    if (state != DONE) return PyLong_FromLong(state);
    if (!copy) return PyLong_FromLong(judge(recv, fold, NULL, 0));
    Py_buffer out;
    if (PyObject_GetBuffer(args[5], &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) return NULL;
    state = judge(recv, fold, out.buf, (size_t)out.len);
    PyBuffer_Release(&out);
    return PyLong_FromLong(state);
}

/* -- a small in-place allreduce, whole -------------------------------------
 * Loops reduce small tensors in place step after step: a flag, a counter, a
 * metric, each step's loss. engine.small_calls arms a HotAllreduce with the
 * signature of such a call (in place, no name, folded inline by the round):
 * the input's type, op, dtype and shape. A later call with a tensor or array of
 * that signature, new or not, then runs here from the checks to the fold,
 * with the same sequence numbers, words and counters as the Python path
 * (SmallCalls._exchange), while the engine's state lets the small path
 * run (no observer, no failure, no matching, no CUDA gate). The input's checks
 * are those of the Python path's `_view`: a torch tensor's device, dtype,
 * shape and contiguity (its memory from data_ptr()), a numpy array's buffer
 * (format, shape, contiguous, writable). Anything else falls back: a round that
 * did not fold goes on in `after(state, seq, issued_at, tensor)`, other calls
 * in `slow(tensor, op, name, inplace)`. It counts the call in `small.calls` and
 * yields every so often as the Python path does.
 */
static PyObject *S_on_event, *S_failure, *S_matcher, *S_data_ptr, *S_dtype, *S_is_cpu,
    *S_shape, *S_is_contiguous, *S_seq, *S_rounds, *S_spin_s, *S_synchronous,
    *S_count_synchronous, *S_calls;

typedef struct {
    PyObject_HEAD
    PyObject *small, *yield_then, *slow, *after, *engine, *lane, *gates, *round;
    long long yield_mask;  /* a call whose count has none of these bits set yields once */
    PyObject *type, *op, *dtype, *shape;  /* the armed signature (type NULL: none) */
    PyObject *inplace, *new_like;  /* Py_True, or Py_False with what makes the result */
    int average;  /* ranks to divide a float sum by (0: not an average) */
    char key[16];
    long long bump;
    Py_ssize_t nbytes;
    char format[16];  /* a numpy array's buffer format ("": a torch tensor) */
    long long calls;  /* calls that ran here (tests read it) */
} HotAllreduce;

/* HotAllreduce(small, yield_mask, yield_then, slow, after, engine, lane, gates, round):
 * `small.calls` counts the calls; every call whose count has no bit of `yield_mask` set
 * returns `yield_then(result)` to await. */
static int hot_init(HotAllreduce *self, PyObject *args, PyObject *kw) {
    PyObject *small, *yield_then, *slow, *after, *engine, *lane, *gates, *rnd;
    long long mask;
    if (!PyArg_ParseTuple(args, "OLOOOOOO!O", &small, &mask, &yield_then, &slow, &after, &engine,
                          &lane, &PyDict_Type, &gates, &rnd))
        return -1;
    if (!Py_IS_TYPE(rnd, &CompactRoundType) && !Py_IS_TYPE(rnd, &NodeCompactRoundType)) {
        PyErr_Format(PyExc_TypeError, "a HotAllreduce runs on a C compact round");
        return -1;
    }
    self->yield_mask = mask;
    PyObject *objs[8] = {small, yield_then, slow, after, engine, lane, gates, rnd};
    PyObject **slots[8] = {&self->small, &self->yield_then, &self->slow, &self->after,
                           &self->engine, &self->lane, &self->gates, &self->round};
    for (int i = 0; i < 8; i++) {
        Py_INCREF(objs[i]);
        Py_XSETREF(*slots[i], objs[i]);
    }
    return 0;
}

static int hot_traverse(HotAllreduce *self, visitproc visit, void *arg) {
    Py_VISIT(self->small);
    Py_VISIT(self->yield_then);
    Py_VISIT(self->slow);
    Py_VISIT(self->after);
    Py_VISIT(self->engine);
    Py_VISIT(self->lane);
    Py_VISIT(self->gates);
    Py_VISIT(self->round);
    Py_VISIT(self->type);
    Py_VISIT(self->op);
    Py_VISIT(self->dtype);
    Py_VISIT(self->shape);
    Py_VISIT(self->inplace);
    Py_VISIT(self->new_like);
    return 0;
}

static int hot_clear(HotAllreduce *self) {
    Py_CLEAR(self->small);
    Py_CLEAR(self->yield_then);
    Py_CLEAR(self->slow);
    Py_CLEAR(self->after);
    Py_CLEAR(self->engine);
    Py_CLEAR(self->lane);
    Py_CLEAR(self->gates);
    Py_CLEAR(self->round);
    Py_CLEAR(self->type);
    Py_CLEAR(self->op);
    Py_CLEAR(self->dtype);
    Py_CLEAR(self->shape);
    Py_CLEAR(self->inplace);
    Py_CLEAR(self->new_like);
    return 0;
}

static void hot_dealloc(HotAllreduce *self) {
    PyObject_GC_UnTrack(self);
    hot_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* arm(example, op, dtype, shape, key, bump, nbytes, inplace, new_like, average): the
 * signature of `example`, a torch tensor (dtype: its torch dtype) or a numpy array (dtype
 * None: the format of its buffer is armed); out of place, `new_like(input)` makes the
 * result; `average`: the ranks a float32/float64 sum is divided by (0: none). */
static PyObject *hot_arm(HotAllreduce *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10) return PyErr_Format(PyExc_TypeError, "arm takes 10 arguments");
    long average = PyLong_AsLong(args[9]);
    if (average == -1 && PyErr_Occurred()) return NULL;
    if (args[7] != Py_True && (args[7] != Py_False || !PyCallable_Check(args[8])))
        return PyErr_Format(PyExc_ValueError, "out of place needs new_like");
    char *key;
    Py_ssize_t klen;
    if (PyBytes_AsStringAndSize(args[4], &key, &klen) < 0) return NULL;
    long long bump = PyLong_AsLongLong(args[5]);
    Py_ssize_t nbytes = PyLong_AsSsize_t(args[6]);
    if (PyErr_Occurred()) return NULL;
    if (klen != 16 || nbytes < 0 || nbytes > INLINE || !PyTuple_Check(args[3]))
        return PyErr_Format(PyExc_ValueError, "not a call for the hot path");
    char format[sizeof(self->format)] = "";
    if (args[2] == Py_None) {
        Py_buffer view;
        if (PyObject_GetBuffer(args[0], &view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT)
                < 0)
            return NULL;
        int fits = strlen(view.format) < sizeof(format) && view.format[0];
        if (fits) strcpy(format, view.format);
        PyBuffer_Release(&view);
        if (!fits || !PyTuple_CheckExact(args[3]))
            return PyErr_Format(PyExc_ValueError, "not an array for the hot path");
    }
    int64_t fold;
    memcpy(&fold, key + 8, 8);
    if (average && fold != 1 && fold != 2)
        return PyErr_Format(PyExc_ValueError, "only float sums are averaged here");
    self->average = (int)average;
    Py_INCREF(args[7]);
    Py_XSETREF(self->inplace, args[7]);
    Py_INCREF(args[8]);
    Py_XSETREF(self->new_like, args[8]);
    memcpy(self->format, format, sizeof(format));
    memcpy(self->key, key, 16);
    self->bump = bump;
    self->nbytes = nbytes;
    PyObject **slots[4] = {&self->type, &self->op, &self->dtype, &self->shape};
    PyObject *objs[4] = {(PyObject *)Py_TYPE(args[0]), args[1], args[2], args[3]};
    for (int i = 0; i < 4; i++) {
        Py_INCREF(objs[i]);
        Py_XSETREF(*slots[i], objs[i]);
    }
    Py_RETURN_NONE;
}

/* 1: `name` of `obj` is None; 0: not; -1: error */
static int attr_is_none(PyObject *obj, PyObject *name) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) return -1;
    int none = v == Py_None;
    Py_DECREF(v);
    return none;
}

/* 1: `obj` (of the armed numpy type) has the armed format and shape, contiguous and
 * writable; its memory in *ptr. 0: not, or -1 */
static int array_fits(HotAllreduce *self, PyObject *obj, void **ptr) {
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0) {
        PyErr_Clear();  /* not contiguous or not writable: the Python path says so */
        return 0;
    }
    int same = view.len == self->nbytes && strcmp(view.format, self->format) == 0
               && view.ndim == PyTuple_GET_SIZE(self->shape);
    for (int i = 0; same && i < view.ndim; i++)
        same = PyLong_AsSsize_t(PyTuple_GET_ITEM(self->shape, i)) == view.shape[i];
    *ptr = view.buf;  /* the array object, held by the caller, keeps the memory */
    PyBuffer_Release(&view);
    if (PyErr_Occurred()) return -1;
    return same;
}

/* 1: `obj` (of the armed torch type) is on the CPU, contiguous, of the armed dtype and
 * shape; its memory in *ptr. 0: not, or -1 */
static int tensor_fits(HotAllreduce *self, PyObject *obj, void **ptr) {
    PyObject *v = PyObject_GetAttr(obj, S_dtype);
    if (v == NULL) return -1;
    int ok = v == self->dtype;
    Py_DECREF(v);
    if (!ok) return 0;
    if ((v = PyObject_GetAttr(obj, S_is_cpu)) == NULL) return -1;
    ok = v == Py_True;
    Py_DECREF(v);
    if (!ok) return 0;
    if ((v = PyObject_GetAttr(obj, S_shape)) == NULL) return -1;
    ok = PyObject_RichCompareBool(v, self->shape, Py_EQ);
    Py_DECREF(v);
    if (ok != 1) return ok;
    if ((v = PyObject_CallMethodNoArgs(obj, S_is_contiguous)) == NULL) return -1;
    ok = v == Py_True;
    Py_DECREF(v);
    if (!ok) return 0;
    if ((v = PyObject_CallMethodNoArgs(obj, S_data_ptr)) == NULL) return -1;
    *ptr = PyLong_AsVoidPtr(v);
    Py_DECREF(v);
    if (*ptr == NULL) return PyErr_Occurred() ? -1 : 0;
    return 1;
}

/* 1: the call may run here now, with its memory in *ptr; 0: the Python path takes it;
 * -1: error */
static int hot_ready(HotAllreduce *self, PyObject *obj, void **ptr) {
    int ok = attr_is_none(self->engine, S_on_event);
    if (ok != 1) return ok;
    if ((ok = attr_is_none(self->engine, S_failure)) != 1) return ok;
    if ((ok = attr_is_none(self->lane, S_matcher)) != 1) return ok;
    int held = PyDict_Contains(self->gates, self->lane);
    if (held != 0) return held < 0 ? -1 : 0;
    return self->format[0] ? array_fits(self, obj, ptr) : tensor_fits(self, obj, ptr);
}

/* obj.name += by; the new value in *out. 0, or -1 with an error set. */
static int bump_attr(PyObject *obj, PyObject *name, long long by, long long *out) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) return -1;
    long long n = PyLong_AsLongLong(v);
    Py_DECREF(v);
    if (n == -1 && PyErr_Occurred()) return -1;
    n += by;
    *out = n;
    if (by == 0) return 0;
    v = PyLong_FromLongLong(n);
    if (v == NULL) return -1;
    int rc = PyObject_SetAttr(obj, name, v);
    Py_DECREF(v);
    return rc;
}

/* An average's finish: the float sum divided by the ranks, as numpy divides
 * (reduce.finish_average_inplace), so every path gives the same bits. */
static void divide_floats(void *p, Py_ssize_t nbytes, int64_t fold, int size) {
    if (fold == 1) {
        float *x = (float *)p, d = (float)size;
        for (Py_ssize_t i = 0; i < nbytes / 4; i++) x[i] = x[i] / d;
    } else {
        double *x = (double *)p, d = (double)size;
        for (Py_ssize_t i = 0; i < nbytes / 8; i++) x[i] = x[i] / d;
    }
}

/* call(tensor, op, name, inplace): SmallCalls.allreduce */
static PyObject *hot_call(HotAllreduce *self, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *obj = nargs == 4 ? args[0] : NULL;
    if (obj == NULL || self->type == NULL || (PyObject *)Py_TYPE(obj) != self->type
            || args[1] != self->op || args[2] != Py_None || args[3] != self->inplace)
        return PyObject_Vectorcall(self->slow, args, (size_t)nargs, NULL);
    void *data = NULL;
    int ready = hot_ready(self, obj, &data);
    if (ready < 0) return NULL;
    if (!ready) return PyObject_Vectorcall(self->slow, args, (size_t)nargs, NULL);
    PyObject *result = obj;  /* in place; else made before anything is counted, so
                                 a failure to make it leaves nothing issued */
    void *out = data;
    if (self->inplace != Py_True) {
        result = PyObject_CallOneArg(self->new_like, obj);
        if (result == NULL) return NULL;
        int fits = self->format[0] ? array_fits(self, result, &out)
                                   : tensor_fits(self, result, &out);
        if (fits != 1) {
            Py_DECREF(result);
            return fits < 0 ? NULL : PyErr_Format(PyExc_RuntimeError, "new_like misfits");
        }
    } else {
        Py_INCREF(result);
    }
    int64_t *send, *recv;
    long long count, seq, ignored;
    double spin = -1.0;
    PyObject *v = NULL;
    if (round_words(self->round, &send, &recv) < 0
            || bump_attr(self->small, S_calls, 1, &count) < 0
            || bump_attr(self->lane, S_seq, self->bump, &seq) < 0
            || bump_attr(self->lane, S_rounds, 1, &ignored) < 0
            || (v = PyObject_GetAttr(self->lane, S_spin_s)) == NULL
            || ((spin = PyFloat_AsDouble(v)) == -1.0 && PyErr_Occurred())) {
        Py_XDECREF(v);
        Py_DECREF(result);
        return NULL;
    }
    Py_DECREF(v);
    self->calls++;
    if (!self->bump) seq += 1;  /* a call that takes no W_SEQ carries the next one */
    double issued_at = now();
    int64_t fold = fill_words(send, self->key, seq, data, (size_t)self->nbytes);
    int state = round_run(self->round, spin);
    if (state < 0) { Py_DECREF(result); return NULL; }
    if (state == DONE) state = judge(recv, fold, out, (size_t)self->nbytes);
    if (state != DONE_FOLDED) {
        Py_DECREF(result);
        return PyObject_CallFunction(self->after, "iLdO", state, seq, issued_at, obj);
    }
    if (self->average) divide_floats(out, self->nbytes, fold, self->average);
    long long n;
    if (bump_attr(self->lane, S_synchronous, 1, &n) < 0) { Py_DECREF(result); return NULL; }
    if (!(n & 7)) {
        PyObject *at = PyFloat_FromDouble(issued_at);
        PyObject *r = at == NULL ? NULL : PyObject_CallMethodObjArgs(
            self->engine, S_count_synchronous, at, self->lane, NULL);
        Py_XDECREF(at);
        if (r == NULL) { Py_DECREF(result); return NULL; }
        Py_DECREF(r);
    }
    if (!(count & self->yield_mask)) {
        PyObject *later = PyObject_CallOneArg(self->yield_then, result);
        Py_DECREF(result);
        return later;
    }
    return result;
}

static PyMethodDef hot_methods[] = {
    {"call", (PyCFunction)(void (*)(void))hot_call, METH_FASTCALL,
     "SmallCalls.allreduce(tensor, op, name, inplace), whole where armed."},
    {"arm", (PyCFunction)(void (*)(void))hot_arm, METH_FASTCALL,
     "arm(example, op, dtype, shape, key, bump, nbytes)"},
    {NULL, NULL, 0, NULL}};

static PyMemberDef hot_members[] = {
    {"calls", T_LONGLONG, offsetof(HotAllreduce, calls), READONLY, "calls that ran here"},
    {NULL, 0, 0, 0, NULL}};

static PyTypeObject HotAllreduceType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "asynclock._fastpath.HotAllreduce",
    .tp_basicsize = sizeof(HotAllreduce),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "HotAllreduce(slow, after, engine, lane, gates, round)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)hot_init,
    .tp_traverse = (traverseproc)hot_traverse,
    .tp_clear = (inquiry)hot_clear,
    .tp_dealloc = (destructor)hot_dealloc,
    .tp_methods = hot_methods,
    .tp_members = hot_members,
};

static int intern_names(void) {
    struct { PyObject **slot; const char *text; } names[] = {
        {&S_on_event, "on_event"}, {&S_failure, "failure"}, {&S_matcher, "matcher"},
        {&S_data_ptr, "data_ptr"}, {&S_dtype, "dtype"}, {&S_is_cpu, "is_cpu"},
        {&S_shape, "shape"}, {&S_is_contiguous, "is_contiguous"}, {&S_seq, "seq"},
        {&S_rounds, "rounds"}, {&S_spin_s, "spin_s"}, {&S_synchronous, "synchronous"},
        {&S_count_synchronous, "count_synchronous"}, {&S_calls, "calls"}};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if ((*names[i].slot = PyUnicode_InternFromString(names[i].text)) == NULL) return -1;
    return 0;
}

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
    if (PyType_Ready(&CompactRoundType) < 0 || PyType_Ready(&NodeRoundType) < 0
            || PyType_Ready(&NodeRequestType) < 0 || PyType_Ready(&NodeCompactRoundType) < 0
            || PyType_Ready(&HotAllreduceType) < 0 || PyType_Ready(&NodeDataType) < 0
            || PyType_Ready(&NodeDataRequestType) < 0 || PyType_Ready(&WindowStepsType) < 0
            || PyType_Ready(&WindowRequestType) < 0 || intern_names() < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&CompactRoundType);
    if (PyModule_AddObject(m, "CompactRound", (PyObject *)&CompactRoundType) < 0) return NULL;
    Py_INCREF(&NodeRoundType);
    if (PyModule_AddObject(m, "NodeRound", (PyObject *)&NodeRoundType) < 0) return NULL;
    Py_INCREF(&NodeCompactRoundType);
    if (PyModule_AddObject(m, "NodeCompactRound", (PyObject *)&NodeCompactRoundType) < 0)
        return NULL;
    Py_INCREF(&HotAllreduceType);
    if (PyModule_AddObject(m, "HotAllreduce", (PyObject *)&HotAllreduceType) < 0) return NULL;
    Py_INCREF(&NodeDataType);
    if (PyModule_AddObject(m, "NodeData", (PyObject *)&NodeDataType) < 0) return NULL;
    Py_INCREF(&WindowStepsType);
    if (PyModule_AddObject(m, "WindowSteps", (PyObject *)&WindowStepsType) < 0) return NULL;
    PyModule_AddIntConstant(m, "REC_BYTES", REC_BYTES);
    PyModule_AddIntConstant(m, "DATA_HEAD", DATA_HEAD);
    PyModule_AddIntConstant(m, "DONE_FOLDED", DONE_FOLDED);
    PyModule_AddIntConstant(m, "DIFFERENT", DIFFERENT);
    PyModule_AddIntConstant(m, "IN_FLIGHT", IN_FLIGHT);
    PyModule_AddIntConstant(m, "DONE", DONE);
    return m;
}
