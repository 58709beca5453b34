/* The tracer's hot path in C: what a collective called from the user's own code costs (docs/performance.md).

    pip install -e .        # builds distcheck/rank/_tracefast*.so when a C compiler is there (optional)

distcheck/rank/tracer.py is the tracer; this module only speeds up its common case, a call whose description is
already cached. The wrapper hands each call to ``Recorder.call(args, kwargs)``, which does in C what the Python path
does in dozens of bytecode-level steps: find the caller's frame, walk out through torch's frames to the user's
(FSDP2's and DTensor's collectives are called from torch's code) without making frame objects, match the call
against what its line issued last (the site cache, no key built: 1.3 µs less per call on this project's VM) or else
build the call's cache key and look it up, claim the next record slot and store the start word and time into the
memory map, call torch's function, and store the end time when it returned None on the CPU. What is not that common
case goes back to tracer.py, so every rule stays written once there: a cache miss, a file not classified yet, a list
argument, a full map or an error of ours to its Python path (with the key, when the cache missed), a Work, a
functional collective or a CUDA tensor's end to ``finish``, an exception the op raised to ``failed`` (and then on to
the caller). A traced call already on the stack (torch issuing an op inside one) calls torch's function untraced.
Once ``Log.stop()`` was called (the report directory's file system refused more blocks for the map), the call is
only counted in the header, so an unrecorded collective costs less than a recorded one. ``Recorder.begin`` is the
first step alone, for the tests: slot (negative when the call's tensors are on the GPU, minus OPEN_BIAS more when
NCCL's ring gives its end), key, ``nested`` or None.

The key built here must equal the Python path's key, element by element (the two share one cache):
(id(code), f_lasti, for each positional argument: shape, dtype[, is_cuda] of an exact Tensor, else the value; for
each keyword argument: its name, then (shape, dtype, is_cuda) of an exact Tensor, else the value).
tests/unit/test_tracer.py checks that both paths find each other's entries.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <frameobject.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#if PY_VERSION_HEX < 0x030B0000
#error "the tracer's C path needs Python 3.11 (PyFrame_GetLasti); older versions use the Python path"
#endif

/* The caller's frames. On 3.11 and 3.12 the walk reads the interpreter's own frames (as sys._getframe does
   internally), so it makes no frame objects: sys._getframe(1) made one for the caller, and each PyFrame_GetBack one
   more for every frame of torch's it passed (FSDP2's and DTensor's collectives are called from a dozen), at about
   60 ns each on an H200's host. Other versions (or -DDISTCHECK_PUBLIC_FRAMES) use the public API. Every Frame the
   walk holds is a frame still running under this call, so each is borrowed, as is its code. */
#if PY_VERSION_HEX < 0x030D0000 && !defined(PYPY_VERSION) && !defined(DISTCHECK_PUBLIC_FRAMES) && defined(__has_include)
#if __has_include(<internal/pycore_frame.h>) /* a Python whose headers leave the internal ones out: the public API */
#define INTERNAL_FRAMES 1
#endif
#endif
#ifdef INTERNAL_FRAMES
#ifndef Py_BUILD_CORE
#define Py_BUILD_CORE 1
#endif
#include <internal/pycore_frame.h>
#undef Py_BUILD_CORE
typedef _PyInterpreterFrame Frame;

static Frame *complete(Frame *f) { /* frames still being set up are not the caller's, as sys._getframe skips them */
    while (f && _PyFrame_IsIncomplete(f))
        f = f->previous;
    return f;
}
/* The frame that called the Python function now calling us (the wrapper's caller), or NULL. */
static Frame *caller_frame(void) {
    Frame *f = PyThreadState_Get()->cframe->current_frame;
    return f ? complete(f->previous) : NULL;
}
static Frame *frame_back(Frame *f) { return complete(f->previous); }
static PyCodeObject *frame_code(Frame *f) { return f->f_code; }
static int frame_lasti(Frame *f) { /* as PyFrame_GetLasti and frame.f_lasti, which tracer.py's key uses */
    int lasti = _PyInterpreterFrame_LASTI(f);
    return lasti < 0 ? -1 : lasti * (int)sizeof(_Py_CODEUNIT);
}
#else
typedef PyFrameObject Frame;
static PyObject *getframe, *one;

static Frame *caller_frame(void) { /* sys._getframe(1) from here is the wrapper's caller */
    PyObject *f = PyObject_CallOneArg(getframe, one);
    if (f && !PyFrame_Check(f))
        Py_CLEAR(f);
    Py_XDECREF(f); /* a running frame's object is held by the frame itself */
    return (Frame *)f;
}
static Frame *frame_back(Frame *f) {
    PyFrameObject *back = PyFrame_GetBack(f);
    Py_XDECREF(back);
    return back;
}
static PyCodeObject *frame_code(Frame *f) {
    PyCodeObject *code = PyFrame_GetCode(f);
    Py_DECREF(code); /* the running frame holds it */
    return code;
}
static int frame_lasti(Frame *f) { return PyFrame_GetLasti(f); }
#endif

/* The record layout of contract/trace_slots.py: a slot's size, where the start's time and the end time go (the
   start word goes first). The module exports them and tracer.py takes the C path only when they match. */
#define RECORD_SIZE 24
#define START_TIME_OFFSET 8
/* What the wrapper does once the op returned (the cached sig's second item): write its end now, record a CUDA
   event for it, or nothing (NCCL's ring gives its end). begin() returns slot, -slot, -(slot + OPEN_BIAS). */
#define AFTER_END 0
#define AFTER_EVENT 1
#define AFTER_NOTHING 2
#define OPEN_BIAS (1LL << 40)
#define END_OFFSET 16
#define UNRECORDED_OFFSET 16 /* in the header slot: a u32 count of collectives issued after recording stopped */

static PyObject *str_shape, *str_dtype, *str_is_cuda;

/* A plain type with an __init__, a dealloc and methods (both of this module's types). */
#define TYPE(var, name, object, init, dealloc, methods)                                                            \
    static PyTypeObject var = {                                                                                    \
        PyVarObject_HEAD_INIT(NULL, 0).tp_name = "distcheck.rank._tracefast." name,                               \
        .tp_basicsize = sizeof(object),                                                                            \
        .tp_flags = Py_TPFLAGS_DEFAULT,                                                                            \
        .tp_new = PyType_GenericNew,                                                                               \
        .tp_init = (initproc)init,                                                                                 \
        .tp_dealloc = (destructor)dealloc,                                                                         \
        .tp_methods = methods,                                                                                     \
    }

/* ---- Log: the record file's slot counter and memory map, shared by every wrapper ---- */

typedef struct {
    PyObject_HEAD
    PyObject *mm;        /* the mmap.mmap of trace-rank<R>.bin */
    PyObject *internal;  /* dict: file name -> True when not the user's code (filled by the Python path) */
    PyObject *tensor;    /* torch.Tensor */
    int gpu_build;       /* key tensors' is_cuda too (a CUDA or ROCm build of torch) */
    int stopped;         /* recording stopped (a full file system): only count calls */
    unsigned long long next_slot;
} LogObject;

static void Log_dealloc(LogObject *self) {
    Py_XDECREF(self->mm);
    Py_XDECREF(self->internal);
    Py_XDECREF(self->tensor);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Log_init(LogObject *self, PyObject *args, PyObject *Py_UNUSED(kwds)) {
    PyObject *mm, *internal, *tensor;
    int gpu_build;
    if (!PyArg_ParseTuple(args, "OO!Op", &mm, &PyDict_Type, &internal, &tensor, &gpu_build))
        return -1;
    Py_INCREF(mm);
    Py_INCREF(internal);
    Py_INCREF(tensor);
    Py_XSETREF(self->mm, mm);
    Py_XSETREF(self->internal, internal);
    Py_XSETREF(self->tensor, tensor);
    self->gpu_build = gpu_build;
    self->stopped = 0;
    self->next_slot = 1; /* slot 0 is the header */
    return 0;
}

/* claim() -> the next free slot (the Python path's counter, so both paths share one sequence of slots). */
static PyObject *Log_claim(LogObject *self, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromUnsignedLongLong(self->next_slot++);
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Store n bytes at offset of the map; 0 on success, -1 (no exception set) when the map is closed or too short. */
static int store(LogObject *log, unsigned long long offset, const void *bytes, size_t n) {
    Py_buffer view;
    if (PyObject_GetBuffer(log->mm, &view, PyBUF_WRITABLE) < 0) {
        PyErr_Clear();
        return -1;
    }
    int ok = offset + n <= (unsigned long long)view.len;
    if (ok)
        memcpy((char *)view.buf + offset, bytes, n);
    PyBuffer_Release(&view);
    return ok ? 0 : -1;
}

/* end(slot): store the end time into the slot's record (the op completed now). */
static PyObject *Log_end(LogObject *self, PyObject *arg) {
    unsigned long long slot = PyLong_AsUnsignedLongLong(arg);
    if (slot == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    double t = now();
    store(self, slot * RECORD_SIZE + END_OFFSET, &t, sizeof t); /* a closed map: tracing never breaks the op */
    Py_RETURN_NONE;
}

/* stop(): recording stopped for good (tracer.py could not allocate more of the file); begin only counts calls. */
static PyObject *Log_stop(LogObject *self, PyObject *Py_UNUSED(ignored)) {
    self->stopped = 1;
    Py_RETURN_NONE;
}

/* One more collective issued after recording stopped: the header's counter, the watch loop's progress. */
static void count_unrecorded(LogObject *log) {
    Py_buffer view;
    if (PyObject_GetBuffer(log->mm, &view, PyBUF_WRITABLE) < 0) {
        PyErr_Clear();
        return;
    }
    if (view.len >= UNRECORDED_OFFSET + 4) {
        uint32_t n;
        memcpy(&n, (char *)view.buf + UNRECORDED_OFFSET, 4);
        n++;
        memcpy((char *)view.buf + UNRECORDED_OFFSET, &n, 4);
    }
    PyBuffer_Release(&view);
}

static PyMethodDef Log_methods[] = {
    {"claim", (PyCFunction)Log_claim, METH_NOARGS, "The next free record slot."},
    {"end", (PyCFunction)Log_end, METH_O, "Store the end time (now) into a slot's record."},
    {"stop", (PyCFunction)Log_stop, METH_NOARGS, "Stop recording: begin() then only counts calls."},
    {NULL}};

TYPE(LogType, "Log", LogObject, Log_init, Log_dealloc, Log_methods);

/* ---- Recorder: one per wrapped function, with that function's cache ---- */

/* The site cache: in front of the sigs dict, one entry per (code, instruction) slot of a small table, holding what
   the call's key held (each argument: a tensor's dtype, shape and is_cuda, else the object itself) and the sig it
   found. A call that matches it needs no key: no list, tuple or ints made, nothing hashed or compared but pointers
   and sizes. Matching is stricter than the key's equality (a non-tensor argument must be the same object, keywords
   the same names in the same order), so a call it does not match takes the key path, which is the rule. Only
   calls of up to SITE_ARGS arguments, positional and keyword, with tensors of up to SITE_DIMS dimensions. A line
   whose calls differ from one to the next (a loop over parameters of several shapes) would pay for the match and
   the refill on top of the key each time (+1.2 µs measured): after SITE_MISSES mismatches the line goes straight to
   the key, as before there was a site cache. */
#define SITE_SLOTS 64
#define SITE_MISSES 2
#define SITE_ARGS 4
#define SITE_DIMS 8

typedef struct {
    PyObject *code;                    /* strong; NULL: an empty slot */
    int lasti;
    int misses;                        /* calls at this line that did not match; SITE_MISSES: the line varies */
    int nargs;                         /* positional */
    int nkw;                           /* keyword, after the positional ones in the arrays below */
    PyObject *name[SITE_ARGS];         /* strong: a keyword argument's name */
    PyObject *arg[SITE_ARGS];          /* strong: a tensor's dtype, else the argument itself */
    PyObject *cuda[SITE_ARGS];         /* borrowed Py_True/Py_False: a tensor's is_cuda on a GPU build, else NULL */
    int ndim[SITE_ARGS];               /* a tensor's dimensions; -1: not a tensor */
    long long dims[SITE_ARGS][SITE_DIMS];
    unsigned long long word;
    long after;
} SiteEntry;

typedef struct {
    PyObject_HEAD
    LogObject *log;
    PyObject *sigs;         /* dict: call key -> (start word, CUDA tensors) */
    PyObject *wrapper_code; /* the code object of tracer.py's wrapper: on the stack, a traced call is running */
    PyObject *nested;       /* what begin returns then: tracer._NESTED */
    /* For call(): the wrapped function, and tracer.py's callbacks for what the common case is not. */
    PyObject *fn;           /* torch's function */
    PyObject *python_path;  /* python_path(args, kwargs, key or None): the Python path, from scratch */
    PyObject *finish;       /* finish(slot, after, result, args, kwargs): an end that is not "now" */
    PyObject *failed;       /* failed(slot, exception): the op raised */
    int funcol;             /* a functional collective: its result is a tensor, its end is finish()'s */
    SiteEntry site[SITE_SLOTS];
} RecorderObject;

static void site_clear(SiteEntry *e) {
    Py_CLEAR(e->code);
    for (int i = 0; i < SITE_ARGS; i++) {
        Py_CLEAR(e->arg[i]);
        Py_CLEAR(e->name[i]);
    }
}

static void Recorder_dealloc(RecorderObject *self) {
    for (int i = 0; i < SITE_SLOTS; i++)
        site_clear(&self->site[i]);
    Py_XDECREF(self->log);
    Py_XDECREF(self->sigs);
    Py_XDECREF(self->wrapper_code);
    Py_XDECREF(self->nested);
    Py_XDECREF(self->fn);
    Py_XDECREF(self->python_path);
    Py_XDECREF(self->finish);
    Py_XDECREF(self->failed);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Recorder(log, sigs, wrapper_code, nested[, fn, python_path, finish, failed, funcol]): call() needs the rest. */
static int Recorder_init(RecorderObject *self, PyObject *args, PyObject *Py_UNUSED(kwds)) {
    PyObject *log, *sigs, *wrapper_code, *nested, *fn = NULL, *python_path = NULL, *finish = NULL, *failed = NULL;
    int funcol = 0;
    if (!PyArg_ParseTuple(args, "O!O!O!O|OOOOp", &LogType, &log, &PyDict_Type, &sigs, &PyCode_Type, &wrapper_code,
                          &nested, &fn, &python_path, &finish, &failed, &funcol))
        return -1;
    Py_XSETREF(self->log, (LogObject *)Py_NewRef(log));
    Py_XSETREF(self->sigs, Py_NewRef(sigs));
    Py_XSETREF(self->wrapper_code, Py_NewRef(wrapper_code));
    Py_XSETREF(self->nested, Py_NewRef(nested));
    Py_XSETREF(self->fn, Py_XNewRef(fn));
    Py_XSETREF(self->python_path, Py_XNewRef(python_path));
    Py_XSETREF(self->finish, Py_XNewRef(finish));
    Py_XSETREF(self->failed, Py_XNewRef(failed));
    self->funcol = funcol;
    return 0;
}

/* A tensor attribute read by its getter, straight: torch's getters (shape, dtype, is_cuda) are getset descriptors
   of its C base class, and PyObject_GetAttr would find the descriptor again on every call (the type's MRO, the
   attribute cache). The getter found is kept while the type's version tag holds (any change to the class gives it a
   new one), and only for a type with the generic attribute lookup, where the getter is what GetAttr would call. */
typedef struct {
    PyTypeObject *type;   /* borrowed: compared only, with its version tag */
    unsigned int version; /* the type's tp_version_tag when found; 0: nothing kept */
    getter get;
    void *closure;
} TensorGetter;

static TensorGetter get_shape, get_dtype, get_is_cuda;

static PyObject *tensor_attr(PyObject *value, PyObject *name, TensorGetter *g) {
    PyTypeObject *type = Py_TYPE(value);
    if (g->version && type == g->type && g->version == type->tp_version_tag
        && PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG))
        return g->get(value, g->closure);
    g->version = 0;
    if (type->tp_getattro == PyObject_GenericGetAttr) {
        PyObject *descr = _PyType_Lookup(type, name); /* borrowed; assigns the type a valid version tag */
        if (descr && Py_IS_TYPE(descr, &PyGetSetDescr_Type) && ((PyGetSetDescrObject *)descr)->d_getset->get
            && PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG)) {
            g->get = ((PyGetSetDescrObject *)descr)->d_getset->get;
            g->closure = ((PyGetSetDescrObject *)descr)->d_getset->closure;
            g->type = type;
            g->version = type->tp_version_tag;
        }
    }
    return PyObject_GetAttr(value, name);
}

/* Append a tensor's key parts to list; 0 on success, -1 with an exception set. */
static int append_tensor(PyObject *list, PyObject *value, int with_device, int nested) {
    PyObject *shape = tensor_attr(value, str_shape, &get_shape);
    if (!shape)
        return -1;
    PyObject *dtype = tensor_attr(value, str_dtype, &get_dtype);
    if (!dtype) {
        Py_DECREF(shape);
        return -1;
    }
    PyObject *cuda = NULL;
    if (with_device) {
        cuda = tensor_attr(value, str_is_cuda, &get_is_cuda);
        if (!cuda) {
            Py_DECREF(shape);
            Py_DECREF(dtype);
            return -1;
        }
    }
    int rc;
    if (nested) {
        PyObject *t = cuda ? PyTuple_Pack(3, shape, dtype, cuda) : PyTuple_Pack(2, shape, dtype);
        rc = t ? PyList_Append(list, t) : -1;
        Py_XDECREF(t);
    } else {
        rc = PyList_Append(list, shape);
        if (rc == 0)
            rc = PyList_Append(list, dtype);
        if (rc == 0 && cuda)
            rc = PyList_Append(list, cuda);
    }
    Py_DECREF(shape);
    Py_DECREF(dtype);
    Py_XDECREF(cuda);
    return rc;
}

/* Clear an error of the tracer's own (an Exception: the Python path then handles the call) and return 0; leave a
   KeyboardInterrupt or SystemExit raised while Python code ran under us (a __torch_function__ mode, say) and
   return -1: it is the user's, and must reach them, as it would from the Python path. */
static int clear_ours(void) {
    if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_Exception))
        return -1;
    PyErr_Clear();
    return 0;
}

/* Whether the Python path's _arg_key(value) is value itself, for a value that is not an exact Tensor (0 with an
   exception set on an error). */
static int keyed_as_itself(RecorderObject *self, PyObject *value) {
    if (PyList_Check(value) || PyTuple_Check(value))
        return 0; /* _arg_key recurses into them */
    int sub = PyObject_IsInstance(value, self->log->tensor);
    return sub == 0; /* a Tensor subclass (Parameter, DTensor): keyed by its metadata, in Python */
}

/* The call's key, or NULL (an exception may be set) when the Python path must build it. */
static PyObject *build_key(RecorderObject *self, PyObject *code_id, PyObject *lasti, PyObject *args,
                           PyObject *kwargs) {
    PyObject *key = PyList_New(0);
    if (!key)
        goto fail;
    if (PyList_Append(key, code_id) < 0 || PyList_Append(key, lasti) < 0)
        goto fail;
    PyTypeObject *tensor = (PyTypeObject *)self->log->tensor;
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *value = PyTuple_GET_ITEM(args, i);
        if (Py_IS_TYPE(value, tensor)) {
            if (append_tensor(key, value, self->log->gpu_build, 0) < 0)
                goto fail;
        } else if (!keyed_as_itself(self, value) || PyList_Append(key, value) < 0) {
            goto fail;
        }
    }
    if (kwargs != Py_None && PyDict_GET_SIZE(kwargs)) {
        PyObject *name, *value;
        Py_ssize_t pos = 0;
        while (PyDict_Next(kwargs, &pos, &name, &value)) {
            if (PyList_Append(key, name) < 0)
                goto fail;
            if (Py_IS_TYPE(value, tensor)) {
                if (append_tensor(key, value, 1, 1) < 0)
                    goto fail;
            } else if (!keyed_as_itself(self, value) || PyList_Append(key, value) < 0) {
                goto fail;
            }
        }
    }
    PyObject *tuple = PyList_AsTuple(key);
    Py_DECREF(key);
    return tuple;
fail:
    Py_XDECREF(key);
    return NULL;
}

/* A tensor's dtype, shape and (on a GPU build) is_cuda, as the key takes them: 0, or -1 with an exception set. */
static int tensor_parts(PyObject *value, int with_device, PyObject **dtype, int *ndim, long long *dims,
                        PyObject **cuda) {
    *dtype = tensor_attr(value, str_dtype, &get_dtype);
    if (!*dtype)
        return -1;
    PyObject *shape = tensor_attr(value, str_shape, &get_shape);
    if (!shape || !PyTuple_Check(shape) || PyTuple_GET_SIZE(shape) > SITE_DIMS) {
        Py_XDECREF(shape);
        Py_CLEAR(*dtype);
        if (!PyErr_Occurred())
            *ndim = -2; /* too many dimensions for the site cache: not an error */
        return PyErr_Occurred() ? -1 : 0;
    }
    *ndim = (int)PyTuple_GET_SIZE(shape);
    for (int d = 0; d < *ndim; d++) {
        dims[d] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, d));
        if (dims[d] == -1 && PyErr_Occurred()) {
            Py_DECREF(shape);
            Py_CLEAR(*dtype);
            return -1;
        }
    }
    Py_DECREF(shape);
    *cuda = NULL;
    if (with_device) {
        PyObject *flag = tensor_attr(value, str_is_cuda, &get_is_cuda);
        if (!flag) {
            Py_CLEAR(*dtype);
            return -1;
        }
        *cuda = flag == Py_True ? Py_True : Py_False; /* immortal enough: the singletons outlive us */
        Py_DECREF(flag);
    }
    return 0;
}

/* One argument against the entry's i-th: 1, 0, or -1 with an exception set. Keyword tensors are keyed with
   is_cuda on every build (as build_key does). */
static int site_item_matches(RecorderObject *self, SiteEntry *e, int i, PyObject *value, int with_device) {
    if (e->ndim[i] < 0)
        return value == e->arg[i];
    if (!Py_IS_TYPE(value, (PyTypeObject *)self->log->tensor))
        return 0;
    PyObject *dtype, *cuda;
    int ndim;
    long long dims[SITE_DIMS];
    if (tensor_parts(value, with_device, &dtype, &ndim, dims, &cuda) < 0)
        return -1;
    int same = dtype == e->arg[i] && ndim == e->ndim[i] && cuda == e->cuda[i]
               && memcmp(dims, e->dims[i], sizeof(long long) * (ndim > 0 ? ndim : 0)) == 0;
    Py_XDECREF(dtype);
    return same;
}

/* Whether the call's arguments are the site entry's: 1, 0, or -1 with an exception set. */
static int site_matches(RecorderObject *self, SiteEntry *e, PyObject *args, PyObject *kwargs) {
    int nkw = kwargs == Py_None ? 0 : (int)PyDict_GET_SIZE(kwargs);
    if (e->nargs != PyTuple_GET_SIZE(args) || e->nkw != nkw)
        return 0;
    for (int i = 0; i < e->nargs; i++) {
        int same = site_item_matches(self, e, i, PyTuple_GET_ITEM(args, i), self->log->gpu_build);
        if (same <= 0)
            return same;
    }
    PyObject *name, *value;
    Py_ssize_t pos = 0;
    for (int i = e->nargs; nkw && PyDict_Next(kwargs, &pos, &name, &value); i++) {
        if (name != e->name[i])
            return 0;
        int same = site_item_matches(self, e, i, value, 1);
        if (same <= 0)
            return same;
    }
    return 1;
}

/* The entry's i-th argument from value: 1 done, 0 not cacheable (the entry stays empty), -1 an exception set. */
static int site_item_fill(RecorderObject *self, SiteEntry *e, int i, PyObject *value, int with_device) {
    if (Py_IS_TYPE(value, (PyTypeObject *)self->log->tensor)) {
        if (tensor_parts(value, with_device, &e->arg[i], &e->ndim[i], e->dims[i], &e->cuda[i]) < 0)
            return -1;
        return e->ndim[i] >= 0;
    }
    e->arg[i] = Py_NewRef(value);
    e->ndim[i] = -1;
    e->cuda[i] = NULL;
    return 1;
}

/* Fill the site entry for a call the sigs dict answered: 0, or -1 with an exception set (the entry stays empty). */
static int site_fill(RecorderObject *self, SiteEntry *e, PyObject *code, int lasti, PyObject *args,
                     PyObject *kwargs, unsigned long long word, long after) {
    int misses = e->code == code && e->lasti == lasti ? e->misses : 0; /* the same line: its misses count on */
    site_clear(e);
    e->misses = misses;
    int n = (int)PyTuple_GET_SIZE(args);
    for (int i = 0; i < n; i++) {
        int done = site_item_fill(self, e, i, PyTuple_GET_ITEM(args, i), self->log->gpu_build);
        if (done <= 0) {
            site_clear(e);
            return done;
        }
    }
    int nkw = 0;
    if (kwargs != Py_None) {
        PyObject *name, *value;
        Py_ssize_t pos = 0;
        while (PyDict_Next(kwargs, &pos, &name, &value)) {
            e->name[n + nkw] = Py_NewRef(name);
            int done = site_item_fill(self, e, n + nkw, value, 1);
            if (done <= 0) {
                site_clear(e);
                return done;
            }
            nkw++;
        }
    }
    e->nargs = n;
    e->nkw = nkw;
    e->lasti = lasti;
    e->word = word;
    e->after = after;
    e->code = Py_NewRef(code); /* last: a slot with a code is complete */
    return 0;
}

/* Store a started record with the sig's word into the next slot: 0 (*slot set), or -1 when the map must grow (or
   is closed): the Python path then claims this slot. */
static int start_record(LogObject *log, unsigned long long word, unsigned long long *slot) {
    unsigned char record[16];
    double t = now();
    memcpy(record, &word, 8); /* little-endian targets only (see the check at module init) */
    memcpy(record + START_TIME_OFFSET, &t, 8);
    if (store(log, log->next_slot * RECORD_SIZE, record, sizeof record) < 0)
        return -1;
    *slot = log->next_slot++;
    return 0;
}

/* What begin_call found for a call. */
enum { BEGUN, NESTED, PYTHON_PATH, RAISED };

/* The common case's first half: find the user's frame, match the call (site cache, else key and sigs dict) and
   store its start. BEGUN: *slot and *after set. NESTED: a traced call is running (do not trace). PYTHON_PATH: the
   Python path takes the call, with *key its key when the cache missed (else NULL). RAISED: a BaseException of the
   user's (Ctrl-C) is set; nothing of ours ever raises (an error of ours is the Python path's). */
static int begin_call(RecorderObject *self, PyObject *args, PyObject *kwargs, unsigned long long *slot, long *after,
                      PyObject **key_out) {
    *key_out = NULL;
    if (self->log->stopped) { /* nothing more reaches the file: the op runs untraced, counted */
        count_unrecorded(self->log);
        return NESTED;
    }
    Frame *frame = caller_frame();
    if (!frame) /* no Python caller (a thread started from C) */
        return clear_ours() < 0 ? RAISED : PYTHON_PATH;
    int how = PYTHON_PATH;
    PyObject *key = NULL, *code_id = NULL, *lasti = NULL;
    PyCodeObject *code = frame_code(frame);
    /* Out to the user's frame, as tracer._user_frame walks: through torch's and distcheck's frames (FSDP2's hooks,
       DTensor), and a traced call on the way means torch runs this op inside it (not traced). */
    for (;;) {
        if ((PyObject *)code == self->wrapper_code) {
            how = NESTED;
            goto done;
        }
        PyObject *internal = PyDict_GetItemWithError(self->log->internal, code->co_filename);
        if (internal == Py_False)
            break;
        if (internal != Py_True) /* a file not classified yet: the Python path does it */
            goto done;
        frame = frame_back(frame);
        if (!frame) /* no user frame at all (a thread of torch's): keyed with no site, as call_keys.call_key does */
            break;
        code = frame_code(frame);
    }
    int at = frame ? frame_lasti(frame) : -1;
    Py_ssize_t nargs = PyTuple_GET_SIZE(args);
    SiteEntry *entry = NULL; /* the site cache's slot for this call, when it can hold it */
    if (frame && nargs + (kwargs == Py_None ? 0 : PyDict_GET_SIZE(kwargs)) <= SITE_ARGS) {
        entry = &self->site[(((uintptr_t)code >> 4) ^ ((uintptr_t)at * 2654435761u)) % SITE_SLOTS];
        if (entry->code == (PyObject *)code && entry->lasti == at) {
            int same = entry->misses < SITE_MISSES ? site_matches(self, entry, args, kwargs) : 0;
            if (same < 0)
                goto done;
            if (same) {
                *after = entry->after;
                if (start_record(self->log, entry->word, slot) == 0)
                    how = BEGUN;
                goto done;
            }
            if (entry->misses >= SITE_MISSES || ++entry->misses >= SITE_MISSES)
                entry = NULL; /* a line whose calls vary: the key, and no refill */
        }
    }
    code_id = frame ? PyLong_FromVoidPtr(code) : PyLong_FromLong(0);
    lasti = PyLong_FromLong(at);
    if (!code_id || !lasti)
        goto done;
    key = build_key(self, code_id, lasti, args, kwargs);
    if (!key)
        goto done;
    PyObject *hit = PyDict_GetItemWithError(self->sigs, key); /* borrowed */
    if (!hit) {
        if (!PyErr_Occurred()) { /* a miss: the Python path describes the call and caches it under this key */
            *key_out = key;
            key = NULL;
        } /* else an unhashable argument */
        goto done;
    }
    if (!PyTuple_Check(hit) || PyTuple_GET_SIZE(hit) != 2)
        goto done;
    unsigned long long word = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(hit, 0));
    *after = PyLong_AsLong(PyTuple_GET_ITEM(hit, 1)); /* AFTER_END, AFTER_EVENT or AFTER_NOTHING */
    if ((word == (unsigned long long)-1 || *after == -1) && PyErr_Occurred())
        goto done;
    if (entry && site_fill(self, entry, (PyObject *)code, at, args, kwargs, word, *after) < 0)
        goto done;
    if (start_record(self->log, word, slot) == 0)
        how = BEGUN;
done:
    Py_XDECREF(key);
    Py_XDECREF(code_id);
    Py_XDECREF(lasti);
    if (clear_ours() < 0) { /* nothing of ours may raise into the user's collective; their Ctrl-C may */
        Py_CLEAR(*key_out);
        return RAISED;
    }
    return how;
}

static int check_args(PyObject *const *argv, Py_ssize_t argc, const char *usage) {
    if (argc != 2 || !PyTuple_Check(argv[0]) || (argv[1] != Py_None && !PyDict_Check(argv[1]))) {
        PyErr_SetString(PyExc_TypeError, usage);
        return -1;
    }
    return 0;
}

/* begin(args, kwargs) -> slot (negative: CUDA tensors) | key (a cache miss) | nested (a traced call is running:
   do not trace) | None (take the Python path). call() is begin, the op and its end in one; begin shows the
   first step on its own (tests/unit/test_tracer.py). */
static PyObject *Recorder_begin(RecorderObject *self, PyObject *const *argv, Py_ssize_t argc) {
    if (check_args(argv, argc, "begin(args: tuple, kwargs: dict)") < 0)
        return NULL;
    unsigned long long slot;
    long after;
    PyObject *key;
    switch (begin_call(self, argv[0], argv[1], &slot, &after, &key)) {
    case BEGUN:
        return PyLong_FromLongLong(after == AFTER_END ? (long long)slot
                                   : after == AFTER_EVENT ? -(long long)slot : -(long long)(slot + OPEN_BIAS));
    case NESTED:
        return Py_NewRef(self->nested);
    case RAISED:
        return NULL;
    default:
        return key ? key : Py_NewRef(Py_None);
    }
}

/* call(args, kwargs) -> what torch's function returns. The whole common case of a traced call in one C call: begin,
   the op, and its end time stored when the op returned None on the CPU. The rest goes to tracer.py: the Python
   path (a miss, anything unusual), finish() (a Work, a functional collective's tensor, a CUDA event, NCCL's ring)
   and failed() (the op raised, and the exception goes on to the caller). */
static PyObject *Recorder_call(RecorderObject *self, PyObject *const *argv, Py_ssize_t argc) {
    if (check_args(argv, argc, "call(args: tuple, kwargs: dict)") < 0)
        return NULL;
    if (!self->fn || !self->python_path || !self->finish || !self->failed) {
        PyErr_SetString(PyExc_TypeError, "call() needs a Recorder made with fn, python_path, finish and failed");
        return NULL;
    }
    PyObject *args = argv[0], *kwargs = argv[1];
    PyObject *kw = kwargs == Py_None || PyDict_GET_SIZE(kwargs) == 0 ? NULL : kwargs;
    unsigned long long slot;
    long after;
    PyObject *key;
    switch (begin_call(self, args, kwargs, &slot, &after, &key)) {
    case BEGUN:
        break;
    case NESTED:
        return PyObject_Call(self->fn, args, kw);
    case RAISED:
        return NULL;
    default: {
        PyObject *result = PyObject_CallFunctionObjArgs(self->python_path, args, kwargs, key ? key : Py_None, NULL);
        Py_XDECREF(key);
        return result;
    }
    }
    PyObject *result = PyObject_Call(self->fn, args, kw);
    if (!result) { /* the op raised: its record ends with the error, and the exception goes on unchanged */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        if (tb && value)
            PyException_SetTraceback(value, tb);
        PyObject *slot_obj = PyLong_FromUnsignedLongLong(slot);
        PyObject *r = slot_obj ? PyObject_CallFunctionObjArgs(self->failed, slot_obj, value ? value : Py_None, NULL)
                               : NULL;
        Py_XDECREF(r);
        Py_XDECREF(slot_obj);
        PyErr_Clear(); /* failed() never raises; if it did, the op's exception is the one to see */
        PyErr_Restore(type, value, tb);
        return NULL;
    }
    if (result == Py_None && !self->funcol) {
        if (after == AFTER_END) { /* a CPU collective's hot path: its end is now */
            double t = now();
            store(self->log, slot * RECORD_SIZE + END_OFFSET, &t, sizeof t); /* a closed map: never breaks the op */
            return result;
        }
        if (after == AFTER_NOTHING) /* NCCL's ring gives the end: the record stays open */
            return result;
    }
    PyObject *slot_obj = PyLong_FromUnsignedLongLong(slot);
    PyObject *after_obj = PyLong_FromLong(after);
    PyObject *r = slot_obj && after_obj
                      ? PyObject_CallFunctionObjArgs(self->finish, slot_obj, after_obj, result, args, kwargs, NULL)
                      : NULL;
    Py_XDECREF(slot_obj);
    Py_XDECREF(after_obj);
    if (!r) { /* finish() keeps its own errors; what comes out is the user's Ctrl-C, as in the Python path */
        Py_DECREF(result);
        return NULL;
    }
    Py_DECREF(r);
    return result;
}

static PyMethodDef Recorder_methods[] = {
    {"begin", (PyCFunction)(void (*)(void))Recorder_begin, METH_FASTCALL,
     "begin(args, kwargs): slot | key | None (see the module's docstring)."},
    {"call", (PyCFunction)(void (*)(void))Recorder_call, METH_FASTCALL,
     "call(args, kwargs): the traced call's result (see the module's docstring)."},
    {NULL}};

TYPE(RecorderType, "Recorder", RecorderObject, Recorder_init, Recorder_dealloc, Recorder_methods);

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_tracefast", .m_doc = "The tracer's hot path in C.", .m_size = -1};

PyMODINIT_FUNC PyInit__tracefast(void) {
    const uint16_t probe = 1;
    if (*(const unsigned char *)&probe != 1) {
        PyErr_SetString(PyExc_ImportError, "the tracer's C path stores little-endian records only");
        return NULL;
    }
    str_shape = PyUnicode_InternFromString("shape");
    str_dtype = PyUnicode_InternFromString("dtype");
    str_is_cuda = PyUnicode_InternFromString("is_cuda");
    if (!str_shape || !str_dtype || !str_is_cuda)
        return NULL;
#ifndef INTERNAL_FRAMES
    getframe = PySys_GetObject("_getframe"); /* borrowed */
    one = PyLong_FromLong(1);
    if (!getframe || !one)
        return NULL;
    Py_INCREF(getframe);
#endif
    if (PyType_Ready(&LogType) < 0 || PyType_Ready(&RecorderType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&LogType);
    Py_INCREF(&RecorderType);
    if (PyModule_AddObject(m, "Log", (PyObject *)&LogType) < 0 ||
        PyModule_AddObject(m, "Recorder", (PyObject *)&RecorderType) < 0 ||
        PyModule_AddIntConstant(m, "RECORD_SIZE", RECORD_SIZE) < 0 ||
        PyModule_AddIntConstant(m, "START_TIME_OFFSET", START_TIME_OFFSET) < 0 ||
        PyModule_AddIntConstant(m, "AFTER_NOTHING", AFTER_NOTHING) < 0 ||
        PyModule_AddIntConstant(m, "OPEN_BIAS", OPEN_BIAS) < 0 ||
        PyModule_AddIntConstant(m, "END_OFFSET", END_OFFSET) < 0 ||
        PyModule_AddIntConstant(m, "UNRECORDED_OFFSET", UNRECORDED_OFFSET) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
